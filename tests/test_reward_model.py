"""Learned rewards (`model:PATH`, gspo.rewards.model.RewardModel) and batched reward functions (`batched`).

The reward model here is built so that its score is known exactly: its layers' outputs are zeroed, so the last
position's hidden state is that token's embedding, and the embeddings and score head make the output 1 when the
conversation's last token is a digit and 0 otherwise. Any mistake in how a batch is padded, which position is read,
what is truncated or which text is scored shows up as a wrong number.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen3Config, Qwen3ForSequenceClassification

from conftest import DEMO, tiny_overrides
from gspo.cli import main
from gspo.config import RewardConfig, load_config
from gspo.models import build_preset, build_tokenizer
from gspo.rewards import RewardFailure, RewardModel, RewardRunner, batched, check_signature
from gspo.tracking import read_metrics
from gspo.trainer import train

DIGITS = "0123456789"


def save_reward_model(folder: Path, *, known: bool = True, chat_template: bool = False, num_labels: int = 1,
                      seed: int = 0, config_pad: int = 0) -> Path:
    """A one-layer Qwen3 sequence classifier with the presets' character tokenizer, saved to `folder`. `known`:
    scores 1.0 when the last token is a digit, else 0.0 (see the module docstring); otherwise random weights.
    `chat_template`: keep the tokenizer's template (`role: content; `) or drop it. `config_pad`: the config's
    pad_token_id (the tokenizer's is 0)."""
    tokenizer = build_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=256,
                         pad_token_id=config_pad, eos_token_id=1, bos_token_id=None, num_labels=num_labels,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(config)
    if known:
        with torch.no_grad():
            for layer in model.model.layers:  # the residual stream is the token's embedding
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            embeddings = model.model.embed_tokens.weight
            embeddings.zero_()
            embeddings[:, 1] = 1.0
            for ch in DIGITS:
                embeddings[tokenizer.convert_tokens_to_ids(ch)] = torch.eye(config.hidden_size)[0]
            model.model.norm.weight.fill_(1.0)  # RMSNorm of a one-hot vector: sqrt(1 / (1/H + eps)) on that axis
            model.score.weight.zero_()
            model.score.weight[0, 0] = (1.0 / config.hidden_size + config.rms_norm_eps) ** 0.5
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ends_in_digit(text: str) -> float:
    return float(text[-1:] in DIGITS and text != "")


@pytest.fixture(scope="module")
def digit_rm(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("digit_rm"))


# ------------------------------------------------------------------------------------------------- the reward model


def test_each_score_is_the_models_output_at_its_conversations_last_token(digit_rm):
    rm = RewardModel(str(digit_rm), batch_size=3)  # 7 conversations of 5 to 17 tokens: 3 padded batches
    completions = ["5", "abc", "12a", "x9", "", "7" * 13, "a b c d e f 1"]
    prompts = ["2+3="] * len(completions)
    expected = [ends_in_digit(p + c) for p, c in zip(prompts, completions, strict=True)]
    assert expected == [1, 0, 0, 1, 0, 1, 1]
    assert rm(prompts, completions) == pytest.approx(expected, abs=1e-5)
    assert [rm([p], [c])[0] for p, c in zip(prompts, completions, strict=True)] == pytest.approx(expected, abs=1e-5)


def test_a_random_reward_model_scores_the_same_batched_as_one_by_one(tmp_path):
    rm = RewardModel(str(save_reward_model(tmp_path, known=False)), batch_size=4)
    completions = ["1", "22 and more", "333", "", "a much longer completion 4444", "5"]
    batch = rm(["9+9="] * 6, completions)
    single = [rm(["9+9="], [c])[0] for c in completions]
    assert batch == pytest.approx(single, abs=1e-5)
    assert len(set(np.round(batch, 4))) == 6  # the random head tells them apart: a constant would pass the above


def test_a_config_pad_id_other_than_the_tokenizers_does_not_move_where_padded_rows_are_read(tmp_path, caplog):
    # The model reads the last token that is not config.pad_token_id; batches are padded with the tokenizer's id (0).
    # With the config saying 2, every padded row was scored at its padding (only the longest row was right).
    rm = RewardModel(str(save_reward_model(tmp_path, known=False, config_pad=2)), batch_size=4)
    assert "differs from its tokenizer's pad token id" in caplog.text
    completions = ["1", "22 and more", "333", "a much longer completion 4444"]
    batch = rm(["9+9="] * 4, completions)
    assert batch == pytest.approx([rm(["9+9="], [c])[0] for c in completions], abs=1e-5)


def test_it_scores_the_rows_conversation_in_the_reward_models_own_chat_template(tmp_path):
    rm = RewardModel(str(save_reward_model(tmp_path, known=False, chat_template=True)))
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    texts = rm.texts(["1+1=", "policy-rendered 2+2="], ["2", "4"], [None, conversation])
    assert texts == ["user: 1+1=; assistant: 2; ", "system: be brief; user: 2+2=; assistant: 4; "]
    runner = RewardRunner({f"model:{tmp_path}": 1.0}, timeout_s=None)
    rows = [{"prompt": "1+1="}, {"prompt": "policy-rendered 2+2=", "messages": conversation}]
    total, _ = runner(["1+1=", "policy-rendered 2+2="], ["2", "4"], rows)
    direct = [rm.model(**rm.tokenizer(t, return_tensors="pt", add_special_tokens=False).to(rm.model.device))
              .logits[0, 0].item()
              for t in texts]
    assert total.tolist() == pytest.approx(direct, abs=1e-5)


def test_a_long_conversation_loses_its_start_not_its_completion(digit_rm, caplog):
    rm = RewardModel(str(digit_rm), max_length=5)
    assert rm(["a" * 50, "1+1="], ["x3", "b"]) == pytest.approx([1.0, 0.0], abs=1e-5)
    assert rm.truncated == 1 and "lost their start" in caplog.text


def test_a_causal_lm_folder_is_refused_not_given_a_random_head(tmp_path):
    model, tokenizer = build_preset("tiny-dense")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"not a reward model: .*score\.weight.*Qwen3ForCausalLM"):
        RewardModel(str(tmp_path))


def test_a_classifier_with_two_outputs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has 2 outputs"):
        RewardModel(str(save_reward_model(tmp_path, num_labels=2)))


@pytest.mark.parametrize("options, match", [({"batch_size": 0}, "batch_size"), ({"max_length": 1}, "max_length"),
                                            ({"dtype": "int8"}, "dtype"),
                                            ({"max_length": 257}, "beyond the model's position limit \\(256")])
def test_bad_options_are_refused_by_name(digit_rm, options, match):
    with pytest.raises(ValueError, match=match):
        RewardModel(str(digit_rm), **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_gpu_is_a_clear_error(digit_rm):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        RewardModel(str(digit_rm), device="cuda")


def test_a_missing_folder_is_an_error_naming_the_spec(tmp_path):
    with pytest.raises(ValueError, match=r"reward 'model:.*nope'.*does not exist"):
        RewardRunner({f"model:{tmp_path / 'nope'}": 1.0})


def test_accuracy_by_a_reward_model_needs_an_explicit_threshold(digit_rm, capsys):
    """1.0 means solved for a verifier, but is an arbitrary line on a learned score: a run (or gspo eval) whose
    accuracy a reward model decides must say where the line is, or name a verifier."""
    spec = f"model:{digit_rm}"
    with pytest.raises(ValidationError, match=r"arbitrary line for a learned score.*rewards\.accuracy_threshold"):
        RewardConfig(functions={spec: 1.0})
    with pytest.raises(ValidationError, match="arbitrary line"):
        RewardConfig(functions={spec: 1.0, "math": 1.0}, accuracy_reward=spec)
    assert RewardConfig(functions={spec: 1.0}, accuracy_threshold=0.8).accuracy_reward == spec
    assert RewardConfig(functions={spec: 1.0, "math": 1.0}).accuracy_reward == "math"  # the verifier decides
    assert main(["eval", "tiny-dense", "--task", "addition", "--size", "4", "--reward", spec]) == 2
    assert "--accuracy-threshold" in capsys.readouterr().err


def test_the_config_refuses_a_model_spec_without_a_path_and_bad_options():
    with pytest.raises(ValidationError, match="names no reward model"):
        RewardConfig(functions={"model: ": 1.0})
    with pytest.raises(ValidationError, match="batch_size"):
        RewardConfig(functions={"addition": 1.0}, reward_model={"batch_size": 0})


# ------------------------------------------------------------------------------------------------ batched rewards


def test_a_trl_style_batched_reward_is_called_once_with_the_columns():
    calls = []

    @batched
    def exact(prompts, completions, answer, **columns):
        calls.append((list(prompts), list(completions), list(answer), sorted(columns)))
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    rows = [{"prompt": "1+1=", "answer": "2", "k": 0}, {"prompt": "2+2=", "answer": "4", "k": 1},
            {"prompt": "3+3=", "answer": "6"}]
    total, stats = RewardRunner([(exact, 1.0)], timeout_s=None)([r["prompt"] for r in rows], ["2", "5", "6"], rows)
    assert total.tolist() == [1.0, 0.0, 1.0] and stats["reward_failures"] == 0
    assert calls == [(["1+1=", "2+2=", "3+3="], ["2", "5", "6"], ["2", "4", "6"], ["k"])]


def test_trls_own_reward_examples_work_as_batched_rewards():
    """TRL calls reward functions by keyword (`reward_func(prompts=..., completions=..., **columns)`): its documented
    examples take only what they need. Called positionally they were refused ('too many positional arguments'), or,
    with a column named second, scored the prompts as completions."""
    @batched
    def reward_len(completions, **kwargs):  # TRL's docs, "Using a custom reward function"
        return [-abs(3 - len(completion)) for completion in completions]

    @batched
    def reward_func(completions, ground_truth, **kwargs):
        return [1.0 if c == gt else 0.0 for c, gt in zip(completions, ground_truth, strict=True)]

    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "44"}]
    for fn in (reward_len, reward_func):
        check_signature(fn, fn.__name__, rows[0])
    total, stats = RewardRunner([(reward_len, 1.0), (reward_func, 10.0)], timeout_s=None)(
        [r["prompt"] for r in rows], ["2", "4444"], rows)
    assert total.tolist() == [-2.0 + 10.0, -1.0] and stats["reward_failures"] == 0


@pytest.mark.parametrize("returned, failed_rows", [
    ([1.0, None, 2.0], [1]),  # a None or NaN value fails its row only
    ([1.0, float("nan"), 2.0], [1]),
    (torch.tensor([1.0, 0.5, 2.0]), []),  # tensors and arrays are sequences of numbers
    (np.array([1.0, 0.5, 2.0]), []),
    ([1.0, 2.0], [0, 1, 2]),  # the wrong count, a non-sequence, or raising fails every row
    ("abc", [0, 1, 2]),
    (3.0, [0, 1, 2]),
    (RuntimeError("judge down"), [0, 1, 2]),
])
def test_a_batched_reward_fails_per_row_or_for_the_whole_batch(returned, failed_rows):
    @batched
    def judge(prompts, completions, **columns):
        if isinstance(returned, Exception):
            raise returned
        return returned

    runner = RewardRunner([(judge, 1.0)], on_error="zero", timeout_s=None)
    scores = runner.score(["p"] * 3, ["a", "b", "c"], [{"prompt": "p"}] * 3)
    assert torch.nonzero(scores.failed["judge"]).flatten().tolist() == failed_rows
    assert runner.failures == {"judge": len(failed_rows)}
    if not failed_rows:
        assert scores.total.tolist() == [1.0, 0.5, 2.0]
    with pytest.raises(RewardFailure, match="judge") if failed_rows else contextlib.nullcontext():
        RewardRunner([(judge, 1.0)], on_error="fail", timeout_s=None)(["p"] * 3, ["a", "b", "c"], [{"prompt": "p"}] * 3)


def test_a_batched_reward_past_the_deadline_times_out_every_row():
    @batched
    def slow(prompts, completions, **columns):
        time.sleep(1.0)
        return [1.0] * len(completions)

    runner = RewardRunner([(slow, 1.0), ("addition", 1.0)], on_error="zero", timeout_s=0.2, workers=2)
    scores = runner.score(["1+1="] * 2, ["2", "3"], [{"prompt": "1+1=", "answer": "2"}] * 2)
    assert runner.timeouts == {"slow": 2, "addition": 0} and scores.total.tolist() == [1.0, 0.0]


def test_a_reward_model_runs_in_the_calling_thread_and_functions_in_the_pool(digit_rm, monkeypatch):
    threads = {}
    rm_call = RewardModel.__call__

    def spy_rm(self, *args, **kwargs):
        threads["model"] = threading.current_thread()
        return rm_call(self, *args, **kwargs)

    def spy_fn(prompt, completion, **row):
        threads["function"] = threading.current_thread()
        return 0.0

    monkeypatch.setattr(RewardModel, "__call__", spy_rm)
    runner = RewardRunner([(f"model:{digit_rm}", 1.0), (spy_fn, 1.0)], timeout_s=5)
    assert runner(["1+1="], ["2"], [{"prompt": "1+1="}])[0].tolist() == pytest.approx([1.0], abs=1e-5)
    assert threads["model"] is threading.current_thread() and threads["function"].name == "gspo-reward"


def test_the_signature_check_of_a_batched_reward_shows_the_batched_signature():
    @batched
    def strict(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"batched reward 'strict'.*prompts: list\[str\]"):
        check_signature(strict, "strict", {"prompt": "p", "answer": "a"})


# ------------------------------------------------------------------------------------------- training and evaluation


def test_gspo_against_a_reward_model_raises_its_score(tmp_path, digit_rm):
    """An untrained policy ends few held-out completions in a digit; 10 GSPO steps against the reward model make it
    end nearly all of them so: the reward model's scores reach the update (held-out "accuracy" here = score >= 1)."""
    spec = f"model:{digit_rm}"
    cfg = load_config(DEMO, tiny_overrides(
        tmp_path, "cold_start=null", "model.name=tiny-dense", f"rewards.functions={{{spec}: 1.0}}",
        "rewards.accuracy_threshold=1.0",
        "trainer.steps=10", "trainer.eval_every=10", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "data.eval_size=64", "optim.lr=1e-3", "optim.warmup_steps=0"))
    summary = train(cfg)
    assert summary["heldout_accuracy_before_rl"] <= 0.25 and summary["heldout_accuracy_after_rl"] >= 0.8
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 10


def test_async_rollout_workers_score_with_the_reward_model(tmp_path, digit_rm):
    spec = f"model:{digit_rm}"
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "rollout.mode=async", "trainer.steps=3", "cold_start.steps=2",
                                           "trainer.eval_every=0", f"rewards.functions={{{spec}: 1.0}}",
                                           "rewards.accuracy_threshold=0.5"))
    train(cfg)
    assert all(0 <= m[f"reward/{spec}"] <= 1 for m in read_metrics(tmp_path / "metrics.jsonl"))


def test_gspo_eval_scores_with_a_reward_model(digit_rm, capsys):
    import json

    assert main(["eval", "tiny-dense", "--task", "addition", "--size", "8", "--max-new-tokens", "3",
                 "--reward", f"model:{digit_rm}", "--accuracy-threshold", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["rows"] == 8 and result["reward_failures"] == {f"model:{digit_rm}": 0}
    assert result["accuracy"] == pytest.approx(result["reward_mean"], abs=1e-5)  # scores are 0 or 1 here


def test_a_bare_cuda_device_under_torchrun_is_the_processs_own_gpu(monkeypatch):
    """rewards.reward_model.device: cuda under torchrun is GPU LOCAL_RANK (modulo the GPUs seen): the current CUDA
    device of a process that trains on the CPU is GPU 0, where every process's reward model would have gone. An
    explicit index, the CPU, and a run without torchrun are left as they are."""
    from gspo.rewards.model import process_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert process_device("cuda") == torch.device("cuda")
    for local_rank, want in (("0", "cuda:0"), ("1", "cuda:1"), ("3", "cuda:1")):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert process_device("cuda") == torch.device(want), local_rank
    assert process_device("cuda:0") == torch.device("cuda:0") and process_device("cpu") == torch.device("cpu")


def test_truncation_is_counted_over_calls_warned_once_and_defaults_to_the_models_position_limit(digit_rm, caplog):
    """Without max_length a conversation is cut to the model's position limit (256 here: positions beyond it give a
    silently wrong score), keeping its end; `truncated` counts the cut conversations over the model's life (every
    call adds), and the warning is given once, not every step."""
    rm = RewardModel(str(digit_rm))
    assert rm.max_length == 256
    for _ in range(2):
        assert rm(["a" * 400, "1+1="], ["x3", "b"]) == pytest.approx([1.0, 0.0], abs=1e-5)
    assert rm.truncated == 2
    assert sum("lost their start" in r.getMessage() for r in caplog.records) == 1


def test_an_explicit_reward_model_device_is_kept_and_auto_follows_the_trainer():
    """rewards.reward_model.device: auto (or unset) means the trainer's device; an explicit one is the user's choice
    (a reward model on its own GPU, or on the CPU) and is kept."""
    from gspo.rewards.model import reward_model_options

    assert reward_model_options({"device": "cpu", "batch_size": 2}, "cuda:1") == {"device": "cpu", "batch_size": 2}
    assert reward_model_options({"device": "auto"}, "cuda:1") == {"device": "cuda:1"}
    assert reward_model_options(None, "cuda:1") == {"device": "cuda:1"}
    assert reward_model_options({"device": "auto"}, None) == {"device": "auto"}

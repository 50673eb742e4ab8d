"""Scaling-out pieces that need neither vLLM nor several processes: the Qwen3 recipes validate, the vLLM settings are
checked, GSM8K preparation, and the vLLM engines' pure parts (batch layout, routing layout, weights out)."""

from __future__ import annotations

import http.server
import importlib.util
import json
import socket
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from conftest import DEMO, tiny_overrides
from gspo.config import ConfigError, load_config
from gspo.data import load_rows
from gspo.models import build_preset, build_tokenizer
from gspo.moe import FREE
from gspo.parallel import ProcessGroup
from gspo.preflight import check
from gspo.rewards import math_reward
from gspo.rollout import HFSampler, make_engine
from gspo.rollout.assemble import Sample, assemble, place_routing
from gspo.rollout.weights import checkpoint_layout, policy_weights, write_safetensors
from gspo.trainer import train
from gspo.trajectory import NO_VERSION

ROOT = Path(__file__).parent.parent
RECIPES = {"qwen3-0.6b-gsm8k.yaml": ("vllm", "ddp", 8), "qwen3-30b-a3b.yaml": ("vllm_server", "fsdp", 16)}


def prepare_gsm8k():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", ROOT / "scripts" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_validate(name):
    """The GPU recipes are valid configs (nothing is loaded), and their batches split over the processes they
    document: whole groups per process, equal minibatch shares."""
    engine, parallel, processes = RECIPES[name]
    cfg = load_config(ROOT / "configs" / name)
    assert (cfg.rollout.engine, cfg.trainer.parallel) == (engine, parallel)
    assert cfg.model.name.startswith("Qwen/Qwen3-")
    assert cfg.data.fields == {"prompt": "chat_prompt", "answer": "final_answer"}  # scripts/prepare_gsm8k.py columns
    assert cfg.rewards.functions == {"math": 1.0}
    ProcessGroup(world_size=processes).check_sizes(cfg.rollout.prompts_per_step, cfg.rollout.group_size,
                                           cfg.algorithm.minibatches)


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine=vllm_server"], "needs rollout.vllm.server_url"),
    (["rollout.engine=vllm", "rollout.vllm.server_url=http://h:8000"], "are for rollout.engine=vllm_server"),
    (["rollout.engine=vllm_server", "rollout.vllm.server_url=h:8000"], "must look like http://host:port"),
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], "gpu_memory_utilization"),
    (["rollout.vllm.bogus=1"], "rollout.vllm.bogus"),
    (["rollout.engine=vllm", "rollout.vllm.max_model_len=64"], "set data.max_prompt_tokens to at most 58"),
    (["rollout.engine=vllm", "rollout.vllm.max_model_len=64", "data.max_prompt_tokens=60"], "at most 58"),
    (["trainer.parallel=zero3"], "trainer.parallel"),
    (["trainer.mixed_precision=float8"], "trainer.mixed_precision"),
    (["trainer.parallel=fsdp", "model.dtype=bfloat16", "trainer.mixed_precision=bfloat16"], "model.dtype=float32"),
])
def test_scaling_settings_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_engine_factory_builds_the_hf_engine(tmp_path):
    cfg = load_config(DEMO, tiny_overrides(tmp_path))
    model, tokenizer = build_preset("tiny-moe")
    engine = make_engine(cfg, model, tokenizer, out=tmp_path)
    assert isinstance(engine, HFSampler) and engine.model is model and engine.shares_weights
    assert engine.params.max_new_tokens == cfg.rollout.max_new_tokens and engine.version == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_vllm_engine_without_vllm_is_refused_at_the_start_not_after_the_cold_start(tmp_path):
    """Before, the missing package surfaced when the engine was built: after the cold start's SFT."""
    with pytest.raises(ConfigError, match=r"rollout\.engine=vllm needs vLLM"):
        train(load_config(DEMO, tiny_overrides(tmp_path / "run", "rollout.engine=vllm")))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_vllm_server_that_does_not_answer_is_refused_at_the_start(tmp_path):
    """A vllm_server run probes each server (GET /v1/models) before anything is computed; one that answers passes."""
    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    server = ["rollout.engine=vllm_server", f"rollout.vllm.server_url=http://127.0.0.1:{closed}"]
    with pytest.raises(ConfigError, match=rf"server_url: vLLM server at http://127\.0\.0\.1:{closed} is not reachable"):
        train(load_config(DEMO, tiny_overrides(tmp_path / "run", *server)))
    assert not (tmp_path / "run" / "config.yaml").exists()

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": "m", "max_model_len": 256}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        report = check(load_config(DEMO, tiny_overrides(tmp_path / "run", server[0],
                                                        f"rollout.vllm.server_url={url}")))
        httpd.shutdown()
    assert report["plan"]["steps"] == 3


# ------------------------------------------------------------------------------------------------------- GSM8K


GSM8K = {
    "question": "  Natalia sold clips to 48 of her friends, and then she sold half as many. How many? ",
    "answer": "She sold 48/2 = <<48/2=24>>24 more.\nIn all 48+24 = <<48+24=72>>72 clips, worth $1,072.\n#### 1,072",
}


def test_gsm8k_rows_have_the_final_answer_and_a_chat_prompt():
    row = prepare_gsm8k().gsm8k_row(GSM8K)
    assert row["final_answer"] == "1072"
    assert "<<" not in row["rationale"] and "####" not in row["rationale"]
    # the prompt is a conversation, rendered at training time with the model's own chat template (gspo.data.chat)
    [message] = row["chat_prompt"]
    assert message["role"] == "user" and message["content"].startswith("Natalia sold clips")
    question = message["content"]
    assert math_reward(question, "... so the total is \\boxed{1072}.", answer=row["final_answer"]) == 1.0
    assert math_reward(question, "\\boxed{1071}", answer=row["final_answer"]) == 0.0
    assert math_reward(question, row["rationale"], answer=row["final_answer"]) == 1.0
    with pytest.raises(ValueError, match="####"):
        prepare_gsm8k().gsm8k_row({"question": "q", "answer": "no final answer"})


def test_prepared_gsm8k_loads_with_the_recipe_field_mapping(tmp_path):
    import datasets

    source = datasets.DatasetDict({split: datasets.Dataset.from_list([GSM8K] * n)
                                   for split, n in (("train", 3), ("test", 2))})
    assert prepare_gsm8k().prepare(source, str(tmp_path / "gsm8k")) == {"train": 3, "test": 2}
    fields = load_config(ROOT / "configs" / "qwen3-0.6b-gsm8k.yaml").data.fields
    rows = load_rows(str(tmp_path / "gsm8k"), split="test", fields=fields)
    assert len(rows) == 2 and rows[0]["answer"] == "1072"
    assert rows[0]["prompt"][0]["role"] == "user" and rows[0]["prompt"][0]["content"].startswith("Natalia")


# --------------------------------------------------------------------------------------- vLLM engines, pure parts


TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id


@st.composite
def samples(draw):
    group = draw(st.integers(1, 3))
    prompts = [draw(st.lists(st.integers(3, 40), min_size=1, max_size=5)) for _ in range(draw(st.integers(1, 3)))]
    out = []
    for prompt in prompts:
        for _ in range(group):
            tokens = draw(st.lists(st.integers(3, 40), min_size=1, max_size=6))
            ends = draw(st.booleans())
            tokens = [*tokens, EOS] if ends else tokens
            logprobs = [-draw(st.floats(0.01, 5)) for _ in tokens]
            routing = torch.randint(0, 8, (len(prompt) + len(tokens) - 1, 2, 2))
            out.append(Sample(prompt, tokens, logprobs, truncated=not ends, routing=routing))
    return group, out


@settings(max_examples=40, deadline=None)
@given(samples())
def test_engine_samples_are_laid_out_as_a_rollout_batch(drawn):
    """Left-padded prompts, right-padded completions, logprobs on real tokens only, text without the EOS, group
    order kept, and the routed experts of each prompt and fed-back token at their training-forward positions."""
    group, items = drawn
    batch = assemble(items, group, TOKENIZER, 0, [EOS], version=7, with_routing=True)
    s = batch.prompt_ids.shape[1]
    assert torch.equal(batch.prompt_index, torch.arange(len(items) // group).repeat_interleave(group))
    for i, item in enumerate(items):
        p, c = len(item.prompt), len(item.tokens)
        assert batch.prompt_ids[i, s - p:].tolist() == item.prompt and batch.prompt_mask[i].sum() == p
        assert batch.completion_ids[i, :c].tolist() == item.tokens and batch.completion_mask[i].sum() == c
        assert batch.logprobs[i, :c].tolist() == pytest.approx(item.logprobs) and not batch.logprobs[i, c:].any()
        assert (batch.versions[i, :c] == 7).all() and (batch.versions[i, c:] == NO_VERSION).all()
        text_tokens = item.tokens[:-1] if item.tokens[-1] == EOS else item.tokens
        assert batch.completions[i] == TOKENIZER.decode(text_tokens) and bool(batch.truncated[i]) == item.truncated
        r = batch.extras["routing"][i]
        assert torch.equal(r[s - p:s + c - 1].long(), item.routing.long())
        assert (r[:s - p] == FREE).all() and (r[s + c - 1:] == FREE).all()


def test_a_sample_that_ends_with_eos_is_not_truncated_whatever_the_engine_said():
    """vLLM releases that checked the length limit before EOS reported finish_reason "length" for an EOS sampled
    exactly at max_tokens: such a completion finished, and overlong_filter must not drop it."""
    eos = TOKENIZER.eos_token_id
    samples = [Sample([5, 6], [7, eos], [-1.0, -1.0], truncated=True), Sample([5, 6], [7, 8], [-1.0, -1.0],
                                                                              truncated=True)]
    batch = assemble(samples, 2, TOKENIZER, pad=0, eos=[eos])
    assert batch.truncated.tolist() == [False, True]


def test_routing_of_the_wrong_length_is_refused():
    bad = Sample([5, 6], [7, 8], [-1.0, -1.0], truncated=True, routing=torch.zeros(4, 2, 2))  # needs 2 + 2 - 1 rows
    with pytest.raises(ValueError, match="expected \\(3, 2, 2\\)"):
        place_routing([bad], prompt_len=2, width=2)


def test_checkpoint_weights_are_what_save_pretrained_writes(tmp_path):
    """The pushed tensors are the saved checkpoint's (names and values; fused MoE experts split back per expert),
    plus the tied output head, which vLLM's in-place reload needs to receive."""
    model, _ = build_preset("tiny-moe")
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    pushed = dict(checkpoint_layout(model)(policy_weights(model)))
    assert pushed.keys() == saved.keys() | {"lm_head.weight"}
    assert all(torch.equal(pushed[k], saved[k]) for k in saved)
    assert torch.equal(pushed["lm_head.weight"], pushed["model.embed_tokens.weight"])
    assert all(t.is_contiguous() for t in pushed.values())
    half = dict(checkpoint_layout(model)(policy_weights(model), torch.bfloat16))
    assert {t.dtype for t in half.values()} == {torch.bfloat16}


def test_weights_are_written_in_bounded_shards_including_tied_copies(tmp_path):
    model, _ = build_preset("tiny-dense")
    weights = dict(checkpoint_layout(model)(policy_weights(model)))
    files = write_safetensors(policy_weights(model), tmp_path, shard_bytes=1 << 20)
    assert len(files) > 1 and not list(tmp_path.glob("*.tmp"))
    back = {}
    for f in files:
        back.update(load_file(f))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)

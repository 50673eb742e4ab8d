"""The GSPO training recipe end to end on the tiny MoE (seconds per run): what a run writes, exact resume after an
interruption, run-folder safety, π_old modes, every objective, reward failures and the KL term."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    DEMO,
    SimulatedCrash,
    crash_after,
    record_objective,
    safetensors_of,
    sampler_autocasts,
    tiny_overrides,
    varied_reward,
)
from gspo.advantages import group_advantages
from gspo.checkpoint import checkpoint_path, find_latest_checkpoint
from gspo.config import ConfigError, load_config
from gspo.data import load_data, make_task
from gspo.models import load_model
from gspo.rewards import RewardFailure, addition_reward
from gspo.schedule import step_prompts
from gspo.sft import sft
from gspo.tracking import read_metrics
from gspo.trainer import train

pytestmark = pytest.mark.usefixtures("test_rewards")

REQUIRED = ("step", "reward_mean", "clip_frac_tokens", "clip_frac_seqs", "ratio_mean", "approx_kl", "entropy",
            "grad_norm", "tokens_per_second", "time_rollout", "time_update")

# Four RL steps with a varied reward (non-zero advantages, so the updates really change the weights), checkpoints
# every 2 steps, evaluation every 2 steps; on the CPU even on a GPU machine, because the resumed run must equal the
# uninterrupted one bit for bit (see conftest.DEVICE). The other tests train on conftest.DEVICE (tiny_overrides).
RUN = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3",
       "rewards.functions={addition: 1.0, varied: 0.5}", "trainer.device=cpu", "log.rollouts=6"]


def cfg_for(out: Path, *extra: str):
    return load_config(DEMO, tiny_overrides(out, *extra))


def finite_or_null(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and math.isfinite(value))


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, test_rewards):
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("run_a")
    summary = train(cfg_for(out, *RUN))
    return out, summary


@pytest.fixture(scope="module")
def run_b(tmp_path_factory, test_rewards):
    """The same run, interrupted right after step 3 (its last checkpoint is step 2), then resumed."""
    out = tmp_path_factory.mktemp("run_b")
    cfg = cfg_for(out, *RUN)
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(3)])
    state = {
        "final_exists": (out / "final").exists(),
        "summary_exists": (out / "summary.json").exists(),
        "steps_logged": [r["step"] for r in read_metrics(out / "metrics.jsonl")],
        "latest_checkpoint": find_latest_checkpoint(out),
    }
    t0 = time.perf_counter()
    summary = train(cfg, resume=True)
    state["resume_seconds"] = time.perf_counter() - t0
    return out, summary, state


# ------------------------------------------------------------------------------------------------ what a run writes


def test_metrics_jsonl_has_one_complete_record_per_step(run_a):
    out, _ = run_a
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        missing = [key for key in REQUIRED if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        bad = {key: v for key, v in record.items() if not finite_or_null(v)}
        assert not bad, f"step {record['step']}: non-finite or non-numeric values {bad}"
        assert 0 <= record["clip_frac_tokens"] <= 1 and 0 <= record["clip_frac_seqs"] <= 1
        assert record["entropy"] >= 0 and record["approx_kl"] >= 0
        assert record["tokens_per_second"] > 0 and record["time_rollout"] > 0 and record["time_update"] > 0
    # the updates are real: gradients flowed, and π moved between minibatches (off-policy ratios ≠ 1)
    assert all(r["grad_norm"] > 0 for r in records)
    assert any(r["approx_kl"] > 0 for r in records)
    # evaluation results are merged into the metrics of the steps that ran one
    assert [r["step"] for r in records if "heldout_accuracy" in r] == [2, 4]


def test_scoring_time_is_rollout_time(tmp_path, monkeypatch):
    """A reward model or a code sandbox takes time scoring: it belongs to time_rollout (the collect phase, as the
    async workers count it), not time_update, or a reward-bound run reads as learner-bound (the preflight's split)."""
    from gspo.rewards import REWARDS, batched

    @batched
    def slow(prompts, completions, **_):
        time.sleep(0.5)
        return [float(len(c) % 2) for c in completions]

    monkeypatch.setitem(REWARDS, "slow", slow)
    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, "rewards.functions={slow: 1.0}", "rewards.accuracy_reward=slow",
                                           "cold_start=null", "trainer.eval_every=0", "data.eval_split=null",
                                           "trainer.steps=2", "rewards.check=false")))
    assert [r["time_rollout"] >= 0.5 for r in read_metrics(out / "metrics.jsonl")] == [True, True]


def test_metrics_lines_are_strict_json(run_a):
    out, _ = run_a
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))


def test_summary_json(run_a):
    out, summary = run_a
    saved = json.loads((out / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    for key in ("heldout_accuracy_before_rl", "heldout_accuracy_after_rl"):
        assert 0 <= saved[key] <= 1
    assert saved["wall_seconds"] > 0
    assert saved["steps"] == 4
    assert saved["reward_failures"] == {"addition": 0, "varied": 0}


def test_eval_jsonl_starts_at_step_0(run_a):
    out, summary = run_a
    evals = read_metrics(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(0 <= e["heldout_accuracy"] <= 1 for e in evals)
    assert summary["heldout_accuracy_before_rl"] == evals[0]["heldout_accuracy"]
    assert summary["heldout_accuracy_after_rl"] == evals[-1]["heldout_accuracy"]


def test_rollouts_jsonl_holds_each_steps_first_groups_as_trained(run_a):
    """log.rollouts=6: each step's first 6 completions (group 0 whole, 2 of group 1), each with the prompt the step
    drew, the values the run's functions give its completion, their weighted sum, the accuracy verdict, and its
    group's Eq. 6 advantage."""
    out, _ = run_a
    cfg = load_config(out / "config.yaml")
    records = read_metrics(out / "rollouts.jsonl")
    assert [r["step"] for r in records] == [s for s in (1, 2, 3, 4) for _ in range(6)]
    train_rows = load_data(cfg.data, cfg.trainer.seed).train
    for step in (1, 2, 3, 4):
        mine = [r for r in records if r["step"] == step]
        assert [r["group"] for r in mine] == [0, 0, 0, 0, 1, 1]
        rows, _ = step_prompts(step - 1, train_rows, cfg.rollout.prompts_per_step, cfg.trainer.seed)
        for r in mine:
            row = rows[r["group"]]
            assert r["prompt"] == row["prompt"]
            values = {"addition": addition_reward(row["prompt"], r["completion"], answer=row["answer"]),
                      "varied": varied_reward(row["prompt"], r["completion"])}
            assert r["rewards"] == pytest.approx(values, abs=1e-6)
            assert r["reward"] == pytest.approx(values["addition"] + 0.5 * values["varied"], abs=1e-6)
            assert r["solved"] == (values["addition"] == 1.0)
            assert 1 <= r["tokens"] <= cfg.rollout.max_new_tokens and r["trained_tokens"] == r["tokens"]
        group = torch.tensor([r["reward"] for r in mine[:4]])
        assert [r["advantage"] for r in mine[:4]] == pytest.approx(group_advantages(group, 4).tolist(), abs=1e-5)


def test_run_folder_layout(run_a):
    out, _ = run_a
    assert (out / "config.yaml").is_file()
    assert (out / "cold_start" / "config.json").is_file()
    assert find_latest_checkpoint(out) == checkpoint_path(out, 4)
    assert checkpoint_path(out, 2).is_dir()


def test_final_model_loads_and_matches_the_last_checkpoint(run_a):
    out, _ = run_a
    final, tokenizer = load_model(str(out / "final"))
    trained, _ = load_model(str(checkpoint_path(out, 4) / "model"))
    cold, _ = load_model(str(out / "cold_start"))
    ids = torch.tensor([tokenizer.encode(s, add_special_tokens=False) for s in ("12+34=46", "70+18=88")])
    with torch.no_grad():
        got = final.eval()(input_ids=ids).logits
        want = trained.eval()(input_ids=ids).logits
        before = cold.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (got - before).abs().max() > 1e-4  # RL changed the cold-start model


@pytest.mark.parametrize("mixed_precision", [None, "bfloat16"])
def test_cold_start_sft_runs_on_the_models_device(device, mixed_precision):
    """sft() tokenizes on the CPU and moves each batch to the model's device (the GPU on a GPU machine)."""
    model, tokenizer = load_model("tiny-dense", seed=0)
    model = model.to(device)
    rows = make_task("addition", split="train", size=32, seed=0)
    losses = sft(model, tokenizer, rows, steps=3, batch_size=8, lr=1e-3, warmup_steps=0, progress=False,
                 mixed_precision=mixed_precision)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert {p.device.type for p in model.parameters()} == {device}


# ------------------------------------------------------------------------------------------------------------ resume


def test_interrupted_run_stops_like_a_crash(run_b):
    _, _, state = run_b
    assert not state["final_exists"] and not state["summary_exists"]
    assert state["steps_logged"] == [1, 2, 3]
    assert state["latest_checkpoint"].name == "step_00000002"


def test_resume_equals_uninterrupted(run_a, run_b):
    out_a, summary_a = run_a
    out_b, summary_b, _ = run_b
    a, b = safetensors_of(out_a / "final"), safetensors_of(out_b / "final")
    assert a.keys() == b.keys()
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, f"weights differ after resume: {unequal[:5]}"

    metrics_a, metrics_b = read_metrics(out_a / "metrics.jsonl"), read_metrics(out_b / "metrics.jsonl")
    assert [r["step"] for r in metrics_b] == [1, 2, 3, 4]  # step 3 was redone after the resume, and logged once
    assert [r["reward_mean"] for r in metrics_b] == [r["reward_mean"] for r in metrics_a]
    assert [r["loss"] for r in metrics_b] == [r["loss"] for r in metrics_a]
    assert read_metrics(out_b / "eval.jsonl") == read_metrics(out_a / "eval.jsonl")
    # step 3's completions were logged before the crash, dropped on resume and logged again: once, the same
    assert read_metrics(out_b / "rollouts.jsonl") == read_metrics(out_a / "rollouts.jsonl")
    assert summary_b["heldout_accuracy_before_rl"] == summary_a["heldout_accuracy_before_rl"]
    assert summary_b["heldout_accuracy_after_rl"] == summary_a["heldout_accuracy_after_rl"]


def test_resumed_run_wall_time_includes_the_time_before_its_checkpoint(run_b):
    """summary.json's wall_seconds = the interrupted process's time up to the checkpoint resumed from (kept in the
    checkpoint) + the resuming process's time, not the last process's alone."""
    out, summary, state = run_b
    before = json.loads((checkpoint_path(out, 2) / "state.json").read_text())["state"]["wall_seconds"]
    assert before > 0
    assert before + 0.8 * state["resume_seconds"] <= summary["wall_seconds"] <= before + state["resume_seconds"]


def test_resume_with_a_different_config_is_refused(run_a):
    out, _ = run_a
    saved = (out / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        train(cfg_for(out, *RUN, "optim.lr=5e-4"), resume=True)
    assert (out / "config.yaml").read_text() == saved


def test_fresh_run_into_a_folder_holding_a_run_is_refused(run_a):
    out, _ = run_a
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg_for(out, *RUN))
    assert sorted(p.name for p in out.iterdir()) == before


def test_resume_without_a_checkpoint_restarts_cleanly(tmp_path):
    """Interrupted before its first checkpoint: the resume starts over, and step 0 is evaluated once."""
    cfg = cfg_for(tmp_path, "cold_start=null", "trainer.steps=2", "trainer.checkpoint_every=0")
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(1)])
    train(cfg, resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path / "eval.jsonl")] == [0, 2]


def test_last_step_is_evaluated_even_without_eval_every(tmp_path):
    summary = train(cfg_for(tmp_path, "cold_start=null", "trainer.steps=1", "trainer.eval_every=0"))
    assert [r["step"] for r in read_metrics(tmp_path / "eval.jsonl")] == [0, 1]
    assert summary["heldout_accuracy_after_rl"] is not None


# ------------------------------------------------------------------------------------------------------- π_old modes


@pytest.fixture
def spy_objective(monkeypatch):
    """(logprobs, old_logprobs, mask) of every call of the gspo objective."""
    return record_objective(monkeypatch, "gspo")


def test_recompute_makes_the_first_minibatch_exactly_on_policy(tmp_path, spy_objective):
    steps, minibatches = 2, 4
    train(cfg_for(tmp_path, "cold_start=null", f"trainer.steps={steps}", "rewards.functions={varied: 1.0}",
                  "algorithm.old_logprobs=recompute", "trainer.eval_every=0", "data.eval_size=1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["clip_frac_tokens_first_mb"] for r in records] == [0.0] * steps
    assert len(spy_objective) == steps * minibatches
    for k, (logprobs, old, mask) in enumerate(spy_objective):
        if k % minibatches == 0:  # first minibatch of a step: π_θ = π_old, bit for bit
            assert torch.equal(logprobs[mask], old[mask]), f"step {k // minibatches + 1}: ratio ≠ 1 on-policy"
    # the later minibatches are off-policy (the weights moved), so the check above is not vacuous
    assert any(not torch.equal(lp[m], old[m]) for k, (lp, old, m) in enumerate(spy_objective) if k % minibatches)
    assert all(r["rollout_logprob_diff"] < 1e-4 for r in records)


def test_under_mixed_precision_every_sampler_of_a_run_samples_under_its_autocast(tmp_path, monkeypatch):
    """trainer.mixed_precision: the before-SFT evaluation and the run's engine (its rollouts and evaluations) sample
    under the same bf16 autocast, so the cold start's change compares like with like and FlashAttention gets no
    float32 attention input."""
    import gspo.evaluation

    made = sampler_autocasts(monkeypatch, gspo.evaluation)
    summary = train(cfg_for(tmp_path, "trainer.steps=1", "trainer.mixed_precision=bfloat16", "trainer.device=cpu"))
    assert summary["status"] == "completed" and summary["cold_start"]["before"]["heldout_accuracy"] is not None
    assert made == [torch.bfloat16, torch.bfloat16]  # the before-SFT evaluation's, then the run's engine


@pytest.mark.parametrize(("overrides", "problem"), [
    (["trainer.device=cpu"], "this run's device is cpu"),
    (["trainer.device=cuda"], "training forwards compute in float32"),
    (["trainer.device=cuda", "trainer.mixed_precision=bfloat16"], None),  # sampler and cold start: under autocast
    (["trainer.device=cuda", "trainer.mixed_precision=bfloat16", "cold_start=null"], None),
    (["trainer.device=cuda", "trainer.mixed_precision=bfloat16", "rollout.dtype=bfloat16"], None),
    (["trainer.device=cuda", "model.dtype=bfloat16"], None),
    (["trainer.device=cuda", "trainer.mixed_precision=bfloat16", "rollout.engine=vllm", "cold_start=null"], None),
])
def test_flash_attention_is_refused_where_its_kernel_would_get_float32_or_a_cpu(tmp_path, overrides, problem):
    """flash-attn raises at its first forward on a CPU or in float32 (transformers casts float32 inputs to the
    autocast dtype, else the weights'): the run refuses such a config before the cold start instead."""
    from gspo.trainer import _flash_attention_checks

    cfg = cfg_for(tmp_path, "model.attn_implementation=flash_attention_2", *overrides)
    device = torch.device(cfg.trainer.device)
    if problem is None:
        _flash_attention_checks(cfg, device)
    else:
        with pytest.raises(ConfigError, match=f"model.attn_implementation=flash_attention_2: .*{problem}"):
            _flash_attention_checks(cfg, device)
    _flash_attention_checks(load_config(DEMO, tiny_overrides(tmp_path, "trainer.device=cpu")), torch.device("cpu"))


@pytest.mark.parametrize("disable", [True, False])
def test_a_model_with_dropout_trains_without_it(tmp_path, spy_objective, caplog, disable):
    """A model folder whose config has dropout (attention_dropout 0.5): RL turns it off (trainer.disable_dropout), so
    a no-grad π_old forward and the on-policy minibatch's forward agree, its ratios exactly 1; with
    disable_dropout=false they are noise, and a warning says so. (A mismatch mask that keeps every row makes the
    trainer run the π_old forward over the first minibatch too: without one, that minibatch's π_old is its update's
    own forward, the same dropout and all.) The model's config (and so the saved model's) keeps its dropout."""
    from gspo.models import build_preset, save_model

    model, tokenizer = build_preset("tiny-dense", seed=0)
    model.config.attention_dropout = 0.5
    save_model(model, tokenizer, tmp_path / "dropout-model")
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="gspo.trainer"):
        train(cfg_for(out, "cold_start=null", f"model.name={tmp_path / 'dropout-model'}", "trainer.steps=1",
                      "rewards.functions={varied: 1.0}", "algorithm.old_logprobs=recompute", "trainer.eval_every=0",
                      "data.eval_size=1", f"trainer.disable_dropout={str(disable).lower()}",
                      "algorithm.mismatch=mask", "algorithm.mask_bounds=[1e-6, 1e6]"))
    logprobs, old, mask = spy_objective[0]
    assert torch.equal(logprobs[mask], old[mask]) == disable
    said = " ".join(r.getMessage() for r in caplog.records if "dropout" in r.getMessage())
    assert "attention_dropout: 0.5" in said and ("off for RL" in said) == disable
    assert json.loads((out / "final" / "config.json").read_text())["attention_dropout"] == 0.5


def test_lora_dropout_with_dropout_disabled_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 with trainer.disable_dropout=true"):
        cfg_for(tmp_path, "model.lora={r: 4, dropout: 0.1}")
    assert cfg_for(tmp_path, "model.lora={r: 4, dropout: 0.1}", "trainer.disable_dropout=false").model.lora.dropout


def test_rollout_logprobs_as_pi_old(tmp_path, spy_objective):
    train(cfg_for(tmp_path, "cold_start=null", "trainer.steps=2", "rewards.functions={varied: 1.0}",
                  "algorithm.old_logprobs=rollout", "trainer.eval_every=0", "data.eval_size=1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    for r in records:
        for key in ("ratio_mean", "ratio_min", "ratio_max", "clip_frac_tokens", "clip_frac_tokens_first_mb",
                    "approx_kl", "loss", "grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), key
        assert "rollout_logprob_diff" not in r
    # first minibatch: the sampler's logprobs are the trainer's up to float32 noise (same weights, same temperature)
    logprobs, old, mask = spy_objective[0]
    assert (logprobs[mask] - old[mask]).abs().max() < 1e-4


def test_mixed_precision_computes_in_bf16_over_float32_weights(tmp_path, spy_objective):
    """trainer.mixed_precision=bfloat16: π_old and π_θ run the same bf16 arithmetic, so the first minibatch is still
    exactly on-policy; the sampler's log-probs (its cached decode, under the same autocast) differ from the trainer's
    by bf16 rounding (so bf16 really ran); the weights (and the saved model) stay float32."""
    steps, minibatches = 2, 4
    train(cfg_for(tmp_path, "cold_start=null", f"trainer.steps={steps}", "rewards.functions={varied: 1.0}",
                  "algorithm.old_logprobs=recompute", "trainer.mixed_precision=bfloat16", "trainer.eval_every=0",
                  "data.eval_size=1"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["clip_frac_tokens_first_mb"] for r in records] == [0.0] * steps
    for k, (logprobs, old, mask) in enumerate(spy_objective):
        assert logprobs.dtype == torch.float32
        if k % minibatches == 0:
            assert torch.equal(logprobs[mask], old[mask])
    assert any(not torch.equal(lp[m], old[m]) for k, (lp, old, m) in enumerate(spy_objective) if k % minibatches)
    # the engine samples under the same autocast (its cached decode vs the trainer's one forward): rounding only
    assert all(1e-5 < r["rollout_logprob_diff"] < 0.1 for r in records)
    assert {t.dtype for t in safetensors_of(tmp_path / "final").values()} == {torch.float32}


@pytest.mark.parametrize("overrides, key", [
    (["model.dtype=bfloat16", "optim.lr=1e-6", "cold_start=null"], "optim.lr"),
    (["model.dtype=bfloat16", "optim.lr=1e-2", "cold_start.lr=1e-5"], "cold_start.lr"),
])
def test_weights_too_coarse_for_the_learning_rate_are_refused_before_any_compute(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=rf"{key}: .*rounds away on .*mixed_precision=bfloat16"):
        train(cfg_for(tmp_path, *overrides))
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "cold_start").exists()


def test_a_model_without_a_chat_template_cold_starts_on_plain_text_demonstrations(tmp_path):
    """String prompts and solutions need no chat template: `--check` and the run with a cold start pass on a model
    folder whose tokenizer has none (the chat format is built only for multi-turn demonstrations)."""
    from gspo.models import build_preset, save_model
    from gspo.preflight import check

    model, tokenizer = build_preset("tiny-dense", seed=0)
    tokenizer.chat_template = None
    save_model(model, tokenizer, tmp_path / "bare")
    cfg = cfg_for(tmp_path / "run", f"model.name={tmp_path / 'bare'}", "trainer.steps=1", "trainer.eval_every=0",
                  "data.eval_size=4")
    assert check(cfg)["cold_start"]["rows"] == 200
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["cold_start"]["steps"] == 5


def test_the_saved_models_keep_the_chat_template_the_run_rendered_with(tmp_path):
    """data.chat_template replaces the tokenizer's template for the run: the models it saves (cold start, checkpoints,
    final/) carry that template, so `gspo eval RUN/final` renders conversations as the run did (final/ had the
    model's own template, or none)."""
    from transformers import AutoTokenizer

    from conftest import write_jsonl

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }};{% endfor %}")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+1="}], "solution": str(a + 1), "answer": str(a + 1)}
            for a in range(40)]
    out = tmp_path / "run"
    train(cfg_for(out, f"data.path={write_jsonl(tmp_path / 'd.jsonl', rows)}", "data.task=null",
                  "data.train_size=null", "data.eval_size=null", "data.eval_fraction=0.25",
                  f"data.chat_template={template}", "trainer.steps=1", "trainer.eval_every=0"))
    for folder in (out / "cold_start", checkpoint_path(out, 1) / "model", out / "final"):
        assert AutoTokenizer.from_pretrained(str(folder)).chat_template == template.read_text()


# ----------------------------------------------------------------------------------------------------------- losses


@pytest.mark.parametrize("loss", ["gspo_token", "grpo", "dapo", "dr_grpo", "cispo"])
def test_each_objective_runs_a_finite_step(tmp_path, loss):
    summary = train(cfg_for(tmp_path, "cold_start=null", "trainer.steps=1", f"algorithm.loss={loss}",
                            "rewards.functions={varied: 1.0}", "data.eval_size=4"))
    if loss == "dr_grpo":
        assert load_config(DEMO, [f"algorithm.loss={loss}"]).algorithm.advantage_scale == "none"
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    for key in (*REQUIRED[1:], "loss"):
        assert record[key] is not None and math.isfinite(record[key]), f"{loss}: {key} = {record[key]}"
    assert record["skipped_updates"] == 0
    assert record["grad_norm"] > 0
    assert summary["heldout_accuracy_after_rl"] is not None


# ---------------------------------------------------------------------------------------------------------- rewards


def test_failing_reward_with_on_error_zero_is_counted(tmp_path):
    steps, rows, eval_rows = 2, 16, 4
    summary = train(cfg_for(tmp_path, "cold_start=null", f"trainer.steps={steps}", "trainer.eval_every=0",
                            f"data.eval_size={eval_rows}", "rewards.functions={addition: 1.0, boom: 1.0}",
                            "rewards.on_error=zero"))
    # every row of every rollout and of both evaluations (step 0 and the last step) failed, and was scored 0
    assert summary["reward_failures"] == {"addition": 0, "boom": steps * rows + 2 * eval_rows}
    assert json.loads((tmp_path / "summary.json").read_text())["reward_failures"]["boom"] == steps * rows + 8
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward_failures"] for r in records] == [rows] * steps
    assert (tmp_path / "final" / "config.json").is_file()


def test_failing_reward_with_on_error_fail_raises(tmp_path):
    with pytest.raises(RewardFailure, match="boom"):
        train(cfg_for(tmp_path, "cold_start=null", "trainer.steps=1", "rewards.functions={boom: 1.0}",
                      "rewards.on_error=fail"))


# --------------------------------------------------------------------------------------------------------------- KL


KL_RUN = ["trainer.steps=2", "trainer.checkpoint_every=1", "algorithm.kl_beta=0.1", "trainer.eval_every=0",
          "data.eval_size=4", "rewards.functions={varied: 1.0}",
          "trainer.device=cpu"]  # the resumed run's kl_ref must equal the uninterrupted one's bit for bit


def test_kl_beta_logs_kl_ref_and_resumes_against_the_same_reference(tmp_path):
    """kl_ref is KL to the cold-start model; a resumed run must measure it against that same model."""
    full = train(cfg_for(tmp_path / "full", *KL_RUN))
    assert full["heldout_accuracy_after_rl"] is not None
    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert all(r["kl_ref"] is not None and r["kl_ref"] >= 0 for r in records)
    assert records[-1]["kl_ref"] > 0  # the policy has moved away from the reference

    cfg = cfg_for(tmp_path / "resumed", *KL_RUN)
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(1)])
    train(cfg, resume=True)
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["kl_ref"] for r in resumed] == [r["kl_ref"] for r in records]


def test_no_kl_ref_without_kl_beta(run_a):
    out, _ = run_a
    assert all("kl_ref" not in r for r in read_metrics(out / "metrics.jsonl"))


def test_trimmed_padding_keeps_the_first_minibatch_exactly_on_policy(tmp_path, spy_objective):
    """A dense model's forwards trim padding (gspo.logprobs trim_padding): π_old and π_θ of the first minibatch use
    the same buckets, so its ratios are still exactly 1 — and the rollout's ragged completions are padded."""
    train(cfg_for(tmp_path, "cold_start=null", "model.name=tiny-dense", "trainer.steps=1", "rollout.max_new_tokens=12",
                  "rollout.stop=[1, 2, 3, 4]", "rewards.functions={varied: 1.0}", "algorithm.old_logprobs=recompute",
                  "trainer.eval_every=0", "data.eval_size=1"))
    logprobs, old, mask = spy_objective[0]
    assert (~mask).any()  # ragged lengths: padding exists and is trimmed
    assert torch.equal(logprobs[mask], old[mask])
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["rollout_logprob_diff"] < 1e-4


def test_rollout_records_of_token_level_advantages_and_filtered_rows():
    """Multi-turn GSPO-token batches carry per-token advantages: a record shows their mean over the tokens the loss
    trains on; a row the loss left out (trained_tokens 0, e.g. rollout.overlong_filter) shows 0; the prompt is decoded
    without its padding."""
    from conftest import ragged_trajectory
    from gspo.models import build_preset
    from gspo.trainer import Collected, rollout_records

    model, tokenizer = build_preset("tiny-dense", seed=0)
    traj = ragged_trajectory(model, n=8)
    loss_mask = traj.completion_mask.clone()
    loss_mask[1, :2] = 0  # an observation's tokens
    loss_mask[2] = 0  # filtered out
    traj.loss_mask = loss_mask
    advantages = torch.randn(traj.completion_mask.shape, generator=torch.Generator().manual_seed(0)) * loss_mask
    records = rollout_records(Collected(traj, torch.arange(8.0), advantages, {}, 0.0), tokenizer, 5, 4)
    assert [r["group"] for r in records] == [0, 0, 0, 0, 1]
    for i, r in enumerate(records):
        trained = loss_mask[i].bool()
        assert r["trained_tokens"] == int(trained.sum()) and r["tokens"] == int(traj.completion_mask[i].sum())
        expected = float(advantages[i][trained].mean()) if trained.any() else 0.0
        assert r["advantage"] == pytest.approx(expected, abs=1e-6)
        assert r["prompt"] == tokenizer.decode(traj.prompt_ids[i][traj.prompt_mask[i].bool()].tolist())
        assert r["reward"] == float(i) and "rewards" not in r  # no per-function values carried: none shown


def test_the_kl_estimator_reaches_the_learner_and_unknown_ones_are_refused(tmp_path):
    from gspo.trainer import learn_settings

    assert learn_settings(cfg_for(tmp_path, "algorithm.kl_beta=0.1")).kl_estimator == "k3"  # GRPO's, the default
    assert learn_settings(cfg_for(tmp_path, "algorithm.kl_beta=0.1",
                                  "algorithm.kl_estimator=k2")).kl_estimator == "k2"
    with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator"):
        cfg_for(tmp_path, "algorithm.kl_estimator=k1")

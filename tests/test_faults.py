"""Faults injected into real (tiny) training runs: non-finite losses, a disk that fills up while checkpointing,
over-long prompts, a hanging reward function. Each is either skipped and counted or stops the run with a clear
error, and never corrupts what a resume needs."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEMO, safetensors_of, tiny_overrides, varied_reward
from gspo import checkpoint as ckpt
from gspo.checkpoint import checkpoint_path, find_latest_checkpoint
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.models import build_preset
from gspo.objectives import OBJECTIVES
from gspo.rewards import REWARDS, RewardFailure
from gspo.tracking import read_metrics
from gspo.trainer import TrainingError, train


@pytest.fixture(autouse=True)
def varied(monkeypatch):
    """Register the `varied` reward for each test only."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)


MINIBATCHES = 4  # the demo config's algorithm.minibatches
QUICK = ["cold_start=null", "trainer.eval_every=0", "data.eval_size=4", "rewards.functions={varied: 1.0}"]


def cfg_for(out: Path, *extra: str):
    return load_config(DEMO, tiny_overrides(out, *QUICK, *extra))


@pytest.fixture
def nan_loss_on_steps(monkeypatch):
    """Make the gspo objective return a NaN loss (NaN gradients follow) on every minibatch of the given RL steps
    (1-based); call the fixture's value with the set of steps."""

    def install(bad_steps: set[int]) -> list[float]:
        inner, calls = OBJECTIVES["gspo"], []

        def objective(logprobs, old_logprobs, advantages, mask, **kw):
            loss, metrics = inner.loss(logprobs, old_logprobs, advantages, mask, **kw)
            step = len(calls) // MINIBATCHES + 1
            calls.append(step)
            return (loss * float("nan") if step in bad_steps else loss), metrics

        monkeypatch.setitem(OBJECTIVES, "gspo", dataclasses.replace(inner, loss=objective))
        return calls

    return install


# ------------------------------------------------------------------------------------------------ non-finite updates


def test_non_finite_loss_skips_the_update_and_leaves_the_weights_untouched(tmp_path, nan_loss_on_steps):
    nan_loss_on_steps({1})
    summary = train(cfg_for(tmp_path, "trainer.steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped_updates"] for r in records] == [MINIBATCHES, 0]
    assert records[0]["grad_norm"] is None  # no finite update to average: logged as null, not NaN
    assert summary["status"] == "completed" and summary["skipped_updates"] == MINIBATCHES

    # after step 1 the weights are still the initial ones, bit for bit, and AdamW never stepped
    initial = build_preset("tiny-moe", seed=0)[0].state_dict()
    after_step_1 = safetensors_of(checkpoint_path(tmp_path, 1) / "model")
    assert after_step_1.keys() <= initial.keys()
    assert all(torch.equal(after_step_1[name], initial[name]) for name in after_step_1)
    assert torch.load(checkpoint_path(tmp_path, 1) / "optimizer.pt", weights_only=True)["state"] == {}
    # step 2 was finite and did update (the check above is not vacuous)
    after_step_2 = safetensors_of(checkpoint_path(tmp_path, 2) / "model")
    assert any(not torch.equal(after_step_2[name], initial[name]) for name in after_step_2)


def test_consecutive_bad_steps_stop_the_run_with_a_report(tmp_path, nan_loss_on_steps):
    """Steps 1, 3 and 4 have a NaN loss: step 2 resets the count, so with max_bad_steps=2 the run stops at step 4."""
    nan_loss_on_steps({1, 3, 4})
    with pytest.raises(TrainingError, match=r"stopped at step 4: the last 2 steps \(trainer.max_bad_steps\)"):
        train(cfg_for(tmp_path, "trainer.steps=6", "trainer.max_bad_steps=2", "trainer.checkpoint_every=1"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "stopped at step 4" in summary["error"]
    assert summary["steps_done"] == 4 and summary["skipped_updates"] == 3 * MINIBATCHES
    assert summary["last_checkpoint"] == 4  # what --resume (after a fix) continues from
    assert not (tmp_path / "final").exists()


def test_max_bad_steps_none_never_stops(tmp_path, nan_loss_on_steps):
    nan_loss_on_steps({1, 2, 3})
    summary = train(cfg_for(tmp_path, "trainer.steps=3", "trainer.max_bad_steps=null"))
    assert summary["status"] == "completed" and summary["skipped_updates"] == 3 * MINIBATCHES


# ------------------------------------------------------------------------------------------------ disk full at save

# on the CPU even on a GPU machine: the resumed run must equal the reference bit for bit (see conftest.DEVICE)
RUN = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3", "trainer.device=cpu"]


def test_full_disk_while_checkpointing_stops_the_run_and_the_previous_checkpoint_resumes(tmp_path, capsys):
    reference = tmp_path / "reference"
    train(cfg_for(reference, *RUN))

    out = tmp_path / "run"
    real_save = torch.save

    def disk_full_at_step_4(obj, file, *args, **kwargs):
        if ".tmp-step_00000004" in str(file) and Path(file).name == "scheduler.pt":
            Path(file).write_bytes(b"partial")  # what a full disk leaves: a truncated file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt.torch, "save", disk_full_at_step_4)
        assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK, *RUN)]) == 1
    err = capsys.readouterr().err
    assert "CheckpointError" in err and "step 4" in err and "disk is full" in err and "left untouched" in err

    # the failed save left nothing behind; the step-2 checkpoint is intact and is what a resume starts from
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert find_latest_checkpoint(out) == checkpoint_path(out, 2)
    assert not (out / "final").exists() and not (out / "summary.json").exists()

    summary = train(cfg_for(out, *RUN), resume=True)
    assert summary["status"] == "completed"
    a, b = safetensors_of(reference / "final"), safetensors_of(out / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_metrics(out / "eval.jsonl") == read_metrics(reference / "eval.jsonl")


# ---------------------------------------------------------------------------------------------- over-long prompts


def write_rows(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "2"}) + "\n" for p in prompts))
    return path


def test_over_long_prompts_are_skipped_counted_logged_and_reported(tmp_path, caplog):
    short, long_ = "1+1=", "1" * 12 + "+1="  # 4 and 15 tokens (one per character)
    data = write_rows(tmp_path / "rows.jsonl", [short, long_, short, long_, long_, short, short, short])
    heldout = write_rows(tmp_path / "heldout.jsonl", ["2+2=", "2" * 12 + "+1=", "3+3=", "4+4="])
    with caplog.at_level(logging.WARNING, logger="gspo.trainer"):
        summary = train(cfg_for(tmp_path / "run", "trainer.steps=1", f"data.path={data}", "data.task=null",
                                f"data.eval_path={heldout}",
                                "data.eval_size=8", "data.max_prompt_tokens=10"))
    assert summary["skipped_prompts"] == {"train": 3, "eval": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert "skipped 3 of 8 prompts of the training rows: longer than 10 tokens" in messages


def test_each_held_out_files_record_counts_the_rows_evaluated_after_over_long_prompts(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ["1+1=", "2+1=", "3+1=", "4+1="])
    a = write_rows(tmp_path / "a.jsonl", ["2+2=", "2" * 12 + "+1=", "3+3="])
    b = write_rows(tmp_path / "b.jsonl", ["5+5=", "6+6="])
    summary = train(cfg_for(tmp_path / "run", "trainer.steps=1", f"data.path={data}", "data.task=null",
                            f"data.eval_path=[{a}, {b}]", "data.max_prompt_tokens=10"))
    sets = summary["heldout"]["sets"]
    assert summary["heldout"]["rows"] == 4 and summary["skipped_prompts"]["eval"] == 1
    assert (sets["a"]["rows"], sets["a"]["skipped_prompts"], sets["a"]["of"]) == (2, 1, 3)
    assert (sets["b"]["rows"], sets["b"]["skipped_prompts"]) == (2, 0)


def test_gspo_eval_of_a_run_scores_the_rows_the_run_scored(tmp_path, capsys):
    """The run drops held-out prompts over its limit; `gspo eval RUN` (its config's rows) must drop the same ones: a
    reward that pays exactly the long prompt would otherwise report 1 of 3 solved where the run reported 0 of 3."""
    (tmp_path / "rw.py").write_text("def long_prompt(prompt, completion, **row):\n    return float(len(prompt) > 10)\n")
    data = write_rows(tmp_path / "rows.jsonl", ["1+1=", "2+1=", "3+1=", "4+1="])
    heldout = write_rows(tmp_path / "heldout.jsonl", ["2+2=", "2" * 12 + "+1=", "3+3=", "4+4="])
    run = tmp_path / "run"
    summary = train(cfg_for(run, "trainer.steps=1", f"data.path={data}", "data.task=null", f"data.eval_path={heldout}",
                            "data.max_prompt_tokens=10", "rewards.check=false",
                            f"rewards.functions={{{tmp_path / 'rw.py'}:long_prompt: 1.0}}"))
    assert summary["skipped_prompts"]["eval"] == 1 and summary["heldout_accuracy_after_rl"] == 0.0
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["rows"], result["skipped_prompts"], result["accuracy"]) == (3, 1, 0.0)
    assert main(["eval", str(run), "--max-new-tokens", "0"]) == 2  # not silently the default
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err


def test_default_prompt_limit_is_the_model_context_minus_the_new_tokens(tmp_path):
    """tiny-moe has 256 positions and the rollout generates 4 tokens: a 253-token prompt cannot be sampled."""
    data = write_rows(tmp_path / "rows.jsonl", ["1+1=", "1" * 250 + "+1=", "1" * 249 + "+1="])
    summary = train(cfg_for(tmp_path / "run", "trainer.steps=1", f"data.path={data}", "data.task=null",
                            "data.eval_split=null"))
    assert summary["skipped_prompts"] == {"train": 1, "eval": 0}


def test_all_prompts_too_long_is_a_clear_error(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ["1" * 12 + "+1="] * 3)
    with pytest.raises(ConfigError, match=r"all 3 prompts of the training rows are longer than 10 tokens .*: raise "
                                          r"data\.max_prompt_tokens \(up to 252\)"):
        train(cfg_for(tmp_path / "run", f"data.path={data}", "data.task=null", "data.eval_split=null",
                      "data.max_prompt_tokens=10"))


def test_prompts_too_long_for_the_model_do_not_suggest_raising_max_prompt_tokens(tmp_path):
    """When the model's positions are the limit, raising data.max_prompt_tokens cannot help: the hint says so."""
    data = write_rows(tmp_path / "rows.jsonl", ["1" * 260 + "+1="] * 3)
    with pytest.raises(ConfigError, match=r"longer than 252 tokens .*: the model has 256 positions") as caught:
        train(cfg_for(tmp_path / "run", f"data.path={data}", "data.task=null", "data.eval_split=null"))
    assert "max_prompt_tokens" not in str(caught.value)
    assert not (tmp_path / "run" / "config.yaml").exists()  # a start that failed leaves nothing behind


# ----------------------------------------------------------------------------------------------- a hanging reward


@pytest.fixture
def hangs_once(monkeypatch):
    """Register reward `hangs_once`: its first call blocks until the test ends, the others score 0.5."""
    release, calls = threading.Event(), []

    def hangs_once(prompt: str, completion: str, **row) -> float:
        calls.append(prompt)
        if len(calls) == 1:
            release.wait()
        return 0.5

    monkeypatch.setitem(REWARDS, "hangs_once", hangs_once)
    yield
    release.set()  # let the abandoned thread finish


def test_a_hanging_reward_is_a_counted_failure_and_training_goes_on(tmp_path, hangs_once):
    summary = train(cfg_for(tmp_path, "trainer.steps=2", "rewards.functions={hangs_once: 1.0}",
                            "rewards.timeout_s=0.5", "rewards.on_error=zero", "rewards.check=false"))  # 1st call
    assert summary["status"] == "completed"
    # the hang was the first call, of the step-0 evaluation's batch of 4, which shares one deadline: the hanging call
    # was abandoned and the 3 queued behind it (one worker) never ran; every later batch scored normally
    assert summary["reward_failures"] == {"hangs_once": 4} and summary["reward_timeouts"] == {"hangs_once": 4}
    evals = read_metrics(tmp_path / "eval.jsonl")
    assert evals[0]["heldout_reward_mean"] == 0.0 and evals[0]["heldout_reward_failure_rate"] == 1.0
    assert evals[-1]["heldout_reward_mean"] == pytest.approx(0.5)


def test_a_hanging_reward_with_on_error_fail_stops_the_run(tmp_path, hangs_once):
    with pytest.raises(RewardFailure, match=r"'hangs_once' failed on row 0: timed out after 0.5 s"):
        train(cfg_for(tmp_path, "trainer.steps=1", "rewards.functions={hangs_once: 1.0}", "rewards.timeout_s=0.5",
                      "rewards.check=false"))


# ------------------------------------------------------------------------------------------------ resume edge cases


def test_a_run_saved_before_a_config_key_existed_still_resumes(tmp_path):
    """A key missing from the saved config.yaml had its default then; only a real difference refuses the resume."""
    cfg = cfg_for(tmp_path, "trainer.steps=1")
    train(cfg)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["rewards"]["timeout_s"], saved["trainer"]["max_bad_steps"], saved["data"]["max_prompt_tokens"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert train(cfg, resume=True)["status"] == "completed"
    with pytest.raises(ConfigError, match=r"differs in rewards\.on_error"):
        train(cfg_for(tmp_path, "trainer.steps=1", "rewards.on_error=zero"), resume=True)

"""float16 compute (`trainer.mixed_precision=float16`, LoRA over a float16 model): the dynamic loss scale
(`gspo.optim.loss_scaler`) that keeps its gradients from underflowing, its overflows (skipped and counted, never a
failure), its state in checkpoints, and float16 weights refused for training."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import (
    DEMO,
    DEVICE,
    SimulatedCrash,
    crash_after,
    ragged_trajectory,
    safetensors_of,
    sgd_learn,
    tiny_overrides,
)
from gspo import optim
from gspo.config import ConfigError, load_config
from gspo.data import make_task
from gspo.learner import LearnSettings
from gspo.models import build_preset
from gspo.objectives import OBJECTIVES
from gspo.optim import loss_scaler, make_optimizer
from gspo.parallel import ProcessGroup
from gspo.sft import sft
from gspo.tracking import read_metrics
from gspo.trainer import train

ROWS = [torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])]  # one on-policy minibatch: π_old = π_θ


def one_update(precision: str | None, advantage_scale: float, scaler=None, device: str = "cpu") -> tuple[dict, dict]:
    """One `learn` update of the tiny dense preset on `device` (`sgd_learn`: the change shows the gradient 1:1) with
    advantages × `advantage_scale`; returns (the weights' change, metrics)."""
    model, _ = build_preset("tiny-dense", seed=1)
    traj = ragged_trajectory(model).to(device)
    spec = OBJECTIVES["gspo"]
    settings = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12,
                             mixed_precision=precision, grad_clip=None)
    advantages = advantage_scale * torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25], device=device)
    return sgd_learn(model.to(device), traj, advantages, [r.to(device) for r in ROWS], settings, lr=1.0,
                     group=ProcessGroup(device=torch.device(device)), scaler=scaler)


def flat(delta: dict) -> torch.Tensor:
    return torch.cat([d.flatten().double() for d in delta.values()])


def test_the_loss_scale_keeps_float16_gradients_from_underflowing(device):
    """Small advantages (1e-4: rewards 1e-4 apart within a group) give activation gradients in float16's subnormal
    range (below 6.1e-5, down to 0 under 6e-8): without the scale the float16 update is 36 % off the float32 one (its
    relative error); with it, 0.1 %, float16 rounding."""
    reference, _ = one_update(None, 1e-4, device=device)
    model, _ = build_preset("tiny-dense", seed=1)
    scaled, metrics = one_update("float16", 1e-4, scaler=loss_scaler(model.to(device), "float16"), device=device)
    unscaled, _ = one_update("float16", 1e-4, device=device)
    ref, got, bare = flat(reference), flat(scaled), flat(unscaled)
    assert ref.norm() > 0
    assert float((got - ref).norm() / ref.norm()) < 0.01
    assert float((bare - ref).norm() / ref.norm()) > 0.2  # float16 without the scale: the gradient is lost in rounding
    assert metrics["overflow_updates"] == 0 and metrics["loss_scale"] == optim.INITIAL_LOSS_SCALE


def test_an_overflowing_scale_skips_the_update_halves_the_scale_and_is_not_a_failure():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**70)  # far past float16's 65504: every gradient overflows
    delta, metrics = one_update("float16", 1.0, scaler=scaler)
    assert all(float(d.abs().max()) == 0 for d in delta.values())  # the weights were not touched
    assert metrics["overflow_updates"] == 1 and metrics["skipped_updates"] == 0
    assert metrics["loss_scale"] == 2.0**69


def test_without_a_scaler_or_under_a_scale_of_one_a_non_finite_gradient_is_a_skipped_update(monkeypatch):
    """Under a scale ≤ 1 the scale cannot be what overflowed: the gradient itself is not finite (a failure, which the
    collapse guard and trainer.max_bad_steps count)."""
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: real(*a, **k) * float("inf"))
    _, metrics = one_update("float16", 1.0, scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    assert metrics["skipped_updates"] == 1 and metrics["overflow_updates"] == 0
    _, metrics = one_update("float16", 1.0)
    assert metrics["skipped_updates"] == 1 and "overflow_updates" not in metrics


def test_a_failed_update_keeps_the_loss_scale(monkeypatch):
    """A non-finite loss (an fp16 forward past 65504) is a failure, not an overflow: halving the scale cannot fix it,
    and failures scattered through a run pushed it below 1 (20 of them: 0.0625), where a clean update then lost 91 % of
    its gradient to underflow with nothing flagged. The scale is kept."""
    import dataclasses

    inner = OBJECTIVES["gspo"]

    def nan_loss(*args, **kwargs):
        loss, metrics = inner.loss(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setitem(OBJECTIVES, "gspo", dataclasses.replace(inner, loss=nan_loss))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    delta, metrics = one_update("float16", 1.0, scaler=scaler)
    assert metrics["skipped_updates"] == 1 and metrics["overflow_updates"] == 0
    assert metrics["loss_scale"] == 2.0**16 and all(float(d.abs().max()) == 0 for d in delta.values())


def test_only_float16_compute_gets_a_scaler():
    fp32, _ = build_preset("tiny-dense", seed=0)
    assert loss_scaler(fp32, None) is None and loss_scaler(fp32, "bfloat16") is None
    assert isinstance(loss_scaler(fp32, "float16"), torch.amp.GradScaler)
    half, _ = build_preset("tiny-dense", seed=0, dtype=torch.float16)  # e.g. the frozen base under LoRA adapters
    assert isinstance(loss_scaler(half, None), torch.amp.GradScaler)


def test_float16_weights_are_refused_for_training_at_any_rate():
    half, _ = build_preset("tiny-dense", seed=0, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"float16 weights cannot be trained.*trainer\.mixed_precision=float16"):
        make_optimizer(half, 1.0, 10)


def test_a_float16_model_is_refused_before_any_compute(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr: float16 weights cannot be trained"):
        train(load_config(DEMO, tiny_overrides(tmp_path, "model.dtype=float16", "cold_start=null")))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cold_start_sft_under_float16_learns_and_skips_overflowed_steps(monkeypatch):
    rows = make_task("addition", split="train", size=32, seed=0)
    model, tokenizer = build_preset("tiny-dense", seed=0)
    losses = sft(model, tokenizer, rows, steps=12, batch_size=8, lr=3e-3, warmup_steps=0, progress=False,
                 mixed_precision="float16")
    assert losses[-1] < losses[0] and {p.dtype for p in model.parameters()} == {torch.float32}
    # a scale past float16's range: the first steps overflow, are skipped (weights untouched), the scale halves
    monkeypatch.setattr(optim, "INITIAL_LOSS_SCALE", 2.0**40)
    model, tokenizer = build_preset("tiny-dense", seed=0)
    before = copy.deepcopy(model.state_dict())
    sft(model, tokenizer, rows, steps=1, batch_size=8, lr=3e-3, warmup_steps=0, progress=False,
        mixed_precision="float16")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())



def test_cold_start_sft_halves_an_overflowing_loss_scale_until_its_steps_apply(monkeypatch, caplog):
    """An overflowed SFT step halves the loss scale (it is not a failure, which keeps the scale and would skip every
    later step as well): from 2^24 the first steps overflow, then steps apply under 2^24 / 2^skipped and move the
    weights. The learning-rate schedule counts the skipped steps too."""
    import logging
    import re

    from gspo import sft as sft_module

    monkeypatch.setattr(optim, "INITIAL_LOSS_SCALE", 2.0**24)
    made = []
    for name in ("loss_scaler", "make_optimizer"):  # record what sft builds; the real ones run
        real = getattr(sft_module, name)
        monkeypatch.setattr(sft_module, name, lambda *a, real=real, **k: made.append(real(*a, **k)) or made[-1])
    model, tokenizer = build_preset("tiny-dense", seed=0)
    before = copy.deepcopy(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="gspo.sft"):
        sft(model, tokenizer, make_task("addition", split="train", size=32, seed=0), steps=8, batch_size=4,
            lr=3e-3, warmup_steps=0, progress=False, mixed_precision="float16")
    skipped = int(re.search(r"skipped (\d+) of 8 steps", caplog.text)[1])
    (_, scheduler), scaler = made
    assert 0 < skipped < 8 and scaler.get_scale() == 2.0**24 / 2**skipped
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scheduler.last_epoch == 8

RUN = ["trainer.mixed_precision=float16", "trainer.device=cpu", "cold_start=null", "trainer.steps=4",
       "trainer.checkpoint_every=2", "trainer.eval_every=0", "data.eval_size=4",
       "rewards.functions={addition: 1.0, conftest.varied_reward: 0.5}"]


def test_a_float16_run_counts_its_overflows_and_resumes_with_its_loss_scale(tmp_path, monkeypatch):
    """A run starting from a scale past float16's range overflows (updates skipped, counted in overflow_updates and
    summary.json, no guard anomaly, no skipped_updates), then trains; a run interrupted after step 3 and resumed from
    step 2's checkpoint continues with the scale it had there, and ends bit for bit as the uninterrupted run (from the
    initial scale again, it would overflow and skip updates the uninterrupted run made)."""
    monkeypatch.setattr(optim, "INITIAL_LOSS_SCALE", 2.0**24)
    whole = train(load_config(DEMO, tiny_overrides(tmp_path / "a", *RUN)))
    records = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert records[0]["overflow_updates"] > 0 and records[0]["loss_scale"] < 2.0**24
    assert all(r["skipped_updates"] == 0 and r["guard_anomalies"] == 0 for r in records)
    assert whole["overflow_updates"] == sum(r["overflow_updates"] for r in records) and whole["skipped_updates"] == 0
    assert "grad_norm" not in records[0]  # no update applied, none failed: no norm to give
    assert all(r["grad_norm"] > 0 for r in records if r["overflow_updates"] < 4)  # it trained once the scale fit

    cfg = load_config(DEMO, tiny_overrides(tmp_path / "b", *RUN))
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(3)])
    train(cfg, resume=True)
    resumed = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in records]
    a, b = safetensors_of(tmp_path / "a" / "final"), safetensors_of(tmp_path / "b" / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_over_a_float16_model_trains_float32_adapters_under_the_loss_scale(tmp_path):
    """The frozen fp16 base computes in fp16, so its backward needs the scale too, though no weight it trains is fp16
    (on the GPU when there is one)."""
    train(load_config(DEMO, tiny_overrides(tmp_path, *RUN[2:], "model.dtype=float16", "model.lora.r=8",
                                           "optim.lr=1e-3", "trainer.steps=2", f"trainer.device={DEVICE}")))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["loss_scale"] > 1 and r["skipped_updates"] == 0 for r in records)
    adapters = safetensors_of(tmp_path / "final")
    assert {t.dtype for t in adapters.values()} == {torch.float32}
    assert any(float(t.abs().max()) > 0 for k, t in adapters.items() if "lora_B" in k)  # B starts at 0: it trained


def test_a_reward_model_on_a_gpu_without_bf16_computes_in_float16(monkeypatch):
    """rewards.reward_model.dtype: auto picked bfloat16 on every CUDA GPU, which a T4 or V100 (the GPUs float16
    training is for) emulates or refuses."""
    from gspo.rewards.model import auto_dtype

    assert auto_dtype(torch.device("cpu")) == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert auto_dtype(torch.device("cuda")) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_dtype(torch.device("cuda")) == "bfloat16"

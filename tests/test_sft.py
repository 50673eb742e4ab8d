"""`gspo.sft`: the cold start's supervised fine-tuning. Each step is an AdamW step (warm-up, cosine decay to 0) on the
token-mean negative log-likelihood of the trained tokens of a batch its seed draws; a loss target stops it at the
first step after warm-up whose running mean reaches it; `cold_start` records what it did and a rerun reuses it."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math

import pytest
import torch

from conftest import DEMO, tiny_overrides
from gspo import sft as sft_module
from gspo.config import load_config
from gspo.data import make_task
from gspo.logprobs import completion_logprobs
from gspo.models import build_preset
from gspo.optim import make_optimizer
from gspo.sft import cold_start, encode_pairs, sft

DEMONSTRATION = [{"role": "assistant", "content": "calc(2*3)"}, {"role": "tool", "content": "6"},
                 {"role": "assistant", "content": "6"}]


def test_sft_takes_adamw_steps_on_the_token_mean_nll_of_the_trained_tokens():
    """Three steps on one multi-turn demonstration (so every batch is the same) equal the reference loop: the loss is
    the mean NLL over the assistant tokens only (the tool's reply is context: not in the denominator), the gradient is
    clipped to norm 1 and zeroed after each step, and the rate warms up then decays by cosine to 0 (step 3 at lr/2)."""
    model, tokenizer = build_preset("tiny-dense", seed=0)
    reference = copy.deepcopy(model).train()
    losses = sft(model, tokenizer, [{"prompt": "2*3=", "solution": DEMONSTRATION}], steps=3, batch_size=2, lr=1e-2,
                 warmup_steps=1, progress=False)

    optimizer, scheduler = make_optimizer(reference, 1e-2, 3, warmup_steps=1, min_lr_ratio=0.0)
    p_ids, p_mask, c_ids, c_mask, trained = encode_pairs(tokenizer, ["2*3="] * 2, [DEMONSTRATION] * 2)
    assert c_mask.sum() > trained.sum()  # the tool's reply is in the completion, not trained
    want, norms = [], []
    for _ in range(3):
        logprobs, _ = completion_logprobs(reference, p_ids, p_mask, c_ids, c_mask, trim_padding=True)
        loss = -logprobs[trained.bool()].mean()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        want.append(loss.item())
    assert max(norms) > 1  # the clipping is not vacuous
    assert losses == pytest.approx(want, rel=1e-5)
    for (name, got), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5, msg=name)


def _run(rows, *, steps, warmup_steps=0, target_loss=None, seed=0):
    model, tokenizer = build_preset("tiny-dense", seed=0)
    return sft(model, tokenizer, rows, steps=steps, batch_size=2, lr=3e-3, warmup_steps=warmup_steps, seed=seed,
               target_loss=target_loss, progress=False)


def test_a_loss_target_stops_at_the_first_step_after_warm_up_whose_running_mean_reaches_it():
    """The stop looks at the ~20-step running mean (0.95·mean + 0.05·loss), not the noisy last loss, and never
    before max(warmup_steps, 20) + 1 steps; the steps it takes are those of the run without a target."""
    rows = make_task("addition", split="train", size=32, seed=0)
    full = _run(rows, steps=28)
    running = list(itertools.accumulate(full, lambda mean, loss: 0.95 * mean + 0.05 * loss))
    target = running[24]
    stop = next(n for n in range(21, 29) if running[n - 1] <= target)
    assert any(full[n - 1] <= target for n in range(21, stop))  # the last loss alone reached it earlier
    assert _run(rows, steps=28, target_loss=target) == full[:stop]
    assert len(_run(rows, steps=23, target_loss=1e9)) == 21  # any loss meets this target: the earliest stop
    assert len(_run(rows, steps=23, warmup_steps=21, target_loss=1e9)) == 22


def test_the_seed_draws_the_batches():
    """The same seed gives the same steps; another seed other batches (another first loss from the same model)."""
    rows = make_task("addition", split="train", size=32, seed=0)
    first = _run(rows, steps=2, seed=1)
    assert _run(rows, steps=2, seed=1) == first
    assert _run(rows, steps=2, seed=2)[0] != first[0]


def test_sft_warns_when_its_warm_up_is_as_long_as_its_steps(caplog):
    """A warm-up of all the steps never lets the rate decay (and reaches lr only at the last step): warned, like
    optim.warmup_steps. One step shorter is not."""
    rows = make_task("addition", split="train", size=8, seed=0)
    with caplog.at_level(logging.WARNING, logger="gspo.sft"):
        _run(rows, steps=2, warmup_steps=2)
    assert "warmup_steps=2 is not below its 2 steps" in caplog.text and "reaches 100% of lr" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gspo.sft"):
        _run(rows, steps=2, warmup_steps=1)
    assert "warmup_steps" not in caplog.text


def _recording_sft(monkeypatch) -> list[tuple[dict, list[float]]]:
    """Wrap `sft` (it still runs) so that each call records its keyword arguments and the losses it returned."""
    calls = []
    real = sft_module.sft

    def recording(*args, **kwargs):
        calls.append((kwargs, real(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(sft_module, "sft", recording)
    return calls


def test_cold_start_records_its_steps_and_final_loss_and_a_rerun_loads_its_model_instead(tmp_path, monkeypatch):
    """OUT/cold_start/sft.json holds the steps taken and the mean of the last (up to 20) losses; a second call (a
    resumed run) trains nothing, loads the saved weights into the model it is given and returns the same record."""
    calls = _recording_sft(monkeypatch)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start.steps=3", "cold_start.batch_size=4"))
    rows = make_task("addition", split="train", size=16, seed=0)
    model, tokenizer = build_preset("tiny-dense", seed=0)
    info = cold_start(cfg, tmp_path, model, tokenizer, rows)
    ((_, losses),) = calls
    assert info["steps"] == len(losses) == 3 and len(set(losses)) == 3
    assert info["final_loss"] == pytest.approx(sum(losses) / 3)
    assert json.loads((tmp_path / "cold_start" / "sft.json").read_text()) == info

    fresh, _ = build_preset("tiny-dense", seed=1)
    assert cold_start(cfg, tmp_path, fresh, tokenizer, rows) == info
    assert len(calls) == 1
    for (name, got), want in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_the_cold_starts_batches_follow_the_trainer_seed(tmp_path, monkeypatch):
    """trainer.seed reaches the cold start: two runs that differ only in it draw other SFT batches."""
    calls = _recording_sft(monkeypatch)
    rows = make_task("addition", split="train", size=32, seed=0)
    for seed in (1, 2):
        cfg = load_config(DEMO, tiny_overrides(tmp_path / str(seed), "cold_start.steps=1", "cold_start.batch_size=4",
                                               f"trainer.seed={seed}"))
        model, tokenizer = build_preset("tiny-dense", seed=0)
        cold_start(cfg, tmp_path / str(seed), model, tokenizer, rows)
    assert calls[0][0]["seed"] != calls[1][0]["seed"] and calls[0][1] != calls[1][1]


def test_a_failed_step_neither_stops_the_loss_target_nor_poisons_the_final_loss(tmp_path, monkeypatch):
    """One step whose loss is NaN (a numerical failure: skipped, weights untouched) leaves the running mean of the
    loss-target stop and sft.json's final_loss to the finite steps: the run stops at the same earliest step as one
    without the failure, and its final loss is a number. Before, one NaN held the running mean at NaN for the rest of
    the run (the target never met: every step taken) and made the final loss NaN."""
    real, calls = sft_module.completion_logprobs, []

    def failing_third_call(*args, **kwargs):
        calls.append(None)
        logprobs, entropy = real(*args, **kwargs)
        return (logprobs * float("nan") if len(calls) == 3 else logprobs), entropy

    monkeypatch.setattr(sft_module, "completion_logprobs", failing_third_call)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start.steps=25", "cold_start.batch_size=2",
                                           "cold_start.warmup_steps=0", "cold_start.target_loss=1e9"))
    rows = make_task("addition", split="train", size=16, seed=0)
    model, tokenizer = build_preset("tiny-dense", seed=0)
    info = cold_start(cfg, tmp_path, model, tokenizer, rows)
    assert info["steps"] == 21  # the earliest stop: after max(warmup, 20) steps
    assert math.isfinite(info["final_loss"]) and info["final_loss"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())

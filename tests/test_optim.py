"""`make_optimizer`: the fused AdamW kernel (the default where it applies) makes the same updates as torch's
reference AdamW, up to float rounding; weights too coarse for the learning rate (pure bf16 at RL rates) are refused."""

from __future__ import annotations

import pytest
import torch

from gspo.models import build_preset
from gspo.optim import can_fuse, lost_update_fraction, make_optimizer


def _train(fused: bool, steps: int = 5) -> dict[str, torch.Tensor]:
    model, _ = build_preset("tiny-moe", seed=1)
    optimizer, scheduler = make_optimizer(model, 1e-3, 10, weight_decay=0.01, warmup_steps=2, fused=fused)
    ids = torch.randint(3, model.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fused_adamw_equals_the_reference_implementation():
    reference, fused = _train(fused=False), _train(fused=True)
    start = {n: p.detach() for n, p in build_preset("tiny-moe", seed=1)[0].named_parameters()}
    moved = max(float((reference[n] - start[n]).abs().max()) for n in reference)
    assert moved > 1e-3  # the comparison is not vacuous: 5 steps of lr 1e-3 moved the weights
    for name, p in reference.items():
        torch.testing.assert_close(fused[name], p, atol=1e-6, rtol=1e-5, msg=name)


def test_fused_is_the_default_for_plain_cpu_parameters():
    model, _ = build_preset("tiny-dense")
    optimizer, _ = make_optimizer(model, 1e-3, 10)
    assert optimizer.defaults["fused"] is True
    assert can_fuse(list(model.parameters()))
    assert not can_fuse([])
    assert not can_fuse([torch.zeros(2, dtype=torch.long)])


@pytest.mark.parametrize("lr", [1e-6, 1e-5, 1e-4, 1e-3])
def test_lost_update_fraction_predicts_the_weights_an_adamw_step_leaves_unchanged(lr):
    """Pure bf16 weights: AdamW's first step moves every weight by ±lr, which round-to-nearest drops wherever it is
    under half the bf16 spacing. The predicted fraction is the observed fraction of unchanged weights."""
    model, _ = build_preset("tiny-moe", seed=0, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    predicted = lost_update_fraction(list(model.parameters()), lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    optimizer.step()
    nonzero = sum(int((b != 0).sum()) for b in before)
    unchanged = sum(int(((p == b) & (b != 0)).sum()) for p, b in zip(model.parameters(), before, strict=True))
    assert abs(predicted - unchanged / nonzero) < 0.005, (predicted, unchanged / nonzero)


def test_float32_weights_lose_no_updates_and_bf16_weights_at_rl_rates_are_refused():
    fp32, _ = build_preset("tiny-moe", seed=0)
    assert lost_update_fraction(list(fp32.parameters()), 1e-7) == 0.0
    make_optimizer(fp32, 1e-7, 10)  # accepted
    bf16, _ = build_preset("tiny-moe", seed=0, dtype=torch.bfloat16)
    assert lost_update_fraction(list(bf16.parameters()), 1e-6) > 0.9
    with pytest.raises(ValueError, match=r"rounds away on 9\d\.\d% .*mixed_precision=bfloat16"):
        make_optimizer(bf16, 1e-6, 10)
    make_optimizer(bf16, 1e-3, 10)  # a rate the bf16 weights can follow (<1% lost) is accepted


def test_the_learning_rate_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    """warmup_cosine(10, 4, 0.1): the first update already runs at 1/4 of the rate (not 0), the rate reaches the full
    rate at the end of the warm-up, falls along a half cosine over the 6 remaining steps to the floor `min_ratio` and
    stays there; without cosine it stays at the full rate after the warm-up."""
    from gspo.optim import warmup_cosine

    factor = warmup_cosine(10, 4, 0.1)
    assert [factor(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factor(4) == pytest.approx(1.0)
    assert factor(7) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay: half way down to the floor
    assert factor(10) == pytest.approx(0.1) and factor(25) == pytest.approx(0.1)
    constant = warmup_cosine(10, 4, 0.1, cosine=False)
    assert [constant(s) for s in (0, 3, 4, 7, 10, 25)] == pytest.approx([0.25, 1.0, 1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize(("cosine", "floor"), [(True, 0.2), (False, 1.0)])
def test_make_optimizer_steps_the_rate_along_its_own_floor_and_shape(cosine, floor):
    """make_optimizer passes min_lr_ratio and cosine to its schedule: after warm-up and decay the optimizer's rate is
    lr × min_lr_ratio (cosine) or lr (constant), never the defaults'."""
    layer = torch.nn.Linear(2, 2)
    optimizer, scheduler = make_optimizer(layer, 1e-3, 6, warmup_steps=2, min_lr_ratio=0.2, cosine=cosine)
    rates = []
    for _ in range(8):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:2] == pytest.approx([5e-4, 1e-3])
    assert rates[-1] == pytest.approx(1e-3 * floor)


def test_make_optimizer_applies_its_weight_decay():
    """AdamW's decoupled weight decay: with zero gradients one step at rate lr shrinks every weight by (1 - lr·wd)."""
    layer = torch.nn.Linear(4, 4)
    before = layer.weight.detach().clone()
    optimizer, _ = make_optimizer(layer, 1e-2, 10, weight_decay=0.5, warmup_steps=0)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    torch.testing.assert_close(layer.weight.detach(), before * (1 - 1e-2 * 0.5))


def test_the_warm_up_warning_starts_at_a_warm_up_as_long_as_the_run():
    """A warm-up of exactly the run's optimizer steps never reaches optim.lr before the last step: warned. One step
    shorter (or a run of no steps) is not."""
    from gspo.optim import warmup_warning

    assert "reaches 100% of optim.lr" in warmup_warning(12, 12)
    assert "reaches 50% of optim.lr" in warmup_warning(24, 12)
    assert warmup_warning(11, 12) is None and warmup_warning(5, 0) is None


def test_lost_update_fraction_ignores_zero_weights():
    """Zeros are no weights a step could lose (a zero-initialised bias or LoRA B moves by lr from 0 in any dtype):
    neither counted as lost nor in the total, so bf16 zeros beside weights that follow lr 1e-3 give 0, not above 1."""
    w = torch.tensor([0.0, 0.0, 0.0, 1e-3], dtype=torch.bfloat16)
    assert lost_update_fraction([w], 1e-3) == 0.0
    assert lost_update_fraction([torch.zeros(8, dtype=torch.bfloat16)], 1e-3) == 0.0


def _with_float32_norms(dtype: torch.dtype) -> torch.nn.Module:
    """tiny-moe in `dtype` with its norm weights kept in float32 (as models that keep some modules in float32)."""
    model, _ = build_preset("tiny-moe", seed=0, dtype=dtype)
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float()
    assert {p.dtype for p in model.parameters()} == {dtype, torch.float32}
    return model


def test_weights_partly_float32_are_checked_for_lost_updates_and_float16_refused():
    """The precision checks look at every trainable weight: bf16 weights beside a few float32 ones are refused at an
    RL rate, float16 weights beside float32 ones are refused at any rate."""
    with pytest.raises(ValueError, match=r"rounds away on"):
        make_optimizer(_with_float32_norms(torch.bfloat16), 1e-6, 10)
    with pytest.raises(ValueError, match=r"float16 weights cannot be trained"):
        make_optimizer(_with_float32_norms(torch.float16), 1e-3, 10)


def test_scale_lr_refuses_a_factor_that_is_not_positive():
    """A factor of 0 would stop training silently (every later rate 0); negative would ascend the loss."""
    from gspo.optim import scale_lr

    optimizer, scheduler = make_optimizer(torch.nn.Linear(2, 2), 1e-3, 10, warmup_steps=0)
    for factor in (0.0, -0.5, float("nan")):
        with pytest.raises(ValueError, match="factor must be > 0"):
            scale_lr(optimizer, scheduler, factor)
    assert optimizer.param_groups[0]["lr"] == 1e-3 and scheduler.base_lrs == [1e-3]

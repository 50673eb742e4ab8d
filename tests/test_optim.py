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

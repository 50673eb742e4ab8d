"""`make_optimizer`: the fused AdamW kernel (the default where it applies) makes the same updates as torch's
reference AdamW, up to float rounding."""

from __future__ import annotations

import torch

from gspo.models import build_preset
from gspo.optim import can_fuse, make_optimizer


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

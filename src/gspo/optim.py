"""Optimizer and learning-rate schedule shared by the RL trainer and cold-start SFT."""

from __future__ import annotations

import math

import torch
from torch import nn


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float, cosine: bool = True):
    """LR multiplier: linear warm-up from 1/warmup to 1, then cosine decay to `min_ratio` (or constant)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizer(
    model: nn.Module,
    lr: float,
    total_steps: int,
    *,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    cosine: bool = True,
    fused: bool | None = None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters with a warm-up + cosine LambdaLR (stepped once per optimizer step).

    `fused=None` uses torch's fused AdamW kernel where it applies (`can_fuse`): one kernel per step instead of ~10
    ops per parameter tensor, the same update up to float rounding (tests/test_optim.py), and the same state dict.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = can_fuse(params) if fused is None else fused
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)
    schedule = warmup_cosine(total_steps, warmup_steps, min_lr_ratio, cosine)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def can_fuse(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW supports these parameters: plain (not DTensor or other subclass) floating-point
    tensors, all on one CPU or CUDA device."""
    if not params:
        return False
    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
            and all(type(p) in (torch.Tensor, nn.Parameter) and p.is_floating_point() for p in params))

"""Optimizer and learning-rate schedule shared by the RL trainer and cold-start SFT."""

from __future__ import annotations

import math
import warnings

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


def warmup_warning(warmup_steps: int, total_steps: int) -> str | None:
    """What is wrong with a warm-up as long as the run (`optim.warmup_steps` counts optimizer steps: trainer.steps ×
    algorithm.minibatches × algorithm.epochs, which is easy to mistake for RL steps), or None when it is shorter."""
    if warmup_steps < total_steps or total_steps < 1:
        return None
    return (f"optim.warmup_steps={warmup_steps} is not below the run's {total_steps} optimizer steps (trainer.steps × "
            f"algorithm.minibatches × algorithm.epochs): the learning rate rises for the whole run and reaches "
            f"{total_steps / warmup_steps:.0%} of optim.lr at its end")


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

    Raises ValueError when the parameters' precision cannot represent steps of size `lr` (check_update_precision).
    `fused=None` uses torch's fused AdamW kernel where it applies (`can_fuse`): one kernel per step instead of ~10
    ops per parameter tensor, the same update up to float rounding (tests/test_optim.py), and the same state dict.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    check_update_precision([p for p in params if type(p) in (torch.Tensor, nn.Parameter)], lr)
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


LOST_UPDATES_MAX = 0.5
"""make_optimizer refuses weights on which more than this fraction of AdamW steps of size lr would round away."""


def lost_update_fraction(params: list[torch.Tensor], lr: float) -> float:
    """Fraction of the non-zero weight elements that a step of size `lr` leaves unchanged after rounding to their dtype.

    AdamW moves every weight by about lr per step (m̂/√v̂ ≈ ±1; exactly ±lr on the first step). A float with machine
    epsilon ε and |w| in [2^e, 2^(e+1)) is spaced ε·2^e apart, so round-to-nearest drops the step when
    lr < ε·2^(e−1). For bfloat16 (ε = 2^-7) that is every |w| ≥ 256·lr: at lr 1e-6 every weight from 2.6e-4 up
    (98% of the tiny-moe preset's) never moves. float32 (ε = 2^-23) only loses steps on |w| ≥ 8.4e6·lr.
    """
    lost = total = 0
    for p in params:
        if not p.is_floating_point() or p.numel() == 0:
            continue
        w = p.detach().float()
        _, exponent = torch.frexp(w)  # |w| = m·2^exponent with m in [0.5, 1): the binade's e = exponent − 1
        spacing_half = torch.finfo(p.dtype).eps * torch.pow(2.0, (exponent - 2).float())
        nonzero = w != 0
        lost += int((nonzero & (spacing_half > lr)).sum())
        total += int(nonzero.sum())
    return lost / total if total else 0.0


def check_update_precision(params: list[torch.Tensor], lr: float) -> None:
    """Refuse to train weights whose dtype rounds most AdamW steps of size `lr` away (pure bfloat16/float16 weights at
    RL learning rates): the run would look healthy while its policy barely changes. float16 weights are refused at
    any rate: their gradients need loss scaling (below 6e-8 a float16 gradient is 0), and a scaled gradient is
    unscaled into float32 weights' gradients (torch's GradScaler refuses float16 ones)."""
    if any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            "float16 weights cannot be trained: their gradients underflow without loss scaling, which unscales into "
            "float32 gradients. Train float32 weights with float16 compute (model.dtype=float32, "
            "trainer.mixed_precision=float16), or LoRA adapters (float32) over the float16 model")
    fraction = lost_update_fraction(params, lr) if any(p.dtype != torch.float32 for p in params) else 0.0
    if fraction > LOST_UPDATES_MAX:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        raise ValueError(
            f"learning rate {lr:g} is below the resolution of the {'/'.join(dtypes)} weights: an AdamW step of that "
            f"size rounds away on {fraction:.1%} of them. Train float32 weights with low-precision compute instead "
            f"(model.dtype=float32, trainer.mixed_precision=bfloat16), or raise the learning rate")


def settle_scale(scaler: torch.amp.GradScaler, failed: bool) -> None:
    """End an update under a loss scale: applied, or skipped for an overflow, `scaler.update()` (an overflow halves the
    scale, clean updates grow it); skipped as a failure (a non-finite loss, e.g. an fp16 forward past 65504, or a
    non-finite gradient under a scale ≤ 1), the scale is kept: halving it cannot help, and failures scattered through a
    run would push it below 1, where clean updates lose their gradients to underflow with nothing flagged."""
    if failed:
        scaler.update(scaler.get_scale())  # resets the overflow checks for the next update, scale unchanged
    else:
        scaler.update()


def overflowed(scaler: torch.amp.GradScaler | None, loss_finite: bool) -> bool:
    """Whether an update with a non-finite gradient overflowed its loss scale (skipped, scale halved: not a failure):
    its loss is finite and the scale above 1 (under a scale ≤ 1 no gradient is larger than it is: it is not finite
    itself)."""
    return scaler is not None and scaler.get_scale() > 1 and loss_finite


def step_schedule(scheduler) -> None:
    """Step the learning-rate schedule after an optimizer update, applied or skipped (non-finite, or a float16 loss
    scale's overflow): the schedule counts updates, not applied ones. torch warns when the schedule steps before the
    first `optimizer.step()`, which is what a skipped first update is: not an error here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def scale_lr(optimizer: torch.optim.Optimizer, scheduler, factor: float) -> None:
    """Multiply the learning rate by `factor` from now on: the scheduler's base rates (so warm-up and decay keep their
    shape) and the optimizer's current rates. The scaled base rates are part of the scheduler's state, so a checkpoint
    taken afterwards resumes with them (the collapse guard's lower learning rate after a rollback)."""
    if not factor > 0:
        raise ValueError(f"learning-rate factor must be > 0, got {factor}")
    scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor


INITIAL_LOSS_SCALE = 2.0**16
"""The float16 loss scale a run starts from (torch's GradScaler default); halved at every overflow, doubled after
`LOSS_SCALE_GROWTH_INTERVAL` updates without one."""
LOSS_SCALE_GROWTH_INTERVAL = 2000


def loss_scaler(model: nn.Module, mixed_precision: str | None, fsdp: bool = False) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler where the training forwards compute in float16 (`trainer.mixed_precision=float16`, or
    float16 weights under trainable float32 LoRA adapters), else None (bfloat16 and float32 have float32's range).

    Why: a float16 gradient below 6e-8 is 0 and below 6.1e-5 loses precision, and an RL loss's activation gradients
    (advantages of order 1 over thousands of tokens) sit there. The loss is multiplied by the scale before backward,
    the gradients divided by it (into float32) before clipping; an update whose scaled gradient overflowed is skipped
    and the scale halved (`gspo.learner.learn` counts it as `overflow_updates`). Under FSDP2 the scaler all-reduces
    its overflow check over the processes (ShardedGradScaler): their gradient shards differ (under DDP they agree)."""
    half = mixed_precision == "float16" or any(p.dtype == torch.float16 for p in model.parameters())
    if not half:
        return None
    device = next(model.parameters()).device.type
    kwargs = {"init_scale": INITIAL_LOSS_SCALE, "growth_interval": LOSS_SCALE_GROWTH_INTERVAL}
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, **kwargs)
    return torch.amp.GradScaler(device, **kwargs)

"""Reward shaping by completion length: DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13)."""

from __future__ import annotations

import torch

__all__ = ["add_overlong_penalty", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """R_length of DAPO's Eq. 13, scaled by `penalty`, for completion lengths |y| [N] (tokens):

        0                                   |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache  L_max − L_cache < |y| ≤ L_max
        −1                                  L_max < |y|

    with L_max = `max_new_tokens` and L_cache = `buffer`: a linear ramp from 0 to −`penalty` over the last `buffer`
    tokens of the budget, so an answer that runs long is worth less before it is cut off. Added to the reward."""
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    start = max_new_tokens - buffer
    ramp = (start - lengths.float()) / buffer
    return penalty * torch.where(lengths > max_new_tokens, torch.full_like(ramp, -1.0), ramp.clamp(max=0.0))


def add_overlong_penalty(total: torch.Tensor, stats: dict[str, float], lengths: torch.Tensor, max_new_tokens: int,
                         buffer: int | None, penalty: float) -> tuple[torch.Tensor, dict[str, float]]:
    """`total` rewards [N] plus `overlong_penalty` of the completion `lengths` [N] when `buffer` is set (the config's
    rewards.overlong_buffer), and `stats` with its mean as `reward/overlong`; unchanged when `buffer` is None
    (applied by `gspo.rewards.score_trajectory`)."""
    if buffer is None:
        return total, stats
    shaped = overlong_penalty(lengths.cpu(), max_new_tokens, buffer, penalty).to(total.device)
    return total + shaped, {**stats, "reward/overlong": float(shaped.mean())}

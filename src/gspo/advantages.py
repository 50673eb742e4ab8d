"""Group-normalised advantages (Eq. 6) and the zero-variance filter used by dynamic sampling."""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and view rewards [P·G] as [P, G] (group-contiguous: rows g·G .. g·G+G−1 share a prompt)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the group std needs two samples), got {group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"reward at index {i} (group {i // group_size}) is {rewards[i].item()}; rewards must be "
                         f"finite ({bad.numel()} non-finite in total)")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)


def zero_variance_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[P] bool: groups whose rewards are all equal (std ≤ eps). They carry no signal: their advantages are 0, and
    dynamic sampling (DAPO) drops them."""
    return _grouped(rewards, group_size).std(-1, correction=1) <= eps


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Scale = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Â_i of Eq. 6: (r_i − mean(group)) / std(group), with the sample std (n − 1).

    Rewards 0.8, 0.4, 0.6 give +1, −1, 0. `scale="batch"` divides by the std of all rewards in the batch instead;
    `"none"` only subtracts the group mean (Dr.GRPO). A group with std ≤ `eps` gets exactly 0 (no NaN, no
    rounding residue). Returns [P·G] in the rewards' order.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    r = _grouped(rewards, group_size)  # [P, G]
    centred = r - r.mean(-1, keepdim=True)
    flat = r.std(-1, keepdim=True, correction=1) <= eps  # [P, 1]
    if scale == "group":
        adv = centred / torch.where(flat, torch.ones_like(centred), r.std(-1, keepdim=True, correction=1))
    elif scale == "batch":
        std = r.flatten().std(correction=1)
        adv = centred / std if std > eps else centred
    else:
        adv = centred
    return torch.where(flat, torch.zeros_like(adv), adv).flatten()

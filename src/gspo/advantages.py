"""Group-normalised advantages (Eq. 6) and the zero-variance filter used by dynamic sampling."""

from __future__ import annotations

import math
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Validate and view rewards [P·G] as [P, G] (group-contiguous: rows g·G .. g·G+G−1 share a prompt)."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
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


def _check_eps(eps: float) -> None:
    """A negative `eps` would let an all-equal group through to 0/0: NaN advantages."""
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _valid(valid: torch.Tensor | None, rewards: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Validate and view `valid` [P·G] bool (which completions count; None: all) as [P, G]."""
    if valid is None:
        return None
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(f"valid must be a bool tensor of the rewards' shape {tuple(rewards.shape)}, got "
                         f"{getattr(valid, 'dtype', type(valid).__name__)} {tuple(getattr(valid, 'shape', ()))}")
    return valid.to(rewards.device).view(-1, group_size)


def _group_stats(r: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's mean and sample std (n − 1), [P, 1] each, over its rewards `r` [P, G], or over its `valid`
    members only (a completion that does not count, e.g. an episode its environment failed, leaves its group's
    baseline). A group with fewer than two valid members has std 0: no signal."""
    if valid is None:
        return r.mean(-1, keepdim=True), r.std(-1, keepdim=True, correction=1)
    v = valid.to(r.dtype)
    n = v.sum(-1, keepdim=True)
    mean = (r * v).sum(-1, keepdim=True) / n.clamp(min=1)
    var = (((r - mean) * v) ** 2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
    return mean, torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))


def _batch_std(r: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The sample std of every (valid) reward of the batch; 0 with fewer than two."""
    values = r.flatten() if valid is None else r[valid]
    return values.std(correction=1) if values.numel() >= 2 else torch.zeros((), dtype=r.dtype, device=r.device)


def zero_variance_groups(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """[P] bool: groups whose rewards are all equal (std ≤ eps; over their `valid` members, as `group_advantages`
    takes them: fewer than two is no signal either). They carry no signal: their advantages are 0, and dynamic
    sampling (DAPO) drops them."""
    _check_eps(eps)
    r = _grouped(rewards, group_size)
    return _group_stats(r, _valid(valid, rewards, group_size))[1].squeeze(-1) <= eps


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Scale = "group", eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Â_i of Eq. 6: (r_i − mean(group)) / std(group), with the sample std (n − 1).

    Rewards 0.8, 0.4, 0.6 give +1, −1, 0. `scale="batch"` divides by the std of all rewards in the batch instead;
    `"none"` only subtracts the group mean (Dr.GRPO). A group with std ≤ `eps` gets exactly 0 (no NaN, no
    rounding residue). `valid` [P·G] bool: the completions that count (None: all); the mean and std are over a
    group's valid members, and the others get 0 (`env.on_failure: mask`: an episode its environment failed is
    neither trained on nor part of its group's baseline). Returns [P·G] in the rewards' order.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    _check_eps(eps)
    r = _grouped(rewards, group_size)  # [P, G]
    ok = _valid(valid, rewards, group_size)
    mean, std = _group_stats(r, ok)
    centred = r - mean
    flat = std <= eps  # [P, 1]
    if scale == "group":
        adv = centred / torch.where(flat, torch.ones_like(centred), std)
    elif scale == "batch":
        std = _batch_std(r, ok)
        adv = centred / std if std > eps else centred
    else:
        adv = centred
    zero = flat if ok is None else flat | ~ok
    return torch.where(zero, torch.zeros_like(adv), adv).flatten()


def turn_advantages(token_rewards: torch.Tensor, loss_mask: torch.Tensor, group_size: int, scale: Scale = "group",
                    eps: float = 1e-6, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages Â_{i,t} of a multi-turn episode, for GSPO-token (Eq. 13/14) and the token-advantage
    objectives: the group-normalised reward-to-go (this library's choice; the paper leaves Â_{i,t} open)

        Â_{i,t} = (G_{i,t} − mean_j R_j) / std_j R_j,   G_{i,t} = Σ_{t' ≥ t} r_{i,t'},   R_j = G_{j,0}

    with `token_rewards` r [N, T] (each turn's reward on its last policy token, the final answer's on the episode's
    last), the mean and sample std over the episode returns R of the group, scaled as `group_advantages` says.
    A token is credited with the rewards of its own turn and the turns after it, not those before: the episode's
    first turn gets exactly Eq. 6's Â_i, and when only the final answer is rewarded every token gets Â_i (GSPO-token
    then equals GSPO, as the paper notes). A group whose returns are all equal is not rescaled (std 1), so its later
    turns keep the credit of their own rewards. `valid` [N] bool as in `group_advantages`: the statistics are over
    the valid episodes of a group, and the others get 0. 0 off `loss_mask`. Returns [N, T] float."""
    _check_eps(eps)
    if not (isinstance(token_rewards, torch.Tensor) and isinstance(loss_mask, torch.Tensor)):
        raise ValueError(f"token_rewards and loss_mask must be torch.Tensors, got {type(token_rewards).__name__} and "
                         f"{type(loss_mask).__name__}")
    if token_rewards.shape != loss_mask.shape or token_rewards.dim() != 2:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and loss_mask {tuple(loss_mask.shape)} must be "
                         "the same [N, T] shape")
    returns = _grouped(token_rewards.sum(-1), group_size)  # [P, G]; also validates finiteness and grouping
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    ok = _valid(valid, token_rewards.sum(-1), group_size)
    mean, std = _group_stats(returns, ok)
    to_go = token_rewards.to(returns.dtype).flip(-1).cumsum(-1).flip(-1).view(returns.shape[0], group_size, -1)
    centred = to_go - mean[..., None]
    if scale == "group":
        std = torch.where(std <= eps, torch.ones_like(std), std)[..., None]
    elif scale == "batch":
        std = _batch_std(returns, ok)
        std = std if std > eps else torch.ones_like(std)
    else:
        std = torch.ones(())
    keep = loss_mask.to(returns.dtype) if ok is None else loss_mask.to(returns.dtype) * ok.flatten()[:, None]
    return (centred / std).view_as(token_rewards) * keep

"""Train–inference mismatch correction: importance weights and masks for π_old ≠ μ (issue 16).

When the learner recomputes π_old (`algorithm.old_logprobs: recompute`), the policy that sampled the tokens is the
rollout engine's μ: possibly older weights (asynchronous rollouts), possibly another precision (a bf16 engine). The
objectives' ratios π_θ/π_old then correct only from π_old on, and the corrections below reweight or drop samples by

    ρ_t = π_old(y_t) / μ(y_t) = exp(log π_old − log μ)          on loss tokens

(verl's rollout_is / rollout_rs; "Your efficient RL framework secretly brings you off-policy RL training": TIS,
IcePop / MIS, Geo-RS). Which form applies follows the objective's own ratio (`Objective.ratio_level`):

    token level     (grpo, dapo, dr_grpo, cispo)  TIS: each token's term × min(ρ_t, C); MIS: tokens with ρ_t outside
                    [low, high] leave the loss
    sequence level  (gspo, gspo_token)           ρ̄_i = exp(mean_t log ρ_t), the length-normalised form of GSPO's
                    Eq. 7 ratio; TIS: Â_i × min(ρ̄_i, C); Geo-RS: sequences with ρ̄_i outside [low, high] leave it

TIS weights are detached and ≥ 0, so they scale the advantages: min(w·r·Â, w·clip(r)·Â) = w·min(r·Â, clip(r)·Â).
Masks are AND-ed into the loss mask, so the objectives' normalising counts leave the dropped tokens out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from gspo.objectives import LOG_RATIO_CLAMP, Objective, RatioLevel

__all__ = ["DEFAULT_MASK_BOUNDS", "Correction", "MismatchMode", "apply_correction", "check_bounds", "mismatch_metrics",
           "resolve_correction", "sequence_keep_mask", "sequence_log_ratio", "sequence_tis_weights", "token_keep_mask",
           "token_log_ratio", "token_tis_weights"]

MismatchMode = Literal["auto", "off", "tis", "mask", "tis+mask"]

DEFAULT_MASK_BOUNDS: dict[RatioLevel, tuple[float, float]] = {"token": (0.5, 2.0), "sequence": (0.5, 2.0)}
"""Keep-mask bounds on ρ when `algorithm.mask_bounds` is not set: IcePop / MIS's [0.5, 2] (|log ρ| ≤ 0.69), at both
levels; at the sequence level on the geometric mean, i.e. a per-token disagreement of 2× on average. Tighter
sequence bounds were measured to hurt: [0.95, 1.05] dropped 32% of GSPO's loss tokens at staleness 2 in `gspo
async-study` (held-out accuracy 58.0% ± 3.5% vs 61.8% ± 2.0% uncorrected): with stale policies the gap is drift,
which a short sequence's mean does not average away, not per-token noise."""


def token_log_ratio(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log ρ_t = log π_old(y_t) − log μ(y_t) on mask tokens, 0 elsewhere ([B, T], detached, float32 at least;
    values at masked positions, ±inf and NaN included, are selected away)."""
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    diff = old_logprobs.detach().to(dtype) - engine_logprobs.detach().to(dtype)
    return torch.where(mask.bool(), diff, diff.new_zeros(()))


def token_tis_weights(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level TIS: w_t = min(ρ_t, C) ([B, T], detached; 1 where log ρ = 0, i.e. off the mask)."""
    return torch.exp(log_rho.detach()).clamp(max=cap)


def token_keep_mask(log_rho: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Token-level MIS (IcePop): mask_t ∧ low ≤ ρ_t ≤ high ([B, T] bool); a NaN ratio is dropped."""
    rho = torch.exp(log_rho)
    return mask.bool() & (rho >= low) & (rho <= high)


def sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log ρ̄_i = 1/|y_i| Σ_t log ρ_t over the sequence's mask tokens ([B]; 0 for an empty sequence): the geometric
    mean ratio ρ̄_i = (π_old(y_i)/μ(y_i))^(1/|y_i|), length-normalised as GSPO's Eq. 7 ratio is, so it never
    under/overflows as the sequence product does on long responses."""
    mask = mask.bool()
    return torch.where(mask, log_rho, log_rho.new_zeros(())).sum(-1) / mask.sum(-1).clamp(min=1).to(log_rho.dtype)


def sequence_keep_mask(seq_log_rho: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Geo-RS (sequence mask): low ≤ ρ̄_i ≤ high ([B] bool); an empty sequence (ρ̄ = 1) is kept."""
    rho = torch.exp(seq_log_rho)
    return (rho >= low) & (rho <= high)


def sequence_tis_weights(seq_log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """Sequence-level TIS: w_i = min(ρ̄_i, C) ([B], detached)."""
    return torch.exp(seq_log_rho.detach()).clamp(max=cap)


def mismatch_metrics(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """How far π_old is from the engine's μ on the sampled tokens (samples come from μ):

        mismatch_kl_k3          1/Σ|y_i| Σ_{i,t} (ρ_t − 1 − log ρ_t), the k3 estimate of KL(μ‖π_old) (≥ 0)
        mismatch_log_ppl_ratio  mean over non-empty sequences of [mean_t(−log π_old) − mean_t(−log μ)] = −log ρ̄_i
    """
    mask = mask.bool()
    log_rho = token_log_ratio(old_logprobs, engine_logprobs, mask)
    clamped = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # exp stays finite
    k3 = torch.where(mask, torch.expm1(clamped) - clamped, clamped.new_zeros(())).sum() / mask.sum().clamp(min=1)
    nonempty = mask.any(-1)
    ppl = -sequence_log_ratio(log_rho, mask)[nonempty]
    return {"mismatch_kl_k3": float(k3), "mismatch_log_ppl_ratio": float(ppl.mean()) if ppl.numel() else 0.0}


@dataclass(frozen=True)
class Correction:
    """A resolved correction: the objective's ratio level, the TIS cap C (None: no TIS) and the keep-mask bounds
    [low, high] on ρ (None: no mask)."""

    level: RatioLevel
    tis_cap: float | None = None
    bounds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ValueError(f"level must be 'token' or 'sequence', got {self.level!r}")
        if self.tis_cap is None and self.bounds is None:
            raise ValueError("a correction needs a TIS cap, mask bounds, or both")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap > 1):
            raise ValueError(f"the TIS cap must be a finite number > 1, got {self.tis_cap}")
        if self.bounds is not None:
            check_bounds(self.bounds)


def check_bounds(bounds: tuple[float, float]) -> None:
    """Mask bounds must satisfy 0 < low < 1 < high < ∞ (ρ = 1, no mismatch, is always kept)."""
    low, high = bounds
    if not (0 < low < 1 < high < math.inf):
        raise ValueError(f"mask bounds must satisfy 0 < low < 1 < high (finite), got [{low}, {high}]")


def resolve_correction(mode: MismatchMode, objective: Objective, *, recompute: bool, asynchronous: bool,
                       tis_cap: float, mask_bounds: tuple[float, float] | None) -> Correction | None:
    """The correction a run applies (None: none). "auto" is "tis+mask" when π_old is recomputed and rollouts are
    asynchronous (μ is then an older policy), else off; a token-level objective that takes no per-token advantages
    gets no TIS (its weights scale the advantages per token). With π_old from the engine, π_old is μ (ρ ≡ 1): any
    explicit correction is an error. `mask_bounds` None: `DEFAULT_MASK_BOUNDS` of the objective's level."""
    if mode == "off" or (mode == "auto" and not (recompute and asynchronous)):
        return None
    if not recompute:
        raise ValueError(f"algorithm.mismatch={mode} corrects a recomputed π_old towards the engine's μ; with "
                         "algorithm.old_logprobs=rollout, π_old is μ (ρ ≡ 1): use old_logprobs=recompute or "
                         "mismatch=off")
    level = objective.ratio_level
    tis_ok = level == "sequence" or objective.token_advantages
    if mode == "auto":
        mode = "tis+mask" if tis_ok else "mask"
    if "tis" in mode and not tis_ok:
        raise ValueError(f"algorithm.mismatch={mode}: token-level TIS scales the advantages per token, which this "
                         "objective does not accept (Objective.token_advantages); use mismatch=mask")
    return Correction(level=level, tis_cap=tis_cap if "tis" in mode else None,
                      bounds=(mask_bounds or DEFAULT_MASK_BOUNDS[level]) if "mask" in mode else None)


def apply_correction(correction: Correction, old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                            dict[str, float]]:
    """(advantages, loss mask, metrics) with the correction applied to a batch. Token level: advantages become
    [B, T] Â·w_t under TIS, the mask drops tokens outside the bounds. Sequence level: Â_i (each row of [B, T]
    advantages) × w_i, the mask drops whole sequences. Metrics: `mismatch_masked_frac`, the fraction of the loss
    tokens dropped; `mismatch_truncated_frac`, the fraction of the loss tokens (token level) or non-empty sequences
    (sequence level) that stay in the loss with their weight capped at C."""
    mask = mask.bool()
    log_rho = token_log_ratio(old_logprobs, engine_logprobs, mask)
    c, keep, truncated = correction, mask, torch.zeros((), device=mask.device)
    if c.level == "sequence":
        seq = sequence_log_ratio(log_rho, mask)
        nonempty = mask.any(-1)
        if c.bounds is not None:
            keep = mask & sequence_keep_mask(seq, *c.bounds)[:, None]
        if c.tis_cap is not None:
            w = sequence_tis_weights(seq, c.tis_cap).to(advantages.dtype)
            advantages = advantages * (w if advantages.dim() == 1 else w[:, None])
            capped = (torch.exp(seq) > c.tis_cap) & keep.any(-1)
            truncated = capped.sum() / nonempty.sum().clamp(min=1)
    else:
        if c.bounds is not None:
            keep = token_keep_mask(log_rho, mask, *c.bounds)
        if c.tis_cap is not None:
            w = token_tis_weights(log_rho, c.tis_cap).to(advantages.dtype)
            advantages = (advantages[:, None] if advantages.dim() == 1 else advantages) * w
            truncated = ((torch.exp(log_rho) > c.tis_cap) & keep).sum() / mask.sum().clamp(min=1)
    masked = (mask & ~keep).sum() / mask.sum().clamp(min=1)
    return advantages, keep, {"mismatch_masked_frac": float(masked), "mismatch_truncated_frac": float(truncated)}

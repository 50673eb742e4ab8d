"""Policy-gradient objectives as pure tensor functions: GSPO (Eq. 5/7), GSPO-token (Eq. 13/14), GRPO (Eq. 2) and the
baselines users compare against (DAPO, Dr.GRPO, CISPO). Equation numbers are those of arXiv 2507.18071.

Every objective takes
    logprobs       [B, T]  log π_θ(y_{i,t} | x, y_{i,<t}) of the sampled tokens, with gradient
    old_logprobs   [B, T]  log π_old of the same tokens (no gradient is taken through them)
    advantages     [B]     Â_i (or [B, T] Â_{i,t} where the objective allows it)
    mask           [B, T]  1 / True on response tokens, 0 / False on padding
and returns `(loss, metrics)`: `loss` is the scalar to minimise (−J); `metrics` is a dict of floats.

Numerical contract (tested):
- Values at masked positions, including ±inf and NaN, change nothing: masked entries are *selected away* with
  `torch.where`, never multiplied by 0 (NaN · 0 = NaN).
- Every log-ratio is clamped to ±LOG_RATIO_CLAMP before `exp`, so loss and gradients are finite for every finite
  input (OpenRLHF's unclamped exp overflowed to inf and NaN-ed every gradient).
- A sequence with no response token contributes 0 to the loss and its gradient and produces no NaN.
- Computation is in float32 at least, whatever the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LOG_RATIO_CLAMP = 20.0
"""Bound on |log ratio| before exp. e^20 ≈ 4.9e8 is far outside any clip range (ε ≤ 1), so an in-range value is never
changed, while exp stays 68 nats below float32 overflow (e^88.7): the ratio times an advantage, a 1/|y| weight and
the backward chain through a large model all stay finite. A ratio that hits the bound gets zero gradient from the
clamp, which is the right thing for a token or sequence that far off-policy."""

Metrics = dict[str, float]


# --------------------------------------------------------------------------------------------------------------------
# Input checks and masked reductions


def _check(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_advantages: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes/dtypes; return (logprobs, old_logprobs, advantages) as float32+ and mask as bool."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {tuple(logprobs.shape)}")
    batch = logprobs.shape[0]
    allowed = [(batch,), tuple(logprobs.shape)] if token_advantages else [(batch,)]
    if tuple(advantages.shape) not in allowed:
        want = " or ".join(str(list(s)) for s in allowed)
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} must be {want} (logprobs is {list(logprobs.shape)})"
        )
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if old_logprobs.dtype != logprobs.dtype:
        raise ValueError(f"old_logprobs dtype {old_logprobs.dtype} does not match logprobs dtype {logprobs.dtype}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"mask of dtype {mask.dtype} must hold only 0 and 1")
        mask = mask != 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    return logprobs.to(dtype), old_logprobs.to(dtype), advantages.to(dtype), mask


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask else 0 — safe for NaN/inf in the masked-out entries, in value and gradient."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _lengths(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|y_i| per sequence, at least 1 so that empty sequences divide safely."""  # [B]
    return mask.sum(-1).clamp(min=1).to(dtype)


def _token_mean_per_seq(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/|y_i| Σ_t x_{i,t} over response tokens; 0 for an empty sequence."""  # [B]
    return _masked(x, mask).sum(-1) / _lengths(mask, x.dtype)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """True where the clipped branch of min(r·Â, clip(r)·Â) is the one taken (and so the gradient is zero)."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (0 <= eps_low <= 1 and eps_high >= 0):
        raise ValueError(f"clip range needs 0 <= eps_low <= 1 and eps_high >= 0, got eps_low={eps_low}, "
                         f"eps_high={eps_high}")


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â), elementwise (the PPO surrogate inside Eqs. 2, 5, 13)."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def _token_metrics(
    log_ratio: torch.Tensor, clipped_tokens: torch.Tensor, mask: torch.Tensor
) -> Metrics:
    """Token-level clip fraction, sequence clip fraction (any token clipped) and k3 KL(π_old‖π_θ) per token."""
    n_tok = mask.sum().clamp(min=1)
    nonempty = mask.any(-1)
    clipped_tokens = clipped_tokens & mask
    kl = _masked(torch.expm1(log_ratio) - log_ratio, mask)  # k3: (r − 1) − log r ≥ 0, unbiased for KL(π_old‖π_θ)
    return {
        "clip_frac_tokens": float(clipped_tokens.sum() / n_tok),
        "clip_frac_seqs": float((clipped_tokens.any(-1) & nonempty).sum() / nonempty.sum().clamp(min=1)),
        "approx_kl": float(kl.sum() / n_tok),
    }


def _ratio_metrics(ratio: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Mean / min / max of the ratio the objective clips, over valid entries (1.0 if there are none)."""
    r = ratio.detach()[valid]
    if r.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0}
    return {"ratio_mean": float(r.mean()), "ratio_min": float(r.min()), "ratio_max": float(r.max())}


# --------------------------------------------------------------------------------------------------------------------
# GSPO


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i(θ) of Eq. 7: 1/|y_i| Σ_t (log π_θ(y_{i,t}|…) − log π_old(y_{i,t}|…)), the length-normalised
    sequence log-ratio. Returns [B]; 0 for a sequence with no response token. Not clamped (see `gspo_loss`)."""
    zeros = torch.zeros(logprobs.shape[0], dtype=logprobs.dtype, device=logprobs.device)
    logprobs, old_logprobs, _, mask = _check(logprobs, old_logprobs, zeros, mask, token_advantages=False)
    return _token_mean_per_seq(_masked(logprobs, mask) - _masked(old_logprobs, mask), mask)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GSPO of Eq. 5 with the sequence ratio s_i of Eq. 7:

        J = 1/B Σ_i min( s_i Â_i , clip(s_i, 1−ε_low, 1+ε_high) Â_i ),   s_i = exp(1/|y_i| Σ_t log w_{i,t})

    One clip decision per response; averaging over the B sequences equals Eq. 5's 1/G per group, mean over groups.
    Gradient (Eq. 10, unclipped): −1/B Σ_i s_i Â_i 1/|y_i| Σ_t ∇ log π_θ(y_{i,t}) — every token weighted equally.
    Metrics: a clipped sequence counts all its tokens as clipped; ratio_* are over s_i of non-empty sequences.
    """
    _check_eps(eps_low, eps_high)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=False)
    log_w = _masked(logprobs, mask) - _masked(old_logprobs, mask)  # [B, T] log w_{i,t}
    log_s = _token_mean_per_seq(log_w, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    s = torch.exp(log_s)
    nonempty = mask.any(-1)
    per_seq = _masked(_clipped_surrogate(s, advantages, eps_low, eps_high), nonempty)  # [B]
    loss = -per_seq.sum() / logprobs.shape[0]

    clipped_seq = _clipped(s.detach(), advantages, eps_low, eps_high) & nonempty  # [B]
    metrics = _token_metrics(log_w.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
                             clipped_seq[:, None].expand_as(mask), mask)
    metrics.update(_ratio_metrics(s, nonempty))
    return loss, metrics


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GSPO-token of Eq. 13 with the token ratio of Eq. 14:

        s_{i,t} = sg[s_i] · π_θ(y_{i,t}|…) / sg[π_θ(y_{i,t}|…)]
        J = 1/B Σ_i 1/|y_i| Σ_t min( s_{i,t} Â_{i,t} , clip(s_{i,t}, 1−ε_low, 1+ε_high) Â_{i,t} )

    s_{i,t} equals s_i in value, so clipping is decided per sequence but by the sign of each token's advantage.
    Gradient (Eq. 17, unclipped): −1/B Σ_i s_i 1/|y_i| Σ_t Â_{i,t} ∇ log π_θ(y_{i,t}). With Â_{i,t} = Â_i this is
    GSPO exactly (value, clipping and gradient). `advantages` is [B] or [B, T].
    """
    _check_eps(eps_low, eps_high)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=True)
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else _masked(advantages, mask)  # [B, T]
    lp = _masked(logprobs, mask)
    log_w = lp - _masked(old_logprobs, mask)
    log_s = _token_mean_per_seq(log_w, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    s_it = torch.exp(log_s.detach()[:, None] + lp - lp.detach())  # [B, T], value s_i, gradient of log π_θ(y_{i,t})
    loss = -_token_mean_per_seq(_clipped_surrogate(s_it, adv, eps_low, eps_high), mask).sum() / logprobs.shape[0]

    nonempty = mask.any(-1)
    clipped = _clipped(s_it.detach(), adv, eps_low, eps_high)
    metrics = _token_metrics(log_w.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), clipped, mask)
    metrics.update(_ratio_metrics(torch.exp(log_s), nonempty))
    return loss, metrics


# --------------------------------------------------------------------------------------------------------------------
# Token-level baselines: GRPO (Eq. 2) and its aggregation variants


def _token_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(log w, w) with w_{i,t} = π_θ/π_old of Eq. 3, clamped in log space; 0 / 1 at masked positions."""
    log_w = _masked(logprobs, mask) - _masked(old_logprobs, mask)
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_w, torch.exp(log_w)


def _token_clip_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, Metrics]:
    """Shared body of the token-ratio PPO-clip objectives: per-token min(w Â, clip(w) Â), then `aggregate`."""
    _check_eps(eps_low, eps_high)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=False)
    log_w, w = _token_ratio(logprobs, old_logprobs, mask)
    adv = advantages[:, None].expand_as(w)
    loss = -aggregate(_clipped_surrogate(w, adv, eps_low, eps_high), mask)
    metrics = _token_metrics(log_w.detach(), _clipped(w.detach(), adv, eps_low, eps_high), mask)
    metrics.update(_ratio_metrics(w, mask))
    return loss, metrics


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/B Σ_i 1/|y_i| Σ_t x_{i,t} — GRPO's aggregation (Eq. 2)."""
    return _token_mean_per_seq(x, mask).sum() / x.shape[0]


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/Σ_i|y_i| Σ_i Σ_t x_{i,t} — DAPO's token-mean over the batch (longer responses weigh more)."""
    return _masked(x, mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GRPO of Eq. 2 with the token ratio w_{i,t} of Eq. 3:

        J = 1/B Σ_i 1/|y_i| Σ_t min( w_{i,t} Â_i , clip(w_{i,t}, 1−ε_low, 1+ε_high) Â_i )

    Gradient (Eq. 11, unclipped): −1/B Σ_i Â_i 1/|y_i| Σ_t w_{i,t} ∇ log π_θ(y_{i,t}). ε defaults are the paper's
    tuned GRPO baseline (0.2 / 0.27). clip_frac_seqs counts sequences with at least one clipped token.
    """
    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, seq_mean_token_mean)


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, Metrics]:
    """DAPO's token-level policy loss (arXiv 2503.14476): GRPO's clipped token surrogate aggregated by a token-mean
    over the whole batch, 1/Σ|y_i| Σ_i Σ_t (...), with its clip-higher defaults ε 0.2 / 0.28."""
    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, token_mean)


def dr_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Dr.GRPO (arXiv 2503.20783): GRPO's surrogate with the per-response 1/|y_i| replaced by a constant 1/L,
    J = 1/B Σ_i 1/L Σ_t (...), so no length bias; L = `max_tokens` (the generation budget), default T. Pair it with
    advantages that are not divided by the std (`group_advantages(..., scale="none")`)."""
    budget = logprobs.shape[-1] if max_tokens is None else max_tokens
    if budget < 1:
        raise ValueError(f"dr_grpo max_tokens must be >= 1, got {max_tokens}")

    def constant_norm(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _masked(x, m).sum() / (x.shape[0] * budget)

    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, constant_norm)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, every token keeps a
    gradient: J = 1/Σ|y_i| Σ_i Σ_t sg[clip(w_{i,t}, 1−ε_low, 1+ε_high)] Â_i log π_θ(y_{i,t}). ε_low = 1 (no lower
    bound) as in MiniMax-M1. clip_frac_tokens counts tokens whose weight is truncated."""
    _check_eps(eps_low, eps_high)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=False)
    log_w, w = _token_ratio(logprobs, old_logprobs, mask)
    weight = w.detach().clamp(1 - eps_low, 1 + eps_high)
    loss = -token_mean(weight * advantages[:, None] * _masked(logprobs, mask), mask)
    truncated = (w.detach() > 1 + eps_high) | (w.detach() < 1 - eps_low)
    metrics = _token_metrics(log_w.detach(), truncated, mask)
    metrics.update(_ratio_metrics(w, mask))
    return loss, metrics


# --------------------------------------------------------------------------------------------------------------------
# KL to a reference policy (β term; the paper uses β = 0)


def kl_to_reference(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(π_θ‖π_ref), token-mean per sequence then mean over sequences (GSPO's averaging):
    r = π_ref/π_θ, k3 = r − 1 − log r ≥ 0. Add β·this to the loss."""
    zeros = torch.zeros(logprobs.shape[0], dtype=logprobs.dtype, device=logprobs.device)
    logprobs, ref_logprobs, _, mask = _check(logprobs, ref_logprobs, zeros, mask, token_advantages=False)
    log_r = (_masked(ref_logprobs, mask) - _masked(logprobs, mask)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return seq_mean_token_mean(torch.expm1(log_r) - log_r, mask)


Objective = Callable[..., tuple[torch.Tensor, Metrics]]

OBJECTIVES: dict[str, Objective] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
    "dapo": dapo_loss,
    "dr_grpo": dr_grpo_loss,
    "cispo": cispo_loss,
}
"""Objectives by name. Each one's default ε is its paper's; `default_eps(name)` reads them."""

TOKEN_ADVANTAGES = frozenset({"gspo_token"})
"""Objectives that accept per-token advantages [B, T]."""


def default_eps(name: str) -> tuple[float, float]:
    """(eps_low, eps_high) defaults of the named objective."""
    import inspect

    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    params = inspect.signature(OBJECTIVES[name]).parameters
    return params["eps_low"].default, params["eps_high"].default

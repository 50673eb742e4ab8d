"""Policy-gradient objectives as pure tensor functions: GSPO (Eq. 5/7), GSPO-token (Eq. 13/14), GRPO (Eq. 2) and the
baselines users compare against (DAPO, Dr.GRPO, CISPO). Equation numbers are those of arXiv 2507.18071.

Every objective takes
    logprobs       [B, T]  log π_θ(y_{i,t} | x, y_{i,<t}) of the sampled tokens, with gradient
    old_logprobs   [B, T]  log π_old of the same tokens (no gradient is taken through them)
    advantages     [B]     Â_i (or [B, T] Â_{i,t} where the objective allows it)
    mask           [B, T]  1 / True on response tokens, 0 / False on padding
and returns `(loss, metrics)`: `loss` is the scalar to minimise (−J); `metrics` is a dict of floats, the metrics of
these tensors and the counts of the entries they are taken over (`METRIC_AGGREGATION`: how the metrics of several
calls, a step's minibatches or the processes' shares of one, combine into those of all their entries).

Registry: `OBJECTIVES` maps a name to an `Objective`, the loss function with what the rest of gspo needs to know about
it: its paper's ε defaults, its normaliser (what the sum over tokens is divided by), whether it takes per-token
advantages, its advantage scale (default and allowed), whether its ratio is per sequence or per token. The config
and the learner read that metadata and the parallel layer only sums counts: none looks an objective up by name, so
adding one is `register_objective(name, Objective(...))`.

Normaliser and multi-process training. Each loss is (1/N) Σ_i Σ_t f_{i,t} (f holding any 1/|y_i| factor), with N
given by the objective's `normalise_by`:
    "sequences"  N = B, the sequences of the minibatch          (gspo Eq. 5, gspo_token Eq. 13, grpo Eq. 2)
    "tokens"     N = Σ_i |y_i|, its response tokens             (dapo, cispo)
    "budget"     N = B · L, L the generation budget             (dr_grpo; L = rollout.max_new_tokens, not T)
Every loss takes `normaliser=N` (keyword); None means N of the tensors it is given (B; Σ|y_i| clamped at 1; B·T for
dr_grpo unless `max_tokens`). When a minibatch is split over W processes whose gradients DDP/FSDP *average*, each
process must divide its own sum by N_global / W, N_global being the count over all the processes' shares:

    count = spec.count(mask, max_new_tokens)                  # this process's share of N
    total = all_reduce_sum(count)                             # N_global
    loss, metrics = spec.loss(..., normaliser=process_normaliser(total, world_size))   # max(total, 1) / W

Process p's gradient is then W · ∇S_p / N_global and their average Σ_p ∇S_p / N_global, the one-process gradient of
the whole minibatch (tested for every registered objective, token-mean ones with unequal token counts included). With
one process, normaliser = N and the loss is bit-identical to normaliser=None (same operations, same order: a Python
number divides where the local count was a Python int, a 0-dim tensor on the loss's device where it was the
`mask.sum()` tensor, since CUDA divides by a CPU scalar as a multiplication by its reciprocal). The learner's
micro-batches (`trainer.micro_batch_tokens`) rest on the same property within a process: a share's micro-batches, each
divided by the same normaliser, have gradients that add up to the share's.

Numerical contract (tested):
- Values at masked positions, including ±inf and NaN, change nothing: masked entries are *selected away* with
  `torch.where`, never multiplied by 0 (NaN · 0 = NaN).
- Every log-ratio is clamped to ±LOG_RATIO_CLAMP before `exp`, so loss and gradients are finite for every finite
  input (OpenRLHF's unclamped exp overflowed to inf and NaN-ed every gradient).
- A sequence with no response token contributes 0 to the loss and its gradient and produces no NaN; an empty batch
  (B = 0) has loss 0.
- Computation is in float32 at least, whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from gspo.advantages import Scale

LOG_RATIO_CLAMP = 20.0
"""Bound on |log ratio| before exp. e^20 ≈ 4.9e8 is far outside any clip range (ε ≤ 1), so an in-range value is never
changed, while exp stays 68 nats below float32 overflow (e^88.7): the ratio times an advantage, a 1/|y| weight and
the backward chain through a large model all stay finite. A ratio that hits the bound gets zero gradient from the
clamp, which is the right thing for a token or sequence that far off-policy."""

Metrics = dict[str, float]
LossFn = Callable[..., tuple[torch.Tensor, Metrics]]
"""`fn(logprobs, old_logprobs, advantages, mask, *, eps_low, eps_high, normaliser) -> (loss, metrics)`."""
NormaliseBy = Literal["sequences", "tokens", "budget"]
RatioLevel = Literal["sequence", "token"]
"""What the objective's importance ratio is taken over: one ratio per sequence (GSPO's s_i) or one per token (GRPO's
w_{i,t}). The train–inference mismatch correction (`gspo.correction`) takes the same level."""


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
    """Validate types, shapes, dtypes and values; return (logprobs, old_logprobs, advantages) as float32+ and mask as
    bool. π_old and the advantages are constants of the objective: they are detached, so that the on-policy call
    `loss(lp, lp, ...)` of a hand-written loop has Eq. 10's gradient rather than none (exp(lp − lp) has no gradient).

    Values: advantages must be finite (at response tokens when per token) and log-probabilities at response tokens
    must not be positive (probabilities or logits passed by mistake would give a plausible number). A non-finite
    log-probability is left to the caller: the learner skips and counts a non-finite update (`gspo.learner`)."""
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    _check_values(logprobs, old_logprobs, advantages, mask)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    return logprobs.to(dtype), old_logprobs.detach().to(dtype), advantages.detach().to(dtype), mask


LOGPROB_TOLERANCE = 1e-3
"""How far above 0 a log-probability may be read (rounding in a log-softmax) before it is taken for a probability or
a logit."""


def _check_values(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor) -> None:
    """`_check`'s value checks, in one device sync; the offending tensor, row and value named only when one fails."""
    at_tokens = advantages.dim() == 2
    bad_adv = ~torch.isfinite(advantages) & (mask if at_tokens else True)
    positive = [(t > LOGPROB_TOLERANCE) & mask for t in (logprobs.detach(), old_logprobs.detach())]
    if not bool(bad_adv.any() | positive[0].any() | positive[1].any()):
        return
    if bad_adv.any():
        where = bad_adv.nonzero()[0].tolist()
        raise ValueError(f"advantages must be finite; {where} is {advantages[tuple(where)].item()} "
                         f"({int(bad_adv.sum())} non-finite in total)")
    for name, t, hit in (("logprobs", logprobs, positive[0]), ("old_logprobs", old_logprobs, positive[1])):
        if hit.any():
            i, j = hit.nonzero()[0].tolist()
            raise ValueError(f"{name} must be log-probabilities (<= 0); [{i}, {j}] is {t[i, j].item():.4g} "
                             f"({int(hit.sum())} response tokens > 0): probabilities or logits passed instead?")


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


def _check_normaliser(normaliser: float | None) -> float | None:
    """The aggregation's denominator as a Python float (None: the local count); must be finite and > 0."""
    if normaliser is None:
        return None
    value = float(normaliser)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"normaliser must be a finite number > 0, got {normaliser}")
    return value


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
    """Token-level clip fraction, sequence clip fraction (any token clipped) and k3 KL(π_old‖π_θ) per token (0 over no
    token), with the counts of masked tokens and of non-empty sequences they are over."""
    n_tok = mask.sum().clamp(min=1)
    nonempty = mask.any(-1)
    clipped_tokens = clipped_tokens & mask
    kl = _masked(torch.expm1(log_ratio) - log_ratio, mask)  # k3: (r − 1) − log r ≥ 0, unbiased for KL(π_old‖π_θ)
    return _read({
        "clip_frac_tokens": clipped_tokens.sum() / n_tok,
        "clip_frac_seqs": (clipped_tokens.any(-1) & nonempty).sum() / nonempty.sum().clamp(min=1),
        "approx_kl": kl.sum() / n_tok,
        "count_tokens": mask.sum(),
        "count_seqs": nonempty.sum(),
    })


def _read(values: dict[str, torch.Tensor]) -> Metrics:
    """Scalar tensors as floats, read from the device in one sync (float64 holds each float32 value and count
    exactly)."""
    return dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist(), strict=True))


def _ratio_metrics(ratio: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Mean / min / max of the ratio the objective clips, over valid entries (1.0 if there are none), with their
    count."""
    none = {"ratio_mean": 1.0, "ratio_min": 1.0, "ratio_max": 1.0, "count_ratios": 0.0}
    if ratio.numel() == 0:
        return none
    r, valid = ratio.detach(), valid.expand_as(ratio)  # masked reductions: no boolean index (a sync of its own)
    m = _read({"ratio_mean": torch.where(valid, r, 0).sum() / valid.sum().clamp(min=1),
               "ratio_min": torch.where(valid, r, torch.inf).min(),
               "ratio_max": torch.where(valid, r, -torch.inf).max(), "count_ratios": valid.sum()})
    return m if m["count_ratios"] else none


METRIC_AGGREGATION: dict[str, tuple[Literal["mean", "max", "min"], str]] = {
    "clip_frac_tokens": ("mean", "count_tokens"),  # fraction of the masked tokens that are clipped
    "approx_kl": ("mean", "count_tokens"),  # k3 KL(π_old‖π_θ) per masked token
    "clip_frac_seqs": ("mean", "count_seqs"),  # fraction of the non-empty sequences with a clipped token
    "ratio_mean": ("mean", "count_ratios"),  # over the valid ratios: s_i of the non-empty sequences (ratio_level
    "ratio_min": ("min", "count_ratios"),  # "sequence") or w_{i,t} of the masked tokens ("token")
    "ratio_max": ("max", "count_ratios"),
}
"""What each of the objectives' metrics is over: key → (how, count key). A metric is a mean ("mean") or an extremum
("max", "min") over the entries counted by the metrics' `count key` (`COUNT_KEYS`). The metrics of several calls (a
step's minibatches, the processes' shares of one) so combine into those of all their entries: a mean as
Σ mean·count / Σ count, an extremum as the calls' extremum, a call with a count of 0 left out (over no entries at all:
what a call gives for none, 0, and 1 for the ratios). `gspo.learner.learn` logs a step's metrics so; a registered
objective's metric without a count here is averaged over the calls."""
COUNT_KEYS = ("count_tokens", "count_seqs", "count_ratios")


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
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GSPO of Eq. 5 with the sequence ratio s_i of Eq. 7:

        J = 1/B Σ_i min( s_i Â_i , clip(s_i, 1−ε_low, 1+ε_high) Â_i ),   s_i = exp(1/|y_i| Σ_t log w_{i,t})

    One clip decision per response; averaging over the B sequences equals Eq. 5's 1/G per group, mean over groups.
    Gradient (Eq. 10, unclipped): −1/B Σ_i s_i Â_i 1/|y_i| Σ_t ∇ log π_θ(y_{i,t}) — every token weighted equally.
    Metrics: a clipped sequence counts all its tokens as clipped; ratio_* are over s_i of non-empty sequences.
    `normaliser` replaces the 1/B (module docstring: multi-process training).
    """
    _check_eps(eps_low, eps_high)
    normaliser = _check_normaliser(normaliser)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=False)
    log_w = _masked(logprobs, mask) - _masked(old_logprobs, mask)  # [B, T] log w_{i,t}
    log_s = _token_mean_per_seq(log_w, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    s = torch.exp(log_s)
    nonempty = mask.any(-1)
    per_seq = _masked(_clipped_surrogate(s, advantages, eps_low, eps_high), nonempty)  # [B]
    loss = -per_seq.sum() / (max(logprobs.shape[0], 1) if normaliser is None else normaliser)

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
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GSPO-token of Eq. 13 with the token ratio of Eq. 14:

        s_{i,t} = sg[s_i] · π_θ(y_{i,t}|…) / sg[π_θ(y_{i,t}|…)]
        J = 1/B Σ_i 1/|y_i| Σ_t min( s_{i,t} Â_{i,t} , clip(s_{i,t}, 1−ε_low, 1+ε_high) Â_{i,t} )

    s_{i,t} equals s_i in value, so clipping is decided per sequence but by the sign of each token's advantage.
    Gradient (Eq. 17, unclipped): −1/B Σ_i s_i 1/|y_i| Σ_t Â_{i,t} ∇ log π_θ(y_{i,t}). With Â_{i,t} = Â_i this is
    GSPO exactly (value, clipping and gradient). `advantages` is [B] or [B, T]. `normaliser` replaces the 1/B.
    """
    _check_eps(eps_low, eps_high)
    normaliser = _check_normaliser(normaliser)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=True)
    adv = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else _masked(advantages, mask)  # [B, T]
    lp = _masked(logprobs, mask)
    log_w = lp - _masked(old_logprobs, mask)
    raw = _token_mean_per_seq(log_w, mask)
    log_s = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B]
    # value s_i exactly, gradient of log π_θ; none where s_i hit the clamp, as GSPO's clamp gives none (the
    # detached s_i let e^20 times the gradient through there)
    live = (raw.detach().abs() <= LOG_RATIO_CLAMP)[:, None]
    s_it = torch.exp(log_s.detach()[:, None] + torch.where(live, lp - lp.detach(), 0.0))  # [B, T]
    per_seq = _token_mean_per_seq(_clipped_surrogate(s_it, adv, eps_low, eps_high), mask)  # [B]
    loss = -per_seq.sum() / (max(logprobs.shape[0], 1) if normaliser is None else normaliser)

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
    """Shared body of the token-ratio PPO-clip objectives: per-token min(w Â, clip(w) Â), then `aggregate(x, mask)`
    (which holds the normaliser). `advantages` is [B] (Â_i) or [B, T] (Â_{i,t}, e.g. Â_i scaled by per-token TIS
    weights, `gspo.correction`)."""
    _check_eps(eps_low, eps_high)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=True)
    log_w, w = _token_ratio(logprobs, old_logprobs, mask)
    adv = advantages[:, None].expand_as(w) if advantages.dim() == 1 else _masked(advantages, mask)
    loss = -aggregate(_clipped_surrogate(w, adv, eps_low, eps_high), mask)
    metrics = _token_metrics(log_w.detach(), _clipped(w.detach(), adv, eps_low, eps_high), mask)
    metrics.update(_ratio_metrics(w, mask))
    return loss, metrics


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor, normaliser: float | None = None) -> torch.Tensor:
    """1/B Σ_i 1/|y_i| Σ_t x_{i,t} — GRPO's aggregation (Eq. 2); `normaliser` replaces B."""
    normaliser = _check_normaliser(normaliser)
    return _token_mean_per_seq(x, mask).sum() / (max(x.shape[0], 1) if normaliser is None else normaliser)


def token_mean(x: torch.Tensor, mask: torch.Tensor, normaliser: float | None = None) -> torch.Tensor:
    """1/Σ_i|y_i| Σ_i Σ_t x_{i,t} — DAPO's token-mean over the batch (longer responses weigh more); `normaliser`
    replaces Σ_i|y_i| (clamped at 1). It divides as a 0-dim tensor on x's device, like the count it replaces."""
    normaliser = _check_normaliser(normaliser)
    total = _masked(x, mask).sum()
    if normaliser is None:
        return total / mask.sum().clamp(min=1)
    return total / total.new_full((), normaliser)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """−J_GRPO of Eq. 2 with the token ratio w_{i,t} of Eq. 3:

        J = 1/B Σ_i 1/|y_i| Σ_t min( w_{i,t} Â_i , clip(w_{i,t}, 1−ε_low, 1+ε_high) Â_i )

    Gradient (Eq. 11, unclipped): −1/B Σ_i Â_i 1/|y_i| Σ_t w_{i,t} ∇ log π_θ(y_{i,t}). ε defaults are the paper's
    tuned GRPO baseline (0.2 / 0.27). clip_frac_seqs counts sequences with at least one clipped token.
    `normaliser` replaces the 1/B.
    """
    normaliser = _check_normaliser(normaliser)
    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high,
                                 lambda x, m: seq_mean_token_mean(x, m, normaliser))


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DAPO's token-level policy loss (arXiv 2503.14476): GRPO's clipped token surrogate aggregated by a token-mean
    over the whole batch, 1/Σ|y_i| Σ_i Σ_t (...), with its clip-higher defaults ε 0.2 / 0.28. `normaliser` replaces
    Σ|y_i|."""
    normaliser = _check_normaliser(normaliser)
    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high,
                                 lambda x, m: token_mean(x, m, normaliser))


def dr_grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    max_tokens: int | None = None,
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Dr.GRPO (arXiv 2503.20783): GRPO's surrogate with the per-response 1/|y_i| replaced by a constant 1/L,
    J = 1/B Σ_i 1/L Σ_t (...), so no length bias; L must be the generation budget (rollout.max_new_tokens), a
    constant of the run. The denominator B·L is `normaliser` when given (what the learner passes), else
    B·`max_tokens`, else B·T — T, the longest completion of these tensors, changes from minibatch to minibatch, so
    the default is for standalone use only. Pair it with advantages that are not divided by the std
    (`group_advantages(..., scale="none")`)."""
    normaliser = _check_normaliser(normaliser)
    if normaliser is not None and max_tokens is not None:
        raise ValueError("dr_grpo takes normaliser (B·L) or max_tokens (L), not both")
    budget = logprobs.shape[-1] if max_tokens is None else max_tokens
    if budget < 1:
        raise ValueError(f"dr_grpo max_tokens must be >= 1, got {max_tokens}" if max_tokens is not None else
                         "dr_grpo needs max_tokens (L, the generation budget) when the tensors have no token (T = 0)")

    def constant_norm(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return _masked(x, m).sum() / (max(x.shape[0], 1) * budget if normaliser is None else normaliser)

    return _token_clip_objective(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, constant_norm)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    *,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, every token keeps a
    gradient: J = 1/Σ|y_i| Σ_i Σ_t sg[clip(w_{i,t}, 1−ε_low, 1+ε_high)] Â_i log π_θ(y_{i,t}). ε_low = 1 (no lower
    bound) as in MiniMax-M1. clip_frac_tokens counts tokens whose weight is truncated. `normaliser` replaces Σ|y_i|.
    `advantages` is [B] or [B, T]."""
    _check_eps(eps_low, eps_high)
    normaliser = _check_normaliser(normaliser)
    logprobs, old_logprobs, advantages, mask = _check(logprobs, old_logprobs, advantages, mask, token_advantages=True)
    log_w, w = _token_ratio(logprobs, old_logprobs, mask)
    weight = w.detach().clamp(1 - eps_low, 1 + eps_high)
    adv = advantages[:, None] if advantages.dim() == 1 else _masked(advantages, mask)
    loss = -token_mean(weight * adv * _masked(logprobs, mask), mask, normaliser)
    truncated = (w.detach() > 1 + eps_high) | (w.detach() < 1 - eps_low)
    metrics = _token_metrics(log_w.detach(), truncated, mask)
    metrics.update(_ratio_metrics(w, mask))
    return loss, metrics


# --------------------------------------------------------------------------------------------------------------------
# KL to a reference policy (β term; the paper uses β = 0)


def kl_k3(log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator per token, r − 1 − log r ≥ 0 with log r = log π_ref − log π_θ (GRPO, DeepSeekMath
    Eq. 4; verl's low_var_kl): an unbiased, low-variance estimate of KL(π_θ‖π_ref) on samples of π_θ. As a loss
    term, its expected gradient over a token's distribution is that of the *forward* KL(π_ref‖π_θ):
    E_π[(1 − π_ref/π_θ)∇log π_θ] = −Σ π_ref ∇log π_θ."""
    return torch.expm1(log_r) - log_r


def kl_k2(log_r: torch.Tensor) -> torch.Tensor:
    """Schulman's k2 estimator per token, ½ (log r)² ≥ 0 (verl's mse): a biased estimate of KL(π_θ‖π_ref), but as a
    loss term its expected gradient over a token's distribution is exactly that of the reverse KL(π_θ‖π_ref) the
    penalty means: E_π[(log π_θ − log π_ref)∇log π_θ]."""
    return 0.5 * log_r.square()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k3": kl_k3, "k2": kl_k2}


def kl_to_reference(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, *, normaliser: float | None = None,
    estimator: str = "k3",
) -> torch.Tensor:
    """The per-token KL `estimator` (`KL_ESTIMATORS`: k3, GRPO's, or k2) between π_θ and π_ref, token-mean per sequence
    then mean over sequences (GSPO's averaging). Add β·this to the loss. Its normaliser is always the sequence count:
    over W processes pass `process_normaliser(global number of rows, W)`. (Schulman's k1, log π_θ/π_ref, is not
    offered: as a loss term its expected gradient is 0, so it would not regularise.)"""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_to_reference: estimator must be one of {sorted(KL_ESTIMATORS)}, got {estimator!r}")
    zeros = torch.zeros(logprobs.shape[0], dtype=logprobs.dtype, device=logprobs.device)
    logprobs, ref_logprobs, _, mask = _check(logprobs, ref_logprobs, zeros, mask, token_advantages=False)
    log_r = (_masked(ref_logprobs, mask) - _masked(logprobs, mask)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return seq_mean_token_mean(KL_ESTIMATORS[estimator](log_r), mask, normaliser)


# --------------------------------------------------------------------------------------------------------------------
# Registry


NORMALISE_BY: tuple[NormaliseBy, ...] = get_args(NormaliseBy)
SCALES: tuple[Scale, ...] = get_args(Scale)


@dataclass(frozen=True, kw_only=True)
class Objective:
    """A loss function and what the config, the learner and the parallel layer need to know about it.

    loss              `fn(logprobs, old_logprobs, advantages, mask, *, eps_low, eps_high, normaliser)` → (loss, metrics)
    eps_low, eps_high its paper's clip range, the config's defaults
    normalise_by      what the sum over tokens is divided by: "sequences" (B), "tokens" (Σ|y_i|) or "budget" (B·L,
                      L = rollout.max_new_tokens); `count` gives a minibatch share's amount of it
    summary           one line for listings and error messages
    token_advantages  the loss accepts per-token advantages [B, T] as well as [B]
    advantage_scale   the advantage normalisation it is meant for (`group_advantages(scale=...)`), the config's default
    allowed_scales    the scales it may be run with (dr_grpo: only "none", since it removes the std normalisation)
    ratio_level       "sequence" (one importance ratio per response: gspo, gspo_token) or "token" (one per token):
                      which form of the train–inference mismatch correction applies (`gspo.correction`)

    Calling the spec calls `loss` with the spec's ε unless given.
    """

    loss: LossFn
    eps_low: float
    eps_high: float
    normalise_by: NormaliseBy
    summary: str
    token_advantages: bool = False
    advantage_scale: Scale = "group"
    allowed_scales: tuple[Scale, ...] = SCALES
    ratio_level: RatioLevel = "token"

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise TypeError(f"Objective.loss must be callable, got {self.loss!r}")
        _check_eps(self.eps_low, self.eps_high)
        if self.normalise_by not in NORMALISE_BY:
            raise ValueError(f"normalise_by must be one of {NORMALISE_BY}, got {self.normalise_by!r}")
        object.__setattr__(self, "allowed_scales", tuple(self.allowed_scales))
        bad = [s for s in self.allowed_scales if s not in SCALES]
        if bad or not self.allowed_scales:
            raise ValueError(f"allowed_scales must be a non-empty subset of {SCALES}, got {self.allowed_scales}")
        if self.advantage_scale not in self.allowed_scales:
            raise ValueError(f"advantage_scale {self.advantage_scale!r} is not in allowed_scales {self.allowed_scales}")
        if not self.summary or "\n" in self.summary:
            raise ValueError("summary must be one non-empty line")
        if self.ratio_level not in get_args(RatioLevel):
            raise ValueError(f"ratio_level must be one of {get_args(RatioLevel)}, got {self.ratio_level!r}")

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, Metrics]:
        return self.loss(logprobs, old_logprobs, advantages, mask,
                         eps_low=self.eps_low if eps_low is None else eps_low,
                         eps_high=self.eps_high if eps_high is None else eps_high, **kwargs)

    def count(self, mask: torch.Tensor, max_new_tokens: int) -> float:
        """This process's share of the normaliser for a minibatch share with response mask [B, T]: B, Σ mask, or
        B · max_new_tokens (the generation budget L, a constant of the run). Sum it over processes, then pass
        `normaliser=process_normaliser(total, world_size)` to the loss."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
        if self.normalise_by == "sequences":
            return float(mask.shape[0])
        if self.normalise_by == "tokens":
            return float((mask != 0).sum())
        if mask.numel() and int((mask != 0).sum(-1).max()) > max_new_tokens:
            raise ValueError(f"a response has more tokens than the generation budget max_new_tokens={max_new_tokens}")
        return float(mask.shape[0] * max_new_tokens)


def process_normaliser(total: float, world_size: int = 1) -> float:
    """The `normaliser` for one of `world_size` processes whose gradients are averaged, given the minibatch's total
    count (the sum of every process's `Objective.count`): total / W, with total clamped at 1 as the local counts are
    (an all-empty minibatch then has loss 0, not NaN). With one process: the local count itself."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return max(float(total), 1.0) / world_size


OBJECTIVES: dict[str, Objective] = {}
"""The registry: objectives by name. Add one with `register_objective`."""


def register_objective(name: str, objective: Objective) -> Objective:
    """Add `objective` under `name` (an error if the name is taken); it is then a valid `algorithm.loss`."""
    if not isinstance(objective, Objective):
        raise TypeError(f"register_objective needs an Objective, got {type(objective).__name__}")
    if not name or not isinstance(name, str):
        raise ValueError(f"objective name must be a non-empty string, got {name!r}")
    if name in OBJECTIVES:
        raise ValueError(f"objective {name!r} is already registered")
    OBJECTIVES[name] = objective
    return objective


register_objective("gspo", Objective(
    loss=gspo_loss, eps_low=3e-4, eps_high=4e-4, normalise_by="sequences", ratio_level="sequence",
    summary="GSPO (Eq. 5/7): one clipped, length-normalised sequence ratio per response, mean over sequences"))
register_objective("gspo_token", Objective(
    loss=gspo_token_loss, eps_low=3e-4, eps_high=4e-4, normalise_by="sequences", token_advantages=True,
    ratio_level="sequence",
    summary="GSPO-token (Eq. 13/14): GSPO's sequence ratio with per-token advantages"))
register_objective("grpo", Objective(
    loss=grpo_loss, eps_low=0.2, eps_high=0.27, normalise_by="sequences", token_advantages=True, ratio_level="token",
    summary="GRPO (Eq. 2): clipped token ratios, token-mean per response, mean over sequences"))
register_objective("dapo", Objective(
    loss=dapo_loss, eps_low=0.2, eps_high=0.28, normalise_by="tokens", token_advantages=True, ratio_level="token",
    summary="DAPO: GRPO's clipped token surrogate, mean over all tokens of the batch, clip-higher"))
register_objective("dr_grpo", Objective(
    loss=dr_grpo_loss, eps_low=0.2, eps_high=0.27, normalise_by="budget", advantage_scale="none",
    token_advantages=True, ratio_level="token",
    allowed_scales=("none",),
    summary="Dr.GRPO: GRPO with a constant 1/(B·L) normaliser and no std normalisation of the advantages"))
register_objective("cispo", Objective(
    loss=cispo_loss, eps_low=1.0, eps_high=0.28, normalise_by="tokens", token_advantages=True, ratio_level="token",
    summary="CISPO: clipped, detached token importance weights times log π_θ, mean over all tokens of the batch"))


def default_eps(name: str) -> tuple[float, float]:
    """(eps_low, eps_high) defaults of the named objective."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    spec = OBJECTIVES[name]
    return spec.eps_low, spec.eps_high

"""The collapse guard: each RL step's metrics against a rolling baseline of the run's own healthy steps.

A GSPO run that collapses (the paper's §1: GRPO's collapse is often irreversible) shows it in a few metrics long
before anyone reads the curves: the reward falls, the entropy collapses or explodes, the clip fraction or the
importance ratios jump, or the numbers stop being finite. `CollapseGuard.observe` checks one step's metrics against
the median and the robust spread (1.4826 · median absolute deviation) of the last `window` healthy steps:

    reward_mean        below   R − max(z·σ, reward_drop·|R|), R = max(M, the best M of the run so far)
    entropy            below   M − max(z·σ, (1 − 1/entropy_factor)·M, entropy_floor)
                       or above  M + max(z·σ, (entropy_factor − 1)·M, entropy_floor)
    clip_frac_tokens   above   M + max(z·σ, clip_jump)
    |log ratio_max|    above   max(M + z·σ, ratio_jump·M, ratio_floor)   (M, σ of |log ratio_max|; ratio_min mirrored)
    non-finite         loss, grad_norm, reward_mean or entropy not finite, or an update skipped for it

Both a statistical (z·σ) and a practical (relative) margin must be exceeded. A ratio within `ratio_floor` of 1 is
never an anomaly (the trainer: log(max(1 + ε_high, trainer.guard.ratio_floor)); token-level objectives move single
tokens to the clip range by design, GRPO's ratio_max of 1.1 was a false alarm, and so was GSPO's sequence ratio of
1.15 on healthy off-policy steps of an async run), nor an entropy within `entropy_floor` nats of its baseline (a
near-deterministic policy's entropy doubling from 0.013 to 0.041 rolled back a multi-turn run already at 100 %
held-out accuracy). So neither noise in a short window nor a tiny but stable spread raises an alarm. The relative
rules start once `warmup` healthy steps are in the window; the non-finite rule from the first step. A non-finite
step is reported but is neither a collapse step nor a baseline step: the trainer's `max_bad_steps` decides about
steps whose updates were skipped for it. A step that breaks a rule
is not added to the baseline. `patience` consecutive anomalous steps are a collapse, which began at the first
anomalous step not followed by `patience` healthy ones: the trainer then rolls back to the last checkpoint that no
step since then saw and whose recent reward is within reward_drop / 4 of the best such checkpoint's (a slow slide
leaves its own degraded checkpoints "clean"; the best checkpoint is kept from pruning), with the learning rate ×
`lr_factor` (at most `max_rollbacks` times), or stops with status
"collapsed" and the reason in summary.json. The guard's state is JSON and saved in every checkpoint (exact resume).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CollapseGuard", "GuardSettings", "Verdict", "best_checkpoint", "good_checkpoint"]

WATCHED = ("reward_mean", "entropy", "clip_frac_tokens", "ratio_max", "ratio_min")
FINITE = ("loss", "grad_norm", "reward_mean", "entropy")


@dataclass(frozen=True)
class GuardSettings:
    """The guard's thresholds (`trainer.guard` in the config; see the module doc for the rules)."""

    window: int = 20
    warmup: int = 10
    patience: int = 3
    z: float = 3.0
    reward_drop: float = 0.5
    entropy_factor: float = 2.0
    entropy_floor: float = 0.0  # nats per token: an entropy this close to its baseline median is never anomalous
    clip_jump: float = 0.25
    ratio_jump: float = 10.0
    ratio_floor: float = 0.0  # |log ratio| never anomalous (the trainer: log(max(1 + ε_high, guard.ratio_floor)))


@dataclass
class Verdict:
    """What the guard made of one step: the rules it broke (rule → explanation) and whether that completes a
    collapse (`patience` anomalous steps in a row, the first being `first_step`)."""

    step: int
    flags: dict[str, str] = field(default_factory=dict)
    collapsed: bool = False
    first_step: int | None = None

    @property
    def reason(self) -> str:
        return "; ".join(f"{k}: {v}" for k, v in self.flags.items())


def _robust(values: list[float]) -> tuple[float, float]:
    """(median, 1.4826 · median absolute deviation): a centre and spread that one outlier cannot move."""
    m = statistics.median(values)
    return m, 1.4826 * statistics.median(abs(v - m) for v in values)


class CollapseGuard:
    """Watches a run's per-step metrics; `observe` each step in order (see the module doc)."""

    def __init__(self, settings: GuardSettings) -> None:
        self.s = settings
        self.history: list[dict[str, float]] = []  # the last `window` healthy steps' watched values (and "step")
        self.streak: list[int] = []  # consecutive anomalous steps, oldest first
        self.since: int | None = None  # the first anomalous step not followed by `patience` healthy ones
        self.healthy_run = 0  # healthy steps in a row
        self.reward_peak: float | None = None  # the best baseline median of reward_mean so far (a slow slide counts)

    def observe(self, step: int, metrics: dict[str, Any]) -> Verdict:
        """Check step `step`'s metrics; healthy steps join the baseline."""
        verdict = Verdict(step, self._flags(metrics))
        if set(verdict.flags) == {"non_finite"}:  # reported; trainer.max_bad_steps decides about such steps
            return verdict
        if verdict.flags:
            self.streak.append(step)
            self.healthy_run = 0
            self.since = step if self.since is None else self.since
            if len(self.streak) >= self.s.patience:  # a rollback goes back before the first anomaly of the episode
                verdict.collapsed, verdict.first_step = True, self.since
        else:
            self.streak = []
            self.healthy_run += 1
            if self.healthy_run >= self.s.patience:
                self.since = None
            kept = {k: float(metrics[k]) for k in WATCHED if _finite(metrics.get(k))}
            self.history = [*self.history, {"step": step, **kept}][-self.s.window:]
        return verdict

    def _flags(self, metrics: dict[str, Any]) -> dict[str, str]:
        s, flags = self.s, {}
        bad = [k for k in FINITE if k in metrics and not _finite(metrics[k])]
        if bad or (metrics.get("skipped_updates") or 0) > 0:
            flags["non_finite"] = (f"{', '.join(bad)} not finite" if bad else f"{metrics['skipped_updates']:g} "
                                   "update(s) skipped for a non-finite loss or gradient")
        if len(self.history) < s.warmup:
            return flags

        def baseline(key: str, log: bool = False) -> tuple[float, float] | None:
            values = [h[key] for h in self.history if key in h and (not log or h[key] > 0)]
            if len(values) < s.warmup or not _finite(metrics.get(key)) or (log and metrics[key] <= 0):
                return None
            return _robust([abs(math.log(v)) for v in values] if log else values)

        if (b := baseline("reward_mean")) is not None:
            m, sd = b
            self.reward_peak = m if self.reward_peak is None else max(self.reward_peak, m)
            ref = self.reward_peak
            limit = ref - max(s.z * sd, s.reward_drop * abs(ref))
            if metrics["reward_mean"] < limit:
                flags["reward"] = (f"reward_mean {metrics['reward_mean']:.4g} < {limit:.4g} (baseline median {m:.4g}, "
                                   f"best {ref:.4g})")
        if (b := baseline("entropy")) is not None:
            m, sd = b
            low = m - max(s.z * sd, (1 - 1 / s.entropy_factor) * m, s.entropy_floor)
            high = m + max(s.z * sd, (s.entropy_factor - 1) * m, s.entropy_floor)
            x = metrics["entropy"]
            if not low <= x <= high:
                flags["entropy"] = f"entropy {x:.4g} outside [{low:.4g}, {high:.4g}] (baseline median {m:.4g})"
        if (b := baseline("clip_frac_tokens")) is not None:
            m, sd = b
            limit = m + max(s.z * sd, s.clip_jump)
            if metrics["clip_frac_tokens"] > limit:
                flags["clip_frac"] = (f"clip_frac_tokens {metrics['clip_frac_tokens']:.4g} > {limit:.4g} "
                                      f"(baseline median {m:.4g})")
        for key, sign in (("ratio_max", 1), ("ratio_min", -1)):  # how far from 1, in log space
            if (b := baseline(key, log=True)) is not None:
                m, sd = b
                limit = max(m + s.z * sd, s.ratio_jump * m, s.ratio_floor)
                if abs(math.log(metrics[key])) > limit:
                    flags[key] = (f"{key} {metrics[key]:.4g} {'>' if sign > 0 else '<'} "
                                  f"{math.exp(sign * limit):.4g} (baseline median {math.exp(sign * m):.4g})")
        return flags

    def reward_baseline(self) -> float | None:
        """The median reward_mean of the last `warmup` healthy steps (None before there are as many): what a
        checkpoint taken now is worth to a rollback (`good_checkpoint`). Recent rather than the whole window, whose
        median lags a slow slide by half its length; a median, so that one lucky step does not count."""
        values = [h["reward_mean"] for h in self.history if "reward_mean" in h][-self.s.warmup:]
        return statistics.median(values) if values and len(values) >= self.s.warmup else None

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history], "streak": list(self.streak),
                "reward_peak": self.reward_peak, "since": self.since, "healthy_run": self.healthy_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state.get("history", [])]
        self.streak = list(state.get("streak", []))
        self.reward_peak = state.get("reward_peak")
        self.since = state.get("since")
        self.healthy_run = state.get("healthy_run", 0)


def good_checkpoint(steps: list[int], first_anomalous: int, baselines: dict[int, float | None] | None = None,
                    tolerance: float = 0.125) -> int | None:
    """The checkpoint step to roll back to: the latest clean one (no anomalous step saw its weights: the metrics of
    step d are measured on the rollouts of the weights after d − 1 steps, so checkpoint c is clean when
    c + 1 < `first_anomalous`) whose reward baseline (`baselines[c]`, `CollapseGuard.reward_baseline` when it was
    saved) is within `tolerance`·|best| of the best clean checkpoint's.

    A reward that slides for longer than the guard's window takes its baseline down with it, so the latest clean
    checkpoint can already be the decline's: a rollback there restarts the run from its own slide. Checkpoints
    without a baseline (before the warm-up) count when none has one."""
    clean = [c for c in steps if c + 1 < first_anomalous]
    scored = {c: b for c in clean if (b := (baselines or {}).get(c)) is not None}
    if not scored:
        return max(clean) if clean else None
    best = max(scored.values())
    return max(c for c, b in scored.items() if b >= best - tolerance * abs(best))


def best_checkpoint(baselines: dict[int, float | None]) -> int | None:
    """The checkpoint step with the highest reward baseline (the latest of equals), None if none has one: kept from
    pruning while the guard may roll back, so that a slow decline cannot push every good checkpoint out."""
    scored = [(b, c) for c, b in baselines.items() if b is not None]
    return max(scored)[1] if scored else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

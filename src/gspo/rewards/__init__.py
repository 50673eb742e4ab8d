"""Reward functions and the runner that scores a batch of completions with a weighted sum of them.

A reward function is a plain function `fn(prompt: str, completion: str, **row) -> float`, where `row` holds the data
row's other fields (e.g. `answer`). It is named either by a registry name (`REWARDS`) or by an import path
(`"package.module:function"` or `"package.module.function"`), so user rewards need no registration.

Each call runs under a wall-clock deadline (`timeout_s`, see `gspo.rewards.deadline` for how and at what cost), and
the `code` reward runs model-written programs in a sandboxed child process (`gspo.rewards.sandbox`).
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from gspo.rewards.builtin import addition_reward, countdown_reward, math_reward, parse_arithmetic
from gspo.rewards.deadline import DeadlinePool, Outcome
from gspo.rewards.sandbox import code_reward

__all__ = [
    "REWARDS",
    "RewardFailure",
    "RewardFn",
    "RewardRunner",
    "addition_reward",
    "code_reward",
    "countdown_reward",
    "math_reward",
    "parse_arithmetic",
    "resolve_reward",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]

REWARDS: dict[str, RewardFn] = {
    "addition": addition_reward,
    "code": code_reward,
    "countdown": countdown_reward,
    "math": math_reward,
}

# Row fields that are passed positionally, so they are dropped from the keyword arguments.
_POSITIONAL_FIELDS = ("prompt", "completion")
_PREFIX_CHARS = 60  # how much of a completion a failure message shows
# Timed-out calls still running in abandoned threads beyond which training stops (each may hold CPU and memory).
MAX_STUCK_CALLS = 16


class RewardFailure(RuntimeError):
    """A reward function raised, timed out, or returned something that is not a finite number."""


def resolve_reward(spec: str) -> RewardFn:
    """The reward function named by `spec`: a `REWARDS` name, `"package.module:function"` or
    `"package.module.function"` (a `:` path may name a nested attribute, e.g. `"pkg.mod:Class.method"`).

    Raises ValueError naming the spec: an unknown name (listing the registry), an import that fails (with the
    import error), a missing attribute, or an object that is not callable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    elif "." in spec:
        module_name, _, attr_path = spec.rpartition(".")
    else:
        raise ValueError(
            f"unknown reward {spec!r}: not a registered reward {sorted(REWARDS)} "
            "nor an import path 'package.module:function'"
        )
    if not module_name or not attr_path:
        raise ValueError(f"reward spec {spec!r} is not of the form 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc} "
            f"(registered rewards: {sorted(REWARDS)})"
        ) from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError as exc:
            raise ValueError(f"reward {spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    if not callable(target):
        raise ValueError(f"reward {spec!r} names a {type(target).__name__}, not a function")
    return target


def _check_value(value: Any) -> tuple[float | None, str, str]:
    """(value as float or None, failure kind, failure description) for what a reward function returned."""
    if value is None:
        return None, "none", "returned None"
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy scalars
        as_float = float(value)
        if not math.isfinite(as_float):
            return None, "non_finite", f"returned a non-finite value {value!r}"
        return as_float, "", ""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return None, "non_number", f"returned a non-number {type(value).__name__}: {shown}"


class RewardRunner:
    """Scores completions with a weighted sum of reward functions and accounts for their failures.

    `specs` maps reward specs (see `resolve_reward`; a callable is also accepted, named by its `__name__`) to finite
    weights, as a dict or a list of `(spec, weight)` pairs. A function that raises, runs longer than `timeout_s`
    seconds (None: no limit), or returns None, NaN, ±inf or a non-number, fails for that row: with `on_error="fail"`
    a `RewardFailure` is raised naming the function, the row, the reason and the start of the completion; with
    `on_error="zero"` the function contributes 0 for that row, the failure is counted (`self.failures`, cumulative
    per function, and `reward_failures` in each call's stats) and a warning is logged once per function and kind of
    failure. Timeouts are also counted in `self.timeouts` (and `reward_timeouts` in the stats).

    Calls run in `workers` daemon threads (`DeadlinePool`) when there is a deadline or more than one worker, else
    inline. A timed-out call cannot be stopped and keeps running in its abandoned thread; once more than
    `MAX_STUCK_CALLS` of them are still running, a RewardFailure is raised whatever `on_error` says.
    """

    def __init__(
        self,
        specs: Sequence[tuple[str | RewardFn, float]] | Mapping[str, float],
        on_error: Literal["fail", "zero"] = "fail",
        timeout_s: float | None = 10.0,
        workers: int = 1,
    ) -> None:
        if on_error not in ("fail", "zero"):
            raise ValueError(f"RewardRunner: on_error must be 'fail' or 'zero', got {on_error!r}")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf
        ):
            raise ValueError(f"RewardRunner: timeout_s must be a finite number > 0 or None, got {timeout_s!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"RewardRunner: workers must be an int >= 1, got {workers!r}")
        items = list(specs.items()) if isinstance(specs, Mapping) else list(specs)
        if not items:
            raise ValueError("RewardRunner needs at least one reward function")
        self.names: list[str] = []
        self.functions: list[RewardFn] = []
        self.weights: list[float] = []
        for index, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"RewardRunner: spec {index} must be a (reward, weight) pair, got {item!r}")
            spec, weight = item
            if callable(spec):
                name, fn = getattr(spec, "__name__", repr(spec)), spec
            else:
                name, fn = spec, resolve_reward(spec)
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"RewardRunner: weight of reward {name!r} must be a finite number, got {weight!r}")
            if name in self.names:
                raise ValueError(f"RewardRunner: reward {name!r} is listed twice")
            self.names.append(name)
            self.functions.append(fn)
            self.weights.append(float(weight))
        self.on_error = on_error
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.failures: dict[str, int] = dict.fromkeys(self.names, 0)
        self.timeouts: dict[str, int] = dict.fromkeys(self.names, 0)
        self._warned: set[tuple[str, str]] = set()
        self._pool = DeadlinePool(workers, self.timeout_s) if self.timeout_s is not None or workers > 1 else None

    def _invoke(self, calls: list[tuple[RewardFn, tuple, dict]]) -> list[Outcome]:
        """Run the calls (inline, or in the pool with the deadline); outcomes in call order."""
        if self._pool is None:
            outcomes = []
            for fn, args, kwargs in calls:
                try:
                    outcomes.append(Outcome(value=fn(*args, **kwargs)))
                except Exception as exc:
                    outcomes.append(Outcome(error=exc))
            return outcomes
        outcomes = self._pool.map(calls)
        stuck = self._pool.stuck
        if stuck > MAX_STUCK_CALLS:
            raise RewardFailure(
                f"{stuck} reward calls that timed out (rewards.timeout_s={self.timeout_s:g}) are still running in "
                "background threads, which Python cannot stop; stopping before they take over the process. Fix the "
                "hanging reward function, or run untrusted code through gspo.rewards.sandbox"
            )
        return outcomes

    def _score(self, name: str, index: int, completion: str, outcome: Outcome) -> tuple[float, bool]:
        """Judge one function's outcome on one row: (value, failed). Raises RewardFailure in "fail" mode."""
        cause: BaseException | None = None
        if outcome.timed_out:
            self.timeouts[name] += 1
            value, kind = None, "timeout"
            reason = f"timed out after {self.timeout_s:g} s (rewards.timeout_s; the call was abandoned)"
        elif outcome.error is not None:
            if not isinstance(outcome.error, Exception):  # SystemExit from a reward function: not ours to swallow
                raise outcome.error
            exc = outcome.error
            value, kind, reason, cause = None, "exception", f"raised {type(exc).__name__}: {exc}", exc
        else:
            value, kind, reason = _check_value(outcome.value)
        if value is not None:
            return value, False
        self.failures[name] += 1
        message = (
            f"reward function {name!r} failed on row {index}: {reason}; "
            f"completion starts {completion[:_PREFIX_CHARS]!r}"
        )
        if self.on_error == "fail":
            raise RewardFailure(message) from cause
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            logger.warning(
                "%s. Scoring it 0; further %s failures of %r are counted but not logged.", message, kind, name
            )
        return 0.0, True

    def __call__(
        self, prompts: list[str], completions: list[str], rows: list[dict]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Score each completion. Returns float32 rewards [N] (the weighted sum) and stats: the unweighted mean of
        each function (`reward/<name>`, failures counted as 0), this call's failure count (`reward_failures`) and
        how many of those were timeouts (`reward_timeouts`)."""
        n = len(completions)
        if len(prompts) != n or len(rows) != n:
            raise ValueError(
                f"RewardRunner: got {len(prompts)} prompts, {n} completions and {len(rows)} rows; they must match"
            )
        if n == 0:
            raise ValueError("RewardRunner: no completions to score")
        for i, (prompt, completion, row) in enumerate(zip(prompts, completions, rows, strict=True)):
            if not isinstance(prompt, str) or not isinstance(completion, str) or not isinstance(row, Mapping):
                raise ValueError(
                    f"RewardRunner: row {i} needs a str prompt, a str completion and a dict row, got "
                    f"{type(prompt).__name__}, {type(completion).__name__}, {type(row).__name__}"
                )
        kwargs = [{k: v for k, v in row.items() if k not in _POSITIONAL_FIELDS} for row in rows]
        outcomes = self._invoke(
            [(fn, (prompts[i], completions[i]), kwargs[i]) for fn in self.functions for i in range(n)]
        )
        totals = [0.0] * n
        stats: dict[str, float] = {}
        call_failures = 0
        timeouts_before = sum(self.timeouts.values())
        for k, (name, weight) in enumerate(zip(self.names, self.weights, strict=True)):
            values = []
            for i in range(n):
                value, failed = self._score(name, i, completions[i], outcomes[k * n + i])
                call_failures += failed
                values.append(value)
                totals[i] += weight * value
            stats[f"reward/{name}"] = sum(values) / n
        stats["reward_failures"] = float(call_failures)
        stats["reward_timeouts"] = float(sum(self.timeouts.values()) - timeouts_before)
        return torch.tensor(totals, dtype=torch.float32), stats

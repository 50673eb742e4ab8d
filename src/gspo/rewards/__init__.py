"""Reward functions and the runner that scores a batch of completions with a weighted sum of them.

A reward function is a plain function `fn(prompt: str, completion: str, **row) -> float`, where `row` holds the data
row's other fields (e.g. `answer`). It is named either by a registry name (`REWARDS`), by an import path
(`"package.module:function"` or `"package.module.function"`; modules in the working directory are found), or by a
file (`"path/to/rewards.py:function"`), so user rewards need no registration. `check_signature` tells, before any
compute, whether a function can be called that way with a given row.

A *batched* reward (`batched`, TRL's reward-function signature) is called once per batch, by keyword, as
`fn(prompts=list[str], completions=list[str], **columns) -> list[float]`, each column a row field's N values: for
rewards that pay per call (an LLM judge behind an API, a model). A learned reward model is named `model:PATH` (a local
folder or hub id of a one-output sequence classifier, `gspo.rewards.model.RewardModel`).

A batch's calls share one wall-clock deadline (`timeout_s`, see `gspo.rewards.deadline` for how and at what cost),
and the `code` reward runs model-written programs in a sandboxed child process (`gspo.rewards.code` on `gspo.sandbox`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from gspo.rewards.builtin import (
    addition_reward,
    answer_extractor,
    countdown_reward,
    last_number_reward,
    math_reward,
    parse_arithmetic,
    with_answer,
)
from gspo.rewards.code import code_reward, make_code_reward
from gspo.rewards.deadline import DeadlinePool, Outcome
from gspo.rewards.model import RewardModel, reward_model_options
from gspo.rewards.shaping import add_overlong_penalty
from gspo.rewards.thinking import THINK_TAGS, after_thinking, check_think_tags, final_answer, judges_final_answer

__all__ = [
    "REWARDS",
    "THINK_TAGS",
    "RewardFailure",
    "RewardFn",
    "RewardModel",
    "RewardRunner",
    "RewardScores",
    "Routes",
    "addition_reward",
    "after_thinking",
    "answer_extractor",
    "batched",
    "check_signature",
    "code_reward",
    "countdown_reward",
    "counted_completions",
    "drop_unscored",
    "final_answer",
    "is_batched",
    "last_number_reward",
    "math_reward",
    "mean_reward_stats",
    "merge_reward_stats",
    "parse_arithmetic",
    "resolve_reward",
    "reward_mean_rows",
    "reward_model_options",
    "score_trajectory",
    "weighted_reward_stats",
    "with_answer",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]

REWARDS: dict[str, RewardFn] = {
    "addition": addition_reward,
    "code": code_reward,
    "countdown": countdown_reward,
    "last_number": last_number_reward,
    "math": math_reward,
}

# Row fields that are passed positionally, so they are dropped from the keyword arguments.
_POSITIONAL_FIELDS = ("prompt", "completion")
_PREFIX_CHARS = 60  # how much of a completion a failure message shows
# Timed-out calls still running in abandoned threads beyond which training stops (each may hold CPU and memory).
MAX_STUCK_CALLS = 16


MODEL_PREFIX = "model:"  # `model:PATH` names a reward model (RewardModel) rather than a function


class RewardFailure(RuntimeError):
    """A reward function raised (or called sys.exit), timed out, or returned something that is not a finite number."""


def batched(fn: Callable[..., Any]) -> RewardFn:
    """Mark `fn` as a batched reward: called once per batch as `fn(prompts=..., completions=..., **columns)`, by
    keyword, where `prompts` and `completions` are the batch's N strings and each column is a row field's N values
    (e.g. `answer=[...]`); it returns N numbers (a list, tuple, numpy array or tensor). This is how TRL calls its
    reward functions, so a TRL reward function (e.g. `def reward_len(completions, **kwargs)`) works as `batched(fn)`
    (with string prompts; a None value is a failure here, see RewardRunner).

    Failures are per row: a None / NaN / non-number value fails that row; raising, timing out or returning the wrong
    count fails every row of the batch. Use it for rewards that pay per call (an API judge, a model)."""
    if not callable(fn):
        raise ValueError(f"batched: {fn!r} is not callable")

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.batched = True
    return call


def is_batched(fn: RewardFn) -> bool:
    """Whether `fn` is called once per batch (`batched`, RewardModel) rather than once per row."""
    return getattr(fn, "batched", False) is True


def resolve_reward(spec: str, model_options: Mapping[str, Any] | None = None,
                   code_options: Mapping[str, Any] | None = None) -> RewardFn:
    """The reward function named by `spec`: a `REWARDS` name, `"package.module:function"`,
    `"package.module.function"` (a `:` path may name a nested attribute, e.g. `"pkg.mod:Class.method"`), or
    `"model:PATH"`, a reward model loaded from a folder or hub id with `RewardModel(PATH, **model_options)`.
    `"code"` with `code_options` (a config's `rewards.code`) is `make_code_reward(**code_options)`.

    Raises ValueError naming the spec: an unknown name (listing the registry), an import that fails (with the
    import error), a missing attribute, an object that is not callable, or a folder that is not a reward model.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    if spec == "code" and code_options:
        try:
            return make_code_reward(**code_options)
        except ValueError as exc:  # a limit or package the sandbox refuses: named as the config's key
            raise ValueError(f"rewards.code: {exc}") from exc
    if spec in REWARDS:
        return REWARDS[spec]
    if spec.startswith(MODEL_PREFIX):
        path = spec[len(MODEL_PREFIX):].strip()
        if not path:
            raise ValueError(f"reward spec {spec!r} names no reward model: write model:PATH (a folder or hub id)")
        try:
            return RewardModel(path, **dict(model_options or {}))
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"reward {spec!r}: {exc}") from exc
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
        target: Any = _import_module(module_name)
    except SystemExit as exc:  # argparse at import: its usage line and exit 2 would read as gspo's own usage error
        raise ValueError(
            f"reward {spec!r}: importing module {module_name!r} called sys.exit({exc.code!r}) (does it parse "
            "command-line arguments at import? Move that under `if __name__ == \"__main__\":`); any usage or error "
            "lines printed above are the module's, not gspo's"
        ) from exc
    except Exception as exc:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc} "
            f"(registered rewards: {sorted(REWARDS)}){_local_file_hint(module_name, attr_path)}"
        ) from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError as exc:
            raise ValueError(f"reward {spec!r}: {module_name!r} has no attribute {attr_path!r}"
                             f"{_local_file_hint(module_name, attr_path)}") from exc
    if not callable(target):
        raise ValueError(f"reward {spec!r} names a {type(target).__name__}, not a function")
    return target


def _import_module(name: str) -> Any:
    """Import a module by dotted name, or a `.py` file by path. The working directory is searched after sys.path
    (as `python -m` would, but without letting a local file shadow an installed module), so `my_rewards:fn` works
    from the `gspo` command too."""
    if name.endswith(".py"):
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {path}")
        module_name = f"gspo_user_rewards.{path.stem}_{abs(hash(str(path))):x}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        return sys.modules[module_name]
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path and importlib.util.find_spec(name.split(".")[0]) is None:
        sys.path.append(cwd)
    return importlib.import_module(name)


def _local_file_hint(module_name: str, attr_path: str) -> str:
    """Why `module_name` may not be the user's file: when the working directory holds `<top>.py` (or a `<top>/`
    package) but Python finds another `<top>` first (a standard-library or installed module, which a local file does
    not shadow, see `_import_module`), a sentence saying so and naming the file form that loads the user's file;
    else "". `<top>` is the name's first part: a submodule is only looked for in its parent package."""
    if module_name.endswith(".py"):
        return ""
    top = module_name.split(".")[0]
    local = next((p for p in (Path(f"{top}.py"), Path(top, "__init__.py")) if p.is_file()), None)
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return ""
    origin = None if spec is None else spec.origin
    if local is None or origin is None or Path(origin).resolve() == local.resolve():
        return ""  # no such local file, or it is what Python imported: the problem is in it
    parts = Path(*module_name.split("."))
    file = next((p for p in (parts.with_suffix(".py"), parts / "__init__.py") if p.is_file()), None)
    instead = f"name the file instead ({file.as_posix()}:{attr_path}) or rename it" if file else "rename it"
    return (f". Note: Python imported its {top!r} module from {origin}, not ./{local.as_posix()}: a file in the "
            f"working directory does not shadow an installed module of the same name; {instead}")


def check_signature(fn: RewardFn, name: str, row: Mapping[str, Any]) -> None:
    """Raise ValueError, before any compute, when `fn` cannot be called as `fn(prompt, completion, **fields)` with
    the fields of `row` (a sample data row), naming the function, what does not fit and the expected signature."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without a signature: it will tell at call time
        return
    fields = {k: v for k, v in row.items() if k not in _POSITIONAL_FIELDS}
    try:
        if is_batched(fn):
            signature.bind(prompts=["prompt"], completions=["completion"], **{k: [v] for k, v in fields.items()})
        else:
            signature.bind("prompt", "completion", **fields)
    except TypeError as exc:
        if is_batched(fn):
            raise ValueError(
                f"batched reward {name!r} cannot be called with a batch's columns (fields {sorted(fields)}): {exc}. "
                "A batched reward is called by keyword, as TRL calls its reward functions: it must accept "
                "`def reward(prompts: list[str], completions: list[str], **columns) -> list[float]` (or take only "
                "the arguments it needs by name and **kwargs; each column is a field's values, e.g. answer=[...])"
            ) from None
        raise ValueError(
            f"reward {name!r} cannot be called with a data row (fields {sorted(fields)}): {exc}. A reward function "
            "must accept `def reward(prompt: str, completion: str, **row) -> float` (the row's other fields, e.g. "
            "answer, come as keyword arguments; take the ones you need by name and keep **row for the rest)"
        ) from None


def _check_value(value: Any) -> tuple[float | None, str, str]:
    """(value as float or None, failure kind, failure description) for what a reward function returned."""
    if value is None:
        return None, "none", "returned None"
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-dim tensor or numpy array: its number
        value = value.item()
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy scalars
        try:
            as_float = float(value)
        except OverflowError:  # an int or Fraction beyond float's range
            return None, "non_finite", f"returned a value too large for a float: {_shown(value)}"
        if not math.isfinite(as_float):
            return None, "non_finite", f"returned a non-finite value {_shown(value)}"
        return as_float, "", ""
    hint = (" (a function that scores the whole batch at once needs the @gspo.rewards.batched decorator)"
            if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) >= 1 else "")
    return None, "non_number", f"returned a non-number {type(value).__name__}: {_shown(value)}{hint}"


def _shown(value: Any) -> str:
    """`value`'s repr, at most 80 characters."""
    if isinstance(value, int) and value.bit_length() > 256:  # the repr of a huge int is refused past 4300 digits
        return f"an int of {value.bit_length()} bits"
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


@dataclass(frozen=True)
class Routes:
    """Which reward functions score which rows, for mixed data (math rows with a verifier, code rows with tests):
    a row whose `field` holds V is scored by the functions `table[V]` lists and by every function that no route lists
    (e.g. a format reward for all). A function is not called on the rows of other routes: it adds nothing to their
    reward and fails nothing (the config's `rewards.route_by` / `rewards.routes`)."""

    field: str
    table: Mapping[str, Sequence[str]]

    def route(self, row: Mapping[str, Any], index: int, where: str = "row") -> str:
        """The route of `row` (its `field`, as a string). Raises ValueError naming the row when it has none or one
        that `table` does not list."""
        value = row.get(self.field)
        if value is None or not isinstance(value, str | int | float | bool) or str(value) not in self.table:
            what = ("no such field" if self.field not in row else
                    f"{value!r}, which rewards.routes does not list")
            raise ValueError(f"rewards.route_by {self.field!r}: {where} {index} has {what} (routes: "
                             f"{sorted(self.table)}); every row needs the reward that scores it")
        return str(value)

    def applies(self, names: Sequence[str], rows: Sequence[Mapping[str, Any]],
                where: str = "row") -> dict[str, list[bool]]:
        """For each function of `names`, which of `rows` it scores (a row without a route: `route`'s error)."""
        routed = {name for route in self.table.values() for name in route}
        keys = [self.route(row, i, where) for i, row in enumerate(rows)]
        return {name: [name not in routed or name in self.table[key] for key in keys] for name in names}


class RewardRunner:
    """Scores completions with a weighted sum of reward functions and accounts for their failures.

    `specs` maps reward specs (see `resolve_reward`; a callable is also accepted, named by its `__name__`) to finite
    weights, as a dict or a list of `(spec, weight)` pairs. A function that raises (SystemExit included: sys.exit()
    in a reward is its own failure, not the end of the run; KeyboardInterrupt still stops it), runs longer than
    `timeout_s` seconds (None: no limit), or returns None, NaN, ±inf or a non-number, fails for that row: with
    `on_error="fail"` a `RewardFailure` is raised naming the function, the row, the reason and the start of the
    completion; with `on_error="zero"` (or "mask") the function contributes 0 for that row, the failure is counted
    (`self.failures`, cumulative per function, and `reward_failures` in each call's stats) and a warning is logged
    once per function and kind of failure. Timeouts are also counted in `self.timeouts` (and `reward_timeouts` in
    the stats). "mask" is "zero" here, and tells the trainer to leave such completions out of the loss
    (`score_trajectory` marks them in `traj.extras["reward_failed"]`, `counted_completions`).

    A batched function (`batched`) is one call per batch whose values are then judged row by row; a reward model
    (`model:PATH`, built with `model_options`, see `RewardModel`) is one too, run in the calling thread before the
    deadline starts. `model_options` are `RewardModel`'s keyword arguments (`reward_model_options` makes them from
    the config's `rewards.reward_model` section); `code_options` `make_code_reward`'s, for `"code"` (the config's
    `rewards.code`: `CodeRewardConfig.options`).

    `routes` (`Routes`; None: every function scores every row): which functions score which rows of mixed data.

    `think_tags` (open, close; None: off): a function marked `after_thinking` (the built-in verifiers, reward models)
    judges `final_answer(prompt, completion)`, the text after the completion's reasoning, "" when the reasoning never
    ended (`gspo.rewards.thinking`); the others see the completion as generated.

    Calls run in `workers` daemon threads (`DeadlinePool`) when there is a deadline or more than one worker, else
    inline; all the calls of one batch share one deadline, `timeout_s` after the batch starts. A timed-out call
    cannot be stopped and keeps running in its abandoned thread; once more than `MAX_STUCK_CALLS` of them are still
    running, a RewardFailure is raised whatever `on_error` says.
    """

    def __init__(
        self,
        specs: Sequence[tuple[str | RewardFn, float]] | Mapping[str, float],
        on_error: Literal["fail", "zero", "mask"] = "fail",
        timeout_s: float | None = 30.0,
        workers: int = 1,
        model_options: Mapping[str, Any] | None = None,
        think_tags: Sequence[str] | None = THINK_TAGS,
        routes: Routes | None = None,
        code_options: Mapping[str, Any] | None = None,
    ) -> None:
        if on_error not in ("fail", "zero", "mask"):
            raise ValueError(f"RewardRunner: on_error must be 'fail', 'zero' or 'mask', got {on_error!r}")
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
                name, fn = spec, resolve_reward(spec, model_options, code_options)
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"RewardRunner: weight of reward {name!r} must be a finite number, got {weight!r}")
            if name in self.names:
                raise ValueError(f"RewardRunner: reward {name!r} is listed twice")
            self.names.append(name)
            self.functions.append(fn)
            self.weights.append(float(weight))
        if routes is not None:
            unknown = sorted({name for route in routes.table.values() for name in route} - set(self.names))
            if unknown or not routes.table or not all(routes.table.values()):
                raise ValueError(f"RewardRunner: routes {dict(routes.table)} must map each value to a non-empty list "
                                 f"of the reward functions {self.names}" + (f"; unknown: {unknown}" if unknown else ""))
        self.routes = routes
        self.on_error = on_error
        self.think_tags = check_think_tags(think_tags, "RewardRunner: think_tags")
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.failures: dict[str, int] = dict.fromkeys(self.names, 0)
        self.timeouts: dict[str, int] = dict.fromkeys(self.names, 0)
        self._warned: set[tuple[str, str]] = set()
        self._quiet = False  # `probing`: failures are not logged
        self._first_failures: dict[str, dict[str, Any]] | None = None  # `probing`: each function's first failure
        self._pool = DeadlinePool(workers, self.timeout_s) if self.timeout_s is not None or workers > 1 else None
        self.workers = workers
        self._agreed = self.state_dict()  # the counters as every process last agreed on them (`sync_counts`)

    @contextlib.contextmanager
    def probing(self) -> Iterator[dict[str, dict[str, Any]]]:
        """Calls that are not the run's (`gspo.rewards.checks`): a failure scores 0 and is not logged, whatever
        `on_error` says, and afterwards the counters, `on_error` and the first-failure logs are as they were.

        Yields a dict that collects each function's first failure while probing, `{name: {"row", "reason",
        "completion"}}` (the row's index in its batch, e.g. "raised KeyError: 'x'", the completion's start): the
        caller, which sees no log, can then say which function failed and how (it may clear the dict between
        batches)."""
        saved = self.on_error, self.state_dict(), set(self._warned), dict(self._agreed)
        self.on_error, self._quiet, self._first_failures = "zero", True, {}
        try:
            yield self._first_failures
        finally:
            self.on_error, counts, self._warned, agreed = saved
            self.failures, self.timeouts = dict(counts["failures"]), dict(counts["timeouts"])
            self._agreed, self._quiet, self._first_failures = agreed, False, None

    def deadline_warning(self, rows: int) -> str | None:
        """Why a batch of `rows` completions could time out calls that are not slow themselves, or None: the
        functions with a per-call time limit (`call_timeout_s`: the sandboxed `code` reward's) may take that long on
        each row (a program that loops), and the `workers` threads then need more than the batch's one deadline
        (`timeout_s`), so the calls queued behind them time out (scored as failures, a correct program included)."""
        limits = [getattr(fn, "call_timeout_s", None) for fn in self.functions]
        per_row = sum(t for t in limits if t is not None)
        if self.timeout_s is None or not per_row:
            return None
        worst = math.ceil(rows / self.workers) * per_row
        if worst <= self.timeout_s:
            return None
        rounds = math.floor(self.timeout_s / per_row)  # rounds of calls the deadline holds; workers that fit:
        workers = (f"raise rewards.workers (sandboxed programs run in their own processes) to "
                   f"{math.ceil(rows / rounds)} or " if rounds else "")
        return (f"rewards.timeout_s={self.timeout_s:g} s is one deadline for a batch's reward calls, but its {rows} "
                f"completions' sandboxed calls may take up to {per_row:g} s each (a looping program) on "
                f"rewards.workers={self.workers}: ~{worst:g} s, so calls queued behind slow ones time out, correct "
                f"programs included; {workers}raise rewards.timeout_s to {worst:g}")

    @classmethod
    def from_config(cls, settings: Any, device: str | torch.device | None = None,
                    on_error: Literal["fail", "zero", "mask"] | None = None) -> RewardRunner:
        """The runner a config's `rewards` section (`gspo.config.RewardConfig`) describes, its reward models on
        `device` unless the section names one; `on_error` overrides the section's (evaluation counts failures)."""
        routes = None if settings.route_by is None else Routes(settings.route_by, settings.routes)
        return cls(settings.functions, on_error=on_error or settings.on_error, timeout_s=settings.timeout_s,
                   workers=settings.workers, think_tags=settings.think_tags, routes=routes,
                   model_options=reward_model_options(settings.reward_model.model_dump(), device),
                   code_options=settings.code.options())

    def applies(self, rows: Sequence[Mapping[str, Any]], where: str = "row") -> dict[str, list[bool]]:
        """For each function, which of `rows` it scores (all of them without `routes`)."""
        if self.routes is None:
            return {name: [True] * len(rows) for name in self.names}
        return self.routes.applies(self.names, rows, where)

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The cumulative counters (`failures`, `timeouts`: per function), e.g. for a checkpoint."""
        return {"failures": dict(self.failures), "timeouts": dict(self.timeouts)}

    def load_state_dict(self, state: Mapping[str, Mapping[str, int]]) -> None:
        """Continue counting from `state` (a `state_dict()`, e.g. restored from a checkpoint)."""
        self.failures.update(state.get("failures", {}))
        self.timeouts.update(state.get("timeouts", {}))
        self._agreed = self.state_dict()

    def sync_counts(self, all_sum: Callable[[list[float]], list[float]]) -> None:
        """Make the counters the run's totals on every process, when each process scores its own rows: `all_sum` sums
        a list of numbers over the processes (a collective: every process calls this at the same point)."""
        current = self.state_dict()
        keys = [(kind, name) for kind in sorted(current) for name in sorted(current[kind])]
        deltas = all_sum([float(current[k][n] - self._agreed[k].get(n, 0)) for k, n in keys])
        for (kind, name), delta in zip(keys, deltas, strict=True):
            getattr(self, kind)[name] = self._agreed[kind].get(name, 0) + round(delta)
        self._agreed = self.state_dict()

    def _invoke(self, calls: list[tuple[RewardFn, tuple, dict]]) -> list[Outcome]:
        """Run the calls, outcomes in call order: in this thread without a pool or for an `inline` function (a reward
        model: a forward pass, run before the deadline starts), else in the pool under the batch's deadline."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        pooled = []
        for j, (fn, args, kwargs) in enumerate(calls):
            if self._pool is not None and getattr(fn, "inline", False) is not True:
                pooled.append(j)
                continue
            try:
                outcomes[j] = Outcome(value=fn(*args, **kwargs))
            except (Exception, SystemExit) as exc:  # sys.exit() in a reward is its failure (`_score`); Ctrl-C is not
                outcomes[j] = Outcome(error=exc)
        if not pooled:
            return outcomes
        for j, outcome in zip(pooled, self._pool.map([calls[j] for j in pooled]), strict=True):
            outcomes[j] = outcome
        stuck = self._pool.stuck
        if stuck > MAX_STUCK_CALLS:
            raise RewardFailure(
                f"{stuck} reward calls that timed out (rewards.timeout_s={self.timeout_s:g}) are still running in "
                "background threads, which Python cannot stop; stopping before they take over the process. Fix the "
                "hanging reward function, or run untrusted code through gspo.sandbox"
            )
        return outcomes

    def _score(self, name: str, index: int, completion: str, outcome: Outcome) -> tuple[float, bool]:
        """Judge one function's outcome on one row: (value, failed). Raises RewardFailure in "fail" mode."""
        cause: BaseException | None = None
        if outcome.timed_out:
            self.timeouts[name] += 1
            value, kind = None, "timeout"
            reason = (f"timed out after {self.timeout_s:g} s (rewards.timeout_s, one deadline for all of a batch's "
                      "reward calls: this call was abandoned or never started)")
        elif isinstance(outcome.error, SystemExit):  # the function's failure, not a request to end the run
            value, kind, cause = None, "exit", outcome.error
            reason = (f"called sys.exit({outcome.error.code!r}) (a reward function must return a number, e.g. 0 for "
                      "a completion it cannot judge)")
        elif outcome.error is not None:
            if not isinstance(outcome.error, Exception):  # KeyboardInterrupt and the like: not the function's failure
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
        if self._first_failures is not None:  # `probing`: the caller reports each function's first failure
            self._first_failures.setdefault(name, {"row": index, "reason": reason,
                                                   "completion": completion[:_PREFIX_CHARS]})
        if self.on_error == "fail":
            raise RewardFailure(message) from cause
        if (name, kind) not in self._warned and not self._quiet:
            self._warned.add((name, kind))
            outcome = "Leaving the completion out of the loss" if self.on_error == "mask" else "Scoring it 0"
            logger.warning("%s. %s; further %s failures of %r are counted but not logged.", message, outcome, kind,
                           name)
        return 0.0, True

    def __call__(
        self, prompts: list[str], completions: list[str], rows: list[dict]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Score each completion. Returns float32 rewards [N] (the weighted sum) and stats: the unweighted mean of
        each function (`reward/<name>`, failures counted as 0), this call's failure count (`reward_failures`) and
        how many of those were timeouts (`reward_timeouts`)."""
        scores = self.score(prompts, completions, rows)
        return scores.total, scores.stats

    def check_rows(self, rows: Sequence[Mapping[str, Any]], accuracy: str | Sequence[str] | None = None,
                   where: str = "row") -> None:
        """Check, before compute, every function's signature against the fields of each row it scores
        (`check_signature`, once per distinct set of field names), so that a row lacking a field a function requires
        (`answer`) is refused here rather than failing the run when it is first drawn, and a function routed to
        other rows is not checked against rows it never scores; with `routes`, that every row has a route and,
        given the `accuracy` reward(s), that one of them scores it (else nothing could call it solved). Raises
        ValueError naming the row (`where` and its index)."""
        if not rows:
            return
        applies = self.applies(rows, where)  # with routes: every row has a route
        for name, fn in zip(self.names, self.functions, strict=True):
            checked: set[frozenset[str]] = set()
            for i, row in enumerate(rows):
                if not applies[name][i] or frozenset(row) in checked:
                    continue
                checked.add(frozenset(row))
                try:
                    check_signature(fn, name, row)
                except ValueError as e:
                    raise ValueError(f"{where} {i}: {e}") from None
        if self.routes is None:
            return
        if accuracy is not None:
            names = [accuracy] if isinstance(accuracy, str) else list(accuracy)
            unjudged = next((i for i in range(len(rows)) if not any(applies[name][i] for name in names)), None)
            if unjudged is not None:
                route = self.routes.route(rows[unjudged], unjudged)
                raise ValueError(f"{where} {unjudged} (route {route!r}) is scored by none of the accuracy rewards "
                                 f"{names}: name its verifier in rewards.accuracy_reward (a list for mixed data)")

    def drop_unscorable(self, rows: list[dict], split: str) -> tuple[list[dict], int]:
        """`rows` without those that a function which scores them can never judge (its `check_row(row)` raises
        ValueError: the code reward's tests that are not Python, run nothing that can fail, ...), and how many were
        left out (a warning counts them and gives the first one's reason). Every call on such a row would fail and,
        under on_error=fail, stop the run when the row is first drawn. Raises ValueError when none is left."""
        applies = self.applies(rows, f"{split} row")
        checks = [(name, fn.check_row) for name, fn in zip(self.names, self.functions, strict=True)
                  if callable(getattr(fn, "check_row", None))]
        if not checks or not rows:
            return rows, 0
        kept, first = [], None
        for i, row in enumerate(rows):
            try:
                for name, check in checks:
                    if applies[name][i]:
                        check(row)
            except ValueError as e:
                first = first or f"{split} row {i}, reward {name!r}: {e}"
                continue
            kept.append(row)
        left_out = len(rows) - len(kept)
        if not kept:
            raise ValueError(f"no {split} row can be judged by the rewards (the first: {first})")
        if left_out:
            logger.warning("left out %d of %d %s rows that the rewards can never judge (the first: %s)", left_out,
                           len(rows), split, first)
        return kept, left_out

    def _final_answers(self, prompts: Sequence[str], completions: Sequence[str]) -> tuple[list[str] | None, int]:
        """(what the `after_thinking` functions judge: each completion's `final_answer`, "" where its reasoning never
        ended; how many never ended), or (None, 0) when no function is marked or `think_tags` is None."""
        if self.think_tags is None or not any(judges_final_answer(fn) for fn in self.functions):
            return None, 0
        answers = [final_answer(p, c, self.think_tags) for p, c in zip(prompts, completions, strict=True)]
        return ["" if a is None else a for a in answers], sum(a is None for a in answers)

    def score(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardScores:
        """Like `__call__`, keeping each function's unweighted values and which calls failed (`RewardScores`); with
        an `after_thinking` function and `think_tags` on, the stats add `unfinished_thinking`, the count of
        completions whose reasoning never ended (scored as an empty answer by those functions)."""
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
        answers, unfinished = self._final_answers(prompts, completions)
        applies = self.applies(rows)
        calls, spans = [], []  # spans[k]: function k's calls, calls[a:b] (one for a batched function, else a row's)
        judged: dict[str, list[str]] = {}
        for name, fn in zip(self.names, self.functions, strict=True):
            start, mine = len(calls), [i for i in range(n) if applies[name][i]]  # the rows it scores (`routes`)
            texts = judged[name] = answers if answers is not None and judges_final_answer(fn) else completions
            if is_batched(fn) and mine:  # by keyword, as TRL calls its reward functions (reward(completions, **kw))
                fields = dict.fromkeys(key for i in mine for key in kwargs[i])  # its rows' fields, in order
                calls.append((fn, (), {"prompts": [prompts[i] for i in mine],
                                       "completions": [texts[i] for i in mine],
                                       **{f: [kwargs[i].get(f) for i in mine] for f in fields}}))
            elif not is_batched(fn):
                calls.extend((fn, (prompts[i], texts[i]), kwargs[i]) for i in mine)
            spans.append((start, len(calls), mine))
        invoked = self._invoke(calls)
        totals = [0.0] * n
        stats: dict[str, float] = {}
        values: dict[str, torch.Tensor] = {}
        failed: dict[str, torch.Tensor] = {}
        timeouts_before = sum(self.timeouts.values())
        for fn, name, weight, (a, b, mine) in zip(self.functions, self.names, self.weights, spans, strict=True):
            outcomes = _per_row(invoked[a], len(mine)) if is_batched(fn) and mine else invoked[a:b]
            scored = dict(zip(mine, (self._score(name, i, completions[i], o) for i, o in zip(mine, outcomes,
                                                                                              strict=True)),
                              strict=True))  # a row it does not score: 0, not failed
            for i, (value, _) in scored.items():
                totals[i] += weight * value
            values[name] = torch.tensor([scored.get(i, (0.0, False))[0] for i in range(n)], dtype=torch.float32)
            failed[name] = torch.tensor([scored.get(i, (0.0, False))[1] for i in range(n)], dtype=torch.bool)
            # the mean over the rows it scores (0 without any), but for those whose call failed under on_error=mask
            # (they leave the loss: their 0 is no score); with routes or on_error=mask, how many (`reward_rows/`):
            # merging batches or processes weights each mean by its rows (`reward_mean_rows`). Every batch of such a
            # run has the key, failures or not: a merge sums it over every batch, and torchrun's processes sum the
            # same keys in the same order (`ProcessGroup.gather_trajectories`)
            kept = [v for v, failure in scored.values() if not (failure and self.on_error == "mask")]
            stats[f"reward/{name}"] = sum(kept) / len(kept) if kept else 0.0
            if self.routes is not None or self.on_error == "mask":
                stats[f"reward_rows/{name}"] = float(len(kept))
        stats["reward_failures"] = float(sum(int(f.sum()) for f in failed.values()))
        stats["reward_timeouts"] = float(sum(self.timeouts.values()) - timeouts_before)
        if answers is not None:
            stats["unfinished_thinking"] = float(unfinished)
        return RewardScores(torch.tensor(totals, dtype=torch.float32), values, failed, stats, judged,
                            {name: torch.tensor(applies[name], dtype=torch.bool) for name in self.names})


def reward_mean_rows(stats: Mapping[str, float], key: str, rows: int) -> float:
    """How many rows the mean `stats[key]` (`reward/<name>`) of a batch of `rows` completions is over: the rows the
    function scored (`reward_rows/<name>`, with routes or on_error=mask), else all of them. Merging batches or
    processes weights each mean by it."""
    return stats.get(key.replace("reward/", "reward_rows/", 1), float(rows))


def weighted_reward_stats(stats: Mapping[str, float], rows: int) -> tuple[dict[str, float], dict[str, float]]:
    """One batch's stats as sums to add up over batches or processes: (each `reward/<name>` mean × the rows behind
    it and every other stat (a count) as it is, the weights: those rows, 1 for a count). `mean_reward_stats` of the
    totals is the merged stats."""
    weights = {k: reward_mean_rows(stats, k, rows) if k.startswith("reward/") else 1.0 for k in stats}
    return {k: v * weights[k] for k, v in stats.items()}, weights


def mean_reward_stats(sums: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Merged stats from `weighted_reward_stats` totals: each `reward/<name>` the mean over all the rows it scored (0
    over none), counts as summed."""
    return {k: v / weights[k] if k.startswith("reward/") and weights[k] else v for k, v in sums.items()}


def merge_reward_stats(parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """The stats of several batches scored apart (dynamic sampling's rounds), each `(stats, rows)`: counts add up,
    and each `reward/<name>` is the mean over all the rows it scored (`weighted_reward_stats`)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for stats, rows in parts:
        part_sums, part_weights = weighted_reward_stats(stats, rows)
        for k, v in part_sums.items():
            sums[k], weights[k] = sums.get(k, 0.0) + v, weights.get(k, 0.0) + part_weights[k]
    return mean_reward_stats(sums, weights)


def drop_unscored(stats: dict[str, float]) -> dict[str, float]:
    """`stats` without the `reward/<name>` of functions that scored no row (routes): no mean over nothing."""
    return {k: v for k, v in stats.items() if not (k.startswith("reward/") and reward_mean_rows(stats, k, 1) == 0)}


def _per_row(outcome: Outcome, n: int) -> list[Outcome]:
    """A batched call's outcome as n per-row outcomes: its values one by one; its error or timeout, or a return
    that is not n numbers in a sequence, for every row."""
    if outcome.timed_out or outcome.error is not None:
        return [outcome] * n
    values = outcome.value
    if getattr(values, "ndim", None) == 2 and values.shape[-1] == 1:  # [N, 1]: a classifier's one logit per row
        values = values[:, 0]
    values = values.tolist() if hasattr(values, "tolist") else values  # a tensor or numpy array
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        error = ValueError(f"a batched reward must return a sequence of {n} numbers, got {type(values).__name__}")
        return [Outcome(error=error)] * n
    if len(values) != n:
        return [Outcome(error=ValueError(f"returned {len(values)} values for {n} completions"))] * n
    return [Outcome(value=v) for v in values]


@dataclass
class RewardScores:
    """One batch's scores: the weighted sum [N] (what training uses), each function's unweighted values [N] (a failed
    call counts 0) and failure flags [N], the stats `RewardRunner.__call__` returns, and the texts each function
    judged [N] (a completion, or its `final_answer` for an `after_thinking` function: what maj@k votes on)."""

    total: torch.Tensor
    values: dict[str, torch.Tensor]
    failed: dict[str, torch.Tensor]
    stats: dict[str, float]
    texts: dict[str, list[str]] = field(default_factory=dict)
    applies: dict[str, torch.Tensor] = field(default_factory=dict)  # [N] bool: which rows a function scored (routes)

    def correct(self, reward: str | Sequence[str], threshold: float = 1.0) -> torch.Tensor:
        """Which completions count as solved: `reward`'s unweighted value is at least `threshold` (and its call did
        not fail), whatever the other functions and the weights say. Several rewards (mixed data, `routes`): each
        of them that scored the row says solved, and at least one did."""
        names = [reward] if isinstance(reward, str) else list(reward)
        unknown = [name for name in names if name not in self.values]
        if unknown or not names:
            raise ValueError(f"accuracy reward {reward!r} is not one of the scored functions {sorted(self.values)}")
        solved = torch.ones_like(self.failed[names[0]])
        scored = torch.zeros_like(solved)
        for name in names:
            applies = self.applies.get(name, torch.ones_like(solved))
            ok = (self.values[name] >= threshold - 1e-6) & ~self.failed[name]
            solved &= ok | ~applies
            scored |= applies
        return solved & scored

    def judge(self, reward: str | Sequence[str]) -> list[str]:
        """Each completion's accuracy reward: `reward`, or of several the first that scored the row."""
        names = [reward] if isinstance(reward, str) else list(reward)
        n = len(self.total)
        return [next((name for name in names if name not in self.applies or bool(self.applies[name][i])), names[0])
                for i in range(n)]

    def rows_failed(self) -> torch.Tensor:
        """Completions on which at least one function failed [N]."""
        return torch.stack(list(self.failed.values())).any(0)


def counted_completions(cfg: Any, traj) -> torch.Tensor | None:
    """[N] bool: the completions that count in the loss and in their groups' statistics: every one but those on which
    a reward call failed, under `rewards.on_error: mask` (`traj.extras["reward_failed"]`), and the episodes their
    environment failed, under `env.on_failure: mask` (`gspo.agent.failed_episodes`). None when every one counts."""
    from gspo.agent.episodes import failed_episodes  # the agent imports this package

    out = torch.zeros(len(traj), dtype=torch.bool, device=traj.completion_ids.device)
    if cfg.rewards.on_error == "mask" and "reward_failed" in traj.extras:
        out |= traj.extras["reward_failed"].to(out.device)
    episodes = failed_episodes(traj) if cfg.env is not None and cfg.env.on_failure == "mask" else None
    if episodes is not None:
        out |= episodes.to(out.device)
    return ~out if out.any() else None


def score_trajectory(runner: RewardRunner, rows: list[dict], traj, settings, max_new_tokens: int
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards a rollout batch trains on ([N], with stats): the one place the synchronous
    collect and the asynchronous rollout workers compute them, so both train on the same rewards.

    Each completion is scored against its prompt's row (`rows[traj.prompt_index[k]]`); the stats are `score`'s plus
    `solved`, the count of completions that `settings.accuracy_reward` ≥ `settings.accuracy_threshold` calls solved.
    Each row's unweighted value of every function (`traj.extras["reward_values"]`, [N, F] in `runner.names` order;
    NaN where `routes` keep a function off the row) and
    its verdict (`traj.extras["solved"]`, [N]) and whether a call failed on it (`traj.extras["reward_failed"]`, [N])
    travel with the rows (`log.rollouts` shows them). For a multi-turn
    episode (`traj.token_rewards` set) the final reply's reward is added on the episode's last policy token, next to
    the per-turn rewards the environment gave, and the episode's return is their sum (`token_rewards` is updated in
    place). Then DAPO's soft overlong shaping
    (`gspo.rewards.shaping`) when `settings.overlong_buffer` is set. `settings` is the config's `rewards` section
    (`gspo.config.RewardConfig`); `max_new_tokens` the rollout's budget per completion."""
    row_of = [rows[i] for i in traj.prompt_index.tolist()]  # one device-to-host copy, not one per row
    scored = runner.score([r["prompt"] for r in row_of], traj.completions, row_of)
    solved = scored.correct(settings.accuracy_reward, settings.accuracy_threshold)
    total, stats = scored.total, {**scored.stats, "solved": float(solved.sum())}
    device = traj.completion_ids.device
    traj.extras["reward_values"] = torch.stack([scored.values[name].masked_fill(~scored.applies[name], math.nan)
                                                for name in runner.names], -1).to(device)  # NaN: not its route
    traj.extras["solved"] = solved.to(device)
    traj.extras["reward_failed"] = scored.rows_failed().to(device)
    if traj.token_rewards is not None:
        last = traj.loss_mask.shape[1] - 1 - traj.loss_mask.flip(-1).argmax(-1)
        traj.token_rewards[torch.arange(len(traj), device=last.device), last] += total.to(traj.token_rewards)
        total = traj.token_rewards.sum(-1)
    return add_overlong_penalty(total, stats, traj.completion_mask.sum(-1), max_new_tokens,
                                settings.overlong_buffer, settings.overlong_penalty)

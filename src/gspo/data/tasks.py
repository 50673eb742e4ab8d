"""Procedural tasks with verifiable answers, for runs that need no downloaded data.

Every task draws problems from a seeded `random.Random`, so `make_task(name, split, size, seed)` is a pure function of
its arguments. Train and test never share a problem, for any seeds: a problem belongs to the test split exactly when a
stable hash of its key falls in one of `TEST_BUCKETS` buckets (`split_of`), and each split only keeps its own
problems. The key is what makes two prompts the same problem (`Task.key`): `12+34=` and `34+12=` are one addition,
`2,4,5:40=` and `4,5,2:40=` one countdown, so a test problem's commuted or reordered twin is never a training row.
Problems are drawn with replacement, so a split may repeat a problem when its problem space is small.

Rows are plain dicts: `prompt` (what the model sees), `answer` (the gold final answer, a string), `solution` (one
correct completion, without EOS, for supervised cold start; for `multiply`, possibly a multi-turn tool-use
demonstration as messages), `task`, plus task-specific fields.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SPLITS", "TASKS", "TEST_BUCKETS", "Task", "make_task", "split_of"]

SPLITS: tuple[str, ...] = ("train", "test")
TEST_BUCKETS = 10  # one problem in TEST_BUCKETS (by prompt hash) is held out for the test split


def split_of(key: str) -> str:
    """The split ("train" or "test") that the problem with this key (`Task.key` of its row) belongs to.

    Uses SHA-256 (not Python's salted `hash`), so the assignment is the same in every process and on every machine.
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


@dataclass(frozen=True)
class Task:
    """A procedural task: integer options with defaults, a check of those options, and a problem sampler.

    `sample(rng, options)` returns one row without the `task` field, or None to ask for another draw; it must be a
    function of the RNG state alone.
    `check(options)` raises ValueError for option values the sampler cannot handle.
    `key(row)` names the problem a row poses, the same for every prompt that poses it (the split and `distinct`
    follow it); by default the prompt.
    `reward`: the registered reward that judges its rows (`gspo eval --task` uses it without a --reward).
    """

    name: str
    defaults: Mapping[str, int]
    check: Callable[[Mapping[str, int]], None]
    sample: Callable[[random.Random, Mapping[str, int]], dict[str, Any] | None]
    key: Callable[[dict[str, Any]], str] = lambda row: row["prompt"]
    reward: str = "addition"  # the leading integer of the completion against the row's answer


def _operands_key(op: str) -> Callable[[dict[str, Any]], str]:
    """The key of a commutative `a op b` problem: its operands in order, so that `b op a` is the same problem."""
    return lambda row: op.join(map(str, sorted((row["a"], row["b"]))))


def _countdown_key(row: dict[str, Any]) -> str:
    """A countdown problem is its multiset of numbers and its target, whatever order the prompt shows them in."""
    return ",".join(map(str, sorted(row["numbers"]))) + ":" + row["answer"]


# ---- addition --------------------------------------------------------------------------------------------------------


def _check_addition(options: Mapping[str, int]) -> None:
    if options["digits"] < 1:
        raise ValueError(f"task 'addition': option digits must be >= 1, got {options['digits']}")


def _sample_addition(rng: random.Random, options: Mapping[str, int]) -> dict[str, Any]:
    """`a+b=` with both operands uniform in [0, 10**digits) (also as fields `a`, `b`, for `data.prompt_template`);
    the answer and the solution are the sum."""
    high = 10 ** options["digits"]
    a, b = rng.randrange(high), rng.randrange(high)
    total = str(a + b)
    return {"prompt": f"{a}+{b}=", "answer": total, "solution": total, "a": a, "b": b}


# ---- multiply (with a calculator tool) ------------------------------------------------------------------------------


def _check_multiply(options: Mapping[str, int]) -> None:
    if options["digits_a"] < 1 or options["digits_b"] < 1:
        raise ValueError(f"task 'multiply': digits_a and digits_b must be >= 1, got {dict(options)}")
    if not 0 <= options["tool_share"] <= 100:
        raise ValueError(f"task 'multiply': tool_share is a percentage in [0, 100], got {options['tool_share']}")


def _sample_multiply(rng: random.Random, options: Mapping[str, int]) -> dict[str, Any]:
    """`a*b=` with a of `digits_a` digits and b of `digits_b` (fields `a`, `b`): a product the tiny models cannot
    compute in their heads, but can with the `calc` tool. The solution (a cold-start demonstration) is, for
    `tool_share` percent of the rows, a tool-use episode in the `call` format (`calc(a*b)`, the tool's result, the
    result as the answer) and otherwise the bare answer."""
    a = rng.randrange(10 ** (options["digits_a"] - 1), 10 ** options["digits_a"])
    b = rng.randrange(10 ** (options["digits_b"] - 1), 10 ** options["digits_b"])
    total = str(a * b)
    solution: str | list[dict] = total
    if rng.randrange(100) < options["tool_share"]:
        solution = [{"role": "assistant", "content": f"calc({a}*{b})"}, {"role": "tool", "content": total},
                    {"role": "assistant", "content": total}]
    return {"prompt": f"{a}*{b}=", "answer": total, "solution": solution, "a": a, "b": b}


# ---- countdown -------------------------------------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class _Expr:
    """An expression under construction: its text, exact integer value and top-level operator (None for a number)."""

    text: str
    value: int
    op: str | None = None


def _combine(left: _Expr, op: str, right: _Expr) -> _Expr:
    """`left op right`, parenthesising operands only where precedence or associativity requires it."""
    prec = _PRECEDENCE[op]
    left_text = left.text if left.op is None or _PRECEDENCE[left.op] >= prec else f"({left.text})"
    right_bare = right.op is None or _PRECEDENCE[right.op] > prec or (right.op == op and op in "+*")
    right_text = right.text if right_bare else f"({right.text})"
    if op == "+":
        value = left.value + right.value
    elif op == "-":
        value = left.value - right.value
    elif op == "*":
        value = left.value * right.value
    else:
        value = left.value // right.value  # only ever called with exact division, see `_valid_ops`
    return _Expr(f"{left_text}{op}{right_text}", value, op)


def _valid_ops(left: int, right: int) -> list[str]:
    """Operators that keep every intermediate value a positive integer (as in the Countdown game)."""
    ops = ["+", "*"]
    if left > right:
        ops.append("-")
    if right > 1 and left % right == 0:
        ops.append("/")
    return ops


def _random_expression(rng: random.Random, numbers: list[int]) -> _Expr:
    """A random expression using each of `numbers` exactly once, with positive integer intermediate values."""
    nodes = [_Expr(str(n), n) for n in numbers]
    while len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        left, right = nodes[i], nodes[j]
        op = rng.choice(_valid_ops(left.value, right.value))
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)]
        nodes.append(_combine(left, op, right))
    return nodes[0]


def _check_countdown(options: Mapping[str, int]) -> None:
    lo, hi = options["min_count"], options["max_count"]
    if not 2 <= lo <= hi <= 8:
        raise ValueError(f"task 'countdown': need 2 <= min_count <= max_count <= 8, got min_count={lo}, max_count={hi}")
    if options["max_number"] < 1:
        raise ValueError(f"task 'countdown': option max_number must be >= 1, got {options['max_number']}")
    if options["max_target"] < 1:
        raise ValueError(f"task 'countdown': option max_target must be >= 1, got {options['max_target']}")


def _sample_countdown(rng: random.Random, options: Mapping[str, int]) -> dict[str, Any] | None:
    """`n1,n2,...:target=`: reach the target with + - * / using each number at most once.

    The target is the value of a random expression over all the numbers, so a solution is known; draws whose target
    falls outside [1, max_target] return None (the caller draws again).
    """
    count = rng.randint(options["min_count"], options["max_count"])
    numbers = [rng.randint(1, options["max_number"]) for _ in range(count)]
    expr = _random_expression(rng, numbers)
    if not 1 <= expr.value <= options["max_target"]:
        return None
    shown = list(numbers)
    rng.shuffle(shown)
    prompt = ",".join(map(str, shown)) + f":{expr.value}="
    return {"prompt": prompt, "answer": str(expr.value), "solution": expr.text, "numbers": shown}


TASKS: dict[str, Task] = {
    "addition": Task(
        name="addition",
        defaults={"digits": 3},
        check=_check_addition,
        sample=_sample_addition,
        key=_operands_key("+"),
    ),
    "multiply": Task(
        name="multiply",
        defaults={"digits_a": 3, "digits_b": 2, "tool_share": 50},
        check=_check_multiply,
        sample=_sample_multiply,
        key=_operands_key("*"),
    ),
    "countdown": Task(
        name="countdown",
        defaults={"min_count": 3, "max_count": 4, "max_number": 20, "max_target": 100},
        check=_check_countdown,
        sample=_sample_countdown,
        key=_countdown_key,
        reward="countdown",
    ),
}


def _resolve_options(task: Task, options: Mapping[str, Any]) -> dict[str, int]:
    """Merge `options` over the task's defaults, rejecting unknown names and non-integer values."""
    unknown = sorted(set(options) - set(task.defaults))
    if unknown:
        raise ValueError(f"task {task.name!r} has no option(s) {unknown}; its options are {dict(task.defaults)}")
    merged = {**task.defaults, **options}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"task {task.name!r}: option {key} must be an int, got {value!r}")
    task.check(merged)
    return merged


def make_task(name: str, split: str = "train", size: int = 1000, seed: int = 0, distinct: bool = False,
              **options: int) -> list[dict]:
    """Draw `size` problems of task `name` from `split` ("train" or "test"), deterministically from `seed`; with
    `distinct`, each problem (`Task.key`) at most once (held-out rows: a problem drawn twice, or its commuted twin,
    would count twice in an accuracy).

    `options` are the task's integer options (see `TASKS[name].defaults`), e.g. `digits=4` for addition.
    Raises ValueError for an unknown task, split or option, a size < 1, or a problem space too small to fill the
    requested split.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"make_task({name!r}): unknown split {split!r}; expected one of {list(SPLITS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"make_task({name!r}): size must be an int >= 1, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"make_task({name!r}): seed must be an int, got {seed!r}")
    task = TASKS[name]
    resolved = _resolve_options(task, options)

    # A string seed is hashed with SHA-512 by `random.Random`, so the stream is stable across processes.
    rng = random.Random(f"gspo/{name}/{split}/{seed}/{sorted(resolved.items())}")
    rows: list[dict] = []
    seen: set[str] = set()
    max_draws = 100 * size + 10_000  # the test split keeps ~1 draw in TEST_BUCKETS; this leaves a wide margin
    for _ in range(max_draws):
        row = task.sample(rng, resolved)
        if row is None or split_of(key := task.key(row)) != split or (distinct and key in seen):
            continue
        seen.add(key)
        rows.append({**row, "task": name})
        if len(rows) == size:
            return rows
    raise ValueError(
        f"make_task({name!r}, split={split!r}): only {len(rows)} of {size} problems found in {max_draws} draws with "
        f"options {resolved}; the problem space is too small for this split, use larger options"
    )

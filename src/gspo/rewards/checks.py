"""The accuracy reward on known answers: a row's own reference must be judged solved, an empty completion and
another row's answer must not (`reward_checks`). A verifier that rejects the gold answers (a format it cannot parse, an
int compared with a str) makes RL learn nothing; one that accepts an empty or a wrong answer makes every accuracy
meaningless; one that raises on an empty completion stops a run (rewards.on_error=fail) at the first one a policy
writes, and one that fails on every row's own answer at its first call (so with on_error=fail that stops the run here,
`RewardCheckFailed`). `gspo train` runs it at the start (rewards.check) and `--check`, and `gspo eval` before it
scores."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gspo.config import ConfigError
from gspo.data import subset_rows
from gspo.rewards import RewardFailure, RewardRunner
from gspo.rewards.thinking import final_answer

__all__ = ["REFERENCE_ROWS", "SPLIT_NAMES", "RewardCheckFailed", "reference_text", "reward_checks", "reward_warnings",
           "split_warnings"]

REFERENCE_ROWS = 200
"""Rows of each split whose references the check scores (a sample by prompt hash; all when there are fewer)."""
SPLIT_NAMES = {"train": "training", "heldout": "held-out"}
"""A run's splits, as `gspo.trainer.check_rewards` keys their results, and as the warnings name them."""
_KINDS = ("reference", "empty", "neighbour")  # the completions `reward_checks` scores, in its order


class RewardCheckFailed(ConfigError, RewardFailure):
    """With rewards.on_error=fail, a reward function fails on every row's own answer: the run would stop at its first
    reward call, so it stops before any compute instead. A configuration error (the CLI exits 2, `--check` fails)
    that is also a `RewardFailure` (what the run would have raised a few seconds later)."""


def reference_text(row: dict, field: str, prompt: str, think_tags: tuple[str, str] | None) -> str | None:
    """Row `field` (`solution` or `answer`) as a completion a correct policy could write, None where the row has no
    text there (a multi-turn solution is a list of messages). Where the prompt opens a reasoning block (R1-style
    templates), the completion must close it before it answers, so the reference follows a close tag."""
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    text = str(value)
    if think_tags is not None and final_answer(prompt, text, think_tags) is None:
        text = f"{think_tags[1]}{text}"
    return text


def reward_checks(runner: RewardRunner, rows: Sequence[dict], accuracy: str | Sequence[str], threshold: float,
                  limit: int = REFERENCE_ROWS) -> dict[str, Any] | None:
    """The accuracy reward(s) on known answers, over a sample of at most `limit` of `rows` (by prompt hash): how many
    rows' own reference is judged solved (`reference_solved` of `rows`), how many are judged wrong by an accuracy
    reward that did not fail on them (`reference_wrong`; the first few in `unsolved`), how many are solved by an
    empty completion (`empty_solved`), and by the next sampled row's reference where it differs from the row's own
    (`neighbour_solved` of `neighbour_rows`), on how many rows of each kind a function failed (`failed`: it raised,
    called sys.exit, timed out or returned no number; `failures` per function and kind: rows failed, rows it scores
    and its first failure), and the rewards' time per completion. A row's reference is its `solution` where that is
    text, else its `answer` (`field` says which were used; a multi-turn demonstration is a list of messages, its
    `answer` is what the final reply must say). None when no sampled row has either.

    Raises RewardCheckFailed when the runner's on_error is "fail" and a function fails on every sampled row's own
    reference that it scores: the run would stop at its first reward call, after the model was built and evaluated."""
    rows = subset_rows(list(rows), limit)
    tags = runner.think_tags
    refs = []  # (row, field, reference)
    for r in rows:
        for f in ("solution", "answer"):
            if (text := reference_text(r, f, r["prompt"], tags)) is not None:
                refs.append((r, f, text))
                break
    if not refs:
        return None
    kept, texts = [r for r, _, _ in refs], [t for _, _, t in refs]
    used = {f for _, f, _ in refs}
    field = " or ".join(f for f in ("solution", "answer") if f in used)
    prompts = [r["prompt"] for r in kept]
    judges = [accuracy] if isinstance(accuracy, str) else list(accuracy)

    scored = [0, 0.0]  # completions, seconds
    failed = {}  # kind: rows on which a function failed (raised, timed out, returned no number)
    failures: dict[str, dict[str, dict[str, Any]]] = {}  # function: kind: rows failed, of rows scored, first failure
    judge_failed: list[bool] = []  # per row: an accuracy reward failed on its own reference

    def solved(kind: str, completions: list[str], which: list[int], first: dict[str, dict[str, Any]]) -> list[bool]:
        if not which:
            return []
        first.clear()
        t0 = time.perf_counter()
        scores = runner.score([prompts[i] for i in which], completions, [kept[i] for i in which])
        scored[0], scored[1] = scored[0] + len(which), scored[1] + time.perf_counter() - t0
        failed[kind] = int(scores.rows_failed().sum())
        for name, flags in scores.failed.items():
            if flags.any():
                f = first[name]
                failures.setdefault(name, {})[kind] = {"rows": int(flags.sum()), "of": int(scores.applies[name].sum()),
                                                       "first": {**f, "row": which[f["row"]]}}
        if kind == "reference":
            judge_failed[:] = [any(bool(scores.failed[name][i]) for name in judges if name in scores.failed)
                               for i in range(len(which))]
        return [bool(v) for v in scores.correct(accuracy, threshold).tolist()]

    everyone = list(range(len(kept)))
    with runner.probing() as first:  # a failure is a finding here, counted by kind; the run's counters don't see it
        own = solved("reference", texts, everyone, first)
        empty = solved("empty", [""] * len(kept), everyone, first)
        # the next row's reference, where it is a different answer: a wrong answer the row's verifier must refuse
        wrong = [i for i in everyone if len(kept) > 1 and texts[(i + 1) % len(kept)].strip() != texts[i].strip()]
        neighbour = solved("neighbour", [texts[(i + 1) % len(kept)] for i in wrong], wrong, first)
    if runner.on_error == "fail":
        _refuse_failing_on_every_reference(failures, field)
    unsolved = [{"row": i, "prompt": prompts[i][-80:], "reference": texts[i][:80]} for i, ok in enumerate(own)
                if not ok and not judge_failed[i]]
    return {"field": field, "sampled": len(rows), "rows": len(kept), "reference_solved": sum(own),
            "reference_wrong": len(unsolved), "unsolved": unsolved[:3], "empty_solved": sum(empty),
            "neighbour_rows": len(wrong), "neighbour_solved": sum(neighbour), "failed": failed, "failures": failures,
            "on_error": runner.on_error, "seconds_per_completion": scored[1] / scored[0]}


def _refuse_failing_on_every_reference(failures: Mapping[str, Mapping[str, dict[str, Any]]], field: str) -> None:
    """Raise RewardCheckFailed for the first function of `failures` (`reward_checks`) that failed on every row's own
    reference it scores: with on_error=fail the run would stop at its first call of it."""
    for name, kinds in failures.items():
        ref = kinds.get("reference")
        if ref is not None and ref["rows"] == ref["of"]:
            raise RewardCheckFailed(
                f"rewards.functions: reward function {name!r} fails on all {ref['of']} checked rows' own {field} "
                f"(correct answers; first {_first(ref['first'])}); with rewards.on_error=fail the run would stop at "
                "its first reward call, so it stops now, before any compute. Fix the function: it must return a "
                "number for every completion")


def _first(failure: Mapping[str, Any], rows: str = "") -> str:
    """A function's first failure (`reward_checks`' `failures`) as words: "on training row 3 ('42'): raised ..."."""
    return f"on {rows + ' ' if rows else ''}row {failure['row']} ({failure['completion']!r}): {failure['reason']}"


def reward_warnings(r: dict[str, Any] | None, name: str) -> list[str]:
    """What a `reward_checks` result of the `name` rows ("training", "held-out", "evaluated") says is wrong with the
    reward functions: references judged wrong, an empty or another row's answer judged right, and one line per
    function that fails on some of them."""
    return _judge_warnings(r, name) + _failure_warnings([(r, name)])


def _judge_warnings(r: dict[str, Any] | None, name: str) -> list[str]:
    """What a `reward_checks` result says about the accuracy reward's verdicts (its failures aside)."""
    found = []
    if r is None:
        return found
    if r["reference_wrong"]:
        first = r["unsolved"][0]
        found.append(f"the accuracy reward judges {r['reference_wrong']} of {r['rows']} {name} rows' "
                     f"own {r['field']} wrong (e.g. row {first['row']}: {first['reference']!r}): a completion "
                     "giving the right answer that way is scored wrong; check the reward's answer format (a row's "
                     "answer and solution reach it as text: a number in the data, JSON 42, is '42')")
    if r["empty_solved"]:
        found.append(f"the accuracy reward judges an empty completion solved on {r['empty_solved']} of {r['rows']} "
                     f"{name} rows: accuracy would count answers never given")
    if r["neighbour_solved"]:
        found.append(f"the accuracy reward judges another row's {r['field']} solved on {r['neighbour_solved']} of "
                     f"{r['neighbour_rows']} {name} rows: it does not compare with the row's own answer")
    return found


def _failure_warnings(results: Sequence[tuple[dict[str, Any] | None, str]]) -> list[str]:
    """One line per function that failed in any of `results` (`reward_checks` results, each with the name of its
    rows): on which completions of which rows it failed, what that does to a run, and its first failure."""
    found = []
    names = dict.fromkeys(fn for r, _ in results if r is not None for fn in r["failures"])
    for fn in names:
        parts, kinds, first, on_error = [], set(), None, "fail"
        for r, rows in results:
            if r is None or fn not in r["failures"]:
                continue
            on_error = r["on_error"]
            for kind in _KINDS:
                if (f := r["failures"][fn].get(kind)) is None:
                    continue
                kinds.add(kind)
                first = first or _first(f["first"], rows)
                count = f"{f['rows']} of {f['of']} {rows} rows"
                parts.append({"reference": f"{count}' own {r['field']}", "empty": f"an empty completion ({count})",
                              "neighbour": f"another row's {r['field']} ({count})"}[kind])
        if on_error == "zero":
            then = "each failure is counted and scored 0"
        elif kinds == {"empty"}:
            then = ("with rewards.on_error=fail a run stops at the first empty completion a policy writes; return 0 "
                    "for it instead")
        else:
            then = "with rewards.on_error=fail a run stops at its first failure; return a number for every completion"
        found.append(f"reward function {fn!r} fails on {', '.join(parts)}: {then} (first {first})")
    return found


def split_warnings(found: Mapping[str, dict[str, Any] | None]) -> list[str]:
    """`reward_warnings` of each split's `reward_checks` result in `found` (keys `SPLIT_NAMES`), with one line per
    failing function for all splits together."""
    results = [(found.get(split), name) for split, name in SPLIT_NAMES.items()]
    return [line for r, name in results for line in _judge_warnings(r, name)] + _failure_warnings(results)

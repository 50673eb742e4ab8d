"""The accuracy reward on known answers: a row's own reference must be judged solved, an empty completion and
another row's answer must not (`reward_checks`). A verifier that rejects the gold answers (a format it cannot parse, an
int compared with a str) makes RL learn nothing; one that accepts an empty or a wrong answer makes every accuracy
meaningless; one that raises on an empty completion stops a run (rewards.on_error=fail) at the first one a policy
writes. `gspo train` runs it at the start (rewards.check) and `--check`, and `gspo eval` before it scores."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from gspo.data import subset_rows
from gspo.rewards import RewardRunner
from gspo.rewards.thinking import final_answer

__all__ = ["REFERENCE_ROWS", "SPLIT_NAMES", "reference_text", "reward_checks", "reward_warnings", "split_warnings"]

REFERENCE_ROWS = 200
"""Rows of each split whose references the check scores (a sample by prompt hash; all when there are fewer)."""
SPLIT_NAMES = {"train": "training", "heldout": "held-out"}
"""A run's splits, as `gspo.trainer.check_rewards` keys their results, and as the warnings name them."""


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
    rows' own reference is judged solved (`reference_solved` of `rows`; the first few that are not in `unsolved`), how
    many are solved by an empty completion (`empty_solved`), and by the next sampled row's reference where it differs
    from the row's own (`neighbour_solved` of `neighbour_rows`), on how many rows of each kind a function failed
    (`failed`: it raised, timed out or returned no number), and the rewards' time per completion. A row's
    reference is its `solution` where that is text, else its `answer` (`field` says which were used; a multi-turn
    demonstration is a list of messages, its `answer` is what the final reply must say). None when no sampled row
    has either."""
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

    scored = [0, 0.0]  # completions, seconds
    failed = {}  # kind: rows on which a function failed (raised, timed out, returned no number)

    def solved(kind: str, completions: list[str], which: list[int]) -> list[bool]:
        if not which:
            return []
        t0 = time.perf_counter()
        scores = runner.score([prompts[i] for i in which], completions, [kept[i] for i in which])
        scored[0], scored[1] = scored[0] + len(which), scored[1] + time.perf_counter() - t0
        failed[kind] = int(scores.rows_failed().sum())
        return [bool(v) for v in scores.correct(accuracy, threshold).tolist()]

    everyone = list(range(len(kept)))
    with runner.probing():  # a failure is a finding here, counted by kind; the run's counters do not see these calls
        own = solved("reference", texts, everyone)
        empty = solved("empty", [""] * len(kept), everyone)
        # the next row's reference, where it is a different answer: a wrong answer the row's verifier must refuse
        wrong = [i for i in everyone if len(kept) > 1 and texts[(i + 1) % len(kept)].strip() != texts[i].strip()]
        neighbour = solved("neighbour", [texts[(i + 1) % len(kept)] for i in wrong], wrong)
    unsolved = [{"row": i, "prompt": prompts[i][-80:], "reference": texts[i][:80]} for i, ok in enumerate(own)
                if not ok]
    return {"field": field, "sampled": len(rows), "rows": len(kept), "reference_solved": sum(own),
            "unsolved": unsolved[:3], "empty_solved": sum(empty), "neighbour_rows": len(wrong),
            "neighbour_solved": sum(neighbour), "failed": failed, "on_error": runner.on_error,
            "seconds_per_completion": scored[1] / scored[0]}


def reward_warnings(r: dict[str, Any] | None, name: str) -> list[str]:
    """What a `reward_checks` result of the `name` rows ("training", "held-out") says is wrong with the accuracy
    reward: references judged wrong, an empty or another row's answer judged right."""
    found = []
    if r is None:
        return found
    if r["reference_solved"] < r["rows"]:
        first = r["unsolved"][0]
        found.append(f"the accuracy reward judges {r['rows'] - r['reference_solved']} of {r['rows']} {name} rows' "
                     f"own {r['field']} wrong (e.g. row {first['row']}: {first['reference']!r}): a completion "
                     "giving the right answer that way is scored wrong; check the reward's answer format")
    if r["empty_solved"]:
        found.append(f"the accuracy reward judges an empty completion solved on {r['empty_solved']} of {r['rows']} "
                     f"{name} rows: accuracy would count answers never given")
    if r["failed"].get("empty"):
        stop = (" with rewards.on_error=fail a run stops at the first empty completion a policy writes"
                if r["on_error"] == "fail" else " each is counted as a failure and scored 0")
        found.append(f"a reward function fails on an empty completion ({r['failed']['empty']} of {r['rows']} {name} "
                     f"rows):{stop}; return 0 for it instead")
    if r["failed"].get("reference"):
        found.append(f"a reward function fails on {r['failed']['reference']} of {r['rows']} {name} rows' own "
                     f"{r['field']}")
    if r["neighbour_solved"]:
        found.append(f"the accuracy reward judges another row's {r['field']} solved on {r['neighbour_solved']} of "
                     f"{r['neighbour_rows']} {name} rows: it does not compare with the row's own answer")
    return found


def split_warnings(found: Mapping[str, dict[str, Any] | None]) -> list[str]:
    """`reward_warnings` of each split's `reward_checks` result in `found` (keys `SPLIT_NAMES`)."""
    return [line for split, name in SPLIT_NAMES.items() for line in reward_warnings(found.get(split), name)]

"""Training rows and held-out rows from one data configuration, disjoint from each other, with a record of where the
held-out rows came from (it goes to summary.json next to the accuracy measured on them).

The held-out rows come from exactly one place:

* an embedded task's test split: disjoint by construction, as problems (`gspo.data.tasks.split_of` of `Task.key`:
  `12+34=` and `34+12=` are one problem, on one side);
* `data.eval_split` of a dataset that has splits (a saved DatasetDict, a hub id, a folder of split files);
* `data.eval_path`: a separate file or dataset;
* `data.eval_fraction` of `data.path`'s rows, chosen by a hash of the prompt (`holdout_bucket`), so the same prompt
  is always on the same side: disjoint by construction, and the same rows whatever the seed or the file's order.

"The prompt" of a row is always the text the model is given: with `data.prompt_template`, the template filled in from
the row (`PromptOf`), not the row's `prompt` field alone (a template "{passage} {prompt}" over rows that share one
question makes every row another prompt, and rows that share a passage and a question one prompt).

For the two sources that are not disjoint by construction, a held-out row whose prompt is also a training prompt is
dropped from the held-out rows (counted in the record, and logged), so that "held-out" accuracy is never measured
on what the policy was trained on.

A file or dataset gives every row it has; `data.train_size` / `data.eval_size` cap that with a sample chosen by
prompt hash (`subset_rows`), so a source sorted by difficulty or by origin never gives a biased prefix. Each record
says how many rows were used of how many (`rows`, `of`). A single file has no test split: asking for one is an error
(`gspo.data.files.load_rows`), never a silent evaluation on the training rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.data.chat import apply_prompt_template
from gspo.data.files import load_rows
from gspo.data.tasks import make_task

__all__ = ["DATA_SOURCE", "EVAL_SET", "MAX_GROUPS", "TASK_ROWS", "DataSplits", "PromptOf", "eval_group_field",
           "eval_groups", "holdout_bucket", "load_data", "near_key", "prompt_of", "source_names", "split_by_fraction",
           "subset_rows"]

# Problems an embedded task draws when data.train_size / data.eval_size are not set (a file or dataset: all rows).
TASK_ROWS = {"train": 20000, "eval": 200}
EVAL_SET = "eval_set"  # the field that a list of data.eval_path files gives each of its held-out rows: the file's name
DATA_SOURCE = "data_source"  # the field a list of data.path sources gives each row that has none: its source's name
MAX_GROUPS = 64  # groups a held-out accuracy is split into at most (data.eval_by)
SUBSET_SALT = b"gspo/subset\0"  # the hash that picks a capped sample, independent of the held-out side
# Fields only training reads (the cold start's SFT targets): a held-out source need not have the column that
# data.fields maps to them, so a held-out file without a `solution` column loads (its rows then have none).
TRAINING_ONLY_FIELDS = ("solution",)

log = logging.getLogger(__name__)

PromptOf = Callable[[dict], Any]
"""A row's prompt as the split, the deduplication and the capped sample compare rows: the text the model is given."""


def _own_prompt(row: dict) -> Any:
    return row["prompt"]


def prompt_of(template: str | None) -> PromptOf:
    """The `PromptOf` of rows under `data.prompt_template` `template` (None: a row's own `prompt`): the template
    filled in from the row, as `gspo.data.chat.apply_prompt_template` fills it (rows are checked there first)."""
    if not template:
        return _own_prompt
    return lambda row: template.format_map(row)


@dataclass
class DataSplits:
    """The rows to train on, the held-out rows, and where each came from (`train_source`, `heldout_source`: JSON)."""

    train: list[dict]
    heldout: list[dict]
    heldout_source: dict[str, Any] = field(default_factory=dict)
    train_source: dict[str, Any] = field(default_factory=dict)  # where the training rows came from: rows of how many


def _prompt_key(prompt: Any) -> str:
    """The identity of a prompt for deduplication and hashing: a string prompt is itself (so the held-out split of a
    string dataset never changes); a conversation (list of messages) is its canonical JSON, keys sorted, so the same
    messages match whatever the key order of the source."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def near_key(prompt: Any) -> str:
    """A prompt as the split check compares it with the training prompts: case-folded, every run of whitespace one
    space, stripped (each message's text, for a conversation). "What is 2+3?" and "what is  2+3? " are one prompt to
    it: a held-out row that differs from a training row only so is not held out."""
    def fold(value: Any) -> Any:
        return " ".join(value.casefold().split()) if isinstance(value, str) else value

    if isinstance(prompt, str):
        return fold(prompt)
    return json.dumps([{k: fold(v) for k, v in m.items()} if isinstance(m, dict) else fold(m) for m in prompt],
                      sort_keys=True)


def holdout_bucket(prompt: Any, salt: bytes = b"") -> float:
    """A number in [0, 1) that is a pure function of the prompt (SHA-256, the same on every machine and process);
    another `salt` gives another number, independent of this one (`subset_rows`'s sample vs the held-out side)."""
    digest = hashlib.sha256(salt + _prompt_key(prompt).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_by_fraction(rows: list[dict], fraction: float,
                      prompt: PromptOf = _own_prompt) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): a row is held out when its prompt's (`prompt(row)`) `holdout_bucket` is below
    `fraction`. Rows with the same prompt land on the same side, so the two are disjoint in prompts, not only in
    rows."""
    if not 0 < fraction < 1:
        raise ValueError(f"split_by_fraction: fraction must be in (0, 1), got {fraction!r}")
    train, heldout = [], []
    for row in rows:
        (heldout if holdout_bucket(prompt(row)) < fraction else train).append(row)
    return train, heldout


def _drop_training_prompts(heldout: list[dict], train: list[dict], where: str, prompt: PromptOf = _own_prompt,
                           advice: str = "use a separate file (data.eval_path) or data.eval_fraction",
                           ) -> tuple[list[dict], int]:
    """Held-out rows without those whose prompt (`prompt(row)`) is also a training prompt, up to case and whitespace
    (`near_key`), and how many were dropped. `advice`: what the error for nothing left says to do."""
    seen = {near_key(prompt(r)) for r in train}
    kept = [r for r in heldout if near_key(prompt(r)) not in seen]
    dropped = len(heldout) - len(kept)
    if dropped:
        log.warning("%s: %d of %d held-out rows have a prompt that is also a training prompt (up to case and "
                    "whitespace); they are left out of the held-out evaluation", where, dropped, len(heldout))
    if not kept:
        raise ValueError(f"{where}: every held-out row's prompt is also a training prompt, so nothing is held out: "
                         f"{advice}")
    return kept, dropped


def subset_rows(rows: list[dict], size: int | None, prompt: PromptOf = _own_prompt) -> list[dict]:
    """At most `size` of `rows` (None: all of them), in their order: the rows whose prompt's (`prompt(row)`)
    `holdout_bucket` under `SUBSET_SALT` is smallest. The choice depends only on the prompts, so it is a uniform
    sample of them whatever the order of the source (a file sorted by difficulty or by source gives no biased prefix)
    and the same on every machine and run."""
    if size is None or len(rows) <= size:
        return rows
    keys = [holdout_bucket(prompt(r), SUBSET_SALT) for r in rows]
    chosen = sorted(sorted(range(len(rows)), key=keys.__getitem__)[:size])  # stable: equal prompts keep their order
    return [rows[i] for i in chosen]


def _drawn(kind: dict[str, Any], rows: list[dict], size: int | None, what: str,
           prompt: PromptOf) -> tuple[list[dict], dict[str, Any]]:
    """`subset_rows(rows, size, prompt)` and the record of it: `rows` kept, `of` how many there were (logged when
    fewer). Held-out rows are first kept once per prompt (`_once`; `repeated_prompts` counts the others)."""
    repeated = {}
    if what == "held-out":
        rows, n = _once(rows, kind.get("path") or kind.get("task"), prompt)
        repeated = {"repeated_prompts": n}
    kept = subset_rows(rows, size, prompt)
    if len(kept) < len(rows):
        log.info("%s rows: %d of %d (data.%s_size), a sample by prompt hash", what, len(kept), len(rows),
                 "train" if what == "training" else "eval")
    return kept, {**kind, "rows": len(kept), "of": len(rows), **repeated}


def repeated_prompts(rows: list[dict], prompt: PromptOf = _own_prompt) -> int:
    """How many of `rows` repeat an earlier row's prompt (`prompt(row)`) up to case and whitespace (`near_key`)."""
    return len(rows) - len({near_key(prompt(r)) for r in rows})


def _once(rows: list[dict], where: Any, prompt: PromptOf) -> tuple[list[dict], int]:
    """Held-out `rows` with each prompt once (the first row of each `near_key`), and how many repeats were left out:
    a problem listed twice would count twice in the accuracy, and its interval would assume two independent rows."""
    seen: set[str] = set()
    kept = []
    for row in rows:
        key = near_key(prompt(row))
        if key not in seen:
            seen.add(key)
            kept.append(row)
    if len(kept) < len(rows):
        log.info("held-out rows of %s: %d repeat an earlier row's prompt (up to case and whitespace) and are "
                 "evaluated once", where, len(rows) - len(kept))
    return kept, len(rows) - len(kept)


def source_names(paths: list[str]) -> list[str]:
    """The names of several sources in records and row fields: each file's stem, or its path where stems clash."""
    stems = [Path(path).stem for path in paths]
    return [stem if stems.count(stem) == 1 else path for stem, path in zip(stems, paths, strict=True)]


def _templated(data, rows: list[dict], where: str) -> list[dict]:
    """`rows`, checked to fill in `data.prompt_template` (when set: `apply_prompt_template`, whose error names the
    row and the field) before their prompts are compared (`prompt_of`)."""
    template = getattr(data, "prompt_template", None)
    if template:
        apply_prompt_template(rows, template, where, data.fields)
    return rows


def _load_paths(data, split: str | None, heldout: bool = False) -> list[dict]:
    """The rows of `data.path` (a file or dataset, or a list of them, concatenated in order) for `split`; with a list,
    each row without a `DATA_SOURCE` field gets its source's name there (`source_names`), so that `rewards.route_by`
    and `data.eval_by` can tell the sources apart. `heldout`: the rows are only evaluated, so the data.fields
    columns of `TRAINING_ONLY_FIELDS` may be missing. Checked against `data.prompt_template` (`_templated`)."""
    optional = TRAINING_ONLY_FIELDS if heldout else ()
    where = f"{'held-out' if heldout else 'training'} rows of {data.path} (split {split!r})"
    if isinstance(data.path, str):
        return _templated(data, load_rows(data.path, split=split, fields=data.fields or None, optional=optional),
                          where)
    rows = []
    for path, name in zip(data.path, source_names(data.path), strict=True):
        rows += [r if DATA_SOURCE in r else {**r, DATA_SOURCE: name}
                 for r in load_rows(path, split=split, fields=data.fields or None, optional=optional)]
    return _templated(data, rows, where)


def _eval_files(data, every_train: list[dict], prompt: PromptOf) -> tuple[list[dict], dict[str, Any]]:
    """The held-out rows of `data.eval_path` (one file or dataset, or a list: each row then carries its file's name in
    `EVAL_SET`, and in `DATA_SOURCE` when it has none, as a list of training sources gives: `train/gsm8k.jsonl` and
    `test/gsm8k.jsonl` are both `gsm8k` for `rewards.routes`) and their record; each file loses its training prompts
    and is capped at `data.eval_size` on its own. A file (one split) is held out as a whole; a dataset with splits
    gives its `data.eval_split`."""
    several = isinstance(data.eval_path, list)
    paths = data.eval_path if several else [data.eval_path]
    rows, records = [], {}
    for path, name in zip(paths, source_names(paths), strict=True):
        part = load_rows(path, split=data.eval_split, fields=data.fields or None, lone_split_ok=True,
                         optional=TRAINING_ONLY_FIELDS)  # held-out rows are not trained on: no solution needed
        part = _templated(data, part, f"held-out rows of data.eval_path {path}")
        part, dropped = _drop_training_prompts(part, every_train, f"data.eval_path {path}", prompt,
                                               "hold out other problems in data.eval_path")
        part, record = _drawn({"kind": "eval_path", "path": path}, part, data.eval_size, "held-out", prompt)
        if several:
            clash = next((i for i, r in enumerate(part) if EVAL_SET in r), None)
            if clash is not None:
                raise ValueError(f"data.eval_path {path}: row {clash} has a field {EVAL_SET!r}, which a list of "
                                 "held-out files gives each row (its file): rename that column (data.fields)")
            part = [{**r, EVAL_SET: name, **({} if DATA_SOURCE in r else {DATA_SOURCE: name})} for r in part]
        rows += part
        records[name] = {**record, "dropped_training_prompts": dropped}
    if not several:
        return rows, next(iter(records.values()))
    files_of: dict[str, set[str]] = {}
    for r in rows:
        files_of.setdefault(near_key(prompt(r)), set()).add(r[EVAL_SET])
    shared = sum(len(names) > 1 for names in files_of.values())
    if shared:  # kept in each file's accuracy, where each belongs; the pooled one then counts them once per file
        log.warning("%d held-out prompts are in more than one of the data.eval_path files: each file's accuracy "
                    "counts them, and the pooled heldout_accuracy counts them once per file", shared)
    return rows, {"kind": "eval_path", "path": paths, **{key: sum(r[key] for r in records.values())
                                                         for key in ("rows", "of", "dropped_training_prompts",
                                                                     "repeated_prompts")},
                  "prompts_in_several_sets": shared, "sets": records}


def eval_group_field(data) -> str | None:
    """The held-out rows' field whose values split the held-out accuracy: `data.eval_by`, else `EVAL_SET` when
    `data.eval_path` lists several files, else None (no split)."""
    if data.eval_by is not None:
        return data.eval_by
    return EVAL_SET if isinstance(data.eval_path, list) else None


def eval_groups(rows: list[dict], by: str | None, where: str = "data.eval_by") -> list[str] | None:
    """Each row's group (`str` of its `by` field) for the split of the held-out accuracy (None when `by` is None).

    Raises ValueError naming the row when one lacks the field or has a non-scalar value there, and when there are more
    than `MAX_GROUPS` groups (a breakdown by an id or an answer measures nothing)."""
    if by is None:
        return None
    groups = []
    for i, row in enumerate(rows):
        value = row.get(by)
        if value is None or not isinstance(value, str | int | float | bool):
            what = "no such field" if by not in row else repr(value)
            raise ValueError(f"{where} {by!r}: held-out row {i} has {what}; "
                             f"every held-out row needs a string or number there (its fields: {sorted(row)})")
        groups.append(str(value))
    if len(set(groups)) > MAX_GROUPS:
        raise ValueError(f"{where} {by!r} has {len(set(groups))} distinct values among {len(rows)} held-out rows; "
                         f"a split of the accuracy is for at most {MAX_GROUPS} groups (a source, a level, a subject)")
    return groups


def load_data(data, seed: int) -> DataSplits:
    """Training and held-out rows for a `gspo.config.DataConfig` (`seed`: the embedded tasks' draw), with the records
    of where they came from.

    A file or dataset gives all its rows unless `data.train_size` / `data.eval_size` caps them; a cap keeps a sample
    by prompt hash (`subset_rows`), never the source's first rows. An embedded task draws `train_size` / `eval_size`
    problems (default `TASK_ROWS`). Training prompts are left out of the held-out rows before the cap. The held-out
    rows' groups (`eval_group_field`, `eval_groups`) and `data.prompt_template` (on every row, `apply_prompt_template`;
    the rows keep their prompts: the template is applied with the chat template, `gspo.data.render_chat`) are checked
    here, before any compute or model loading; rows are compared by the prompt the template makes (`prompt_of`).
    Held-out rows need not have the columns data.fields maps to `TRAINING_ONLY_FIELDS`.

    Raises ValueError / FileNotFoundError naming the source and the setting when a split does not exist, a file is
    missing or malformed, nothing is left to hold out, a held-out row has no group, or the prompt template cannot
    phrase a row."""
    splits = _load_data(data, seed)
    eval_groups(splits.heldout, eval_group_field(data))
    template = getattr(data, "prompt_template", None)
    if template and data.task is not None:  # a file's rows were checked as they loaded (`_templated`)
        for rows, where in ((splits.train, "training rows"), (splits.heldout, "held-out rows")):
            apply_prompt_template(rows, template, where, data.fields)
    return splits


def _load_data(data, seed: int) -> DataSplits:
    """`load_data` before the groups are checked."""
    prompt = prompt_of(getattr(data, "prompt_template", None))
    if data.eval_split is not None and data.eval_split == data.split and data.eval_path is None \
            and data.eval_fraction is None:
        raise ValueError(f"data.eval_split {data.eval_split!r} is the training split data.split: held-out rows must "
                         "come from another split, data.eval_path or data.eval_fraction")
    if data.task is not None:
        sizes = {"train": data.train_size or TASK_ROWS["train"], "eval": data.eval_size or TASK_ROWS["eval"]}
        train = make_task(data.task, split=data.split, size=sizes["train"], seed=seed, **data.task_options)
        train_source = {"kind": "task_split", "task": data.task, "split": data.split, "rows": len(train)}
        if data.eval_split is None:
            return DataSplits(train, [], {"kind": "none"}, train_source)
        heldout = make_task(data.task, split=data.eval_split, size=sizes["eval"], seed=seed, distinct=True,
                            **data.task_options)  # distinct problems: each counts once
        return DataSplits(train, heldout, {"kind": "task_split", "task": data.task, "split": data.eval_split,
                                           "rows": len(heldout), "dropped_training_prompts": 0}, train_source)
    if data.eval_fraction is not None:
        rows = _load_paths(data, data.split)
        train, heldout = split_by_fraction(rows, data.eval_fraction, prompt)
        if not train or not heldout:
            raise ValueError(f"data.eval_fraction={data.eval_fraction:g} of the {len(rows)} rows of {data.path} "
                             f"leaves {len(train)} training and {len(heldout)} held-out rows; both must be non-empty")
        # the same prompt lands on one side; one that differs only in case or spacing may not
        heldout, dropped = _drop_training_prompts(heldout, train, f"data.eval_fraction of {data.path}", prompt)
        train, train_source = _drawn({"kind": "eval_fraction_rest", "path": data.path, "split": data.split},
                                     train, data.train_size, "training", prompt)
        heldout, heldout_source = _drawn({"kind": "eval_fraction", "path": data.path, "fraction": data.eval_fraction},
                                         heldout, data.eval_size, "held-out", prompt)
        return DataSplits(train, heldout, {**heldout_source, "dropped_training_prompts": dropped}, train_source)
    every_train = _load_paths(data, data.split)
    train, train_source = _drawn({"kind": "path", "path": data.path, "split": data.split}, every_train,
                                 data.train_size, "training", prompt)
    if data.eval_path is not None:
        heldout, source = _eval_files(data, every_train, prompt)
        return DataSplits(train, heldout, source, train_source)
    if data.eval_split is None:
        return DataSplits(train, [], {"kind": "none"}, train_source)
    heldout = _load_paths(data, data.eval_split, heldout=True)
    heldout, dropped = _drop_training_prompts(heldout, every_train, f"data.path {data.path} split {data.eval_split!r}",
                                              prompt, "hold out other problems in that split, or use data.eval_path "
                                              "or data.eval_fraction")
    heldout, source = _drawn({"kind": "dataset_split", "path": data.path, "split": data.eval_split}, heldout,
                             data.eval_size, "held-out", prompt)
    return DataSplits(train, heldout, {**source, "dropped_training_prompts": dropped}, train_source)

"""Load prompt rows from files, saved datasets or the Hugging Face Hub, with early and specific validation.

Whatever the source, the result is a list of plain dicts that each carry a `prompt`: a non-empty string, or a
conversation, a list of messages `{"role": ..., "content": ...}` (also read from a `messages` field when there is no
`prompt`) that `gspo.data.chat.render_prompts` later renders with the model's chat template. The fields that
rewards and cold start read, when present, are checked too (`answer`: a non-empty string, numbers converted;
`solution`: a non-empty string; `tests`: a non-empty string or list of strings). A bad row is reported by its 0-based
index (and line number for JSON Lines) and by the field that is wrong, so a broken dataset fails at load time rather
than deep inside training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ROLES", "check_messages", "load_rows"]

# Files `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of their directory.
_SAVED_DATASET_MARKERS = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT_MARKER = "dataset_dict.json"
_FILE_SUFFIXES = (".jsonl", ".parquet")
# The roles of OpenAI-style chat messages; a prompt must not end with "assistant" (the answer is not part of it).
ROLES = ("system", "user", "assistant", "tool")


def _check_fields(fields: Mapping[str, str] | None) -> dict[str, str]:
    if fields is None:
        return {}
    if not isinstance(fields, Mapping):
        raise ValueError(f"load_rows: fields must be a dict of our name -> source column, got {fields!r}")
    for ours, theirs in fields.items():
        if not isinstance(ours, str) or not ours or not isinstance(theirs, str) or not theirs:
            raise ValueError(f"load_rows: fields entries must map non-empty strings, got {ours!r}: {theirs!r}")
    return dict(fields)


_MISSING = object()


def _lookup(raw: Mapping[str, Any], column: str) -> Any:
    """`raw[column]`, or for a dotted name that is not a column the value at that path in nested objects (verl's
    `reward_model.ground_truth`); `_MISSING` when there is none."""
    if column in raw:
        return raw[column]
    value: Any = raw
    for part in column.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _where(index: int, line: int | None) -> str:
    return f"row {index}" + (f" (line {line})" if line is not None else "")


def _normalize_row(raw: Any, index: int, line: int | None, fields: Mapping[str, str], source: str) -> dict[str, Any]:
    """Rename mapped columns to our names and check that the required fields are present and valid."""
    where = _where(index, line)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: {where} is a {type(raw).__name__}, expected an object with a 'prompt' field")
    renamed_from = set(fields.values())
    row = {key: value for key, value in raw.items() if key not in renamed_from}
    for ours, theirs in fields.items():
        value = _lookup(raw, theirs)
        if value is _MISSING:
            raise ValueError(
                f"{source}: {where} has no field {theirs!r} (mapped to {ours!r}); its fields are {sorted(raw)}"
            )
        if value is None:
            raise ValueError(f"{source}: {where} field {theirs!r} (mapped to {ours!r}) is null")
        row[ours] = value
    field = "prompt"
    if "prompt" not in row and "messages" in row:
        field, row["prompt"] = "messages", row.pop("messages")  # an OpenAI-style conversation is the prompt
    if "prompt" not in row:
        raise ValueError(
            f"{source}: {where} has no field 'prompt' or 'messages' (map another column with "
            f"fields={{'prompt': ...}}); its fields are {sorted(raw)}"
        )
    prompt = row["prompt"]
    if isinstance(prompt, list) or field == "messages":
        row["prompt"] = check_messages(prompt, f"{source}: {where} field {field!r}")
    elif not isinstance(prompt, str):
        raise ValueError(f"{source}: {where} field 'prompt' must be a string or a list of messages, got "
                         f"{type(prompt).__name__} {prompt!r}")
    elif not prompt.strip():
        raise ValueError(f"{source}: {where} field 'prompt' is empty or whitespace")
    _check_known_fields(row, f"{source}: {where}")
    return row


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Check a conversation used as a prompt and return it as a list of plain dicts.

    Each message is an object with a `role` from `ROLES` and a non-empty string `content`; the list is non-empty and
    does not end with an assistant message (the expected answer belongs in `answer` / `solution`, not the prompt).
    Keys other than role and content are kept, except null ones: parquet and `datasets` fill a key that only some
    messages have (`name`, `tool_calls`) with null in the others, which would make the same conversation differ by
    source. Raises ValueError starting with `where` (source, row, field) and naming the message and the problem.
    """
    if not isinstance(messages, list):
        raise ValueError(f"{where} must be a list of messages (objects with 'role' and 'content'), got "
                         f"{_shown(messages)}")
    if not messages:
        raise ValueError(f"{where} is an empty list of messages")
    checked = []
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} message {j} is a {type(message).__name__}, expected an object with 'role' and "
                             f"'content': {_shown(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where} message {j} has role {role!r}; the allowed roles are {', '.join(ROLES)}")
        content = message.get("content")
        if not (isinstance(content, str) and content.strip()):
            raise ValueError(f"{where} message {j} ({role}) needs a non-empty string 'content', got "
                             f"{'nothing' if 'content' not in message else _shown(content)}")
        checked.append({key: value for key, value in message.items() if value is not None})
    if checked[-1]["role"] == "assistant":
        raise ValueError(f"{where} ends with an assistant message: a prompt must end with a user, system or tool "
                         "message (the expected answer belongs in 'answer' / 'solution')")
    return checked


def _check_known_fields(row: dict[str, Any], where: str) -> None:
    """Check (in place) the optional fields whose meaning we know, so that a wrong type is reported here, at its row,
    instead of as a reward failure at every step that draws the row. A numeric `answer` (JSON `42`) becomes "42"."""
    answer = row.get("answer", "")
    if "answer" in row and isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        row["answer"] = answer = str(answer)
    if "answer" in row and not (isinstance(answer, str) and answer.strip()):
        raise ValueError(f"{where} field 'answer' must be a non-empty string or a number, got {_shown(answer)}")
    solution = row.get("solution", "")
    if "solution" in row and not (isinstance(solution, str) and solution.strip()):
        raise ValueError(f"{where} field 'solution' must be a non-empty string, got {_shown(solution)}")
    tests = row.get("tests", "")
    if "tests" in row and not (
        (isinstance(tests, str) and tests.strip())
        or (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests))
    ):
        raise ValueError(f"{where} field 'tests' must be a non-empty string or list of strings, got {_shown(tests)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _jsonl_records(path: Path) -> Iterator[tuple[Any, int]]:
    """Yield (parsed object, 1-based line number) for each non-blank line of a JSON Lines file."""
    with path.open(encoding="utf-8") as handle:
        for line_no, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                yield json.loads(text), line_no
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {line_no} is not valid JSON: {exc.msg} (column {exc.colno})") from exc


def _dataset_records(dataset: Any, limit: int | None) -> Iterator[tuple[Any, None]]:
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))
    for record in dataset:
        yield record, None


def _parquet_records(path: Path, limit: int | None) -> Iterator[tuple[Any, None]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise ValueError(f"{path}: not a readable parquet file: {exc}") from exc
    if limit is not None:
        table = table.slice(0, limit)
    for record in table.to_pylist():
        yield record, None


def _pick_split(loaded: Any, source: str, split: str | None) -> Any:
    """One split of a DatasetDict: `split`, or the only one when `split` is None."""
    if split is None:
        if len(loaded) != 1:
            raise ValueError(f"{source}: has the splits {sorted(loaded)}; name one (data.split / data.eval_split, "
                             "gspo eval --split)")
        split = next(iter(loaded))
    if split not in loaded:
        raise ValueError(f"{source}: has no split {split!r}; its splits are {sorted(loaded)}")
    return loaded[split]


def _saved_dataset_records(path: Path, split: str | None, limit: int | None,
                           lone_split_ok: bool) -> Iterator[tuple[Any, None]]:
    """Rows of a directory written by `Dataset.save_to_disk` (one split) or `DatasetDict.save_to_disk`."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _pick_split(loaded, str(path), split)
    else:
        _single_split(str(path), split, "a saved Dataset", lone_split_ok)
    return _dataset_records(loaded, limit)


def _hub_records(source: str, split: str | None, limit: int | None) -> Iterator[tuple[Any, None]]:
    import datasets

    try:
        loaded = datasets.load_dataset(source, split=split)  # split=None: all of them, then the only one
    except Exception as exc:
        raise ValueError(
            f"could not load dataset {source!r} (split {split!r}) with datasets.load_dataset: {exc}"
        ) from exc
    return _dataset_records(loaded if split is not None else _pick_split(loaded, source, None), limit)


def _single_split(source: str, split: str | None, kind: str, lone_split_ok: bool = False) -> None:
    """A source without splits (one file, one saved Dataset) is its one split, "train" (as `datasets` names a lone
    data file's split); asking it for another split is an error rather than silently reading the training rows."""
    if split not in (None, "train") and not lone_split_ok:
        raise ValueError(f"{source}: {kind} has no splits, so no split {split!r} (it is all one split, 'train'); for "
                         "held-out rows name a separate file (data.eval_path, gspo eval --data), hold out a "
                         "fraction of it (data.eval_fraction), or train without evaluation (data.eval_split: null)")


def _records(source: str, split: str | None, limit: int | None,
             lone_split_ok: bool) -> Iterable[tuple[Any, int | None]]:
    """Dispatch on the kind of source; yields (raw record, line number or None)."""
    path = Path(source).expanduser()
    if path.is_file():
        _single_split(source, split, f"a single {path.suffix or 'data'} file", lone_split_ok)
        if path.suffix == ".jsonl":
            return _jsonl_records(path)
        if path.suffix == ".parquet":
            return _parquet_records(path, limit)
        raise ValueError(f"{source}: unsupported file type {path.suffix!r}; expected one of {list(_FILE_SUFFIXES)}")
    if path.is_dir() and (
        (path / _SAVED_DATASET_DICT_MARKER).is_file() or all((path / m).is_file() for m in _SAVED_DATASET_MARKERS)
    ):
        return _saved_dataset_records(path, split, limit, lone_split_ok)
    if path.suffix in _FILE_SUFFIXES and not path.exists():
        raise FileNotFoundError(f"data file {source!r} does not exist")
    # Anything else (a hub id, or a local folder of data files) is for `datasets.load_dataset`.
    return _hub_records(source, split, limit)


def load_rows(
    source: str,
    *,
    split: str | None = "train",
    fields: dict[str, str] | None = None,
    limit: int | None = None,
    lone_split_ok: bool = False,
) -> list[dict]:
    """Load rows from `source` and check that every row has a prompt: a non-empty string or a list of messages.

    `source` is a `.jsonl` file (one JSON object a line; blank lines skipped), a `.parquet` file, a directory written
    by `datasets` `save_to_disk`, or anything `datasets.load_dataset(source)` accepts (a hub id, a folder of data
    files). `split` picks the split of a source that has several (None: its only one); a source without splits (a
    file, a saved `Dataset`) is all one split, "train", and any other split is an error, never the training rows
    (unless `lone_split_ok`: the source is a file of held-out rows, whose one split is meant whatever `split` says).

    `fields` maps our field names to the source's column names, e.g. `{"prompt": "question", "answer": "final"}`:
    the mapped columns are renamed, all other columns are kept as they are. A dotted name reaches into nested objects
    (`{"answer": "reward_model.ground_truth"}` for verl's format; that column is then kept whole). Every field named in
    `fields`, and `prompt`, is required. `limit` keeps only the first `limit` rows (rows after them are not read or
    checked). A `prompt` may be a string or a conversation (a list of messages, see `check_messages`); a row
    without `prompt` but with `messages` has that list moved to `prompt`. Conversations are rendered later, with the
    model's chat template (`gspo.data.chat.render_prompts`).

    Raises ValueError naming the source, the row (0-based index; line number for JSON Lines) and the field for a
    missing field, a non-string or empty prompt, a malformed message list, a wrong-typed or empty `answer` /
    `solution` / `tests`, or a malformed JSON line; FileNotFoundError for a missing data file;
    ValueError if the source has no rows.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"load_rows: source must be a non-empty string, got {source!r}")
    if split is not None and (not isinstance(split, str) or not split):
        raise ValueError(f"load_rows: split must be None or a non-empty string, got {split!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_rows: limit must be None or an int >= 1, got {limit!r}")
    mapping = _check_fields(fields)

    rows: list[dict] = []
    for index, (raw, line) in enumerate(_records(source, split, limit, lone_split_ok)):
        if limit is not None and index >= limit:
            break
        rows.append(_normalize_row(raw, index, line, mapping, source))
    if not rows:
        raise ValueError(f"{source}: no rows found (split {split!r})")
    return rows

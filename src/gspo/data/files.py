"""Load prompt rows from files, saved datasets or the Hugging Face Hub, with early and specific validation.

Whatever the source, the result is a list of plain dicts that each carry a `prompt`: a non-empty string, or a
conversation, a list of messages `{"role": ..., "content": ...}` (also read from a `messages` field when there is no
`prompt`) that `gspo.data.chat.render_prompts` later renders with the model's chat template. The fields that
rewards and cold start read, when present, are checked too (`answer`: a non-empty string, numbers converted;
`solution`: a non-empty string; `tests`: a non-empty string or list of strings, or stdin/stdout or call-based cases
(APPS's `{"inputs": [...], "outputs": [...], "fn_name": ...}` or LiveCodeBench's list of `{"input", "output",
"testtype"}`, as they are or as JSON text; functional ones with the row's `fn_name` or `metadata`), checked by
`gspo.sandbox.parse_io_cases`). A bad row is reported by its 0-based index (and line number for JSON Lines) and by
the field that is wrong, named as the source names it (the column that `fields` maps), so a broken dataset fails at
load time rather than deep inside training.
"""

from __future__ import annotations

import codecs
import csv
import json
import math
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

from gspo.sandbox import parse_io_cases, row_fn_name

__all__ = ["ROLES", "check_messages", "load_rows"]

# Files `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of their directory.
_SAVED_DATASET_MARKERS = ("state.json", "dataset_info.json")
_SAVED_DATASET_DICT_MARKER = "dataset_dict.json"
_FILE_SUFFIXES = (".jsonl", ".parquet")
_DELIMITERS = {".csv": ",", ".tsv": "\t"}  # files read as text, cell by cell (`_delimited_records`)
_BUILDERS = {".json": "json"}  # other single files: the `datasets` builder reading them
# Suffixes of data files (ours and those `datasets.load_dataset` reads from a folder): a source ending with one is a
# file, never a Hub dataset id, so a missing one is reported at once rather than looked up on the Hub.
_DATA_SUFFIXES = (*_FILE_SUFFIXES, ".json", ".csv", ".tsv", ".txt", ".arrow")
# The shape of a Hub dataset id (huggingface_hub's `validate_repo_id`): `name` or `org/name`, word characters,
# `-` and `.`, starting with a word character. Anything else (`./x`, `/abs`, `~/x`, `a/b/c`, a backslash) is a path.
_HUB_ID = re.compile(r"(\w[\w.-]*/)?\w[\w.-]*", re.ASCII)
# Floats up to this size are exactly integers when integral, so 37.0 can be written "37" without inventing digits.
_EXACT_INT = 2**53
# Python writes floats below this in scientific notation (`repr(0.00005)` is "5e-05"); `_number_text` does not.
_SMALL_FLOAT = 1e-4
# The fields gspo itself reads from a row (`_check_known_fields`; a `messages` column is a prompt, never kept twice).
_KNOWN_FIELDS = ("prompt", "answer", "solution", "tests")
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


def _named(field: str, fields: Mapping[str, str]) -> str:
    """Our field `field` as an error names it: by the source's column when `fields` maps one to it ("'question'
    (mapped to 'prompt')"), since that is the name the user sees in the file; else by itself."""
    theirs = fields.get(field)
    return f"{field!r}" if theirs is None or theirs == field else f"{theirs!r} (mapped to {field!r})"


def _normalize_row(raw: Any, index: int, line: int | None, fields: Mapping[str, str], source: str,
                   optional: Collection[str] = ()) -> dict[str, Any]:
    """Rename mapped columns to our names and check that the required fields are present and valid. A mapped field
    named in `optional` may be missing or null (the row then has no such field); every other mapped field is
    required."""
    where = _where(index, line)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: {where} is a {type(raw).__name__}, expected an object with a 'prompt' field")
    # mapped columns are renamed, except one that is itself a field gspo reads and no mapping replaces: with
    # {"solution": "answer"} the row keeps its `answer` too (a copy, not a move that would leave the reward without it)
    renamed_from = set(fields.values()) - (set(_KNOWN_FIELDS) - set(fields))
    row = {key: value for key, value in raw.items() if key not in renamed_from}
    for ours, theirs in fields.items():
        value = _lookup(raw, theirs)
        if ours in optional and (value is _MISSING or value is None):
            continue
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
    prompt, named = row["prompt"], _named(field, fields)
    if isinstance(prompt, list) or field == "messages":
        row["prompt"] = check_messages(prompt, f"{source}: {where} field {named}")
    elif not isinstance(prompt, str):
        raise ValueError(f"{source}: {where} field {named} must be a string or a list of messages, got "
                         f"{type(prompt).__name__} {prompt!r}")
    elif not prompt.strip():
        raise ValueError(f"{source}: {where} field {named} is empty or whitespace")
    _check_known_fields(row, f"{source}: {where}", fields)
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


def _check_known_fields(row: dict[str, Any], where: str, fields: Mapping[str, str] | None = None) -> None:
    """Check (in place) the optional fields whose meaning we know, so that a wrong type is reported here, at its row,
    instead of as a reward failure at every step that draws the row. A numeric `answer` (JSON `42`) becomes text
    (`_number_text`), and so does a numeric `solution` (a cold start's target "37"). Errors name a field by the
    source's column when `fields` maps one to it."""
    fields = fields or {}
    for name in ("answer", "solution"):
        value = row.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            row[name] = _number_text(value)
    answer = row.get("answer", "")
    if "answer" in row and not (isinstance(answer, str) and answer.strip()):
        raise ValueError(f"{where} field {_named('answer', fields)} must be a non-empty string or a number, got "
                         f"{_shown(answer)}")
    solution = row.get("solution", "")
    if "solution" in row and not (isinstance(solution, str) and solution.strip()):
        raise ValueError(f"{where} field {_named('solution', fields)} must be a non-empty string or a number, got "
                         f"{_shown(solution)}")
    tests = row.get("tests", "")
    if "tests" not in row:
        return
    try:
        cases = parse_io_cases(tests, row_fn_name(row))
    except ValueError as e:
        raise ValueError(f"{where} field {_named('tests', fields)} as {e}") from None
    if cases is None and not (
        (isinstance(tests, str) and tests.strip())
        or (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests) and any(map(str.strip, tests)))
    ):
        raise ValueError(f"{where} field {_named('tests', fields)} must be a non-empty string or list of strings, "
                         f"or stdin/stdout cases {{'inputs': [...], 'outputs': [...]}}, got {_shown(tests)}")


def _number_text(number: int | float) -> str:
    """A numeric answer as the text an exact-match reward compares with: an integral float as the integer it is
    (37.0 -> "37"; pandas stores an int column that has a null as float64, and a file may hold floats), since "37.0"
    is never what a model writes for 37; a float below 1e-4 in its decimals (0.00005 -> "0.00005", where Python
    writes "5e-05", which neither the file nor a model wrote), its shortest digits kept; any other number as Python
    writes it ("0.5", "1e+20")."""
    if isinstance(number, float) and number.is_integer() and abs(number) < _EXACT_INT:
        return str(int(number))
    if isinstance(number, float) and 0 < abs(number) < _SMALL_FLOAT:
        return format(Decimal(repr(number)), "f")
    return str(number)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _text_lines(path: Path) -> Iterator[str]:
    """The lines of a text file, each with its line ending, decoded one at a time, so that text that is not UTF-8 (a
    file saved as Latin-1) is reported by its line and the byte's place in it rather than by an offset into a read
    buffer; a UTF-8 byte order mark at the start (Windows editors write one) is skipped."""
    with path.open("rb") as handle:
        for line_no, data in enumerate(handle, start=1):
            if line_no == 1 and data.startswith(codecs.BOM_UTF8):
                data = data[len(codecs.BOM_UTF8):]
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: line {line_no} is not UTF-8 text: its byte {exc.start + 1} is "
                                 f"{data[exc.start]:#04x} ({exc.reason}); save the file as UTF-8") from None


def _jsonl_records(path: Path) -> Iterator[tuple[Any, int]]:
    """Yield (parsed object, 1-based line number) for each non-blank line of a JSON Lines file (`_text_lines`)."""
    for line_no, text in enumerate(_text_lines(path), start=1):
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
    """Rows of a local folder of data files or of a Hub dataset id, read by `datasets.load_dataset`. Its error says,
    for a folder, what the file it could not read was wrong with (`_root_cause`), and for an id, that there is no
    local file or folder of that name either (a typo in a path that has the shape of an id)."""
    import datasets

    try:
        loaded = datasets.load_dataset(source, split=split)  # split=None: all of them, then the only one
    except Exception as exc:
        if Path(source).is_dir():
            root = _root_cause(exc)
            why = f"{exc}" if root is exc else f"{exc}: {type(root).__name__}: {root}"
        else:
            why = f"{exc} (and there is no local file or folder {str(Path(source).absolute())!r})"
        raise ValueError(f"could not load dataset {source!r} (split {split!r}) with datasets.load_dataset: "
                         f"{why}") from exc
    return _dataset_records(loaded if split is not None else _pick_split(loaded, source, None), limit)


def _delimited_records(path: Path, limit: int | None) -> Iterator[tuple[dict[str, str | None], int]]:
    """Yield (row, its first line) for each record of a CSV or TSV file: every value the text as written ("007",
    "1e3", "NA", "true" stay what they are: an exact-match answer is never rewritten by a type guess), an empty cell
    null (a missing value), blank lines skipped, a UTF-8 byte order mark skipped. CSV quoting is RFC 4180's (a quoted
    value may hold commas, quotes written twice and line breaks; anything else is an error, `strict`); a TSV has no
    quoting: tabs separate values and a quote is an ordinary character (the IANA text/tab-separated-values format).

    Raises ValueError naming the file and line for a header that repeats a column name, a record with more or fewer
    values than the header names, malformed CSV quoting, or text that is not UTF-8."""
    tsv = path.suffix.lower() == ".tsv"
    reader = csv.reader(_text_lines(path), delimiter=_DELIMITERS[path.suffix.lower()], strict=True,
                        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
    header, line, rows = None, 1, 0
    try:
        for values in reader:
            start, line = line, reader.line_num + 1  # a quoted value may span lines: the record's first one
            if header is None:
                if values:
                    header, header_line = _header(values, path, start), start
                continue
            if not any(values):
                continue  # a blank line, or one of empty cells
            if len(values) != len(header):
                raise ValueError(f"{path}: line {start} has {len(values)} values where the header (line {header_line}) "
                                 f"names {len(header)} columns {header}" + ("; a value cannot hold a tab in a TSV file"
                                 if tsv else "; a value holding a comma must be quoted"))
            yield {name: value or None for name, value in zip(header, values, strict=True)}, start
            rows += 1
            if limit is not None and rows >= limit:
                return
    except csv.Error as exc:
        raise ValueError(f"{path}: line {reader.line_num} is not valid CSV: {exc} (a quoted value ends with a quote "
                         'followed by a comma or the line\'s end; a quote inside it is written "")') from None


def _header(values: list[str], path: Path, line: int) -> list[str]:
    """A CSV / TSV file's column names (its first record), each once: a repeated name would silently drop a column.
    An empty name (the index column `DataFrame.to_csv` writes, a trailing comma) is `Unnamed: i`, as pandas names it."""
    names = [v.strip() or f"Unnamed: {i}" for i, v in enumerate(values)]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"{path}: the header (line {line}) names the column {twice!r} twice: {names}")
    return names


def _data_file_records(path: Path, limit: int | None) -> Iterator[tuple[Any, None]]:
    """Rows of one JSON file (an array of objects, or one object a line), read by the `datasets` builder for its
    format, as a folder of such files is."""
    import datasets

    builder = _BUILDERS[path.suffix.lower()]
    try:
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:
        root = _root_cause(exc)
        raise ValueError(f"{path}: could not read it as {builder.upper()} with datasets.load_dataset: "
                         f"{type(root).__name__}: {root}") from exc
    return _dataset_records(loaded, limit)


def _folder_records(path: Path, split: str | None, limit: int | None) -> Iterable[tuple[Any, int | None]]:
    """Rows of a folder of data files, its splits found by file name as `datasets.load_dataset` finds them
    (`train.csv`, `data/test-00000-of-00001.csv`, ...). A folder of CSV / TSV files only is read as single such files
    are (`_delimited_records`: values as written, where `datasets` would guess types, per chunk of rows); any other
    folder is `datasets.load_dataset`'s (`_hub_records`)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        files = {str(name): list(found) for name, found in
                 DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path)).items()}
    except Exception:  # no data files it recognises: load_dataset's own error says so
        return _hub_records(str(path), split, limit)
    if not files or not all(Path(f).suffix.lower() in _DELIMITERS for found in files.values() for f in found):
        return _hub_records(str(path), split, limit)
    chosen = _pick_split(files, str(path), split)

    def records() -> Iterator[tuple[Any, None]]:
        n = 0
        for f in chosen:
            for row, _ in _delimited_records(Path(f), None if limit is None else limit - n):
                yield row, None
                n += 1
            if limit is not None and n >= limit:
                return
    return records()


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception `exc` was raised from: `datasets` wraps a file it cannot read (not UTF-8, a bad CSV
    line) in "An error occurred while generating the dataset", which alone does not say what is wrong."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def _looks_like_path(source: str) -> bool:
    """Whether `source` is meant as a local file or folder, never a Hub dataset id, so that a missing one is an
    immediate error instead of a minute of Hub retries. It is when it is not shaped like a Hub id (`_HUB_ID`: it
    starts with `/`, `./`, `../` or `~`, has more than one `/`, a backslash or a space), ends with a data-file suffix
    (`_DATA_SUFFIXES`: `missing.csv`), or is `first/rest` where `first` is a local folder (`data/train` run beside a
    `data/` folder). A Hub id such as `openai/gsm8k` or `gsm8k` is none of these, unless the working directory has a
    folder named like its organization (`openai/`): the error then says so (`_missing`)."""
    if not _HUB_ID.fullmatch(source) or Path(source).suffix.lower() in _DATA_SUFFIXES:
        return True
    first, slash, _ = source.partition("/")
    return bool(slash) and Path(first).is_dir()


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
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return _jsonl_records(path)
        if suffix == ".parquet":
            return _parquet_records(path, limit)
        if suffix in _DELIMITERS:
            return _delimited_records(path, limit)
        if suffix in _BUILDERS:
            return _data_file_records(path, limit)
        raise ValueError(f"{source}: unsupported file type {path.suffix!r}; expected one of "
                         f"{[*_FILE_SUFFIXES, *_DELIMITERS, *_BUILDERS]}")
    if path.is_dir() and (
        (path / _SAVED_DATASET_DICT_MARKER).is_file() or all((path / m).is_file() for m in _SAVED_DATASET_MARKERS)
    ):
        return _saved_dataset_records(path, split, limit, lone_split_ok)
    if path.is_dir():  # a folder of data files (train.csv, test.jsonl, ...), split as `datasets.load_dataset` does
        return _folder_records(path, split, limit)
    if _looks_like_path(source):
        raise _missing(source, path)
    return _hub_records(source, split, limit)  # a Hub dataset id


def _missing(source: str, path: Path) -> FileNotFoundError:
    """The error for a local source that does not exist; when `source` has the shape of a Hub id and was taken for a
    path only because a folder of its first part exists here, it says how to reach the Hub dataset instead."""
    hint = ""
    if _HUB_ID.fullmatch(source) and Path(source).suffix.lower() not in _DATA_SUFFIXES:
        first = source.partition("/")[0]
        hint = (f"; for the Hub dataset {source!r}, run from a folder without a {first + '/'!r} subfolder (that "
                "folder makes it a local path)")
    return FileNotFoundError(f"data file or folder {source!r} does not exist (there is nothing at "
                             f"{path.absolute()}){hint}")


def load_rows(
    source: str,
    *,
    split: str | None = "train",
    fields: dict[str, str] | None = None,
    limit: int | None = None,
    lone_split_ok: bool = False,
    optional: Collection[str] = (),
) -> list[dict]:
    """Load rows from `source` and check that every row has a prompt: a non-empty string or a list of messages.

    `source` is a `.jsonl` file (one JSON object a line; blank lines skipped), a `.parquet` file, a directory written
    by `datasets` `save_to_disk`, or anything `datasets.load_dataset(source)` accepts (a hub id, a folder of data
    files such as `.csv` or `.json`; a single `.csv` or `.json` file is refused). `split` picks the split of a source
    that has several (None: its only one); a source without splits (a file, a saved `Dataset`) is all one split,
    "train", and any other split is an error, never the training rows (unless `lone_split_ok`: the source is a file
    of held-out rows, whose one split is meant whatever `split` says).

    `fields` maps our field names to the source's column names, e.g. `{"prompt": "question", "answer": "final"}`:
    the mapped columns are renamed, all other columns are kept as they are. A dotted name reaches into nested objects
    (`{"answer": "reward_model.ground_truth"}` for verl's format; that column is then kept whole). Every field named in
    `fields`, and `prompt`, is required, but for our names listed in `optional` (held-out rows need no `solution`):
    such a field is renamed when a row has it and left out when it is missing or null. `limit` keeps only the first
    `limit` rows (rows after them are not read or checked). A `prompt` may be a string or a conversation (a list of
    messages, see `check_messages`); a row without `prompt` but with `messages` has that list moved to `prompt`.
    Conversations are rendered later, with the model's chat template (`gspo.data.chat.render_prompts`). A numeric
    `answer` becomes text, an integral float as an integer (37.0: "37").

    Raises ValueError naming the source, the row (0-based index; line number for JSON Lines) and the field (as the
    source names it) for a missing field, a non-string or empty prompt, a malformed message list, a wrong-typed or
    empty `answer` / `solution` / `tests`, or a JSON line that is malformed or not UTF-8; FileNotFoundError for a
    missing data file or folder (a source that can only be a path, `_looks_like_path`: never looked up on the Hub);
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
        rows.append(_normalize_row(raw, index, line, mapping, source, optional))
    if not rows:
        raise ValueError(f"{source}: no rows found (split {split!r})")
    return rows

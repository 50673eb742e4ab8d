"""Test cases run one child process each, for the code reward (`gspo.rewards.code`): the formats code datasets
store them in (APPS's and TACO's `input_output`, stdin/stdout or call-based; LiveCodeBench's test-case list), how a
case's output is judged (`outputs_match`, `values_match`), and `run_sandboxed_io`, which runs a program against them
in the sandbox (`gspo.sandbox.process`: its driver `_IO_DRIVER` and caller stub `_CALLER` run inside; everything
here runs in the trainer, so the expected outputs never enter the sandbox). Standard library only, as the sandbox.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gspo.sandbox.process import (
    _CALLER,
    _IO_DRIVER,
    SandboxError,
    SandboxResult,
    _call,
    _failure_reason,
    check_limits,
    package_dirs,
)

__all__ = ["IOCases", "check_io_limits", "outputs_match", "parse_io_cases", "row_fn_name", "run_sandboxed_io",
           "values_match"]


@dataclass(frozen=True)
class IOCases:
    """Test cases run one child process each (`run_sandboxed_io`). Built by `parse_io_cases`, which checks them.

    Stdin/stdout cases (`fn_name` None): each input is the text the program reads as its stdin, each output the text
    it must print (`outputs_match`). Call-based cases (`fn_name` the function's name): each input is the JSON text
    of the list of arguments, which the caller stub (`_CALLER`) reads, and each output the expected return value, a
    JSON value compared in the parent with the one returned (`values_match`); `wrapped_outputs`: an expected
    one-element list also accepts its element (APPS and TACO store many return values wrapped so, and their checker
    accepts either; LiveCodeBench's outputs are the values themselves)."""

    inputs: tuple[str, ...]
    outputs: tuple[Any, ...]
    fn_name: str | None = None
    wrapped_outputs: bool = False

    def passes(self, index: int, stdout: str, float_tolerance: float = 1e-6) -> bool:
        """Whether case `index`'s stdout (for a call-based case: the caller stub's JSON line) is a pass."""
        expected = self.outputs[index]
        if self.fn_name is None:
            return outputs_match(stdout, expected, float_tolerance)
        try:
            value = json.loads(stdout)
            if values_match(value, expected, float_tolerance):
                return True
            return (self.wrapped_outputs and isinstance(expected, list) and len(expected) == 1
                    and values_match(value, expected[0], float_tolerance))
        except (ValueError, RecursionError):  # not one JSON value (a stray write), too deep, digits past the limit
            return False


_IO_KEYS = ("inputs", "outputs", "fn_name")
_LIVECODEBENCH_KEYS = ("input", "output", "testtype")


def parse_io_cases(tests: Any, fn_name: Any = None) -> IOCases | None:
    """A row's `tests` as test cases run per case, or None when they are not such cases (a Python snippet or a list
    of them). Raises ValueError naming what is wrong with cases that cannot judge a program.

    Two layouts, each as it is or as its JSON text (which no Python test snippet is):

    * APPS's and TACO's `input_output`: `{"inputs": [...], "outputs": [...], "fn_name": ...}`. Without a `fn_name`
      (absent, null or ""), stdin/stdout cases: items are strings, or lists of strings taken as lines joined by
      newlines (as APPS's own checker does). With one, call-based cases: each input is the list of the function's
      positional arguments (or the JSON text of that list, as some copies store it), each output its expected
      return value, a JSON value; an expected one-element list also accepts its element (`IOCases.wrapped_outputs`).
    * LiveCodeBench's test cases (`public_test_cases`; decode `private_test_cases` first): a list of
      `{"input": str, "output": str, "testtype": "stdin" | "functional"}`, one testtype for all. Stdin ones are
      stdin/stdout cases; functional ones call `fn_name`, which the cases do not hold (LiveCodeBench keeps it in the
      row's `metadata`; see `row_fn_name`), with the arguments in their input, one JSON value per line, and expect
      the JSON value of their output. `fn_name` is only read for these.

    Refused, by name: unknown keys, no cases, `inputs` and `outputs` of different lengths, items of another type,
    call-based arguments that are not a list, outputs that are not JSON values, a `fn_name` that is not an
    identifier, LiveCodeBench cases with other keys, another or mixed testtypes, or functional ones without
    `fn_name`.
    """
    if isinstance(tests, str):
        if not tests.lstrip().startswith(("{", "[")):
            return None
        try:
            tests = json.loads(tests)
        except ValueError:
            return None  # not JSON: Python (a dict or list display), which the tests' own check judges
    if isinstance(tests, list) and any(isinstance(case, dict) for case in tests):
        return _livecodebench_cases(tests, fn_name)
    if not isinstance(tests, dict):
        return None
    kind = "call-based test cases" if tests.get("fn_name") else "stdin/stdout test cases"
    unknown = sorted(map(str, set(tests) - set(_IO_KEYS)))
    if unknown:
        raise ValueError(f"{kind} take the keys {list(_IO_KEYS)}, got unknown {unknown}")
    for key in ("inputs", "outputs"):
        items = tests.get(key)
        if not isinstance(items, list) or not items:
            raise ValueError(f"{kind} need '{key}', a non-empty list, got {items!r:.80}")
    inputs, outputs = tests["inputs"], tests["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"{kind}: 'inputs' has {len(inputs)} items but 'outputs' has {len(outputs)}")
    if not tests.get("fn_name"):
        return IOCases(tuple(_case_text(item, "inputs", i) for i, item in enumerate(inputs)),
                       tuple(_case_text(item, "outputs", i) for i, item in enumerate(outputs)))
    name = _function_name(tests["fn_name"], kind)
    arguments = tuple(_arguments_text(item, i) for i, item in enumerate(inputs))
    values = tuple(_json_value(item, f"{kind}: 'outputs' item {i}") for i, item in enumerate(outputs))
    return IOCases(arguments, values, name, wrapped_outputs=True)


def row_fn_name(row: Mapping[str, Any]) -> Any:
    """The function a row's LiveCodeBench functional cases call (their cases do not name it): the row's `fn_name`
    field, else `func_name` in its `metadata` (a dict, or its JSON text as LiveCodeBench stores it), else None.
    Returned as found; `parse_io_cases` checks it when it is used."""
    if row.get("fn_name") is not None:
        return row["fn_name"]
    metadata = row.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except ValueError:
            return None
    return metadata.get("func_name") if isinstance(metadata, dict) else None


def _livecodebench_cases(tests: list[Any], fn_name: Any) -> IOCases:
    kind = "LiveCodeBench test cases"
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or sorted(map(str, case)) != sorted(_LIVECODEBENCH_KEYS):
            shown = sorted(map(str, case)) if isinstance(case, dict) else f"{type(case).__name__} {case!r:.60}"
            raise ValueError(f"{kind}: item {i} must be a dict with the keys {list(_LIVECODEBENCH_KEYS)}, got {shown}")
        for key in ("input", "output"):
            if not isinstance(case[key], str):
                raise ValueError(f"{kind}: item {i}'s '{key}' must be a str, got {type(case[key]).__name__}")
    testtypes = sorted({str(case["testtype"]) for case in tests})
    if testtypes not in (["stdin"], ["functional"]):
        raise ValueError(f"{kind}: 'testtype' must be 'stdin' or 'functional', the same for every case, got "
                         f"{testtypes}")
    inputs, outputs = tuple(case["input"] for case in tests), tuple(case["output"] for case in tests)
    if testtypes == ["stdin"]:
        return IOCases(inputs, outputs)
    if fn_name is None or fn_name == "":
        raise ValueError(f"{kind}: functional cases call a function the cases do not name; give the row an "
                         "'fn_name' field (or LiveCodeBench's 'metadata' with its 'func_name')")
    name = _function_name(fn_name, kind)
    arguments = tuple(_json_text([_json_value(line, f"{kind}: item {i}'s input line {n}", decode=True)
                                  for n, line in enumerate(text.split("\n")) if line.strip()], f"{kind}: item {i}")
                      for i, text in enumerate(inputs))
    values = tuple(_json_value(text, f"{kind}: item {i}'s output", decode=True) for i, text in enumerate(outputs))
    return IOCases(arguments, values, name)


def _function_name(name: Any, kind: str) -> str:
    if not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f"{kind}: fn_name must be a function's name (an identifier), got {name!r:.60}")
    return name


def _case_text(item: Any, key: str, index: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, list) and all(isinstance(line, str) for line in item):
        return "\n".join(item)
    raise ValueError(f"stdin/stdout test cases: '{key}' item {index} must be a str (or a list of str, its lines), "
                     f"got {type(item).__name__} {item!r:.60}")


def _arguments_text(item: Any, index: int) -> str:
    """A call-based input (the argument list, or its JSON text) as the JSON text the caller stub reads."""
    arguments = item
    if isinstance(item, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(item)
    if not isinstance(arguments, list):
        raise ValueError(f"call-based test cases: 'inputs' item {index} must be the list of the function's "
                         f"arguments (or its JSON text), got {type(item).__name__} {item!r:.60}")
    return _json_text(arguments, f"call-based test cases: 'inputs' item {index}")


def _json_text(value: Any, where: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must be a JSON value ({e})") from None


def _json_value(value: Any, where: str, decode: bool = False) -> Any:
    """`value` as the JSON value the parent compares with (tuples as lists, keys as strings), or decoded from its
    JSON text when `decode`."""
    try:
        return json.loads(value if decode else json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must be {'the JSON text of ' if decode else ''}a JSON value, got "
                         f"{value!r:.60} ({e})") from None


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_WHITESPACE = re.compile(r"(\s+)")


def _output_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def outputs_match(actual: str, expected: str, float_tolerance: float = 1e-6) -> bool:
    """Whether a program's stdout matches a case's expected output, as the code datasets' checkers judge (APPS,
    TACO, LiveCodeBench): line endings normalised (\\r\\n, \\r -> \\n), trailing whitespace of each line and trailing
    blank lines ignored; leading whitespace and blank lines in between count. Failing that, with a `float_tolerance`
    > 0, the lines are compared token by token (the whitespace between tokens still exactly): a token equal to the
    expected one, or — when the expected token is a decimal with a point or an exponent ("0.333333", "1e-9") — a
    number within `float_tolerance` of it, absolute or relative (Codeforces-style checkers' 1e-6 by default).
    Integer tokens stay exact ("1000000" never matches "1000000.5"), and "nan" / "inf" never match by tolerance."""
    got, want = _output_lines(actual), _output_lines(expected)
    if got == want:
        return True
    if not float_tolerance or len(got) != len(want):
        return False
    for got_line, want_line in zip(got, want, strict=True):
        got_tokens, want_tokens = _WHITESPACE.split(got_line), _WHITESPACE.split(want_line)  # with the whitespace
        if len(got_tokens) != len(want_tokens):
            return False
        for have, need in zip(got_tokens, want_tokens, strict=True):
            if have == need:
                continue
            if not (_DECIMAL.fullmatch(need) and any(c in need for c in ".eE") and _DECIMAL.fullmatch(have)):
                return False
            if not math.isclose(float(have), float(need), rel_tol=float_tolerance, abs_tol=float_tolerance):
                return False
    return True


def values_match(actual: Any, expected: Any, float_tolerance: float = 1e-6) -> bool:
    """Whether a call-based case's return value (decoded from its JSON) is the expected one: JSON values compared as
    Python's `==` compares them (as APPS's and LiveCodeBench's checkers do: 2 == 2.0, True == 1, "1" != 1), except
    that an expected float also accepts a number within `float_tolerance` of it, absolute or relative (0: exact),
    also inside lists and dicts, which are compared item by item. nan never matches. Both sides are plain JSON
    values, decoded in the trainer, so no object of the program's takes part in the comparison."""
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        try:
            return actual == expected or (float_tolerance > 0 and math.isclose(
                actual, expected, rel_tol=float_tolerance, abs_tol=float_tolerance))
        except OverflowError:  # an int too large for a float: no float is near it
            return False
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(actual) == len(expected)
                and all(values_match(a, e, float_tolerance) for a, e in zip(actual, expected, strict=True)))
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and actual.keys() == expected.keys()
                and all(values_match(actual[key], value, float_tolerance) for key, value in expected.items()))
    return actual == expected


class _CaseReports:
    """The parent's side of the driver's reports (the result pipe's JSON lines, `_IO_DRIVER`): checks each line
    (the call's token, the next case's index), compares its stdout with the expected output (`IOCases.passes`) and
    records the case's verdict; asks `_collect` to stop the run at the first failing case when `stop_at_failure`,
    and at a malformed report ("invalid report")."""

    def __init__(self, token: str, cases: IOCases, case_output_bytes: int, float_tolerance: float,
                 stop_at_failure: bool) -> None:
        self.token, self.cases, self.tolerance = token, cases, float_tolerance
        self.cap, self.stop_at_failure = case_output_bytes, stop_at_failure
        self.limit = 4 * (case_output_bytes + 3) // 3 + 4096  # base64 of the capped output, and the rest of a line
        self.buffer = bytearray()
        self.verdicts: list[str] = []
        self.last_stdout = b""  # the last reported case's output (a failing case's, when it stopped the run)

    def __call__(self, chunk: bytes) -> str | None:
        self.buffer += chunk
        while (end := self.buffer.find(b"\n")) >= 0:
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            verdict = self._verdict(line)
            if verdict is None:
                return "invalid report"
            self.verdicts.append(verdict)
            if verdict != "passed" and self.stop_at_failure:
                return "case failed"
        return "invalid report" if len(self.buffer) > self.limit else None

    def _verdict(self, line: bytes) -> str | None:
        try:
            record = json.loads(line)
            stdout = base64.b64decode(record["stdout"], validate=True)
        except (ValueError, TypeError, KeyError):
            return None
        index = len(self.verdicts)
        if record.get("token") != self.token or record.get("case") != index or index >= len(self.cases.outputs):
            return None
        self.last_stdout = stdout
        exit_code, limit = record.get("exit"), record.get("limit")
        if limit is not None or len(stdout) > self.cap:
            return str(limit or "output limit exceeded")
        if not isinstance(exit_code, int) or exit_code != 0:
            return _failure_reason(None, exit_code, "")
        text = stdout.decode("utf-8", "replace")
        return "passed" if self.cases.passes(index, text, self.tolerance) else "wrong answer"


def run_sandboxed_io(
    code: str,
    cases: IOCases | dict[str, Any] | list[Any] | str,
    *,
    fn_name: str | None = None,
    timeout_s: float = 5.0,
    case_timeout_s: float | None = None,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_output_bytes: int = 64 << 10,
    case_output_bytes: int = 1 << 20,
    float_tolerance: float = 1e-6,
    partial_credit: bool = False,
    python: str | None = None,
    require_isolation: bool = False,
    packages: Sequence[str] = (),
) -> SandboxResult:
    """Run `code` against `cases` in the sandbox, one child process per case: a stdin/stdout program with that
    case's input as its stdin, its stdout compared with the expected output (`outputs_match`); or, for call-based
    cases, the caller stub (`_CALLER`) calling the program's function `fn_name` with the case's arguments, the JSON
    of its return value compared with the expected value (`values_match`). The expected outputs never enter the
    sandbox: a driver inside (`_IO_DRIVER`) runs the cases and reports each one's output to the parent, which
    compares.

    `cases`: `IOCases` or what `parse_io_cases` accepts (`fn_name`: the function LiveCodeBench functional cases
    call, `parse_io_cases`' argument; see `row_fn_name`). Score: 1.0 if every case passes, else 0.0, and the run
    stops at the first failing case; `partial_credit`: the fraction of cases passed, every case run (until
    `timeout_s`). `SandboxResult.cases` holds each case's verdict in order ("passed", "wrong answer", "timeout",
    "exit code 1", ...; cases not run are absent), `reason` is "passed" or the first failure ("case 2: wrong
    answer"; a whole-call "timeout" when the cases did not all run in time; "invalid report", scoring 0, when the
    result pipe held a line that is not the driver's report of the next case), `stdout` the last reported case's
    output (the failing one's; call-based: the JSON of its return value) and `stderr` every case's stderr.

    `timeout_s`: wall-clock limit of the whole call (every case, interpreter starts included); `case_timeout_s`: of
    each case's program (default `timeout_s`; at most `timeout_s`); `cpu_s`: CPU seconds of each case's program;
    `memory_mb`: address space of each process; `max_procs`: processes at once, the driver included (so a case's
    program may use `max_procs - 1`); `max_output_bytes`: the call's stderr (all cases), more stops it;
    `case_output_bytes`: each case's stdout, more fails that case ("output limit exceeded"), and an expected output
    longer than that is a ValueError (no program could pass it); `float_tolerance`: see `outputs_match` (0: exact
    lines). `python`, `require_isolation` and `packages` as in `run_sandboxed` (each case's program, and the caller
    stub, gets the packages' folders on its sys.path; importing numpy costs each case ~0.1 s). Bad cases or arguments
    raise ValueError.
    """
    check_limits(timeout_s, cpu_s, memory_mb, max_procs, max_output_bytes)
    check_io_limits(timeout_s, case_timeout_s, case_output_bytes, float_tolerance)
    path = package_dirs(packages, python)
    case_timeout_s = timeout_s if case_timeout_s is None else case_timeout_s
    if not sys.platform.startswith("linux"):
        raise SandboxError(f"the sandbox needs Linux (namespaces, rlimits, prctl); this is {sys.platform}")
    if not isinstance(code, str):
        raise TypeError(f"run_sandboxed_io: code must be a str, got {type(code).__name__}")
    parsed = cases if isinstance(cases, IOCases) else parse_io_cases(cases, fn_name)
    if parsed is None:
        raise ValueError(f"run_sandboxed_io: cases must be a dict {{'inputs': [...], 'outputs': [...]}}, a list of "
                         f"LiveCodeBench cases, or the JSON text of either, got {cases!r:.80}")
    longest = max(map(_shortest_output_bytes, parsed.outputs, [parsed] * len(parsed.outputs)))
    if longest > case_output_bytes:
        raise ValueError(f"run_sandboxed_io: an expected output has {longest} bytes, more than case_output_bytes "
                         f"({case_output_bytes}): no program could pass; raise case_output_bytes")
    token = secrets.token_hex(16)
    driver = (_IO_DRIVER.replace("CASE_TIMEOUT_S = 5.0", f"CASE_TIMEOUT_S = {float(case_timeout_s)!r}")
              .replace("CASE_OUTPUT_BYTES = 1048576", f"CASE_OUTPUT_BYTES = {int(case_output_bytes)}")
              .replace("PACKAGE_PATH = []", f"PACKAGE_PATH = {list(path)!r}"))
    files = {"main.py": driver, "solution.py": f"{code}\n", "inputs.json": json.dumps(list(parsed.inputs))}
    if parsed.fn_name is not None:
        if not parsed.fn_name.isidentifier():
            raise ValueError(f"run_sandboxed_io: fn_name must be an identifier, got {parsed.fn_name!r:.60}")
        files["main.py"] = driver.replace('PROGRAM = "solution.py"', 'PROGRAM = "caller.py"')
        files["caller.py"] = _CALLER.replace('FN_NAME = "f"', f"FN_NAME = {parsed.fn_name!r}")
    reports = _CaseReports(token, parsed, case_output_bytes, float_tolerance, not partial_credit)
    run = _call(files, token, timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_procs=max_procs,
                max_output=max_output_bytes, python=python, require_isolation=require_isolation, on_result=reports)
    verdicts = tuple(reports.verdicts)
    passed = verdicts.count("passed")
    stderr = run.data["stderr"][:max_output_bytes].decode("utf-8", "replace")
    failed = next((i for i, verdict in enumerate(verdicts) if verdict != "passed"), None)
    if run.stopped == "invalid report":  # not the driver's line (or one too many): nothing of the run counts
        reason, passed = run.stopped, 0
    elif failed is not None:
        reason = f"case {failed}: {verdicts[failed]}"
    elif passed == len(parsed.inputs):
        reason = "passed"
    elif run.stopped is not None:  # a whole-call limit, or a malformed report
        reason = run.stopped
    else:  # the driver ended without reporting every case (the program killed it, say)
        reason = _failure_reason(None, run.exit_code, stderr)
        reason = "the driver ended before every case ran" if reason.startswith("exited before") else reason
    score = passed / len(parsed.inputs) if partial_credit else float(reason == "passed")
    stdout = reports.last_stdout[:max_output_bytes].decode("utf-8", "replace")
    return SandboxResult(score, reason, stdout, stderr, run.exit_code, run.isolation, run.warnings, verdicts)


def _shortest_output_bytes(expected: Any, cases: IOCases) -> int:
    """The fewest stdout bytes that pass against `expected`: its text, or the JSON of the value (of its element,
    when a wrapped one-element list also accepts that)."""
    if cases.fn_name is None:
        return len(expected.encode("utf-8"))
    if cases.wrapped_outputs and isinstance(expected, list) and len(expected) == 1:
        expected = expected[0]
    return len(json.dumps(expected)) + 1


def check_io_limits(
    timeout_s: float, case_timeout_s: float | None, case_output_bytes: int, float_tolerance: float,
) -> None:
    """Raise ValueError unless these are options `run_sandboxed_io` accepts besides `check_limits`' (for callers
    that validate them early): `case_timeout_s` None (= `timeout_s`) or in (0, `timeout_s`]."""
    if case_timeout_s is not None and (isinstance(case_timeout_s, bool) or not isinstance(case_timeout_s, (int, float))
            or not 0 < case_timeout_s <= timeout_s):
        raise ValueError(f"run_sandboxed_io: case_timeout_s must be None or a number > 0 and at most timeout_s "
                         f"({timeout_s}), got {case_timeout_s!r}")
    if isinstance(case_output_bytes, bool) or not isinstance(case_output_bytes, int) or case_output_bytes < 1:
        raise ValueError(f"run_sandboxed_io: case_output_bytes must be an int >= 1, got {case_output_bytes!r}")
    if (isinstance(float_tolerance, bool) or not isinstance(float_tolerance, (int, float))
            or not 0 <= float_tolerance < math.inf):
        raise ValueError(f"run_sandboxed_io: float_tolerance must be a finite number >= 0, got {float_tolerance!r}")

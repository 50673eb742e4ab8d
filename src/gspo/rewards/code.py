"""The `code` reward: run the program in a completion against the row's tests in the sandbox (`gspo.sandbox`).

A row's `tests` are either a Python snippet (or a list of them, e.g. asserts) run after the program, or cases run
one process each (`gspo.sandbox.parse_io_cases`), as a dict or list or its JSON text: APPS's and TACO's
`input_output` column as it is, `{"inputs": [...], "outputs": [...]}`, or LiveCodeBench's test cases,
`[{"input": ..., "output": ..., "testtype": "stdin" | "functional"}, ...]`. Stdin/stdout cases feed each input to
the program as its stdin and compare its stdout with the output (`gspo.sandbox.outputs_match`); call-based ones
(APPS's `fn_name`, LiveCodeBench's functional cases with the row's `fn_name` or `metadata`'s `func_name`:
`gspo.sandbox.row_fn_name`) call that function with each input's arguments and compare the value it returns
(`gspo.sandbox.values_match`).

Only the reward-specific parts live here: which program a completion holds (`extract_code`), what a row's `tests`
must be, and the score. Running the program safely is `gspo.sandbox.run_sandboxed`'s (and `run_sandboxed_io`'s) job.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gspo.rewards.thinking import after_thinking
from gspo.sandbox import (
    PYTEST_FIXTURES,
    PYTEST_NAMES,
    IOCases,
    check_io_limits,
    check_limits,
    package_dirs,
    parse_io_cases,
    row_fn_name,
    run_sandboxed,
    run_sandboxed_io,
)

__all__ = ["code_reward", "extract_code", "make_code_reward"]

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py")


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```python (or ```py) fenced block, else the last untagged ``` block,
    else — when there is no fence at all — the whole completion. A block cut off by the token limit (no closing
    fence) counts as running to the end. Blocks tagged with another language only give "" (no Python code)."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    for wanted in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return ""


def _python_tests(tests: str | list[str], entry_point: Any = None) -> str | list[str]:
    """A row's Python tests as the sandbox runs them. A string that is only a list of strings (the JSON or Python
    text of one, as a CSV or a dataset's string column stores MBPP-style `test_list`) is that list: run as written,
    the list display is one expression that no program can fail. HumanEval's layout, a `check(candidate)` function
    that nothing calls (its harness appends `check(entry_point)`), gets that call from the row's `entry_point`.
    Raise ValueError when the tests cannot judge a program: they are not Python (every program would fail them), or
    run nothing that can fail (no statement, a comment, only literal values, only definitions and imports: every
    program that runs would pass them). The sandbox also runs pytest-style tests (`test_*` functions, `Test*` classes,
    with the sandbox's pytest: `gspo.sandbox.pytest_shim`) and unittest cases that the tests define, so those count as
    run, except those marked skip (or xfail, which no program fails); pytest-style tests that ask for a fixture that
    neither they nor the sandbox's pytest define, or use a `pytest.<name>` it lacks, are refused too (every program
    would fail them: `_pytest_problem`). Stdin/stdout and call-based cases are checked by
    `gspo.sandbox.parse_io_cases` instead."""
    text = tests if isinstance(tests, str) else "\n".join(tests)
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise ValueError(f"code_reward: the row's tests are not valid Python ({e.msg}, line {e.lineno}): "
                         f"{text[:80]!r}") from None
    body = tree.body
    literal = [_literal(statement) for statement in body]
    if isinstance(tests, str) and len(body) == 1 and isinstance(literal[0], (list, tuple)) and literal[0] and all(
            isinstance(t, str) for t in literal[0]):
        return _python_tests(list(literal[0]), entry_point)
    nodes = list(ast.walk(tree))  # walked once: a large test file took ~1 ms per walk, and this runs per call
    called = _called(nodes)
    problem = _pytest_problem(body, nodes, called)
    if problem is not None:
        raise ValueError(f"code_reward: the row's tests {problem}, so every program would fail them: {text[:80]!r}")
    if any(_runs(statement, called) for statement in body):
        return tests
    if any(isinstance(s, ast.FunctionDef) and s.name == "check" and len(s.args.args) == 1 for s in body):
        if not (isinstance(entry_point, str) and entry_point.isidentifier()):
            raise ValueError(f"code_reward: the row's tests define check(candidate) but never call it (HumanEval's "
                             f"layout, whose harness calls check(entry_point)): give the row an 'entry_point' field, "
                             f"the name of the function to check, got {entry_point!r:.60}")
        return f"{text}\n\ncheck({entry_point})\n"
    raise ValueError(f"code_reward: the row's tests run nothing that can fail (no statement, only literal values, "
                     f"only definitions and imports, or only skipped tests), so every program that runs would pass: "
                     f"{text[:80]!r}")


def _runs(statement: ast.stmt, called: set[str]) -> bool:
    """Whether a top-level statement of the tests runs something that can fail: anything but a definition, an import,
    a literal value or an assignment of one; a pytest-style test (a `test*` function, not a helper that the tests
    call with arguments, or a `Test*` class with such methods) or a unittest case, which the sandbox runs, counts as
    run, unless it is marked skip or xfail."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _is_test(statement, called)
    if isinstance(statement, ast.ClassDef):
        if _not_judging(statement):
            return False
        if any("TestCase" in ast.unparse(base) for base in statement.bases):
            return True
        methods = [s for s in statement.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return statement.name.startswith("Test") and all(m.name != "__init__" for m in methods) and any(
            _is_test(m, set()) for m in methods)
    if isinstance(statement, (ast.Import, ast.ImportFrom, ast.Pass)):
        return False
    if isinstance(statement, (ast.Assign, ast.AnnAssign)):
        return statement.value is None or _literal(ast.Expr(statement.value)) is _NOT_LITERAL
    return _literal(statement) is _NOT_LITERAL


def _is_test(function: ast.FunctionDef | ast.AsyncFunctionDef, called: set[str]) -> bool:
    """Whether a function is one the sandbox runs as a test (`test*`, not a helper the tests call with arguments) and
    that can fail (not marked skip or xfail)."""
    takes = function.args.args[len(function.args.defaults):] or function.args.kwonlyargs
    return (function.name.startswith("test") and not (takes and function.name in called)
            and not _not_judging(function))


def _not_judging(definition: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    """Marked so that no program can fail it: skip (pytest's or unittest's), or a non-strict xfail."""
    for decorator in definition.decorator_list:
        name = ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)
        strict = isinstance(decorator, ast.Call) and any(
            k.arg == "strict" and isinstance(k.value, ast.Constant) and k.value.value for k in decorator.keywords)
        if name.endswith("mark.skip") or name in ("unittest.skip", "skip") or (name.endswith("mark.xfail")
                                                                              and not strict):
            return True
    return False


def _called(nodes: list[ast.AST]) -> set[str]:
    """The names the tests (all their `nodes`) call (`name(...)`): a `test*` function called with arguments is a
    helper, not a test."""
    return {node.func.id for node in nodes if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}


def _pytest_problem(body: list[ast.stmt], nodes: list[ast.AST], called: set[str]) -> str | None:
    """What in the tests the sandbox's pytest cannot run, in words ("ask for fixture 'db' in test_f, which ..."), or
    None: a `pytest.<name>` (or `from pytest import <name>`) it does not provide, or a fixture that a test asks for
    (a parameter without a default, not given by a literal parametrize) that neither the tests define (as module or
    class fixtures) nor it provides (`FIXTURES`). A test whose parameters it cannot read for sure (a parametrize with
    computed names, another decorator such as unittest.mock's patch) is not checked. `nodes`: every node of the
    tests; `called`: `_called(nodes)`."""
    aliases = {a.asname or a.name for node in nodes if isinstance(node, ast.Import)
               for a in node.names if a.name == "pytest"}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            missing = [a.name for a in node.names if a.name not in PYTEST_NAMES and a.name != "*"]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
              and not node.attr.startswith("__")):
            missing = [node.attr] if node.attr not in PYTEST_NAMES else []
        else:
            continue
        if missing:
            return (f"use pytest.{missing[0]}, which the sandbox's pytest does not provide (it has "
                    f"{', '.join(PYTEST_NAMES)})")
    module_fixtures = _fixtures(body, False)
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_test(statement, called):
            problem = _missing_fixture(statement, module_fixtures, False, [])
        elif isinstance(statement, ast.ClassDef) and statement.name.startswith("Test"):
            fixtures = {**module_fixtures, **_fixtures(statement.body, True)}
            problem = next((p for m in statement.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and _is_test(m, set()) and (p := _missing_fixture(m, fixtures, True,
                                                                              statement.decorator_list))), None)
        else:
            continue
        if problem is not None:
            return problem
    return None


def _fixtures(body: list[ast.stmt], methods: bool) -> dict[str, tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """The fixtures that statements define, by name (`@pytest.fixture`, `@fixture(name=...)`), each with `methods`
    (whether they are a class's)."""
    found = {}
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in statement.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                if ast.unparse(call.func if call else decorator).split(".")[-1] in ("fixture", "yield_fixture"):
                    names = [k.value.value for k in (call.keywords if call else []) if k.arg == "name"
                             and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
                    found[names[0] if names else statement.name] = (statement, methods)
    return found


def _missing_fixture(function: ast.FunctionDef | ast.AsyncFunctionDef, fixtures: dict[str, Any], method: bool,
                     class_decorators: list[ast.expr]) -> str | None:
    """The first fixture the test (and the fixtures it asks for) needs that nobody defines, in words; None."""
    given: set[str] = set()
    used: list[str] = []
    for decorator in [*class_decorators, *function.decorator_list]:
        name = ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)
        if name.endswith("mark.usefixtures") and isinstance(decorator, ast.Call):
            if not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in decorator.args):
                return None
            used += [a.value for a in decorator.args]
        elif name.endswith("mark.parametrize") and isinstance(decorator, ast.Call):
            names = decorator.args[0] if decorator.args else next(
                (k.value for k in decorator.keywords if k.arg == "argnames"), None)
            try:
                value = ast.literal_eval(names) if names is not None else None
            except ValueError:
                return None
            if isinstance(value, str):
                given |= {n.strip() for n in value.split(",") if n.strip()}
            elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
                given |= set(value)
            else:
                return None
        elif "mark." not in name:  # another decorator (unittest.mock.patch, a wrapper): its signature is its own
            return None
    wanted = [(n, function.name) for n in [*used, *_required(function, method)] if n not in given]
    seen: set[str] = set()
    while wanted:
        name, asker = wanted.pop()
        if name in seen or name in PYTEST_FIXTURES:
            continue
        seen.add(name)
        if name not in fixtures:
            return (f"ask for fixture {name!r} in {asker}, which neither the tests define nor the sandbox's pytest "
                    f"provides (it has {', '.join(PYTEST_FIXTURES)})")
        wanted += [(n, name) for n in _required(*fixtures[name])]
    return None


def _required(function: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    """A function's parameters without a default (`self` aside for a method)."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    names = [a.arg for a in positional[: len(positional) - len(arguments.defaults)]]
    names += [a.arg for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if default is None]
    is_static = any(ast.unparse(d) == "staticmethod" for d in function.decorator_list)
    return names[1:] if method and not is_static else names


_NOT_LITERAL = object()


def _literal(statement: ast.stmt) -> Any:
    """The value of an expression statement made of literals only (a string, a list of strings); else _NOT_LITERAL."""
    if not isinstance(statement, ast.Expr):
        return _NOT_LITERAL
    try:
        return ast.literal_eval(statement.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _program(prompt: str, completion: str, entry_point: Any) -> str:
    """The program a completion holds (`extract_code`), or, when the row names an `entry_point` that it does not
    define but the prompt followed by the completion does, that text: HumanEval's layout, whose prompt is the
    function's signature and docstring and whose completion (a base model's, or the canonical solution) its body."""
    code = extract_code(completion)
    if isinstance(entry_point, str) and not _defines(code, entry_point) and _defines(prompt + completion, entry_point):
        return prompt + completion
    return code


def _defines(source: str, name: str) -> bool:
    """Whether Python `source` parses and defines a top-level function or class `name`."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name == name for s in body)


def _row_cases(row: dict[str, Any]) -> IOCases | None:
    """The row's tests as stdin/stdout or call-based cases (None: a Python snippet); bad cases are a ValueError
    naming the row's field and what is wrong."""
    try:
        return parse_io_cases(row.get("tests"), row_fn_name(row))
    except ValueError as e:
        raise ValueError(f"code_reward: the row's 'tests' as {e}") from None


_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z_]\w*)")


def _missing_module_hint(stderr: str, packages: tuple[str, ...], seen: set[str]) -> str | None:
    """A hint for a program that failed with ModuleNotFoundError for a top-level module that is installed in the
    trainer's environment, is not in the standard library and not in `packages` (the rows' tests or solutions may
    need it: `packages`); None when there is none, and for a module already in `seen` (which this adds to). A
    module that is not installed here (a policy's guess) gets no hint."""
    for name in dict.fromkeys(_MISSING_MODULE.findall(stderr)):
        if name in seen or name in packages or name in sys.stdlib_module_names:
            continue
        seen.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin is not None:  # not a namespace package (a folder that happens to be here)
            return (f"a program failed with ModuleNotFoundError: No module named {name!r}; the sandbox's programs "
                    "import only the standard library and the reward's `packages`. If the rows' tests or solutions "
                    f"need it, use make_code_reward(packages=({name!r}, ...)) (installed here: {spec.origin})")
    return None


def make_code_reward(
    *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512, max_procs: int = 32,
    python: str | None = None, strict_equality: bool = True, case_timeout_s: float | None = None,
    case_output_bytes: int = 1 << 20, float_tolerance: float = 1e-6, partial_credit: bool = False,
    packages: Sequence[str] = (),
) -> Callable[..., float]:
    """A `code` reward with other sandbox limits, e.g. `my_rewards.py: slow_code = make_code_reward(timeout_s=20)`
    named in the config as `my_rewards:slow_code`. `timeout_s` is one call's wall-clock limit, every stdin/stdout
    case included; keep it below `rewards.timeout_s`. `strict_equality`: the tests' `==` finds a value whose
    equality the program defines unequal to a plain value (the always-equal object hack); false for tests that
    compare the program's own objects with plain values on purpose.

    `packages`: top-level modules of the trainer's environment that the programs and the rows' tests may import
    besides the standard library, for datasets whose tests or solutions use them (BigCodeBench: `import numpy as np`,
    pandas, ...): `my_rewards.py: bcb_code = make_code_reward(packages=("numpy", "pandas"), timeout_s=20)`. Without
    them such a row fails every program (ModuleNotFoundError; the reward logs a hint naming the module when it is
    installed here). The folders that hold them (e.g. the venv's site-packages) go on the program's sys.path after the
    standard library, and every module in a folder comes with it: importability is not what contains the program
    (`gspo.sandbox.package_dirs`). Checked here, before any call: a name that is not installed, is in the standard
    library or is not top-level ("numpy.linalg") is a ValueError, as is a folder the sandbox's unprivileged uid cannot
    read or extension modules the sandbox's interpreter cannot load (another Python version; `python`). Importing
    them costs every call, and every stdin/stdout case, its import time (2 CPU cores: numpy ~0.1 s, pandas ~0.5 s).
    The default `memory_mb=512` (address space) holds numpy (~100 MB at import) and pandas with pyarrow (~330 MB at
    import, modest DataFrames included; below ~320 MB pandas rows fail with "memory"); raise it for rows that build
    large arrays.

    For stdin/stdout and call-based cases (see `gspo.sandbox.run_sandboxed_io`): `case_timeout_s` limits each case's
    run (default and at most `timeout_s`: a row with many cases needs a `timeout_s` that covers them all, ~0.02 s of
    interpreter start each plus the program's time), `cpu_s` applies to each case's run, `case_output_bytes` caps
    each case's stdout (call-based: its return value's JSON), `float_tolerance` lets a decimal token (call-based: an
    expected float) differ that much (0: exact; `outputs_match`, `values_match`), and
    `partial_credit` scores the fraction of cases passed instead of 1.0 only when all pass (the binary reward of the
    GSPO paper). Python-snippet tests always score 1.0 or 0.0.
    """
    check_limits(timeout_s, cpu_s, memory_mb, max_procs, 1)
    check_io_limits(timeout_s, case_timeout_s, case_output_bytes, float_tolerance)
    package_dirs(packages, python)  # a bad name is a configuration error now, not a failure at the first call
    packages = tuple(packages)
    io_limits = {"timeout_s": timeout_s, "case_timeout_s": case_timeout_s, "cpu_s": cpu_s, "memory_mb": memory_mb,
                 "max_procs": max_procs, "case_output_bytes": case_output_bytes, "float_tolerance": float_tolerance,
                 "partial_credit": partial_credit, "python": python, "packages": packages}
    warned: set[str] = set()
    missing: set[str] = set()  # modules the programs could not import, looked up once each (`_missing_module_hint`)

    @after_thinking  # a program drafted inside the reasoning is not the answer
    def code_reward(prompt: str, completion: str, **row: Any) -> float:
        """The completion's program (see `extract_code`) against the row's `tests` in the sandbox.

        `row["tests"]` is a Python snippet (or a list of snippets) run after the program, usually asserts on its
        functions, e.g. `["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]`: 1.0 if they run to their end, else
        0.0. Or stdin/stdout cases, `{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}` or its JSON text: 1.0 if the
        program prints every case's output (trailing whitespace aside), else 0.0, or the fraction passed with
        `partial_credit`; or call-based cases (`{..., "fn_name": "add"}`, or LiveCodeBench's functional cases and
        the row's `fn_name`), scored alike on the function's return values. A row without usable tests is a data
        error (ValueError), not a wrong completion. Isolation warnings are logged once each.
        """
        cases, tests = row_tests(row)
        code = _program(prompt, completion, row.get("entry_point"))
        if not code.strip():
            return 0.0
        if cases is not None:
            result = run_sandboxed_io(code, cases, **io_limits)
        else:
            result = run_sandboxed(code, tests, timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                                   max_procs=max_procs, python=python, strict_equality=strict_equality,
                                   packages=packages)
        for warning in result.warnings:
            if warning not in warned:
                warned.add(warning)
                logger.warning("code reward sandbox: %s", warning)
        if result.score < 1.0 and "ModuleNotFoundError" in result.stderr:
            hint = _missing_module_hint(result.stderr, packages, missing)
            if hint is not None:
                logger.warning("code reward: %s", hint)
        return result.score

    code_reward.call_timeout_s = timeout_s  # the longest one call runs (RewardRunner.deadline_warning)
    code_reward.check_row = row_tests  # a row no program can pass or fail is left out before any compute
    return code_reward


def row_tests(row: dict[str, Any]) -> tuple[IOCases | None, str | list[str] | None]:
    """A row's tests as the code reward runs them: (stdin/stdout or call-based cases, None) or (None, the Python
    tests, `_python_tests`). Raises ValueError saying why no program could be judged by them: no `tests`, cases that
    do not parse, tests that are not Python, run nothing that can fail, or need what the sandbox lacks. The reward
    raises it on every call of such a row; `RewardRunner.drop_unscorable` leaves such rows out before a run starts."""
    tests = row.get("tests")
    cases = _row_cases(row)
    if cases is not None:
        return cases, None
    if not (isinstance(tests, str) and tests.strip()) and not (
        isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)
    ):
        raise ValueError("code_reward needs a row field 'tests' (a non-empty str or list of str, or "
                         f"stdin/stdout cases {{'inputs': [...], 'outputs': [...]}}), got {tests!r:.200}")
    return None, _python_tests(tests, row.get("entry_point"))


code_reward = make_code_reward()

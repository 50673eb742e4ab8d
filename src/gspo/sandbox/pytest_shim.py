"""The `pytest` of the sandbox: what the test files of code datasets use of pytest, with pytest's semantics, for
tests that `import pytest` in a sandbox that has no site-packages (`gspo.sandbox.process`; every program failed such
tests: ModuleNotFoundError), and the runner that collects and runs their tests as pytest would.

The harness (`process._HARNESS`) runs this file inside the sandbox, before the program, when the tests or the program
mention pytest or define `test*` functions or `Test*` classes, and calls `install`: that registers the module `pytest`
(`NAMES`) in sys.modules, and returns the `Runner`, which the harness asks to `restore` after the program ran and to
`run` the tests' `test*` functions and `Test*` classes once the tests ran as `__main__`. Provided:

* `raises(exc_or_tuple, match=regex)` as a context manager (its `ExceptionInfo`: `.value`, `.type`, `.match()`) or
  called as `raises(exc, fn, *args)`; `warns` and `deprecated_call` alike;
* `approx(expected, rel=None, abs=None, nan_ok=False)` for numbers and lists, tuples and dicts of numbers, pytest's
  tolerances (rel 1e-6, abs 1e-12); its `==` counts as plain for the harness's strict equality (`install` registers
  its methods), and a value the program made up (its own class, or arithmetic it wrote) is compared strictly, never by
  its arithmetic: an always-equal object fails `f(x) == approx(3.0)`;
* `mark.parametrize` (names as "a, b" or a sequence; one name: values not unpacked; stacked: their product; `param`
  with `marks=`; `indirect=`), `mark.skip` / `skipif` / `xfail` (strict, raises, run) / `usefixtures`, and any other
  `mark.<name>` as a marker that does nothing; marks on a class or the module's `pytestmark` apply to its tests;
* `fixture` (with or without arguments; scopes other than "function" are made once per run; params; autouse;
  fixtures that take fixtures; `yield` fixtures, torn down after the test), found by parameter name, in the test's
  class first; built-in `capsys` (and `capfd`, which captures the same way), `monkeypatch`, `tmp_path` and `request`
  (`FIXTURES`);
* `fail`, `skip`, `xfail`, `importorskip`, and `main` (a no-op: the harness runs the tests).

Tests run in the order they are defined; module, class and method setup/teardown (`setup_module`, `setup_class`,
`setup_method`, ...) run around them; a `test*` function the tests call themselves with arguments is their helper,
not a test. The first failing test ends the run (its exception propagates: the harness exits non-zero); a skipped or
xfailed test does not fail. A test that asks for a fixture nobody defines ends the run with "gspo sandbox: tests
error: ..." naming it (exit 2; `gspo.rewards.code` refuses such rows before they run).

Containment. The program runs after this module, in the same process, and can reach it through `pytest`: everything
the runner uses is taken before the program runs (the built-ins, `re.search`, `io.StringIO`), and `Runner.restore`
puts back the module's attributes, every class and function of this file and its globals as they were at `install`,
after the program ran and before each test (a program that set `pytest.raises` to a no-op, or `approx`'s `__eq__` to
always-true, fails as before). `skip`, `xfail` and `importorskip` only skip when called by the tests (tests.py's code):
called by the program they fail the test, and an outcome exception the program raises itself counts as a failure.
The harness's caveat holds: a program that deliberately digs into the harness's frames can still forge a pass.

This file runs under the sandbox's interpreter (Python >= 3.8) and imports only the standard library; the trainer
imports it for `NAMES` and `FIXTURES` (`gspo.rewards.code` checks the tests against them).
"""

from __future__ import annotations

import io
import itertools
import os
import re
import sys
from collections import namedtuple

NAMES = ("approx", "raises", "warns", "deprecated_call", "mark", "param", "fixture", "yield_fixture", "fail", "skip",
         "xfail", "importorskip", "main", "MonkeyPatch", "CaptureFixture", "FixtureRequest")
"""The names the sandbox's `pytest` module has; `pytest.<other>` is an AttributeError that says it is not provided."""
FIXTURES = ("capsys", "capfd", "monkeypatch", "tmp_path", "request")
"""The built-in fixtures the runner provides."""

# taken when this file runs, before the program does (it could replace them in the builtins module)
_type, _isinstance, _issubclass, _getattr, _setattr, _delattr = type, isinstance, issubclass, getattr, setattr, delattr
_callable, _len, _id, _str, _repr, _abs, _any, _all = callable, len, id, str, repr, abs, any, all
_dict, _list, _tuple, _set, _zip, _enumerate, _sorted = dict, list, tuple, set, zip, enumerate, sorted
_import, _eval, _next, _iter, _exit = __import__, eval, next, iter, sys.exit
_re_search, _StringIO, _product, _getframe = re.search, io.StringIO, itertools.product, sys._getframe
_MODULE_GETATTRIBUTE = type(sys).__getattribute__
_write, _CWD = sys.stderr.write, os.getcwd()
_NUMBERS = (int, float, complex)  # plain numbers: approx compares them within its tolerance
_ARITHMETIC = ("__eq__", "__ne__", "__sub__", "__rsub__", "__abs__")  # what approx asks of another number type
_NOT_SET = object()
_legit = []  # the outcome exceptions that skip(), xfail() and importorskip() raised for the tests (kept: identity)


def _called_by_tests(depth: int) -> bool:
    """Whether the function `depth` frames up from the caller is tests.py's code (not the program's)."""
    return _getframe(depth + 1).f_code.co_filename == "tests.py"


class OutcomeException(BaseException):
    """What fail(), skip() and xfail() raise (a BaseException, as pytest's: `except Exception` does not catch it)."""

    def __init__(self, msg: str = "") -> None:
        BaseException.__init__(self, msg)
        self.msg = msg


class Failed(OutcomeException):
    """pytest.fail(): the test fails."""


class Skipped(OutcomeException):
    """pytest.skip() and importorskip(): the test is skipped."""


class XFailed(OutcomeException):
    """pytest.xfail(): the test fails as expected."""


def fail(reason: str = "", pytrace: bool = True) -> None:
    """Fail the test with `reason`."""
    raise Failed(reason)


def _outcome(cls: type, reason: str, name: str) -> None:
    """Raise `cls(reason)` for the tests' code (the caller of pytest.`name`); for the program, fail instead."""
    if not _called_by_tests(2):
        raise Failed(f"the program called pytest.{name}(): only the tests may")
    exc = cls(reason)
    _legit.append(exc)
    raise exc


def skip(reason: str = "", allow_module_level: bool = False, msg: str | None = None) -> None:
    """Skip the test (from the tests only)."""
    _outcome(Skipped, msg if msg is not None else reason, "skip")


def xfail(reason: str = "") -> None:
    """End the test as an expected failure (from the tests only)."""
    _outcome(XFailed, reason, "xfail")


def importorskip(modname: str, minversion: str | None = None, reason: str | None = None, exc_type: type | None = None):
    """The module `modname`, or skip the test when it cannot be imported (the sandbox has the standard library only)."""
    try:
        _import(modname)
    except ImportError:
        _outcome(Skipped, reason or f"could not import {modname!r}", "importorskip")
    return sys.modules[modname]


def main(*args, **kwargs) -> int:
    """A no-op: the harness runs the tests (as `unittest.main` is one in the sandbox)."""
    return 0


# ------------------------------------------------------------------------------------------------------ raises, warns


class ExceptionInfo:
    """What `raises` caught: `value` (the exception), `type`, `typename`, `tb`; `match(regex)` asserts its message."""

    def __init__(self) -> None:
        self.value = self.type = self.tb = None

    @property
    def typename(self) -> str:
        return self.type.__name__

    def match(self, regexp) -> bool:
        text = "\n".join([_str(self.value)] + [_str(n) for n in _getattr(self.value, "__notes__", ())])
        if not _re_search(regexp, text):
            raise AssertionError(f"Regex pattern did not match.\n Regex: {regexp!r}\n Input: {text!r}")
        return True

    def errisinstance(self, exc) -> bool:
        return _isinstance(self.value, exc)


class RaisesContext:
    """`with raises(...) as excinfo:`: the block must raise `expected` (a subclass, or one of a tuple) whose message
    matches `match`; another exception propagates; none fails the test."""

    def __init__(self, expected, match) -> None:
        kinds = expected if _isinstance(expected, _tuple) else (expected,)
        if not kinds or not _all(_isinstance(k, _type) and _issubclass(k, BaseException) for k in kinds):
            raise TypeError(f"pytest.raises: expected exception must be a BaseException type, not {expected!r}")
        self.expected, self.match, self.excinfo = expected, match, ExceptionInfo()

    def __enter__(self) -> ExceptionInfo:
        return self.excinfo

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            raise Failed(f"DID NOT RAISE {self.expected!r}")
        if not _issubclass(exc_type, self.expected):
            return False
        self.excinfo.value, self.excinfo.type, self.excinfo.tb = exc, exc_type, tb
        if self.match is not None:
            self.excinfo.match(self.match)
        return True


def raises(expected, *args, match=None, **kwargs):
    """`with raises(ValueError, match="empty"):` (a `RaisesContext`), or `raises(ValueError, fn, *args, **kwargs)`,
    which calls fn and returns the ExceptionInfo."""
    _restore()
    context = RaisesContext(expected, match)
    if not args:
        if kwargs:
            raise TypeError(f"pytest.raises: unexpected keyword arguments {_sorted(kwargs)}")
        return context
    with context as info:
        args[0](*args[1:], **kwargs)
    return info


class WarningsChecker(_list):
    """`with warns(UserWarning, match=...) as record:`: the block must warn so (the warnings it gave are the list)."""

    def __init__(self, expected, match) -> None:
        _list.__init__(self)
        self.expected, self.match = expected, match
        self.catcher = _WARNINGS[0].catch_warnings(record=True)

    def __enter__(self) -> WarningsChecker:
        self.log = self.catcher.__enter__()
        _WARNINGS[0].simplefilter("always")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.catcher.__exit__(exc_type, exc, tb)
        self.extend(self.log)
        if exc_type is not None or _any(_issubclass(w.category, self.expected) and (
                self.match is None or _re_search(self.match, _str(w.message))) for w in self):
            return False
        raise Failed("DID NOT WARN. No warnings of type {!r}{} were emitted. Emitted: {!r}".format(
            self.expected, "" if self.match is None else f" matching {self.match!r}", [w.message for w in self]))


_WARNINGS = []  # the warnings module, imported by `install` when the tests use warns()


def warns(expected=Warning, *args, match=None, **kwargs):
    """`with warns(UserWarning):`, or `warns(UserWarning, fn, *args)`, as pytest's."""
    _restore()
    checker = WarningsChecker(expected, match)
    if not args:
        return checker
    with checker:
        return args[0](*args[1:], **kwargs)


def deprecated_call(*args, **kwargs):
    """`warns((DeprecationWarning, PendingDeprecationWarning), ...)`."""
    return warns((DeprecationWarning, PendingDeprecationWarning), *args, **kwargs)


# ------------------------------------------------------------------------------------------------------------ approx


def _plain_number(value, plain_method) -> bool:
    """A number whose arithmetic is Python's or the standard library's (Fraction, Decimal), not the program's: an
    object whose `-` says 0 must not be within tolerance of anything."""
    cls = _type(value)
    if cls in _NUMBERS:
        return True
    return cls is not bool and _all(plain_method(_getattr(cls, name, None)) for name in _ARITHMETIC)


class ApproxBase:
    """`approx(expected)`: equal to a number within the tolerance, or to a list / tuple / dict of such numbers in the
    same places; anything else only as it is equal to `expected` (strictly: the harness's comparison)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, expected, rel=None, abs=None, nan_ok=False) -> None:
        if _isinstance(expected, (_set, frozenset)):
            raise TypeError(f"pytest.approx() only supports ordered sequences, but got: {expected!r}")
        self.expected, self.rel, self.abs, self.nan_ok = expected, rel, abs, nan_ok

    def __repr__(self) -> str:
        return f"approx({self.expected!r})"

    def __bool__(self) -> bool:
        raise AssertionError("approx() is not supported in a boolean context. Did you mean: `assert a == approx(b)`?")

    def __eq__(self, actual) -> bool:
        return _approx_equal(self, self.expected, actual)

    def __ne__(self, actual) -> bool:
        return not _approx_equal(self, self.expected, actual)


def _approx_equal(approx: ApproxBase, expected, actual) -> bool:
    compare = _RUNTIME["compare"]
    if _isinstance(expected, _dict):
        if not _isinstance(actual, _dict) or not compare(_set(actual.keys()), _set(expected.keys()), True):
            return False
        return _all(_approx_equal(approx, value, actual[key]) for key, value in expected.items())
    if _isinstance(expected, (_list, _tuple)):
        if not _isinstance(actual, (_list, _tuple)) or _len(actual) != _len(expected):
            return False
        return _all(_approx_equal(approx, e, a) for e, a in _zip(expected, actual))
    if (_type(expected) is bool) != (_type(actual) is bool):
        return False
    if compare(actual, expected, True):
        return True
    plain = _RUNTIME["plain_method"]
    if _type(expected) is bool or not (_plain_number(expected, plain) and _plain_number(actual, plain)):
        return False
    if _abs(expected) != _abs(expected):  # nan
        return approx.nan_ok and _abs(actual) != _abs(actual)
    if _abs(expected) == float("inf"):
        return False
    tolerance = 1e-12 if approx.abs is None else approx.abs
    try:
        if approx.rel is not None or approx.abs is None:
            tolerance = max((1e-6 if approx.rel is None else approx.rel) * _abs(expected), tolerance)
        return _abs(expected - actual) <= tolerance
    except TypeError:  # float and Decimal
        return False


def approx(expected, rel=None, abs=None, nan_ok=False) -> ApproxBase:
    """An object equal to numbers within `rel` (default 1e-6) of `expected`, or `abs` (default 1e-12) of it: the
    larger; with only `abs` given, within `abs`. Lists, tuples and dicts of numbers compare item by item."""
    _restore()
    return ApproxBase(expected, rel, abs, nan_ok)


_RUNTIME = {}  # the harness's strict comparison and plain-method test, the runner's restore (filled by `install`)


def _restore() -> None:
    """Undo what the program changed of this module (`Runner.restore`): raises(), warns() and approx() do, so that
    even a program that patched it earlier in the same test gets them as they were."""
    if "restore" in _RUNTIME:
        _RUNTIME["restore"]()


# -------------------------------------------------------------------------------------------------- marks and params


class Mark:
    """One mark on a test: its name and the arguments it was given."""

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs


class MarkDecorator:
    """`pytest.mark.<name>` and `pytest.mark.<name>(...)`: called with one test function or class alone, marks it
    (in its `pytestmark` list, as pytest does); with anything else, a decorator with those arguments."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.mark = Mark(name, args, kwargs or {})

    def __call__(self, *args, **kwargs):
        if _len(args) == 1 and not kwargs and (_isinstance(args[0], _type) or (
                _callable(args[0]) and _getattr(args[0], "__name__", "<lambda>") != "<lambda>")):
            target = args[0]
            _setattr(target, "pytestmark", [*_list(_getattr(target, "pytestmark", [])), self.mark])
            return target
        mark = self.mark
        return MarkDecorator(mark.name, mark.args + args, _dict(mark.kwargs, **kwargs))


class MarkGenerator:
    """`pytest.mark`: any attribute is a mark (`parametrize`, `skip`, `skipif`, `xfail`, `usefixtures` mean what they
    do in pytest; the others, such as `slow` or `asyncio`, mark and do nothing)."""

    def __getattr__(self, name: str) -> MarkDecorator:
        if name.startswith("_"):
            raise AttributeError(name)
        return MarkDecorator(name)


mark = MarkGenerator()


class ParameterSet:
    """`pytest.param(*values, marks=..., id=...)`: one parametrize case with marks of its own."""

    def __init__(self, values: tuple, marks, id) -> None:
        marks = marks if _isinstance(marks, (_list, _tuple)) else [marks]
        self.values, self.marks, self.id = values, [m.mark for m in marks], id


def param(*values, marks=(), id=None) -> ParameterSet:
    return ParameterSet(values, marks, id)


def _marks(marks) -> list:
    """The Marks of a `pytestmark` value (a list, a mark, or None)."""
    marks = marks if _isinstance(marks, _list) else [] if marks is None else [marks]
    return [m.mark if _isinstance(m, MarkDecorator) else m for m in marks if _isinstance(m, (Mark, MarkDecorator))]


def _parametrize(mark: Mark) -> tuple:
    """A parametrize mark's (names, cases, indirect names): each case a (values by name, marks) pair. A case is
    unpacked into the names, except for one name given as a string ("x": each value is x's, a tuple too)."""
    args, kwargs = _list(mark.args), mark.kwargs
    names = kwargs["argnames"] if "argnames" in kwargs else args.pop(0)
    values = kwargs["argvalues"] if "argvalues" in kwargs else args.pop(0)
    whole = _isinstance(names, _str)
    names = [n.strip() for n in names.split(",") if n.strip()] if whole else _list(names)
    whole = whole and _len(names) == 1
    indirect = kwargs.get("indirect", False)
    indirect = _set(names) if indirect is True else _set(indirect or ())
    cases = []
    for value in values:
        marks = value.marks if _isinstance(value, ParameterSet) else []
        row = value.values if _isinstance(value, ParameterSet) else (value,) if whole else _tuple(value)
        if _len(row) != _len(names):
            raise _TestsError(f"parametrize {names!r}: a case has {_len(row)} values for {_len(names)} names: "
                              f"{value!r}")
        cases.append((_dict(_zip(names, row)), marks))
    return names, cases, indirect


# ------------------------------------------------------------------------------------------------------------ fixtures


class FixtureDef:
    """A `@pytest.fixture` function (calling it directly is an error, as in pytest)."""

    def __init__(self, func, name=None, scope="function", params=None, autouse=False) -> None:
        self.func, self.name, self.scope, self.autouse = func, name or func.__name__, scope, autouse
        self.params = None if params is None else _list(params)

    def __call__(self, *args, **kwargs):
        raise Failed(f"Fixture {self.name!r} called directly. Fixtures are not meant to be called directly, but are "
                     "created when test functions request them as parameters.")


def fixture(fixture_function=None, *, scope="function", params=None, autouse=False, ids=None, name=None):
    """`@pytest.fixture` or `@pytest.fixture(scope=..., params=..., autouse=..., name=...)`."""
    if fixture_function is not None:
        return FixtureDef(fixture_function, name, scope, params, autouse)
    return lambda function: FixtureDef(function, name, scope, params, autouse)


yield_fixture = fixture

CaptureResult = namedtuple("CaptureResult", ["out", "err"])


class CaptureFixture:
    """`capsys` (and `capfd`): what the test printed to sys.stdout / sys.stderr since it started or since the last
    `readouterr()`, which returns it as `(out, err)` and starts anew."""

    def __class_getitem__(cls, item):  # `capsys: pytest.CaptureFixture[str]`
        return cls

    def __init__(self) -> None:
        self.saved = (sys.stdout, sys.stderr)
        self.out, self.err = _StringIO(), _StringIO()
        sys.stdout, sys.stderr = self.out, self.err

    def readouterr(self) -> CaptureResult:
        result = CaptureResult(self.out.getvalue(), self.err.getvalue())
        for stream in (self.out, self.err):
            stream.seek(0)
            stream.truncate()
        return result

    def close(self) -> None:
        sys.stdout, sys.stderr = self.saved


class MonkeyPatch:
    """`monkeypatch`: setattr / delattr / setitem / delitem / setenv / delenv / syspath_prepend / chdir, each undone
    (in reverse order) after the test."""

    def __init__(self) -> None:
        self.undos = []

    def setattr(self, target, name, value=_NOT_SET, raising=True) -> None:
        if value is _NOT_SET:  # setattr("package.module.attr", value)
            if not _isinstance(target, _str) or "." not in target:
                raise TypeError("use setattr(target, name, value) or setattr('module.attr', value)")
            target, name, value = _resolve(target.rsplit(".", 1)[0]), target.rsplit(".", 1)[1], name
        old = _getattr(target, name, _NOT_SET)
        if raising and old is _NOT_SET:
            raise AttributeError(f"{target!r} has no attribute {name!r}")
        if _isinstance(target, _type):  # a class's own attribute, not what it inherits
            old = target.__dict__.get(name, _NOT_SET)
        self.undos.append(lambda: _setattr(target, name, old) if old is not _NOT_SET else _delattr(target, name))
        _setattr(target, name, value)

    def delattr(self, target, name=_NOT_SET, raising=True) -> None:
        if name is _NOT_SET:
            target, name = _resolve(target.rsplit(".", 1)[0]), target.rsplit(".", 1)[1]
        if _getattr(target, name, _NOT_SET) is _NOT_SET:
            if raising:
                raise AttributeError(name)
            return
        old = _getattr(target, name)
        self.undos.append(lambda: _setattr(target, name, old))
        _delattr(target, name)

    def setitem(self, mapping, name, value) -> None:
        old = mapping.get(name, _NOT_SET)
        self.undos.append(lambda: mapping.__setitem__(name, old) if old is not _NOT_SET else mapping.pop(name, None))
        mapping[name] = value

    def delitem(self, mapping, name, raising=True) -> None:
        if name not in mapping:
            if raising:
                raise KeyError(name)
            return
        old = mapping[name]
        self.undos.append(lambda: mapping.__setitem__(name, old))
        del mapping[name]

    def setenv(self, name, value, prepend=None) -> None:
        value = _str(value)
        if prepend and name in os.environ:
            value = value + prepend + os.environ[name]
        self.setitem(os.environ, name, value)

    def delenv(self, name, raising=True) -> None:
        self.delitem(os.environ, name, raising)

    def syspath_prepend(self, path) -> None:
        saved = _list(sys.path)
        self.undos.append(lambda: sys.path.__setitem__(slice(None), saved))
        sys.path.insert(0, _str(path))

    def chdir(self, path) -> None:
        saved = os.getcwd()
        self.undos.append(lambda: os.chdir(saved))
        os.chdir(path)

    def undo(self) -> None:
        while self.undos:
            self.undos.pop()()


def _resolve(dotted: str):
    """The object a dotted name names: modules imported as needed, then attributes."""
    parts = dotted.split(".")
    found = _import(parts[0])
    for i in range(1, _len(parts)):
        if _getattr(found, parts[i], _NOT_SET) is _NOT_SET:
            _import(".".join(parts[: i + 1]))
        found = _getattr(found, parts[i])
    return found


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name


class FixtureRequest:
    """`request`: `param` (the fixture's parameter, from `params=` or an indirect parametrize), `fixturename`,
    `function`, `cls`, `instance`, `node.name`, `addfinalizer(fn)` and `getfixturevalue(name)`."""

    def __init__(self, call: _Call, fixturename: str | None) -> None:
        self._call, self.fixturename = call, fixturename
        self.function, self.cls, self.instance = call.item.function, call.item.cls, call.instance
        self.node = _Node(call.item.name)
        if fixturename in call.params:
            self.param = call.params[fixturename]

    def addfinalizer(self, finalizer) -> None:
        self._call.finalizers.append(finalizer)

    def getfixturevalue(self, name: str):
        return self._call.value(name)


# ------------------------------------------------------------------------------------------------------------- runner


class _TestsError(Exception):
    """The tests cannot run as written (a fixture nobody defines, a bad parametrize): no program is at fault."""


def _innermost(function):
    """The function a decorator that used functools.wraps wrapped (pytest reads the signature there too)."""
    for _ in range(100):
        inner = _getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    return function


def _from_tests(function) -> bool:
    code = _getattr(_innermost(function), "__code__", None)
    return code is not None and code.co_filename == "tests.py"


def _argnames(function, method: bool) -> list:
    """The parameters of a test or fixture that fixtures fill, as pytest finds them: those without a default, aside
    from `self` (`method`) and the mocks that unittest.mock's `patch` decorators pass."""
    patches = _getattr(function, "patchings", None)
    inner = _innermost(function)
    code = _getattr(inner, "__code__", None)
    if code is None:
        return []
    names = _list(code.co_varnames[: code.co_argcount])
    names = names[: _len(names) - _len(_getattr(inner, "__defaults__", None) or ())]
    kwdefaults = _getattr(inner, "__kwdefaults__", None) or {}
    names += [n for n in code.co_varnames[code.co_argcount: code.co_argcount + code.co_kwonlyargcount]
              if n not in kwdefaults]
    names = names[int(method):]
    if patches:
        default = sys.modules["unittest.mock"].DEFAULT
        names = names[_len([p for p in patches if not p.attribute_name and p.new is default]):]
    return names


class _Item:
    """One collected test: a `test*` function (cls None) or the `test*` method `attribute` of a `Test*` class."""

    def __init__(self, name: str, function, cls, attribute: str | None, marks: list, argnames: list) -> None:
        self.name, self.function, self.cls, self.attribute = name, function, cls, attribute
        self.marks, self.argnames = marks, argnames


class _Call:
    """One run of a test item with one parametrize case: its fixtures, made as asked for and torn down after."""

    def __init__(self, runner: Runner, item: _Item, direct: dict, params: dict) -> None:
        self.runner, self.item, self.direct, self.params = runner, item, direct, params
        self.instance = item.cls() if item.cls is not None else None  # a new instance per test, as pytest makes
        self.values, self.finalizers = {}, []

    def value(self, name: str, asked_by: str | None = None):
        """The value of fixture (or parametrize argument) `name` for this call, made when first asked for."""
        if name in self.direct:
            return self.direct[name]
        if name in self.values:
            return self.values[name]
        if name == "request":
            return FixtureRequest(self, asked_by)
        definition = self.runner.fixture(name, self.item.cls)
        if definition is None:
            raise _TestsError("{} asks for fixture {!r}, which neither the tests define nor the sandbox's pytest "
                              "provides (it has {})".format(self.item.name, name, ", ".join(FIXTURES)))
        if not _isinstance(definition, FixtureDef):  # a built-in: a class with close() or undo(), or tmp_path
            value = definition(self.runner) if definition is _tmp_path else definition()
            if definition is not _tmp_path:
                self.finalizers.append(_getattr(value, "close", None) or value.undo)
        elif definition.scope == "function":
            value = self._make(name, definition, self.finalizers)
        else:  # made once per run (per parameter), torn down at its end
            key = (name, _id(self.params.get(name)))
            if key not in self.runner.cached:
                self.runner.cached[key] = self._make(name, definition, self.runner.finalizers)
            value = self.runner.cached[key]
        self.values[name] = value
        return value

    def _make(self, name: str, definition: FixtureDef, finalizers: list):
        method = self.item.cls is not None and name in self.runner.class_fixtures(self.item.cls)
        kwargs = {n: self.value(n, name) for n in _argnames(definition.func, method)}
        result = definition.func(self.instance, **kwargs) if method else definition.func(**kwargs)
        if _type(result).__name__ == "generator":  # a yield fixture: its code after the yield is its teardown
            generator, result = result, _next(result)
            finalizers.append(lambda: _finish(generator, name))
        return result

    def teardown(self) -> None:
        while self.finalizers:
            self.finalizers.pop()()


def _finish(generator, name: str) -> None:
    try:
        _next(generator)
    except StopIteration:
        return
    raise _TestsError(f"fixture {name!r} yields more than once")


def _tmp_path(runner: Runner):
    """A new empty folder for the test, under the sandbox's working folder (the only writable place)."""
    import pathlib

    runner.tmp_count += 1
    path = os.path.join(_CWD, "pytest-tmp", f"test{runner.tmp_count}")
    os.makedirs(path)
    return pathlib.Path(path)


_BUILTIN = {"capsys": CaptureFixture, "capfd": CaptureFixture, "monkeypatch": MonkeyPatch, "tmp_path": _tmp_path}


class Runner:
    """Collects and runs the tests' pytest-style tests (`run`); puts the module back as it was (`restore`)."""

    def __init__(self, module, shim: dict) -> None:
        self.module, self.shim = module, shim
        self.attributes, self.saved_names, self.globals = _dict(module.__dict__), _dict(_ATTRIBUTES), _dict(shim)
        own = [v for n, v in shim.items() if _getattr(v, "__module__", None) == shim["__name__"]]
        self.classes = [(c, _dict(c.__dict__)) for c in own if _isinstance(c, _type)]
        functions = [f for f in own if not _isinstance(f, _type)]
        for _, attributes in self.classes:
            functions += [_getattr(v, "fget", None) or _getattr(v, "__func__", None) or v for v in attributes.values()]
        self.functions = [(f, f.__code__, f.__defaults__, f.__kwdefaults__) for f in functions
                          if _type(f).__name__ == "function"]
        self.tests, self.fixtures, self.own_fixtures, self.cached, self.finalizers = {}, {}, {}, {}, []
        self.tmp_count = 0

    def restore(self) -> None:
        """Put back what the program may have replaced: `sys.modules["pytest"]` and its attributes, this file's
        globals, classes and functions (`pytest.raises = ...`, `type(pytest.approx(1)).__eq__ = ...`)."""
        sys.modules["pytest"] = self.module
        for saved, live in ((self.attributes, self.module.__dict__), (self.saved_names, _ATTRIBUTES),
                            (self.globals, self.shim)):
            for name in [n for n in live if n not in saved]:
                del live[name]
            for name, value in saved.items():
                if live.get(name, _NOT_SET) is not value:
                    live[name] = value
        for cls, attributes in self.classes:
            for name in [n for n in cls.__dict__ if n not in attributes]:
                _delattr(cls, name)
            for name, value in attributes.items():
                if cls.__dict__.get(name, _NOT_SET) is not value:
                    _setattr(cls, name, value)
        for function, code, defaults, kwdefaults in self.functions:
            if function.__code__ is not code:
                function.__code__ = code
            if function.__defaults__ is not defaults:
                function.__defaults__ = defaults
            if function.__kwdefaults__ is not kwdefaults:
                function.__kwdefaults__ = kwdefaults

    def fixture(self, name: str, cls):
        """The definition of fixture `name` for a test of `cls`: the class's, the tests', or a built-in; None."""
        if cls is not None and name in self.class_fixtures(cls):
            return self.class_fixtures(cls)[name]
        return self.fixtures.get(name) or _BUILTIN.get(name)

    def class_fixtures(self, cls) -> dict:
        if cls not in self.own_fixtures:
            self.own_fixtures[cls] = {v.name: v for base in _list(cls.__mro__)[::-1] for v in base.__dict__.values()
                                      if _isinstance(v, FixtureDef) and _from_tests(v.func)}
        return self.own_fixtures[cls]

    def collect(self, called: set, test_case) -> list:
        """The tests' items in pytest's order: `test*` functions (not a helper that the tests call with arguments)
        and the `test*` methods of `Test*` classes without `__init__` (unittest's TestCases are the harness's)."""
        items, module_marks = [], _marks(self.tests.get("pytestmark"))
        for name, value in _list(self.tests.items()):
            if _isinstance(value, FixtureDef):
                if _from_tests(value.func):
                    self.fixtures[value.name] = value
            elif name.startswith("test") and _callable(value) and not _isinstance(value, _type) and _from_tests(value):
                argnames = _argnames(value, False)
                if not (argnames and name in called):
                    marks = module_marks + _marks(_getattr(value, "pytestmark", None))
                    items.append(_Item(name, value, None, None, marks, argnames))
            elif (name.startswith("Test") and _isinstance(value, _type) and "__init__" not in value.__dict__
                  and not (test_case is not None and _issubclass(value, test_case))
                  and _any(_from_tests(v) for v in _list(value.__dict__.values()))):
                items += self._methods(name, value, module_marks)
        return items

    def _methods(self, name: str, cls, module_marks: list) -> list:
        items, seen = [], _set()
        class_marks = module_marks + _marks(cls.__dict__.get("pytestmark"))
        for base in cls.__mro__[:-1]:
            for attribute, method in _list(base.__dict__.items()):
                static = _isinstance(method, staticmethod)
                function = method.__func__ if static else method
                if (attribute.startswith("test") and attribute not in seen and _callable(function)
                        and not _isinstance(function, (_type, FixtureDef)) and _from_tests(function)):
                    seen.add(attribute)
                    marks = class_marks + _marks(_getattr(function, "pytestmark", None))
                    items.append(_Item(f"{name}.{attribute}", function, cls, attribute, marks,
                                       _argnames(function, not static)))
        return items

    def _closure(self, item: _Item, direct: dict) -> list:
        """The fixture definitions an item needs (autouse ones, `usefixtures`', its parameters', and theirs), once
        each and in the order they are made; a name `direct` gives (parametrize) is no fixture."""
        autouse = _list(self.fixtures.values()) + (_list(self.class_fixtures(item.cls).values()) if item.cls else [])
        wanted = [d.name for d in autouse if d.autouse]
        wanted += [n for m in item.marks if m.name == "usefixtures" for n in m.args] + item.argnames
        found, seen = [], _set()
        while wanted:
            name = wanted.pop(0)
            if name in seen or name in direct:
                continue
            seen.add(name)
            definition = self.fixture(name, item.cls)
            if _isinstance(definition, FixtureDef):
                found.append(definition)
                wanted += _argnames(definition.func, item.cls is not None and name in self.class_fixtures(item.cls))
        return found

    def expand(self, item: _Item) -> list:
        """The item's calls, (arguments given directly, fixtures' params, marks) each: one per case of the product
        of its parametrize marks and its fixtures' params; none when a parametrize has no case (pytest skips it)."""
        cases = [({}, {}, [])]
        for mark in item.marks:
            if mark.name == "parametrize":
                _names, rows, indirect = _parametrize(mark)
                cases = [(_dict(direct, **{n: v for n, v in row.items() if n not in indirect}),
                          _dict(params, **{n: v for n, v in row.items() if n in indirect}), marks + extra)
                         for (direct, params, marks), (row, extra) in _product(cases, rows)]
        calls = []
        for direct, params, marks in cases:
            parametrized = [d for d in self._closure(item, direct) if d.params is not None and d.name not in params]
            for combination in _product(*[d.params for d in parametrized]):
                given = _dict(params, **{d.name: v for d, v in _zip(parametrized, combination)})
                calls.append((direct, given, marks))
        return calls

    def run(self, tests: dict, called: set, test_case=None) -> None:
        """Run every collected test of `tests` (the namespace they ran in); `called`: the names the tests call;
        `test_case`: unittest.TestCase when the tests use it. The first failure propagates; a tests error ends the
        run with its message and exit status 2."""
        self.tests = tests
        try:
            self._run(self.collect(called, test_case))
        except _TestsError as e:
            _write(f"gspo sandbox: tests error: {e}\n")
            _exit(2)

    def _run(self, items: list) -> None:
        module = sys.modules.get("solution")
        if items:
            self._hook(self.tests, "setup_module", module)
        current = None
        for item in items:
            if item.cls is not current:
                self._hook(current, "teardown_class")
                current = item.cls
                self._hook(current, "setup_class")
            for direct, params, marks in self.expand(item):
                self._run_call(_Call(self, item, direct, params), item.marks + marks)
        self._hook(current, "teardown_class")
        while self.finalizers:
            self.finalizers.pop()()
        if items:
            self._hook(self.tests, "teardown_module", module)

    def _run_call(self, call: _Call, marks: list) -> None:
        """Run one call of a test: skipped by a skip / true skipif mark, an expected failure under a true xfail
        mark (a pass too, unless strict); any other exception propagates."""
        self.restore()
        if _any(m.name == "skip" or (m.name == "skipif" and _condition(m, self.tests)) for m in marks):
            return
        xfail = _next((m for m in marks if m.name == "xfail" and _condition(m, self.tests)), None)
        if xfail is not None and not xfail.kwargs.get("run", True):
            return
        item, instance = call.item, call.instance
        hooks = (instance, "_method") if instance is not None else (self.tests, "_function")
        try:
            self._hook(hooks[0], "setup" + hooks[1], item.function)
            kwargs = {n: call.value(n) for n in self._made_first(item) + item.argnames}
            function = _getattr(instance, item.attribute) if instance is not None else item.function
            result = function(**{n: kwargs[n] for n in item.argnames})
            if _type(result).__name__ == "coroutine":  # `async def test_...():`, as pytest-asyncio runs it
                if not _ASYNCIO:
                    _ASYNCIO.append(_import("asyncio"))
                _ASYNCIO[0].run(result)
        except (Skipped, XFailed) as e:
            if not _any(e is legit for legit in _legit):  # the program raised it itself
                raise
        except (Exception, Failed) as e:
            raises = xfail.kwargs.get("raises") if xfail is not None else None
            if _isinstance(e, _TestsError) or xfail is None or (raises is not None and not _isinstance(e, raises)):
                raise
        else:
            if xfail is not None and xfail.kwargs.get("strict", False):
                raise Failed("[XPASS(strict)] {}".format(xfail.kwargs.get("reason", "")))
        call.teardown()
        self._hook(hooks[0], "teardown" + hooks[1], item.function)

    def _made_first(self, item: _Item) -> list:
        """The fixtures made before a test's own: autouse ones, then `usefixtures`' (pytest's order)."""
        return ([d.name for d in self._closure(item, {}) if d.autouse]
                + [n for m in item.marks if m.name == "usefixtures" for n in m.args])

    def _hook(self, owner, name: str, argument=None) -> None:
        """Call an xunit-style setup / teardown hook of the tests (a module's, a class's, an instance's) if it has
        one, with `argument` when the hook takes one."""
        if owner is None:
            return
        hook = owner.get(name) if _isinstance(owner, _dict) else _getattr(owner, name, None)
        if hook is None or not _from_tests(hook):
            return
        code = _innermost(hook).__code__
        if code.co_argcount > (1 if _getattr(hook, "__self__", None) is not None else 0):
            hook(argument)
        else:
            hook()


_ASYNCIO = []  # the asyncio module, imported by `install` when the tests have `async def` tests


def _condition(mark: Mark, tests: dict) -> bool:
    """Whether a skipif / xfail mark applies: no condition (xfail), or one that is true (a string is evaluated with
    the tests' names, os and sys, as pytest does)."""
    conditions = _list(mark.args) + ([mark.kwargs["condition"]] if "condition" in mark.kwargs else [])
    if not conditions:
        return mark.name == "xfail"
    for condition in conditions:
        if _isinstance(condition, _str):
            condition = _eval(condition, _dict(tests, os=os, sys=sys))
        if condition:
            return True
    return False


_ATTRIBUTES = {}  # the module's names (`install`); `Runner.restore` puts them back too


class _Module(type(sys)):
    """The `pytest` module: its names come from _ATTRIBUTES, not from its __dict__ (so a program that wrote there,
    even while a test runs, changes nothing), it cannot be assigned to, and a name it does not provide is an
    AttributeError that says so."""

    def __getattribute__(self, name: str):
        if name in _ATTRIBUTES:
            return _ATTRIBUTES[name]
        return _MODULE_GETATTRIBUTE(self, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"gspo sandbox: the sandbox's pytest is read-only (pytest.{name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"gspo sandbox: the sandbox's pytest is read-only (pytest.{name})")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"gspo sandbox: pytest.{name} is not provided by the sandbox's pytest (it has "
                             f"{', '.join(NAMES)})")


def install(compare, plain_method, plain_ids: set, source: str) -> Runner:
    """Register the module `pytest` in sys.modules and return its Runner (see the module docstring). `compare` and
    `plain_method` are the harness's strict `==` and its test of a plain method; approx's methods go into
    `plain_ids` (the harness counts them as plain by identity); `source` is the tests' text (what they use is
    imported now, before the program runs)."""
    shim = globals()
    module = _Module("pytest")
    _ATTRIBUTES.update({name: shim[name] for name in NAMES}, __version__="8.0.0 (gspo sandbox)")
    module.__dict__.update(_ATTRIBUTES)
    _RUNTIME.update(compare=compare, plain_method=plain_method)
    for method in (ApproxBase.__eq__, ApproxBase.__ne__):  # module-level: alive as long as the process
        plain_ids.add(_id(method))
    if "async " in source:
        import asyncio

        _ASYNCIO.append(asyncio)
    if "warns" in source or "deprecated_call" in source:
        import warnings

        _WARNINGS.append(warnings)
    runner = Runner(module, shim)
    _RUNTIME["restore"] = runner.restore
    sys.modules["pytest"] = module
    return runner

"""Run untrusted, model-written Python in a locked-down child process (the `code` reward, `gspo.rewards.code`,
is built on it).

`run_sandboxed(code, tests)` runs `code` followed by `tests` (a Python snippet, typically `assert` statements) and
scores 1.0 only if the tests ran to their end; anything else scores 0.0 with a reason ("tests failed", "timeout",
"memory", "cpu time limit", "killed by signal 9", "exit code 1", ...). It never raises because of what the program
does; it raises `SandboxError` only when the sandbox itself cannot be set up (e.g. no usable interpreter).

How the program is contained (Linux). The trainer starts a small launcher (this file, run as a script by the
trainer's interpreter in isolated mode, in a new session), which

* enters new network, PID, mount and IPC namespaces (`unshare` through ctypes). When the trainer is not root, a user
  namespace is created first so that this works unprivileged;
* forks the sandbox's init process (PID 1 of the new PID namespace), which makes every mount read-only except the
  private working folder, mounts a /proc of its own (host processes are invisible: no command lines, no
  environments), sets resource limits (RLIMIT_CPU: CPU seconds; RLIMIT_AS: address space; RLIMIT_NPROC: processes;
  no core dumps; 16 MiB files; 256 open files) and — when the trainer runs as root — drops to an unprivileged uid
  and gid of the call's own (see `_own_ids`: no account has it, and no other running call) with no supplementary
  groups: that is what makes RLIMIT_NPROC bite (it is not enforced for uid 0, and it counts every process of a uid,
  so calls sharing one uid, such as `nobody`, would share one budget and a fork bomb in one would keep the others
  from starting); without root the user namespace's own process count plays that part. It sets no-new-privileges
  and a parent-death signal, forks the program and reaps every process until the program exits; when it exits in
  turn, the kernel kills whatever the program left behind in the namespace, however it daemonised;
* the program `exec`s `python -s -S -B main.py` (no site-packages: only the standard library is importable, plus
  the folders of the call's `packages`, which the harness puts on sys.path after it; the harness takes the call's
  folder off sys.path, as isolated mode would) in the private temporary folder (created per call, removed afterwards)
  with a clean environment (PATH, LANG, HOME and TMPDIR in that folder, OPENBLAS_NUM_THREADS, OMP_NUM_THREADS and
  MKL_NUM_THREADS 1, so that numpy's thread pools fit the limits, and PYTHONHASHSEED 0, so that a program iterates a
  set of strings in the same order in every call and its reward does not change from call to call; nothing
  inherited) and stdin at EOF. In the new
  network namespace there is no interface but a downed loopback: no connection goes anywhere, not even to the
  trainer's machine.

The trainer enforces the wall-clock limit itself (killing the whole process group; the parent-death signals and the
PID namespace take care of anything that left the group), caps the captured output, and reads the launcher's report
of which layers were applied. A layer that could not be applied is never claimed: it is named in
`SandboxResult.warnings` (and `require_isolation=True` turns that into an error).

Reward hacking: `tests` only count as passed when the harness reaches its end and writes a per-call random token to a
pipe the trainer reads, so `exit(0)` before the tests does not pass. The tests' `==` and `!=` count a value whose
equality the program defines (a class of its own, unittest.mock.ANY) as unequal to a plain one, so returning an object
whose `__eq__` always says True does not pass `assert f(2) == 4` either, nor `assert f(2) in (4, 5)` (the tests' `in` /
`not in` are checked alike, and a container whose membership the program defines counts as its own) (`strict_equality`;
`_HARNESS`; unittest's assertEqual / assertIn alike). Chained comparisons (`a == b == c`) are left to Python. The tests
run as a test file does: as `__main__`, with `from solution import f` importable, their pytest-style tests (`test*`
functions, `Test*` classes) and unittest cases run by the harness (neither ran, so every program passed them), and exec
/ compile taken before the program runs (a program that replaced `builtins.exec` passed every test); a unittest case
counts as skipped only when the tests skip it (a program that raised `unittest.SkipTest` passed every case). Tests that
import pytest get the sandbox's own (`gspo.sandbox.pytest_shim`: raises, approx, parametrize and the other marks,
fixtures with capsys, monkeypatch, tmp_path and request; pytest itself cannot be imported, so every program failed
them), which a program cannot replace or patch to pass. The harness runs in the same process as the program, so a
program that deliberately inspects the harness's frames can still forge a pass: this guards against accidental and
common hacks, not against an adversary that targets this harness.

Stdin/stdout cases: `gspo.sandbox.cases.run_sandboxed_io(code, cases)` (APPS/TACO-style `{"inputs": [...], "outputs":
[...]}`, checked by `parse_io_cases`; what is judged there runs in the trainer) makes one such call in which the entry
point is a driver (`_IO_DRIVER`) that runs the program once per input as a child process, with that input as its stdin,
and reports each case's output with the token on the result pipe. Only the inputs are written into the sandbox: the
trainer compares the outputs (`outputs_match`), so a program cannot pass a case whose output it does not print, whatever
it reads or forges. The driver is non-dumpable and runs the program with every other descriptor closed, so the program
cannot write to the result pipe either (a line there that is not the driver's report of the next case fails the
completion).

Call-based cases (APPS's and TACO's rows with a `fn_name`, LiveCodeBench's functional cases; `parse_io_cases`) go
the same way, except that each case's child runs a caller stub (`_CALLER`) instead of the program itself: it reads
the case's arguments (JSON) on stdin, runs solution.py, calls the function (a method of `class Solution`, else a
module-level function) and writes the JSON of its return value where the driver reads the case's stdout, after
pointing the program's own stdout at /dev/null, so nothing the program prints can be taken for its result. The
trainer decodes that JSON and compares plain values (`values_match`): the expected return values never enter the
sandbox either, and no object of the program's takes part in the comparison (no always-equal hack).

Third-party packages: `run_sandboxed(..., packages=("numpy", "pandas"))` lets the program and the tests import
those modules of the trainer's environment (BigCodeBench's rows import numpy, pandas, ...): the folders that hold
them (`package_dirs`, checked before any call) go on sys.path, in the harness and in every case's child interpreter.
That widens what is importable, not what is reachable: the filesystem is readable (read-only) anyway. With numpy
importable, its arrays of the program's objects and the program's ndarray subclasses count as the program's own
equality too (`_HARNESS`).

Not contained: the program can read world-readable files and use CPU, memory and its folder's disk space up to its
limits.

This module imports only the standard library: the launcher runs it as a script (`python -I -S process.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import marshal
import math
import os
import pwd
import re
import secrets
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SandboxError", "SandboxResult", "check_limits", "package_dirs", "run_sandboxed"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
# Per-mount flags that a remount must repeat (in a user namespace the kernel refuses to clear locked ones).
_MOUNT_OPTION_FLAGS = {"nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "noatime": 0x400, "nodiratime": 0x800,
                       "relatime": 0x200000, "strictatime": 0x1000000}

# As root, each call's program runs under a uid (= gid) of its own from this block, which no account uses: systemd
# leaves 0x70000000-0x7FFDFFFF unassigned (between its container and "foreign" ranges: systemd's UIDS-GIDS.md).
_UID_BASE = 0x70000000
_UID_COUNT = 1 << 20
_MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE: the largest file the program may write
_MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
_MAX_REPORT_BYTES = 64 << 10  # what is kept of the launcher's report and the result pipe
_RESULT_FD = 3  # where the harness finds the result pipe
_SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_FALLBACK_PYTHONS = ("/usr/local/bin/python3", "/usr/bin/python3")
# In the program's environment: the numeric libraries' thread pools (numpy's OpenBLAS, MKL, OpenMP, which pyarrow's
# pool follows too) start one thread, not one per CPU. Each thread's stack and buffers count against RLIMIT_AS and each
# thread against RLIMIT_NPROC: on a machine with many cores `import numpy` failed under the sandbox's limits.
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The program's str / bytes hashes, so the order it iterates a set (or prints one) in: one seed for every call, so that
# a reward is a function of the program and its tests. With a random seed per call, `list(set(a + b))` compared with a
# list passed or failed by chance (a KodCode test, 2 of 12 calls of one program).
_HASH_SEED = "0"
# How the sandbox's interpreter runs the entry point: not -I (isolated mode ignores PYTHONHASHSEED, as every PYTHON*
# variable; the environment is the sandbox's own anyway), so the entry points take their folder off sys.path themselves
_FLAGS = ("-s", "-S", "-B")

# The program's entry point. It reads the per-call token from stdin, leaves stdin at EOF, compiles tests.py and
# solution.py (before the program runs, with exec and compile taken then: a program that replaced builtins.exec made
# every test pass), runs solution.py (the code) as module "solution" (importable: `from solution import f`; with
# __name__ "solution", so an `if __name__ == "__main__":` block waiting for input does not run), then tests.py in the
# same namespace as __main__ (a test file run as a script: its main guard runs), then the pytest-style tests tests.py
# defines (`test*` functions, with fixtures and parametrize, and `Test*` classes: pytest_shim.py's runner, loaded with
# the module `pytest` before the program runs when the tests or the program mention pytest or the tests define such
# tests) and, when it uses unittest, its TestCase classes (unittest.main() and pytest.main() are left to the harness),
# and writes the token to the result pipe only if all of them returned (the runner's tests error, a fixture that nobody
# defines, exits 2 with "gspo sandbox: tests error: ..."). builtins.__import__ is put back after the program ran (a
# program's own could hand the tests a pytest or unittest of its own), and sys.exit taken before. With STRICT_EQUALITY,
# every `==` and `!=` of the tests goes through _compare (the tests' syntax tree rewritten): a side that holds a value
# whose equality the program wrote (or that says yes to anything, as unittest.mock.ANY does) is unequal to a side that
# holds none, so a program cannot pass `assert f(2) == 4` by returning an object whose __eq__ always says True; every
# `in` and `not in` goes through _contains alike (a container whose __contains__ / __iter__ / __getitem__ the program
# wrote counts as its own too: `assert 5 in f()` with f returning an object that holds anything fails). Built-in types'
# own comparisons, the standard library's numbers and collections (Fraction, Counter, ...), methods the tests themselves
# define (by their code's file: an approx class) and the sandbox pytest's approx (_plain_ids, by identity) count as
# plain; unittest's assertEqual, assertNotEqual, assertIn and assertNotIn check alike (as taken before the program ran).
# numpy's types are plain but for its arrays of objects (dtype object: their items are looked at, as a list's) and
# classes that subclass a numpy type without being numpy's (their == results are the program's). PACKAGE_PATH: the
# folders of the call's packages (`package_dirs`), appended to sys.path before anything of the program runs.
# Kept compatible with Python >= 3.8.
_HARNESS = """\
import sys

if not sys.flags.isolated:  # run as `python -s -S -B main.py` (_FLAGS): not the call's folder on sys.path, as -I did
    del sys.path[0]

import ast
import builtins
import itertools
import os
import sys

STRICT_EQUALITY = True
PACKAGE_PATH = []  # the folders of the packages the program may import (`run_sandboxed`'s packages), after the stdlib
sys.path.extend(PACKAGE_PATH)
# the built-ins the checks use, taken before the program runs (it could replace them in the builtins module)
_type, _getattr, _isinstance, _issubclass, _id, _write = type, getattr, isinstance, issubclass, id, sys.stderr.write
_exec, _compile, _setattr = exec, compile, setattr  # `builtins.exec = lambda *a: None` made every test pass
_exit, _import = sys.exit, builtins.__import__  # `sys.exit = print` let failed unittest cases pass
_dict, _list, _set, _map, _any, _chain, _len = dict, list, set, map, any, itertools.chain, len
# a built-in type's own methods (int, str, list, dict, OrderedDict, Decimal, ...): slot wrappers and C methods
_C_METHODS = (_type(object.__eq__), _type(dict.__contains__))
# the standard library's modules whose types' methods are plain too (not unittest.mock: ANY equals anything), the
# collections' mixins included (ChainMap's == and UserList's iteration are collections.abc's), an Enum class's
# membership, os.environ, WeakSet
_PLAIN_MODULES = ("fractions", "decimal", "_pydecimal", "collections", "collections.abc", "_collections_abc",
                  "datetime", "_pydatetime", "ipaddress", "pathlib", "uuid", "enum", "os", "_weakrefset", "weakref")
_CONTAINERS = (_dict, _list, tuple, _set, frozenset)
_said, _plain_builtins, _plain_ids = [], set(), set()  # _plain_ids: the sandbox pytest's approx methods


def _plain_method(method):
    if _type(method) in _C_METHODS or _id(method) in _plain_ids:
        return True
    code = _getattr(method, "__code__", None)
    if code is not None and code.co_filename == "tests.py":  # the tests' own helper, e.g. an approx class
        return True
    return _getattr(method, "__module__", None) in _PLAIN_MODULES


def _from_numpy(cls):
    module = _getattr(cls, "__module__", None)
    return _isinstance(module, str) and (module == "numpy" or module.startswith("numpy."))


def _own_type(cls):
    if cls in _plain_builtins:
        return None
    for name in ("__eq__", "__ne__"):
        if not _plain_method(_getattr(cls, name, None)):
            return cls
    # a subclass of a numpy type that numpy did not write (an ndarray with its own __bool__ or __array_ufunc__):
    # numpy's == hands back an array of that class, whose truth the program decides
    if not _from_numpy(cls) and _any(_from_numpy(base) for base in _getattr(cls, "__mro__", ())[1:]):
        return cls
    if _getattr(cls, "__module__", None) == "builtins":  # a C type: its methods cannot change later
        _plain_builtins.add(cls)
    return None


def _object_array(value):
    # a numpy array of Python objects (dtype object): its == calls its items' own ==, so they are looked at as a
    # list's are (a program with packages=("numpy",) could return np.array([Yes()], dtype=object))
    return _from_numpy(_type(value)) and _getattr(_getattr(value, "dtype", None), "kind", None) == "O"


def _nested(value):
    return _isinstance(value, _CONTAINERS) or _object_array(value)


def _items(item, base):
    if base is _dict:
        return _chain(_dict.keys(item), _dict.values(item))
    return base.__iter__(item)


def _own_equality(value):
    stack, seen, budget = [value], _set(), 100000  # items looked at, at most (a hack is rarely buried deeper)
    while stack and budget > 0:
        item = stack.pop()
        own = _own_type(_type(item))
        if own is not None:
            return own
        if _object_array(item):
            if _id(item) not in seen:
                seen.add(_id(item))
                items = _list(item.flat)
                budget -= _len(items)
                for kind in _set(_map(_type, items)):
                    own = _own_type(kind)
                    if own is not None:
                        return own
                stack.extend(x for x in items if _nested(x))
            continue
        for base in _CONTAINERS:
            if _isinstance(item, base) and _id(item) not in seen:
                seen.add(_id(item))
                budget -= base.__len__(item)
                kinds = _set(_map(_type, _items(item, base)))  # each type checked once: a million ints cost little
                for kind in kinds:
                    own = _own_type(kind)
                    if own is not None:
                        return own
                if _any(_issubclass(kind, _CONTAINERS) or _from_numpy(kind) for kind in kinds):
                    stack.extend(x for x in _items(item, base) if _nested(x))
                break
    return None


def _own_container(value):
    cls = _type(value)
    for name in ("__contains__", "__iter__", "__getitem__"):
        method = _getattr(cls, name, None)
        if method is not None and not _plain_method(method):
            return cls
    return None


def _mixed(own, what):
    if (own[0] is None) == (own[1] is None):
        return False
    if not _said:
        _said.append(1)
        cls = own[0] or own[1]
        _write("gspo sandbox: a value of %s (its %s is not a built-in type's) compared with a plain value: "
               "unequal\\n" % (_getattr(cls, "__qualname__", cls), what))
    return True


def _compare(left, right, equal):
    if _mixed((_own_equality(left), _own_equality(right)), "=="):
        return not equal
    return left == right if equal else left != right


def _contains(left, right, inside):
    if _mixed((_own_equality(left), _own_equality(right) or _own_container(right)), "== or membership"):
        return not inside
    return left in right if inside else left not in right


_REWRITES = {ast.Eq: ("__gspo_compare__", True), ast.NotEq: ("__gspo_compare__", False),
             ast.In: ("__gspo_contains__", True), ast.NotIn: ("__gspo_contains__", False)}


class _Equalities(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or _type(node.ops[0]) not in _REWRITES:
            return node
        name, positive = _REWRITES[_type(node.ops[0])]
        call = ast.Call(func=ast.Name(id=name, ctx=ast.Load()),
                        args=[node.left, node.comparators[0], ast.Constant(value=positive)], keywords=[])
        return ast.copy_location(call, node)


def _strict_unittest(unittest):
    case = unittest.TestCase
    equal, not_equal, inside, outside = case.assertEqual, case.assertNotEqual, case.assertIn, case.assertNotIn
    unequal = "a value of the program's own equality compared with a plain value: unequal"

    def assertEqual(self, first, second, msg=None):
        if _mixed((_own_equality(first), _own_equality(second)), "=="):
            raise self.failureException(msg or unequal)
        return equal(self, first, second, msg)

    def assertNotEqual(self, first, second, msg=None):
        if not _mixed((_own_equality(first), _own_equality(second)), "=="):
            return not_equal(self, first, second, msg)

    def assertIn(self, member, container, msg=None):
        if _mixed((_own_equality(member), _own_equality(container) or _own_container(container)), "membership"):
            raise self.failureException(msg or unequal)
        return inside(self, member, container, msg)

    def assertNotIn(self, member, container, msg=None):
        if not _mixed((_own_equality(member), _own_equality(container) or _own_container(container)), "membership"):
            return outside(self, member, container, msg)

    return {"assertEqual": assertEqual, "assertNotEqual": assertNotEqual, "assertIn": assertIn,
            "assertNotIn": assertNotIn}


def _from_tests(value):
    code = _getattr(value, "__code__", None)
    return code is not None and code.co_filename == "tests.py"


# The sandbox's pytest (pytest_shim.py) installed (its runner), and the names the tests call, when the tests or the
# program mention pytest or the tests define `test*` functions or `Test*` classes; else (None, None).
def _pytest(tests, source, program):
    if "pytest" not in source and "pytest" not in program and not _any(
            _isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and s.name.lower().startswith("test")
            for s in tests.body):
        return None, None
    called = _set(n.func.id for n in ast.walk(tests) if _isinstance(n, ast.Call) and _isinstance(n.func, ast.Name))
    with open("pytest_shim.pyc", "rb") as handle:  # compiled by the trainer: compiling it here took ~15 ms
        compiled = handle.read()
    magic = _getattr(sys.modules.get("_frozen_importlib_external"), "MAGIC_NUMBER", None)
    if magic is not None and compiled[:len(magic)] == magic:
        import marshal
        code = marshal.loads(compiled[len(magic):])
    else:  # another Python version than the trainer's
        with open("pytest_shim.py", encoding="utf-8") as handle:
            code = _compile(handle.read(), "pytest_shim.py", "exec")
    shim = {"__name__": "gspo_pytest", "__builtins__": builtins}
    _exec(code, shim)
    return shim["install"](_compare, _plain_method, _plain_ids, source), called


def _refuse_program_skip(error):
    # a SkipTest counts only when the tests' own code raised it: a `raise` in tests.py, or unittest's skipTest()
    # called there; one raised in the program (`raise unittest.SkipTest` in f, or in the Solution() a setUp makes)
    # made every test that reached it pass
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    if not frames or not (frames[-1].co_filename == "tests.py" or (
            frames[-1].co_name == "skipTest" and _len(frames) > 1 and frames[-2].co_filename == "tests.py")):
        raise AssertionError("the program raised unittest.SkipTest: a test it skips is not passed")


def _no_program_skips(function, skip_test):
    if function.__code__.co_flags & 0x80:  # CO_COROUTINE: an IsolatedAsyncioTestCase's async test
        async def guarded(*args, **kwargs):
            try:
                return await function(*args, **kwargs)
            except skip_test as error:
                _refuse_program_skip(error)
                raise
    else:
        def guarded(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except skip_test as error:
                _refuse_program_skip(error)
                raise
    guarded.__name__, guarded.__qualname__, guarded.__doc__ = function.__name__, function.__qualname__, function.__doc__
    return guarded


def _run_test_cases(namespace, unittest, skip_test):
    cases = [value for value in _list(namespace.values()) if _isinstance(value, _type) and
             _issubclass(value, unittest.TestCase) and _any(_from_tests(v) for v in _dict(value.__dict__).values())]
    if not cases:
        return
    for case in cases:  # its tests, setUp and helpers (class and static methods too): the program's skips fail
        for name, value in _list(_dict(case.__dict__).items()):
            inner = _getattr(value, "__func__", value)
            if _from_tests(inner):
                guarded = _no_program_skips(inner, skip_test)
                _setattr(case, name, guarded if inner is value else _type(value)(guarded))
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromTestCase(case) for case in cases)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
    if result.testsRun == 0 or not result.wasSuccessful():
        _write("gspo sandbox: the tests' unittest cases failed\\n")
        _exit(1)


def _main():
    token = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    with open("tests.py", encoding="utf-8") as handle:
        source = handle.read()
    with open("solution.py", encoding="utf-8") as handle:
        program_source = handle.read()
    program = _compile(program_source, "solution.py", "exec")
    tests = ast.parse(source, "tests.py")  # compiled before the program runs: it could replace compile
    runner, called = _pytest(tests, source, program_source)
    if STRICT_EQUALITY:
        tests = ast.fix_missing_locations(_Equalities().visit(tests))
    tests = _compile(tests, "tests.py", "exec")
    unittest = None
    if "unittest" in source:  # its assertions and SkipTest, taken before the program runs (it could replace them)
        import unittest
        strict, skip_test = _strict_unittest(unittest), unittest.SkipTest
    module = _type(sys)("solution")  # importable: `from solution import f` in the tests
    namespace = module.__dict__
    namespace["__builtins__"] = __builtins__
    sys.modules["solution"] = module
    _exec(program, namespace)
    builtins.__import__ = _import  # a program's __import__ could hand the tests a pytest or unittest of its own
    if runner is not None:
        runner.restore()
    if STRICT_EQUALITY:
        namespace.update(__gspo_compare__=_compare, __gspo_contains__=_contains)
    if unittest is not None:
        if STRICT_EQUALITY:
            for name, method in strict.items():
                _setattr(unittest.TestCase, name, method)
        unittest.main = lambda *args, **kwargs: None  # the harness runs the test cases itself, below
        # `unittest.case.SkipTest = AssertionError` in the program made every failed assertion a skip
        unittest.SkipTest = sys.modules["unittest.case"].SkipTest = skip_test
    namespace["__name__"] = "__main__"  # the tests run as a script would: their `if __name__ == "__main__":` too
    namespace["__file__"] = os.path.abspath("tests.py")  # `pytest.main([__file__])` under that guard
    _exec(tests, namespace)
    if runner is not None:  # pytest's layout: `def test_...():` functions, `class Test...:`
        runner.run(namespace, called, unittest.TestCase if unittest is not None else None)
    if unittest is not None:
        _run_test_cases(namespace, unittest, skip_test)
    if STRICT_EQUALITY and (namespace.get("__gspo_compare__") is not _compare
                            or namespace.get("__gspo_contains__") is not _contains):
        _write("gspo sandbox: the program replaced the tests' comparison\\n")
        _exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(3, token.encode() + b"\\n")


_main()
"""

# The entry point for stdin/stdout cases (`run_sandboxed_io`): a driver that reads the per-call token from stdin, leaves
# stdin at EOF, makes itself non-dumpable and reads inputs.json (the cases' stdin texts; the expected outputs never
# enter the sandbox), then runs PROGRAM (solution.py; for call-based cases the caller stub, `_CALLER`) as `python -s -S
# -B -c BOOT PROGRAM`, which takes the working folder off its sys.path, puts the packages' folders there and runs
# PROGRAM as `python PROGRAM` would, once per input, in that order: stdin a file holding the input (call-based: the
# arguments' JSON), stdout a pipe it reads up to CASE_OUTPUT_BYTES (+1, so that the parent sees an overflow), stderr its
# own (the captured stderr), every other descriptor closed (close_fds: the program never holds the result pipe, fd 3),
# its own process group (killed with whatever it started once the case ends), CASE_TIMEOUT_S of wall clock. After each
# case it writes one JSON line to fd 3: the token, the case's index, its exit status (None when a limit stopped it), the
# limit ("timeout", "output limit exceeded" or None) and its stdout in base64; the parent compares. The programs run
# under the driver's uid, so the driver is made non-dumpable (prctl PR_SET_DUMPABLE 0): they can then neither ptrace it
# nor open its /proc/<pid>/fd/3, mem or environ; at worst they can kill or stop it, which loses the cases not yet
# reported. Kept compatible with Python >= 3.8.
_IO_DRIVER = """\
import sys

if not sys.flags.isolated:  # as the harness: not the call's folder on sys.path
    del sys.path[0]

import base64
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

CASE_TIMEOUT_S = 5.0
CASE_OUTPUT_BYTES = 1048576
PROGRAM = "solution.py"
PACKAGE_PATH = []
_PR_SET_DUMPABLE = 4
# a case's program runs as `python -s -S -B -c BOOT PROGRAM`: BOOT takes the working folder off its sys.path (as -I
# did), puts the PACKAGE_PATH folders there (after the stdlib) and runs PROGRAM as the script would run, as __main__
# with its __file__ and argv
BOOT = ("import sys; del sys.path[0]; sys.path.extend(%r); sys.argv[:] = [%r]; del sys; __file__ = %r; "
        "exec(compile(open(__file__, 'rb').read(), __file__, 'exec'))" % (PACKAGE_PATH, PROGRAM, PROGRAM))
COMMAND = [sys.executable, "-s", "-S", "-B", "-c", BOOT, PROGRAM]


def _run_case(text):
    with tempfile.TemporaryFile(dir=".") as stdin:
        stdin.write(text.encode("utf-8"))
        stdin.seek(0)
        child = subprocess.Popen(COMMAND, stdin=stdin, stdout=subprocess.PIPE, close_fds=True,
                                 start_new_session=True)
    deadline = time.monotonic() + CASE_TIMEOUT_S
    out, limit = bytearray(), None
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while limit is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                limit = "timeout"
            elif selector.select(remaining):
                chunk = os.read(child.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                if len(out) > CASE_OUTPUT_BYTES:
                    limit = "output limit exceeded"
    if limit is None:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            limit = "timeout"
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the program, if a limit stopped it, and what it left in its group
    except OSError:
        pass
    child.wait()
    child.stdout.close()
    return {"exit": None if limit else child.returncode, "limit": limit,
            "stdout": base64.b64encode(bytes(out[:CASE_OUTPUT_BYTES + 1])).decode("ascii")}


def _main():
    token = sys.stdin.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    zero = ctypes.c_ulong(0)
    if ctypes.CDLL(None, use_errno=True).prctl(ctypes.c_int(_PR_SET_DUMPABLE), zero, zero, zero, zero) != 0:
        sys.stderr.write("gspo sandbox: the driver could not make itself non-dumpable\\n")
        sys.exit(1)
    with open("inputs.json", encoding="utf-8") as handle:
        inputs = json.load(handle)
    for case, text in enumerate(inputs):
        record = _run_case(text)
        record.update(case=case, token=token)
        line = (json.dumps(record) + "\\n").encode("ascii")
        while line:
            line = line[os.write(3, line):]


_main()
"""

# The program a call-based case's child runs instead of solution.py (`_IO_DRIVER`'s PROGRAM): it reads the case's
# arguments (a JSON list) from stdin, points stdin and stdout (fd 0 and 1) at /dev/null, keeping a private duplicate
# of the stdout pipe (not inheritable), runs solution.py with __name__ "solution", calls FN_NAME (a method of
# `Solution()` when solution.py defines that class with it, LeetCode-style; else a module-level function) with those
# arguments, and writes the JSON of its return value (tuples as lists) to the kept duplicate, one line, then exits 0.
# Whatever the program prints goes to /dev/null (as the datasets' checkers discard it), so no line it prints can be
# taken for the result; a return value that json cannot write (a set, an object) fails the case (exit 1, stderr
# says why). The program runs in this process and could find the duplicate and write there itself, but that gains
# nothing: what reaches the driver must be the JSON of the expected value, which never enters the sandbox (the
# parent compares, `IOCases.passes`), so it has to compute the answer, as returning it would; a stray write makes
# the report not one JSON value, a wrong answer. Kept compatible with Python >= 3.8.
_CALLER = """\
import json
import os
import sys

FN_NAME = "f"


def _main():
    arguments = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    result = os.dup(1)
    os.dup2(null, 1)
    os.close(null)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    with open("solution.py", encoding="utf-8") as handle:
        exec(compile(handle.read(), "solution.py", "exec"), namespace)
    owner = namespace.get("Solution")
    if isinstance(owner, type) and hasattr(owner, FN_NAME):
        function = getattr(owner(), FN_NAME)
    else:
        function = namespace.get(FN_NAME)
    if not callable(function):
        sys.stderr.write("gspo sandbox: solution.py defines no function %s (nor a method of class Solution)\\n"
                         % FN_NAME)
        sys.exit(1)
    value = function(*arguments)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        sys.stderr.write("gspo sandbox: the return value is not a JSON value: %s\\n" % e)
        sys.exit(1)
    sys.stdout.flush()
    line = (text + "\\n").encode("ascii")
    while line:
        line = line[os.write(result, line):]


_main()
"""


class SandboxError(RuntimeError):
    """The sandbox could not run the program (a setup problem, not the program's fault)."""


@dataclass(frozen=True)
class SandboxResult:
    """What became of one sandboxed program.

    `score` 1.0 (the tests ran to their end) or 0.0; `reason` "passed" or why not; `stdout` / `stderr` as captured
    (at most `max_output_bytes` each, decoded with replacement); `exit_code` the program's exit status (negative:
    killed by that signal; None when the trainer killed it on timeout or output overflow); `isolation` the layers
    that were applied; `warnings` the layers that could not be (never silently missing); `cases` each stdin/stdout
    case's verdict in order (`run_sandboxed_io`; empty for `run_sandboxed`).
    """

    score: float
    reason: str
    stdout: str
    stderr: str
    exit_code: int | None
    isolation: tuple[str, ...]
    warnings: tuple[str, ...]
    cases: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------------ the parent


def run_sandboxed(
    code: str,
    tests: str | Sequence[str] = "",
    *,
    timeout_s: float = 5.0,
    cpu_s: float = 5.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_output_bytes: int = 64 << 10,
    python: str | None = None,
    require_isolation: bool = False,
    strict_equality: bool = True,
    packages: Sequence[str] = (),
) -> SandboxResult:
    """Run `code` then `tests` in a sandbox (see the module docstring); score 1.0 if the tests ran to their end.

    `tests`: a Python snippet, or a list of snippets (e.g. one `assert` each) joined by newlines, run after `code`
    in the same namespace. `timeout_s`: wall-clock limit (interpreter start included); `cpu_s`: CPU seconds
    (rounded up); `memory_mb`: address-space limit of each process; `max_procs`: processes the program may run at
    once, itself included; `max_output_bytes`: per stream, more kills the program ("output limit exceeded").
    `python`: the interpreter for the program (default: this one, or a system python3 when this one is not usable
    by the unprivileged uid). `require_isolation`: raise SandboxError instead of running with a layer missing.
    `strict_equality`: the tests' `==`, `!=`, `in` and `not in` count a value whose equality (or membership) the
    program defines as unequal to a plain one (the always-equal object hack; `_HARNESS`); false: Python's own
    comparisons. `packages`: top-level modules of the trainer's environment that the program and the tests may
    import besides the standard library, e.g. ("numpy", "pandas") (`package_dirs`: their folders go on the program's
    sys.path; a name that is not installed, a stdlib module or not a top-level name is a ValueError). Tests that are
    not valid Python raise ValueError (no program could pass them).
    """
    check_limits(timeout_s, cpu_s, memory_mb, max_procs, max_output_bytes)
    path = package_dirs(packages, python)
    if not sys.platform.startswith("linux"):
        raise SandboxError(f"the sandbox needs Linux (namespaces, rlimits, prctl); this is {sys.platform}")
    if not isinstance(code, str):
        raise TypeError(f"run_sandboxed: code must be a str, got {type(code).__name__}")
    tests_source = _tests_source(tests)
    try:
        compile(tests_source, "tests.py", "exec", dont_inherit=True)
    except SyntaxError as e:  # the row's fault, not the program's: no program could pass them
        raise ValueError(f"run_sandboxed: the tests are not valid Python ({e.msg}, line {e.lineno})") from None
    token = secrets.token_hex(16)
    harness = (_HARNESS.replace("STRICT_EQUALITY = True", f"STRICT_EQUALITY = {bool(strict_equality)}")
               .replace("PACKAGE_PATH = []", f"PACKAGE_PATH = {list(path)!r}"))
    files = {"main.py": harness, "solution.py": f"{code}\n", "tests.py": f"{tests_source}\n"}
    if "pytest" in code or "test" in tests_source.lower():  # what the harness may load it for (`_pytest` there)
        files.update(_pytest_shim())
    run = _call(files, token, timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_procs=max_procs,
                max_output=max_output_bytes, python=python, require_isolation=require_isolation)
    passed = run.stopped is None and run.exit_code == 0 and token.encode() in run.data["result"].split(b"\n")
    stdout, stderr = (run.data[name][:max_output_bytes].decode("utf-8", "replace") for name in ("stdout", "stderr"))
    reason = "passed" if passed else _failure_reason(run.stopped, run.exit_code, stderr)
    return SandboxResult(1.0 if passed else 0.0, reason, stdout, stderr, run.exit_code, run.isolation, run.warnings)


@functools.cache
def _pytest_shim() -> dict[str, str | bytes]:
    """The sandbox's pytest (`gspo.sandbox.pytest_shim`), which the harness runs when the tests use pytest: its source
    and its code compiled by this interpreter (marshal, after the magic number), which the harness loads instead when
    it runs the same Python version."""
    import importlib.util

    source = Path(__file__).with_name("pytest_shim.py").read_text(encoding="utf-8")
    code = compile(source, "pytest_shim.py", "exec", dont_inherit=True)
    return {"pytest_shim.py": source, "pytest_shim.pyc": importlib.util.MAGIC_NUMBER + marshal.dumps(code)}


def check_limits(timeout_s: float, cpu_s: float, memory_mb: int, max_procs: int, max_output_bytes: int) -> None:
    """Raise ValueError unless these are limits `run_sandboxed` accepts (for callers that validate them early)."""
    for name, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"run_sandboxed: {name} must be a finite number > 0, got {value!r}")
    for name, value, low in (("memory_mb", memory_mb, 16), ("max_procs", max_procs, 1),
                             ("max_output_bytes", max_output_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"run_sandboxed: {name} must be an int >= {low}, got {value!r}")


def package_dirs(packages: Sequence[str], python: str | None = None) -> tuple[str, ...]:
    """The folders that `run_sandboxed(packages=...)` puts on the program's sys.path (after the standard library) so
    that it can import `packages`, top-level modules installed in the trainer's environment: each one's folder as
    this interpreter finds it (`importlib.util.find_spec`), e.g. the virtual environment's site-packages. A folder
    brings every module in it, not only those named (which is also how a package's dependencies installed next to it,
    pandas' numpy, come along; one installed elsewhere must be named too): the sandbox contains the program by its
    namespaces, limits and read-only filesystem, not by what it may import (it can read the filesystem, site-packages
    included, anyway). No .pth file of those folders is processed (the program runs without `site`).

    Checked once per `packages` and interpreter (cached), before any program runs: ValueError for a name that is not
    a top-level module name ("numpy.linalg"), is in the standard library ("os"), or is not installed here; for a
    folder that the program cannot read (the trainer is root and the program runs as an unprivileged uid: the folder
    and those above it must be readable by all users); and for extension modules that the sandbox's interpreter
    (`python`, or the fallback python3 that `run_sandboxed` uses as root when this one is in a closed folder) cannot
    load because it is another Python version than this one (numpy built for 3.11 under a 3.12: every program that
    imports it would fail with an ImportError). Pure-Python packages are not checked against that interpreter."""
    if isinstance(packages, str) or not isinstance(packages, Sequence) or not all(isinstance(p, str) for p in packages):
        raise TypeError(f"packages must be a list of top-level module names, e.g. ['numpy'], got {packages!r:.80}")
    if not packages:
        return ()
    return _package_dirs(tuple(packages), python, os.geteuid() == 0)


@functools.lru_cache(maxsize=64)
def _package_dirs(packages: tuple[str, ...], python: str | None, root: bool) -> tuple[str, ...]:
    import importlib.util

    folders: dict[str, None] = {}
    places: dict[str, list[str]] = {}  # name: where its files are (a package's folder, a module's file)
    for name in packages:
        if not name.isidentifier():
            top = name.split(".")[0]
            hint = f" (give {top!r})" if "." in name and top.isidentifier() else ""
            raise ValueError(f"packages: {name!r} is not a top-level module name{hint}")
        if name in sys.stdlib_module_names or name in sys.builtin_module_names:
            raise ValueError(f"packages: {name!r} is in the standard library, which the program can import anyway")
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:  # a package (a namespace package may have several)
            places[name] = [os.path.abspath(folder) for folder in spec.submodule_search_locations]
        elif spec is not None and spec.has_location and spec.origin:
            places[name] = [os.path.abspath(spec.origin)]
        else:
            raise ValueError(f"packages: no module {name!r} is installed in the trainer's environment "
                             f"({sys.executable})")
        for place in places[name]:
            folders.setdefault(os.path.dirname(place), None)
    if root:  # the program runs as an unprivileged uid, with no groups: only the "other" permission bits count
        for name, paths in places.items():
            closed = next((p for p in [*folders, *paths] if not _readable_by_others(p)), None)
            if closed is not None:
                raise ValueError(f"packages: {name!r} is in a folder that the sandboxed program cannot read: "
                                 f"{closed} (the trainer runs as root and the program as an unprivileged uid; that "
                                 "folder and every folder above it must be readable by all users, chmod o+rx)")
    interpreter = python or _default_python(root)
    if os.path.realpath(interpreter) != os.path.realpath(sys.executable):
        loads = _extension_suffixes(interpreter)
        for name, paths in places.items():
            built = _foreign_extension(paths, loads) if loads is not None else None
            if built is not None:
                raise ValueError(
                    f"packages: {name!r} has extension modules built for this Python ({sys.version.split()[0]}: "
                    f"{os.path.basename(built)}), which the sandbox's interpreter {interpreter} cannot load (it "
                    f"loads {loads[0]}): every program that imports {name!r} would fail. Run the programs with an "
                    "interpreter of this Python version (python=...; as root, one that all users can run) or "
                    "install the packages for that one")
    return tuple(folders)


def _readable_by_others(path: str) -> bool:
    """Whether a user with no relation to the owners can read `path` (a folder: list and enter it): it is o+r
    (o+rx for a folder) and every folder above it o+x."""
    target = Path(path)
    try:
        mode = target.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        return mode & need == need and all(parent.stat().st_mode & stat.S_IXOTH for parent in target.parents)
    except OSError:
        return False


@functools.cache
def _extension_suffixes(interpreter: str) -> tuple[str, ...] | None:
    """The file suffixes of the extension modules that `interpreter` loads ('.cpython-311-x86_64-linux-gnu.so',
    '.abi3.so', '.so'), or None when it cannot be run (the sandbox call then says so)."""
    probe = "import importlib.machinery as m; print('\\n'.join(m.EXTENSION_SUFFIXES))"
    try:
        done = subprocess.run([interpreter, "-I", "-S", "-B", "-c", probe], capture_output=True, text=True,
                              timeout=60, env={"PATH": _SAFE_PATH, "LANG": "C.UTF-8"})
    except (OSError, subprocess.SubprocessError):
        return None
    suffixes = tuple(done.stdout.split())
    return suffixes if done.returncode == 0 and suffixes else None


def _foreign_extension(paths: Sequence[str], loads: Sequence[str]) -> str | None:
    """The first extension module under `paths` (a package's folders, or a module's file) that this interpreter
    loads but an interpreter that loads `loads` (`_extension_suffixes`) does not; None."""
    import importlib.machinery

    ours = importlib.machinery.EXTENSION_SUFFIXES  # most specific first, as the import system tries them
    for place in paths:
        files = ([place] if os.path.isfile(place) else
                 (os.path.join(folder, f) for folder, _, names in os.walk(place) for f in names))
        for file in files:
            suffix = next((s for s in ours if file.endswith(s)), None)
            if suffix is not None and suffix not in loads:
                return file
    return None


def _tests_source(tests: str | Sequence[str]) -> str:
    if isinstance(tests, str):
        return tests
    if isinstance(tests, Sequence) and all(isinstance(t, str) for t in tests):
        return "\n".join(tests)
    raise TypeError(f"run_sandboxed: tests must be a str or a list of str, got {tests!r:.80}")


@contextlib.contextmanager
def _own_ids() -> Iterator[tuple[int, int]]:
    """A uid (and the same number as gid) for one call as root, held until the block ends: drawn at random from
    `_UID_BASE`'s block, skipping any that an account has, and reserved machine-wide by binding an abstract Unix
    socket named after it (released by the kernel even if this process dies), so that no other call running at the
    same time (other threads, other trainers, pytest workers) gets it. RLIMIT_NPROC then counts this call's
    processes alone. All of them are gone before the block ends (see `_stop`), so the uid can be reused after."""
    for _ in range(100):
        uid = _UID_BASE + secrets.randbelow(_UID_COUNT)
        try:
            pwd.getpwuid(uid)
            continue  # an account has it
        except KeyError:
            pass
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0gspo-sandbox-uid-{uid}")
        except OSError:  # another call holds it (EADDRINUSE)
            lock.close()
            continue
        with lock:
            yield uid, uid
        return
    raise SandboxError("could not reserve a uid for the sandbox (100 tries)")


def _usable_by_others(path: str) -> bool:
    """Whether a user with no relation to the owners can execute `path`: it and every folder above it are o+x."""
    target = Path(path)
    try:
        if not target.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in target.parents)
    except OSError:
        return False


def _default_python(dropping_privileges: bool) -> str:
    """This interpreter, or (when the program runs as an unprivileged uid and cannot reach it) a system python3."""
    own = os.path.realpath(sys.executable)
    if not dropping_privileges:
        return own
    for candidate in (own, *_FALLBACK_PYTHONS):
        if os.path.isfile(candidate) and _usable_by_others(os.path.realpath(candidate)):
            return candidate
    raise SandboxError(
        f"no Python interpreter that the unprivileged uid can run: {own} (this one) is in a folder closed to other "
        f"users and none of {list(_FALLBACK_PYTHONS)} is usable; pass python=... (any python3 with its standard "
        "library readable by all users)"
    )


@dataclass(frozen=True)
class _Run:
    """What one launch left: the streams as collected (`data`: stdout, stderr, status, result), why the collection
    stopped early (None: every stream reached EOF), the program's exit status and the launcher's isolation report."""

    data: dict[str, bytes]
    stopped: str | None
    exit_code: int | None
    isolation: tuple[str, ...]
    warnings: tuple[str, ...]


def _call(
    files: dict[str, str | bytes], token: str, *, timeout_s: float, cpu_s: float, memory_mb: int, max_procs: int,
    max_output: int, python: str | None, require_isolation: bool,
    on_result: Callable[[bytes], str | None] | None = None,
) -> _Run:
    """Write `files` (main.py, the entry point, and what it reads) into a fresh private folder and run main.py there
    in the sandbox, `token` on its stdin; the folder is removed afterwards."""
    root = os.geteuid() == 0
    interpreter = python or _default_python(root)
    with _own_ids() if root else contextlib.nullcontext() as drop_to:  # as root: a uid of this call's own
        workdir = Path(tempfile.mkdtemp(prefix="gspo-sandbox-"))
        try:
            for name, text in files.items():
                if isinstance(text, bytes):
                    (workdir / name).write_bytes(text)
                else:
                    (workdir / name).write_text(text, encoding="utf-8")
            if drop_to is not None:
                os.chown(workdir, *drop_to)
            spec = {
                "python": interpreter,
                "workdir": str(workdir),
                "uid_gid": drop_to,
                "cpu_s": math.ceil(cpu_s),
                "memory_bytes": int(memory_mb) << 20,
                "max_procs": int(max_procs),
                "env": {"PATH": _SAFE_PATH, "LANG": "C.UTF-8", "HOME": str(workdir), "TMPDIR": str(workdir),
                        **_ONE_THREAD, "PYTHONHASHSEED": _HASH_SEED},
            }
            return _run(spec, token, timeout_s, max_output, require_isolation, on_result)
        finally:
            _remove_tree(workdir)


def _run(spec: dict[str, Any], token: str, timeout_s: float, max_output: int, require_isolation: bool,
         on_result: Callable[[bytes], str | None] | None) -> _Run:
    """Start the launcher, feed the token, collect output and reports until EOF or a limit (or `on_result`'s
    reason to stop), kill what is left."""
    status_r, status_w = os.pipe()
    result_r, result_w = os.pipe()
    spec = {**spec, "status_fd": status_w, "result_fd": result_w}
    try:
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-B", os.path.abspath(__file__), "--launch",
             json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=spec["workdir"],
            env=spec["env"], start_new_session=True, pass_fds=(status_w, result_w),
        )
    except BaseException:
        for fd in (status_r, status_w, result_r, result_w):
            os.close(fd)
        raise
    os.close(status_w)
    os.close(result_w)
    streams = {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(), "status": status_r,
               "result": result_r}
    ended = False
    try:
        with contextlib.suppress(OSError):  # the launcher is already gone; its report says why
            proc.stdin.write(token.encode() + b"\n")
            proc.stdin.close()
        data, stopped = _collect(streams, time.monotonic() + timeout_s, max_output, on_result)
        ended = stopped is None
    finally:
        _stop(proc, ended)
        for handle in (proc.stdout, proc.stderr):
            handle.close()
        data_status = _drain(status_r)  # after a timeout: the launcher's report of what it set up
        os.close(status_r)
        os.close(result_r)
    data["status"] = (data["status"] + data_status)[:_MAX_REPORT_BYTES]
    reports = _parse_reports(data["status"])
    if "setup_error" in reports:
        raise SandboxError(f"the sandbox could not start the program: {reports['setup_error']}")
    if "isolation" not in reports and stopped is None:  # the launcher died before saying what it set up
        tail = data["stderr"][-2000:].decode("utf-8", "replace")
        raise SandboxError(f"the sandbox launcher failed (exit {proc.returncode}) before starting the program: {tail}")
    isolation, warnings = tuple(reports.get("isolation", ())), tuple(reports.get("warnings", ()))
    if require_isolation and warnings:
        raise SandboxError("the sandbox is missing isolation layers: " + "; ".join(warnings))
    exit_code = None if stopped else reports.get("exit", reports.get("init_exit", proc.returncode))
    return _Run(data, stopped, exit_code, isolation, warnings)


def _collect(
    streams: dict[str, int], deadline: float, max_output: int, on_result: Callable[[bytes], str | None] | None = None,
) -> tuple[dict[str, bytes], str | None]:
    """Read every stream until all are at EOF (None), the deadline ("timeout") or an overflow of stdout or stderr
    ("output limit exceeded"). The reports are kept up to _MAX_REPORT_BYTES. With `on_result`, the result stream's
    chunks go to it instead (kept nowhere), and a reason it returns stops the collection (its reason)."""
    data = {name: bytearray() for name in streams}
    names = {fd: name for name, fd in streams.items()}
    with selectors.DefaultSelector() as selector:
        for fd in names:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {k: bytes(v) for k, v in data.items()}, "timeout"
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                name = names[key.fd]
                if name == "result" and on_result is not None:
                    reason = on_result(chunk)
                    if reason is not None:
                        return {k: bytes(v) for k, v in data.items()}, reason
                    continue
                limit = max_output if name in ("stdout", "stderr") else _MAX_REPORT_BYTES
                data[name] += chunk[: max(0, limit + 1 - len(data[name]))]
                if len(data[name]) > limit:
                    if name in ("stdout", "stderr"):
                        return {k: bytes(v) for k, v in data.items()}, "output limit exceeded"
                    del data[name][limit:]
    return {k: bytes(v) for k, v in data.items()}, None


def _drain(fd: int) -> bytes:
    """What is left in a pipe whose writers are gone (or no longer write), without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            if sum(map(len, chunks)) > _MAX_REPORT_BYTES:
                break
    except BlockingIOError:
        pass
    return b"".join(chunks)


def _stop(proc: subprocess.Popen, ended: bool) -> None:
    """Make sure that nothing of the sandbox runs any more, then reap the launcher.

    A launcher that did not end by itself (timeout, output overflow, an interrupted caller) gets SIGTERM: it kills
    the sandbox's init, whose exit makes the kernel kill every process of the namespace, and returns once all are
    gone; SIGKILL to the whole process group is the fallback. The group is killed while the launcher is unreaped, so
    that its group id cannot have been reused by then."""
    if not ended:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGTERM)
    if not _wait_exited(proc.pid, 10.0):
        _kill_group(proc.pid)
    _kill_group(proc.pid)  # whatever is left in the group (only possible without a PID namespace)
    proc.wait()


def _wait_exited(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for the child `pid` to exit, without reaping it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        time.sleep(0.005)
    return False


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):  # nothing left in the group (ESRCH)
        os.killpg(pgid, signal.SIGKILL)


def _parse_reports(raw: bytes) -> dict[str, Any]:
    """Merge the launcher's JSON lines (only the launcher and the program's pre-exec setup write to this pipe)."""
    merged: dict[str, Any] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            for key, value in record.items():  # lists (isolation, warnings) accumulate; the rest is replaced
                merged[key] = merged.get(key, []) + value if isinstance(value, list) else value
    return merged


def _failure_reason(stopped: str | None, exit_code: int | None, stderr: str) -> str:
    if stopped is not None:
        return stopped
    if exit_code is None:
        return "no exit status"
    if exit_code < 0:
        return "cpu time limit" if -exit_code == signal.SIGXCPU else f"killed by signal {-exit_code}"
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if exit_code == 2 and last.startswith("gspo sandbox: tests error: "):  # the pytest runner's: a fixture missing
        return last.removeprefix("gspo sandbox: ")
    exception = last.split(":", 1)[0]  # numpy's `numpy._core._exceptions._ArrayMemoryError: Unable to allocate ...`
    if (exception.endswith("MemoryError") and " " not in exception) or "Cannot allocate memory" in last or (
            "failed to map segment from shared object" in last):  # an extension module that did not fit
        return "memory"
    if last.startswith("AssertionError"):
        return "tests failed"
    if exit_code == 0:
        return "exited before the tests finished"
    return f"exit code {exit_code}"


def _remove_tree(path: Path) -> None:
    """Delete the call's folder even if the program made parts of it unreadable or unwritable."""
    if not path.exists():
        return
    for folder, dirs, _ in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- the launcher


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> int:
    """unshare(2); returns 0 or the errno."""
    libc = _libc()
    if libc.unshare(ctypes.c_int(flags)) == 0:
        return 0
    return ctypes.get_errno()


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _child(report: Callable[..., None], body: Callable[[], None]) -> None:
    """In a forked child: run `body`, which execs or exits and only returns by raising; the failure is then reported
    as a setup error and the child exits 127, so it never runs on into the parent's code."""
    try:
        body()
    except BaseException as exc:
        try:
            report(setup_error=f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(127)


def _launch(spec: dict[str, Any]) -> int:
    """The launcher's main: namespaces, then fork the program's process, wait for it and report its exit status."""
    import fcntl

    # Move the report pipes out of the way of fd 3 (the harness's result fd), close-on-exec.
    status_fd = fcntl.fcntl(spec["status_fd"], fcntl.F_DUPFD_CLOEXEC, 10)
    result_fd = fcntl.fcntl(spec["result_fd"], fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(spec["status_fd"])
    os.close(spec["result_fd"])

    def report(**record: Any) -> None:
        os.write(status_fd, (json.dumps(record) + "\n").encode())

    dropping = spec["uid_gid"] is not None
    own_uid = os.getuid()  # before a user namespace makes it read as the overflow uid
    flags = _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWNS | (0 if dropping else _CLONE_NEWUSER)
    error = _unshare(flags)
    isolation = ["rlimits (cpu, memory, files, core)", "clean environment", "private working folder"]
    warnings = []
    if error == 0:
        isolation += ["network namespace (no network)", "PID namespace"]
    else:
        warnings.append(f"no network or PID namespace (unshare: {os.strerror(error)}): the program can use the "
                        "network, and processes that leave its process group may outlive it")
    if dropping:
        isolation += [f"uid {spec['uid_gid'][0]}", f"process limit {spec['max_procs']}"]
    elif error == 0:  # not root: the user namespace stands in for the uid drop (its processes are its own)
        isolation += [f"user namespace (uid {own_uid}, no root to drop)",
                      f"process limit {spec['max_procs']} (per user namespace)"]
    else:
        warnings += [f"not root and no user namespace: the program runs as the trainer's uid {own_uid} and can "
                     "write the trainer's files and signal its processes",
                     "no process limit (RLIMIT_NPROC would count every process of the trainer's user)"]
    report(isolation=isolation, warnings=warnings)
    limit_procs = dropping or error == 0
    spec = {**spec, "namespaces": error == 0}

    pid = os.fork()
    if pid == 0:
        _child(report, lambda: _init_process(spec, result_fd, limit_procs, report))
    os.close(result_fd)
    # the trainer's SIGTERM (timeout): kill the init, which takes the whole namespace with it; the wait below returns
    # once all of it is gone
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    report(init_exit=os.waitstatus_to_exitcode(status))
    return 0


def _read_only_filesystem(workdir: str, report: Callable[..., None]) -> None:
    """In the sandbox's private mount namespace, remount every mount read-only except the working folder (bound
    onto itself first, so that it stays writable): the program can write nowhere else, whatever its uid may."""
    libc = _libc()
    if libc.mount(b"none", b"/", None, ctypes.c_ulong(_MS_REC | _MS_PRIVATE), None) != 0:  # nothing leaks out
        report(warnings=[f"the filesystem stays writable (mount: {os.strerror(ctypes.get_errno())})"])
        return
    mounts = []
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            flags = sum(_MOUNT_OPTION_FLAGS.get(option, 0) for option in fields[5].split(","))
            mounts.append((point, flags))
    folder = workdir.encode()
    failed = []
    if libc.mount(folder, folder, None, ctypes.c_ulong(_MS_BIND | _MS_REC), None) != 0:
        failed.append(f"{workdir} ({os.strerror(ctypes.get_errno())})")
    for point, flags in sorted(mounts):
        options = ctypes.c_ulong(_MS_BIND | _MS_REMOUNT | _MS_RDONLY | flags)
        if libc.mount(None, point.encode(), None, options, None) != 0:
            failed.append(f"{point} ({os.strerror(ctypes.get_errno())})")
    if failed:
        report(warnings=[f"not every mount could be made read-only, the program may write there: {', '.join(failed)}"])
    else:
        report(isolation=["read-only filesystem except the working folder"])


def _mount_own_proc(report: Callable[..., None]) -> None:
    """Mount a /proc of the sandbox's own PID namespace over the host's (in its private mount namespace), so that
    the program cannot list the host's processes nor read their command lines or environments."""
    libc = _libc()
    if libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV | _MS_NOEXEC), None) == 0:
        report(isolation=["own /proc (host processes hidden)"])
        return
    report(warnings=[f"the host's /proc stays visible (mount: {os.strerror(ctypes.get_errno())}): the program can "
                     "list host processes and read their command lines (and, without root, the environments of the "
                     "trainer's user's processes)"])


def _init_process(spec: dict[str, Any], result_fd: int, limit_procs: bool, report: Callable[..., None]) -> None:
    """The sandbox's first process (PID 1 of its namespace): limits and privilege drop, which its children inherit,
    then fork the program, reap every process that ends (orphans come to PID 1), and report the program's exit
    status. The program is not PID 1 itself, so signals behave for it as usual; and when this process exits, the
    kernel kills whatever the program left running in the namespace. Only returns by raising."""
    import resource

    if spec["namespaces"]:
        _read_only_filesystem(spec["workdir"], report)
        _mount_own_proc(report)
    cpu = spec["cpu_s"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_MAX_FILE_BYTES, _MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_MAX_OPEN_FILES, _MAX_OPEN_FILES))
    if limit_procs:  # this process counts too, and in a user namespace (no root) so does the launcher
        procs = spec["max_procs"] + (1 if spec["uid_gid"] is not None else 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
    if spec["uid_gid"] is not None:
        uid, gid = spec["uid_gid"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"could not drop privileges to uid {uid}")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it: dies with the launcher

    program = os.fork()
    if program == 0:
        def run_program() -> None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # not inherited across fork
            os.dup2(result_fd, _RESULT_FD)  # inheritable: the harness writes its token here
            os.chdir(spec["workdir"])
            python = spec["python"]
            os.execve(python, [python, *_FLAGS, "main.py"], spec["env"])

        _child(report, run_program)
    os.close(result_fd)
    while True:
        pid, status = os.wait()
        if pid == program:
            report(exit=os.waitstatus_to_exitcode(status))
            os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["--launch"]:
    raise SystemExit(_launch(json.loads(sys.argv[2])))

"""The sandbox for model-written code and the `code` reward: correct and wrong programs, and hostile ones (infinite
loop, CPU burner, fork bomb, memory hog, network, files outside its folder, the parent's secrets, signals to the
parent), each of which must score 0 with a reason, get nothing out, and leave no process behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import numpy_for_the_sandbox
from gspo.rewards import REWARDS, RewardRunner
from gspo.rewards.code import code_reward, extract_code, make_code_reward
from gspo.sandbox import (
    IOCases,
    SandboxError,
    outputs_match,
    parse_io_cases,
    row_fn_name,
    run_sandboxed,
    run_sandboxed_io,
    values_match,
)
from gspo.sandbox import cases as sandbox_cases
from gspo.sandbox import process as sandbox_module  # the implementation: its file is what the launcher runs

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox uses Linux namespaces and rlimits")

ROOT = os.geteuid() == 0
FAST = {"timeout_s": 5.0, "cpu_s": 5.0, "memory_mb": 256, "max_procs": 8}


def processes_of(uid: int) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.add(int(entry.name))
            except FileNotFoundError:
                pass
    return pids


@pytest.fixture(autouse=True)
def sandbox_uids(monkeypatch):
    """Every test must leave no sandboxed process running. As root every sandbox call runs under a uid of its own
    (`sandbox._own_ids`), recorded here: the check looks at the processes of this test's uids only, so sandboxes of
    tests running at the same time (pytest -n) never count. Yields the list of those uids, in call order."""
    used: list[int] = []
    own_ids = sandbox_module._own_ids

    @contextlib.contextmanager
    def recording():
        with own_ids() as ids:
            used.append(ids[0])
            yield ids

    monkeypatch.setattr(sandbox_module, "_own_ids", recording)
    yield used
    stray = {pid for uid in used for pid in processes_of(uid)}
    assert not stray, f"processes left running after the test: {sorted(stray)}"


def assert_contained(result) -> None:
    assert not result.warnings, result.warnings
    for layer in ("network namespace (no network)", "PID namespace", "read-only filesystem except the working folder",
                  "own /proc (host processes hidden)"):
        assert layer in result.isolation, (layer, result.isolation)


# ------------------------------------------------------------------------------------------------ honest programs


def test_a_correct_program_passes_and_a_wrong_one_fails_the_tests(sandbox_uids):
    code = "def add(a, b):\n    return a + b\n"
    passed = run_sandboxed(code, ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"], **FAST)
    assert (passed.score, passed.reason, passed.exit_code) == (1.0, "passed", 0)
    assert_contained(passed)
    if ROOT:  # a uid of the call's own, which no account has
        (uid,) = sandbox_uids
        assert f"uid {uid}" in passed.isolation and "process limit 8" in passed.isolation
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)

    wrong = run_sandboxed("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5", **FAST)
    assert (wrong.score, wrong.reason, wrong.exit_code) == (0.0, "tests failed", 1)
    assert "AssertionError" in wrong.stderr


def test_errors_and_early_exits_score_zero_with_a_reason():
    assert run_sandboxed("def f(:\n", "", **FAST).reason == "exit code 1"  # a syntax error
    # exiting with status 0 before the tests ran is not a pass (a common reward hack)
    hack = run_sandboxed("import sys\nsys.exit(0)\n", "assert False", **FAST)
    assert (hack.score, hack.reason, hack.exit_code) == (0.0, "exited before the tests finished", 0)
    hack = run_sandboxed("import os\nos._exit(0)\n", "assert False", **FAST)
    assert (hack.score, hack.reason) == (0.0, "exited before the tests finished")


ALWAYS_EQUAL = ("class Yes:\n    def __eq__(self, other):\n        return True\n"
                "    def __ne__(self, other):\n        return False\n")


@pytest.mark.parametrize("returned", ["Yes()", "[Yes()]", "{'sum': Yes()}", "ANY", "inner()"])
def test_an_object_that_equals_anything_does_not_pass_the_tests(returned):
    """The always-equal hack: `add` returns an object whose == says True to anything (the program's own class, inside
    a container, a class it defines while the tests run, or unittest.mock.ANY). The tests' == finds it unequal to the
    plain expected value, and says why; with strict_equality off Python's comparison lets it pass, which is what the
    harness prevents."""
    inner = "def inner():\n    class Inner:\n        __eq__ = lambda self, other: True\n    return Inner()\n"
    code = f"from unittest.mock import ANY\n{ALWAYS_EQUAL}{inner}def add(a, b):\n    return {returned}\n"
    expected = {"Yes()": "5", "[Yes()]": "[5]", "{'sum': Yes()}": "{'sum': 5}", "ANY": "5", "inner()": "5"}[returned]
    hacked = run_sandboxed(code, f"assert add(2, 3) == {expected}", **FAST)
    assert (hacked.score, hacked.reason) == (0.0, "tests failed")
    assert "compared with a plain value: unequal" in hacked.stderr
    assert run_sandboxed(code, f"assert add(2, 3) == {expected}", strict_equality=False, **FAST).score == 1.0
    assert run_sandboxed(code, f"assert {expected} == add(2, 3)", **FAST).score == 0.0  # either side


CONTAINS_ANYTHING = "class Holds:\n    def __contains__(self, item):\n        return True\n"


@pytest.mark.parametrize(("returned", "tests"), [
    ("Yes()", "assert add(2, 3) in (5, 6)"),  # the always-equal object found in a plain tuple
    ("[Yes()]", "assert 5 in add(2, 3)"),  # a plain value found among the program's always-equal items
    ("Holds()", "assert 5 in add(2, 3)"),  # a container that says it holds anything
    ("Yes()", "assert not (add(2, 3) not in [5])"),
])
def test_membership_does_not_let_the_always_equal_hack_through(returned, tests):
    """`in` compares with == (or asks the container): the same hacks as with == pass `assert add(2, 3) in (5, 6)`
    unless the tests' `in` / `not in` are checked as their == is."""
    code = f"{ALWAYS_EQUAL}{CONTAINS_ANYTHING}def add(a, b):\n    return {returned}\n"
    hacked = run_sandboxed(code, tests, **FAST)
    assert (hacked.score, hacked.reason) == (0.0, "tests failed"), hacked.stderr
    assert "compared with a plain value: unequal" in hacked.stderr
    assert run_sandboxed(code, tests, strict_equality=False, **FAST).score == 1.0


def test_membership_of_plain_values_is_python_s():
    """`in` / `not in` on built-in containers, strings, dict keys, ranges, generators, the standard library's
    collections (their collections.abc mixins too: ChainMap's == was refused before), an Enum class, os.environ, a
    WeakSet and a container the tests define behave as Python's."""
    code = ("import enum, os, weakref\nfrom collections import ChainMap, Counter, UserList, deque\n"
            "def f():\n    return [1, (2, 3)], 'abc', {'k': 1}, Counter('ab')\n")
    tests = textwrap.dedent("""\
        items, text, table, counts = f()
        assert 1 in items and (2, 3) in items and 4 not in items and 1.0 in items
        assert "bc" in text and "x" not in text and "k" in table and 1 not in table and "a" in counts
        assert 5 in range(10) and 3 in (x for x in [3]) and 2 in deque([2]) and 1 in {1: 2}.keys()
        assert 1 in UserList([1]) and 1 in ChainMap({1: 2}) and "HOME" in os.environ and ChainMap({1: 2}) == {1: 2}
        class Color(enum.Enum):
            RED = 1
        pair = f
        assert Color.RED in Color and pair in weakref.WeakSet([pair])
        class Evens:
            def __contains__(self, n):
                return n % 2 == 0
        assert 4 in Evens() and 3 not in Evens()
        """)
    assert run_sandboxed(code, tests, **FAST).reason == "passed"


def test_plain_values_and_the_standard_librarys_compare_as_python_does():
    """What strict equality leaves alone: built-in types and their subclasses, the standard library's numbers and
    collections against plain values (Fraction == 0.5, Counter == dict), the program's own objects against each
    other (a dataclass), a comparison helper the tests define (an approx class), `!=`, comparisons inside a test
    helper (HumanEval's check(candidate)) and chains."""
    code = textwrap.dedent("""\
        from collections import Counter, OrderedDict, defaultdict, namedtuple
        from dataclasses import dataclass
        from fractions import Fraction
        Pair = namedtuple("Pair", "a b")
        class Big(int):
            pass
        @dataclass
        class Point:
            x: int
        def f():
            return Fraction(1, 2), Counter("aab"), OrderedDict(a=1), Pair(1, 2), defaultdict(int, a=1), Big(7)
        def double(x):
            return 2 * x
        """)
    tests = textwrap.dedent("""\
        half, counts, ordered, pair, default, big = f()
        assert half == 0.5 and counts == {"a": 2, "b": 1} and ordered == {"a": 1} and pair == (1, 2)
        assert default == {"a": 1} and big == 7 and [big, (pair,)] == [7, ((1, 2),)]
        assert Point(1) == Point(1) and Point(1) != Point(2) and half != 1
        assert 1 == True == 1.0
        class approx:
            def __init__(self, value):
                self.value = value
            def __eq__(self, other):
                return abs(other - self.value) < 1e-9
        assert 0.1 + 0.2 == approx(0.3) and [half] == [approx(0.5)]
        def check(candidate):
            assert candidate(2) == 4
            assert candidate(3) != 5
        check(double)
        """)
    assert run_sandboxed(code, tests, **FAST).reason == "passed"


def test_a_program_that_replaces_the_tests_comparison_fails():
    """A program that swaps the harness's comparison for one that always says True (after passing the first assert
    honestly) is caught when the tests end; invalid tests are a ValueError, not a score."""
    code = textwrap.dedent("""\
        calls = []
        def f(x):
            calls.append(x)
            if len(calls) == 1:
                globals()["__gspo_compare__"] = lambda *args: True
                return 4
            return 0
        """)
    result = run_sandboxed(code, ["assert f(2) == 4", "assert f(3) == 6"], **FAST)
    assert (result.score, result.reason) == (0.0, "exit code 1")
    assert "replaced the tests' comparison" in result.stderr
    with pytest.raises(ValueError, match="tests are not valid Python"):
        run_sandboxed("def f():\n    return 1\n", "assert f( == 1", **FAST)


def test_the_program_sees_a_clean_environment_and_closed_stdin(monkeypatch):
    monkeypatch.setenv("GSPO_TEST_SECRET", "hunter2-secret-value")
    code = (
        "import os, sys\n"
        "print(sorted(os.environ))\n"
        "print(open('/proc/self/environ', 'rb').read())\n"
        "for pid in os.listdir('/proc'):\n"  # every process the program can see
        "    if pid.isdigit():\n"
        "        try:\n"
        "            print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError as e:\n"
        "            print(pid, e)\n"
        f"for pid in ({os.getpid()}, {os.getppid()}):\n"  # this test's process and its parent, by number
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(pid, e)\n"
        "print('stdin', repr(sys.stdin.read()))\n"
    )
    result = run_sandboxed(code, "", **FAST)
    assert result.reason == "passed", result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    assert ("['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'PYTHONHASHSEED', "
            "'TMPDIR']" in result.stdout)
    assert "stdin ''" in result.stdout


# ----------------------------------------------------------------------------------------------- hostile programs


def test_an_infinite_loop_is_stopped_at_the_wall_clock_limit():
    result = run_sandboxed("while True:\n    pass\n", "", timeout_s=1.0, cpu_s=60, memory_mb=256, max_procs=8)
    assert (result.score, result.reason, result.exit_code) == (0.0, "timeout", None)
    assert_contained(result)  # the launcher's report is read even after the kill


def test_a_sleeping_program_is_stopped_at_the_wall_clock_limit():
    result = run_sandboxed("import time\ntime.sleep(600)\n", "", timeout_s=1.0, cpu_s=60, memory_mb=256, max_procs=8)
    assert (result.score, result.reason) == (0.0, "timeout")


def test_a_cpu_burner_is_stopped_at_the_cpu_limit():
    result = run_sandboxed("while True:\n    pass\n", "", timeout_s=60, cpu_s=1, memory_mb=256, max_procs=8)
    assert (result.score, result.reason, result.exit_code) == (0.0, "cpu time limit", -signal.SIGXCPU)


def test_a_memory_hog_fails_with_memory():
    result = run_sandboxed("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n", "", **FAST)
    assert (result.score, result.reason) == (0.0, "memory")


def test_concurrent_sandboxes_do_not_share_a_process_budget(sandbox_uids):
    """Sandboxes running at the same time (reward workers, several trainers) each get their whole `max_procs`: two
    that hold all their processes keep no third one from starting (as root, each runs under a uid of its own; under
    one shared uid the process limit would count all of them together)."""
    hog = ("import os, time\n"
           f"for _ in range({FAST['max_procs'] - 1}):\n"
           "    if os.fork() == 0:\n"
           "        time.sleep(4)\n"
           "        os._exit(0)\n"
           "time.sleep(3)\n")

    def run(code: str, delay: float):
        time.sleep(delay)
        return run_sandboxed(code, "assert True", **{**FAST, "timeout_s": 20.0})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # the third starts while the hogs hold their processes
        futures = [pool.submit(run, hog, 0.0), pool.submit(run, hog, 0.0), pool.submit(run, "x = 1\n", 1.5)]
        results = [f.result() for f in futures]
    assert [r.reason for r in results] == ["passed"] * 3, [r.stderr[-500:] for r in results]
    if ROOT:
        assert len(set(sandbox_uids)) == 3


def test_a_fork_bomb_is_capped_and_its_daemonised_children_do_not_survive():
    """Children leave the process group and the session (setsid) and sleep: the PID namespace still ends them."""
    code = (
        "import os, time\n"
        "forks = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "            time.sleep(120)\n"
        "            os._exit(0)\n"
        "        forks += 1\n"
        "except OSError as e:\n"
        "    print('forks', forks, 'errno', e.errno, flush=True)\n"
        "raise SystemExit(3)\n"
    )
    result = run_sandboxed(code, "", **FAST)
    assert (result.score, result.reason) == (0.0, "exit code 3"), result.stderr
    forks = int(result.stdout.split()[1])
    assert forks == FAST["max_procs"] - 1  # the program itself counts: capped at max_procs processes
    assert "errno 11" in result.stdout  # EAGAIN
    # (the autouse fixture checks that none of the sleeping children is still alive)


def test_network_connections_go_nowhere():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"for address in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n"
            "        socket.create_connection(address, timeout=1).close()\n"
            "        print('CONNECTED', address)\n"
            "    except OSError as e:\n"
            "        print('blocked', address, e)\n"
            "try:\n"
            "    socket.getaddrinfo('example.com', 80)\n"
            "    print('RESOLVED')\n"
            "except OSError as e:\n"
            "    print('no dns', e)\n"
        )
        result = run_sandboxed(code, "", **FAST)
        assert result.reason == "passed", result.stderr
        assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
        assert result.stdout.count("blocked") == 3
        with pytest.raises(BlockingIOError):  # nobody knocked on the test's own port
            listener.accept()


def test_files_outside_the_working_folder_cannot_be_written(tmp_path):
    outside = Path(tempfile.mkdtemp(prefix="gspo-test-victim-"))
    try:
        outside.chmod(0o777)  # even a world-writable folder is out of reach
        victim = outside / "victim.txt"
        victim.write_text("original")
        victim.chmod(0o666)
        escape = outside / "escape.txt"
        code = (
            f"for path, mode in [({str(victim)!r}, 'a'), ({str(escape)!r}, 'w'), ('/tmp/gspo-escape.txt', 'w')]:\n"
            "    try:\n"
            "        open(path, mode).write('pwned')\n"
            "        print('WROTE', path)\n"
            "    except OSError as e:\n"
            "        print('denied', path, e)\n"
            "open('inside.txt', 'w').write('fine')\n"  # its own folder is writable
            "print(open('inside.txt').read())\n"
        )
        result = run_sandboxed(code, "", **FAST)
        assert result.reason == "passed", result.stderr
        assert "WROTE" not in result.stdout and result.stdout.count("denied") == 3 and "fine" in result.stdout
        assert victim.read_text() == "original" and not escape.exists() and not Path("/tmp/gspo-escape.txt").exists()
    finally:
        shutil.rmtree(outside)


def test_signals_to_the_parent_and_its_group_hurt_nobody_but_the_program():
    me = os.getpid()
    code = (
        "import os, signal\n"
        f"for target in ({me}, os.getppid(), -1):\n"  # this test by pid, the sandbox's init, everything it may
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('sent', target, flush=True)\n"
        "    except OSError as e:\n"
        "        print('refused', target, e, flush=True)\n"
        "os.killpg(os.getpgid(0), signal.SIGKILL)\n"  # its own process group: the program itself dies
        "print('still here')\n"
    )
    result = run_sandboxed(code, "", **FAST)
    assert (result.score, result.reason, result.exit_code) == (0.0, "killed by signal 9", -9)
    assert f"refused {me}" in result.stdout  # no such process in its namespace
    assert "still here" not in result.stdout
    os.kill(me, 0)  # and this process is alive


def test_output_is_capped():
    result = run_sandboxed("while True:\n    print('x' * 1000)\n", "", **FAST, max_output_bytes=10_000)
    assert (result.score, result.reason) == (0.0, "output limit exceeded")
    assert len(result.stdout) <= 10_000


def test_an_unusable_interpreter_is_a_sandbox_error_not_a_score():
    with pytest.raises(SandboxError, match="could not start the program"):
        run_sandboxed("pass", "", **FAST, python="/nonexistent/python3")


def test_bad_arguments_are_rejected():
    for kwargs, match in [({"timeout_s": 0}, "timeout_s"), ({"cpu_s": float("inf")}, "cpu_s"),
                          ({"memory_mb": 8}, "memory_mb"), ({"max_procs": 0}, "max_procs")]:
        with pytest.raises(ValueError, match=match):
            run_sandboxed("pass", "", **{**FAST, **kwargs})
    with pytest.raises(TypeError, match="tests"):
        run_sandboxed("pass", [1, 2], **FAST)


@pytest.mark.skipif(not ROOT or not os.path.exists("/usr/bin/python3"), reason="needs root to become another user")
def test_without_root_the_user_namespace_contains_the_program(tmp_path):
    """The trainer as an ordinary user (here `nobody`): same containment through a user namespace, or, where that
    is unavailable, warnings that say what is missing — never a silent claim."""
    script = tmp_path / "as_user.py"
    script.write_text(
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('sandbox', 'sandbox.py')\n"
        "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(sandbox)\n"
        "ok = sandbox.run_sandboxed('def f():\\n    return 1\\n', 'assert f() == 1', timeout_s=5)\n"
        "net = sandbox.run_sandboxed(\"import socket\\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\", '',"
        " timeout_s=5)\n"
        "print(json.dumps([ok.reason, net.reason, ok.isolation, ok.warnings]))\n"
    )
    folder = Path(tempfile.mkdtemp(prefix="gspo-test-user-"))
    try:
        shutil.copy(script, folder / "as_user.py")
        # a copy of the module: `nobody` may not be able to read the checkout (e.g. a clone inside a 0700 mktemp dir)
        shutil.copy(sandbox_module.__file__, folder / "sandbox.py")
        folder.chmod(0o755)
        for name in ("as_user.py", "sandbox.py"):
            (folder / name).chmod(0o644)
        nobody = pwd.getpwnam("nobody")
        proc = subprocess.run(["/usr/bin/python3", "-I", str(folder / "as_user.py")], capture_output=True, text=True,
                              timeout=60, user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd=folder,
                              env={"PATH": "/usr/bin:/bin"})
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    import json

    ok_reason, net_reason, isolation, warnings = json.loads(proc.stdout)
    assert ok_reason == "passed"
    if warnings:  # no user namespaces on this machine: what is missing must be said
        assert any("no user namespace" in w or "namespace" in w for w in warnings), warnings
    else:
        assert net_reason == "exit code 1"  # the connection failed inside the sandbox
        assert any(layer.startswith("user namespace") for layer in isolation), isolation
        assert "read-only filesystem except the working folder" in isolation


# --------------------------------------------------------------------------------------------- stdin/stdout cases

SUM_CASES = {"inputs": ["2\n1 2\n", "3\n4 5 6\n", "1\n-7\n"], "outputs": ["3\n", "15\n", "-7\n"]}
SUM = "n = int(input())\nprint(sum(map(int, input().split())))\n"


def test_a_program_that_prints_every_cases_output_passes_and_a_wrong_one_stops_at_its_first_failure():
    passed = run_sandboxed_io(SUM, SUM_CASES, **FAST)
    assert (passed.score, passed.reason, passed.cases, passed.stdout) == (1.0, "passed", ("passed",) * 3, "-7\n")
    assert_contained(passed)
    # right for the first case only (it prints 3 whatever the input): all or nothing, and no case after the failing
    # one runs; with partial credit every case runs and the fraction passed is the score
    constant = run_sandboxed_io("print(3)", SUM_CASES, **FAST)
    assert (constant.score, constant.reason, constant.stdout) == (0.0, "case 1: wrong answer", "3\n")
    assert constant.cases == ("passed", "wrong answer")
    partial = run_sandboxed_io("print(3)", SUM_CASES, partial_credit=True, **FAST)
    assert partial.score == pytest.approx(1 / 3) and partial.cases == ("passed", "wrong answer", "wrong answer")


def test_a_program_that_reads_stdin_wrongly_fails():
    # one number per line where the case has them on one line: a ValueError, exit status 1
    per_line = run_sandboxed_io("n = int(input())\nprint(sum(int(input()) for _ in range(n)))\n", SUM_CASES, **FAST)
    assert (per_line.score, per_line.reason) == (0.0, "case 0: exit code 1") and "ValueError" in per_line.stderr
    # the count taken for one of the numbers: a wrong answer
    everything = run_sandboxed_io("import sys\nprint(sum(map(int, sys.stdin.read().split())))\n", SUM_CASES, **FAST)
    assert (everything.score, everything.reason) == (0.0, "case 0: wrong answer")


def test_trailing_whitespace_and_other_line_endings_are_tolerated():
    code = "n = int(input())\nprint(sum(map(int, input().split())), end='  \\r\\n\\n\\n')\n"
    assert run_sandboxed_io(code, SUM_CASES, float_tolerance=0, **FAST).reason == "passed"


def test_outputs_match_as_the_datasets_checkers_do():
    assert outputs_match("1 2  \r\n3\r\n\n\n", "1 2\n3") and outputs_match("", "\n")
    assert not outputs_match(" 1 2\n3", "1 2\n3")  # leading whitespace counts
    assert not outputs_match("1 2\n\n3", "1 2\n3")  # a blank line in between counts
    assert not outputs_match("12\n3", "1 2\n3") and not outputs_match("1 2\n3\n4", "1 2\n3")
    assert not outputs_match("yes", "YES")
    # a decimal token within the tolerance (absolute or relative), token by token; integers, words and nan exact
    assert outputs_match("0.3333333333 2\n", "0.333333 2\n") and outputs_match("1e-9", "0.0")
    assert outputs_match("2000000.0000001", "2.0e6")
    assert not outputs_match("0.3333333333 2\n", "0.333333 2\n", float_tolerance=0)
    assert not outputs_match("0.34", "0.333333") and not outputs_match("1000000.5", "1000000")
    assert not outputs_match("nan", "0.5") and not outputs_match("inf", "1e400")
    assert not outputs_match("0.333333 3", "0.333333 2") and not outputs_match("0.3333333  2", "0.333333 2")


def test_each_case_has_its_own_time_limit_and_the_call_its_own():
    code = "import time\nn = int(input())\nif n == 3:\n    time.sleep(60)\nprint(sum(map(int, input().split())))\n"
    start = time.monotonic()
    result = run_sandboxed_io(code, SUM_CASES, **{**FAST, "timeout_s": 20.0}, case_timeout_s=0.5, partial_credit=True)
    assert result.cases == ("passed", "timeout", "passed") and result.score == pytest.approx(2 / 3)
    assert result.reason == "case 1: timeout" and time.monotonic() - start < 5
    # each case in time, but not all of them in the call's time: "timeout", the cases reported before it count
    slow = "import time\ntime.sleep(0.6)\n" + SUM
    whole = run_sandboxed_io(slow, SUM_CASES, **{**FAST, "timeout_s": 1.0}, case_timeout_s=0.9, partial_credit=True)
    assert whole.reason == "timeout" and len(whole.cases) < 3 and set(whole.cases) <= {"passed"}
    assert whole.score == len(whole.cases) / 3


def test_a_program_cannot_write_to_the_result_pipe_nor_fake_a_report():
    """The driver reports each case on fd 3. The program tries every way to add a (fake) report there: fd 3 and
    whatever else it inherited (close_fds: nothing), the driver's /proc/<pid>/fd/3 and its memory (the driver is
    non-dumpable), and it prints a report on stdout and stderr. None reaches the pipe (a line there that is not the
    driver's would make it an "invalid report"): it is a wrong answer, as its stdout is."""
    code = textwrap.dedent("""\
        import json, os, sys
        fake = json.dumps({"token": "0" * 32, "case": 0, "exit": 0, "limit": None, "stdout": "Mwo="}) + "\\n"
        reached = []
        for fd in range(3, 64):
            try:
                os.write(fd, fake.encode())
                reached.append(fd)
            except OSError:
                pass
        driver = os.getppid()
        for name, flags in (("fd/3", os.O_WRONLY), ("mem", os.O_RDWR), ("environ", os.O_RDONLY)):
            try:
                fd = os.open(f"/proc/{driver}/{name}", flags)
            except OSError:
                continue
            reached.append(name)
            if name == "fd/3":
                os.write(fd, fake.encode())
            os.close(fd)
        print(fake, end="")
        sys.stderr.write(fake + f"reached {reached}\\n")
        """)
    result = run_sandboxed_io(code, SUM_CASES, **FAST)
    assert (result.score, result.reason, result.cases) == (0.0, "case 0: wrong answer", ("wrong answer",))
    assert "reached []" in result.stderr and result.stdout.startswith('{"token": "000')


def test_the_expected_outputs_never_enter_the_sandbox():
    """A program that searches whatever it can read for the expected outputs (its folder, its stdin, the command
    lines, environments and open files of every process it can see) finds nothing to print: they stay with the
    parent, which compares."""
    secret = f"expected-{secrets.token_hex(8)}"
    code = textwrap.dedent("""\
        import os, re, sys
        found = set(re.findall(rb"expected-[0-9a-f]{16}", sys.stdin.buffer.read()))
        paths = [os.path.join(folder, name) for folder, _, names in os.walk(".") for name in names]
        for pid in filter(str.isdigit, os.listdir("/proc")):
            paths += [f"/proc/{pid}/cmdline", f"/proc/{pid}/environ"]
            try:
                paths += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                pass
        for path in filter(os.path.isfile, paths):  # regular files (a pipe's reader would wait for its writer)
            try:
                with open(path, "rb") as handle:
                    found.update(re.findall(rb"expected-[0-9a-f]{16}", handle.read(1 << 22)))
            except OSError:
                pass
        print(b" ".join(sorted(found)).decode() or f"nothing in {len(paths)} places")
        """)
    result = run_sandboxed_io(code, {"inputs": ["expected-?\n"], "outputs": [secret]}, **FAST)
    assert (result.score, result.reason) == (0.0, "case 0: wrong answer")
    assert result.stdout.startswith("nothing in "), result.stdout


def test_the_parent_takes_only_the_drivers_report_of_the_next_case():
    """Behind the closed pipe, the parent's own check: a line without the call's token, for another case than the
    next one, one case too many, or malformed is an "invalid report" (which `run_sandboxed_io` scores 0), never a
    pass; a case's output over its cap fails it; the first failure stops the run when asked to."""
    def line(token="t" * 32, case=0, stdout="Mwo=", **extra):  # "Mwo=": "3\n"
        record = {"token": token, "case": case, "exit": 0, "limit": None, "stdout": stdout, **extra}
        return (json.dumps(record) + "\n").encode()

    def reports(cap=1 << 20, stop=True):
        return sandbox_cases._CaseReports("t" * 32, IOCases(("", ""), ("3\n", "15\n")), cap, 1e-6, stop)

    good = reports()
    assert good(line()[:9]) is None and good(line()[9:] + line(case=1, stdout="MTU=")) is None  # "15"
    assert good.verdicts == ["passed", "passed"] and good(line(case=2)) == "invalid report"  # one case too many
    for bad in (line(token="0" * 32), line(case=1), line(stdout="3"), b"{}\n", b"[1]\n", b"not json\n"):
        assert reports()(bad) == "invalid report", bad
    assert reports(stop=False)(line(stdout="NA==")) is None  # "4": a wrong answer, and the run goes on
    assert reports()(line(stdout="NA==")) == "case failed"
    over = reports(cap=1, stop=False)
    assert over(line()) is None and over.verdicts == ["output limit exceeded"]


def test_what_counts_as_stdin_stdout_cases():
    assert parse_io_cases("assert f(1) == 1") is None and parse_io_cases(["assert True"]) is None
    assert parse_io_cases("{1: 2}[1] == 2") is None  # Python that starts like a dict, not JSON
    apps = '{"inputs": ["1 2\\n", ["3 4", "5"]], "outputs": ["3\\n", ["7", "5"]], "fn_name": null}'
    assert parse_io_cases(apps) == IOCases(("1 2\n", "3 4\n5"), ("3\n", "7\n5"))  # a list of lines is one text


@pytest.mark.parametrize(("cases", "says"), [
    ({"inputs": ["1"], "outputs": ["1", "2"]}, "'inputs' has 1 items but 'outputs' has 2"),
    ({"inputs": [], "outputs": []}, "need 'inputs', a non-empty list, got \\[\\]"),
    ({"outputs": ["1"]}, "need 'inputs', a non-empty list, got None"),
    ({"inputs": "1", "outputs": "1"}, "need 'inputs', a non-empty list, got '1'"),
    ({"inputs": [1], "outputs": ["1"]}, "'inputs' item 0 must be a str \\(or a list of str, its lines\\), got int"),
    ({"inputs": ["1"], "outputs": [["1", 2]]}, "'outputs' item 0 must be a str .*got list"),
    ('{"inputs": ["1"], "output": ["1"]}', "take the keys .*got unknown \\['output'\\]"),
])
def test_bad_stdin_stdout_cases_are_a_clear_error(cases, says):
    with pytest.raises(ValueError, match=f"stdin/stdout test cases.*{says}"):
        parse_io_cases(cases)
    with pytest.raises(ValueError, match=f"code_reward: the row's 'tests' as stdin/stdout test cases.*{says}"):
        code_reward("p", "print(1)", tests=cases)


def test_bad_stdin_stdout_arguments_are_rejected():
    for kwargs, match in [({"case_timeout_s": 6.0}, "case_timeout_s must be None or a number > 0 and at most"),
                          ({"case_timeout_s": 0}, "case_timeout_s"), ({"float_tolerance": -1e-6}, "float_tolerance"),
                          ({"case_output_bytes": 0}, "case_output_bytes must be an int >= 1"),
                          ({"case_output_bytes": 2}, "an expected output has 3 bytes, more than case_output_bytes")]:
        with pytest.raises(ValueError, match=match):
            run_sandboxed_io("print(3)", SUM_CASES, **{**FAST, **kwargs})
        if "expected output" not in match:  # the reward checks its options when it is made
            with pytest.raises(ValueError, match=match):
                make_code_reward(**kwargs)
    with pytest.raises(ValueError, match="cases must be a dict"):
        run_sandboxed_io("print(3)", "assert True", **FAST)


# ---------------------------------------------------------------------------------------- call-based test cases

ADD_CASES = {"inputs": [[1, 2], [0.5, 0.25]], "outputs": [3, 0.75], "fn_name": "add"}
TWO_SUM = textwrap.dedent("""\
    class Solution:
        def twoSum(self, nums, target):
            seen = {}
            for i, x in enumerate(nums):
                if target - x in seen:
                    return seen[target - x], i  # a tuple: its JSON is a list
                seen[x] = i
    """)
# APPS's and TACO's layout: each input the argument list (here also as its JSON text), each output the return value
# wrapped in a one-element list; LiveCodeBench's: one JSON argument per input line, the output the value itself
TWO_SUM_APPS = {"inputs": [[[2, 7, 11, 15], 9], "[[3, 2, 4], 6]"], "outputs": [[[0, 1]], [[1, 2]]],
                "fn_name": "twoSum"}
TWO_SUM_LCB = [{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"},
               {"input": "[3,2,4]\n6\n", "output": "[1, 2]", "testtype": "functional"}]


def test_a_call_based_function_passes_and_a_wrong_one_fails():
    """A module-level function gets each input's arguments; its return value, as JSON, is compared in the trainer."""
    right = run_sandboxed_io("def add(a, b):\n    return a + b\n", ADD_CASES, **FAST)
    assert (right.score, right.reason, right.cases, right.stdout) == (1.0, "passed", ("passed", "passed"), "0.75\n")
    assert_contained(right)
    wrong = run_sandboxed_io("def add(a, b):\n    return 3\n", ADD_CASES, partial_credit=True, **FAST)
    assert (wrong.score, wrong.cases) == (0.5, ("passed", "wrong answer"))
    missing = run_sandboxed_io("def plus(a, b):\n    return a + b\n", ADD_CASES, **FAST)
    assert missing.reason == "case 0: exit code 1" and "defines no function add" in missing.stderr


def test_a_solution_class_method_passes_with_wrapped_or_plain_outputs():
    """LeetCode-style `class Solution` (instantiated with no arguments): APPS's one-element list around the return
    value is accepted, LiveCodeBench's plain value too (its cases name no function: the row's metadata does)."""
    apps = run_sandboxed_io(TWO_SUM, TWO_SUM_APPS, **FAST)
    assert (apps.score, apps.cases, apps.stdout) == (1.0, ("passed", "passed"), "[1, 2]\n")
    lcb_row = {"tests": json.dumps(TWO_SUM_LCB), "metadata": json.dumps({"func_name": "twoSum"})}
    assert code_reward("p", f"```python\n{TWO_SUM}```", **lcb_row) == 1.0
    assert code_reward("p", TWO_SUM.replace("seen[target - x], i", "i, seen[target - x]"), **lcb_row) == 0.0


def test_what_a_call_based_program_prints_is_never_its_result():
    """The program's stdout is /dev/null: printing the expected result line and exiting before returning (or
    returning a wrong value) does not pass, nor does printing it on stderr."""
    for ending in ("raise SystemExit(0)", "return [9, 9]", "import os; os._exit(0)"):
        code = f"import sys\nclass Solution:\n    def twoSum(self, nums, target):\n        print('[0, 1]')\n" \
               f"        sys.stderr.write('[0, 1]\\n')\n        {ending}\n"
        result = run_sandboxed_io(code, TWO_SUM_APPS, **FAST)
        assert (result.score, result.reason) == (0.0, "case 0: wrong answer"), (ending, result)


def test_a_return_value_that_is_not_json_fails_the_case():
    result = run_sandboxed_io("def add(a, b):\n    return {a, b}\n", ADD_CASES, **FAST)
    assert (result.score, result.reason) == (0.0, "case 0: exit code 1")
    assert "the return value is not a JSON value: Object of type set" in result.stderr


def test_the_expected_return_values_never_enter_the_sandbox():
    """A function that searches its folder, the arguments and every visible process's command line and
    environment for the expected value returns what it found: nothing."""
    secret = f"expected-{secrets.token_hex(8)}"
    code = textwrap.dedent("""\
        import os, re
        def find(text):
            found = set(re.findall(r"expected-[0-9a-f]{16}", text))
            paths = [os.path.join(folder, name) for folder, _, names in os.walk(".") for name in names]
            for pid in filter(str.isdigit, os.listdir("/proc")):
                paths += [f"/proc/{pid}/cmdline", f"/proc/{pid}/environ"]
            for path in paths:
                try:
                    with open(path, "rb") as handle:
                        found.update(re.findall(r"expected-[0-9a-f]{16}", handle.read().decode("latin-1")))
                except OSError:
                    pass
            return sorted(found) or f"nothing in {len(paths)} places"
        """)
    result = run_sandboxed_io(code, {"inputs": [["expected-?"]], "outputs": [secret], "fn_name": "find"}, **FAST)
    assert (result.score, result.reason) == (0.0, "case 0: wrong answer")
    assert result.stdout.startswith('"nothing in '), result.stdout


def test_return_values_match_as_json_values_with_a_float_tolerance():
    assert values_match([1, 2.0, {"a": True}], [1, 2, {"a": 1}])  # Python's == on JSON values
    assert values_match(0.3333333333, 1 / 3) and values_match([[1e-9]], [[0.0]])  # an expected float: within 1e-6
    assert not values_match(0.3333333333, 1 / 3, float_tolerance=0) and not values_match(3.0000001, 3)  # int exact
    assert not values_match([1, 2], [1, 2, 3]) and not values_match({"a": 1}, {"a": 1, "b": 2})
    assert not values_match("1", 1) and not values_match([1], 1) and not values_match(math.nan, math.nan)
    assert not values_match(10**400, 1.0)  # no float near it (and no OverflowError)
    # one-element list wrapping: APPS's outputs accept the element, LiveCodeBench's do not
    apps, lcb = parse_io_cases(TWO_SUM_APPS), parse_io_cases(TWO_SUM_LCB, "twoSum")
    assert apps.passes(0, "[0, 1]\n") and apps.passes(0, "[[0, 1]]") and not apps.passes(0, "[[[0, 1]]]")
    assert lcb.passes(0, "[0, 1]") and not lcb.passes(0, "[[0, 1]]")
    assert not apps.passes(0, "[0, 1]\n[0, 1]\n") and not apps.passes(0, "") and not apps.passes(0, "[" * 100000)


def test_what_counts_as_call_based_and_livecodebench_cases():
    assert parse_io_cases(TWO_SUM_APPS) == IOCases(("[[2, 7, 11, 15], 9]", "[[3, 2, 4], 6]"), ([[0, 1]], [[1, 2]]),
                                                   "twoSum", wrapped_outputs=True)
    assert parse_io_cases(json.dumps(TWO_SUM_LCB), "twoSum") == IOCases(
        ("[[2, 7, 11, 15], 9]", "[[3, 2, 4], 6]"), ([0, 1], [1, 2]), "twoSum")
    stdin = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    assert parse_io_cases(stdin) == parse_io_cases(json.dumps(stdin)) == IOCases(("1 2\n",), ("3\n",))
    assert parse_io_cases('["assert f(1) == 1"]') is None  # a JSON list of snippets is Python tests, as before
    assert row_fn_name({"fn_name": "f", "metadata": '{"func_name": "g"}'}) == "f"
    assert row_fn_name({"metadata": '{"func_name": "g"}'}) == row_fn_name({"metadata": {"func_name": "g"}}) == "g"
    assert row_fn_name({"metadata": "not json"}) is None and row_fn_name({}) is None


FUNCTIONAL = {"input": "1", "output": "1", "testtype": "functional"}


@pytest.mark.parametrize(("cases", "fn_name", "says"), [
    ({"inputs": ["1"], "outputs": ["1"], "fn_name": "solve"}, None, "call-based test cases: 'inputs' item 0 must be "
     "the list of the function's arguments \\(or its JSON text\\), got str '1'"),
    ({"inputs": [[1]], "outputs": [{1, 2}], "fn_name": "solve"}, None, "call-based test cases: 'outputs' item 0 must "
     "be a JSON value"),
    ({"inputs": [[1]], "outputs": [1], "fn_name": "not a name"}, None, "call-based test cases: fn_name must be a "
     "function's name \\(an identifier\\), got 'not a name'"),
    ({"inputs": [[1]], "outputs": [], "fn_name": "f"}, None, "call-based test cases need 'outputs', a non-empty list"),
    ([FUNCTIONAL], None, "LiveCodeBench test cases: functional cases call a function the cases do not name; give "
     "the row an 'fn_name' field \\(or LiveCodeBench's 'metadata' with its 'func_name'\\)"),
    ([FUNCTIONAL, {**FUNCTIONAL, "testtype": "stdin"}], "f", "LiveCodeBench test cases: 'testtype' must be 'stdin' "
     "or 'functional', the same for every case, got \\['functional', 'stdin'\\]"),
    ([{**FUNCTIONAL, "testtype": "call"}], "f", "'testtype' must be 'stdin' or 'functional'.*got \\['call'\\]"),
    ([FUNCTIONAL, "assert f(1) == 1"], "f", "LiveCodeBench test cases: item 1 must be a dict with the keys "
     "\\['input', 'output', 'testtype'\\], got str"),
    ([{"input": "1", "output": "1"}], "f", "item 0 must be a dict with the keys .*, got \\['input', 'output'\\]"),
    ([{**FUNCTIONAL, "output": 1}], "f", "LiveCodeBench test cases: item 0's 'output' must be a str, got int"),
    ([{**FUNCTIONAL, "input": "[1,"}], "f", "LiveCodeBench test cases: item 0's input line 0 must be the JSON text of "
     "a JSON value"),
    ([{**FUNCTIONAL, "output": "yes"}], "f", "LiveCodeBench test cases: item 0's output must be the JSON text of a"),
])
def test_bad_call_based_and_livecodebench_cases_are_a_clear_error(cases, fn_name, says):
    with pytest.raises(ValueError, match=says):
        parse_io_cases(cases, fn_name)
    with pytest.raises(ValueError, match=f"code_reward: the row's 'tests' as .*{says}"):
        code_reward("p", "print(1)", tests=cases, fn_name=fn_name)


# ------------------------------------------------------------------------------------------------ the code reward


def test_extract_code():
    assert extract_code("def f(): pass") == "def f(): pass"
    text = "Try:\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\n"
    assert extract_code(text) == "x = 2\n"  # the last Python block
    assert extract_code("```\ny = 3\n```") == "y = 3\n"  # an untagged block
    assert extract_code("```python\nz = 4\n```\n```\nnot this\n```") == "z = 4\n"  # Python tags win
    assert extract_code("```cpp\nint main() {}\n```") == ""  # only another language: no Python code
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off by the limit


def test_code_reward_scores_completions_and_rejects_rows_without_tests():
    row = {"tests": ["assert square(3) == 9", "assert square(-2) == 4"]}
    right = "Here you go:\n```python\ndef square(x):\n    return x * x\n```"
    wrong = "```python\ndef square(x):\n    return 2 * x\n```"
    assert code_reward("p", right, **row) == 1.0
    assert code_reward("p", wrong, **row) == 0.0
    assert code_reward("p", "```cpp\nint x;\n```", **row) == 0.0  # no Python: not even run
    hack = f"```python\n{ALWAYS_EQUAL}def square(x):\n    return Yes()\n```"
    assert code_reward("p", hack, **row) == 0.0  # strict equality by default
    assert make_code_reward(strict_equality=False)("p", hack, **row) == 1.0
    for tests in (None, "", [], [1], 3):
        with pytest.raises(ValueError, match="tests"):
            code_reward("p", right, tests=tests)
    # tests that judge nothing (every program that runs passed them) or cannot run (every program failed them)
    for tests, says in (([""], "run nothing that can fail"), (["  ", ""], "nothing that can fail"),
                        (["# TODO"], "nothing that can fail"), (['"assert square(3) == 0"'], "nothing that can fail"),
                        ('"""docstring"""\n42', "nothing that can fail"), ("assert square(3) == ", "not valid Python"),
                        ("import math\nLIMIT = 3\ndef helper(x):\n    assert square(x) == x * x", "nothing that can"),
                        ("def check(candidate):\n    assert candidate(3) == 9", "give the row an 'entry_point'")):
        with pytest.raises(ValueError, match=says):
            code_reward("p", right, tests=tests)


HUMANEVAL_TESTS = 'METADATA = {"author": "x"}\n\n\ndef check(candidate):\n    assert candidate(3) == 9\n'
PYTEST_TESTS = "from solution import square\n\ndef test_square():\n    assert square(3) == 9\n"
UNITTEST_TESTS = textwrap.dedent("""\
    import unittest
    from solution import *
    class TestSquare(unittest.TestCase):
        def test_values(self):
            self.assertEqual(square(3), 9)
            self.assertIn(square(2), [4, 5])
    if __name__ == "__main__":
        unittest.main()
    """)


@pytest.mark.parametrize(("tests", "row"), [
    (HUMANEVAL_TESTS, {"entry_point": "square"}),  # HumanEval's `test` column: its harness calls check(entry_point)
    (PYTEST_TESTS, {}),  # KodCode's: `from solution import ...` and test functions that pytest would call
    ("import asyncio\nasync def test_square():\n    await asyncio.sleep(0)\n    assert square(3) == 9\n", {}),
    (UNITTEST_TESTS, {}),  # unittest cases behind a main guard, or unittest.main() bare (it found no tests)
    (UNITTEST_TESTS.replace('if __name__ == "__main__":\n    ', ""), {}),
])
def test_the_code_datasets_test_layouts_judge_the_program(tests, row):
    """HumanEval's check(candidate) nothing called, pytest-style test functions nothing called, and unittest cases
    behind `if __name__ == "__main__":` passed every program, wrong ones included; `from solution import ...` failed
    every one, and a bare unittest.main() ran no test and exited. Each now runs and judges the program, and the
    always-equal object fails the unittest assertions as it fails the tests' ==."""
    right = "```python\ndef square(x):\n    return x * x\n```"
    assert code_reward("p", right, tests=tests, **row) == 1.0
    assert code_reward("p", "```python\ndef square(x):\n    return 2 * x\n```", tests=tests, **row) == 0.0
    hack = f"```python\n{ALWAYS_EQUAL}    __hash__ = object.__hash__\ndef square(x):\n    return Yes()\n```"
    assert code_reward("p", hack, tests=tests, **row) == 0.0


def test_a_humaneval_completion_is_the_body_of_the_prompts_function():
    """HumanEval's prompt is a function's signature and docstring, and a base model's completion (or the row's
    canonical solution) its body: the program is the prompt followed by the completion when the completion alone
    does not define the entry point. A completion that defines it is the program by itself, as before."""
    row = {"tests": HUMANEVAL_TESTS, "entry_point": "square"}
    prompt = 'def square(x):\n    """The square of x."""\n'
    assert code_reward(prompt, "    return x * x\n", **row) == 1.0
    assert code_reward(prompt, "    return 2 * x\n", **row) == 0.0
    assert code_reward(prompt, "```python\ndef square(x):\n    return x ** 2\n```", **row) == 1.0
    with pytest.raises(ValueError, match="give the row an 'entry_point' field"):
        code_reward(prompt, "    return x * x\n", tests=HUMANEVAL_TESTS)
def test_a_program_that_replaces_exec_or_compile_does_not_skip_the_tests():
    """`builtins.exec = lambda *a, **k: None` in the program made the harness's exec of the tests a no-op: every
    test passed. The harness takes exec and compile before the program runs, and compiles the tests first."""
    for patch in ("builtins.exec = lambda *a, **k: None",
                  "real = builtins.compile\nbuiltins.compile = lambda s, f, m, *a, **k: real('pass', f, m, *a, **k)"):
        code = f"import builtins\n{patch}\ndef add(a, b):\n    return 0\n"
        assert run_sandboxed(code, "assert add(2, 3) == 5", **FAST).reason == "tests failed", patch


UNITTEST_CASES = """import unittest
from solution import f, Solution

class T(unittest.TestCase):
    def setUp(self):
        self.s = Solution()

    def test_f(self):
        self.assertEqual(f(2), 4)

    def test_g(self):
        self.assertEqual(self.s.g(3), 9)

if __name__ == "__main__":
    unittest.main()
"""


@pytest.mark.parametrize("program", [
    "def f(x):\n    raise unittest.SkipTest('')\n"
    "class Solution:\n    def g(self, x):\n        raise unittest.SkipTest('')\n",
    "def f(x):\n    return 0\nclass Solution:\n    def __init__(self):\n        raise unittest.SkipTest('')\n",
    "import unittest.case\nunittest.case.SkipTest = AssertionError\ndef f(x):\n    return 0\n"
    "class Solution:\n    def g(self, x):\n        return 0\n",
], ids=["raised-in-the-function", "raised-in-the-setUp's-Solution()", "every-failure-a-skip"])
def test_a_program_cannot_pass_unittest_cases_by_skipping_them(program):
    """A unittest case skipped counts as passed: a program that raised unittest.SkipTest (from the function, or from
    the Solution() every setUp makes), or made SkipTest stand for AssertionError, passed every test. A skip counts only
    when the tests raise it (a `raise` in their code, or their own self.skipTest); SkipTest is put back after the
    program ran."""
    wrong = run_sandboxed(f"import unittest\n{program}", UNITTEST_CASES, **FAST)
    assert wrong.score == 0.0 and "unittest cases failed" in wrong.stderr, wrong
    right = "def f(x):\n    return x * x\nclass Solution:\n    def g(self, x):\n        return x * x\n"
    assert run_sandboxed(right, UNITTEST_CASES, **FAST).score == 1.0
    skipping = UNITTEST_CASES.replace("    def test_g(self):", "    @unittest.skip('later')\n    def test_h(self):\n"
                                      "        pass\n\n    def test_i(self):\n        self.skipTest('not here')\n\n"
                                      "    def test_g(self):")
    assert run_sandboxed(right, skipping, **FAST).score == 1.0  # the tests' own skips are skips


@pytest.mark.parametrize("form", [json.dumps, repr])
def test_tests_stored_as_the_text_of_a_list_are_that_list(form):
    """MBPP's `test_list` kept as text (JSON, or Python's repr in a CSV): run as written it was one list display that
    no program could fail, so every program scored 1.0. It is now the list of tests it spells."""
    tests = form(["assert square(3) == 9", "assert square(-2) == 4"])
    right = "```python\ndef square(x):\n    return x * x\n```"
    assert code_reward("p", right, tests=tests) == 1.0
    assert code_reward("p", "```python\ndef square(x):\n    return 2 * x\n```", tests=tests) == 0.0


def test_code_reward_scores_stdin_stdout_cases():
    apps_row = {"tests": json.dumps(SUM_CASES)}  # APPS's and TACO's `input_output` JSON text, as it is
    right = f"Reads the count, then the numbers:\n```python\n{SUM}```"
    assert code_reward("p", right, **apps_row) == 1.0 and code_reward("p", right, tests=SUM_CASES) == 1.0
    assert code_reward("p", "```python\nprint(3)\n```", **apps_row) == 0.0  # right for case 0 only
    assert make_code_reward(partial_credit=True)("p", "print(3)", **apps_row) == pytest.approx(1 / 3)


def test_a_batch_deadline_that_looping_programs_could_use_up_is_said_before_the_run(monkeypatch):
    """With the defaults (one 30 s deadline per batch, 1 worker, 5 s per sandboxed call) six looping programs used up
    the deadline, and the correct programs queued behind them timed out: scored 0, or a RewardFailure."""
    runner = RewardRunner({"code": 1.0}, timeout_s=30.0, workers=1)
    note = runner.deadline_warning(256)
    assert note is not None and "~1280 s" in note and "raise rewards.workers" in note and "to 43 " in note
    for limit in (7.0, 11.0):  # the workers suggested fit the deadline, one fewer does not
        monkeypatch.setitem(REWARDS, "slow_code", make_code_reward(timeout_s=limit))
        note = RewardRunner({"slow_code": 1.0}, timeout_s=30.0).deadline_warning(256)
        workers = int(note.split("rewards.workers (sandboxed programs run in their own processes) to ")[1].split()[0])
        assert math.ceil(256 / workers) * limit <= 30 < math.ceil(256 / (workers - 1)) * limit
    # one call outlasts the deadline: no number of workers fits, only a longer deadline
    monkeypatch.setitem(REWARDS, "slow_code", make_code_reward(timeout_s=40.0))
    note = RewardRunner({"slow_code": 1.0}, timeout_s=30.0).deadline_warning(256)
    assert "raise rewards.workers" not in note and "raise rewards.timeout_s to 10240" in note
    assert RewardRunner({"code": 1.0}, timeout_s=30.0, workers=43).deadline_warning(256) is None
    assert RewardRunner({"addition": 1.0}, timeout_s=30.0).deadline_warning(256) is None  # no call limit to add up
    assert RewardRunner({"code": 1.0}, timeout_s=None).deadline_warning(256) is None  # no deadline


def test_code_is_a_registered_reward_that_runs_concurrently_in_the_runner():
    assert REWARDS["code"] is code_reward
    row = {"tests": "assert inc(1) == 2"}
    completions = ["def inc(x):\n    return x + 1\n", "def inc(x):\n    return x\n", "raise SystemExit(1)\n",
                   "```python\ndef inc(x):\n    return 1 + x\n```"]
    runner = RewardRunner({"code": 1.0}, on_error="fail", timeout_s=30, workers=4)
    rewards, stats = runner(["p"] * 4, completions, [row] * 4)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]  # in call order, whatever order the workers finished in
    assert stats["reward_failures"] == 0.0  # a wrong program is a score of 0, not a failure


KODCODE_TESTS = textwrap.dedent('''\
    from solution import mean, parse, greet, Stack
    import pytest

    @pytest.mark.parametrize("xs, expected", [([1, 2, 3], 2.0), ([0.1, 0.2], 0.15), pytest.param([4], 4.0, id="one")])
    def test_mean(xs, expected):
        assert mean(xs) == pytest.approx(expected)

    def test_mean_of_nothing():
        with pytest.raises(ValueError, match="empty"):
            mean([])

    @pytest.fixture
    def stack():
        s = Stack()
        s.push(1)
        yield s
        s.items.clear()

    def test_stack(stack):
        assert stack.pop() == 1

    def test_greet(capsys):
        greet("Bob")
        assert capsys.readouterr().out == "Hello, Bob\\n"

    class TestParse:
        def test_int(self):
            assert parse("3") == 3

        @pytest.mark.parametrize("text", ["x", ""])
        def test_bad(self, text):
            with pytest.raises(ValueError):
                parse(text)

    if __name__ == "__main__":
        pytest.main([__file__])
    ''')
KODCODE_RIGHT = textwrap.dedent('''\
    def mean(xs):
        if not xs:
            raise ValueError("empty list")
        return sum(xs) / len(xs)

    def parse(text):
        return int(text)

    def greet(name):
        print(f"Hello, {name}")

    class Stack:
        def __init__(self):
            self.items = []

        def push(self, x):
            self.items.append(x)

        def pop(self):
            return self.items.pop()
    ''')


def test_pytest_style_tests_judge_the_program_with_the_sandboxs_pytest():
    """KodCode's layout: `import pytest`, parametrize, raises with match, approx, a fixture, capsys and a test class.
    pytest cannot be imported in the sandbox (no site-packages), so every program failed these tests, the correct one
    too: the sandbox's own pytest runs them now, with pytest's semantics. Each wrong program fails one of them."""
    assert code_reward("p", f"```python\n{KODCODE_RIGHT}```", tests=KODCODE_TESTS) == 1.0
    for fix in ("def mean(xs):\n    return sum(xs) / max(len(xs), 1)\n",  # no ValueError for []
                "def mean(xs):\n    return round(sum(xs) / len(xs), 1)\n",  # 0.2, not 0.15
                "def parse(text):\n    return 3\n",  # a test class's method fails
                "def greet(name):\n    print('Hello', name)\n",  # prints something else
                "class Stack:\n    def push(self, x):\n        pass\n    def pop(self):\n        return 2\n"):
        assert code_reward("p", f"```python\n{KODCODE_RIGHT}\n{fix}```", tests=KODCODE_TESTS) == 0.0, fix


def test_the_sandboxs_pytest_covers_what_code_datasets_use():
    """Fixtures (yield teardown, fixtures of fixtures, params, scopes, autouse, a class's own), parametrize (stacked,
    one name not unpacked, param marks, indirect), skip / skipif / xfail, monkeypatch, tmp_path, request, approx on
    containers and its tolerances, raises' call form, warns, setup_method, unittest.mock.patch decorators, async tests,
    a test* helper the tests call and a class with __init__ (neither collected): all pass for a correct program."""
    tests = textwrap.dedent('''\
        import os
        import warnings
        import pytest
        from unittest.mock import patch
        from solution import add, div, helper

        LOG = []

        @pytest.fixture
        def base():
            LOG.append("up")
            yield 10
            LOG.append("down")

        @pytest.fixture
        def doubled(base):
            return base * 2

        @pytest.fixture(params=[1, 2])
        def n(request):
            return request.param

        @pytest.fixture
        def hundreds(request):
            return request.param * 100

        @pytest.fixture(scope="module")
        def shared():
            return []

        @pytest.fixture(autouse=True)
        def counted():
            LOG.append("test")

        def test_fixtures(doubled, base):
            assert (doubled, base) == (20, 10)

        def test_teardown_ran():
            assert LOG[:4] == ["test", "up", "down", "test"]

        def test_params(n, shared):
            shared.append(n)
            assert add(n, 0) == n

        def test_module_scope(shared):
            assert shared == [1, 2]

        @pytest.mark.parametrize("hundreds", [1, 2], indirect=True)
        def test_indirect(hundreds):
            assert hundreds in (100, 200)

        @pytest.mark.parametrize("a", [1, 2])
        @pytest.mark.parametrize(("b", "c"), [(10, 11), pytest.param(20, 0, marks=pytest.mark.xfail(strict=True))])
        def test_stacked(a, b, c):
            assert add(1, b) == c

        @pytest.mark.parametrize("pair", [(1, 2)])
        def test_one_name(pair):
            assert pair == (1, 2)

        @pytest.mark.skip(reason="never")
        def test_skipped():
            assert False

        @pytest.mark.skipif("sys.platform == 'linux'")
        def test_skipif():
            assert False

        @pytest.mark.xfail(raises=ZeroDivisionError)
        def test_xfail():
            div(1, 0)

        def test_imperative_skip():
            pytest.skip("later")
            assert False

        def test_approx():
            assert [add(0.1, 0.2), 1] == pytest.approx([0.3, 1.0])
            assert {"a": add(0.1, 0.2)} == pytest.approx({"a": 0.3})
            assert add(100, 0) == pytest.approx(104, rel=0.05) and add(1, 0) != pytest.approx(1.5, abs=0.4)
            assert float("nan") != pytest.approx(float("nan")) and "a" == pytest.approx("a")

        def test_raises_and_warns():
            info = pytest.raises(ZeroDivisionError, div, 1, 0)
            assert info.type is ZeroDivisionError and info.match("zero")
            with pytest.raises((TypeError, ValueError)) as info:
                int("x")
            assert "invalid" in str(info.value)
            with pytest.warns(UserWarning, match="careful"):
                warnings.warn("be careful")

        def test_monkeypatch_and_tmp_path(monkeypatch, tmp_path):
            monkeypatch.setenv("GSPO_X", "1")
            monkeypatch.setattr("os.getpid", lambda: -1)
            (tmp_path / "a.txt").write_text("hi")
            assert os.environ["GSPO_X"] == "1" and os.getpid() == -1 and (tmp_path / "a.txt").read_text() == "hi"

        def test_undone():
            assert "GSPO_X" not in os.environ and os.getpid() != -1

        def test_request(request):
            assert request.node.name == "test_request"

        @patch("solution.helper", return_value=42)
        def test_mock_patch(mocked, base):
            import solution
            assert solution.helper() == 42 and base == 10

        async def test_async():
            assert add(1, 2) == 3

        def test_helper(x):
            assert x == 3

        test_helper(add(1, 2))

        class TestThings:
            def setup_method(self, method):
                self.ready = True

            @pytest.fixture
            def thing(self):
                return "thing"

            def test_setup_and_own_fixture(self, thing, base):
                assert self.ready and thing == "thing" and base == 10

            @staticmethod
            def test_static():
                assert add(2, 2) == 4

        class TestWithInit:
            def __init__(self):
                pass

            def test_never_collected(self):
                assert False
        ''')
    code = "def add(a, b):\n    return a + b\n\ndef div(a, b):\n    return a / b\n\ndef helper():\n    return 1\n"
    passed = run_sandboxed(code, tests, **FAST)
    assert (passed.score, passed.reason) == (1.0, "passed"), passed.stderr
    wrong = run_sandboxed(code.replace("a + b", "a + b + (a == 2)"), tests, **FAST)  # wrong for one stacked case
    assert (wrong.score, wrong.reason) == (0.0, "tests failed")


ALWAYS_EQUAL_KODCODE = ALWAYS_EQUAL + "    __hash__ = object.__hash__\n"


@pytest.mark.parametrize("hack", [
    # returns an object that equals anything: approx and the tests' == find it unequal
    f"{ALWAYS_EQUAL_KODCODE}def mean(xs):\n    return Yes()\ndef parse(text):\n    return Yes()\n",
    # a float whose arithmetic says it is within any tolerance
    "class F(float):\n    def __sub__(self, other):\n        return 0.0\n    __rsub__ = __sub__\n"
    "def mean(xs):\n    return F(99)\n",
    # replaces pytest's raises and approx: the module is read-only, and its __dict__ is not where names come from
    "import pytest, contextlib\npytest.raises = lambda *a, **k: contextlib.suppress(BaseException)\n",
    "import pytest, contextlib\npytest.__dict__['raises'] = lambda *a, **k: contextlib.suppress(BaseException)\n"
    "pytest.__dict__['approx'] = lambda x, **k: x + 0.01\n",
    # the shim's internals: classes, functions' code, globals; put back as they were before each test
    "import pytest\ntype(pytest.approx(1)).__eq__ = lambda s, o: True\ntype(pytest.raises(ValueError)).__exit__ = "
    "lambda *a: True\n",
    "import pytest\npytest.raises.__code__ = (lambda *a, **k: __import__('contextlib').suppress(BaseException))"
    ".__code__\ntype(pytest.approx(1)).__eq__.__code__ = (lambda s, o: True).__code__\n",
    "import pytest\npytest.raises.__globals__['RaisesContext'].__exit__ = lambda *a: True\n"
    "pytest.raises.__globals__['_approx_equal'] = lambda *a: True\n",
    # hands the tests a pytest of its own: through sys.modules, or __import__
    "import sys, types, contextlib\nfake = types.ModuleType('pytest')\nfake.raises = lambda *a, **k: "
    "contextlib.suppress(BaseException)\nfake.approx = lambda x, **k: x + 0.01\nsys.modules['pytest'] = fake\n",
    "import builtins, types, contextlib\nreal = builtins.__import__\nfake = types.ModuleType('pytest')\n"
    "fake.raises = lambda *a, **k: contextlib.suppress(BaseException)\nfake.approx = lambda x, **k: x + 0.01\n"
    "builtins.__import__ = lambda n, *a, **k: fake if n == 'pytest' else real(n, *a, **k)\n",
    # skips the tests it would fail, or raises the skip exception itself
    "import pytest\ndef mean(xs):\n    pytest.skip('no')\n",
    "import pytest\nSkipped = pytest.skip.__globals__['Skipped']\ndef mean(xs):\n    raise Skipped('no')\n",
    # patches while a test runs, before the test's next raises()
    "import pytest, contextlib\ndef parse(text):\n    pytest.__dict__['raises'] = lambda *a, **k: "
    "contextlib.suppress(BaseException)\n    type(pytest.raises(ValueError)).__exit__ = lambda *a: True\n"
    "    return 3\n",
])
def test_a_program_cannot_pass_pytest_style_tests_by_hacking_the_sandboxs_pytest(hack):
    """Each program is wrong where it hacks (mean without its ValueError for [], or parse("x") without one) and
    tries to pass anyway. The runner takes what it needs before the program runs and puts the module back."""
    wrong = KODCODE_RIGHT.replace('        raise ValueError("empty list")\n', "        return 0.0\n").replace(
        "    return int(text)\n", "    return int(text) if text.isdigit() else 3\n")
    assert code_reward("p", f"```python\n{wrong}\n{hack}```", tests=KODCODE_TESTS) == 0.0
    assert code_reward("p", f"```python\n{KODCODE_RIGHT}```", tests=KODCODE_TESTS) == 1.0


def test_pytest_style_tests_that_no_program_can_pass_or_fail_are_refused():
    """A fixture that nobody defines (conftest.py's, pytest plugins'), or a pytest feature the sandbox lacks, failed
    every program: the row is refused naming it (and the harness, should one slip through, says it is the tests').
    Tests that are all skipped (or xfail) judge nothing, like tests that run nothing."""
    right = f"```python\n{KODCODE_RIGHT}```"
    for tests, says in (
        ("from solution import mean\n\ndef test_mean(db):\n    assert mean([1]) == 1\n",
         "fixture 'db' in test_mean, which neither the tests define nor the sandbox's pytest provides"),
        ("import pytest\n\n@pytest.fixture\ndef rows(db):\n    return [1]\n\nclass TestMean:\n"
         "    def test_mean(self, rows):\n        assert rows\n", "fixture 'db' in rows"),
        ("import pytest\n\ndef test_log(caplog):\n    assert not caplog.records\n", "fixture 'caplog'"),
        ("import pytest\n\ndef test_f(tmpdir):\n    assert pytest.register_assert_rewrite\n", "pytest.register_"),
        ("from pytest import MonkeyPatch, Pytester\n\ndef test_f():\n    assert True\n", "pytest.Pytester"),
        ("import pytest\n\n@pytest.mark.skip\ndef test_f():\n    assert False\n", "nothing that can fail"),
        ("import pytest\n\n@pytest.mark.xfail(reason='todo')\ndef test_f():\n    assert False\n", "nothing that can"),
        ("import pytest\n\n@pytest.mark.skip(reason='todo')\nclass TestF:\n    def test_f(self):\n"
         "        assert False\n", "nothing that can fail"),
    ):
        with pytest.raises(ValueError, match=says):
            code_reward("p", right, tests=tests)
    # what the static check cannot see (a computed parametrize), the harness reports as the tests' error
    tests = "import pytest\n\n@pytest.mark.parametrize('a' + 'b', [1])\ndef test_f(ab, db):\n    assert ab\n"
    assert code_reward("p", right, tests=tests) == 0.0
    result = run_sandboxed("", tests, **FAST)
    assert result.reason.startswith("tests error: test_f asks for fixture 'db', which neither the tests define"), (
        result.reason)
    # parameters with defaults, a helper called with arguments and a parametrized test are fine
    for tests in ("from solution import mean\n\ndef test_mean(x=2):\n    assert mean([x]) == x\n",
                  "from solution import mean\n\ndef test_of(xs):\n    assert mean(xs) == 2\n\ntest_of([1, 3])\n",
                  "import pytest\n\n@pytest.mark.parametrize('xs', [[2]])\ndef test_m(xs):\n"
                  "    assert mean(xs) == 2\n"):
        assert code_reward("p", right, tests=tests) == 1.0, tests


def test_the_sandboxs_pytest_is_python_3_8_and_has_the_names_the_reward_checks():
    """The shim runs under the sandbox's interpreter (Python >= 3.8); `gspo.rewards.code` checks tests against
    `NAMES` and `FIXTURES`, which must be what the module in the sandbox has."""
    import ast

    from gspo.sandbox import PYTEST_FIXTURES, PYTEST_NAMES

    source = Path(sandbox_module.__file__).with_name("pytest_shim.py").read_text()
    ast.parse(source, feature_version=(3, 8))
    listed = run_sandboxed("", f"import pytest\nassert sorted(n for n in dir(pytest) if not n.startswith('_')) == "
                               f"{sorted(PYTEST_NAMES)!r}\n", **FAST)
    assert listed.score == 1.0, listed.stderr
    fixtures = "\n".join(f"def test_{name}({name}):\n    assert {name} is not None\n" for name in PYTEST_FIXTURES)
    assert run_sandboxed("", fixtures, **FAST).score == 1.0


# ------------------------------------------------------------------------------- packages beyond the standard library

NUMPY_ROW = {"tests": "import numpy as np\n\nassert np.array_equal(running(np.array([1, 2, 3])), np.array([1, 3, 6]))\n"
                      "assert running(np.arange(4)).dtype.kind == 'i'\n"}
NUMPY_RIGHT = "```python\nimport numpy as np\n\ndef running(xs):\n    return np.cumsum(xs)\n```"
NUMPY_WRONG = "```python\nimport numpy as np\n\ndef running(xs):\n    return np.array(xs)\n```"


def test_packages_let_the_program_and_the_tests_import_the_trainers_modules():
    """A row whose tests import numpy (BigCodeBench's `import numpy as np`) failed every program: the sandbox runs
    `python -I -S`, the standard library only. With packages=("numpy",) numpy's folder is on the program's path."""
    numpy_for_the_sandbox()
    with_numpy = make_code_reward(**FAST, packages=("numpy",))
    assert with_numpy("p", NUMPY_RIGHT, **NUMPY_ROW) == 1.0
    assert with_numpy("p", NUMPY_WRONG, **NUMPY_ROW) == 0.0
    assert make_code_reward(**FAST)("p", NUMPY_RIGHT, **NUMPY_ROW) == 0.0  # without: the right program fails
    plain = run_sandboxed(extract_code(NUMPY_RIGHT), NUMPY_ROW["tests"], **FAST)
    assert plain.reason == "exit code 1" and "ModuleNotFoundError: No module named 'numpy'" in plain.stderr
    result = run_sandboxed(extract_code(NUMPY_RIGHT), NUMPY_ROW["tests"], packages=["numpy"], **FAST)
    assert result.reason == "passed", result.stderr
    assert_contained(result)
    # the numeric libraries start one thread each (a thread per core failed under RLIMIT_AS / RLIMIT_NPROC)
    threads = run_sandboxed("import os\nimport numpy\nprint(len(os.listdir('/proc/self/task')))\n", "",
                            packages=("numpy",), **FAST)
    assert (threads.reason, threads.stdout) == ("passed", "1\n"), threads.stderr
    hog = run_sandboxed("import numpy as np\nblock = np.ones(1 << 30)\n", "", packages=("numpy",), **FAST)
    assert (hog.score, hog.reason) == (0.0, "memory"), hog.stderr  # numpy's _ArrayMemoryError


def test_packages_reach_stdin_stdout_and_call_based_cases():
    """Each case's program runs in a child interpreter of its own (and a call-based one under the caller stub): it
    gets the packages' folders too, and runs as the script it is (__main__, its __file__ and argv)."""
    numpy_for_the_sandbox()
    code = ("import sys\nimport numpy as np\n\nn = int(input())\nprint(int(np.array(input().split(), dtype=int).sum()))"
            "\nassert __name__ == '__main__' and __file__ == sys.argv[0] == 'solution.py', (__file__, sys.argv)\n"
            "assert 'sys' in globals() and 'np' in globals() and 'BOOT' not in globals()\n")
    result = run_sandboxed_io(code, SUM_CASES, packages=("numpy",), **FAST)
    assert (result.reason, result.cases) == ("passed", ("passed",) * 3), result.stderr
    assert run_sandboxed_io(code, SUM_CASES, **FAST).reason == "case 0: exit code 1"  # ModuleNotFoundError
    function = "import numpy as np\n\ndef add(a, b):\n    return np.add(a, b).item()\n"
    assert run_sandboxed_io(function, ADD_CASES, packages=("numpy",), **FAST).reason == "passed"
    right = f"```python\n{code}```"
    assert make_code_reward(**FAST, packages=("numpy",))("p", right, tests=json.dumps(SUM_CASES)) == 1.0


@pytest.mark.parametrize(("packages", "says"), [
    (("nonexistent_mod",), "no module 'nonexistent_mod' is installed in the trainer's environment"),
    (("os",), "'os' is in the standard library"),
    (("numpy.linalg",), "'numpy.linalg' is not a top-level module name \\(give 'numpy'\\)"),
    (("",), "'' is not a top-level module name"),
])
def test_packages_that_are_not_installed_top_level_modules_are_refused_when_the_reward_is_made(packages, says):
    with pytest.raises(ValueError, match=says):
        make_code_reward(packages=packages)
    with pytest.raises(ValueError, match=says):
        run_sandboxed("pass", "assert True", packages=packages, **FAST)
    with pytest.raises(TypeError, match="a list of top-level module names"):
        make_code_reward(packages="numpy")  # a str is not a list of names


@pytest.mark.skipif(not ROOT, reason="as root the program runs as an unprivileged uid")
def test_a_package_in_a_folder_closed_to_the_sandboxs_uid_is_refused(monkeypatch):
    """A venv under /root (0700) holds packages that the unprivileged uid cannot read: every program would fail."""
    folder = Path(tempfile.mkdtemp(prefix="gspo-test-packages-"))
    try:
        (folder / "gspo_test_helper.py").write_text("def double(x):\n    return 2 * x\n")
        monkeypatch.syspath_prepend(str(folder))
        folder.chmod(0o700)
        with pytest.raises(ValueError, match=r"in a folder that the sandboxed program cannot read: .*chmod o\+rx"):
            make_code_reward(packages=("gspo_test_helper",))
        folder.chmod(0o755)
        (folder / "gspo_test_helper.py").chmod(0o644)
        reward = make_code_reward(**FAST, packages=("gspo_test_helper",))
        tests = "from gspo_test_helper import double\nassert quadruple(3) == double(double(3))\n"
        assert reward("p", "from gspo_test_helper import double\n\ndef quadruple(x):\n    return double(double(x))\n",
                      tests=tests) == 1.0
    finally:
        shutil.rmtree(folder)


def test_extension_modules_another_python_cannot_load_are_refused(monkeypatch):
    """The sandbox's interpreter (python=..., or the fallback python3 as root) of another Python version cannot load
    numpy's extension modules built for this one: every program importing numpy failed with an ImportError."""
    numpy_for_the_sandbox()
    suffixes = sandbox_module._extension_suffixes  # what an interpreter says it loads
    assert ".abi3.so" in suffixes(sys.executable)
    assert suffixes("/nonexistent/python3") is None  # unchecked: the sandbox call says why it cannot start
    monkeypatch.setattr(sandbox_module, "_extension_suffixes", lambda python: (".cpython-399-x86_64-linux-gnu.so",
                                                                               ".abi3.so", ".so"))
    sandbox_module._package_dirs.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"'numpy' has extension modules built for this Python .* which the "
                                             r"sandbox's interpreter /other/python3 cannot load"):
            make_code_reward(packages=("numpy",), python="/other/python3")
        make_code_reward(packages=("numpy",), python=sys.executable)  # this interpreter: nothing to check
        monkeypatch.undo()
        others = [p for v in range(8, 15) if v != sys.version_info[1] and (p := shutil.which(f"python3.{v}"))
                  and suffixes(p) is not None]
        for other in others[:1]:  # a real interpreter of another version, where this machine has one
            with pytest.raises(ValueError, match="'numpy' has extension modules built for this Python"):
                make_code_reward(packages=("numpy",), python=other)
    finally:
        sandbox_module._package_dirs.cache_clear()


def test_numpys_arrays_do_not_let_the_always_equal_hack_through():
    """With numpy importable, an array of the program's objects (dtype object: its == asks theirs) or an ndarray
    subclass of the program's (numpy's == hands back one, whose truth it decides) equals anything; the tests' == and
    unittest's assertEqual find them unequal to a plain value. numpy's own values compare as numpy does."""
    numpy_for_the_sandbox()
    subclass = "class Truthy(np.ndarray):\n    def __bool__(self):\n        return True\n"
    for returned in ("np.array([Yes()], dtype=object)", "np.array(Yes(), dtype=object)", "[np.array([Yes()], "
                     "dtype=object)]", "np.zeros(1).view(Truthy)"):
        code = f"import numpy as np\n{ALWAYS_EQUAL}{subclass}def add(a, b):\n    return {returned}\n"
        for tests in ("assert add(2, 3) == 5", "assert 5 in [add(2, 3)]",
                      "import unittest\n\nclass T(unittest.TestCase):\n    def test(self):\n"
                      "        self.assertEqual(add(2, 3), 5)\n"):
            hacked = run_sandboxed(code, tests.replace("5", "[5]") if returned.startswith("[") else tests,
                                   packages=("numpy",), **FAST)
            assert hacked.score == 0.0, (returned, tests)
    honest = ("import numpy as np\ndef add(a, b):\n    return np.int64(a + b)\n"
              "def pair(a, b):\n    return np.array(['x', a + b], dtype=object)\n")
    tests = ("import numpy as np\nassert add(2, 3) == 5\nassert 5 in [add(2, 3)]\nassert (pair(2, 3) == "
             "np.array(['x', 5], dtype=object)).all()\nassert pair(1, 1).tolist() == ['x', 2]\n")
    assert run_sandboxed(honest, tests, packages=("numpy",), **FAST).reason == "passed"


def test_a_missing_module_that_is_installed_here_gets_a_hint(caplog):
    """The start-of-run reward check scores the rows' own solutions: with a module they need left out of packages,
    the reward says which and how to add it, once; a module that is not installed here gets no hint."""
    pytest.importorskip("numpy")
    reward = make_code_reward(**FAST)
    with caplog.at_level("WARNING", logger="gspo.rewards.code"):
        assert reward("p", NUMPY_RIGHT, **NUMPY_ROW) == 0.0
        assert reward("p", NUMPY_RIGHT, **NUMPY_ROW) == 0.0
        assert reward("p", "import not_a_module_here\n", **NUMPY_ROW) == 0.0
    hints = [r.getMessage() for r in caplog.records if "ModuleNotFoundError" in r.getMessage()]
    assert len(hints) == 1 and "make_code_reward(packages=('numpy', ...))" in hints[0], hints


def test_the_scripts_that_run_in_the_sandbox_are_python_3_8():
    import ast

    for name in ("_HARNESS", "_IO_DRIVER", "_CALLER"):
        ast.parse(getattr(sandbox_module, name), feature_version=(3, 8))
    # the driver's bootstrap of a case's program with packages, as the driver builds it
    driver = ast.parse(sandbox_module._IO_DRIVER)
    names = {"PROGRAM", "PACKAGE_PATH", "BOOT"}
    assignments = [s for s in driver.body if isinstance(s, ast.Assign) and s.targets[0].id in names]
    scope = {}
    exec(compile(ast.Module(assignments, []), "driver", "exec"), scope)
    assert scope["PACKAGE_PATH"] == []
    scope["PACKAGE_PATH"] = ["/x"]
    exec(compile(ast.Module(assignments[-1:], []), "driver", "exec"), scope)
    ast.parse(scope["BOOT"], feature_version=(3, 8))
    assert "sys.path.extend(['/x'])" in scope["BOOT"]


HASH_PROBE = ("import sys\n"
              "sys.stderr.write('probe %r %r\\n' % (hash('gspo'), list({'apple', 'pear', 'fig', 'kiwi', 'plum'})))\n")


def test_a_program_hashes_strings_alike_in_every_call():
    """Each call's program ran under a random hash seed of its own, so the order it iterated a set of strings in
    changed from call to call, and with it the reward of a program whose tests compare `list(set(a + b))` with a list
    (a KodCode row: 2 of 12 calls of one program passed). The sandbox's interpreter now hashes with one seed in every
    call (PYTHONHASHSEED), in the tests' harness and in the stdin/stdout cases alike."""
    def probe(result) -> str:
        assert result.score == 1.0, result
        (line,) = [x for x in result.stderr.splitlines() if x.startswith("probe ")]
        return line

    seen = {probe(run_sandboxed(HASH_PROBE, "pass", **FAST)) for _ in range(3)}
    seen |= {probe(run_sandboxed_io(HASH_PROBE + "print(3)\n", {"inputs": [""], "outputs": ["3"]}, **FAST))
             for _ in range(2)}
    assert len(seen) == 1, seen


def test_the_call_folder_is_not_on_the_programs_sys_path():
    """The interpreter no longer runs in isolated mode (which ignores PYTHONHASHSEED): the entry points take the call's
    folder off sys.path themselves, so a module the program writes there is not what the tests (or a later case's
    program) import."""
    code = "with open('shadow_mod.py', 'w') as f:\n    f.write('x = 1')\n"
    tests = ("try:\n    import shadow_mod\nexcept ModuleNotFoundError:\n    pass\n"
             "else:\n    raise AssertionError('the call folder is on sys.path')\n")
    assert run_sandboxed(code, tests, **FAST).score == 1.0
    io = code + "import os, sys\nprint(any(p in ('', os.getcwd()) for p in sys.path))\n"
    assert run_sandboxed_io(io, {"inputs": ["", ""], "outputs": ["False", "False"]}, **FAST).score == 1.0

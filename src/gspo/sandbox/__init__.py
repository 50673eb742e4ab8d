"""A process sandbox for untrusted, model-written Python: `run_sandboxed(code, tests)` runs the program in a
locked-down child process (namespaces, rlimits, an unprivileged uid, a private folder, a clean environment) and says
whether its tests ran to their end; `run_sandboxed_io(code, cases)` runs it once per stdin/stdout or call-based
case and compares its output (or return value) outside the sandbox. See `gspo.sandbox.process` for how the program
is contained. The `code` reward (`gspo.rewards.code`) is built on them.

The implementation is standard-library only: `gspo.sandbox.process` contains the program (the launcher runs that
module as a script) and holds the scripts that run inside; `gspo.sandbox.pytest_shim` is the `pytest` those scripts
provide to tests that use it; `gspo.sandbox.cases` reads the test-case formats, judges outputs and runs a program
against cases.
"""

from gspo.sandbox.cases import (
    IOCases,
    check_io_limits,
    outputs_match,
    parse_io_cases,
    row_fn_name,
    run_sandboxed_io,
    values_match,
)
from gspo.sandbox.process import SandboxError, SandboxResult, check_limits, package_dirs, run_sandboxed
from gspo.sandbox.pytest_shim import FIXTURES as PYTEST_FIXTURES
from gspo.sandbox.pytest_shim import NAMES as PYTEST_NAMES

__all__ = ["PYTEST_FIXTURES", "PYTEST_NAMES", "IOCases", "SandboxError", "SandboxResult", "check_io_limits",
           "check_limits", "outputs_match", "package_dirs", "parse_io_cases", "row_fn_name", "run_sandboxed",
           "run_sandboxed_io", "values_match"]

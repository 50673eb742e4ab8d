"""A process sandbox for untrusted, model-written Python: `run_sandboxed(code, tests)` runs the program in a
locked-down child process (namespaces, rlimits, an unprivileged uid, a private folder, a clean environment) and says
whether its tests ran to their end; `run_sandboxed_io(code, cases)` runs it once per stdin/stdout or call-based
case and compares its output (or return value) outside the sandbox. See `gspo.sandbox.process` for how the program
is contained. The `code` reward (`gspo.rewards.code`) is built on them.

The implementation is one standard-library-only module (`gspo.sandbox.process`), which the launcher runs as a script.
"""

from gspo.sandbox.process import (
    IOCases,
    SandboxError,
    SandboxResult,
    check_io_limits,
    check_limits,
    outputs_match,
    parse_io_cases,
    row_fn_name,
    run_sandboxed,
    run_sandboxed_io,
    values_match,
)

__all__ = ["IOCases", "SandboxError", "SandboxResult", "check_io_limits", "check_limits", "outputs_match",
           "parse_io_cases", "row_fn_name", "run_sandboxed", "run_sandboxed_io", "values_match"]

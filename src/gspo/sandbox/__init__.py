"""A process sandbox for untrusted, model-written Python: `run_sandboxed(code, tests)` runs the program in a
locked-down child process (namespaces, rlimits, an unprivileged uid, a private folder, a clean environment) and says
whether its tests ran to their end. See `gspo.sandbox.process` for how the program is contained. The `code` reward
(`gspo.rewards.code`) is built on it.

The implementation is one standard-library-only module (`gspo.sandbox.process`), which the launcher runs as a script.
"""

from gspo.sandbox.process import SandboxError, SandboxResult, check_limits, run_sandboxed

__all__ = ["SandboxError", "SandboxResult", "check_limits", "run_sandboxed"]

"""Run reward-function calls with a per-call wall-clock deadline, so that a hanging reward cannot hang training.

Why daemon threads, and what that costs. A call that passes its deadline is reported as timed out and the caller
moves on; the thread running it is abandoned (replaced by a fresh one) and counted in `DeadlinePool.stuck`, because
Python cannot stop a thread: a hung pure-Python call keeps running in the background, holding the GIL in turns,
until it returns by itself. The alternatives were worse here:

* SIGALRM (what Math-Verify does) interrupts a pure-Python call for real, but works only in the main thread, clashes
  with reward functions that use SIGALRM themselves (math_reward through Math-Verify would cancel our alarm), and
  cannot interrupt C code either;
* a process per call can be killed, but needs picklable functions and rows, and costs a fork of a process holding a
  model (unsafe with the threads torch starts) or an interpreter start per call.

So: a deadline here protects training from *hangs* in trusted reward code (a regex or a symbolic solver gone
quadratic, a lock, a network call). Untrusted code must not run in a reward thread at all: it belongs in
`gspo.rewards.sandbox`, whose child process is killed at its own limits. The threads are daemons, so the abandoned
ones never keep the interpreter from exiting (a `concurrent.futures` pool would join them at exit, i.e. hang).

With more than one worker, calls run concurrently: a win for rewards that wait (the sandbox, I/O); the functions must
then be thread-safe. Results are returned in call order either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeadlinePool", "Outcome"]


@dataclass
class Outcome:
    """How one call ended: its return value, the exception it raised, or a timeout (then the call was abandoned)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


@dataclass(eq=False)
class _Batch:
    """The calls of one `map`, and what the waiting caller needs to know about them."""

    remaining: int
    running: set = field(default_factory=set)  # tasks started and not finished
    cancelled: bool = False


@dataclass(eq=False)
class _Task:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    batch: _Batch
    started: float | None = None
    worker: threading.Thread | None = None
    outcome: Outcome | None = None
    timed_out: bool = False


class DeadlinePool:
    """`workers` daemon threads running calls with a deadline of `timeout_s` seconds each (None: no deadline),
    counted from when the call starts, not from when it was queued."""

    def __init__(self, workers: int = 1, timeout_s: float | None = None) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"DeadlinePool: workers must be an int >= 1, got {workers!r}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            raise ValueError(f"DeadlinePool: timeout_s must be a finite number > 0 or None, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._abandoned: list[threading.Thread] = []
        for _ in range(workers):
            self._spawn()

    @property
    def stuck(self) -> int:
        """Abandoned calls (past their deadline) that are still running in the background."""
        with self._cond:
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)

    def map(self, calls: Sequence[tuple[Callable[..., Any], tuple, dict]]) -> list[Outcome]:
        """Run each `(fn, args, kwargs)` and return their outcomes in the same order; never raises for a call."""
        batch = _Batch(remaining=len(calls))
        tasks = [_Task(fn, tuple(args), dict(kwargs), batch) for fn, args, kwargs in calls]
        for task in tasks:
            self._queue.put(task)
        try:
            with self._cond:
                while batch.remaining:
                    self._cond.wait(self._expire(batch))
        finally:
            batch.cancelled = True  # an interrupted caller (KeyboardInterrupt): workers skip what is still queued
        return [Outcome(timed_out=True) if task.timed_out else task.outcome for task in tasks]

    def _expire(self, batch: _Batch) -> float | None:
        """Time out the running calls past their deadline (called with the lock held); how long to wait before
        looking again: until the soonest deadline, and at most `timeout_s` (a call starting meanwhile has a later
        deadline than that), so that workers need not wake the caller when a call starts, only when all are done."""
        if self.timeout_s is None:
            return None
        now, soonest = time.monotonic(), self.timeout_s
        for task in list(batch.running):
            deadline = task.started + self.timeout_s
            if now >= deadline:
                task.timed_out = True
                batch.running.discard(task)
                batch.remaining -= 1
                self._abandoned.append(task.worker)
                self._spawn()  # the stuck thread's replacement
            else:
                soonest = min(soonest, deadline - now)
        return soonest

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="gspo-reward", daemon=True).start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            task = self._queue.get()
            with self._cond:
                if task.batch.cancelled:
                    continue
                task.started, task.worker = time.monotonic(), me
                task.batch.running.add(task)
            try:
                outcome = Outcome(value=task.fn(*task.args, **task.kwargs))
            except BaseException as exc:  # handed to the caller, who decides what is fatal
                outcome = Outcome(error=exc)
            with self._cond:
                if not task.timed_out:
                    task.outcome = outcome
                    task.batch.running.discard(task)
                    task.batch.remaining -= 1
                    if not task.batch.remaining:
                        self._cond.notify_all()
                if me in self._abandoned:  # replaced while stuck: leave the pool
                    self._abandoned.remove(me)
                    return

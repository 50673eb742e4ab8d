"""Run a batch of reward-function calls under one wall-clock deadline, so that a hanging reward cannot hang training.

The deadline is the batch's: every call of one `map` must have finished `timeout_s` seconds after the `map` began
(`rounds` × that where the caller runs more calls than workers on purpose, as an episode driver's environment steps).
Per-call deadlines alone made a step wait for them one after another (16 hanging calls at 10 s each held a step for
179 s); with one deadline a step's reward phase takes at most `timeout_s`, however many calls hang. At the deadline, a
call still running is abandoned and a call not yet started is skipped; both are reported as timed out. Within a
longer batch (rounds > 1) a call is also abandoned once it has run `timeout_s` on its own, so that a hung call gives
its worker (a fresh thread) to the calls queued behind it instead of holding it to the batch's deadline and making
healthy calls miss it.

Why daemon threads, and what that costs. A call that passes the deadline is reported as timed out and the caller
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
`gspo.sandbox`, whose child process is killed at its own limits. The threads are daemons, so the abandoned
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
    deadline: float | None = None  # time.monotonic() by which every call must have finished; None: no deadline
    running: set = field(default_factory=set)  # tasks started and not finished
    queued: list = field(default_factory=list)  # all the batch's tasks (those not started are skipped at the deadline)
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
    """`workers` daemon threads running batches of calls; every call of a batch must finish within `timeout_s`
    seconds of the batch's start (`rounds` × that: see `map`), and of its own start (None: no deadline)."""

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

    def map(self, calls: Sequence[tuple[Callable[..., Any], tuple, dict]], rounds: int = 1) -> list[Outcome]:
        """Run each `(fn, args, kwargs)` and return their outcomes in the same order; never raises for a call.
        `rounds`: the deadline is `rounds` × timeout_s (an episode driver gives each of its ⌈calls / workers⌉ rounds
        of environment steps the time of one); a call is also abandoned once it has run timeout_s itself."""
        batch = _Batch(remaining=len(calls),
                       deadline=None if self.timeout_s is None else time.monotonic() + self.timeout_s * rounds)
        tasks = [_Task(fn, tuple(args), dict(kwargs), batch) for fn, args, kwargs in calls]
        batch.queued = tasks
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
        """At the batch's deadline (called with the lock held): abandon the running calls (each replaced by a fresh
        worker), skip those not started, and end the batch. Returns how long to wait before looking again: until the
        deadline; None (no deadline: workers wake the caller when all calls are done); 0 once the batch is over."""
        if batch.deadline is None:
            return None
        now = time.monotonic()
        if now < batch.deadline:
            for task in [t for t in batch.running if now >= t.started + self.timeout_s]:  # over its own time
                self._abandon(task)
            if not batch.remaining:
                return 0.0
            return min([batch.deadline, *(t.started + self.timeout_s for t in batch.running)]) - now
        batch.cancelled = True  # workers skip the calls still queued
        for task in batch.queued:
            if task.outcome is None and not task.timed_out:
                if task in batch.running:
                    self._abandon(task)
                else:
                    task.timed_out = True
        batch.remaining = 0
        return 0.0  # do not wait: the batch is over

    def _abandon(self, task: _Task) -> None:
        """Report a running call as timed out and replace its (stuck) worker; called with the lock held."""
        task.timed_out = True
        task.batch.running.discard(task)
        task.batch.remaining -= 1
        self._abandoned.append(task.worker)
        self._spawn()

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
                self._cond.notify_all()  # the caller's next wake-up: this call's own time limit
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

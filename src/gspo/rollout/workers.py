"""Asynchronous rollouts (`rollout.mode: async`): worker processes generate while the learner trains.

    learner   step k: take a finished batch from a worker (dropping any older than `max_staleness` versions), train
              on it with policy version k, publish version k + 1 into the shared weights
    worker    claim the next batch index i, wait until version + skipped >= i - max_staleness is published, generate
              (or play the episodes of an `env` run) and score batch i with its own engine, send it to the learner
              through its own pipe

`skipped` counts the batch indices that will never be trained (lost with workers that died twice generating them,
dropped as stale; at a resume,
those the run had passed by then and will not redo): without it each one would use up a version of the bound for good,
and once more than `max_staleness` were skipped every worker would wait for a version the learner cannot publish.

A worker's engine is the one `rollout.engine` names (`gspo.rollout.worker_engine`): the built-in sampler on its own
copy of the weights, an in-process vLLM engine, or a vLLM server of its own (`rollout.vllm.server_url[worker]`).

The wait is the back-pressure: a worker is never more than max_staleness + 1 batches ahead of the learner, so what is
in flight is bounded. Each worker has a pipe of its own (one writer: a worker killed mid-message cannot leave a shared
queue's lock held), replaced when the worker is restarted.

With `partial`, a worker takes newly published weights between two decode steps, so a generation in flight continues
under them (a partial rollout, §5.4): each token keeps the version and the engine log-probability it was sampled with,
so π_old is per token (`old_logprobs: rollout`). Batch i draws its prompts and seeds exactly as sync step i would.

Which weights a token was sampled with depends on timing, so async runs are not bit-reproducible (sync runs are). A
worker that dies (killed, out of memory) is restarted with the current weights and generates the batch it held again
first (`retried_batches`); a batch that kills its worker a second time is not tried again but counted as lost
(`lost_batches`: its prompts are skipped, e.g. one whose sampling runs out of memory every time). An exception in a
worker stops the run with the worker's traceback, except a ValueError (a ConfigError included: a bad input the worker
met, e.g. an environment's reset that failed), which the learner raises as it is, with the message a sync run would give
(the worker's traceback logged at debug level). On resume, batch indices continue after the highest one trained, and the
batches in flight at the checkpoint are generated again: a checkpoint keeps the indices below that one which were
claimed but had not arrived (`rollout_pending`; with several workers a later batch can arrive and be trained first), and
workers claim those before any new index, so a crash skips no prompts; one of them that a worker already died generating
(`rollout_retried`) is lost at its next death, as it would have been without the crash.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.multiprocessing as mp

from gspo.rollout.dynamic import NoSignal, Sampled
from gspo.rollout.weights import unwrap_model
from gspo.trajectory import NO_VERSION, Trajectory

__all__ = ["ROLLOUT_COUNTS", "AsyncRollouts", "SharedRollouts", "WorkerBatch", "WorkerError", "drain",
           "registered_rewards", "staleness_metrics", "token_staleness"]

log = logging.getLogger(__name__)

IDLE = -1  # a worker's in-flight index when it is not generating
# what checkpoints keep of the rollouts
ROLLOUT_COUNTS = ("dropped_stale", "lost_batches", "retried_batches", "worker_restarts")


def drain(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Iterate a weight stream without keeping it: a process that does not publish still takes part in gathering
    FSDP-sharded tensors, a collective (`gspo.rollout.policy_weights`)."""
    for _ in weights:
        pass


class WorkerError(RuntimeError):
    """A rollout worker raised: its traceback is the message."""


@dataclass
class WorkerBatch:
    """One finished batch, as a worker sends it (CPU tensors)."""

    index: int
    traj: Trajectory
    rewards: torch.Tensor
    stats: dict[str, float]
    seconds: float  # the worker's generation + scoring time
    # reward failures / timeouts counted while scoring this batch (and, once taken, the batches dropped as stale before
    # it: `AsyncRollouts.next`)
    failures: dict[str, dict[str, int]]
    sampled: Sampled  # every completion sampled for it (dynamic sampling: more than kept), for the reward metrics


def merge_failures(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Two batches' reward failure / timeout counts ({kind: {function: count}}) as one."""
    kinds = {**a, **b}
    return {kind: {name: a.get(kind, {}).get(name, 0) + b.get(kind, {}).get(name, 0)
                   for name in {**a.get(kind, {}), **b.get(kind, {})}} for kind in kinds}


def token_staleness(traj: Trajectory, version: int) -> torch.Tensor:
    """[N, T] how many versions older than `version` (the policy being trained) each response token's sampler was;
    0 off the loss mask."""
    valid = traj.loss_mask.bool() & (traj.versions != NO_VERSION)
    return torch.where(valid, version - traj.versions, 0)


def staleness_metrics(traj: Trajectory, version: int, buckets: int = 4) -> dict[str, float]:
    """Per-step staleness: mean and max over the loss tokens, and the histogram as fractions of tokens that are
    0, 1, ..., `buckets` - 1 and >= `buckets` versions old (`staleness_frac_0`, ..., `staleness_frac_4+`)."""
    valid = traj.loss_mask.bool() & (traj.versions != NO_VERSION)
    age = token_staleness(traj, version)[valid].float()
    if age.numel() == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    hist = {f"staleness_frac_{b}": float((age == b).float().mean()) for b in range(buckets)}
    hist[f"staleness_frac_{buckets}+"] = float((age >= buckets).float().mean())
    return {"staleness_mean": float(age.mean()), "staleness_max": float(age.max()), **hist}


class SharedWeights:
    """The learner's latest weights in shared memory plus their version; a worker copies them into its engine, never
    a half-written set. The lock is a file lock (flock: the learner writes exclusively, workers read shared): the
    kernel releases it when its holder dies, so a worker killed while copying cannot block the learner."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], ctx) -> None:
        self.tensors = {name: t.detach().to("cpu", copy=True).share_memory_() for name, t in weights}
        self.version = ctx.Value("q", NO_VERSION, lock=False)
        fd, self.lock_path = tempfile.mkstemp(prefix="gspo-weights-", suffix=".lock")
        os.close(fd)
        self._fd: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}  # each process opens the lock file itself

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        import fcntl  # POSIX only: async rollouts need it, nothing else does

        if self._fd is None:
            self._fd = os.open(self.lock_path, os.O_RDWR)
        fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @torch.no_grad()
    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with self._locked(exclusive=True):
            for name, t in weights:
                self.tensors[name].copy_(t)
            self.version.value = version

    def pull(self, engine) -> None:
        """Give `engine` the published weights if it does not have them yet."""
        if engine.version != self.version.value:
            with self._locked(exclusive=False):
                engine.update_weights(self.tensors.items(), int(self.version.value))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)


def worker_policy(model_config, cfg, device: str) -> torch.nn.Module:
    """The policy's architecture as a rollout worker builds it, in the policy's dtype (`model.dtype`), as the learner's
    own engine samples it (under `trainer.mixed_precision`'s autocast over float32): from the config alone it was
    float32, so a bf16 or fp16 run's workers sampled in float32 what its synchronous engine samples in bf16 / fp16.
    The built-in sampler samples with it; vLLM engines only read its layout (on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    from gspo.models import resolve_dtype

    with torch.device(device if cfg.rollout.engine == "hf" else "meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=resolve_dtype(cfg.model.dtype))


def _worker_main(worker: int, model_config, tokenizer, cfg, train_rows: list[dict], shared: SharedWeights, channel,
                 claim, redo, redone, in_flight, skipped, device: str, out: str, source: str | None,
                 registered: dict, retry: int = IDLE) -> None:
    """A rollout worker process: claim, wait for fresh-enough weights, generate (or play episodes), score, send; until
    the learner stops it. `retry`: the batch index a worker that died held, which this one generates first. Its
    engine (`gspo.rollout.worker_engine`: the built-in sampler or vLLM) is built for the policy's architecture and
    takes every weight from `shared`. Exceptions go to the learner as ("error", worker, traceback); a ValueError (a
    bad input's clean message) as ("value_error", worker, traceback, message, whether it is a ConfigError)."""
    from gspo.agent import build_env, make_episode_runner
    from gspo.rewards import REWARDS, RewardRunner, counted_completions, score_trajectory
    from gspo.rollout import worker_engine
    from gspo.rollout.dynamic import Scored, keep_informative
    from gspo.schedule import step_prompts

    try:
        torch.set_num_threads(cfg.rollout.worker_threads)
        REWARDS.update(registered)  # rewards the learner's process registered by name
        ro = cfg.rollout
        model = worker_policy(model_config, cfg, device)
        engine = worker_engine(cfg, model, tokenizer, worker=worker, out=out, source=source)
        del model
        engine.version = NO_VERSION  # nothing published taken yet
        make_env, _ = build_env(cfg)
        episodes = make_episode_runner(cfg, engine, tokenizer, make_env) if make_env is not None else None
        rewards = RewardRunner.from_config(cfg.rewards, device)
        if ro.partial:
            engine.between_tokens = lambda: shared.pull(engine)

        def sample(rows: list[dict], seeds: list[int]) -> Scored:
            if episodes is not None:
                traj = episodes.run(rows, ro.group_size, seeds).to("cpu")
            else:
                traj = engine.generate([r["prompt"] for r in rows], ro.group_size, seeds).to("cpu")
            total, stats = score_trajectory(rewards, rows, traj, cfg.rewards, ro.max_new_tokens)
            return Scored(traj, total.cpu(), stats, 0.0)

        while True:
            with claim.get_lock():  # claimed and held as one: a worker killed now leaves no index uncounted
                if retry != IDLE:  # what the worker this one replaces died generating
                    i, retry = retry, IDLE
                elif redone.value < len(redo):  # a resume's batches in flight at its checkpoint come first
                    i = redo[redone.value]
                    redone.value += 1
                else:
                    i = claim.value
                    claim.value += 1
                in_flight[worker] = i
            # the staleness bound, enforced before generating, over the indices that will be trained
            while shared.version.value + skipped.value < i - ro.max_staleness:
                time.sleep(0.002)
            shared.pull(engine)
            t0 = time.perf_counter()
            rows, seeds = step_prompts(i, train_rows, ro.prompts_per_step, cfg.trainer.seed)  # as sync step i
            before = rewards.state_dict()
            scored = sample(rows, seeds)
            counted = partial(counted_completions, cfg)
            if ro.dynamic_sampling:  # as the sync collect of step i: refill rounds until P informative groups
                scored, every = keep_informative(i, train_rows, scored, sample, ro, cfg.trainer.seed,
                                                 pad_id=engine.pad_id, counted=counted)
            else:
                every = Sampled.of([scored], counted)
            after = rewards.state_dict()
            failures = {kind: {name: n - before[kind][name] for name, n in counts.items()}
                        for kind, counts in after.items()}
            batch = WorkerBatch(i, scored.traj, scored.rewards, scored.stats, time.perf_counter() - t0, failures,
                                every)
            # plain pickle bytes: tensors sent through torch's shared-memory reductions live in the sender's file
            # descriptors, which a worker killed right after sending takes with it
            channel.send_bytes(pickle.dumps(batch))  # killed before it returns: the batch is lost
            with claim.get_lock():
                if in_flight[worker] == i:  # (the learner may have marked it taken already)
                    in_flight[worker] = IDLE
    except NoSignal as e:  # dynamic sampling found no informative group: the learner stops as a sync run does
        channel.send_bytes(pickle.dumps(("no_signal", worker, str(e))))
    except ValueError as e:  # a bad input (config, data, environment): the learner raises its message as sync would
        from gspo.config import ConfigError

        channel.send_bytes(pickle.dumps(("value_error", worker, traceback.format_exc(), str(e),
                                         isinstance(e, ConfigError))))
    except Exception:  # everything else goes to the learner, which raises it with the worker's traceback
        channel.send_bytes(pickle.dumps(("error", worker, traceback.format_exc())))


class SharedRollouts:
    """Asynchronous rollouts under torchrun: rank 0 runs the worker processes (`AsyncRollouts`, `inner`), and every
    process trains on each batch it takes, which rank 0 broadcasts with its bookkeeping, so that the processes train
    their shares of one batch, as in sync mode. The other processes take part in what is collective (gathering sharded
    weights for a publish) and mirror the counts that checkpoints keep."""

    def __init__(self, group, inner: AsyncRollouts | None, start_index: int, counts: dict[str, int],
                 pending: Sequence[int] = (), retried: Sequence[int] = ()) -> None:
        self.group, self.inner = group, inner
        self.next_index, self.counts, self._ahead = start_index, {**dict.fromkeys(ROLLOUT_COUNTS, 0), **counts}, 0
        self.pending, self.retried = list(pending), list(retried)

    def next(self, version: int) -> tuple[WorkerBatch, float]:
        """Rank 0's next batch (`AsyncRollouts.next`) on every process; the wait is rank 0's."""
        payload: Any = None
        if self.inner is not None:
            try:
                item, waited = self.inner.next(version)
                payload = (item, waited, self.inner.ahead(), dict(self.inner.counts), self.inner.next_index,
                           self.inner.pending(), sorted(self.inner.retried))
            except (NoSignal, WorkerError, ValueError) as e:
                payload = e  # every process raises it, none waits for a batch that never comes
        payload = self.group.broadcast_object(payload)
        if isinstance(payload, Exception):
            raise payload
        item, waited, self._ahead, self.counts, self.next_index, self.pending, self.retried = payload
        return item, waited

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Rank 0 publishes; every process iterates `weights` (under FSDP each tensor is gathered collectively)."""
        if self.inner is not None:
            self.inner.publish(weights, version)
        else:
            drain(weights)

    def ahead(self) -> int:
        return self._ahead

    def state_dict(self) -> dict[str, Any]:
        """As `AsyncRollouts.state_dict`, as of the last batch taken (a batch arriving later settles nothing that the
        checkpoint after this step keeps: it is trained after it)."""
        return {"rollout_index": self.next_index, "rollout_pending": self.pending,
                "rollout_retried": [i for i in self.retried if i in self.pending], **self.counts}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def registered_rewards(cfg) -> dict:
    """The run's reward functions that this process registered by name in `gspo.rewards.REWARDS` (a worker is a new
    process: it sees only the built-in ones), checked to be picklable: sent by reference, so defined at module
    level. Import-path rewards (`package.module:function`) are imported by the workers themselves."""
    from gspo.rewards import REWARDS

    registered = {name: REWARDS[name] for name in cfg.rewards.functions if name in REWARDS}
    for name, fn in registered.items():
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise ValueError(f"rollout.mode=async: reward {name!r} (registered in gspo.rewards.REWARDS) cannot be sent "
                             f"to the rollout worker processes ({e}); define it as a module-level function, or name "
                             "it by import path 'package.module:function'") from None
    return registered


def _exit_reason(code: int | None) -> str:
    """A dead worker's exit code in words: a signal by name (SIGKILL is what the out-of-memory killer sends)."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        return f"killed by {name}" + (": out of memory, or kill -9" if name == "SIGKILL" else "")
    return f"exit code {code}"


class AsyncRollouts:
    """The learner's side of asynchronous rollouts: the worker processes, their pipes, the shared weights."""

    def __init__(self, cfg, model: torch.nn.Module, tokenizer, train_rows: list[dict], weights, version: int,
                 start_index: int = 0, device: str = "cpu", counts: dict[str, int] | None = None,
                 out: str = ".", pending: Sequence[int] = (), retried: Sequence[int] = ()) -> None:
        from gspo.rollout import prepare_worker_source

        ro = cfg.rollout
        self.cfg, self.tokenizer, self.train_rows, self.device, self.out = cfg, tokenizer, train_rows, device, out
        self.source = prepare_worker_source(cfg, model, tokenizer, out)  # what workers' vLLM engines load at start
        self.registered = registered_rewards(cfg)
        self.ctx = mp.get_context("spawn")  # fork would copy the learner's threads and locks
        self.shared = SharedWeights(weights, self.ctx)
        self.shared.publish((), version)
        # a (re)started worker builds this architecture; weights come from `shared`
        self.model_config = unwrap_model(model).config
        self.claim = self.ctx.Value("q", start_index)
        # a resume's indices below `start_index` in flight at its checkpoint, claimed (under claim's lock) first
        self.redo = self.ctx.Array("q", list(pending), lock=False)
        self.redone = self.ctx.Value("q", 0, lock=False)
        self.in_flight = self.ctx.Array("q", [IDLE] * ro.workers)
        # indices that will never be trained: at a resume those the run passed and will not redo (its next index less
        # its version, the batches trained, less the pending ones)
        self.skipped = self.ctx.Value("q", start_index - version - len(pending), lock=False)
        self.next_index = start_index  # after the last trained batch: where a resume continues
        # what `pending` reports: every index below next_index was claimed; those below `floor` and those in
        # `settled` have arrived (trained or dropped) or were lost
        self.floor = min([*pending, start_index])
        self.settled = set(range(self.floor, start_index)) - set(pending)
        self.counts = {**dict.fromkeys(ROLLOUT_COUNTS, 0), **(counts or {})}
        # the reward failures / timeouts of batches dropped as stale since the last batch taken: the next batch taken
        # carries them, so that the run counts every call that failed (the dropped batch's rewards were computed too)
        self.dropped_failures: dict[str, dict[str, int]] = {}
        # indices a worker died generating once (a second death loses them; a resume's pending ones among them too)
        self.retried: set[int] = set(retried)
        self.workers: list = [None] * ro.workers
        self.readers: list = [None] * ro.workers
        for w in range(ro.workers):
            self._start(w)

    def _start(self, worker: int, retry: int = IDLE) -> None:
        reader, writer = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(
            target=_worker_main, daemon=True, name=f"gspo-rollout-{worker}",
            args=(worker, self.model_config, self.tokenizer, self.cfg, self.train_rows, self.shared, writer,
                  self.claim, self.redo, self.redone, self.in_flight, self.skipped, self.device, str(self.out),
                  self.source, self.registered, retry))
        process.start()
        writer.close()  # the worker holds the only write end: its death reads as end-of-file here
        self.workers[worker], self.readers[worker] = process, reader

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The learner's new weights, version `version`, to every worker (read at their next poll)."""
        self.shared.publish(weights, version)

    def next(self, version: int) -> tuple[WorkerBatch, float]:
        """The next batch no more than `max_staleness` versions older than `version` (older ones are dropped and
        counted), and the seconds the learner waited for it. Restarts dead workers while waiting."""
        t0 = time.perf_counter()
        while True:
            ready = wait(self.readers, timeout=0.1)
            if not ready:
                continue
            w = self.readers.index(ready[0])
            try:
                item = pickle.loads(self.readers[w].recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):  # the worker died (perhaps mid-message)
                self._restart(w)
                continue
            if isinstance(item, tuple):
                if item[0] == "no_signal":
                    raise NoSignal(item[2])
                if item[0] == "value_error":  # the clean message of a bad input, as a sync run raises it
                    from gspo.config import ConfigError

                    log.debug("rollout worker %d raised:\n%s", item[1], item[2])
                    raise (ConfigError if item[4] else ValueError)(item[3])
                raise WorkerError(f"rollout worker {item[1]} failed:\n{item[2]}")
            with self.claim.get_lock():  # arrived: a death of its worker from now on loses no batch
                if self.in_flight[w] == item.index:
                    self.in_flight[w] = IDLE
            self._settle(item.index)
            sampled = item.traj.versions[item.traj.versions != NO_VERSION]
            oldest = int(sampled.min()) if sampled.numel() else version
            if version - oldest > self.cfg.rollout.max_staleness:
                self.counts["dropped_stale"] += 1
                self.skipped.value += 1
                self.dropped_failures = merge_failures(self.dropped_failures, item.failures)
                continue
            self.next_index = max(self.next_index, item.index + 1)
            item.failures, self.dropped_failures = merge_failures(item.failures, self.dropped_failures), {}
            return item, time.perf_counter() - t0

    def _restart(self, w: int) -> None:
        """Worker `w` died: start a new one on a new pipe, which generates the batch `w` held again first; a batch
        that a worker already died generating is counted as lost instead (it may be what kills them)."""
        process = self.workers[w]
        process.join(timeout=10)
        self.readers[w].close()
        held, retry = int(self.in_flight[w]), IDLE
        if held != IDLE and held in self.retried:
            self.counts["lost_batches"] += 1
            self.skipped.value += 1
            self._settle(held)
            self.in_flight[w] = IDLE
            log.warning("rollout batch %d was lost: a worker died generating it twice (counted in "
                        "rollout_lost_batches; its prompts are skipped)", held)
        elif held != IDLE:  # generated again; in_flight[w] keeps it, so a new worker dying before it claims it loses it
            self.retried.add(held)
            self.counts["retried_batches"] += 1
            retry = held
        log.warning("rollout worker %d died (%s); restarted%s", w, _exit_reason(process.exitcode),
                    f", generating batch {retry} again" if retry != IDLE else "")
        self.counts["worker_restarts"] += 1
        if self.counts["worker_restarts"] > 10 * len(self.workers):
            raise WorkerError(f"rollout workers died {self.counts['worker_restarts']} times (the last one "
                              f"{_exit_reason(process.exitcode)}); giving up")
        self._start(w, retry)

    def ahead(self) -> int:
        """Batches the workers have claimed beyond the last one the learner took (bounded: back-pressure)."""
        return int(self.claim.value) - self.next_index

    def pending(self) -> list[int]:
        """The batch indices below `next_index` that were claimed but have not arrived (nor been lost): generating,
        or sent and not yet read. A resume from a checkpoint taken now generates them again, or their prompts would be
        skipped (with several workers a later index can arrive, and be trained, before them)."""
        return sorted(set(range(self.floor, self.next_index)) - self.settled)

    def _settle(self, *indices: int) -> None:
        """Mark batch indices as arrived or lost; the settled ones at the bottom move into `floor`."""
        self.settled.update(indices)
        while self.floor in self.settled:
            self.settled.remove(self.floor)
            self.floor += 1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: where the batch indices continue, the ones in flight below it (and which of those
        a worker already died generating), and the counts."""
        pending = self.pending()
        return {"rollout_index": self.next_index, "rollout_pending": pending,
                "rollout_retried": sorted(self.retried.intersection(pending)), **self.counts}

    def close(self) -> None:
        """Stop the workers (they may be blocked sending, or waiting for weights)."""
        for process in self.workers:
            if process.is_alive():
                process.terminate()
        for process, reader in zip(self.workers, self.readers, strict=True):
            process.join(timeout=10)
            reader.close()
        self.shared.close()

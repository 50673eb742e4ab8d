"""The process group of a run and the collectives the trainer needs; one process (no torchrun) is the default
`ProcessGroup()`, whose every method is then the identity or a no-op.

What makes N processes train exactly like one (up to floating-point summation order):

* **Rollouts.** Each step's P prompts and their seeds are chosen globally (by step and *global* prompt position); rank
  r generates and scores the contiguous share `shard(P)` of them, i.e. whole groups, then every process gathers the
  whole batch (`gather_trajectories`), so group advantages, the minibatch permutation and all batch metrics are those
  of one process.
* **Updates.** Each minibatch of the global permutation is split into W equal contiguous shares (`share`); rank r runs
  the π_old and π_θ forwards of its share only. Each objective is normalised by its *global* count (sequences,
  tokens or B·L, summed over the shares with `all_sum`: see `gspo.objectives.Objective.count`), and DDP/FSDP average
  gradients over processes, so the gradient is the one-process gradient whatever the shares hold.
* **Consistency.** An update is skipped on every process or on none (`all_finite`); the update metrics are combined
  over processes as one process would have computed them, sums and counts summed, extrema by max or min
  (`reduce_metrics`); per-row results of the shares are gathered back (`merge_rows`).
* **Files.** Only rank 0 writes run files; evaluation is sharded over processes and combined as one evaluation of
  all the rows (`evaluate`, `gspo.evaluation.merge_shards`).

Wrapping the policy (DDP / FSDP2) is `gspo.parallel.wrap`; the training state of a wrapped policy (checkpoints, the
final model) is `gspo.parallel.state`.
"""

from __future__ import annotations

import datetime
import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gspo.config import ConfigError
from gspo.rewards import mean_reward_stats, weighted_reward_stats
from gspo.trajectory import Trajectory

__all__ = ["ProcessGroup", "init_distributed", "on_shutdown", "resolve_device", "shutdown"]

log = logging.getLogger(__name__)

_TIMEOUT = datetime.timedelta(minutes=60)  # the process group's collectives
MAIN_FIRST_TIMEOUT = datetime.timedelta(hours=48)
"""How long the other processes wait for rank 0's work in `ProcessGroup.main_first` (a cold-start SFT of a large model
takes hours, longer than the process group's timeout). If rank 0 fails instead, torchrun stops them at once."""


def resolve_device(device: str = "auto", local_rank: int = 0, local_world_size: int = 1,
                   key: str = "trainer.device") -> torch.device:
    """What `trainer.device` means for process `local_rank` of the `local_world_size` processes on this machine; `key`
    names the setting in errors (a command's `--device`).

    cpu: the CPU. cuda: GPU `local_rank`; ConfigError if CUDA is unavailable or there are fewer visible GPUs than
    processes on the machine (one GPU per process: two processes on one GPU is refused, not shared). auto: GPU
    `local_rank` when every process has a GPU of its own, else the CPU (gloo), with a warning when there are GPUs,
    but too few."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda, but CUDA is not available (torch.cuda.is_available() is False)")
    gpus, processes = torch.cuda.device_count(), max(local_world_size, local_rank + 1)
    if processes > gpus:
        if device == "cuda":
            raise ConfigError(f"{key}=cuda: {processes} processes on this machine (LOCAL_WORLD_SIZE) but only "
                              f"{gpus} visible CUDA device(s), and each process needs one of its own: start at most "
                              f"{gpus} (torchrun --nproc_per_node={gpus}), make more GPUs visible "
                              f"(CUDA_VISIBLE_DEVICES), or set {key}=cpu")
        if local_rank == 0:
            log.warning("trainer.device=auto: %d processes on this machine (LOCAL_WORLD_SIZE) but only %d visible CUDA "
                        "device(s): every process trains on the CPU (gloo). Start at most %d processes per machine "
                        "to train on the GPUs", processes, gpus, gpus)
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def _backend_devices(backend: str) -> set[str]:
    """The device types a process group's backend reduces tensors of: "nccl" → {"cuda"}; "cpu:gloo,cuda:nccl" →
    {"cpu", "cuda"}; a backend torch has no record of is taken to take any."""
    if ":" in backend:
        return {part.split(":")[0].strip() for part in backend.split(",")}
    return set(dist.Backend.backend_capability.get(backend, ["cpu", "cuda"]))


def init_distributed(parallel: str = "ddp", device: str = "auto") -> ProcessGroup:
    """The process group of this run: from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
    else one process.

    Initialises the default process group (NCCL on GPUs, gloo on CPUs) unless it already is (then a ConfigError when
    its backend cannot reduce the run's tensors: NCCL on the CPU), and selects this process's GPU (LOCAL_RANK) when
    training on CUDA (`resolve_device`: one GPU per process on the machine, else the CPU for `auto` and a ConfigError
    for `cuda`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    # without its place on its machine, each process would pick its GPU (and so its backend) blind to the others
    missing = [k for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if k not in os.environ]
    if world > 1 and missing and not dist.is_initialized():
        raise ConfigError(f"WORLD_SIZE={world} without {' and '.join(missing)}: each process's GPU and backend are "
                          "chosen from its place on its machine; start the processes with torchrun, which sets them, "
                          "or set them as torchrun does")
    target = resolve_device(device, local_rank, local_world)
    if dist.is_available() and dist.is_initialized() and target.type not in _backend_devices(dist.get_backend()):
        # a group the caller started (e.g. a launcher's NCCL one) whose collectives cannot take this device's tensors
        raise ConfigError(f"the process group was initialised with the {dist.get_backend()} backend, which cannot "
                          f"reduce {target.type} tensors, but this run trains on the {target.type} "
                          f"(trainer.device={device}): initialise it with a backend for both (e.g. "
                          "'cpu:gloo,cuda:nccl'), or leave that to gspo")
    if target.type == "cuda":
        torch.cuda.set_device(target)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if target.type == "cuda" else "gloo", timeout=_TIMEOUT)
    return ProcessGroup(rank=rank, world_size=world, local_rank=local_rank, parallel=parallel, device=target)


_TEARDOWNS: list[Callable[[], None]] = []


def on_shutdown(teardown: Callable[[], None]) -> None:
    """Have `shutdown` call `teardown` (once, however often it is registered) after its barrier and before it destroys
    the process group: for a library that built process groups of its own on the default one and holds them until
    the interpreter exits (vLLM's in-process engine), to destroy them first. `destroy_process_group()` destroys every
    group, and the library's own teardown at exit then fails on the groups it still holds ("ValueError: Invalid
    process group specified", a traceback after a successful run)."""
    if teardown not in _TEARDOWNS:
        _TEARDOWNS.append(teardown)


def shutdown() -> None:
    """Tear the process group down (at the end of `gspo train` under torchrun, after success; in one process, the
    group vLLM started for its engine).

    First the run's dead wrapped models are collected (their DDP reducer / FSDP mesh hold the process group, in
    reference cycles that only the garbage collector frees) and every process passes a barrier (no collective left in
    flight); then the libraries registered with `on_shutdown` tear their own groups down, and the group is destroyed
    while Python still runs. Otherwise the group lives on until the interpreter shuts down, and a gloo thread that
    releases a finished collective's tensors then cannot take the GIL: the process aborts ("terminate called without
    an active exception", SIGABRT) after a successful run (3 of 77 runs of the 2-process FSDP checkpoint test's
    workers before, 0 of 70 after)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        while _TEARDOWNS:
            _TEARDOWNS.pop(0)()
        if dist.is_initialized():  # a library's teardown may have destroyed the default group as well (vLLM's does)
            dist.destroy_process_group()


@dataclass
class ProcessGroup:
    """This process's place in the run and the collective operations the trainer needs (identity for 1 process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = "ddp"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.parallel == "fsdp"

    # ----------------------------------------------------------------------------------------- splitting work

    def check_sizes(self, prompts_per_step: int, group_size: int, minibatches: int) -> None:
        """Raise ValueError unless every process gets whole groups and equal minibatch shares."""
        w = self.world_size
        if prompts_per_step % w:
            raise ValueError(f"rollout.prompts_per_step={prompts_per_step} must be divisible by the {w} processes "
                             "(each generates whole groups)")
        per_minibatch = prompts_per_step * group_size // minibatches
        if per_minibatch % w:
            raise ValueError(f"a minibatch of {per_minibatch} completions does not split into {w} equal shares: "
                             "adjust rollout.prompts_per_step, group_size or algorithm.minibatches")

    def shard(self, n: int) -> slice:
        """This process's contiguous equal share of `n` items (n divisible by the number of processes)."""
        if n % self.world_size:
            raise ValueError(f"{n} items do not split into {self.world_size} equal shares")
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def share(self, indices: torch.Tensor) -> torch.Tensor:
        """This process's contiguous equal share of one minibatch's row indices."""
        return indices[self.shard(len(indices))]

    def _uneven_shard(self, n: int) -> slice:
        """A contiguous share of `n` items; shares differ by at most one (evaluation rows)."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    # ----------------------------------------------------------------------------------------- collectives

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def main_first(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on rank 0, then, once it is done, on the other processes: for work whose files rank 0 writes and
        the others then read (cold-start SFT, repairing the checkpoint folder after a crash). The others wait at a
        barrier of a gloo group made for it with `MAIN_FIRST_TIMEOUT`, not at the process group's (60 minutes, which a
        long cold start on rank 0 outlasted, so the waiting processes failed)."""
        if not self.enabled:
            return fn()
        wait = dist.new_group(backend="gloo", timeout=MAIN_FIRST_TIMEOUT)  # every process, before rank 0 starts
        try:
            result = fn() if self.is_main else None
            dist.barrier(group=wait)
        finally:
            dist.destroy_process_group(wait)
        return result if self.is_main else fn()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of every process along dim 0, in rank order."""
        wire = tensor.to(self.device)
        if wire.dtype in (torch.bool, torch.int16, torch.int8):  # not every backend reduces these
            wire = wire.to(torch.int32)
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        dist.all_gather(parts, wire.contiguous())
        return torch.cat(parts).to(tensor.dtype)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (pickled; what the others pass is ignored)."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_sum(self, values: list[float]) -> list[float]:
        """Each value summed over processes (float64)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_max(self, values: list[int]) -> list[int]:
        """Each value's maximum over processes."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_finite(self, *values: torch.Tensor) -> bool:
        """Whether all `values` are finite on every process (so all processes skip or apply an update together)."""
        ok = bool(torch.stack([torch.isfinite(v).all() for v in values]).all())  # one device sync
        if not self.enabled:
            return ok
        return self.all_sum([0.0 if ok else 1.0])[0] == 0

    def reduce_metrics(self, metrics: dict[str, float], op: str) -> dict[str, float]:
        """Per-process metrics combined over processes by `op`: each key's "sum", "mean", "max" or "min" (float64;
        NaN where a process has NaN). Every process must pass the same keys (checked: the values are reduced by
        position)."""
        return self.reduce_metrics_by_op({op: metrics})[op]

    def reduce_metrics_by_op(self, parts: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """`reduce_metrics` of several dicts at once, each by its op (`{op: metrics}`), in one gather of the keys and
        two all-reduces (a sum for "sum", "mean" and the NaN flags; a max for "max" and the negated "min") instead of
        three collectives per op: a step's update metrics cost the same whatever their kinds."""
        bad = [op for op in parts if op not in ("sum", "mean", "max", "min")]
        if bad:
            raise ValueError(f"reduce_metrics: op must be sum, mean, max or min, got {bad[0]!r}")
        if not self.enabled:
            return {op: dict(metrics) for op, metrics in parts.items()}
        keys = {op: sorted(metrics) for op, metrics in parts.items()}
        if any(k != keys for k in self.all_gather_object(keys)):
            raise RuntimeError(f"processes logged different metrics; rank {self.rank} has {keys}")
        entries = [(op, k, float(parts[op][k])) for op in parts for k in keys[op]]
        if not entries:
            return {op: {} for op in parts}
        sign = {"max": 1.0, "min": -1.0}  # a min is the max of the negated values
        # summed: a sum or mean's value, an extremum's NaN flag (gloo's and NCCL's max keep or drop a NaN depending on
        # the rank order); maxed: an extremum's signed value, NaN as -inf
        summed = torch.tensor([float(math.isnan(v)) if op in sign else v for op, _, v in entries],
                              dtype=torch.float64, device=self.device)
        maxed = torch.tensor([-math.inf if op not in sign or math.isnan(v) else sign[op] * v for op, _, v in entries],
                             dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        out: dict[str, dict[str, float]] = {op: {} for op in parts}
        for (op, k, _), total, top in zip(entries, summed.tolist(), maxed.tolist(), strict=True):
            if op in sign:
                out[op][k] = math.nan if total else sign[op] * top
            else:
                out[op][k] = total / self.world_size if op == "mean" else total
        return out

    # ----------------------------------------------------------------------------------------- rollouts

    def gather_trajectories(self, traj: Trajectory, rewards: torch.Tensor, stats: dict[str, float],
                            pad_id: int = 0) -> tuple[Trajectory, torch.Tensor, dict[str, float]]:
        """Every process's share of the step's trajectories, with their rewards and reward stats, combined into the
        global batch in global prompt order, on this process's device. Shares are re-padded to the widest one
        (`Trajectory.padded`). Per-function reward means (`reward/...`) are averaged over the (equal) shares, the other
        stats (counts) summed."""
        traj = traj.to(self.device)
        rewards = rewards.to(self.device)
        if not self.enabled:
            return traj, rewards, stats
        prompt_width, completion_width = self.all_max([traj.prompt_ids.shape[1], traj.completion_ids.shape[1]])
        local = traj.padded(prompt_width, completion_width, pad_id)
        n_prompts = int(traj.prompt_index.max()) + 1
        extras = {k: self.all_gather(v) if isinstance(v, torch.Tensor) else v for k, v in local.extras.items()}
        tensors = {name: self.all_gather(getattr(local, name)) for name in (
            "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask", "logprobs", "versions",
            "truncated")}
        gathered = Trajectory(
            **tensors,
            completions=[c for part in self.all_gather_object(traj.completions) for c in part],
            prompt_index=self.all_gather(traj.prompt_index + self.rank * n_prompts),
            token_rewards=None if local.token_rewards is None else self.all_gather(local.token_rewards),
            extras=extras,
        )
        keys = sorted(stats)  # the same keys on every process (a function's mean is 0 over no rows, not missing)
        sums, weights = weighted_reward_stats(stats, len(rewards))  # each mean × its rows: summed, then divided
        totals = self.all_sum([sums[k] for k in keys] + [weights[k] for k in keys])
        merged = mean_reward_stats(dict(zip(keys, totals[:len(keys)], strict=True)),
                                   dict(zip(keys, totals[len(keys):], strict=True)))
        return gathered, self.all_gather(rewards), merged

    def merge_rows(self, tensor: torch.Tensor | None, minibatches: list[torch.Tensor]) -> torch.Tensor | None:
        """A per-row tensor of the global batch of which this process filled only its `minibatches` shares' rows,
        completed with every other process's rows."""
        if not self.enabled or tensor is None:
            return tensor
        own = torch.cat(list(minibatches)).to(tensor.device)
        rows = self.all_gather(own)
        values = self.all_gather(tensor[own])
        merged = tensor.clone()
        merged[rows.to(tensor.device)] = values.to(tensor.device)
        return merged

    # ----------------------------------------------------------------------------------------- evaluation

    def evaluate(self, fn: Callable[[list[dict], int], dict[str, float]], rows: list[dict],
                 after: Callable[[], None] = lambda: None) -> dict[str, float]:
        """`fn(part, offset)` (`gspo.evaluation.evaluate`'s metrics of the rows `part`, which start at position
        `offset` of `rows`) over `rows`, sharded over processes and combined as one call on all the rows gives them
        (`gspo.evaluation.merge_shards`: row means by rows, tool-call fractions by calls); with several processes every
        one then calls `after` (a collective, e.g. syncing the reward runner's counters)."""
        from gspo.evaluation import merge_shards

        if not self.enabled:
            return fn(rows, 0)
        share = self._uneven_shard(len(rows))
        part = rows[share]
        result = fn(part, share.start) if part else {}
        after()
        return merge_shards(self.all_gather_object((result, len(part))))  # rank 0's share is never empty


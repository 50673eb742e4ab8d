"""Multi-process training on torch.distributed: `torchrun --nproc_per_node=N -m gspo train CONFIG ...`.

What makes N processes train exactly like one (up to floating-point summation order):

* **Rollouts.** Each step's P prompts and their seeds are chosen globally (by step and *global* prompt position); rank
  r generates and scores the contiguous share `shard(P)` of them, i.e. whole groups, then every process gathers the
  whole batch (`gather_rollouts`: tokens, log-probabilities, rewards, text), so group advantages, the minibatch
  permutation and all batch metrics are those of one process.
* **Updates.** Each minibatch of the global permutation is split into W equal contiguous shares (`share`); rank r runs
  the π_old and π_θ forwards of its share only. The objectives average over a minibatch's sequences, and DDP/FSDP
  average gradients over processes, so equal shares give the one-process gradient; objectives that average over
  tokens (DAPO, CISPO) are rescaled per process by its share of the minibatch's tokens (`loss_scale`).
* **Consistency.** An update is skipped on every process or on none (`all_finite`); per-minibatch metrics are
  averaged over processes (`mean_metrics`); π_old and routing recomputed per share are gathered back
  (`merge_rows`) for the batch-level diagnostics.
* **Files.** Only rank 0 writes (config, metrics, evaluations, checkpoints, final model, summary); every process
  loads a checkpoint on resume. Evaluation is sharded over processes and combined by row count.

`ddp` wraps the model in `DistributedDataParallel`; `fsdp` shards it with FSDP2 (`fully_shard` per decoder layer,
then the root), for models that do not fit one device; checkpoints are then gathered to full tensors on rank 0 and
written in the same format as a one-process run, so a run can be resumed with any number of processes.
One process (no torchrun) is the `Dist()` default: every method is then the identity or a no-op.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gspo.config import ConfigError
from gspo.moe import FREE
from gspo.rollout.base import RolloutBatch

__all__ = ["TOKEN_NORMALISED", "Dist", "FullCopyEngine", "NullLogger", "init_distributed", "resolve_device", "shutdown"]

log = logging.getLogger(__name__)

TOKEN_NORMALISED = frozenset({"dapo", "cispo"})
"""Objectives whose loss is a mean over the minibatch's tokens (every other built-in one averages over sequences)."""

_COUNTERS = ("failures", "timeouts")  # cumulative per-function counters of the reward runner
_TIMEOUT = datetime.timedelta(minutes=60)  # rank 0 alone runs cold-start SFT while the others wait at a barrier


def resolve_device(device: str = "auto", local_rank: int = 0, local_world_size: int = 1) -> torch.device:
    """What `trainer.device` means for process `local_rank` of the `local_world_size` processes on this machine.

    cpu: the CPU. cuda: GPU `local_rank`; ConfigError if CUDA is unavailable or there are fewer visible GPUs than
    processes on the machine (one GPU per process: two processes on one GPU is refused, not shared). auto: GPU
    `local_rank` when every process has a GPU of its own, else the CPU (gloo), with a warning when there are GPUs,
    but too few."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda, but CUDA is not available (torch.cuda.is_available() is False)")
    gpus, processes = torch.cuda.device_count(), max(local_world_size, local_rank + 1)
    if processes > gpus:
        if device == "cuda":
            raise ConfigError(f"trainer.device=cuda: {processes} processes on this machine (LOCAL_WORLD_SIZE) but only "
                              f"{gpus} visible CUDA device(s), and each process needs one of its own: start at most "
                              f"{gpus} (torchrun --nproc_per_node={gpus}), make more GPUs visible "
                              "(CUDA_VISIBLE_DEVICES), or set trainer.device=cpu")
        if local_rank == 0:
            log.warning("trainer.device=auto: %d processes on this machine (LOCAL_WORLD_SIZE) but only %d visible CUDA "
                        "device(s): every process trains on the CPU (gloo). Start at most %d processes per machine "
                        "to train on the GPUs", processes, gpus, gpus)
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init_distributed(parallel: str = "ddp", device: str = "auto") -> Dist:
    """The process group of this run: from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE),
    else one process.

    Initialises the default process group (NCCL on GPUs, gloo on CPUs) unless it already is, and selects this
    process's GPU (LOCAL_RANK) when training on CUDA (`resolve_device`: one GPU per process on the machine, else the
    CPU for `auto` and a ConfigError for `cuda`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    target = resolve_device(device, local_rank, local_world)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if target.type == "cuda" else "gloo", timeout=_TIMEOUT)
    return Dist(rank=rank, world_size=world, local_rank=local_rank, parallel=parallel, device=target)


def shutdown() -> None:
    """Tear the process group down (at the end of `gspo train` under torchrun)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class NullLogger:
    """Stands in for the metrics logger on processes other than rank 0."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Dist:
    """This process's place in the run and the collective operations the trainer needs (identity for 1 process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    parallel: str = "ddp"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _param_names: list[str] = field(default_factory=list, repr=False)  # the optimizer's parameters, in order
    _counted: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # counters' last agreed totals

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
        the others then read (cold-start SFT, repairing the checkpoint folder after a crash)."""
        result = fn() if self.is_main else None
        self.barrier()
        return result if self.is_main else fn()

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of every process along dim 0, in rank order."""
        wire = tensor.to(self.device)
        if wire.dtype in (torch.bool, torch.int16, torch.int8):  # not every backend reduces these
            wire = wire.to(torch.int32)
        parts = [torch.empty_like(wire) for _ in range(self.world_size)]
        dist.all_gather(parts, wire.contiguous())
        return torch.cat(parts).to(tensor.dtype)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def _sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_finite(self, *values: torch.Tensor) -> bool:
        """Whether all `values` are finite on every process (so all processes skip or apply an update together)."""
        ok = all(bool(torch.isfinite(v).all()) for v in values)
        if not self.enabled:
            return ok
        return self._sum([0.0 if ok else 1.0])[0] == 0

    def loss_scale(self, loss_name: str, mask: torch.Tensor) -> float:
        """Factor on this process's minibatch loss so that DDP/FSDP's gradient average equals the one-process
        gradient: W · (this share's weight) / (the minibatch's weight), the weight being the share's sequences, or
        for token-mean objectives (`TOKEN_NORMALISED`) its tokens. Exactly 1 with equal sequence shares."""
        if not self.enabled:
            return 1.0
        weight = float(mask.sum()) if loss_name in TOKEN_NORMALISED else float(mask.shape[0])
        total = self._sum([weight])[0]
        return self.world_size * weight / total if total > 0 else 1.0

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Average per-process metrics over processes (same keys everywhere)."""
        if not self.enabled:
            return metrics
        keys = sorted(metrics)
        if any(k != keys for k in self._all_gather_object(keys)):
            raise RuntimeError(f"processes logged different metrics; rank {self.rank} has {keys}")
        return {k: v / self.world_size for k, v in zip(keys, self._sum([metrics[k] for k in keys]), strict=True)}

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        """Sum integer counters (e.g. reward failures) over processes."""
        if not self.enabled:
            return counts
        keys = sorted(counts)
        return {k: round(v) for k, v in zip(keys, self._sum([float(counts[k]) for k in keys]), strict=True)}

    # ----------------------------------------------------------------------------------------- reward counters

    def watch_counters(self, runner: Any) -> None:
        """Take the reward runner's cumulative counters (`failures`, `timeouts`: per function) as they are now, e.g.
        restored from a checkpoint, as the run's agreed totals; `sync_counters` then adds every process's new counts."""
        self._counted = {name: dict(getattr(runner, name)) for name in _COUNTERS
                         if isinstance(getattr(runner, name, None), dict)}

    def sync_counters(self, runner: Any) -> None:
        """Make the runner's counters the run's totals on every process (each process scores only its own rows)."""
        if not self.enabled or runner is None:
            return
        for name in _COUNTERS:
            counter = getattr(runner, name, None)
            if not isinstance(counter, dict):
                continue
            base = self._counted.get(name, {})
            keys = sorted(counter)
            deltas = self._sum([float(counter[k] - base.get(k, 0)) for k in keys])
            for k, delta in zip(keys, deltas, strict=True):
                counter[k] = base.get(k, 0) + round(delta)
            self._counted[name] = dict(counter)

    # ----------------------------------------------------------------------------------------- rollouts

    def gather_rollouts(self, batch: RolloutBatch, rewards: torch.Tensor, stats: dict[str, float],
                        runner: Any = None, pad_id: int = 0) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """Every process's rollout share, rewards and reward stats combined into the global batch, in global prompt
        order, on this process's device. Prompts are re-padded on the left and completions on the right to the widest
        share (`pad_id`, mask 0; routing FREE). Per-function reward means (`reward/...`) are averaged over the (equal)
        shares, the other stats (counts) summed; the reward `runner`'s cumulative counters are synced."""
        batch = _batch_to(batch, self.device)
        rewards = rewards.to(self.device)
        if not self.enabled:
            return batch, rewards, stats
        self.sync_counters(runner)
        widths = torch.tensor([batch.prompt_ids.shape[1], batch.completion_ids.shape[1]], device=self.device)
        dist.all_reduce(widths, op=dist.ReduceOp.MAX)
        s, t = (int(x) for x in widths)
        local = _pad_batch(batch, s, t, pad_id)
        n_prompts = int(batch.prompt_index.max()) + 1
        extras = dict(batch.extras)
        if "routing" in extras:
            extras["routing"] = self._all_gather(extras["routing"])
        completions = [c for part in self._all_gather_object(batch.completions) for c in part]
        gathered = RolloutBatch(
            prompt_ids=self._all_gather(local.prompt_ids),
            prompt_mask=self._all_gather(local.prompt_mask),
            completion_ids=self._all_gather(local.completion_ids),
            completion_mask=self._all_gather(local.completion_mask),
            logprobs=self._all_gather(local.logprobs),
            truncated=self._all_gather(batch.truncated),
            completions=completions,
            prompt_index=self._all_gather(batch.prompt_index + self.rank * n_prompts),
            extras=extras,
        )
        keys = sorted(stats)
        totals = self._sum([stats[k] for k in keys])
        merged = {k: v / self.world_size if k.startswith("reward/") else v for k, v in zip(keys, totals, strict=True)}
        return gathered, self._all_gather(rewards), merged

    def merge_rows(self, tensor: torch.Tensor | None, minibatches: list[torch.Tensor]) -> torch.Tensor | None:
        """A per-row tensor of the global batch of which this process filled only its `minibatches` shares' rows,
        completed with every other process's rows."""
        if not self.enabled or tensor is None:
            return tensor
        own = torch.cat(list(minibatches)).to(tensor.device)
        rows = self._all_gather(own)
        values = self._all_gather(tensor[own])
        merged = tensor.clone()
        merged[rows.to(tensor.device)] = values.to(tensor.device)
        return merged

    # ----------------------------------------------------------------------------------------- evaluation

    def evaluate(self, fn: Callable[[list[dict]], dict[str, float]], rows: list[dict],
                 runner: Any = None) -> dict[str, float]:
        """`fn` (row-mean metrics of some rows) over `rows`, sharded over processes and combined by row count; the
        reward `runner`'s counters are synced after."""
        if not self.enabled:
            return fn(rows)
        part = rows[self._uneven_shard(len(rows))]
        result = fn(part) if part else {}
        self.sync_counters(runner)
        keys = [sorted(result)]
        dist.broadcast_object_list(keys, src=0)  # rank 0's share is never empty
        sums = self._sum([result[k] * len(part) if part else 0.0 for k in keys[0]])
        return {k: v / len(rows) for k, v in zip(keys[0], sums, strict=True)}

    # ----------------------------------------------------------------------------------------- models

    def place(self, model: nn.Module) -> nn.Module:
        """Move a model to this process's device (FSDP moves only its shards, when wrapping)."""
        return model if self.fsdp else model.to(self.device)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             build_optimizer: Callable[[nn.Module], tuple[torch.optim.Optimizer, Any]],
             mixed_precision: str | None = None) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        """The training-time policy: DDP around `model`, or `model` sharded in place with FSDP2.

        FSDP replaces the parameters, so the optimizer and scheduler are rebuilt with `build_optimizer` and given the
        state of the ones passed in (non-empty after a resume). With one process everything is returned as is."""
        self._param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.enabled:
            return model, optimizer, scheduler
        if not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers (rotary tables) are constant and equal everywhere: no per-forward broadcast
            no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel).parameters else {"broadcast_buffers": False}
            return DistributedDataParallel(model, device_ids=ids, **no_sync), optimizer, scheduler
        _fully_shard(model, self.device, self.world_size, mixed_precision)
        new_optimizer, new_scheduler = build_optimizer(model)
        old = optimizer.state_dict()
        if old["state"]:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            names = self._param_names
            by_name = {
                "state": {names[i]: s for i, s in old["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in old["param_groups"]],
            }
            set_optimizer_state_dict(model, new_optimizer, by_name, options=StateDictOptions(full_state_dict=True))
        if scheduler is not None:
            new_scheduler.load_state_dict(scheduler.state_dict())
        return model, new_optimizer, new_scheduler

    def autocast(self, mixed_precision: str | None) -> contextlib.AbstractContextManager:
        """Where the training forwards run in `mixed_precision` over float32 weights: torch.autocast on this process's
        device, except under FSDP, whose MixedPrecisionPolicy (set in `wrap`) already gathers parameters in it."""
        if mixed_precision is None or self.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, mixed_precision))

    def wrap_frozen(self, model: nn.Module | None, mixed_precision: str | None = None) -> nn.Module | None:
        """A no-gradient model used in the training forwards (the KL reference): sharded like the policy under FSDP."""
        if model is not None and self.fsdp:
            _fully_shard(model, self.device, self.world_size, mixed_precision)
        return model

    @contextlib.contextmanager
    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[tuple]:
        """`(model, optimizer)` as a one-process run would save them, on rank 0; `(None, None)` elsewhere.

        DDP: the bare model and the optimizer. FSDP (collective: every process enters): views holding full tensors
        gathered to rank 0's CPU, with the optimizer state keyed like a one-process optimizer's, so the checkpoint
        is the same as a one-process run's."""
        if not self.fsdp:
            yield (_bare(model), optimizer) if self.is_main else (None, None)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        seen: set[int] = set()  # tied parameters (one object, several names): keep the first name, as HF saves
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                weights.pop(name, None)
            seen.add(id(param))
        state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
        if not self.is_main:
            yield None, None
            return
        optimizer_view = None
        if state is not None:
            index = {name: i for i, name in enumerate(self._param_names)}
            optimizer_view = _StateView({
                "state": {index[name]: s for name, s in state["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
            })
        yield _FullModelView(model, weights), optimizer_view


# ------------------------------------------------------------------------------------------------------- helpers


def _bare(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _fully_shard(model: nn.Module, device: torch.device, world_size: int, mixed_precision: str | None) -> None:
    """FSDP2: shard every decoder layer (the model's `_no_split_modules` classes), then the root (embeddings, norm,
    head). With `mixed_precision`, parameters are gathered in that dtype for compute and gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, mixed_precision),
                                                   reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        log.warning("FSDP: %s names no decoder-layer classes (_no_split_modules): sharding it as one unit",
                    type(model).__name__)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


class _FullModelView:
    """What checkpoint/final saving needs of a model (`save_pretrained`), for an FSDP model whose full weights were
    gathered into `weights`."""

    def __init__(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.weights = weights

    def save_pretrained(self, save_directory, save_original_format: bool = True, **kwargs) -> None:
        if "save_original_format" in inspect.signature(self.model.save_pretrained).parameters:
            kwargs["save_original_format"] = save_original_format
        self.model.save_pretrained(save_directory, state_dict=self.weights, **kwargs)


class _StateView:
    """What checkpoint saving needs of an optimizer (`state_dict()`), for a gathered FSDP optimizer state."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def _batch_to(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    tensors = {name: getattr(batch, name).to(device) for name in (
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "truncated", "prompt_index")}
    extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.extras.items()}
    return replace(batch, **tensors, extras=extras)


def _pad_batch(batch: RolloutBatch, prompt_len: int, width: int, pad_id: int) -> RolloutBatch:
    """`batch` with prompts left-padded to `prompt_len` and completions right-padded to `width` (routing: FREE)."""
    s, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    left, right = prompt_len - s, width - t

    def pad(x: torch.Tensor, before: int, after: int, value: float) -> torch.Tensor:
        shape = list(x.shape)
        parts = []
        if before:
            parts.append(x.new_full([shape[0], before, *shape[2:]], value))
        parts.append(x)
        if after:
            parts.append(x.new_full([shape[0], after, *shape[2:]], value))
        return torch.cat(parts, 1) if len(parts) > 1 else x

    extras = dict(batch.extras)
    if "routing" in extras:
        r = extras["routing"]
        extras["routing"] = torch.cat([pad(r[:, :s], left, 0, FREE), pad(r[:, s:], 0, right, FREE)], 1)
    return replace(
        batch,
        prompt_ids=pad(batch.prompt_ids, left, 0, pad_id),
        prompt_mask=pad(batch.prompt_mask, left, 0, 0),
        completion_ids=pad(batch.completion_ids, 0, right, pad_id),
        completion_mask=pad(batch.completion_mask, 0, right, 0),
        logprobs=pad(batch.logprobs, 0, right, 0.0),
        extras=extras,
    )


class FullCopyEngine:
    """The built-in sampler for FSDP training: it samples from a full (unsharded) copy of the policy, taken before
    sharding, because a sharded model cannot run data-dependent generation loops (every forward is a collective).
    `update_weights` gathers the sharded policy's tensors one at a time (collective: every process calls it) into
    the copy. Needs one full model per process: for models that large, use a vLLM engine."""

    def __init__(self, make_sampler: Callable[[nn.Module], Any], model: nn.Module, device: torch.device) -> None:
        self.copy = copy.deepcopy(_bare(model)).to(device).eval().requires_grad_(False)
        self.sampler = make_sampler(self.copy)
        self.pad_id = getattr(self.sampler, "pad_id", 0)

    def generate(self, prompts: list[str], group_size: int, seeds: list[int]) -> RolloutBatch:
        return self.sampler.generate(prompts, group_size, seeds)

    @torch.no_grad()
    def update_weights(self, model: nn.Module) -> None:
        target = self.copy.state_dict()
        for name, tensor in _bare(model).state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            target[name].copy_(full)
        self.sampler.update_weights(self.copy)

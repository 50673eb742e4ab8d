"""Wrapping the policy for multi-process training: DDP replicates it on every process, FSDP2 shards its parameters,
gradients and optimizer state over them (`fully_shard` per decoder layer, then the root), for models that do not fit
one device. Build the optimizer on the wrapped model (its parameters are the sharded ones under FSDP).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gspo.logprobs import LogprobForward
from gspo.parallel.group import ProcessGroup

__all__ = ["autocast", "gradient_sync", "whole", "wrap_frozen", "wrap_policy"]

log = logging.getLogger(__name__)


def wrap_policy(group: ProcessGroup, model: nn.Module, mixed_precision: str | None = None) -> nn.Module:
    """The training-time policy: `model` as is (one process), in `DistributedDataParallel` (around
    `gspo.logprobs.LogprobForward(model)`: its forward is `completion_logprobs`, chunked head included), or sharded
    in place with FSDP2 (`group.parallel == "fsdp"`; with `mixed_precision`, parameters gathered in that dtype for
    compute and gradients reduced in float32; the root is then a `LogprobForward(model)` too)."""
    if not group.enabled:
        return model
    if not group.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        ids = [group.device.index] if group.device.type == "cuda" else None
        # buffers (rotary tables) are constant and equal everywhere: no per-forward broadcast
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(
            DistributedDataParallel).parameters else {"broadcast_buffers": False}
        # DDP syncs the gradients of what runs inside its forward: the log-prob computation runs there whole
        return DistributedDataParallel(LogprobForward(model), device_ids=ids, **no_sync)
    return _fully_shard(model, group, mixed_precision)


def wrap_frozen(group: ProcessGroup, model: nn.Module | None, mixed_precision: str | None = None) -> nn.Module | None:
    """A no-gradient model used in the training forwards (the KL reference): sharded like the policy under FSDP."""
    if model is not None and group.fsdp:
        return _fully_shard(model, group, mixed_precision)
    return model


def autocast(group: ProcessGroup, mixed_precision: str | None) -> contextlib.AbstractContextManager:
    """Where the training forwards run in `mixed_precision` over float32 weights: torch.autocast on this process's
    device, except under FSDP, whose MixedPrecisionPolicy (set in `wrap_policy`) already gathers parameters in it."""
    if mixed_precision is None or group.fsdp:
        return contextlib.nullcontext()
    from gspo.models import resolve_dtype

    return torch.autocast(group.device.type, dtype=resolve_dtype(mixed_precision))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` gathered whole when it is a shard or a partial value (a DTensor under FSDP2: a collective, so every
    process calls it), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Around a forward and backward of the wrapped policy: under DDP, `sync` False keeps the gradients local
    (`no_sync`), so that micro-batches accumulate them and only the last one's backward all-reduces. FSDP2 reduces
    each backward's gradients into its shards as they come: accumulating without that would hold the whole unsharded
    gradient on every process, which sharding exists to avoid. One process: nothing to sync."""
    from torch.nn.parallel import DistributedDataParallel

    if sync or not isinstance(model, DistributedDataParallel):
        yield
    else:
        with model.no_sync():
            yield


def _fully_shard(model: nn.Module, group: ProcessGroup, mixed_precision: str | None) -> nn.Module:
    """FSDP2: shard every decoder layer (the model's `_no_split_modules` classes) in place, then the root, a
    `LogprobForward(model, group)` that holds the rest (embeddings, norm, head): its forward gathers them, so the
    training forward takes the chunked head inside it (the HF model as the root gathers them only inside its own
    forward, which computes N×T×V logits), and the processes run equally many bucket forwards. With
    `mixed_precision`, parameters are gathered in that dtype for compute and gradients reduced in fp32. Returns the
    root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gspo.models import decoder_layers, resolve_dtype

    mesh = init_device_mesh(group.device.type, (group.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=resolve_dtype(mixed_precision),
                                                   reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if not layers:
        log.warning("FSDP: %s names no decoder-layer classes (_no_split_modules): sharding it as one unit",
                    type(model).__name__)
    for layer in layers:
        fully_shard(layer, **kwargs)
    return fully_shard(LogprobForward(model, group), **kwargs)



"""Weight export, engine-neutral: the policy's tensors as the stream every engine's `update_weights` takes, the same
stream in the Hugging Face checkpoint layout (what vLLM's loaders read), and as safetensors files (a vLLM server
reloads from those).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = ["checkpoint_layout", "policy_weights", "unwrap_model", "write_safetensors"]

_SHARD_BYTES = 4 << 30  # safetensors shard size when writing weights for a server

Weights = Iterable[tuple[str, torch.Tensor]]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model inside DDP/FSDP-style (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            return unwrap_model(inner)
    return model


def policy_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as `(name, tensor)` pairs, under the bare model's `state_dict()` names, one at a time.

    Accepts a bare model, a DDP wrapper or an FSDP2-sharded model: sharded tensors (DTensors) are gathered one at a time
    with `full_tensor()`, a collective, so under FSDP every process must iterate this to the end in lockstep; a push
    then never holds more than one full tensor beyond the model. Tensors are detached; tied tensors appear under each
    of their names (an engine that reloads in place must receive the output head too).

    A LoRA policy (a peft model, `gspo.lora`) yields its merged weights W + (alpha/r)·B·A under the base model's names,
    no adapter tensors: engines load it as the full model it computes (`gspo.lora.merged_weights`)."""
    bare = unwrap_model(model)
    if hasattr(bare, "peft_config"):
        from gspo.lora import merged_weights

        yield from merged_weights(bare)
        return
    # no torch.no_grad() here: a generator suspended inside it would leave gradients off in its consumer (and for
    # good, if it is not run to the end); state_dict() tensors are detached, so nothing is recorded anyway
    from gspo.parallel.wrap import whole  # here: importing gspo.rollout should not import the trainer's config

    for name, tensor in bare.state_dict().items():
        yield name, whole(tensor).detach()


def checkpoint_layout(model: nn.Module) -> Callable[[Weights, torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]:
    """A function mapping a `policy_weights` stream of `model` to the layout of a saved checkpoint (what vLLM's loaders
    read), cast to a dtype when given (floating-point tensors only), contiguous.

    transformers >= 5 fuses some tensors in memory (e.g. per-expert MoE weights into one [E, ...] tensor) and splits
    them back on save; the same reversal applies here. Older transformers keep the checkpoint layout in memory."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x

        def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return tensors
    else:
        bare = unwrap_model(model)
        if hasattr(bare, "get_base_model"):  # a peft (LoRA) model: the stream has its base model's names
            bare = bare.get_base_model()

        def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return revert_weight_conversion(bare, tensors)

    def convert(weights: Weights, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            for out_name, out in revert({name: tensor}).items():
                yield out_name, out.contiguous()

    return convert


def write_safetensors(weights: Weights, folder: str | os.PathLike, shard_bytes: int = _SHARD_BYTES) -> list[Path]:
    """Write `(name, tensor)` pairs as `model-NNNNN.safetensors` shards of at most ~`shard_bytes` into `folder`
    (created), each written to a temporary name and renamed, so a reader never sees a partial shard."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0
    written: set[int] = set()  # storages already in a shard: a tied tensor's second name gets its own copy

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        target = folder / f"model-{len(files) + 1:05d}.safetensors"
        tmp = target.with_suffix(".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.replace(target)
        files.append(target)
        shard, size = {}, 0

    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        tensor = tensor.detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in written:
            tensor = tensor.clone()
        written.add(tensor.untyped_storage().data_ptr())
        shard[name] = tensor
        size += nbytes
    flush()
    return files

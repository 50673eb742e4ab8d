"""Rollout engines: the `RolloutEngine` protocol (`gspo.rollout.base`), the built-in Hugging Face sampler, the vLLM
engines (`gspo.rollout.vllm`, which imports vLLM only when chosen), engine-neutral assembly (`gspo.rollout.assemble`)
and weight export (`gspo.rollout.weights`), and `make_engine`, which builds the engine a config asks for
(`rollout.engine: hf | vllm | vllm_server`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gspo.rollout.base import RolloutEngine, SamplingParams
from gspo.rollout.sampler import HFSampler, filter_scores, row_seed, sample_from_logits
from gspo.rollout.weights import checkpoint_layout, policy_weights, unwrap_model

if TYPE_CHECKING:
    from torch import nn

    from gspo.config import Config
    from gspo.parallel import ProcessGroup

__all__ = [
    "HFSampler",
    "RolloutEngine",
    "SamplingParams",
    "filter_scores",
    "make_engine",
    "policy_weights",
    "row_seed",
    "sample_from_logits",
    "sampling_params",
    "unwrap_model",
]


def sampling_params(cfg: Config) -> SamplingParams:
    """The engine's sampling parameters from the rollout section."""
    ro = cfg.rollout
    return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, stop=tuple(ro.stop))


def _vllm_model_source(cfg: Config, model: nn.Module, tokenizer, out: Path, dist: ProcessGroup) -> str:
    """What vLLM loads at start: the configured local directory or hub id; for a built-in preset (no files), the
    policy saved by rank 0 to OUT/vllm_init. The trainer's current weights are pushed right after, either way."""
    from gspo.models import PRESETS, save_model

    if cfg.model.name not in PRESETS:
        return cfg.model.name
    target = out / "vllm_init"
    if dist.is_main:
        save_model(getattr(model, "module", model), tokenizer, target)
    dist.barrier()
    return str(target)


def make_engine(cfg: Config, model: nn.Module, tokenizer, *, out: str | Path,
                dist: ProcessGroup | None = None) -> RolloutEngine:
    """The rollout engine `cfg.rollout.engine` names, for the policy `model`.

    Call it with the unwrapped policy, before DDP/FSDP wrapping (the engines keep or copy what they need), then give it
    the policy's current weights with `update_weights(policy_weights(model), version)` before the first `generate`
    (the trainer's first sync): vLLM starts from the files it loads, not from the trainer's memory.
    hf: `HFSampler` sharing the trainer's weights (or its own copy in `rollout.dtype`; under FSDP always its own full
    copy on this process's device). vllm: an in-process `VLLMEngine`. vllm_server: a `VLLMServerEngine` for the server
    at `rollout.vllm.server_url`. With `algorithm.routing_replay=r3` the engine records its MoE routing."""
    from gspo.parallel import ProcessGroup

    dist = dist or ProcessGroup()
    out = Path(out)
    ro, params = cfg.rollout, sampling_params(cfg)
    record_routing = cfg.algorithm.routing_replay == "r3"
    if ro.engine == "hf":
        return HFSampler(model, tokenizer, params, dtype=ro.dtype, record_routing=record_routing, own_copy=dist.fsdp,
                         device=dist.device if dist.fsdp else None, decode=ro.decode)

    from gspo.rollout.vllm import VLLMEngine, VLLMServerEngine

    v = ro.vllm
    if ro.engine == "vllm":
        return VLLMEngine(
            _vllm_model_source(cfg, model, tokenizer, out, dist), tokenizer, params,
            dtype=ro.dtype or cfg.model.dtype, seed=cfg.trainer.seed, gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len, enable_prefix_caching=v.enable_prefix_caching,
            enforce_eager=v.enforce_eager, record_routing=record_routing, distributed=dist.enabled,
            engine_args=v.engine_args, to_checkpoint=checkpoint_layout(model))
    return VLLMServerEngine(
        v.server_url, tokenizer, params, sync_dir=v.weight_sync_dir or out / "weight_sync",
        timeout=v.request_timeout, max_concurrent=v.max_concurrent_requests, is_main=dist.is_main,
        barrier=dist.barrier, record_routing=record_routing, to_checkpoint=checkpoint_layout(model))

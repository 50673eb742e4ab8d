"""Rollout engines: the `RolloutEngine` interface, the built-in Hugging Face sampler, and `make_engine`, which builds
the engine a config asks for (`rollout.engine: hf | vllm | vllm_server`; the vLLM ones live in `gspo.rollout.vllm`
and import vLLM only when chosen)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from gspo.rollout.sampler import HFSampler, filter_scores, row_seed, sample_from_logits

if TYPE_CHECKING:
    from torch import nn

    from gspo.config import Config
    from gspo.distributed import Dist

__all__ = [
    "HFSampler",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "eval_sampler",
    "filter_scores",
    "make_engine",
    "row_seed",
    "sample_from_logits",
]


def _sampling_params(cfg: Config) -> SamplingParams:
    ro = cfg.rollout
    return SamplingParams(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                          max_new_tokens=ro.max_new_tokens, stop=tuple(ro.stop))


def _vllm_model_source(cfg: Config, model: nn.Module, tokenizer, out: Path, dist: Dist) -> str:
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


def make_engine(cfg: Config, model: nn.Module, tokenizer, *, out: str | Path, dist: Dist | None = None) -> Any:
    """The rollout engine `cfg.rollout.engine` names, sampling from `model`'s current weights.

    Call it with the unwrapped policy, before DDP/FSDP wrapping (the engines keep or copy what they need).
    hf: `HFSampler` sharing the trainer's weights (or its own copy in `rollout.dtype`); under FSDP a
    `FullCopyEngine` around it. vllm: an in-process `VLLMEngine`. vllm_server: a `VLLMServerEngine` for the server
    at `rollout.vllm.server_url`. With `algorithm.routing_replay=r3` the engine records its MoE routing."""
    from gspo.distributed import Dist, FullCopyEngine

    dist = dist or Dist()
    out = Path(out)
    ro, params = cfg.rollout, _sampling_params(cfg)
    record_routing = cfg.algorithm.routing_replay == "r3"
    if ro.engine == "hf":
        def sampler(m: nn.Module) -> HFSampler:
            return HFSampler(m, tokenizer, params, dtype=ro.dtype, record_routing=record_routing)

        return FullCopyEngine(sampler, model, dist.device) if dist.fsdp else sampler(model)

    from gspo.rollout.vllm import VLLMEngine, VLLMServerEngine

    v = ro.vllm
    if ro.engine == "vllm":
        engine = VLLMEngine(
            _vllm_model_source(cfg, model, tokenizer, out, dist), tokenizer, params,
            dtype=ro.dtype or cfg.model.dtype, seed=cfg.trainer.seed, gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len, enable_prefix_caching=v.enable_prefix_caching,
            enforce_eager=v.enforce_eager, record_routing=record_routing, distributed=dist.enabled,
            engine_args=v.engine_args)
    else:
        engine = VLLMServerEngine(
            v.server_url, tokenizer, params, sync_dir=v.weight_sync_dir or out / "weight_sync",
            timeout=v.request_timeout, max_concurrent=v.max_concurrent_requests, is_main=dist.is_main,
            barrier=dist.barrier, record_routing=record_routing)
    engine.update_weights(model)  # the policy as it is now (cold start, resume), not the files vLLM started from
    return engine


def eval_sampler(cfg: Config, engine: Any, model: nn.Module, tokenizer, max_new_tokens: int) -> Any:
    """The greedy sampler evaluation decodes with: the rollout engine itself for vLLM (same weights), an
    `HFSampler` on the full policy otherwise (the FSDP engine's unsharded copy, or the bare model)."""
    from gspo.distributed import FullCopyEngine

    params = SamplingParams(top_k=1, max_new_tokens=max_new_tokens)
    if hasattr(engine, "with_params"):
        return engine.with_params(params)
    full = engine.copy if isinstance(engine, FullCopyEngine) else getattr(model, "module", model)
    return HFSampler(full, tokenizer, params)

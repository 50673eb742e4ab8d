"""Rollout engines: the `RolloutEngine` protocol (`gspo.rollout.base`), the built-in Hugging Face sampler, the vLLM
engines (`gspo.rollout.vllm`, which imports vLLM only when chosen), engine-neutral assembly (`gspo.rollout.assemble`)
and weight export (`gspo.rollout.weights`), and `make_engine`, which builds the engine a config asks for
(`rollout.engine: hf | vllm | vllm_server`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gspo.rollout.assemble import eos_ids, output_rows
from gspo.rollout.base import RolloutEngine, SamplingParams
from gspo.rollout.cache_memory import check_release
from gspo.rollout.sampler import (
    KEPT_CACHE_SHARE,
    HFSampler,
    filter_scores,
    resolve_decode,
    row_seed,
    sample_from_logits,
)
from gspo.rollout.weights import checkpoint_layout, policy_weights, unwrap_model

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gspo.config import Config
    from gspo.parallel import ProcessGroup

__all__ = [
    "HFSampler",
    "RolloutEngine",
    "SamplingParams",
    "check_hf_engine",
    "filter_scores",
    "make_engine",
    "policy_weights",
    "prepare_worker_source",
    "row_seed",
    "sample_from_logits",
    "sampling_params",
    "unwrap_model",
    "worker_engine",
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


def make_engine(cfg: Config, model: nn.Module, tokenizer, *, out: str | Path, dist: ProcessGroup | None = None,
                kind: str | None = None) -> RolloutEngine:
    """The rollout engine `cfg.rollout.engine` names, for the policy `model`.

    Call it with the unwrapped policy, before DDP/FSDP wrapping (the engines keep or copy what they need), then give it
    the policy's current weights with `update_weights(policy_weights(model), version)` before the first `generate`
    (the trainer's first sync): vLLM starts from the files it loads, not from the trainer's memory.
    hf: `HFSampler` sharing the trainer's weights (or its own copy in `rollout.dtype`; under FSDP always its own full
    copy on this process's device). vllm: an in-process `VLLMEngine`. vllm_server: a `VLLMServerEngine` for the server
    at `rollout.vllm.server_url`. With `algorithm.routing_replay=r3` the engine records its MoE routing. `kind`
    overrides `rollout.engine`."""
    from gspo.parallel import ProcessGroup

    dist = dist or ProcessGroup()
    out = Path(out)
    ro = cfg.rollout
    kind = kind or ro.engine
    if kind == "hf":
        return _hf_engine(cfg, model, tokenizer, own_copy=dist.fsdp, device=dist.device if dist.fsdp else None)

    if kind == "vllm":
        return _vllm_engine(cfg, _vllm_model_source(cfg, model, tokenizer, out, dist), model, tokenizer,
                            distributed=dist.enabled)
    return _server_engine(cfg, ro.vllm.server_urls[0], _sync_dir(cfg, out), model, tokenizer, dist)


def _hf_engine(cfg: Config, model: nn.Module, tokenizer, *, own_copy: bool, device=None) -> HFSampler:
    """The built-in `HFSampler` on `model` (or its own copy), with the rollout section's settings. Multi-turn
    episodes decode dynamically under `rollout.decode: auto`: each turn generates for the episodes still running,
    whose number and context length change turn after turn, and a compiled decode step is recompiled (and its static
    cache allocated) for every new shape."""
    ro = cfg.rollout
    return HFSampler(model, tokenizer, sampling_params(cfg), dtype=ro.dtype, own_copy=own_copy,
                     record_routing=cfg.algorithm.routing_replay == "r3", device=device, decode=_hf_decode(cfg),
                     max_rows=ro.max_batch_rows, autocast=cfg.trainer.mixed_precision,
                     release_cache=ro.release_decode_cache, cache_share=KEPT_CACHE_SHARE / hf_engines_per_device(cfg))


def hf_engines_per_device(cfg: Config) -> int:
    """Built-in engines on one device: asynchronous workers sample on the learner's device (`rollout.workers` of
    them, each a process with its own engine) beside the learner's evaluation engine; so the compiled loop's kept
    caches of each take their share of `KEPT_CACHE_SHARE`, not all of it (with 2 workers, three engines could keep
    three quarters of the device in caches)."""
    return cfg.rollout.workers + 1 if cfg.rollout.mode == "async" and cfg.rollout.engine == "hf" else 1


def _hf_decode(cfg: Config) -> str:
    """The rollout.decode the built-in engine is asked for: auto, unless multi-turn episodes make it dynamic."""
    return "dynamic" if cfg.rollout.decode == "auto" and cfg.env is not None else cfg.rollout.decode


def check_hf_engine(cfg: Config, model: nn.Module, device: torch.device) -> None:
    """Raise ValueError now, before any compute, for what the built-in engine `make_engine` builds for `model` on
    `device` would refuse later: a decode loop the model or the routing recording cannot run, a cache release that
    needs a library this machine lacks. Nothing to check when the run's engine is vLLM (the learner's evaluation
    engine of an asynchronous run is built-in)."""
    if cfg.rollout.engine != "hf" and cfg.rollout.mode != "async":
        return
    decode = resolve_decode(_hf_decode(cfg), model, device, record_routing=cfg.algorithm.routing_replay == "r3")
    if cfg.rollout.release_decode_cache:
        check_release(decode, device)


def _sync_dir(cfg: Config, out: Path) -> Path:
    """Where a vllm_server engine writes the weights its server reloads: rollout.vllm.weight_sync_dir, else
    OUT/weight_sync."""
    return Path(cfg.rollout.vllm.weight_sync_dir or out / "weight_sync")


def _vllm_engine(cfg: Config, source: str, model: nn.Module, tokenizer, *, distributed: bool = False):
    """An in-process `VLLMEngine` loading `source`, with the rollout section's settings."""
    from gspo.rollout.vllm import VLLMEngine

    ro, v = cfg.rollout, cfg.rollout.vllm
    return VLLMEngine(
        source, tokenizer, sampling_params(cfg), dtype=ro.dtype or cfg.model.dtype, seed=cfg.trainer.seed,
        gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len,
        enable_prefix_caching=v.enable_prefix_caching, enforce_eager=v.enforce_eager,
        record_routing=cfg.algorithm.routing_replay == "r3", distributed=distributed, engine_args=v.engine_args,
        to_checkpoint=checkpoint_layout(model))


def _server_engine(cfg: Config, url: str, sync_dir: Path, model: nn.Module, tokenizer, dist: ProcessGroup):
    """A `VLLMServerEngine` for the server at `url`, writing weights to `sync_dir`."""
    from gspo.rollout.vllm import VLLMServerEngine

    v = cfg.rollout.vllm
    return VLLMServerEngine(
        url, tokenizer, sampling_params(cfg), sync_dir=sync_dir, timeout=v.request_timeout,
        max_concurrent=v.max_concurrent_requests, is_main=dist.is_main, barrier=dist.barrier,
        record_routing=cfg.algorithm.routing_replay == "r3", to_checkpoint=checkpoint_layout(model),
        vocab_size=output_rows(unwrap_model(model)),
        eos=eos_ids(tokenizer, getattr(unwrap_model(model), "generation_config", None)))  # the server stops at them


def worker_engine(cfg: Config, model: nn.Module, tokenizer, *, worker: int, out: str | Path,
                  source: str | None = None) -> RolloutEngine:
    """The engine of asynchronous rollout worker `worker` (`gspo.rollout.workers`), which takes every weight it samples
    with from the learner through `update_weights`. `model` is the policy's architecture built in the worker (the hf
    engine samples with it; the vLLM engines only read its checkpoint layout, so it may be on the meta device).
    hf: an own-copy `HFSampler` on the model's device. vllm: an in-process `VLLMEngine` loading `source` (what
    `prepare_worker_source` returned). vllm_server: a `VLLMServerEngine` for the worker's own server,
    `rollout.vllm.server_url[worker]`, writing weights to its own folder (a server per worker: each reloads the
    weights its worker has taken, when that worker takes them)."""
    from gspo.parallel import ProcessGroup

    ro = cfg.rollout
    if ro.engine == "hf":
        return _hf_engine(cfg, model, tokenizer, own_copy=True)
    if ro.engine == "vllm":
        if source is None:
            raise ValueError("worker_engine: rollout.engine=vllm needs the model source vLLM loads at start")
        return _vllm_engine(cfg, source, model, tokenizer)
    return _server_engine(cfg, ro.vllm.server_urls[worker], _sync_dir(cfg, Path(out)) / f"worker{worker}", model,
                          tokenizer, ProcessGroup())


def prepare_worker_source(cfg: Config, model: nn.Module, tokenizer, out: str | Path) -> str | None:
    """What the asynchronous workers' vLLM engines load at start (`rollout.engine=vllm`; see `_vllm_model_source`),
    prepared once by the learner; None for the other engines. A preset saved by the learner's own engine (before
    LoRA wrapping) is reused."""
    from gspo.parallel import ProcessGroup

    if cfg.rollout.engine != "vllm":
        return None
    saved = Path(out) / "vllm_init"
    if (saved / "config.json").is_file():
        return str(saved)
    return _vllm_model_source(cfg, unwrap_model(model), tokenizer, Path(out), ProcessGroup())

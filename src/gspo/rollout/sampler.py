"""The built-in rollout engine: batched sampling with a Hugging Face causal LM and its KV cache.

`HFSampler` samples `group_size` completions per prompt, reproducibly per prompt, and returns the log-probability of
every sampled token under the distribution it was actually drawn from (temperature, top-k and top-p applied), which is
what GSPO's importance ratio needs as the behaviour policy's log-probabilities.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import inspect
import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gspo.models import cache_keyword, compile_options, output_cache, resolve_dtype
from gspo.moe import RolloutRoutingRecorder, config_has_experts, require_replay_support
from gspo.rollout import cache_memory
from gspo.rollout.assemble import encode_prompts, eos_ids, output_rows, pad_id
from gspo.rollout.base import SamplingParams
from gspo.rollout.weights import unwrap_model
from gspo.trajectory import NO_VERSION, Trajectory, concat, pad_left

log = logging.getLogger(__name__)

__all__ = ["DECODE_MODES", "HFSampler", "autocast_twin", "compile_decode_step", "filter_scores", "refresh_twin",
           "resolve_decode", "row_seed", "sample_from_logits"]

DECODE_MODES = ("dynamic", "static", "compiled")
"""How `HFSampler` runs its decode loop. dynamic: a growing KV cache; finished rows leave the batch (the fastest eager
loop). static: a preallocated KV cache of fixed shape (transformers' StaticCache), every row stays to the end; the
same tokens, log-probabilities equal within float tolerance. compiled: static, with the decode step compiled by
torch.compile (on CUDA with CUDA graphs: one graph replay per token instead of hundreds of kernel launches)."""

STATIC_CACHE_BUCKET = 128
"""A static cache's length is prompt + new tokens rounded up to a multiple of this, so that a compiled decode step
(fixed shapes) is reused across batches whose prompt lengths differ."""

_SEED_STRIDE = 1_000_003  # prime multiplier that spreads (prompt seed, index in group) over distinct generator seeds


def row_seed(prompt_seed: int, index_in_group: int) -> int:
    """The generator seed of completion `index_in_group` of a prompt whose seed is `prompt_seed`.

    A function of these two numbers alone, so a prompt's group does not depend on the rest of the batch.
    """
    return (prompt_seed * _SEED_STRIDE + index_in_group) % 2**63


def filter_scores(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k and then top-p remove from temperature-scaled `scores` [A, V].

    top-k keeps the `top_k` highest scores (ties with the k-th score are kept too); 0 disables it. top-p (nucleus)
    then keeps the smallest set of most probable tokens whose cumulative probability reaches `top_p`, measured on the
    top-k-filtered distribution; the most probable token is always kept; 1.0 disables it.
    """
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_probs, order = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True)
        # A token is dropped once the strictly more probable tokens already cover top_p; the top one never is.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_from_logits(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [A, V] by inverse CDF with the given `uniforms` [A] in [0, 1).

    The distribution is softmax(filter_scores(logits / temperature)), computed in float32. Returns `(tokens [A] long,
    logprobs [A] float32)`, the log-probability of each token under that same final distribution, i.e. the one
    sampled from (renormalised over the kept tokens). With top_k=0 and top_p=1 it equals
    log_softmax(logits / temperature). Sampling by inverse CDF makes the token a deterministic function of the
    uniform, so per-row random streams give per-row reproducibility.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scores = filter_scores(logits.float() / temperature, top_k, top_p)
    logp = torch.log_softmax(scores, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    # Scale by the total (float32 sums are not exactly 1) and stay strictly below it, so that searching with
    # right=True lands on a token with non-zero probability: cdf[i] > v >= cdf[i-1] implies p[i] > 0.
    v = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, v, right=True).clamp_(max=cdf.shape[-1] - 1)
    return idx.squeeze(1), logp.gather(-1, idx).squeeze(1)


KEPT_CACHES = 4
"""Static KV caches a compiled decode loop keeps, one per (rows, cache length) shape: a run's rollout shape, its
evaluation's and their remainders; a fifth shape frees the least recently used."""

KEPT_CACHE_SHARE = 0.25
"""The most memory a compiled decode loop's kept caches may hold together: this share of the device's total (GPU memory
on CUDA, RAM elsewhere). A new cache that would take the kept ones past it frees the least recently used first, and a
call whose cache is larger than the share alone decodes with the dynamic loop (`HFSampler._keeps`), which frees its
cache at the end and records no CUDA graph. Why: at real lengths one cache is large (Qwen3-0.6B keeps 112 KiB of bf16
K/V per token: an evaluation of 256 rows × 1,280 slots holds 37.6 GB, a rollout of 128 × 1,280 18.8 GB), and kept
through the updates they would leave an 80 GB GPU less than half of its memory for training. The price of an evicted
cache: its shape's next call allocates it again, at other addresses, and the compiled step records its CUDA graph
again (no recompile; torch 2.11 stops using CUDA graphs for a function after 128 such re-recordings)."""


def compiled_shapes_limit() -> int:
    """How many (rows, cache length) shapes a compiled decode loop compiles its step for: dynamo's recompile limit
    (`torch._dynamo.config.recompile_limit`, 8 by default; read at each new shape, so raising it raises this).

    Why: the step is compiled with fixed shapes, once per shape, and past that limit dynamo stops compiling the
    model's forward and runs it eagerly for every new shape, with a warning of its own and no other sign: the static
    loop, eager, keeping every finished row to the end and a kept cache per shape, which is slower than the dynamic
    loop and holds more memory. A run meets new shapes as its prompts' lengths cross `STATIC_CACHE_BUCKET`s and as
    evaluation batches and their remainders differ from the rollout's; `HFSampler._compiles` decodes a shape past the
    limit with the dynamic loop instead. Each engine counts its own shapes; dynamo counts per compiled function, which
    the engines of one model class in a process share (a run has one compiled engine)."""
    import torch._dynamo

    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None)  # its name since torch 2.7; cache_size_limit before
    return int(config.cache_size_limit if limit is None else limit)


def static_cache_len(prompt_len: int, max_new_tokens: int) -> int:
    """A static cache's slots for prompts of `prompt_len` tokens (left-padded) and `max_new_tokens` new ones."""
    return -(-(prompt_len + max_new_tokens) // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET


def cache_bytes(layout: list[tuple[torch.Tensor, torch.Tensor] | None], n_rows: int, cache_len: int) -> int:
    """Bytes of a static cache of `n_rows` × `cache_len` slots whose layers hold K and V as `layout` says
    (`HFSampler._cache_layout`)."""
    per_slot = sum(k.shape[1] * k.shape[-1] * k.element_size() + v.shape[1] * v.shape[-1] * v.element_size()
                   for k, v in filter(None, layout))
    return n_rows * cache_len * per_slot


def resolve_decode(decode: str, model: PreTrainedModel, device: torch.device | str,
                   record_routing: bool = False) -> str:
    """The decode mode `HFSampler` runs for `rollout.decode` (DECODE_MODES or "auto"): auto is compiled on CUDA for a
    dense model with sdpa or eager attention that supports a static cache, else dynamic (a compiled decode step was
    measured with sdpa only: other kernels, e.g. `model.attn_implementation=flash_attention_2`, decode dynamically
    unless rollout.decode says otherwise). Raises ValueError for a static mode the model or the
    routing recording cannot run, and for compiled on CUDA with an MoE model: transformers' expert kernel reads the
    expert offsets on the host (`offs.tolist()` in its grouped-mm fallback, transformers 5.17), which a CUDA graph
    cannot capture (measured on an H100: "Cannot copy between CPU and CUDA tensors during CUDA graph capture")."""
    static_ok = bool(getattr(unwrap_model(model), "_can_compile_fullgraph", False))
    cuda = torch.device(device).type == "cuda"
    moe_on_cuda = cuda and config_has_experts(getattr(model, "config", None))
    if decode == "auto":
        attention = getattr(getattr(unwrap_model(model), "config", None), "_attn_implementation", "sdpa")
        measured = attention in ("sdpa", "eager")
        return "compiled" if cuda and static_ok and measured and not moe_on_cuda and not record_routing else "dynamic"
    if decode not in DECODE_MODES:
        raise ValueError(f"rollout.decode must be auto or one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if decode == "compiled" and moe_on_cuda:
        raise ValueError("rollout.decode=compiled: an MoE model's decode step cannot be captured in a CUDA graph "
                         "(transformers' expert kernel syncs with the host); use rollout.decode=static or dynamic")
    if decode != "dynamic" and not static_ok:
        raise ValueError(f"rollout.decode={decode}: {type(unwrap_model(model)).__name__} does not support a static KV "
                         "cache (transformers' _can_compile_fullgraph is False); use rollout.decode=dynamic")
    if decode != "dynamic" and record_routing:
        raise ValueError(f"rollout.decode={decode}: recording the rollout's routing (routing_replay r3) needs "
                         "rollout.decode=dynamic (the recorder's hooks run per eager decode step)")
    return decode


GQA_DECODE = "gspo_gqa_decode_sdpa"
"""The attention implementation `HFSampler` decodes with, for a model that attends with sdpa: `gqa_decode_sdpa`."""


def gqa_decode_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for one query token of a grouped-query model (a decode step): there the
    `groups` query heads that share a KV head become `groups` query rows of that KV head, so the KV cache is read
    once as it is, instead of being copied `groups` times (transformers' `repeat_kv`, which its sdpa path does
    whenever there is a mask, as a decode step over left-padded prompts or a static cache always has; 5.24 skips it
    in eager decoding but not under torch.compile). The same attention for every head: softmax(q·Kᵀ·scale + mask)·V.

    Why it matters: at Qwen3-0.6B's shape (16 query heads, 8 KV heads, 28 layers), 128 rows over a 384-slot static
    cache, `repeat_kv` writes 11 GB of copies per decode step, which attention then reads: ~28 GB of memory traffic
    where reading the cache and the weights once is ~7 GB.
    Anything else (prompts, training forwards, per-head masks, position bias, softcap, dropout) goes to
    `sdpa_attention_forward`.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1
    plain = (query.shape[2] != 1 or groups == 1 or dropout or per_head_mask or kwargs.get("position_bias") is not None
             or kwargs.get("softcap") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, _ = query.shape
    grouped = query.reshape(batch, heads // groups, groups, query.shape[-1])  # head h → KV head h // groups
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


try:  # transformers >= 4.53: a registered attention also needs its mask function registered
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_DECODE, gqa_decode_sdpa)
    AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
    _GQA_DECODE_AVAILABLE = True
except ImportError:  # older transformers build masks by comparing the implementation's name: keep theirs
    _GQA_DECODE_AVAILABLE = False


@contextlib.contextmanager
def gqa_decoding(model: PreTrainedModel):
    """Within the block, `model` attends with `gqa_decode_sdpa` if it attends with sdpa and has grouped KV heads (its
    own config only, not sub-configs: models whose layers read a sub-config keep sdpa); restored on exit. Training
    forwards that run meanwhile (another thread) compute the same values: only one-token queries differ in how."""
    config = getattr(model, "config", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    grouped = kv_heads is not None and kv_heads < getattr(config, "num_attention_heads", kv_heads)
    if not (_GQA_DECODE_AVAILABLE and grouped and getattr(config, "_attn_implementation_internal", None) == "sdpa"):
        yield
        return
    config._attn_implementation_internal = GQA_DECODE  # not the setter: it would rewrite sub-configs too
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"


class NarrowStaticCache(StaticCache):
    """transformers' StaticCache whose layers may hold K and V in a narrower dtype than the model computes them in,
    cast on the way in. Under bf16 autocast over float32 weights the rotary embedding leaves K in float32 (bf16 keys
    times float32 cos/sin), and every op that reads the cache (sdpa, matmul) casts it to bf16 first: a bf16 K gives
    the same attention, bit for bit, in 2/3 of the cache's memory and without casting the whole cache at every
    decode step. `HFSampler._allocate` picks the dtypes."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.is_initialized:
            key_states, value_states = key_states.to(layer.keys.dtype), value_states.to(layer.values.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _ProbeCache(StaticCache):
    """A one-slot StaticCache that stores nothing: it records the K and V each layer hands it (`seen`, by layer) and
    attends over them as they are. `HFSampler._probe_layout` reads the static caches' layout off it: the dtypes the
    model computes K and V in, not the ones transformers would allocate (before 5.24 a StaticCache layer allocated V
    in K's dtype, float32 under bf16 autocast, and then refused the bf16 V: "index_copy_(): self and source expected
    to have the same dtype")."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = (key_states, value_states)
        return key_states, value_states


def autocast_twin(model: torch.nn.Module, dtype: torch.dtype,
                  region: contextlib.AbstractContextManager | None = None,
                  ) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, ...]]]:
    """A second module tree over `model`'s own tensors (its parameters, buffers and config are shared, not copied),
    except that each `nn.Linear` with float32 weights holds its weight and bias as a `dtype` copy of its own: what
    the compiled decode loop runs under `dtype` autocast (`HFSampler._decode_step`). Returns the twin, in eval mode,
    and its copies as (copy, source) pairs; the copies are empty until `refresh_twin` fills them, and are allocated
    inside `region` (`gspo.rollout.cache_memory.region`: given back with the KV caches). A weight that several Linear
    layers share gets one copy, and a tied embedding keeps the float32 weight it shares with the head. Module
    attributes that are not tensors (flags, rates) are copied as they are when the twin is made.

    Why: autocast casts a float32 weight to `dtype` at every linear it enters. Eager autocast casts each weight once
    per autocast block (its cast cache), but a compiled step casts inside its graph, at every call: per decode token
    it reads the float32 weights (4 bytes a parameter), writes their cast (2) and reads that (2), where `dtype`
    copies are read once (2): 4× the weights' memory traffic (at Qwen3-0.6B's shape ~4.8 GB per step instead of
    1.2). The values are autocast's own (the same round-to-nearest cast, once per generate call instead of once per
    token). The price is the copies' memory: 2 bytes per Linear parameter (1.2 GB at that shape)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    config = getattr(model, "config", None)
    if config is not None:
        shared[id(config)] = config  # gqa_decoding switches the attention on the model's config: the twin sees it
    twin = copy.deepcopy(model, shared).eval()
    copies: dict[int, torch.Tensor] = {}
    pairs = []
    with region or contextlib.nullcontext():
        for source_module, module in zip(model.modules(), twin.modules(), strict=True):
            if type(module) is not torch.nn.Linear or module.weight.dtype != torch.float32:
                continue  # subclasses (quantized layers) are left as they are
            for name in ("weight", "bias"):
                source = getattr(source_module, name)
                if source is None:
                    continue
                if id(source) not in copies:
                    copies[id(source)] = torch.nn.Parameter(torch.empty_like(source, dtype=dtype),
                                                            requires_grad=False)
                    pairs.append((copies[id(source)], source))
                setattr(module, name, copies[id(source)])
    return twin, pairs


@torch.no_grad()
def refresh_twin(pairs: list[tuple[torch.Tensor, ...]]) -> None:
    """Cast the sources' current values into an `autocast_twin`'s copies, in place (their addresses stay)."""
    for copied, source in pairs:
        copied.copy_(source)


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere): freed tensors of a few
    MB live in the heap, and without this the process's resident memory keeps them."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


def compile_decode_step(model: torch.nn.Module, cuda: bool) -> Callable:
    """`model`'s forward compiled for the compiled decode loop: with CUDA graphs on CUDA (`triton.cudagraphs`: what
    mode="reduce-overhead" sets, which torch.compile does not take together with options), inductor alone elsewhere;
    shapes fixed (dynamic=False); eager's roundings under autocast (`gspo.models.COMPILE_OPTIONS`), so that it samples
    what the eager loops sample (on the CPU bit for bit)."""
    options = compile_options({"triton.cudagraphs": True} if cuda else None)
    return torch.compile(model, dynamic=False, fullgraph=False, options=options)


class HFSampler:
    """Rollout engine that samples from a Hugging Face causal LM with its KV cache (implements `RolloutEngine`).

    With `dtype=None` (or the model's own dtype) it samples from the trainer's model object itself (`shares_weights`),
    so `update_weights` has nothing to read. With another dtype (e.g. bf16 rollouts for an fp32 trainer), or
    `own_copy=True` (FSDP training: a sharded model cannot run data-dependent generation loops, every forward being a
    collective), it is a separate inference engine: it keeps its own full copy on `device` (default the model's),
    parameters cast to `dtype` (buffers such as rotary frequencies keep their dtype, as `from_pretrained(dtype=...)`
    would leave them), and `update_weights` copies the streamed tensors into it in memory. `release` frees that copy
    until the next `update_weights`. `autocast` (e.g. "bfloat16", the trainer's `trainer.mixed_precision`) runs the
    forwards of float32 weights under torch.autocast, as the policy's training forwards run: the sampled policy is the
    one trained (TRL's generation runs under its accelerator's autocast too), on bf16 tensor cores, with bf16 KV
    caches; the log-softmax of the sampled tokens stays float32. Weights already in a half dtype ignore it.

    Generation: prompts are tokenized without special tokens and left-padded; one prefill, then one cached decode
    step per token. Rows that finish (EOS or a stop string) are dropped from the batch and the KV cache, so they stop
    costing compute; the loop ends when every row is finished or `max_new_tokens` is reached. Set
    `drop_finished_rows = False` to keep finished rows in the batch instead (same results; for testing). `max_rows`
    caps the rows (completions) of one batch: a larger request runs as batches of whole groups, one after another
    (each row draws from its own seeded generator, so the samples are the same up to float rounding; a group larger
    than the cap runs whole, alone). `decode`
    ("static", "compiled") runs the loop over a fixed-shape KV cache instead (see DECODE_MODES), which a compiled
    decode step needs ("compiled" keeps that cache and its weights between calls: `_static_cache`, `release`).
    `release_cache=True` (`rollout.release_decode_cache`) gives the compiled loop's KV-cache memory back at `release`:
    on CUDA by unmapping it at the same addresses (`gspo.rollout.cache_memory`, torch_memory_saver), elsewhere by
    freeing the caches.

    `record_routing=True` (MoE models; for R3 routing replay, arXiv 2510.11370) also records which experts every
    router chose for every prompt and generated token, into `Trajectory.extras["routing"]`: [N, S + T, layers, k]
    int16, aligned to the training forward's tokens (left-padded prompt then right-padded completion), FREE (-1)
    where the engine routed nothing (padding, and each completion's last token, which is never fed back; see
    `gspo.moe.RolloutRoutingRecorder`). Off by default: normal rollouts install no hooks and pay nothing.
    """

    drop_finished_rows: bool = True
    grouped_decode: bool = True
    """Decode a grouped-query sdpa model with `gqa_decode_sdpa` (same values; False: the model's own sdpa path, for
    comparison in benchmarks/decode_attention.py)."""
    twin_weights: bool = True
    """Under autocast over float32 weights, run the compiled decode step on `autocast_twin` (False: on the model
    itself, casting every weight at every step; for comparison in benchmarks/decode_weights.py)."""
    between_tokens: Callable[[], None] | None = None
    """Called between two decode steps (after a token is sampled, before the next forward): an asynchronous rollout
    worker takes new weights there (`update_weights`), so a generation in flight continues under them (a partial
    rollout); every token records the `version` it was sampled under. The KV cache of earlier tokens is kept."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer,
        params: SamplingParams,
        dtype: torch.dtype | str | None = None,
        record_routing: bool = False,
        own_copy: bool = False,
        device: torch.device | str | None = None,
        decode: str = "dynamic",
        max_rows: int | None = None,
        autocast: torch.dtype | str | None = None,
        release_cache: bool = False,
        cache_share: float = KEPT_CACHE_SHARE,
    ) -> None:
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
        if not 0 < cache_share <= 1:
            raise ValueError(f"cache_share must be in (0, 1], got {cache_share}")
        self.max_rows = max_rows
        self.cache_share = cache_share
        model = unwrap_model(model)
        if record_routing:
            require_replay_support(model, "r3")
        self.decode = resolve_decode(decode, model, device or next(model.parameters()).device, record_routing)
        if release_cache:
            cache_memory.check_release(self.decode, device or next(model.parameters()).device)
        self.release_cache = release_cache
        self._compiled_step = None  # the compiled decode forward, made on first use ("compiled")
        self._twin_pairs: list[tuple[torch.Tensor, ...]] = []  # ("compiled" under autocast) see _decode_step
        self._static_caches: dict[tuple[int, int], StaticCache] = {}  # ("compiled") kept per shape: see _static_cache
        self._compiled_shapes: set[tuple[int, int]] = set()  # ("compiled") shapes its step was compiled for
        self._warned_shapes = False  # whether _compiles has said that a shape went past the limit
        self._layout: list | None = None  # the static caches' K/V layout, probed at the first (`_cache_layout`)
        self.record_routing = record_routing
        model_dtype = next(model.parameters()).dtype
        target = model_dtype if dtype is None else resolve_dtype(dtype)
        self.tokenizer = tokenizer
        self.params = params
        self.version = 0
        self.owns_weights = own_copy or target != model_dtype
        self.shares_weights = not self.owns_weights
        if self.owns_weights:
            engine = copy.deepcopy(model).eval()
            if device is not None:
                engine = engine.to(device)
            for p in engine.parameters():
                p.requires_grad_(False)
                p.grad = None
                p.data = p.data.to(target)
            self.model = engine
        else:
            self.model = model
        self.dtype = target
        # under autocast only float32 weights compute in the lower dtype; half weights already do
        self.autocast = resolve_dtype(autocast) if autocast is not None and target == torch.float32 else None

        self.pad_id = pad_id(tokenizer)
        self.eos_ids = eos_ids(tokenizer, getattr(model, "generation_config", None))
        self._forward_takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache = cache_keyword(model)  # the forward's KV-cache keyword (past_key_values, or cache)
        self._stop_table: tuple[tuple[str, ...], torch.Tensor] | None = None
        self._routing: RolloutRoutingRecorder | None = None  # set during generate() when recording routing
        self._released_shapes: dict[str, torch.Size] = {}  # parameters freed by release
        if self.owns_weights:  # hold the copy in one buffer from the start (see update_weights)
            self.release()
            self.update_weights(model.state_dict().items(), 0)

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Sample from `weights` (name → tensor, the bare model's `state_dict()` names) from now on; see
        `gspo.rollout.base`. Shared-weight engine: reads nothing. Own-copy engine: copies every tensor by name, casting
        to the engine's dtypes; raises ValueError if a name or shape does not match the copy or a tensor is missing."""
        if self.owns_weights:
            self._load(weights)
        self.version = version

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        dst = self.model.state_dict(keep_vars=True)
        released, self._released_shapes = self._released_shapes, {}
        # parameters freed by release come back as views of one buffer: one allocation, which the allocator hands back
        # to the system as a whole when they are released again (scattered ones would fragment the heap); the free
        # heap pages the trainer's gradients left are handed back first, so the copy does not stack on them
        if released:
            _trim_heap()
        flat = torch.empty(sum(shape.numel() for shape in released.values()), dtype=self.dtype,
                           device=next(self.model.parameters()).device)
        offset = 0
        for name, t in dst.items():
            if name in released:
                t.data = flat[offset:offset + released[name].numel()].view(released[name])
                offset += released[name].numel()
        seen = set()
        for name, tensor in weights:
            if name not in dst:
                raise ValueError(f"update_weights: unexpected tensor {name!r} (the engine's model has no such tensor)")
            if tensor.shape != dst[name].shape:
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dst[name].shape)}")
            dst[name].copy_(tensor)
            seen.add(name)
        missing = sorted(dst.keys() - seen)
        if missing:
            raise ValueError(f"update_weights: no tensor for {missing[:5]} ({len(missing)} missing)")

    def release(self) -> None:
        """Own-copy engine: free the copy's parameters until the next `update_weights`, which allocates them again.
        The trainer calls this after each rollout, so that the copy (e.g. a bf16 engine's) never coexists with the
        gradients and optimizer state of the updates: peak memory as with a shared engine. Shared-weight engine:
        nothing to do. `generate` on a released engine is an error. The compiled decode loop keeps its weights (and
        its KV caches): its CUDA graphs replay fixed memory addresses, which freeing and re-allocating would move;
        with `release_cache` its caches give their memory back (`_static_cache`), the weights stay."""
        if self.decode == "compiled" and self.release_cache:
            if self._pauses_caches:
                cache_memory.pause()
            else:
                self._static_caches.clear()
        if not self.owns_weights or self.decode == "compiled":
            return
        for name, p in self.model.named_parameters():
            if name not in self._released_shapes:
                self._released_shapes[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        _trim_heap()

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                 params: SamplingParams | None = None) -> Trajectory:
        """Sample `group_size` completions for each prompt (rows g*G .. g*G+G-1 belong to prompt g), with `params`
        (default: the engine's own).

        Row j of prompt i draws one uniform per generated token from its own generator seeded with
        `row_seed(seeds[i], j)` and picks the token by inverse CDF, so a prompt's group depends only on its seed
        (up to floating-point differences caused by the batch composition).

        `logprobs` are float32 log-probabilities of the sampled tokens under the distribution actually sampled from:
        logits / temperature, then top-k, then top-p, renormalised over the kept tokens. With top_k=0 and top_p=1
        they equal log_softmax(logits / temperature). A row ends at EOS (included in `completion_ids`, masked 1, its
        logprob counts, excluded from the text) or once its decoded text contains a stop string (the token that
        completes it is the last one; `completions[i]` is exactly the decoded completion, so it can extend past the
        stop string within that last token). Rows reaching `max_new_tokens` otherwise are `truncated`.
        Returned tensors live on the model's device and are ordinary (not inference-mode) tensors.
        """
        if self._released_shapes:
            raise RuntimeError("generate: this engine's weights were released (release()); give it weights with "
                               "update_weights() first")
        params = params or self.params
        # whole groups per batch; one group larger than the cap decodes whole (it cannot be split)
        if self.max_rows is not None and len(prompts) > 1 and len(prompts) * group_size > self.max_rows:
            per = max(1, self.max_rows // group_size)
            return concat([self.generate(prompts[i:i + per], group_size, seeds[i:i + per], params)
                           for i in range(0, len(prompts), per)], self.pad_id)
        unique_ids, unique_mask = self._encode(prompts, group_size, seeds, params)
        max_new = params.max_new_tokens
        uniforms = torch.stack(
            [
                torch.rand(max_new, generator=torch.Generator().manual_seed(row_seed(seed, j)))
                for seed in seeds
                for j in range(group_size)
            ]
        )
        was_training = self.model.training
        self.model.eval()
        self._routing = None
        if self.record_routing:
            self._routing = RolloutRoutingRecorder(self.model, len(seeds) * group_size, unique_ids.shape[1], max_new,
                                                   unique_ids.device)
        try:
            autocast = (contextlib.nullcontext() if self.autocast is None
                        else torch.autocast(unique_ids.device.type, dtype=self.autocast))
            with (torch.inference_mode(), self._routing or contextlib.nullcontext(), autocast,
                  gqa_decoding(self.model) if self.grouped_decode else contextlib.nullcontext()):
                dynamic = self.decode == "dynamic" or (self.decode == "compiled" and not self._compiles(
                    unique_ids.shape[0] * group_size, static_cache_len(unique_ids.shape[1], params.max_new_tokens)))
                decode = self._decode if dynamic else self._decode_static
                raw = decode(unique_ids, unique_mask, group_size, uniforms.to(unique_ids.device), params)
        finally:
            self.model.train(was_training)
        ids, logprobs, lengths, truncated, versions = (x.clone() for x in raw)  # clones are ordinary tensors again

        width = int(lengths.max())
        mask = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]
        ids = ids[:, :width].masked_fill(~mask, self.pad_id)
        logprobs = logprobs[:, :width].masked_fill(~mask, 0.0)
        last = ids.gather(1, (lengths - 1)[:, None]).squeeze(1)
        ends_with_eos = torch.isin(last, torch.tensor(self.eos_ids, device=ids.device, dtype=torch.long))
        text_lengths = (lengths - ends_with_eos.long()).tolist()
        pairs = zip(ids.tolist(), text_lengths, strict=True)
        completions = [self.tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in pairs]
        extras = {} if self._routing is None else {"routing": self._routing.result(lengths, width)}
        self._routing = None
        return Trajectory(
            prompt_ids=unique_ids.repeat_interleave(group_size, 0),
            prompt_mask=unique_mask.repeat_interleave(group_size, 0),
            completion_ids=ids,
            completion_mask=mask.long(),
            logprobs=logprobs,
            truncated=truncated,
            completions=completions,
            prompt_index=torch.arange(len(prompts), device=ids.device).repeat_interleave(group_size),
            versions=versions[:, :width].masked_fill(~mask, NO_VERSION),
            extras=extras,
        )

    @property
    def max_context(self) -> int | None:
        """The most tokens a prompt and its completion may have together (the model's max_position_embeddings;
        None: unknown): `generate` refuses a request past it."""
        return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)

    def _encode(self, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate the request; return the left-padded prompt ids and mask [P, S] on the model's device."""
        if any(not s for s in params.stop):
            raise ValueError(f"generate: stop strings must be non-empty, got {params.stop!r}")
        encoded = encode_prompts(self.tokenizer, prompts, group_size, seeds, params.max_new_tokens, self.max_context,
                                 "max_position_embeddings", output_rows(self.model))
        ids, mask = pad_left(encoded, self.pad_id)
        device = next(self.model.parameters()).device
        return ids.to(device), mask.to(device)

    def _decode(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, uniforms: torch.Tensor,
        p: SamplingParams,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill + cached decode loop for P unique prompts [P, S], each sampled `group_size` times.

        Returns (ids [N, max_new], logprobs [N, max_new], lengths [N], truncated [N], versions [N, max_new]) for
        N = P * group_size rows; truncated rows are those that never hit EOS or a stop string; versions: the engine's
        `version` when each token was sampled (`between_tokens` may change it mid-generation: partial rollouts).
        Each prompt is prefilled once and its cache repeated for its group. Batch position b holds output row
        `rows[b]`; finished rows are dropped from every per-row tensor and from the KV cache (or, with
        `drop_finished_rows = False`, kept but ignored).
        """
        n_rows, prompt_len = prompt_ids.shape[0] * group_size, prompt_ids.shape[1]
        device = prompt_ids.device
        out_ids, out_logprobs, lengths, truncated, versions, eos_ids = self._outputs(n_rows, p.max_new_tokens, device)

        position_ids = (prompt_mask.cumsum(1) - 1).masked_fill(prompt_mask == 0, 1)
        extra = {"logits_to_keep": 1} if self._forward_takes_logits_to_keep else {}
        out = self.model(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True, **extra
        )
        cache, logits = output_cache(out), out.logits[:, -1, :]
        if self._routing is not None:
            self._routing.prefill(prompt_mask, group_size)
        if group_size > 1:
            cache.batch_repeat_interleave(group_size)
            logits = logits.repeat_interleave(group_size, 0)
            prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
            position_ids = position_ids.repeat_interleave(group_size, 0)

        # The attention mask for the whole run, sliced per step instead of re-concatenated.
        attention = torch.cat([prompt_mask, prompt_mask.new_ones((n_rows, p.max_new_tokens))], dim=1)
        next_position = position_ids[:, -1] + 1  # position of the first generated token, per row
        rows = torch.arange(n_rows, device=device)
        alive = torch.ones(n_rows, dtype=torch.bool, device=device)  # only shrinks when rows are not dropped
        stop_candidates = self._stop_candidates(p.stop, logits.shape[-1], device) if p.stop else None
        for t in range(p.max_new_tokens):
            tokens, logprobs = sample_from_logits(logits, uniforms[rows, t], p.temperature, p.top_k, p.top_p)
            out_ids[rows, t] = tokens
            out_logprobs[rows, t] = logprobs
            versions[rows, t] = self.version
            finished = torch.isin(tokens, eos_ids) & alive
            if stop_candidates is not None:
                finished |= self._hits_stop(p.stop, out_ids, rows, t, stop_candidates[tokens] & alive & ~finished)
            if finished.any():
                ended = rows[finished]
                lengths[ended] = t + 1
                truncated[ended] = False
                if self.drop_finished_rows:
                    keep = (~finished).nonzero().squeeze(1)
                    if keep.numel() == 0:
                        break
                    rows, tokens, next_position = rows[keep], tokens[keep], next_position[keep]
                    attention, alive = attention[keep], alive[keep]
                    cache.batch_select_indices(keep)
                else:
                    alive &= ~finished
                    if not alive.any():
                        break
            if t == p.max_new_tokens - 1:
                break
            if self.between_tokens is not None:
                self.between_tokens()
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention[:, : prompt_len + t + 1],
                position_ids=(next_position + t)[:, None],
                use_cache=True,
                **{self._cache: cache},
            )
            cache, logits = output_cache(out), out.logits[:, -1, :]
            if self._routing is not None:
                self._routing.decode_step(rows, t)
        return out_ids, out_logprobs, lengths, truncated, versions

    def _outputs(self, n_rows: int, max_new: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A decode loop's buffers: ids [N, max_new] (pad), log-probs [N, max_new] (0), lengths [N] (max_new), a
        per-row flag [N] (True: not finished yet), versions [N, max_new] (NO_VERSION), and the EOS ids."""
        return (torch.full((n_rows, max_new), self.pad_id, dtype=torch.long, device=device),
                torch.zeros((n_rows, max_new), dtype=torch.float32, device=device),
                torch.full((n_rows,), max_new, dtype=torch.long, device=device),
                torch.ones(n_rows, dtype=torch.bool, device=device),
                torch.full((n_rows, max_new), NO_VERSION, dtype=torch.long, device=device),
                torch.tensor(self.eos_ids, dtype=torch.long, device=device))

    def _decode_static(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int, uniforms: torch.Tensor,
        p: SamplingParams,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_decode` over a fixed-shape KV cache: every decode step has the same input shapes ([N, 1] tokens and
        positions, an [N, L] attention mask, the [N, heads, L, head_dim] cache), so a compiled step is replayed as is.
        Every row stays in the batch to the end (finished ones are ignored), and the prompts are prefilled once per
        row (the prefill is a small part of the work; a static cache cannot be repeated per group after it).
        Finishing is tracked on the device; the loop ends early, checked every few steps, once every row has."""
        prompt_ids = prompt_ids.repeat_interleave(group_size, 0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
        n_rows, prompt_len = prompt_ids.shape
        device = prompt_ids.device
        out_ids, out_logprobs, lengths, alive, versions, eos_ids = self._outputs(n_rows, p.max_new_tokens, device)
        rows = torch.arange(n_rows, device=device)

        cache_len = static_cache_len(prompt_len, p.max_new_tokens)
        cache = self._static_cache(n_rows, cache_len)
        # One mask for the whole run: the prompt's, then ones (slots past the current token are causally masked).
        attention = torch.ones((n_rows, cache_len), dtype=torch.long, device=device)
        attention[:, :prompt_len] = prompt_mask
        position_ids = (prompt_mask.cumsum(1) - 1).masked_fill(prompt_mask == 0, 1)
        extra = {"logits_to_keep": 1} if self._forward_takes_logits_to_keep else {}
        logits = self.model(input_ids=prompt_ids, attention_mask=attention, position_ids=position_ids,
                            use_cache=True, **{self._cache: cache}, **extra).logits[:, -1, :]
        step = self._decode_step()
        next_position = position_ids[:, -1:] + 1
        stop_candidates = self._stop_candidates(p.stop, logits.shape[-1], device) if p.stop else None
        for t in range(p.max_new_tokens):
            tokens, logprobs = sample_from_logits(logits, uniforms[:, t], p.temperature, p.top_k, p.top_p)
            out_ids[:, t], out_logprobs[:, t], versions[:, t] = tokens, logprobs, self.version
            finished = torch.isin(tokens, eos_ids) & alive
            if stop_candidates is not None:
                finished |= self._hits_stop(p.stop, out_ids, rows, t, stop_candidates[tokens] & alive & ~finished)
            lengths = torch.where(finished, t + 1, lengths)
            alive &= ~finished
            if t == p.max_new_tokens - 1 or (t % 8 == 7 and not alive.any()):
                break
            if self.between_tokens is not None:
                version = self.version
                self.between_tokens()
                if self.version != version:  # new weights (a partial rollout): the twin's copies follow
                    refresh_twin(self._twin_pairs)
            if self.decode == "compiled":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs (logits) are consumed
            logits = step(input_ids=tokens[:, None], attention_mask=attention, position_ids=next_position + t,
                          use_cache=True, **{self._cache: cache}).logits[:, -1, :]
        return out_ids, out_logprobs, lengths, alive, versions

    def _static_cache(self, n_rows: int, cache_len: int) -> StaticCache:
        """A KV cache of fixed shape for one `generate` call (a `NarrowStaticCache`, allocated by `_allocate`):
        "static" makes a new one, freed with the call; "compiled" keeps one per (rows, length) for the engine's life
        and resets it, so that the CUDA graph recorded on it is replayed on the same addresses (transformers'
        generate keeps its static cache the same way). The price: the cache stays allocated during the updates (28
        layers × 128 rows × 384 slots of bf16 K/V: 5.6 GB on the Qwen3-0.6B shape, also under bf16 autocast; 11.3 GB
        in float32; benchmarks/RESULTS.md §5); rollout.decode=dynamic frees everything between rollouts, and
        `release_cache` gives the caches' memory back at `release` (on CUDA they are allocated where
        torch_memory_saver can unmap them and map them again at the same addresses). At most `KEPT_CACHES` are kept,
        holding together at most `KEPT_CACHE_SHARE` of the device's memory, the least recently used freed first (a
        call whose cache is larger than that share alone decodes dynamically: `_keeps`): shapes that keep changing (a
        rollout's row count, evaluation remainders) must not accumulate caches until the GPU is out of memory, nor
        may a long evaluation's cache stay through the updates."""
        if self.decode != "compiled":
            cache = NarrowStaticCache(config=self.model.config, max_cache_len=cache_len)
            self._allocate(cache, n_rows)
            return cache
        if self._pauses_caches:
            cache_memory.resume()  # (contents undefined: reset below, or made by _allocate)
        cache = self._static_caches.pop((n_rows, cache_len), None)  # re-inserted below: the most recently used
        if cache is None:
            layout, budget = self._cache_layout(), self._cache_budget()
            size = cache_bytes(layout, n_rows, cache_len)
            while self._static_caches and (len(self._static_caches) >= KEPT_CACHES or size + sum(
                    cache_bytes(layout, *shape) for shape in self._static_caches) > budget):
                del self._static_caches[next(iter(self._static_caches))]
            cache = NarrowStaticCache(config=self.model.config, max_cache_len=cache_len)
            self._allocate(cache, n_rows)
        else:
            cache.reset()
        self._static_caches[n_rows, cache_len] = cache
        return cache

    def _keeps(self, n_rows: int, cache_len: int) -> bool:
        """Whether the compiled loop keeps a cache of this shape (`KEPT_CACHE_SHARE`): `generate` decodes a call whose
        cache would not fit dynamically, which allocates as the completions grow and frees it all at the end, and
        records no CUDA graph for a shape whose cache could not stay (each new allocation would record it again)."""
        return ((n_rows, cache_len) in self._static_caches
                or cache_bytes(self._cache_layout(), n_rows, cache_len) <= self._cache_budget())

    def _compiles(self, n_rows: int, cache_len: int) -> bool:
        """Whether the compiled loop decodes a call of this shape with its compiled step (and records the shape): a
        shape it compiled for, or a new one whose cache it keeps (`_keeps`) while fewer than `compiled_shapes_limit()`
        shapes are compiled. Past that limit a new shape decodes with the dynamic loop (a warning, once per engine)
        rather than dynamo's eager fallback of the static loop."""
        shape = (n_rows, cache_len)
        if shape in self._compiled_shapes:
            return True
        if not self._keeps(n_rows, cache_len):
            return False
        limit = compiled_shapes_limit()
        if len(self._compiled_shapes) >= limit:
            if not self._warned_shapes:
                log.warning("compiled decode: the step is compiled for %d shapes (rows, cache slots) %s, dynamo's "
                            "recompile limit (torch._dynamo.config.recompile_limit); a call of another shape, here "
                            "%s, decodes with the dynamic loop. Raise that limit to compile more shapes (each a "
                            "compile of its own).", limit, sorted(self._compiled_shapes), shape)
                self._warned_shapes = True
            return False
        self._compiled_shapes.add(shape)
        return True

    def _cache_budget(self) -> int:
        """`cache_share` (KEPT_CACHE_SHARE unless the device has more engines) of the total memory of the device the
        engine's weights are on, in bytes."""
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(self.cache_share * total)

    @property
    def _pauses_caches(self) -> bool:
        """Whether `release` unmaps the compiled loop's caches (CUDA) rather than freeing them (`release_cache`)."""
        return (self.release_cache and self.decode == "compiled"
                and next(self.model.parameters()).device.type == "cuda")

    def _cache_layout(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Each layer's K and V as the static caches hold them, as empty [1, heads, 0, head_dim] tensors on the
        model's device: the head shapes the model computes them in and their dtypes, or the autocast dtype under
        autocast (`NarrowStaticCache`: K leaves the rotary embedding in float32 there, and is read in bf16), read off
        a one-token forward of one row that records what each layer hands its cache (`_ProbeCache`; once per engine);
        None for a layer the model never fills."""
        if self._layout is None:
            self._layout = self._probe_layout()
        return self._layout

    def _probe_layout(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        device = next(self.model.parameters()).device
        scratch = _ProbeCache(config=self.model.config, max_cache_len=1)
        extra = {"logits_to_keep": 1} if self._forward_takes_logits_to_keep else {}
        one = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.model(input_ids=one, attention_mask=torch.ones_like(one), position_ids=one, use_cache=True,
                   **{self._cache: scratch}, **extra)
        seen = [scratch.seen.get(i) for i in range(len(scratch.layers))]
        return [None if kv is None else
                tuple(t.new_empty((1, t.shape[1], 0, t.shape[-1]), dtype=self.autocast or t.dtype) for t in kv)
                for kv in seen]

    def _allocate(self, cache: StaticCache, n_rows: int) -> None:
        """Allocate `cache`'s tensors now, zeroed (transformers allocates a layer's on its first update, inside the
        prefill), as `_cache_layout` says; a layer the model never fills is left to its first update. The layout's
        probe forward runs before the `cache_memory.region` (with `release_cache` on CUDA), so only the caches' own
        tensors are allocated in it: a library buffer made by a first matmul there (cuBLAS's workspace) would be
        unmapped with them."""
        layout = self._cache_layout()
        with cache_memory.region() if self._pauses_caches else contextlib.nullcontext():
            for layer, kv in zip(cache.layers, layout, strict=True):
                if kv is not None:
                    k, v = kv
                    layer.lazy_initialization(k.new_empty((n_rows, *k.shape[1:])), v.new_empty((n_rows, *v.shape[1:])))

    def _decode_step(self):
        """The model's forward for one decode step: as is ("static"), or compiled once per engine ("compiled"), by
        `compile_decode_step`. Under autocast over float32 weights the compiled step runs the model's `autocast_twin`
        (its Linear weights held in the autocast dtype: the same values; with `release_cache` on CUDA given back and
        mapped again with the caches), whose copies are refreshed from the model's weights here, at the start of
        every compiled loop, and after `between_tokens` brings new weights: the step samples the current policy."""
        if self.decode != "compiled":
            return self.model
        if self._compiled_step is None:
            model = self.model
            if self.autocast is not None and self.twin_weights:
                with torch.inference_mode(False):  # ordinary tensors, updated in place under inference mode
                    model, self._twin_pairs = autocast_twin(
                        self.model, self.autocast, cache_memory.region() if self._pauses_caches else None)
            self._compiled_step = compile_decode_step(model, next(self.model.parameters()).device.type == "cuda")
        if self._pauses_caches:
            cache_memory.resume()  # (the copies are paused with the caches)
        refresh_twin(self._twin_pairs)
        return self._compiled_step

    # ------------------------------------------------------------------ stop strings

    def _hits_stop(self, stop: tuple[str, ...], out_ids: torch.Tensor, rows: torch.Tensor, t: int,
                   candidates: torch.Tensor) -> torch.Tensor:
        """Which batch positions' completions (tokens 0..t) now contain a stop string; only `candidates` are decoded.

        A row that did not contain a stop string before this step and does now has just completed one, ending in
        this step's token: so only the last tokens are decoded, a window of 4 per character of the longest stop
        string (a character is at most 4 bytes, a token at least one) and 8 more, so that the text a window starts
        with (a cut character, a dropped leading space) is far from any stop string it can hold. The candidates'
        tokens are copied to the host at once (one device sync per step, not one per row).
        """
        picked = candidates.nonzero().squeeze(1)
        hits = torch.zeros_like(candidates)
        if picked.numel() == 0:
            return hits
        window = 4 * max(map(len, stop)) + 8
        texts = self.tokenizer.batch_decode(out_ids[rows[picked], max(0, t + 1 - window): t + 1].tolist(),
                                            skip_special_tokens=True)
        hit = [b for b, text in zip(picked.tolist(), texts, strict=True) if any(s in text for s in stop)]
        hits[torch.tensor(hit, dtype=torch.long, device=hits.device)] = True
        return hits

    def _stop_candidates(self, stop: tuple[str, ...], vocab: int, device: torch.device) -> torch.Tensor:
        """Bool [V]: tokens that can complete a stop string, i.e. whose text can contain a stop string's last char.

        Conservative on purpose: a token decoded alone may lose leading whitespace or be a partial UTF-8 byte, so
        tokens decoding to '' or containing U+FFFD count, and a stop string ending in whitespace makes every token a
        candidate. Cached per tuple of stop strings.
        """
        if self._stop_table is None or self._stop_table[0] != stop or self._stop_table[1].numel() != vocab:
            last_chars = {s[-1] for s in stop}
            if any(c.isspace() for c in last_chars):
                table = torch.ones(vocab, dtype=torch.bool)
            else:
                known = min(vocab, len(self.tokenizer))
                pieces = self.tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=True)
                flags = [not s or "\ufffd" in s or any(c in s for c in last_chars) for s in pieces]
                table = torch.tensor(flags + [True] * (vocab - known), dtype=torch.bool)
            self._stop_table = (stop, table)
        return self._stop_table[1].to(device)

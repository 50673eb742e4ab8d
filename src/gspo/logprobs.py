"""Per-token log-probabilities of given completions under a causal LM (teacher forcing).

Two things keep this cheap (both exact up to float rounding, both tested against the naive computation):

- Memory: log π(y_t) is computed from the final hidden states in chunks of tokens (`chunked_token_logprobs`), so the
  N×T×V logits never exist at once; the backward recomputes each chunk's logits instead of keeping them. At Qwen3's
  vocabulary (151,936) and 4k completion tokens that is ~0.3 GB instead of ~7 GB for logits, log-softmax and their
  gradients (benchmarks/logprobs_memory.py). Tiles of chunk × vocabulary slice are sized by a budget of float32
  logits per device (`LOGPROB_CHUNK_MIB`; on CUDA chunks of 4,096 tokens, `LOGPROB_CHUNK_ROWS`, whose matmuls fill
  the GPU, over slices of the vocabulary).
- Padding (`trim_padding=True`): rows are forwarded in length buckets, each cut to its own longest prompt and
  completion, and the last completion token (which predicts nothing) is not fed, so left/right padding costs
  (almost) nothing; a prompt shared by several rows (a group) can run once (`share_prompts`). This changes the token
  layout the model sees, so it is off by default: MoE routing capture and replay (`gspo.moe.RoutingCapture`) need
  one forward over the full [N, S + T] layout.

And on a GPU under mixed precision (`trainer.mixed_precision`, torch.autocast on CUDA) the head's matmul runs in the
compute dtype (bf16 tensor cores, as the model's own head would) while the log-softmax, its gradient and the entropy
stay float32; `chunked_token_logprobs` states the tolerance against float32.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel
from transformers.modeling_outputs import MoeModelOutputWithPast

from gspo.models import cache_keyword, compile_options, output_cache

LOGPROB_CHUNK_MIB: dict[str, int] = {"cpu": 64, "cuda": 128}
"""Default size of one tile of `chunked_token_logprobs` (a chunk of tokens × a slice of the vocabulary), as MiB of
float32 logits, by device type (other devices: the CPU's). The head's transient memory is a few tiles (the matmul's
logits, their float32 upcast, the gradient), besides the float32 weight gradient the backward accumulates."""

LOGPROB_CHUNK_ROWS: dict[str, int] = {"cuda": 4096}
"""Tokens per chunk by device type; a device type not listed (the CPU) takes as many as one slice of the whole
vocabulary fits LOGPROB_CHUNK_MIB (110 at Qwen3's 151,936 words), so its tiles are whole rows of logits. Why CUDA
slices the vocabulary: every chunk reads the whole head weight, so a chunk must be hundreds of tokens for its
matmul to be compute-bound rather than weight-bandwidth-bound, and whole rows of that many tokens are large (883
rows of Qwen3's vocabulary are 512 MiB of float32). At 4,096 tokens a tile is 8,192 words wide (128 MiB): a
69-GFLOP matmul at hidden size 1,024 in a quarter of that memory, and no tile holds the head weight in bf16 whole."""

HEAD_AUTOCAST_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types on which the chunked head's matmul follows torch.autocast (`trainer.mixed_precision`): bf16 tensor
cores there, as the model's own head and the full-logits path compute it. Elsewhere (CPU) it keeps running in the
weights' dtype under autocast too, as before (float32 over float32 weights), so CPU runs keep their numbers.
`head_dtype=` overrides the choice either way."""


def default_chunk_tokens(vocab_size: int, device: torch.device | str) -> int:
    """Tokens per chunk of `chunked_token_logprobs` by default on `device` (LOGPROB_CHUNK_ROWS)."""
    device_type = torch.device(device).type
    if device_type in LOGPROB_CHUNK_ROWS:
        return LOGPROB_CHUNK_ROWS[device_type]
    return max(1, _budget(device_type) // (4 * vocab_size))


def default_vocab_chunk(vocab_size: int, rows: int, device: torch.device | str) -> int:
    """Words per vocabulary slice of `chunked_token_logprobs` for chunks of `rows` tokens: as many as a tile of
    LOGPROB_CHUNK_MIB of float32 logits holds, at most the whole vocabulary."""
    return min(vocab_size, max(1, _budget(torch.device(device).type) // (4 * rows)))


def _budget(device_type: str) -> int:
    return LOGPROB_CHUNK_MIB.get(device_type, LOGPROB_CHUNK_MIB["cpu"]) << 20


def head_compute_dtype(weight: torch.Tensor, device_type: str) -> torch.dtype:
    """The dtype of the chunked head's matmul by default: the autocast dtype where autocast is on for
    `device_type` and that device type is in HEAD_AUTOCAST_DEVICES, else the head weights' own dtype."""
    if device_type in HEAD_AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


_PLAIN_HEAD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()  # `_logits_are_the_head`


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(h W^T + b)/τ at the target token, computed one tile at a time: `chunk` tokens × `width` words of
    the vocabulary (a slice of W and b). Each tile gives its log-sum-exp, the target's logit if the target is in it,
    and its share of the entropy; the tiles of a chunk combine exactly (`_combine`). The backward recomputes each
    tile's logits (∂/∂logits = (onehot − softmax)·g/τ), so only the [M] log-sum-exps are saved besides the inputs.

    The matmuls (forward and the backward ones) run in `dtype` with autocast off, on a slice of the weights cast to
    it (never the whole weight at once); the logits are upcast to float32 before anything else, so the log-softmax,
    its gradient and the entropy are float32 whatever `dtype` is, and the gradients of the hidden states (over
    several slices) and of the weights (over several chunks) are accumulated in float32 (`_add_product`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, width, with_entropy, dtype):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        ctx.fused = _FUSED_HEAD["on"]
        stats = _fused(_tile_stats) if ctx.fused else _tile_stats
        for s in range(0, n, chunk):
            h, t = hidden[s:s + chunk], targets[s:s + chunk]
            tiles = [stats(_chunk_matmul(h, *_slice(weight, bias, v, width, dtype)), t - v, temperature, with_entropy)
                     for v in range(0, weight.shape[0], width)]
            lse[s:s + chunk], logprobs[s:s + chunk], ent = _combine(tiles)
            if with_entropy:
                entropy[s:s + chunk] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.width, ctx.head_dtype = temperature, chunk, width, dtype
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        width, vocab = ctx.width, weight.shape[0]
        sliced = width < vocab  # several slices: the hidden states' gradient is a sum, accumulated in float32
        grad_h = None if not need_h else (torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
                                          if sliced else torch.empty_like(hidden))
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        logits_grad = _fused(_tile_logits_grad) if ctx.fused else _tile_logits_grad
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk].to(ctx.head_dtype)
            for v in range(0, vocab, width):
                w, b = _slice(weight, bias, v, width, ctx.head_dtype)
                grad_logits = logits_grad(_chunk_matmul(h, w, b), lse[s:s + ctx.chunk], targets[s:s + ctx.chunk] - v,
                                          grad_logprobs[s:s + ctx.chunk], ctx.temperature, ctx.head_dtype)
                with torch.autocast(hidden.device.type, enabled=False):
                    if need_h and sliced:
                        _add_product(grad_h[s:s + ctx.chunk], grad_logits, w)
                    elif need_h:
                        grad_h[s:s + ctx.chunk] = grad_logits @ w
                    if need_w:
                        _add_product(grad_w[v:v + width], grad_logits.t(), h)
                    if need_b:
                        grad_b[v:v + width] += grad_logits.float().sum(0)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _slice(weight: torch.Tensor, bias: torch.Tensor | None, start: int, width: int,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Words start..start + width of the head, in `dtype` (a view, no copy, in the weights' own dtype)."""
    return weight[start:start + width].to(dtype), None if bias is None else bias[start:start + width].to(dtype)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for a float32 `acc`, in place, the product never rounded to the dtype of `a` and `b` first nor
    held as a tensor of its own: a weight-sized bf16 product and its float32 sum would be two more copies of the
    head weight at the top of the backward. On CUDA a bf16 / fp16 matmul writes float32 directly (cuBLAS, torch's
    out_dtype); elsewhere the operands are upcast (one tile, and the chunk's hidden states)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One tile's logits in the dtype of `weight` (autocast off). With float32 weights this is exactly what the
    model's own float32 head computes without autocast."""
    with torch.autocast(hidden.device.type, enabled=False):
        return nn.functional.linear(hidden.to(weight.dtype), weight, bias)


def _tile_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Of one tile of logits z / τ [rows, words], in float32 whatever the logits' dtype (the matmul's): the
    log-sum-exp, the target's logit where `targets` (relative to the tile's first word) falls in it and 0 elsewhere,
    and Σ softmax(z)·z over the tile (None without `with_entropy`)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, -1)
    inside = (targets >= 0) & (targets < z.shape[-1])
    target = z.gather(-1, targets.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(-1).where(inside, 0.0)
    if not with_entropy:
        return lse, target, None
    probs = (z - lse[:, None]).exp_()
    return lse, target, probs.mul_(z).sum(-1)


def _combine(tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A chunk's (log-sum-exp, target log-prob, entropy H = lse − Σ p·z) from its tiles' `_tile_stats`: the
    log-sum-exp of theirs, and each tile's Σ softmax·z weighted by its share of the probability, exp(lse_t − lse).
    One tile (the whole vocabulary) is taken as it is."""
    if len(tiles) == 1:
        lse, target, dot = tiles[0]
        return lse, target - lse, None if dot is None else lse - dot
    lses = torch.stack([t[0] for t in tiles])
    lse = torch.logsumexp(lses, 0)
    target = torch.stack([t[1] for t in tiles]).sum(0)
    if tiles[0][2] is None:
        return lse, target - lse, None
    dot = ((lses - lse).exp() * torch.stack([t[2] for t in tiles])).sum(0)
    return lse, target - lse, lse - dot


def _tile_logits_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor,
                      temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """∂(Σ g·log-prob)/∂logits of one tile, (onehot − softmax(z / τ))·g / τ with the chunk's log-sum-exp `lse` and
    `targets` relative to the tile's first word (a target outside the tile adds nothing), computed in float32 and
    returned in `dtype` (the matmul's). In place on the upcast logits, which are not needed after."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    g = g[:, None].float()
    grad = z.sub_(lse[:, None]).exp_().mul_(-g)
    inside = (targets >= 0) & (targets < grad.shape[-1])
    grad.scatter_add_(-1, targets.clamp(0, grad.shape[-1] - 1)[:, None], g * inside[:, None])
    if temperature != 1.0:
        grad /= temperature
    return grad.to(dtype)


_FUSED_HEAD = {"on": False}
_FUSED: dict[Callable, Callable] = {}


def _fused(fn: Callable) -> Callable:
    """`fn` compiled by torch.compile (dynamic shapes: chunks differ in rows), made once per process."""
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn, dynamic=True, options=compile_options())
    return _FUSED[fn]


@contextlib.contextmanager
def fused_head(enabled: bool = True) -> Iterator[None]:
    """Within (`trainer.compile`, beside `gspo.models.compiled_layers`): `chunked_token_logprobs` runs the float32
    passes over each tile of logits compiled, so that inductor fuses them: the forward's upcast, log-sum-exp, target
    gather and entropy, and the backward's upcast, softmax gradient and downcast, each read the matmul's logits once
    instead of 3 to 6 eager passes over a float32 tile (at Qwen3's 151,936-word vocabulary ~75 GB of memory traffic
    per minibatch forward and backward of 32 × 256 tokens, by arithmetic). The matmuls stay as they are. Values:
    the same computation within float rounding (`tests/test_compile.py`)."""
    before = _FUSED_HEAD["on"]
    _FUSED_HEAD["on"] = enabled
    try:
        yield
    finally:
        _FUSED_HEAD["on"] = before


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    head_dtype: torch.dtype | None = None,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature)[targets] for hidden [M, H], targets [M]: returns
    (logprobs [M] float32 with gradient to hidden/weight/bias, entropy [M] float32 detached or None).

    Never holds more than one tile of logits: `chunk_size` tokens (default: `default_chunk_tokens`) × `vocab_chunk`
    words (default: `default_vocab_chunk`, LOGPROB_CHUNK_MIB of float32 logits for the device), nor the head weight
    in another dtype than its own beyond one slice; the backward adds the float32 weight gradient.

    head_dtype: the dtype of the head's matmuls (forward and backward); None = `head_compute_dtype`: under autocast
        on CUDA the autocast dtype (bf16 tensor cores, like the model's own head and the full-logits path), otherwise
        the weights' dtype. The logits are upcast to float32 before the log-softmax, its gradient and the entropy,
        and the gradients are accumulated over chunks and slices in float32.

    Precision: in float32 (float32 weights without autocast, or autocast on a CPU) this equals the naive full-logits
    computation in value and gradient up to float rounding (tests: values within 2e-5, gradients within 1e-5 of each
    parameter's largest entry, whole rows or slices of the vocabulary). With a bf16 matmul the log-probs carry the
    bf16 rounding of the hidden states, the weights and the logits (the log-softmax itself adds none): measured on a
    CPU under torch.autocast (64 tokens, hidden 256, vocabulary 8,192, logits of standard deviation 2; four seeds)
    the largest error against the float32 reference is 1.2e-2 to 2.2e-2 (mean 4.0e-3 to 4.9e-3), where a
    log-softmax computed in bf16 too is off by up to 3.7e-2 to 4.8e-2 (mean 1.5e-2 to 1.75e-2); gradients are within
    4e-3 to 7e-3 of each one's largest entry. The errors grow in proportion to the logits' scale.
    `test_bf16_head_matmul_keeps_a_float32_log_softmax` asserts 3e-2 (mean 1e-2), and gradients within 1.5e-2.
    """
    if (chunk_size or 0) < 0 or (vocab_chunk or 0) < 0:
        raise ValueError(f"chunked_token_logprobs: chunk_size and vocab_chunk are positive (None or 0: the device's "
                         f"default), got chunk_size={chunk_size}, vocab_chunk={vocab_chunk}")
    chunk = chunk_size or default_chunk_tokens(weight.shape[0], weight.device)
    width = vocab_chunk or default_vocab_chunk(weight.shape[0], chunk, weight.device)
    dtype = head_compute_dtype(weight, hidden.device.type) if head_dtype is None else head_dtype
    logprobs, entropy = _ChunkedTokenLogprob.apply(hidden, weight, bias, targets, temperature, chunk, width,
                                                   with_entropy, dtype)
    return logprobs, entropy if with_entropy else None


def _is_fsdp_sharded(model: nn.Module) -> bool:
    """Whether `model` is sharded in place by FSDP2 (`fully_shard`), see gspo.parallel.wrap."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return False
    return isinstance(model, FSDPModule)


def _lora_base(model: nn.Module) -> nn.Module:
    """The model a peft LoRA `PeftModel` injected its layers into (`get_base_model()`): for LoRA, the wrapper's forward
    is that model's, adapters included, so its backbone and head serve the hidden-state path. Any other module (and a
    prompt-learning peft model, whose forward adds virtual tokens) is returned as is."""
    if not hasattr(model, "get_base_model") or not hasattr(model, "peft_config"):
        return model
    active = getattr(model, "active_peft_config", None)
    return model if active is None or getattr(active, "is_prompt_learning", True) else model.get_base_model()


def _backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(decoder backbone, LM head) of a plain Hugging Face causal LM whose logits are exactly `head(last hidden
    state)`, also inside a peft LoRA wrapper; None when that cannot be relied on (DDP without `LogprobForward`, FSDP,
    soft-capped or scaled logits, custom heads), in which case the caller takes the full-logits path."""
    model = _lora_base(model)
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(backbone, PreTrainedModel) or backbone is model or type(head) is not nn.Linear:
        return None
    if not (isinstance(model, PreTrainedModel) and type(model).__name__.endswith("ForCausalLM")):
        return None
    if _is_fsdp_sharded(model):  # its parameters are whole only inside the root module's forward
        return None
    if not _logits_are_the_head(model, prefix, head):
        return None
    return backbone, head


class _StandIn(nn.Module):
    """A backbone that returns the given hidden states whatever it is called with (`_logits_are_the_head`)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> MoeModelOutputWithPast:
        return MoeModelOutputWithPast(last_hidden_state=self.hidden)  # no router logits: no auxiliary loss


class _StandInHead(nn.Module):
    """A head of rank one, `(h · direction) ⊗ spread` (`_logits_are_the_head`): its logits follow its input (a model
    that scales the hidden states before its head shows) at the real head's width, without the real weights."""

    def __init__(self, direction: torch.Tensor, spread: torch.Tensor) -> None:
        super().__init__()
        self.direction, self.spread = direction, spread

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden.float() @ self.direction)[..., None] * self.spread


def _logits_are_the_head(model: PreTrainedModel, prefix: str, head: nn.Linear) -> bool:
    """Whether `model`'s logits are exactly `head(last hidden state)`, checked once per model: its own forward runs
    with the backbone and the head stood in for (`_StandIn`, `_StandInHead`: logits ~100 in magnitude), bypassing
    every module's hooks (no routing capture, FSDP gather or user hook sees it, no weight is read), and its logits
    are compared with the stand-in head's. A soft cap (Gemma 2's final_logit_softcapping, RecurrentGemma's
    logits_soft_cap), a logit scale (Cohere), a width multiplier or a cut of the vocabulary shows as a mismatch; so
    does any other post-processing a model class adds, where a list of config keys would have to know them all
    (RecurrentGemma's soft cap was missed so, silently: π_θ came from uncapped logits while the engine sampled
    capped ones). False, and the full-logits path, on a mismatch or an error."""
    if model in _PLAIN_HEAD:
        return _PLAIN_HEAD[model]
    g = torch.Generator().manual_seed(0)
    device, dtype = head.weight.device, head.weight.dtype
    hidden = torch.randn(1, 2, head.in_features, generator=g).to(device, dtype)
    direction = torch.nn.functional.normalize(torch.randn(head.in_features, generator=g), dim=0).to(device)
    spread = torch.randn(head.out_features, generator=g).to(device)
    stand_in = _StandInHead(direction, spread / float((hidden.float() @ direction).abs().max()) * 100)
    backbone = getattr(model, prefix)
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            want = stand_in(hidden)
            setattr(model, prefix, _StandIn(hidden))
            model.set_output_embeddings(stand_in)
            try:
                got = type(model).forward(model, input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                                          use_cache=False).logits.float()
            finally:
                setattr(model, prefix, backbone)
                model.set_output_embeddings(head)
        plain = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-2, atol=0.5))
    except Exception:  # a forward that needs more than hidden states: the general path
        plain = False
    _PLAIN_HEAD[model] = plain
    return plain


def _length_buckets(p: list[int], c: list[int], min_waste: int = 128, max_waste: float = 0.05) -> list[list[int]]:
    """Row indices grouped so that each group, cut to its longest prompt and completion (lengths `p`, `c`, read on the
    host once per forward), wastes little on padding.

    Rows are taken longest first (ties in row order); a row starts a new group when adding it would make the group's
    padding exceed both `min_waste` tokens and `max_waste` × its real tokens (small batches stay one forward: a
    forward has a fixed cost).
    """
    order = sorted(range(len(p)), key=lambda i: -(p[i] + c[i]))
    buckets, current, p_max, c_max, real = [], [], 0, 0, 0
    for i in order:
        new_p, new_c, new_real = max(p_max, p[i]), max(c_max, c[i]), real + p[i] + c[i]
        waste = (len(current) + 1) * (new_p + new_c) - new_real
        if current and waste > max(min_waste, max_waste * new_real):
            buckets.append(current)
            current, new_p, new_c, new_real = [], p[i], c[i], p[i] + c[i]
        current.append(i)
        p_max, c_max, real = new_p, new_c, new_real
    buckets.append(current)
    return buckets


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    chunk_size: int | None = None,
    trim_padding: bool = False,
    share_prompts: bool | None = None,
    head_dtype: torch.dtype | None = None,
    equal_forwards: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | x, y_<t) / temperature-scaled, for every completion token: returns (logprobs [N, T] float32,
    entropy [N, T] float32 or None). Prompts are left-padded, completions right-padded; position ids count real
    tokens only, so left padding does not shift positions (same convention as the rollout sampler).

    The prompt never costs a vocab projection. The temperature matches the sampler's: π_θ and π_old must be the same
    distribution family. Entropy is of the temperature-scaled distribution, detached (a diagnostic).

    chunk_size: tokens per chunk of the vocab projection (`chunked_token_logprobs`); None = `default_chunk_tokens`
        (LOGPROB_CHUNK_MIB of float32 logits for the device); 0 = the full-logits path (`logits_to_keep`), also
        taken for models whose head is not a plain linear map of the last hidden state. The chunked path returns 0
        at padded completion positions.
    trim_padding: forward in length buckets cut to their own lengths (see the module docstring); the model then does
        not see the [N, S + T] layout, so leave it off under MoE routing capture or replay.
    share_prompts: with `trim_padding`, run each distinct prompt once per bucket and its completions against its KV
        cache (`_trimmed_bucket_hidden`); None = when that saves at least PROMPT_SHARING_MIN of the tokens. Never
        while the model trains with gradient checkpointing (its checkpointed layers drop the KV cache in train mode).
    head_dtype: the chunked head's matmul dtype (`chunked_token_logprobs`); None = the autocast dtype under autocast
        on CUDA, else the head weights' dtype. The log-softmax is float32 either way.
    equal_forwards: with `trim_padding`, for processes whose every backbone forward is a collective (FSDP2: see
        `LogprobForward.logprobs`): maps this process's number of bucket forwards to the number all of them run
        (their maximum); a process with fewer runs one-token forwards that add 0 to the result. Prompt sharing is
        then off (one forward per bucket).
    """
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(inner, LogprobForward):  # one forward through the wrapper (DDP's gradient sync), the fast path inside
        return model(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy,
                     chunk_size=chunk_size, trim_padding=trim_padding, share_prompts=share_prompts,
                     head_dtype=head_dtype, completion_logprobs=True)
    split = _backbone_and_head(model) if chunk_size != 0 else None
    if split is not None:
        return _hidden_state_logprobs(split, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                                      with_entropy, chunk_size, trim_padding, share_prompts, head_dtype,
                                      equal_forwards)
    if equal_forwards is not None and trim_padding:  # the others may count buckets: the full-logits path is one
        equal_forwards(1)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    t = completion_ids.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=t + 1,
        use_cache=False,
    ).logits[:, :-1].float()  # [N, T, V]: position t predicts completion token t
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    logprobs = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


class LogprobForward(nn.Module):
    """`completion_logprobs` of `module` as this module's forward: what `gspo.parallel.wrap_policy` puts inside
    DistributedDataParallel, so that a training forward is one DDP forward (DDP all-reduces the gradients only of
    what ran inside its forward: calling the backbone and the head past it would silently skip the sync) and still
    takes the chunked head, the length buckets and prompt sharing instead of DDP's full N×T×V logits. `module` stays
    the attribute DDP-style unwrapping (`gspo.rollout.unwrap_model`) follows, so checkpoints and engines see the
    bare model. Called without `completion_logprobs=True` it is `module` itself (`ddp(input_ids=..., labels=...)`).

    `group` (a `gspo.parallel.ProcessGroup`): given for an FSDP2 root, whose every backbone forward is a collective
    (`gspo.parallel.wrap`)."""

    def __init__(self, module: nn.Module, group: Any = None) -> None:
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, *args, completion_logprobs: bool = False, **kwargs) -> Any:
        if not completion_logprobs:
            return self.module(*args, **kwargs)
        return self.logprobs(*args, **kwargs)

    def logprobs(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`completion_logprobs(module, ...)` (what a subclass changes). With a `group` (an FSDP2 root), every
        process runs the same number of backbone forwards (`equal_forwards`: their maximum): each forward of a
        sharded layer is a collective, and the length buckets depend on each process's rows, so processes with
        different numbers of forwards would wait on each other forever (an async FSDP run hung so before)."""
        if self.group is not None:
            kwargs["equal_forwards"] = lambda count: self.group.all_max([count])[0]
        return completion_logprobs(self.module, *args, **kwargs)


def _hidden_state_logprobs(
    split: tuple[nn.Module, nn.Linear],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_size: int | None,
    trim_padding: bool,
    share_prompts: bool | None,
    head_dtype: torch.dtype | None = None,
    equal_forwards: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`completion_logprobs` through the backbone's last hidden states and `chunked_token_logprobs`: one backbone
    forward per length bucket (one over the full layout without `trim_padding`), then one chunked head call over the
    real completion tokens of all buckets, scattered back to [N, T] (0 at padding)."""
    backbone, head = split
    n, s = prompt_ids.shape
    t = completion_ids.shape[1]
    c_mask = completion_mask.bool()
    if trim_padding:  # the lengths, read on the host in one sync; buckets without a completion token need no forward
        p_lens, c_lens = torch.stack([prompt_mask.sum(-1).long(), c_mask.sum(-1)]).tolist()
        buckets = [b for b in _length_buckets(p_lens, c_lens) if any(c_lens[i] for i in b)]
    else:
        buckets = [list(range(n))]
    padding_forwards = 0
    if equal_forwards is not None and trim_padding:  # (without it: one forward everywhere)
        share_prompts = False  # one forward per bucket, so that the count is the buckets'
        padding_forwards = equal_forwards(len(buckets)) - len(buckets)
    hidden, rows, cols = [], [], []
    for bucket in buckets:
        idx = torch.tensor(bucket, device=prompt_ids.device)
        p_ids, p_mask, c_ids, cm = prompt_ids[idx], prompt_mask[idx], completion_ids[idx], c_mask[idx]
        if trim_padding:  # cut to this bucket's longest prompt and completion; the last completion token is not fed
            p_len, c_len = max(p_lens[i] for i in bucket), max(c_lens[i] for i in bucket)
            p_ids, p_mask, c_ids, cm = p_ids[:, s - p_len:], p_mask[:, s - p_len:], c_ids[:, :c_len], cm[:, :c_len]
            predicting = _trimmed_bucket_hidden(backbone, p_ids, p_mask, c_ids, cm, share_prompts)
        else:
            inputs, attention = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, cm], 1).long()
            last = backbone(input_ids=inputs, attention_mask=attention,
                            position_ids=(attention.cumsum(-1) - 1).clamp(min=0), use_cache=False).last_hidden_state
            predicting = last[:, s - 1:s - 1 + t]  # position s-1+j predicts completion token j
        r, c = cm.nonzero(as_tuple=True)
        hidden.append(predicting[r, c])
        rows.append(idx[r])
        cols.append(c)
    logprobs = torch.zeros((n, t), dtype=torch.float32, device=prompt_ids.device)
    for _ in range(padding_forwards):  # as many collective forwards as the other processes; adds 0 (and 0 gradient)
        one = torch.ones((1, 1), dtype=torch.long, device=prompt_ids.device)
        out = backbone(input_ids=prompt_ids[:1, -1:], attention_mask=one, position_ids=one - 1, use_cache=False)
        logprobs = logprobs + 0.0 * out.last_hidden_state.float().sum()
    entropy = torch.zeros((n, t), dtype=torch.float32, device=prompt_ids.device) if with_entropy else None
    if not hidden:
        return logprobs + 0.0 * sum(p.sum() for p in head.parameters()), entropy
    rows_all, cols_all = torch.cat(rows), torch.cat(cols)
    lp, ent = chunked_token_logprobs(torch.cat(hidden), head.weight, completion_ids[rows_all, cols_all], head.bias,
                                     temperature, chunk_size, with_entropy, head_dtype)
    logprobs = logprobs.index_put((rows_all, cols_all), lp)
    if entropy is not None:
        entropy[rows_all, cols_all] = ent
    return logprobs, entropy


PROMPT_SHARING_MIN = 0.25
"""Auto prompt sharing is used when it saves at least this fraction of a bucket's tokens. Two forwards over fewer
tokens each cost more per token (per-call overhead, smaller matmuls, the cache concatenation): measured on this CPU,
16 rows of 8 groups with 6-token prompts and 16-token completions (16% saved) got ~15% slower, with 60-token prompts
(45% saved) 29% (tiny MoE) to 36% (58.8M MoE) faster."""


def _checkpointing_drops_cache(model: nn.Module) -> bool:
    """Whether `model` trains with gradient checkpointing: transformers' checkpointed layers then ignore
    `past_key_values` (and `use_cache`), so a forward against a prompt's KV cache would not see the prompt."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _trimmed_bucket_hidden(backbone: nn.Module, p_ids: torch.Tensor, p_mask: torch.Tensor, c_ids: torch.Tensor,
                           cm: torch.Tensor, share_prompts: bool | None) -> torch.Tensor:
    """Hidden states [B, c_len, H] that predict each completion token of a trimmed bucket (prompt [B, p_len],
    completion [B, c_len]); the last completion token is not fed.

    With prompt sharing, rows with the same prompt (a group's G completions) run it once: a forward of the unique
    prompts fills a KV cache (with gradient), whose rows are then indexed per completion row, and a second forward
    runs the completions against it. Same computation per token (prompt positions never attend to completions)."""
    p_len, c_len = p_ids.shape[1], c_ids.shape[1]
    unique, inverse = torch.unique(torch.cat([p_ids, p_mask], 1), dim=0, return_inverse=True)
    saved = (len(p_ids) - len(unique)) * p_len
    if share_prompts is None:
        share_prompts = saved >= PROMPT_SHARING_MIN * len(p_ids) * (p_len + c_len - 1)
    if not share_prompts or saved == 0 or _checkpointing_drops_cache(backbone):
        inputs, attention = torch.cat([p_ids, c_ids[:, :-1]], 1), torch.cat([p_mask, cm[:, :-1]], 1).long()
        last = backbone(input_ids=inputs, attention_mask=attention,
                        position_ids=(attention.cumsum(-1) - 1).clamp(min=0), use_cache=False).last_hidden_state
        return last[:, p_len - 1:]  # position p_len-1+j predicts completion token j
    u_ids, u_mask = unique[:, :p_len], unique[:, p_len:]
    out = backbone(input_ids=u_ids, attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
                   use_cache=True)
    first = out.last_hidden_state[inverse, -1:]  # each row's last prompt token predicts its completion token 0
    if c_len == 1:
        return first
    cache = output_cache(out)
    cache.batch_select_indices(inverse)  # differentiable indexing: the prompt's gradient sums over its rows
    attention = torch.cat([p_mask, cm[:, :-1]], 1).long()
    positions = p_mask.sum(-1, keepdim=True) + torch.arange(c_len - 1, device=p_ids.device)
    rest = backbone(input_ids=c_ids[:, :-1], attention_mask=attention, position_ids=positions, use_cache=True,
                    **{cache_keyword(backbone): cache}).last_hidden_state
    return torch.cat([first, rest], 1)

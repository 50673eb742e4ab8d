"""Mixture-of-Experts routing: record which experts each router chose, replay a recorded routing, and measure how
much the routing moves between two forwards of the same tokens.

Why (GSPO, arXiv 2507.18071 §5.3): in an MoE policy the experts a token activates change after a gradient update
(~10% of activations for Qwen3-30B-A3B), so a token ratio w_{i,t} = π_θ/π_old can compare two *different* networks
and swing far outside the clip range. **Routing Replay (R2)** caches the routing of the π_old forward and replays it
in the π_θ forward that computes the ratios; **R3** (arXiv 2510.11370) replays the routing the *rollout engine* used
(recorded during sampling) in the training forward. GSPO's sequence ratio is argued not to need either.

Mechanism: a forward hook on every router module (`RoutingCapture`). The hook reads the router's top-k expert indices
(recording) and, under replay, returns a new router output whose indices are the recorded ones and whose gate
weights are recomputed by the *current* router at those indices (softmax over the router logits gathered at the
replayed experts, renormalised exactly as the model does), so the router keeps receiving gradient. What a router's
output looks like differs between MoE families; a `RouterAdapter` per router class says how to read and override it,
so supporting another family is one `register_router(cls, adapter)` call.

Layout of a routing tensor: `[..., layers, k]` int16 expert indices, one row of k per token and MoE layer, layers in
module order. Token order is that of the model's input, flattened batch-major (`[B, L]` → `B·L`), which is how every
supported router sees its input. `FREE` (-1) in a replay tensor means "not recorded": that token keeps the router's
own choice (padding, or the last completion token, which the rollout engine never feeds back).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "FREE",
    "ROUTING_DTYPE",
    "RolloutRoutingRecorder",
    "RouterAdapter",
    "Routing",
    "RoutingCapture",
    "config_has_experts",
    "find_routers",
    "is_moe",
    "register_router",
    "replay_support_error",
    "require_replay_support",
    "routing_change",
    "routing_change_counts",
    "softmax_topk_adapter",
]

FREE = -1
"""Entry of a replay tensor meaning "no recorded routing here": the token keeps the router's own top-k."""

ROUTING_DTYPE = torch.int16
"""Recorded expert indices are stored compactly (every MoE in use has far fewer than 32768 experts per layer)."""


# ------------------------------------------------------------------------------------------------------ adapters


@dataclass(frozen=True)
class RouterAdapter:
    """How to read and override the top-k choice of one router family.

    indices(output) -> [tokens, k] long: the experts the router's output selects.
    replay(router, output, forced) -> output: the output the router would give if it had selected `forced`
        ([tokens, k] long; rows containing FREE keep the router's own choice), with gate weights recomputed from the
        current router so gradients still reach it.
    top_k(router), num_experts(router): the router's k and number of experts.
    """

    indices: Callable[[Any], torch.Tensor]
    replay: Callable[[nn.Module, Any, torch.Tensor], Any]
    top_k: Callable[[nn.Module], int]
    num_experts: Callable[[nn.Module], int]


def softmax_topk_adapter(normalize: Callable[[nn.Module], bool], cast_to_logits_dtype: bool) -> RouterAdapter:
    """Adapter for routers returning `(router_logits, top_k_weights, top_k_indices)` with
    weights = softmax(logits in float32)[top-k], divided by their sum when `normalize(router)` (norm_topk_prob),
    then cast to the logits' dtype when `cast_to_logits_dtype` (Qwen3-MoE, Qwen2-MoE, OLMoE do; Mixtral does not).

    Replayed weights are computed with the same operations on the same values, so replaying the router's own choice
    gives bit-identical weights."""

    def replay(router: nn.Module, output: tuple, forced: torch.Tensor) -> tuple:
        logits, _, own = output
        free = (forced < 0).any(-1, keepdim=True)
        idx = torch.where(free, own, forced)
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
        if normalize(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if cast_to_logits_dtype:
            weights = weights.to(logits.dtype)
        return logits, weights, idx

    return RouterAdapter(
        indices=lambda output: output[2],
        replay=replay,
        top_k=lambda router: int(router.top_k),
        num_experts=lambda router: int(router.num_experts),
    )


_ADAPTERS: dict[type, RouterAdapter] = {}

# (module, router class, adapter factory) of the families supported out of the box; imported lazily, and a family
# that this transformers version lacks is simply not registered.
_BUILTIN: tuple[tuple[str, str, Callable[[], RouterAdapter]], ...] = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter",
     lambda: softmax_topk_adapter(lambda r: bool(r.norm_topk_prob), cast_to_logits_dtype=True)),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter",
     lambda: softmax_topk_adapter(lambda r: bool(r.norm_topk_prob), cast_to_logits_dtype=True)),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter",
     lambda: softmax_topk_adapter(lambda r: bool(r.norm_topk_prob), cast_to_logits_dtype=True)),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter",
     lambda: softmax_topk_adapter(lambda r: True, cast_to_logits_dtype=False)),
)
_builtins_loaded = False


def register_router(router_cls: type, adapter: RouterAdapter) -> None:
    """Teach capture and replay a router class (an `nn.Module` subclass). Replaces an earlier registration."""
    if not (isinstance(router_cls, type) and issubclass(router_cls, nn.Module)):
        raise TypeError(f"register_router: expected an nn.Module subclass, got {router_cls!r}")
    _ADAPTERS[router_cls] = adapter


def _adapters() -> dict[type, RouterAdapter]:
    global _builtins_loaded
    if not _builtins_loaded:
        for module_name, cls_name, factory in _BUILTIN:
            try:
                cls = getattr(importlib.import_module(module_name), cls_name)
            except (ImportError, AttributeError):
                continue
            _ADAPTERS.setdefault(cls, factory())
        _builtins_loaded = True
    return _ADAPTERS


def _adapter_for(module: nn.Module) -> RouterAdapter | None:
    adapters = _adapters()
    for cls in type(module).__mro__:
        if cls in adapters:
            return adapters[cls]
    return None


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module, RouterAdapter]]:
    """(name, module, adapter) of every router with a registered adapter, in module order (= layer order)."""
    found = []
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is not None:
            found.append((name, module, adapter))
    return found


_EXPERT_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def config_has_experts(config: Any) -> bool:
    """Whether a model config describes a mixture of experts (more than one expert), routers registered or not."""
    return any(isinstance(getattr(config, key, None), int) and getattr(config, key) > 1 for key in _EXPERT_CONFIG_KEYS)


def is_moe(model: nn.Module) -> bool:
    """Whether `model` has routers that capture and replay support (a registered adapter)."""
    return bool(find_routers(model))


def require_replay_support(model: nn.Module, mode: str) -> None:
    """Raise ValueError unless routing replay `mode` (r2 / r3) can run on `model`: it must have MoE routers with a
    registered adapter. Called before any compute, so a dense model or an unknown MoE family fails up front."""
    if is_moe(model):
        return
    name = type(model).__name__
    if config_has_experts(getattr(model, "config", None)):
        raise ValueError(
            f"algorithm.routing_replay={mode}: {name} is a Mixture-of-Experts model but none of its router classes has "
            f"a routing adapter; register one with gspo.moe.register_router (supported: {_supported_names()})")
    raise ValueError(f"algorithm.routing_replay={mode} needs a Mixture-of-Experts model; {name} has no MoE routers "
                     f"(supported router families: {_supported_names()})")


def _supported_names() -> str:
    return ", ".join(sorted(cls.__name__ for cls in _adapters()))


def replay_support_error(model_name: str, mode: str, trust_remote_code: bool = False) -> str | None:
    """The reason routing replay `mode` cannot run on the model `model_name` (a preset or a local model directory),
    found from its config alone (the model is instantiated on the meta device: no weights, no compute); None if it
    can, if `mode` is "none", or if that cannot be known before loading (a hub id: the trainer checks again after
    loading, with `require_replay_support`).

    Not part of config validation (which builds no model): the trainer's start checks call it, before any file is
    written or any model loaded, as `replay_support_error(cfg.model.name, cfg.algorithm.routing_replay,
    cfg.model.trust_remote_code)`, and raise ConfigError with the message it returns."""
    if mode == "none":
        return None
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM

    from gspo.models import PRESETS, build_tokenizer

    if model_name in PRESETS:
        config = PRESETS[model_name](len(build_tokenizer()))
    elif (Path(model_name).expanduser() / "config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(str(Path(model_name).expanduser()), trust_remote_code=trust_remote_code)
        except Exception:  # an unreadable config is load_model's error to report, with its own message
            return None
    else:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    try:
        require_replay_support(model, mode)
    except ValueError as e:
        return f"{e} (model.name={model_name})"
    return None


# ------------------------------------------------------------------------------------------------ capture & replay


class Routing(NamedTuple):
    """One forward's routing, [tokens, layers, k] int16 each."""

    chosen: torch.Tensor  # the router's own top-k (what it would have picked: volatility is measured on this)
    used: torch.Tensor  # the experts the forward actually used (= the replayed ones under replay)


class RoutingCapture:
    """Context manager recording (and optionally replaying) the routing of every MoE router of `model`.

        with RoutingCapture(model) as cap:               # record
            model(...)
        routing = cap.take()                              # Routing(chosen, used), [B·L, layers, k]
        with RoutingCapture(model, replay=routing.chosen.view(B, L, layers, k)) as cap:
            model(...)                                    # same experts as recorded, weights from the current router

    `replay` is [B, L, layers, k] or [B·L, layers, k] (FREE entries keep the router's choice) for a forward whose
    input is [B, L]; it is the caller's job to pass the rows of the batch it forwards. Hooks are installed on enter
    and removed on exit, so the model (and any deepcopy of it) carries nothing outside the block. Each router must be
    called once per forward between `take()`s (no gradient checkpointing recompute inside the block).
    """

    def __init__(self, model: nn.Module, replay: torch.Tensor | None = None) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"RoutingCapture: {type(model).__name__} has no MoE router with a registered adapter "
                             f"(supported: {_supported_names()})")
        self.num_layers = len(self.routers)
        self.top_k = self.routers[0][2].top_k(self.routers[0][1])
        self._replay: torch.Tensor | None = None
        if replay is not None:
            if replay.shape[-2:] != (self.num_layers, self.top_k):
                raise ValueError(f"RoutingCapture: replay routing must end in [layers={self.num_layers}, "
                                 f"k={self.top_k}], got shape {tuple(replay.shape)}")
            self._replay = replay.reshape(-1, self.num_layers, self.top_k).long()
        self._calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.routers]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RoutingCapture:
        for layer, (_, module, adapter) in enumerate(self.routers):
            self._handles.append(module.register_forward_hook(self._hook(layer, adapter)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int, adapter: RouterAdapter) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            chosen = adapter.indices(output)
            used = chosen
            if self._replay is not None:
                forced = self._replay[:, layer]
                if forced.shape[0] != chosen.shape[0]:
                    raise ValueError(f"RoutingCapture: router {layer} routes {chosen.shape[0]} tokens but the replay "
                                     f"routing holds {forced.shape[0]}: pass the routing of exactly the forwarded rows")
                output = adapter.replay(module, output, forced.to(chosen.device))
                used = adapter.indices(output)
            with torch.no_grad():
                self._calls[layer].append((chosen.to(ROUTING_DTYPE), used.to(ROUTING_DTYPE)))
            return output

        return hook

    def take(self) -> Routing:
        """The routing of the forward since the last `take()`, and forget it. [tokens, layers, k] int16 each."""
        counts = [len(calls) for calls in self._calls]
        if any(c != 1 for c in counts):
            raise RuntimeError(f"RoutingCapture.take: expected one call per router since the last take, got {counts}")
        chosen = torch.stack([calls[0][0] for calls in self._calls], dim=1)
        used = torch.stack([calls[0][1] for calls in self._calls], dim=1)
        self._calls = [[] for _ in self.routers]
        return Routing(chosen, used)


class RolloutRoutingRecorder:
    """Records the rollout engine's routing (for R3) into the training forward's token layout.

    The engine prefills P unique prompts [P, S] once and repeats each for its G samples, then decodes one token per
    step for the rows still alive. The training forward sees, per row, the left-padded prompt followed by the
    right-padded completion, [N, S + T]. This recorder writes the prefill's routing at positions 0..S-1 (FREE on
    padding) of all G rows of each prompt, and the routing of completion token t, which the engine routes when it
    feeds that token back at decode step t, at position S + t of its row. The last token of each completion is never
    fed back, so its routing stays FREE; that cannot change any scored log-probability, since no scored position
    attends to it (position S + t predicts token t + 1).
    """

    def __init__(self, model: nn.Module, n_rows: int, prompt_len: int, max_new_tokens: int, device: torch.device):
        self.capture = RoutingCapture(model)
        self.prompt_len = prompt_len
        self.routing = torch.full((n_rows, prompt_len + max_new_tokens, self.capture.num_layers, self.capture.top_k),
                                  FREE, dtype=ROUTING_DTYPE, device=device)

    def __enter__(self) -> RolloutRoutingRecorder:
        self.capture.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.capture.__exit__(*exc)

    def prefill(self, prompt_mask: torch.Tensor, group_size: int) -> None:
        """After the prefill forward of the unique prompts [P, S]."""
        p, s = prompt_mask.shape
        chosen = self.capture.take().used.view(p, s, self.capture.num_layers, self.capture.top_k)
        chosen = chosen.masked_fill(~prompt_mask.bool()[:, :, None, None], FREE)
        self.routing[:, :s] = chosen.repeat_interleave(group_size, 0)

    def decode_step(self, rows: torch.Tensor, t: int) -> None:
        """After the decode forward that fed completion token t of output rows `rows` (one token per row)."""
        used = self.capture.take().used
        self.routing[rows, self.prompt_len + t] = used

    def result(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """[N, S + width, layers, k]: FREE past each completion's second-to-last token."""
        routing = self.routing[:, : self.prompt_len + width].clone()
        positions = torch.arange(width, device=routing.device)
        unrouted = positions[None, :] >= (lengths[:, None] - 1)  # the last token and the padding after it
        routing[:, self.prompt_len:][unrouted] = FREE
        return routing


# ------------------------------------------------------------------------------------------------------- volatility


def routing_change(old: torch.Tensor, new: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """Fraction of expert activations in `new` that `old` did not have: over (token, layer, slot) triples, whether
    the expert in `new`'s slot is absent from `old`'s top-k set for that token and layer. Order within the top-k is
    ignored (a set comparison), so a reordering is no change; each of the k slots counts, so one swapped expert of
    top-2 is 0.5 for that token and layer.

    old, new: [..., layers, k] routing of the same tokens; valid: [...] bool, the tokens to count (e.g. not
    padding). (token, layer) pairs where `old` is FREE (unrecorded) are skipped. NaN if nothing is counted.
    This is GSPO §5.3's "expert-activation volatility" when `old` is π_old's routing and `new` π_θ's."""
    changed, total = routing_change_counts(old, new, valid)
    return changed / total if total else float("nan")


def routing_change_counts(old: torch.Tensor, new: torch.Tensor,
                          valid: torch.Tensor | None = None) -> tuple[float, float]:
    """(changed, counted) expert activations of `routing_change`, which is their ratio: counts add up over the
    shares of several processes, fractions do not."""
    if old.shape != new.shape:
        raise ValueError(f"routing_change: shapes differ, {tuple(old.shape)} vs {tuple(new.shape)}")
    kept = (new.unsqueeze(-1) == old.unsqueeze(-2)).any(-1)  # [..., layers, k]
    counted = (old >= 0).all(-1)  # [..., layers]
    if valid is not None:
        if valid.shape != old.shape[:-2]:
            raise ValueError(f"routing_change: valid has shape {tuple(valid.shape)}, expected {tuple(old.shape[:-2])}")
        counted = counted & valid.bool().unsqueeze(-1)
    return float((~kept & counted.unsqueeze(-1)).sum()), float(counted.sum()) * old.shape[-1]

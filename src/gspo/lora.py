"""LoRA through peft: train low-rank adapters on a frozen model (`model.lora`), and hand every consumer what it needs.

* `apply_lora(model, cfg)` wraps the model with `peft.get_peft_model`: only the adapters require grad, so
  `gspo.optim.make_optimizer` (which takes the `requires_grad` parameters) trains and keeps AdamW state for them alone.
  The target names are checked first, so a typo or a layer LoRA cannot adapt fails with the model's linear layers
  listed instead of a deep peft error.
* Rollout engines get merged weights: `merged_weights(model)` streams W + (alpha/r)·B·A under the base model's own
  `state_dict()` names, one tensor at a time, without touching the training model. `gspo.rollout.policy_weights` takes
  this branch for a peft model, so every engine (HF sampler copy, vLLM, async workers) is fed as for a full model.
  An HF sampler that shares the trainer's model simply runs it, adapters active.
* Checkpoints (`gspo.checkpoint`) hold the adapter only; the base weights come from `model.name` on resume.
* The KL reference is the base itself, adapters disabled (`BaseReference`): no copy of the model.
* Training forwards take the chunked-head path through the wrapper (`gspo.logprobs`: a LoRA model's backbone and
  head are the base model's, adapters injected), not N×T×V logits.
* `save_lora_final` writes the final adapter folder, and optionally a merged full model next to it.

peft is imported when a function here runs, so the rest of gspo works without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gspo.logprobs import LogprobForward
from gspo.parallel.wrap import whole

if TYPE_CHECKING:
    from gspo.config import LoraConfig

__all__ = ["BaseReference", "apply_lora", "check_lora", "is_peft_model", "merged_weights", "save_lora_final"]

MERGED_DIRNAME = "merged"  # save_lora_final's merged full model, inside the adapter folder


def _peft() -> Any:
    """The peft module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("LoRA (model.lora) needs the peft package: pip install peft") from exc
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` carries peft adapters: a `PeftModel`, or the base model peft injected its layers into."""
    return hasattr(model, "peft_config")


# ------------------------------------------------------------------------------------------------------- wrapping


def check_lora(model: nn.Module, cfg: LoraConfig) -> None:
    """What `apply_lora(model, cfg)` would refuse, found without touching `model`: ImportError when peft is missing,
    ValueError naming the target patterns that match no module, a non-linear one or a tied weight. The trainer checks
    it when the model is built, so a typo costs nothing (not a cold start that then blocks the corrected command)."""
    _peft()
    _target_modules(model, cfg.target_modules)


def apply_lora(model: nn.Module, cfg: LoraConfig, base_model: str | None = None, seed: int | None = None
               ) -> nn.Module:
    """Wrap `model` (a Hugging Face causal LM) with LoRA adapters as `cfg` says; returns the `peft.PeftModel`.

    peft replaces the targeted `nn.Linear` modules of `model` in place (the returned wrapper and `model` share every
    tensor), freezes every base weight and initialises B = 0, so the wrapped model computes exactly what `model` did.
    Adapters are float32 even on a bfloat16 / float16 model (peft's default), so AdamW steps on them do not round away.

    `cfg.target_modules`: "all-linear" is every `nn.Linear` except the output head; a list names modules as peft
    does (a module's full name, or its last dotted parts: `q_proj`). Raises ValueError, naming the patterns and the
    model's linear layers, when a pattern matches no module or matches one that is not an `nn.Linear` (e.g. MoE
    experts fused into 3-D weights), or when a targeted weight is tied to another tensor (an output head tied to the
    embeddings); ImportError when peft is missing. Call it after building the rollout engine from the plain model (an
    engine with its own copy keeps the base layout that `merged_weights` fills) and before DDP / FSDP wrapping.
    `base_model` (the base's path or name) is what every adapter folder saved from it records as
    `base_model_name_or_path` (a run's checkpoints, as its final/), where `gspo eval` finds the base; by default peft
    records the model's `name_or_path`, empty for a model built in code.
    `seed`: peft draws the adapters' A matrices from the global torch RNG (on the CPU, where it builds them); with a
    seed they are drawn from a generator seeded with it instead and the caller's RNG is left as it was, so the
    adapters are a function of the seed alone, not of what ran before (a cold start's dropout in a fresh run, none
    when a resume loads the saved cold-start model).
    """
    peft = _peft()
    if is_peft_model(model):
        raise ValueError("apply_lora: the model already carries peft adapters")
    targets = _target_modules(model, cfg.target_modules)
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                             task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.random.default_generator.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config)
    if base_model is not None:  # get_peft_model records the model's name_or_path
        for each in wrapped.peft_config.values():
            each.base_model_name_or_path = base_model
    return wrapped


def _matches(name: str, pattern: str) -> bool:
    """peft's rule for a list of target modules: the full module name, or its last dotted parts."""
    return name == pattern or name.endswith("." + pattern)


def _target_modules(model: nn.Module, wanted: list[str] | str) -> list[str]:
    """The explicit target list for peft: checked patterns, or the linear layers' names for "all-linear".

    "all-linear" is resolved here rather than by peft, whose meaning of it depends on its version (peft >= 0.18 also
    adapts the fused 3-D expert weights and the router of transformers-5 MoE models, which gspo does not support)."""
    modules = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [name for name, m in modules.items() if isinstance(m, nn.Linear) and m is not head]
    if wanted == "all-linear":
        if not linear:
            raise ValueError(f"model.lora.target_modules=all-linear: {type(model).__name__} has no nn.Linear layer "
                             f"besides the output head{_fused_note(model)}")
        leaves = sorted({name.rpartition(".")[2] for name in linear})
        # short names when they select exactly these layers (readable adapter_config.json), else the full names
        exact = {n for n in modules if any(_matches(n, leaf) for leaf in leaves)} == set(linear)
        names = leaves if exact else linear
    else:
        names = list(wanted)
        unmatched = [p for p in names if not any(_matches(n, p) for n in modules)]
        if unmatched:
            raise ValueError(f"model.lora.target_modules {unmatched} match no module of {type(model).__name__}: its "
                             f"linear layers are {_short(linear)} (a pattern is a module's full name or its last "
                             f"dotted parts){_fused_note(model)}")
        for pattern in names:
            other = [n for n in modules if _matches(n, pattern) and not isinstance(modules[n], nn.Linear)]
            if other:
                kind = type(modules[other[0]]).__name__
                raise ValueError(f"model.lora.target_modules {pattern!r} matches {other[0]!r}, a {kind}, not an "
                                 f"nn.Linear: gspo's LoRA adapts linear layers only ({_short(linear)})"
                                 f"{_fused_note(modules[other[0]])}")
    _check_untied(model, [n for n, m in modules.items() if isinstance(m, nn.Linear) and any(_matches(n, p)
                                                                                           for p in names)])
    return names


def _short(names: list[str], limit: int = 12) -> str:
    """The distinct last parts of module names (q_proj, ...), at most `limit` of them."""
    leaves = sorted({name.rpartition(".")[2] for name in names})
    return ", ".join(leaves[:limit]) + (", ..." if len(leaves) > limit else "") if leaves else "none"


def _fused_note(module: nn.Module) -> str:
    """An explanation when `module` holds weights of 3 or more dimensions (MoE experts fused into one tensor)."""
    fused = [(name, tuple(p.shape)) for name, p in module.named_parameters() if p.dim() >= 3]
    if not fused:
        return ""
    shown = ", ".join(f"{name} {list(shape)}" for name, shape in fused[:2])
    return (f". Its MoE experts are fused 3-D parameters ({shown}{', ...' if len(fused) > 2 else ''}), not nn.Linear "
            "modules: LoRA through target_modules cannot adapt them, so a LoRA run trains the other linear layers "
            "(on Qwen3-MoE: the attention projections) and leaves the experts and the router as they are")


def _check_untied(model: nn.Module, targets: list[str]) -> None:
    """Refuse to adapt a weight shared with another tensor: merging W + B·A into it would change the other too."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for target in targets:
        names = names_of.get(id(model.get_submodule(target).weight), [])
        if len(names) > 1:
            raise ValueError(f"model.lora.target_modules selects {target}, whose weight is tied to "
                             f"{[n for n in names if n != f'{target}.weight']} (tie_word_embeddings): an adapter on it "
                             "cannot be merged without changing those too; leave it out of model.lora.target_modules")


# --------------------------------------------------------------------------------------------------- merged weights


_PEFT_PREFIX = "base_model.model."  # what a peft model's state_dict() puts before its base model's names


def merged_weights(model: nn.Module, state: dict[str, torch.Tensor] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the peft `model` with its active LoRA adapters merged, W + (alpha/r)·B·A, under the base model's
    `state_dict()` names (no `base_layer` parts, no lora_A / lora_B entries), one tensor at a time.

    The training model is not modified and nothing is copied but the merged tensor being yielded (the delta is the one
    `merge_and_unload` adds, computed without gradients); every other tensor is the model's own, detached. Tied
    tensors appear under each of their names, as in `policy_weights`. Under FSDP the model's tensors are shards
    (DTensors): each is gathered whole (`full_tensor()`, a collective: every process iterates this in lockstep).
    `state`: the peft model's full state dict (e.g. gathered to rank 0's CPU for the final save) to merge from
    instead of the model's own tensors; no collectives then. Raises NotImplementedError for adapters this cannot
    merge (not LoRA, DoRA; sharded or from `state`: not on nn.Linear)."""
    _peft()
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = {id(m): name for name, m in base.named_modules()}
    tuners = {name: m for name, m in base.named_modules() if isinstance(m, BaseTunerLayer)}
    adapter_prefixes = tuple(f"{name}.{attr}." for name, m in tuners.items() for attr in m.adapter_layer_names)
    adapted: dict[str, list[tuple[str, nn.Module]]] = {}  # base tensor's key -> (path, LoRA layer) adapting it
    for name, layer in tuners.items():
        key = f"{path[id(layer.get_base_layer())]}.{getattr(layer, 'parameter_name', 'weight')}"
        adapted.setdefault(key, []).append((name, layer))
    tensors = base.state_dict() if state is None else {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    for key, tensor in tensors.items():
        if key.startswith(adapter_prefixes):
            continue
        with torch.no_grad():  # not across the yield: see policy_weights
            tensor = whole(tensor)
            deltas = [d for name, layer in adapted.get(key, ()) for d in _deltas(name, layer, tensors, state)]
            merged = (tensor + sum(deltas)).to(tensor.dtype) if deltas else tensor
        yield _base_name(key, tuners), merged.detach()


def _deltas(name: str, layer: nn.Module, tensors: dict[str, torch.Tensor],
            state: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
    """What merging adds to the weight `layer` (at `name`) adapts: one delta per active adapter (none if already
    merged): peft's `get_delta_weight`; for adapters sharded by FSDP or read from a gathered `state`, its formula for
    a LoRA nn.Linear, transpose(B·A, fan_in_fan_out) · scaling, on A and B taken whole from `tensors`."""
    if not hasattr(layer, "get_delta_weight") or not hasattr(layer, "lora_A"):
        raise NotImplementedError(f"merging {type(layer).__name__} adapters is not supported (LoRA only)")
    if layer.merged or layer.disable_adapters:
        return []
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if any(getattr(layer, "use_dora", {}).get(a) for a in active):
        raise NotImplementedError("merging DoRA adapters is not supported")
    from peft.tuners.lora import Linear

    deltas = []
    for a in active:
        if state is None and not hasattr(layer.lora_A[a].weight, "full_tensor"):  # whole, in the model
            deltas.append(layer.get_delta_weight(a))
            continue
        if type(layer) is not Linear:
            raise NotImplementedError(f"merging sharded {type(layer).__name__} adapters is not supported (LoRA on "
                                      "nn.Linear only)")
        weight_a, weight_b = (whole(tensors[f"{name}.lora_{ab}.{a}.weight"]) for ab in "AB")
        delta = weight_b.float() @ weight_a.float()
        deltas.append(((delta.T if layer.fan_in_fan_out else delta) * layer.scaling[a]).to(weight_b.dtype))
    return deltas


def _base_name(key: str, tuners: dict[str, nn.Module]) -> str:
    """`key` without the `base_layer` parts peft's layers insert (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    out: list[str] = []
    module = ""  # the real module path walked so far
    for part in key.split("."):
        if not (part == "base_layer" and module in tuners):
            out.append(part)
        module = f"{module}.{part}" if module else part
    return ".".join(out)


# ----------------------------------------------------------------------------------------------- the KL reference


class BaseReference(LogprobForward):
    """The KL reference of a LoRA run (`algorithm.kl_beta > 0`): the peft `model` with its adapters disabled (peft's
    `disable_adapter()`) and in eval mode, i.e. the frozen base weights the adapters start from, without the full copy
    a reference model takes (a second 7B model in memory). `gspo.logprobs.completion_logprobs(reference, ...)` runs
    it; the policy's training mode and adapters are restored afterwards. Under FSDP `model` is the sharded policy's
    root (a `LogprobForward` around the peft model), whose forward gathers the shards."""

    def logprobs(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        peft = self.module.module if isinstance(self.module, LogprobForward) else self.module
        was_training = self.module.training
        self.module.eval()
        try:
            with peft.disable_adapter():
                return super().logprobs(*args, **kwargs)
        finally:
            self.module.train(was_training)


# ------------------------------------------------------------------------------------------------------ final model


def save_lora_final(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike, merged: bool,
                    base_model: str | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the trained LoRA policy to `out_dir` (created): a peft adapter folder (adapter_config.json,
    adapter_model.safetensors) with the tokenizer, loadable with `peft.PeftModel.from_pretrained(base, out_dir)`; with
    `merged`, also the merged full model in `out_dir/merged/`, a Hugging Face model folder `gspo.models.load_model`
    reads. Returns `out_dir`. `base_model` (the base's path or hub id) is recorded as adapter_config.json's
    `base_model_name_or_path`, where tools look for the base; by default peft records the model's `name_or_path`.

    The merged model is written from `merged_weights` gathered on the CPU: the model's device holds no more than one
    extra tensor, the training model is unchanged, and its config and layout (e.g. MoE experts split back per expert by
    transformers 5) are the base model's. Under FSDP, `state` is the peft model's full state dict gathered on this
    process (`gspo.parallel.full_state`): the adapter and the merged model are written from it."""
    if not hasattr(model, "get_base_model"):
        raise TypeError(f"save_lora_final needs the peft model apply_lora returned, got {type(model).__name__}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if base_model is not None:
        for config in model.peft_config.values():
            config.base_model_name_or_path = base_model
    # the base embeddings are frozen: not saved, and not looked up on the Hub (peft's "auto" does) to decide that
    model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False, state_dict=state)
    tokenizer.save_pretrained(out)
    if merged:
        def ident(t: torch.Tensor) -> tuple:
            return t.data_ptr(), t.dtype, tuple(t.shape)

        # Tied names get one CPU tensor, as save_pretrained expects. Ties are found among the source tensors only,
        # which stay alive: a merged tensor is freed once copied to the CPU, and on CUDA the caching allocator hands
        # its address to the next one of its size (every layer's q_proj was saved as the first layer's, H100).
        source = state.values() if state is not None else model.get_base_model().state_dict().values()
        tied = {ident(t) for t in source}
        weights: dict[str, torch.Tensor] = {}
        on_cpu: dict[tuple, torch.Tensor] = {}
        for name, tensor in merged_weights(model, state):
            key = ident(tensor)
            weights[name] = on_cpu.setdefault(key, tensor.to("cpu")) if key in tied else tensor.to("cpu")
        model.get_base_model().save_pretrained(out / MERGED_DIRNAME, state_dict=weights)
        tokenizer.save_pretrained(out / MERGED_DIRNAME)
    return out

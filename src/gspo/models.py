"""Models and tokenizers: tiny built-in presets for CPU runs and tests, and any Hugging Face causal LM by path or id.

The presets are randomly initialised Qwen3 / Qwen3-MoE models a few MB in size, paired with a character-level
tokenizer built in code, so the whole library can be exercised without network access. Everything else goes through
`transformers`' `AutoModelForCausalLM` / `AutoTokenizer`, with the failure modes of a bad local path turned into short
errors that name the path and what is missing.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import string
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from packaging import version
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

__all__ = [
    "DTYPES",
    "PRESETS",
    "PRESET_SEED",
    "SPECIAL_TOKENS",
    "VOCAB_CHARS",
    "adapter_base_name",
    "build_preset",
    "build_tokenizer",
    "cache_keyword",
    "check_compile_support",
    "check_model_source",
    "compiled_layers",
    "decoder_layers",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "load_model",
    "load_pretrained",
    "output_cache",
    "resolve_dtype",
    "save_model",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Special tokens first, so their ids are fixed: <pad>=0, <eos>=1, <unk>=2.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<unk>")
# Every character the built-in tasks need (digits, arithmetic, separators) plus space and a-z for short words.
VOCAB_CHARS: str = string.digits + "+-*/=(),:;?. " + string.ascii_lowercase

# Files of which at least one must be present for a local directory to hold loadable weights.
_WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Files of which at least one must be present for a local directory to hold a tokenizer. (Without any, transformers 5
# silently builds an empty tokenizer from the model type instead of failing.)
_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)

# `from_pretrained` takes `dtype` since transformers 4.56 (and only that in 5.x); older versions call it `torch_dtype`.
_DTYPE_KWARG = "dtype" if version.parse(transformers.__version__) >= version.parse("4.56") else "torch_dtype"


_DTYPE_ALIASES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16,
                                          "fp32": torch.float32}


def cache_keyword(model: nn.Module) -> str:
    """The keyword `model`'s forward takes a KV cache by: transformers 5.24 renamed `past_key_values` to `cache`
    (the old name still works, with a deprecation warning, until 5.40); older versions and remote-code models take
    `past_key_values`."""
    try:
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    except (TypeError, ValueError):  # a forward without a signature inspect can read
        return "past_key_values"


def output_cache(out) -> object:
    """The KV cache a forward returned: `out.cache` from transformers 5.24 (where `out.past_key_values` warns),
    `out.past_key_values` before."""
    return out["cache"] if "cache" in out else out.past_key_values  # noqa: SIM401 (.get would read the old name)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The floating-point torch dtype that `dtype` names: the one parser of dtypes in gspo (model loading, rollout
    engines, mixed precision).

    Accepts a floating-point `torch.dtype`, a name from `DTYPES` ("float32", "bfloat16", "float16"), an alias ("bf16",
    "fp16", "half", "fp32"), or any torch attribute name of a floating-point dtype, optionally written
    "torch.float32"-style (case-insensitive). Raises ValueError naming the value and the accepted names for anything
    else (an unknown name, a non-floating dtype such as int8), so a typo in a config fails at load time.
    """
    resolved: object = dtype
    if isinstance(dtype, str):
        name = dtype.strip().removeprefix("torch.").lower()
        resolved = DTYPES.get(name) or _DTYPE_ALIASES.get(name) or getattr(torch, name, None)
    if isinstance(resolved, torch.dtype) and resolved.is_floating_point:
        return resolved
    raise ValueError(f"unsupported dtype {dtype!r}: expected a floating-point torch.dtype or one of "
                     f"{sorted([*DTYPES, *_DTYPE_ALIASES])}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer used by the presets.

    One token per character of `VOCAB_CHARS` (ids 3..), specials `<pad>`=0, `<eos>`=1, `<unk>`=2; any other
    character encodes to `<unk>`. There is no normaliser and the decoder concatenates tokens, so
    `decode(encode(s)) == s` for every string over `VOCAB_CHARS`, spaces included. No BOS/EOS is added when encoding
    (the rollout and SFT code append EOS themselves). Padding is on the left, as generation needs.

    Its chat template writes each message as `role: content; ` and the generation prompt as `assistant:` (e.g.
    "system: be brief; user: 2+3=; assistant:"), characters the vocabulary has (no uppercase, no newline), so
    conversation data can be exercised on the presets offline. Setting it changes nothing about how a string is
    tokenized.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in VOCAB_CHARS:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # `[\s\S]` matches any single character (including newlines), so every character becomes its own word.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,  # the default clean-up would delete the space in "a ." on decode
        model_max_length=256,
    )
    # saved with the tokenizer (save_pretrained) and loaded back with it
    tokenizer.chat_template = (
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}; {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tokenizer


def tiny_moe_config(vocab_size: int) -> Qwen3MoeConfig:
    """A ~1.8M-parameter Qwen3-MoE: 4 layers, 8 experts with top-2 routing, tied embeddings."""
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        use_cache=True,
    )


def tiny_dense_config(vocab_size: int) -> Qwen3Config:
    """A ~1M-parameter dense Qwen3 of the same shape as `tiny_moe_config` (one 512-wide MLP per layer)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        use_cache=True,
    )


# Preset name -> config factory taking the vocabulary size. `build_preset` / `load_model` turn one into a model.
PRESETS: dict[str, Callable[[int], PretrainedConfig]] = {
    "tiny-moe": tiny_moe_config,
    "tiny-dense": tiny_dense_config,
}


def _init_from_config(config: PretrainedConfig) -> PreTrainedModel:
    """Instantiate a randomly initialised causal LM, with SDPA attention where the model supports it."""
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, ImportError):  # transformers raises these when SDPA is unsupported for a model or torch
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def build_preset(
    name: str, *, seed: int = 0, dtype: str | torch.dtype = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build preset `name` with random weights that are a function of `seed` alone, plus `build_tokenizer()`.

    The global torch RNG is forked around construction, so the caller's random state is left untouched. Weights
    are initialised in float32 and then cast, so the same seed gives the same weights (up to rounding) in every dtype.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    torch_dtype = resolve_dtype(dtype)
    tokenizer = build_tokenizer()
    config = PRESETS[name](len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _init_from_config(config)
    return model.to(torch_dtype), tokenizer


def _looks_like_local_path(name: str) -> bool:
    """True if `name` can only be meant as a filesystem path (a hub id is `name` or `org/name`)."""
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or name.endswith(("/", os.sep))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _check_local_model_dir(path: Path, shown: str) -> None:
    """Raise a short, specific error (naming the path as the caller wrote it, `shown`) if `path` is not a directory
    holding a config, weights and a tokenizer."""
    if not path.exists():
        raise FileNotFoundError(f"model directory {shown!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {shown!r} is a file; expected a model directory (as written by save_model)")
    try:
        names = set(os.listdir(path))
    except PermissionError:
        raise PermissionError(f"model directory {shown!r} cannot be read: permission denied") from None
    if "config.json" not in names:
        raise FileNotFoundError(f"model directory {shown!r} has no config.json")
    if not any(f in names for f in _WEIGHT_FILES):
        raise FileNotFoundError(f"model directory {shown!r} has no weights (looked for {', '.join(_WEIGHT_FILES)})")
    safetensors = sorted(name for name in names if name.endswith(".safetensors"))
    if not safetensors:
        raise ValueError(
            f"model directory {shown!r} holds only pickle weights ({', '.join(sorted(names & set(_WEIGHT_FILES)))}); "
            "gspo loads safetensors only, because unpickling a file can run arbitrary code. Convert it once, in a "
            "trusted environment: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
            "safe_serialization=True)"
        )
    if not any(f in names for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {shown!r} has no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    for name in ("config.json", *safetensors):  # as root this never fails; for anyone else, say which file
        try:
            with open(path / name, "rb"):
                pass
        except PermissionError:
            raise PermissionError(f"{name} in model directory {shown!r} cannot be read: permission denied") from None


def check_model_source(name: str) -> None:
    """What `load_model(name)` would find wrong with a local model folder, found without loading it (a command checks
    its model arguments before any compute): FileNotFoundError / ValueError naming `name`. A preset, a hub id and a
    LoRA adapter folder (whose base is checked when loaded) pass."""
    path = Path(name).expanduser()
    if name in PRESETS or not (path.exists() or _looks_like_local_path(name)) or _is_adapter_folder(path):
        return
    _check_local_model_dir(path, name)


PRESET_SEED = "@seed="
"""How a LoRA adapter folder names a preset base with the seed of its weights: `tiny-dense@seed=3`
(`adapter_base_name`)."""


def adapter_base_name(name: str, seed: int = 0) -> str:
    """The name under which a LoRA adapter folder records the base `load_model(name, seed=seed)` built
    (adapter_config.json's `base_model_name_or_path`), so that `load_model` of the folder builds that same base from
    any working folder: a local folder's absolute path, a preset with the seed its random weights came from
    (`tiny-dense@seed=3`; read back only there), a hub id as it is."""
    if name in PRESETS:
        return f"{name}{PRESET_SEED}{seed}"
    path = Path(name).expanduser()
    return str(path.absolute()) if path.exists() or _looks_like_local_path(name) else name


def _is_adapter_folder(path: Path) -> bool:
    """A peft adapter folder (adapter_config.json, no config.json); an unreadable folder is not (the model-folder
    checks then say what cannot be read)."""
    try:
        return (path / "adapter_config.json").is_file() and not (path / "config.json").exists()
    except OSError:
        return False


def _load_adapter_folder(path: Path, **kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A peft LoRA adapter folder (a LoRA run's OUT/final): its base model (adapter_config.json's
    `base_model_name_or_path`, loaded by `load_model`; a preset named with its seed, `adapter_base_name`, is built
    from that seed, not the caller's; a run's cold start, recorded as an absolute path, is the cold start of the run
    the folder is in, so a moved or copied run evaluates on its own and not on whatever now sits at the old path)
    with the adapters merged in, and the folder's tokenizer. Its weights are trainable, as any loaded model's: peft
    freezes the base it injects adapters into, and merging keeps that, so a run started from the folder
    (`model.name`) had nothing to train."""
    import json

    from peft import PeftModel

    base_name = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_name:
        raise ValueError(f"LoRA adapter folder {str(path)!r}: adapter_config.json names no base_model_name_or_path")
    preset, _, seed = base_name.partition(PRESET_SEED)
    if preset in PRESETS and seed.isdigit():
        base_name, kwargs = preset, {**kwargs, "seed": int(seed)}
    elif Path(base_name).name == "cold_start":  # a LoRA run's own cold start: the run this folder is in (moved or not)
        own = next((parent / "cold_start" for parent in path.resolve().parents[:4]
                    if (parent / "cold_start" / "sft.json").is_file()), None)
        base_name = str(own) if own is not None else base_name
    base, _ = load_model(base_name, **kwargs)
    model = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    model.requires_grad_(True)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    `name_or_path` is a preset name (`PRESETS`; weights random from `seed`), a local model directory (e.g. one
    written by `save_model`, or a LoRA run's adapter folder: its base with the adapters merged), or a Hugging Face Hub
    id. `seed` only matters for presets. Remote code is only run when
    `trust_remote_code=True`. Weights are only read from safetensors files (`use_safetensors=True`): a directory or
    hub repository with only pickle weights (pytorch_model.bin) is refused, since unpickling can run code. A
    tokenizer without a pad token gets its EOS token as pad. `attn_implementation` (`model.attn_implementation`):
    the attention kernel, set by `set_attention`; None keeps the model's default (sdpa where it supports it).

    The model is returned as constructed: presets are in train mode and `from_pretrained` models in eval mode, so
    callers that care (the trainer, evaluation) set the mode themselves.

    Raises FileNotFoundError / PermissionError / ValueError naming the path and what is missing, unreadable or
    corrupt for a bad local directory, instead of the deep traceback transformers would give.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"load_model: name_or_path must be a non-empty string, got {name_or_path!r}")
    torch_dtype = resolve_dtype(dtype)
    path = Path(name_or_path).expanduser()
    if name_or_path in PRESETS:
        model, tokenizer = build_preset(name_or_path, seed=seed, dtype=torch_dtype)
    elif (path.exists() or _looks_like_local_path(name_or_path)) and _is_adapter_folder(path):
        model, tokenizer = _load_adapter_folder(path, dtype=dtype, trust_remote_code=trust_remote_code, seed=seed)
    else:
        model, tokenizer, info = load_pretrained(name_or_path, AutoModelForCausalLM, dtype=torch_dtype,
                                                 trust_remote_code=trust_remote_code)
        if missing := sorted(info.get("missing_keys", ())):  # e.g. an untied model saved without lm_head.weight
            raise ValueError(f"model {name_or_path!r}: its checkpoint has no weights for {missing[:5]}"
                             f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}, which transformers "
                             "would initialise at random and train from there: the folder is incomplete or not this "
                             f"architecture's ({model.config.architectures})")
    if attn_implementation is not None:
        set_attention(model, attn_implementation)
    return model, tokenizer


def set_attention(model: PreTrainedModel, implementation: str) -> None:
    """Switch `model`'s attention kernel to `implementation` (transformers' `attn_implementation`: eager, sdpa,
    flash_attention_2, flex_attention, ...), checked by transformers now rather than at the first forward. Raises
    ValueError naming `model.attn_implementation` and what transformers said: an unknown name, a kernel whose package
    is not installed (flash-attn), or one this model's class does not support."""
    try:
        model.set_attn_implementation(implementation)
    except (ValueError, ImportError) as e:
        raise ValueError(f"model.attn_implementation={implementation!r} cannot be used with "
                         f"{type(model).__name__}: {e}") from None


def load_pretrained(
    name_or_path: str, auto_class: type, *, dtype: torch.dtype, trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, list[str]]]:
    """`auto_class.from_pretrained` (e.g. AutoModelForCausalLM, AutoModelForSequenceClassification) for a local
    directory or a hub id, with its tokenizer and transformers' loading info (`missing_keys`: weights the checkpoint
    did not have, which transformers initialised at random). The one loader of pretrained folders, so every model
    gspo loads gets the same checks: safetensors only, a short error naming the path and what is missing for a bad
    local directory, and a tokenizer without a pad token gets its EOS token as pad."""
    path = Path(name_or_path).expanduser()
    is_local = path.exists() or _looks_like_local_path(name_or_path)
    source = str(path) if is_local else name_or_path
    if is_local:
        _check_local_model_dir(path, name_or_path)
        try:
            AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        except Exception as exc:
            raise ValueError(f"model directory {name_or_path!r} has an unreadable config.json: {exc}") from exc
        where = f"model directory {name_or_path!r}"
    else:
        where = f"{source!r} (not a preset {sorted(PRESETS)} nor a local directory, so tried as a Hugging Face Hub id)"
    try:
        model, info = auto_class.from_pretrained(
            source, trust_remote_code=trust_remote_code, use_safetensors=True, output_loading_info=True,
            **{_DTYPE_KWARG: dtype},
        )
    except Exception as exc:
        raise ValueError(f"could not load model weights from {where}: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ValueError(f"could not load a tokenizer from {where}: {exc}") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {where} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:  # ids past the table: garbage, or an IndexError deep in torch
        raise ValueError(f"the tokenizer of {where} has {len(tokenizer)} tokens but the model's embedding table has "
                         f"{rows} rows: the tokenizer files are not this model's (token ids >= {rows} have no "
                         "embedding)")
    return model, tokenizer, info


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them: transformers' own
    checkpointing of its layers, non-reentrant (`use_reentrant=False`). Raises ValueError for a model without it.

    It acts only in train mode. There transformers' checkpointed layers also ignore `use_cache` and
    `past_key_values` (a cache written in the forward would be written again by the recompute), so no training
    forward may rely on a KV cache (`gspo.logprobs` then does not share prompts). In eval mode the layers run as
    usual, cache included: the sampler (which switches the model to eval) is unaffected, so `model.config.use_cache`
    is left as it is (it is also what a saved model's config says)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name; the old one is a deprecated alias there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of `model` (a transformers model, or a wrapper around one: DDP, peft, gspo's
    `LogprobForward`): the modules whose class, or a class it derives from (FSDP2 makes each sharded layer an instance
    of a subclass `FSDP<Layer>`), is named in the model's `_no_split_modules`. Empty when the model names none."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


COMPILE_OPTIONS = {"emulate_precision_casts": True}
"""inductor's options in every torch.compile gspo makes (the decoder layers, the fused head, the compiled decode step).
A fused kernel then rounds to bf16 / fp16 wherever eager autocast would, instead of keeping a fused chain's
intermediates in float32, so compiled code computes eager's values rather than slightly more precise ones: under
bf16 autocast over float32 weights the compiled decode loop samples what the eager loop samples (on the CPU bit for
bit; without it 2 of 16 rows of the rollout tests' model differed, log-probs by up to 0.02), and compiled layers'
log-probs are 10× closer to eager's (mean 8e-5 vs 8e-4; `tests/test_compile.py`). The trainer's forwards, the
sampler's log-probs (π_old under `algorithm.old_logprobs: rollout`) and evaluation then agree whichever ran compiled.
The extra roundings are in-register arithmetic inside fused kernels: no memory traffic. inductor's CPU code generator
honours the option from torch 2.13 (2.11 and 2.12 ignore it there; README, Installing)."""


def compile_options(extra: dict | None = None) -> dict:
    """`COMPILE_OPTIONS` that this torch's inductor knows (older releases lack some), plus `extra`. Read when compiling:
    importing inductor's config takes ~2 s, which a process that never compiles should not pay."""
    from torch._inductor import config

    return {**{k: v for k, v in COMPILE_OPTIONS.items() if hasattr(config, k)}, **(extra or {})}


_COMPILED: dict[Callable, Callable] = {}  # a layer class's forward -> its forward, compiled except with a KV cache
_CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")  # a decoder layer's KV-cache keyword, by version


def _compiled_forward(forward: Callable) -> Callable:
    """`forward` (a decoder layer class's) compiled by torch.compile, except for calls given a KV cache, which run it
    eager: a cache specialises the compiled graph on each layer's index (one graph per layer, past dynamo's recompile
    limit), and only prompt sharing (`gspo.logprobs`) passes one in a training forward."""
    compiled = torch.compile(forward, options=compile_options())

    def layer_forward(self, *args, **kwargs):
        if any(kwargs.get(k) is not None for k in _CACHE_KEYWORDS):
            return forward(self, *args, **kwargs)
        return compiled(self, *args, **kwargs)

    return layer_forward


@contextlib.contextmanager
def compiled_layers(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within: every decoder layer of `model` (`decoder_layers`) runs its forward compiled by torch.compile (regional
    compilation). The layers of one class share one compiled function, so a 28-layer model compiles one layer's graph
    (per grad mode and shape family), not the whole model's; the LM head, the embeddings and what the trainer computes
    around them stay eager, and so does a layer given a KV cache (prompt sharing's forwards: `_compiled_forward`).
    Out of it, the layers are eager again: the sampler, evaluation and saving never run compiled code, and the model's
    state dict and class are untouched.

    Why: a layer of a small model on a GPU is dispatched op by op (a Qwen3 layer's forward and backward are ~740 ops
    in eager mode), and the device waits on the host; compiled, a layer is a handful of fused kernels.
    The first forward of each grad mode and shape family compiles (seconds per graph); dimensions that change between
    calls are compiled as dynamic after their second value. Values: the same computation, within float rounding of
    eager (fused kernels may order additions differently; `tests/test_compile.py`). Nothing to do when `enabled` is
    False or the model names no decoder layers."""
    # a layer whose instance already has a forward (e.g. accelerate's offloading hook) is left as it is
    layers = [m for m in decoder_layers(model) if "forward" not in m.__dict__] if enabled else []
    for layer in layers:
        forward = type(layer).forward
        if forward not in _COMPILED:
            _COMPILED[forward] = _compiled_forward(forward)
        layer.forward = types.MethodType(_COMPILED[forward], layer)  # an instance attribute: nn.Module calls it
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def check_compile_support(model: nn.Module, device: torch.device) -> None:
    """Raise ValueError, saying why, when `compiled_layers` cannot serve `model`'s training forwards on `device`, before
    any compute (rather than a compiler error, or a silent fallback to eager, at the first forward): an MoE model
    (data-dependent token counts per expert, read on the host, break a compiled layer into pieces), a model that names
    no decoder-layer classes, or no code generator for the device (inductor builds C++ for the CPU: a C++ compiler on
    PATH; Triton kernels for CUDA: the triton package)."""
    from gspo.moe import config_has_experts, is_moe

    if is_moe(model) or config_has_experts(getattr(model, "config", None)):
        raise ValueError("MoE expert dispatch (data-dependent token counts per expert, read on the host) breaks a "
                         "compiled layer into pieces; only dense models are compiled")
    if not decoder_layers(model):
        raise ValueError(f"{type(model).__name__} names no decoder-layer classes (_no_split_modules) to compile")
    if device.type == "cpu":
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            raise ValueError("torch.compile needs a C++ compiler on the CPU (g++, c++ or clang++ on PATH); none found")
    elif device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError("torch.compile needs the triton package on CUDA (installed with torch's CUDA wheels); "
                             "it cannot be imported") from None
    else:
        raise ValueError(f"torch.compile of the decoder layers is supported on cpu and cuda, not {device.type}")


def disable_dropout(model: nn.Module, *, dry_run: bool = False) -> list[str]:
    """Make `model`'s train-mode forwards deterministic: each dropout module's p and each module's float dropout rate
    or router jitter (`_RANDOM_IN_TRAINING`, e.g. the `attention_dropout` transformers' attention passes to its
    kernel) set to 0. Returns what was on, as "module name: rate" (empty when nothing was); `dry_run` only lists it.

    For RL (`trainer.disable_dropout`, as TRL does by default): with dropout the policy's training forwards are
    random, so π_θ and the recomputed π_old of the on-policy first minibatch differ by the dropout noise instead of
    being equal, and GSPO's clip range (3e-4 around a ratio of 1) clips that noise. The model's config keeps its
    values (a saved model is unchanged)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                found.append(f"{name}: {module.p:g}")
                if not dry_run:
                    module.p = 0.0
            continue
        for attr in _RANDOM_IN_TRAINING:
            rate = getattr(module, attr, None)
            if isinstance(rate, float) and rate > 0:
                found.append(f"{name}.{attr}: {rate:g}")
                if not dry_run:
                    setattr(module, attr, 0.0)
    return found


_RANDOM_IN_TRAINING = ("attention_dropout", "dropout", "hidden_dropout", "activation_dropout", "jitter_noise")
"""Float attributes by which transformers' modules randomise train-mode forwards: dropout rates passed to functional
dropout or the attention kernel, and MoE router jitter (Mixtral, PhiMoE: `router_jitter_noise` scales the router's
input by uniform noise in train mode)."""


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike) -> Path:
    """Write `model` (safetensors weights + config) and `tokenizer` to `out_dir`, loadable with `load_model(out_dir)`.

    Returns the directory. Creates it (and parents) if needed; existing files of the same names are overwritten.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"save_model: {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    # transformers 4.x takes `safe_serialization` (default True); 5.x always writes safetensors and dropped it.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    return out

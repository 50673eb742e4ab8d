"""The built-in sampler's decode steps with grouped-query attention read as is vs transformers' `repeat_kv` copies.

    .venv/bin/python benchmarks/decode_attention.py                       # CPU: 4 layers of the Qwen3-0.6B shape
    python benchmarks/decode_attention.py --device cuda --layers 28 --rows 128 --vocab 151936   # the GPU shape

A Qwen3 model with Qwen3-0.6B's attention layout (hidden 1,024, 16 query heads sharing 8 KV heads of 128) and a
random init samples `--rows` completions of `--new-tokens` forced tokens (EOS disabled) with `HFSampler`, in each
decode mode (`--decodes`), once with `grouped_decode` on (gspo's `gqa_decode_sdpa`: each KV head's query heads attend
as rows of one query block) and once off (transformers' sdpa path, which under a mask copies every KV head's cache
`groups` times per layer and step: always under torch.compile; in eager decoding only before transformers 5.24).
Each (decode, grouped) pair runs in the same process, alternating, `--batches` measured calls after one warm-up (the
compiled mode's first call compiles). Prints a table (tokens/s, ratio against grouped off) and one JSON line; the
samples of the two paths are checked to be the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PROMPTS = ["12+34=", "5+678=", "90+1=", "2345+67="]


def decode_model(layers: int, vocab: int, device: str, dtype: str):
    """A random-init Qwen3 with Qwen3-0.6B's layer shape (hidden 1,024, 16 query heads sharing 8 KV heads of 128,
    MLP 3,072, tied head), `layers` deep, attending with sdpa, in eval mode, and a tokenizer of `vocab` plain tokens."""
    import torch
    from run import padded_tokenizer  # benchmarks/run.py: this script's folder is on sys.path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=getattr(torch, dtype)).eval()
    return model, padded_tokenizer(vocab)


def alternate(engines: dict, request: tuple, batches: int, device: str) -> tuple[dict, dict, dict]:
    """Time `engines[side].generate(*request)` for the sides False and True, alternating (the order reversed every
    other round): one warm-up call per side, then `batches` measured ones. Returns (each side's measured seconds, its
    first call's seconds, its last Trajectory)."""
    from run import sync

    times: dict[bool, list[float]] = {False: [], True: []}
    firsts: dict[bool, float] = {}
    last = {}
    for rep in range(1 + batches):
        for side in ((False, True) if rep % 2 == 0 else (True, False)):
            sync(device)
            t0 = time.perf_counter()
            last[side] = engines[side].generate(*request)
            sync(device)
            elapsed = time.perf_counter() - t0
            if rep:
                times[side].append(elapsed)
            else:
                firsts[side] = elapsed
    return times, firsts, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=32, help="completions per call (4 prompts × rows/4)")
    p.add_argument("--new-tokens", type=int, default=236, help="(+ the prompt: a 384-slot static cache by default)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--decodes", default=None, help="comma-separated (default: dynamic,static,compiled)")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.batches < 1:
        p.error(f"--batches {a.batches}: at least 1 measured call per side")

    import torch
    import transformers

    from gspo.rollout import HFSampler, SamplingParams

    torch.set_num_threads(a.threads)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    decodes = (a.decodes or "dynamic,static,compiled").split(",")
    model, tokenizer = decode_model(a.layers, a.vocab, a.device, dtype)
    prompts = PROMPTS
    group = a.rows // len(prompts)
    print(f"decode steps, Qwen3-0.6B attention layout × {a.layers} layers, vocab {a.vocab}, {dtype}, {a.device}, "
          f"{len(prompts) * group} rows × {a.new_tokens} tokens; torch {torch.__version__}, "
          f"transformers {transformers.__version__}", flush=True)
    summary: dict = {"device": a.device, "layers": a.layers, "rows": len(prompts) * group}
    print(f"{'decode':>9} | {'repeat_kv tok/s':>15} | {'grouped tok/s':>13} | grouped/repeat | first call s")
    for decode in decodes:
        engines = {}
        for grouped in (False, True):
            engine = HFSampler(model, tokenizer, SamplingParams(max_new_tokens=a.new_tokens), decode=decode)
            engine.eos_ids, engine.grouped_decode = [], grouped
            engines[grouped] = engine
        times, firsts, batches = alternate(engines, (prompts, group, list(range(len(prompts)))), a.batches, a.device)
        samples = {grouped: batch.completion_ids for grouped, batch in batches.items()}
        tokens = samples[True].numel()
        rate = {g: tokens / statistics.median(times[g]) for g in (False, True)}
        same = float((samples[True] == samples[False]).float().mean())
        print(f"{decode:>9} | {rate[False]:15.0f} | {rate[True]:13.0f} | {rate[True] / rate[False]:14.2f} | "
              f"{firsts[False]:.1f} / {firsts[True]:.1f}   (same tokens: {same:.3f})", flush=True)
        summary[f"grouped_over_repeat_{decode}"] = round(rate[True] / rate[False], 3)
        summary[f"tokens_per_s_{decode}"] = round(rate[True])
        del engines
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

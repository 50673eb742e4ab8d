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

    import torch
    import transformers
    from run import padded_tokenizer, sync  # benchmarks/run.py: this script's folder is on sys.path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.rollout import HFSampler, SamplingParams

    torch.set_num_threads(a.threads)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    decodes = (a.decodes or "dynamic,static,compiled").split(",")
    config = Qwen3Config(vocab_size=a.vocab, hidden_size=1024, num_hidden_layers=a.layers, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(a.device):
        model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=getattr(torch, dtype)).eval()
    tokenizer = padded_tokenizer(a.vocab)
    prompts = ["12+34=", "5+678=", "90+1=", "2345+67="]
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
        times: dict[bool, list[float]] = {False: [], True: []}
        firsts: dict[bool, float] = {}
        samples = {}
        for rep in range(1 + a.batches):
            for grouped in ((False, True) if rep % 2 == 0 else (True, False)):
                sync(a.device)
                t0 = time.perf_counter()
                batch = engines[grouped].generate(prompts, group, list(range(len(prompts))))
                sync(a.device)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[grouped].append(elapsed)
                else:
                    firsts[grouped] = elapsed
                samples[grouped] = batch.completion_ids
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

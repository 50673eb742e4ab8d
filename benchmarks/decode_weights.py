"""The compiled decode loop under bf16 autocast over float32 weights: weights cast at every step vs bf16 copies.

    .venv/bin/python benchmarks/decode_weights.py                         # CPU: 4 layers of the Qwen3-0.6B shape
    python benchmarks/decode_weights.py --device cuda --layers 28 --rows 128 --vocab 151936   # the GPU shape

The sampler of a `trainer.mixed_precision: bfloat16` run shares the policy's float32 weights and samples under bf16
autocast. Eager autocast casts each weight once per generate call (its cast cache); a compiled decode step casts
every weight inside its graph at every call: per token it reads the float32 weights, writes their bf16 cast and
reads that. `HFSampler` runs the compiled step on `autocast_twin` instead (every Linear's weight held as a bf16 copy,
refreshed once per call: the same values). This script samples `--rows` completions (a comma-separated list) of
`--new-tokens` forced tokens (EOS disabled) from a random-init Qwen3 with Qwen3-0.6B's layer shape, with
`twin_weights` off and on, alternating in one process, `--batches` measured calls after one warm-up (whose first call
compiles). Prints a table (tokens/s, ratio) and one JSON line; the two paths' samples are checked to be the same.
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", default="1,8,32", help="comma-separated completions per call")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    try:
        rows = [int(r) for r in a.rows.split(",")]
        if any(r < 1 for r in rows):
            raise ValueError
    except ValueError:
        p.error(f"--rows: comma-separated positive integers, got {a.rows!r}")
    if a.batches < 1:
        p.error(f"--batches {a.batches}: at least 1 measured call per side")

    import torch
    import torch._dynamo
    import transformers
    from decode_attention import PROMPTS, alternate, decode_model  # this script's folder is on sys.path

    from gspo.rollout import HFSampler, SamplingParams

    torch.set_num_threads(a.threads)
    model, tokenizer = decode_model(a.layers, a.vocab, a.device, "float32")
    linear = sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)
    print(f"compiled decode under bf16 autocast, float32 weights, Qwen3-0.6B layer shape × {a.layers} layers, vocab "
          f"{a.vocab}, {a.device}, {a.new_tokens} tokens per row; Linear weights {linear / 1e6:.1f}M parameters "
          f"(bf16 copies {2 * linear / 2**20:.0f} MiB); torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    summary: dict = {"device": a.device, "layers": a.layers, "new_tokens": a.new_tokens}
    print(f"{'rows':>5} | {'cast per step tok/s':>19} | {'bf16 copies tok/s':>17} | copies/cast | first call s")
    for n in rows:
        torch._dynamo.reset()  # each row count's two compiled steps, within dynamo's recompile limit
        engines = {}
        for twin in (False, True):
            engine = HFSampler(model, tokenizer, SamplingParams(max_new_tokens=a.new_tokens), decode="compiled",
                               autocast="bfloat16")
            engine.eos_ids, engine.twin_weights = [], twin
            engines[twin] = engine
        prompts = (PROMPTS * n)[:n]
        times, firsts, samples = alternate(engines, (prompts, 1, list(range(n))), a.batches, a.device)
        assert bool(engines[True]._twin_pairs) and not engines[False]._twin_pairs
        same = float((samples[True].completion_ids == samples[False].completion_ids).float().mean())
        gap = float((samples[True].logprobs - samples[False].logprobs).abs().max())
        tokens = samples[True].completion_ids.numel()
        rate = {t: tokens / statistics.median(times[t]) for t in (False, True)}
        print(f"{n:>5} | {rate[False]:19.0f} | {rate[True]:17.0f} | {rate[True] / rate[False]:11.2f} | "
              f"{firsts[False]:.1f} / {firsts[True]:.1f}   (same tokens: {same:.3f}, log-prob gap {gap:.1e})",
              flush=True)
        summary[f"copies_over_cast_rows{n}"] = round(rate[True] / rate[False], 3)
        summary[f"tokens_per_s_rows{n}"] = round(rate[True])
        del engines
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

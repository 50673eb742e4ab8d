"""The learner's update phase eager vs compiled (`trainer.compile`: `compiled_layers`, and the head's float32 passes,
`fused_head`; `--layers-only` leaves the head eager).

    .venv/bin/python benchmarks/compile_update.py                      # CPU: 28 narrow layers (dispatch-bound) + wider
    python benchmarks/compile_update.py --device cuda --widths 1024 --rows 128 --new-tokens 256 --vocab 151936 \\
        --precision autocast                                           # the GPU benchmark's Qwen3-0.6B update phase

For each width in `--widths`, a random-init Qwen3 of `--layers` layers (width 1,024: Qwen3-0.6B's layout, 16 query
heads sharing 8 KV heads of 128; else heads of 32) runs `gspo.learner.learn` on one rollout batch of `--rows` random
rows (6-token prompts, `--new-tokens` completion tokens, a few rows cut short): π_old recomputed, then 4 minibatch
updates (GSPO ε 3e-4/4e-4, grad-norm clip, fused AdamW), i.e. the trainer's whole update phase, with
`LearnSettings.compile` off and on, alternating, `--batches` measured calls each after one warm-up (the compiled
side's first call compiles: its time is shown). Also counted, on one more call per side: the aten ops dispatched
(torch.profiler, CPU side) and on CUDA the GPU kernels launched, and on CUDA the peak memory. Prints a table and one
JSON line (`compile_speedup_w{width}`: eager s / compiled s).

Why the narrow rows: a Qwen3 layer's forward and backward are ~700 aten ops in eager mode. On a GPU a small model's
update waits on the host dispatching them; a 28-layer model a few dozen wide is in that regime on a CPU too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def build(width: int, layers: int, vocab: int, device: str):
    """A random-init Qwen3 for the update (float32 weights; sdpa attention)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads, kv, head_dim = (16, 8, 128) if width == 1024 else (max(2, width // 32), max(1, width // 64), 32)
    config = Qwen3Config(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim, intermediate_size=3 * width,
                         max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def rollout_batch(rows: int, new_tokens: int, vocab: int, device: str):
    """`rows` random rows: 6-token prompts (some left-padded), completions of `new_tokens` (every 4th row cut to half,
    right-padded), engine log-probs of -2, sequence advantages ±1."""
    import torch

    from gspo.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(rows, 6, dtype=torch.long)
    prompt_mask[::3, :2] = 0
    completion_mask = torch.ones(rows, new_tokens, dtype=torch.long)
    completion_mask[::4, new_tokens // 2:] = 0
    traj = Trajectory(prompt_ids=torch.randint(3, vocab, (rows, 6), generator=g) * prompt_mask,
                      prompt_mask=prompt_mask,
                      completion_ids=torch.randint(3, vocab, (rows, new_tokens), generator=g) * completion_mask,
                      completion_mask=completion_mask, logprobs=-2.0 * completion_mask.float(),
                      truncated=torch.zeros(rows, dtype=torch.bool), completions=[""] * rows,
                      prompt_index=torch.arange(rows) // 8)
    advantages = (torch.arange(rows) % 2 * 2 - 1).float()  # one per sequence (GSPO)
    return traj.to(device), advantages.to(device)


def measure(a: argparse.Namespace, width: int) -> dict:
    """One width's eager and compiled update phases: median seconds, aten ops and CUDA kernels of one call, peak GPU
    bytes (each a pair: eager, compiled), the compiled side's first call (compile included) and the parameter count."""
    import torch
    from run import gpu_peak_bytes, sync  # benchmarks/run.py: this script's folder is on sys.path
    from torch.profiler import ProfilerActivity, profile

    from gspo.learner import LearnSettings, learn
    from gspo.objectives import OBJECTIVES
    from gspo.optim import make_optimizer
    from gspo.parallel import ProcessGroup

    cuda = a.device.startswith("cuda")
    if a.layers_only:  # the learner enters fused_head with the layers: leave the head's passes eager
        import contextlib

        import gspo.learner

        gspo.learner.fused_head = lambda enabled=True: contextlib.nullcontext()
    group = ProcessGroup(device=torch.device(a.device))  # the learner's autocast runs on this device type
    model = build(width, a.layers, a.vocab, a.device)
    optimizer, scheduler = make_optimizer(model, 1e-6, 1000)
    traj, advantages = rollout_batch(a.rows, a.new_tokens, a.vocab, a.device)
    minibatches = list(torch.randperm(a.rows, generator=torch.Generator().manual_seed(1)).to(a.device).chunk(4))
    settings = {c: LearnSettings(objective=OBJECTIVES["gspo"], eps_low=3e-4, eps_high=4e-4,
                                 max_new_tokens=a.new_tokens, compile=c,
                                 mixed_precision="bfloat16" if a.precision == "autocast" else None)
                for c in (False, True)}

    def update(compiled: bool) -> float:
        sync(a.device)
        t0 = time.perf_counter()
        learn(model, optimizer, scheduler, traj, advantages, minibatches, settings[compiled], group)
        sync(a.device)
        return time.perf_counter() - t0

    times: dict[bool, list[float]] = {False: [], True: []}
    first, peak = {}, {False: 0, True: 0}
    for rep in range(1 + a.batches):
        for compiled in ((False, True) if rep % 2 == 0 else (True, False)):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            elapsed = update(compiled)
            peak[compiled] = max(peak[compiled], gpu_peak_bytes(a.device))
            if rep:
                times[compiled].append(elapsed)
            else:
                first[compiled] = elapsed
    ops, kernels = {}, {}
    for compiled in (False, True):
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            update(compiled)
        events = prof.events()
        ops[compiled] = sum(1 for e in events if e.name.startswith("aten::"))
        kernels[compiled] = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    pair = (False, True)
    return {"seconds": [statistics.median(times[c]) for c in pair], "ops": [ops[c] for c in pair],
            "kernels": [kernels[c] for c in pair], "peak": [peak[c] for c in pair], "compile_s": first[True],
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--widths", default="64,256", help="comma-separated hidden sizes (1024: the Qwen3-0.6B layout)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", type=int, default=32, help="rows per rollout batch (4 minibatches)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--precision", default="fp32", choices=["fp32", "autocast"], help="autocast: bf16 over fp32")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers-only", action="store_true",
                   help="the compiled side compiles the decoder layers only, not the head's passes (fused_head)")
    a = p.parse_args()

    import torch
    import transformers

    torch.set_num_threads(a.threads)
    print(f"update phase (π_old + 4 minibatch updates), Qwen3 × {a.layers} layers, vocab {a.vocab}, {a.precision}, "
          f"{a.device}, {a.rows} rows × (6 + {a.new_tokens}) tokens; torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    summary: dict = {"device": a.device, "layers": a.layers, "rows": a.rows, "new_tokens": a.new_tokens,
                     "precision": a.precision}
    print(f"{'width':>5} | {'params':>7} | {'eager s':>8} | {'compiled s':>10} | {'eager/compiled':>14} | "
          f"{'aten ops (e / c)':>17} | {'kernels (e / c)':>15} | {'peak GiB (e / c)':>16} | compile s")
    for width in map(int, a.widths.split(",")):
        row = measure(a, width)
        cuda = a.device.startswith("cuda")
        gib = f"{row['peak'][0] / 2**30:.2f} / {row['peak'][1] / 2**30:.2f}" if cuda else "-"
        kern = f"{row['kernels'][0]} / {row['kernels'][1]}" if cuda else "-"
        eager, comp = row["seconds"]
        print(f"{width:>5} | {row['params'] / 1e6:6.1f}M | {eager:8.3f} | {comp:10.3f} | {eager / comp:13.2f}× | "
              f"{row['ops'][0]:>7} / {row['ops'][1]:<7} | {kern:>15} | {gib:>16} | {row['compile_s']:.1f}", flush=True)
        summary[f"compile_speedup_w{width}"] = round(eager / comp, 3)
        summary[f"update_s_eager_w{width}"] = round(eager, 4)
        summary[f"update_s_compiled_w{width}"] = round(comp, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Peak memory and time of one learner step with `trainer.micro_batch_tokens`: none (a minibatch share per forward)
against token budgets, measured in the same run.

    .venv/bin/python benchmarks/micro_batch_memory.py [--budgets none,2048,1024,512] [--rows 32] [--length 512]
    python benchmarks/micro_batch_memory.py --device cuda --layers 28 --hidden 1024 --rows 64 --length 1024 \
        --budgets none,8192,4096,2048          # on a GPU: torch.cuda.max_memory_allocated instead of RSS

Each measurement is one `gspo.learner.learn` call (π_old recomputed, then 4 minibatch updates, GSPO) on the same
rollout batch of `--rows` rows (16-token prompts, completions of 64 to `--length` tokens) through a Qwen3 of
`--layers` layers and `--hidden` width (default 8 and 128; vocab 8,192), in a fresh subprocess: peak = the
subprocess's peak RSS (VmHWM; on CUDA the peak of allocated memory) minus what was in use just before the call
(model, gradients and a warm-up step already resident), so what it shows is the step's activations. A step that
runs out of memory is a row "out of memory" (the baseline's too: then no ratios). The
update is the same whatever the budget: the table shows the largest weight difference against the unbudgeted step,
relative to the largest weight change. The optimizer is plain SGD, so that this compares the gradients (AdamW's
first steps move every weight by about ±lr whatever its gradient's size, and GSPO's narrow clip turns a rounding
difference into a clipped or kept sequence, which would show float rounding as 1e-3 differences). Prints a table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(budget: int | None, rows: int, length: int, device: str = "cpu", layers: int = 8,
            hidden: int = 128) -> dict:
    """In this process: the memory growth (CPU: RSS; CUDA: allocated) and time of one learn() step; also the weights'
    change, for the comparison."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.learner import LearnSettings, learn
    from gspo.objectives import OBJECTIVES
    from gspo.trajectory import Trajectory

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=length + 32, tie_word_embeddings=False)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    g = torch.Generator().manual_seed(1)
    c_len = torch.randint(64, length + 1, (rows,), generator=g)
    completion_mask = (torch.arange(length) < c_len[:, None]).long()
    traj = Trajectory(prompt_ids=torch.randint(3, 8192, (rows, 16), generator=g),
                      prompt_mask=torch.ones(rows, 16, dtype=torch.long),
                      completion_ids=torch.randint(3, 8192, (rows, length), generator=g) * completion_mask,
                      completion_mask=completion_mask, logprobs=torch.zeros(rows, length),
                      truncated=torch.zeros(rows, dtype=torch.bool), completions=[""] * rows,
                      prompt_index=torch.arange(rows) // 8)
    traj = traj.to(device)
    advantages = torch.randn(rows, generator=g).to(device)
    spec = OBJECTIVES["gspo"]
    settings = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=length,
                             micro_batch_tokens=budget)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    minibatches = [mb.to(device) for mb in torch.randperm(rows, generator=g).chunk(4)]
    # a 2-row step first: the optimizer state and the allocator's pools exist before the measured step
    two = torch.arange(2, device=device)
    learn(model, optimizer, scheduler, traj.take(two), torch.zeros(2, device=device), [two], settings)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = memory(device, peak=False)
    t0 = time.perf_counter()
    try:
        learn(model, optimizer, scheduler, traj, advantages, minibatches, settings)
    except torch.OutOfMemoryError:  # what the budget is for: a row of the table, not a failed benchmark
        return {"budget": budget, "out_of_memory": True}
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = memory(device, peak=True)
    delta = {k: (v.detach() - start[k])[:64].cpu().tolist() for k, v in model.named_parameters()
             if k.endswith("layers.0.self_attn.q_proj.weight")}
    return {"budget": budget, "peak_bytes": peak - before, "seconds": seconds, "delta": delta}


def memory(device: str, peak: bool) -> int:
    """Bytes in use (`peak` False; on CUDA also resets the peak) or the peak since (`peak` True): the process's RSS and
    VmHWM on the CPU (ru_maxrss would include the parent's peak, kept across exec), allocated tensors on CUDA."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        if peak:
            return torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/status") as f:
        key = "VmHWM:" if peak else "VmRSS:"
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def run(budget: int | None, rows: int, length: int, device: str, layers: int, hidden: int) -> dict:
    """`measure` in a fresh subprocess (peak RSS is per process and never goes down)."""
    args = f"{budget!r}, {rows}, {length}, {device!r}, {layers}, {hidden}"
    code = f"import json, sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); " \
           f"from micro_batch_memory import measure; print(json.dumps(measure({args})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_gap(a: dict, b: dict) -> tuple[float, float]:
    """(largest |a − b|, largest |a|) over the compared weight changes."""
    import torch

    gap = max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)
    return gap, max(float(torch.tensor(v).abs().max()) for v in a.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="none,2048,1024,512")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128, help="a multiple of 4 (4 attention heads)")
    args = parser.parse_args()
    if args.rows < 8 or args.length < 64 or args.layers < 1 or args.hidden < 4 or args.hidden % 4:
        parser.error("need --rows >= 8, --length >= 64, --layers >= 1 and --hidden a positive multiple of 4")
    budgets = []
    for value in args.budgets.split(","):
        if value != "none" and not (value.isdigit() and int(value) > 0):
            parser.error(f"--budgets: {value!r} is neither 'none' nor a positive token count")
        budgets.append(None if value == "none" else int(value))
    if budgets[0] is not None:
        parser.error("--budgets: the first must be 'none' (the baseline the others are compared with)")
    results = [run(b, args.rows, args.length, args.device, args.layers, args.hidden) for b in budgets]
    base, mib = results[0], 2**20
    print(f"learner step peak memory ({args.device}): {args.rows} rows × (16 + ≤{args.length} tokens), 4 minibatches,"
          f" {args.layers}-layer Qwen3 hidden {args.hidden}")
    print(f"{'micro_batch_tokens':>18} | {'peak':>9} | {'vs none':>7} | {'time':>7} | {'vs none':>7} | update gap")
    fitted = "out_of_memory" not in base
    for r in results:
        if "out_of_memory" in r:
            print(f"{r['budget']!s:>18} | out of memory")
            continue
        peak, seconds = r["peak_bytes"], r["seconds"]
        ratios = f"      – | {seconds:>6.2f}s |       – |       –"
        if fitted:
            gap, scale = max_gap(base["delta"], r["delta"])
            ratios = (f"{peak / base['peak_bytes']:>7.2f} | {seconds:>6.2f}s | {seconds / base['seconds']:>7.2f} | "
                      f"{gap / scale:.1e}")
        print(f"{r['budget']!s:>18} | {peak / mib:>5,.0f} MiB | {ratios}")
    measured = [r for r in results[1:] if "out_of_memory" not in r]
    line = {"baseline_out_of_memory": not fitted,
            "micro_batch_peak_mib": {str(r["budget"]): round(r["peak_bytes"] / mib) for r in measured}}
    if fitted:
        line["micro_batch_peak_ratio"] = {str(r["budget"]): round(r["peak_bytes"] / base["peak_bytes"], 3)
                                          for r in measured}
        line["micro_batch_time_ratio"] = {str(r["budget"]): round(r["seconds"] / base["seconds"], 3)
                                          for r in measured}
    print(json.dumps(line))


if __name__ == "__main__":
    main()

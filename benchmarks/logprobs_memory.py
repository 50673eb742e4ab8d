"""Peak memory of per-token log-probabilities at Qwen3's vocabulary (151,936): full logits vs `gspo.logprobs`' chunks.

    .venv/bin/python benchmarks/logprobs_memory.py [--lengths 1024,2048,4096,8192] [--hidden 64]

Each measurement is one forward + backward of `completion_logprobs` (a training step's log-prob work) on one
sequence of an 8-token prompt and a T-token completion, through a 2-layer Qwen3 with a small hidden size (so that it
runs on a CPU) and the full 151,936-token vocabulary, in a fresh subprocess: peak memory = the subprocess's peak RSS
(VmHWM) minus its RSS just before the call (model, inputs, imports and the gradient buffers of a 16-token
warm-up call already resident). The full-logits path
(`chunk_size=0`) holds the [T, V] float32 logits, their log-softmax and their gradients (~3 × 4·T·V bytes); the
chunked path holds one chunk of logits at a time. The naive path is skipped where its projected peak would not fit in
the machine's free memory. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/logprobs_memory.py --wrap ddp,fsdp [--lengths 1024,2048]

measures the policy as the trainer wraps it under torchrun (`gspo.parallel.wrap_policy`: DDP, or FSDP2), on 2
processes (gloo, one thread each) that each run the step on their own sequence; the peak is the larger of the two.
The full-logits column is what a wrapped policy computed before its training forward took the chunked head
(`gspo.logprobs.LogprobForward`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 151_936
PROCESSES = 2  # of a wrapped (DDP / FSDP) measurement


def measure(length: int, hidden: int, chunked: bool, wrap: str = "none") -> dict:
    """In this process: RSS growth and time of one forward + backward of completion_logprobs. `wrap` ddp / fsdp: the
    policy wrapped as under torchrun (this process is one of torchrun's); the result is the processes' largest."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.logprobs import completion_logprobs

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=length + 16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa")
    group = None
    if wrap != "none":
        from gspo.parallel import init_distributed, wrap_policy

        group = init_distributed(parallel=wrap, device="cpu")
        model = wrap_policy(group, model)
        torch.manual_seed(1 + group.rank)  # each process its own sequence
    prompt = torch.randint(0, VOCAB, (1, 8))
    completion = torch.randint(0, VOCAB, (1, length))
    masks = torch.ones_like(prompt), torch.ones_like(completion)
    chunk_size = None if chunked else 0
    warm, _ = completion_logprobs(model, prompt, masks[0], completion[:, :16], masks[1][:, :16], chunk_size=chunk_size)
    warm.sum().backward()  # one-time set-up (kernels, thread pool, gradient buffers) is not the method's memory
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    t0 = time.perf_counter()
    logprobs, _ = completion_logprobs(model, prompt, masks[0], completion, masks[1], chunk_size=chunk_size)
    logprobs.sum().backward()
    seconds = time.perf_counter() - t0
    with open("/proc/self/status") as f:  # VmHWM: ru_maxrss would include the parent's peak (kept across exec)
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    result = {"length": length, "chunked": chunked, "peak_bytes": peak - before, "seconds": seconds}
    if group is not None:
        from gspo.parallel import shutdown

        every = group.all_gather_object(result)
        result = {**result, "peak_bytes": max(r["peak_bytes"] for r in every),
                  "seconds": max(r["seconds"] for r in every)}
        del model, logprobs
        shutdown()
    return result


def run(length: int, hidden: int, chunked: bool, wrap: str = "none") -> dict:
    """`measure` in a fresh subprocess (peak RSS is per process and never goes down); 2 under torchrun for `wrap`."""
    script = [str(Path(__file__).resolve()), "--measure", str(length), "--hidden", str(hidden), "--wrap", wrap]
    if chunked:
        script.append("--chunked")
    cmd = [sys.executable, *script] if wrap == "none" else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCESSES}", *script]
    threads = os.environ.get("OMP_NUM_THREADS", "2") if wrap == "none" else "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": threads},
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed ({length}, chunked={chunked}, wrap={wrap}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def table(lengths: list[int], hidden: int, wrap: str = "none") -> tuple[list[dict], dict[int, float]]:
    """Rows for every length (naive where it fits), and chunked/naive peak ratios by length."""
    rows, ratios = [], {}
    processes = 1 if wrap == "none" else PROCESSES
    for length in lengths:
        chunked = run(length, hidden, True, wrap)
        projected = 4 * 4 * length * VOCAB  # logits, log-softmax, their gradients: ~4 [T, V] float32 buffers
        naive = run(length, hidden, False, wrap) if processes * projected < 0.7 * available_bytes() else None
        rows.append({"length": length, "naive": naive, "chunked": chunked, "wrap": wrap})
        if naive is not None:
            ratios[length] = chunked["peak_bytes"] / naive["peak_bytes"]
    return rows, ratios


def print_table(rows: list[dict], ratios: dict[int, float]) -> None:
    mib = 2**20
    wrap = rows[0].get("wrap", "none") if rows else "none"
    where = "fresh process per cell" if wrap == "none" else f"{wrap.upper()}, {PROCESSES} fresh processes per cell"
    print(f"log-prob peak memory, vocab {VOCAB:,}, forward + backward, one sequence ({where})")
    print(f"{'completion tokens':>18} | {'full logits':>12} | {'chunked':>10} | {'ratio':>7} | {'time full':>9} | "
          f"{'time chunked':>12}")
    for r in rows:
        n, c = r["naive"], r["chunked"]
        full = f"{n['peak_bytes'] / mib:,.0f} MiB" if n else "skipped"
        ratio = f"1/{1 / ratios[r['length']]:.0f}" if r["length"] in ratios else "-"
        t_full = f"{n['seconds']:.2f} s" if n else "-"
        print(f"{r['length']:>18,} | {full:>12} | {c['peak_bytes'] / mib:>6,.0f} MiB | {ratio:>7} | {t_full:>9} | "
              f"{c['seconds']:>10.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--wrap", default="none", help="none, or a comma list of ddp / fsdp: the policy wrapped as under "
                   f"torchrun, {PROCESSES} processes")
    p.add_argument("--measure", type=int, help=argparse.SUPPRESS)
    p.add_argument("--chunked", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        result = measure(a.measure, a.hidden, a.chunked, a.wrap)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    lengths = [int(x) for x in a.lengths.split(",")]
    wraps = a.wrap.split(",")
    if bad := [w for w in wraps if w not in ("none", "ddp", "fsdp")]:  # before any measurement
        p.error(f"--wrap {','.join(bad)}: use none, ddp or fsdp")
    summary: dict = {}
    for wrap in wraps:
        rows, ratios = table(lengths, a.hidden, wrap)
        print_table(rows, ratios)
        key = "logprob_peak_memory_ratio" + ("" if wrap == "none" else f"_{wrap}")
        summary.update({key: ratios.get(4096 if wrap == "none" else max(ratios, default=0)),
                        f"ratios{'' if wrap == 'none' else '_' + wrap}": {str(k): v for k, v in ratios.items()}})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

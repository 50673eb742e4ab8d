"""Where one minibatch update's time goes: forward + backward of the training log-probs, grad-norm clipping and fused
AdamW on 16 rows × (6 prompt + 16 completion) tokens of a benchmark model, with torch.profiler's op table.

    .venv/bin/python benchmarks/profile_update.py --model medium_moe                  # fp32 (gspo's default)
    .venv/bin/python benchmarks/profile_update.py --model medium_moe --precision autocast   # trainer.mixed_precision
    .venv/bin/python benchmarks/profile_update.py --model tiny_moe --precision bf16         # pure bf16 weights

Prints the median update time over `--repeats` updates (after 3 warm-ups), then the ops by self CPU time over 3
profiled updates. `bf16` converts the weights (what `model.dtype: bfloat16` would train, refused by gspo at RL learning
rates; here only to time the arithmetic, so the learning-rate check is bypassed with a large rate).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="medium_moe", choices=["tiny_moe", "medium_moe"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "autocast", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--rows", type=int, default=30, help="rows of the op table")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    import run  # benchmarks/run.py: the same models as the TRL comparison

    from gspo.logprobs import completion_logprobs
    from gspo.models import load_model
    from gspo.optim import make_optimizer

    with tempfile.TemporaryDirectory() as tmp:
        path = run.build_models(Path(tmp))[a.model]
        model, _ = load_model(str(path))
    model.train()
    if a.precision == "bf16":
        model.to(torch.bfloat16)
    optimizer, _ = make_optimizer(model, 1e-5 if a.precision != "bf16" else 1.0, 1000)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 52, (16, 6), generator=g)
    completion = torch.randint(3, 52, (16, 16), generator=g)
    batch = (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))

    def update() -> None:
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if a.precision == "autocast" else contextlib.nullcontext()
        with amp:
            logprobs, _ = completion_logprobs(model, *batch, trim_padding=True)
        logprobs.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        update()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    print(f"{a.model} {a.precision}: median update {statistics.median(times) * 1e3:.1f} ms "
          f"({a.threads} threads, {a.repeats} updates)")
    with torch.profiler.profile() as prof:
        for _ in range(3):
            update()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()

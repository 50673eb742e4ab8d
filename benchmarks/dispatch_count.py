"""Aten ops each side dispatches per rollout batch, generation left out: TRL's GRPOTrainer vs gspo's rl_step.

    bash benchmarks/setup.sh && .venv-bench/bin/python benchmarks/dispatch_count.py

On a GPU an update phase of a small model waits on the host launching its ops, so the count is a device-free proxy of
that cost. Both sides run benchmarks/run.py's workers (the same saved model, GSPO, 4 minibatches, forced lengths) on a
narrow 28-layer Qwen3 (64 wide, vocab 4,096; 8 prompts × 4 completions × 64 tokens), with every op counted below
autograd (a TorchDispatchMode: forward, backward, optimizer, metrics) except inside the sampling call (TRL's
`_generate`, gspo's `HFSampler.generate`); per rollout batch = the count over 1 warm-up + 2 batches, divided by 3.
Prints one JSON line per side; then (not with `--no-time`) each side's update phase in seconds (a rollout batch's time
minus its sampling call's, 3 alternating rounds of 1 warm-up + 3 batches, medians): the same regime timed, as a
second proxy of the GPU's.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

import run  # benchmarks/run.py: this script's folder is on sys.path
import torch
from torch.utils._python_dispatch import TorchDispatchMode

NARROW = {"narrow": ("Qwen3Config", {**run._GPU_COMMON, "vocab_size": 4096, "hidden_size": 64,
                                     "num_hidden_layers": 28, "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "head_dim": 32, "intermediate_size": 192})}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `on`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.on = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def pause_in(self, owner: object, name: str) -> None:
        """Stop counting inside `owner.name` (a method)."""
        inner = getattr(owner, name)

        def paused(*args, **kwargs):
            self.on = False
            try:
                return inner(*args, **kwargs)
            finally:
                self.on = True

        setattr(owner, name, paused)


def count(side: str, path: Path, batches: int = 2, warmup: int = 1) -> dict:
    counter = OpCounter()
    options = {"shape": [8, 4, 64], "device": "cpu", "reward": "hash"}
    if side == "trl":
        import trl

        init = trl.GRPOTrainer.__init__

        def counted_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            counter.pause_in(self, "_generate")

        trl.GRPOTrainer.__init__ = counted_init
        with counter:
            run.trl_worker(str(path), batches, warmup, options)
    else:
        from gspo.rollout import HFSampler

        counter.pause_in(HFSampler, "generate")
        with counter:
            run.gspo_worker(str(path), batches, warmup, options)
    n = batches + warmup
    return {"side": side, "ops_per_rollout_batch": round(sum(counter.ops.values()) / n),
            "most": [(op, round(k / n)) for op, k in counter.ops.most_common(6)]}


def main() -> None:
    torch.set_num_threads(2)
    if len(sys.argv) > 1 and sys.argv[1] in ("trl", "gspo"):  # one side in this process (the counter patches classes)
        path = Path(sys.argv[2])
        print(json.dumps(count(sys.argv[1], path)), flush=True)
        return
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        path = run.build_gpu_models(Path(tmp), ["narrow"], NARROW, "cpu")["narrow"]
        for side in ("trl", "gspo"):
            out = subprocess.run([sys.executable, __file__, side, str(path)], capture_output=True, text=True,
                                 check=True)
            print(out.stdout.strip().splitlines()[-1], flush=True)
        if "--no-time" in sys.argv:
            return
        options = {"shape": [8, 4, 64], "device": "cpu", "reward": "hash", "time_generation": True}
        update: dict[str, list[float]] = {"trl": [], "gspo": []}
        for r in range(3):
            for side in ("trl", "gspo") if r % 2 == 0 else ("gspo", "trl"):
                out = run.run_worker(side, path, 3, 1, 2, options)
                update[side] += [t - g for t, g in zip(out["times"], out["rollout"], strict=True)]
        print(json.dumps({f"update_s_{side}": round(statistics.median(v), 3) for side, v in update.items()}))


if __name__ == "__main__":
    main()

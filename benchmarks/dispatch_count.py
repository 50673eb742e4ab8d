"""Aten ops each side dispatches per rollout batch, generation left out: TRL's GRPOTrainer vs gspo's rl_step.

    bash benchmarks/setup.sh && .venv-bench/bin/python benchmarks/dispatch_count.py

On a GPU an update phase of a small model waits on the host launching its ops, so the count is a device-free proxy of
that cost. Both sides run benchmarks/run.py's workers (the same saved model, GSPO, 4 minibatches, forced lengths) on a
narrow 28-layer Qwen3 (64 wide, vocab 4,096; 8 prompts × 4 completions × 64 tokens), with every op counted below
autograd (a TorchDispatchMode: forward, backward, optimizer, metrics) except inside the sampling call (TRL's
`_generate`, gspo's `HFSampler.generate`); per rollout batch = the count over 1 warm-up + 2 batches, divided by 3.
Each side's host syncs are counted too: ops that on CUDA make the host wait for the device (a scalar read — `.item()`,
`float()`, `bool()` of a tensor —, `nonzero`, a boolean-mask index, `masked_select`, `unique`, `repeat_interleave`
without its output size) and calls of `Tensor.tolist`, `.cpu()` and `.numpy()` (on the CPU every tensor is already
there, so this counts each call, also on tensors that live on the host on a GPU too: an upper bound). A sync stops
the host from queueing kernels until the device has run all it was given, so the device then idles for the launch
latency of what follows: the sync count, with the op count, is what the GPU's update time can be proxied by here.
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
import traceback
from pathlib import Path

import run  # benchmarks/run.py: this script's folder is on sys.path
import torch
from torch.utils._python_dispatch import TorchDispatchMode

NARROW = {"narrow": ("Qwen3Config", {**run._GPU_COMMON, "vocab_size": 4096, "hidden_size": 64,
                                     "num_hidden_layers": 28, "num_attention_heads": 2, "num_key_value_heads": 1,
                                     "head_dim": 32, "intermediate_size": 192})}


SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim",
            "aten.unique_consecutive"}
"""Aten ops whose CUDA kernels wait for the device: their result's value or size is read on the host."""

HOST_COPIES = ("tolist", "cpu", "numpy")
"""Tensor methods that copy to the host (below the dispatcher on a CPU tensor, so counted by patching them)."""


def syncs(func, args: tuple, kwargs: dict) -> bool:
    """Whether this aten call waits for the device on CUDA."""
    name = str(func.overloadpacket)
    if name in SYNC_OPS:
        return True
    if name == "aten.index":  # a boolean mask is turned into indices on the host's behalf
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None
    return False


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `on`, and among them (and the host copies) the host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.where: collections.Counter[str] = collections.Counter()
        self.on = True

    def sync(self, what: str) -> None:
        """Count one host sync, and where it was asked for (the innermost gspo / TRL frame, as memory_peak labels)."""
        self.syncs[what] += 1
        frames = traceback.extract_stack()[:-2]
        own = [f for f in frames if "/gspo/" in f.filename or "/trl/" in f.filename]
        f = (own or frames)[-1]
        self.where[f"{f.filename.split('/gspo/')[-1].split('/trl/')[-1]}:{f.lineno} {f.name}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on:
            self.ops[str(func.overloadpacket)] += 1
            if syncs(func, args, kwargs):
                self.sync(str(func.overloadpacket))
        return func(*args, **kwargs)

    def count_host_copies(self) -> None:
        """Count calls of the HOST_COPIES methods of torch.Tensor while `on` (patches the class: one side per
        process)."""
        for name in HOST_COPIES:
            inner = getattr(torch.Tensor, name)

            def counted(tensor, *args, _inner=inner, _name=name, **kwargs):
                if self.on:
                    self.sync(f"Tensor.{_name}")
                return _inner(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)

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
    counter.count_host_copies()
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
            "most": [(op, round(k / n)) for op, k in counter.ops.most_common(6)],
            "host_syncs_per_rollout_batch": round(sum(counter.syncs.values()) / n, 1),
            "syncs": {op: round(k / n, 1) for op, k in counter.syncs.most_common()},
            "syncs_where": {at: round(k / n, 1) for at, k in counter.where.most_common(12)}}


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

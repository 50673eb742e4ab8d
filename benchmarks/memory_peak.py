"""What holds a device's memory at its peak: the allocations live at the moment of the most allocated bytes, by
where they were made. `benchmarks/run.py --device cuda --memory-peak DIR` runs one more rollout batch of each side
(TRL's too) under `torch.cuda.memory._record_memory_history` and writes this breakdown to DIR/MODEL_SIDE_memory.txt.

The allocator's trace lists every alloc and free made while recording; the allocations made before it (the weights,
AdamW's state) appear only at their free, or not at all if they outlive the recording: they are found from the
snapshot's blocks, and labelled by the frames recorded with them, if any.

On the CPU, `Recording` reads torch.profiler's memory events instead (the growth over the recording's start), and
`python benchmarks/memory_peak.py` runs the GPU comparison's dense model with fewer layers and tokens on the CPU:
what each side (TRL, gspo exact, gspo fast) holds at its peak, without a GPU (`main`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

OWN = ("/gspo/", "/trl/", "/transformers/", "/peft/")
"""Frames of these packages name an allocation: the innermost such frame (the code that asked), not torch's."""

MAX_ENTRIES = 1_000_000
"""Trace entries recorded (a ring buffer: a longer trace loses its start, and this analysis says so)."""


def label(frames: list[dict]) -> str:
    """`file:line function` of the innermost frame in OWN (the shortest path from the package root), else of the
    innermost Python frame; "(no stack recorded)" for an allocation made before the recording."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in python:
        for pkg in OWN:
            if pkg in f["filename"]:
                return f"{pkg.strip('/')}/{f['filename'].split(pkg, 1)[1]}:{f['line']} {f['name']}"
    if python:
        return f"{Path(python[0]['filename']).name}:{python[0]['line']} {python[0]['name']}"
    return "(no stack recorded)"


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, dict[int, tuple[int, str]], bool]:
    """Replay `snapshot`'s trace of `device`: (the most bytes allocated at once, the allocations live then as {address:
    (bytes, label)}, whether the trace may have lost its start). Allocated bytes count from the alloc to the free
    request, as torch.cuda.max_memory_allocated counts them."""
    trace = snapshot["device_traces"][device]
    blocks = {b["address"]: b for seg in snapshot["segments"] if seg.get("device", device) == device
              for b in seg["blocks"] if b["state"] != "inactive"}
    first: dict[int, str] = {}
    for e in trace:
        if "addr" in e:
            first.setdefault(e["addr"], e["action"])
    live = {addr: (b["size"], label(b.get("frames", []))) for addr, b in blocks.items() if addr not in first}
    frees: dict[int, int] = {}
    for e in trace:
        if e["action"] in ("free_requested", "free_completed"):
            frees.setdefault(e["addr"], e["size"])
    for addr, action in first.items():  # freed before any alloc in the trace: allocated before the recording
        if action in ("free_requested", "free_completed"):
            live[addr] = (frees[addr], label(blocks.get(addr, {}).get("frames", [])))
    total = sum(size for size, _ in live.values())
    peak, at_peak = total, dict(live)
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], label(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    return peak, at_peak, len(trace) >= MAX_ENTRIES


def breakdown(snapshot: dict, rows: int = 30, device: int = 0) -> str:
    """A text table of `live_at_peak`: the peak, then the live bytes by label, largest first."""
    peak, at_peak, truncated = live_at_peak(snapshot, device)
    head = (f"peak allocated {peak / 2**30:.2f} GiB in {len(at_peak)} allocations"
            + (" (the trace filled its buffer: its start, and so this peak, may be wrong)" if truncated else ""))
    return table(head, peak, at_peak, rows)


def table(head: str, peak: int, at_peak: dict[int, tuple[int, str]], rows: int = 30) -> str:
    """`head`, then the bytes live at the peak ({address: (bytes, label)}) summed by label, largest first."""
    by = Counter()
    count = Counter()
    for size, where in at_peak.values():
        by[where] += size
        count[where] += 1
    lines = [head, f"{'GiB':>7} {'share':>6} {'allocs':>7}  where (innermost gspo / trl / transformers frame)"]
    for where, size in by.most_common(rows):
        lines.append(f"{size / 2**30:7.3f} {size / max(peak, 1):6.1%} {count[where]:7d}  {where}")
    return "\n".join(lines)


def profiled_allocations(prof) -> list[tuple[int, int, int, str]]:
    """The CPU allocations and frees a `torch.profiler.profile(profile_memory=True, with_stack=True)` saw, in time
    order: (time ns, address, bytes: negative for a free, label). The label is `label` of the Python frames above the
    event, or for autograd's C++ backward (no Python frame of its own package) the backward node, e.g.
    "backward MmBackward0"."""
    from torch._C._profiler import _EventType

    found = []
    stack = [(root, ()) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, above = stack.pop()
        kind = node.typed[0]
        if kind == _EventType.Allocation:
            event = node.typed[1]
            if event.device.type == "cpu":
                found.append((node.start_time_ns, event.ptr, event.alloc_size, _profiled_label(above)))
            continue
        below = (*above, node.name) if kind in (_EventType.PyCall, _EventType.TorchOp) else above
        stack.extend((child, below) for child in node.children)
    return sorted(found)


def _profiled_label(above: tuple[str, ...]) -> str:
    """`label` of the profiler's names above an allocation (outermost first): Python calls "path(line): function",
    ops and record_function ranges by name."""
    frames = []
    for name in reversed(above):  # innermost first, as `label` takes them
        path, paren, rest = name.partition("(")
        if paren and path.endswith(".py") and "): " in rest:
            line, _, function = rest.partition("): ")
            frames.append({"filename": "/" + path.lstrip("/"), "line": int(line), "name": function})
    own = [f for f in frames if any(pkg in f["filename"] for pkg in OWN)]
    if own:
        return label(own)
    engine = [n for n in above if n.startswith("autograd::engine::evaluate_function: ")]
    if engine:
        return "backward " + engine[-1].split(": ", 1)[1]
    return label(frames) if frames else (above[-1] if above else "(no stack recorded)")


def cpu_live_at_peak(allocations: list[tuple[int, int, int, str]]) -> tuple[int, dict[int, tuple[int, str]]]:
    """Replay `profiled_allocations`: (the most bytes live at once that were allocated during the recording, the
    allocations live then as {address: (bytes, label)}). Memory allocated before the recording is not seen, and its
    frees are left out: the peak is the recording's growth over its start."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for _, address, size, where in allocations:
        if size > 0:
            live[address] = (size, where)
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif address in live:
            total -= live.pop(address)[0]
    return peak, at_peak


class Recording:
    """What is live at the memory peak of the code run between `start` and `stop`, written to `path` at `stop`. On
    CUDA from the allocator's history (`breakdown`: every live allocation, those made before too); on the CPU from
    torch.profiler's memory events (`cpu_live_at_peak`: the growth over the start), which costs a profiled run."""

    def __init__(self, path: str | Path, device: str = "cuda") -> None:
        self.path, self.device, self._prof = Path(path), device, None

    def start(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
            return
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
        self._prof.start()

    def stop(self, what: str = "one rollout batch (generation and update)") -> None:
        import torch

        if self.device == "cuda":
            try:
                torch.cuda.synchronize()
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            self.path.write_text(f"torch {torch.__version__}: {what}; torch.cuda.max_memory_allocated "
                                 f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\n{breakdown(snapshot)}\n")
            return
        self._prof.stop()
        peak, at_peak = cpu_live_at_peak(profiled_allocations(self._prof))
        head = (f"peak growth {peak / 2**30:.3f} GiB over the recording's start, in {len(at_peak)} allocations "
                "(CPU, torch.profiler's memory events)")
        self.path.write_text(f"torch {torch.__version__}: {what}\n{table(head, peak, at_peak)}\n")


def record(path: str | Path, step: Callable[[], object], device: str = "cuda") -> None:
    """Run `step` once as a `Recording` on `device` ("cuda" or "cpu"), writing what is live at its peak to `path`."""
    recording = Recording(path, device)
    recording.start()
    step()
    recording.stop()


def main() -> None:
    """On the CPU: what is live at each side's memory peak (TRL, gspo exact, gspo fast) in `run.py`'s GPU comparison,
    on its dense model (Qwen3-0.6B's width, heads and vocabulary) with fewer layers and tokens, so that it runs here.
    gspo's chunked head runs as on CUDA (a bf16 matmul under autocast, CUDA's chunk size: `run.py`'s `cuda_head`);
    the decode loop is the CPU's (dynamic). What differs from a GPU: CPU kernels (their autocast op lists, sdpa's
    saved tensors) and the allocator (no caching, no block rounding), and the peak is the growth over the recorded
    batch's start: the weights, AdamW's state and anything kept between batches are not in it."""
    import argparse
    import tempfile

    import run

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the dense model (28 on the GPU)")
    p.add_argument("--shape", default="4,8,32", help="prompts,completions,new tokens per rollout batch")
    p.add_argument("--sides", default="trl,exact,fast", help="comma-separated subset of trl, exact, fast")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="memory-peak", help="folder for one table per side")
    a = p.parse_args()
    try:
        shape = [int(x) for x in a.shape.split(",")]
    except ValueError:
        shape = []
    if len(shape) != 3 or min(shape) < 1:
        p.error(f"--shape {a.shape!r}: three positive integers, prompts,completions,new tokens (e.g. 2,4,8)")
    if unknown := [x for x in a.sides.split(",") if x not in ("trl", "exact", "fast")]:
        p.error(f"--sides: unknown {unknown}; sides: trl, exact, fast")
    sides = [run.GPU_SIDE_NAMES[x] for x in a.sides.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    config_class, kwargs = run.GPU_MODELS["dense"]
    specs = {"dense": (config_class, {**kwargs, "num_hidden_layers": a.layers})}
    with tempfile.TemporaryDirectory() as tmp:
        path = run.build_gpu_models(Path(tmp), ["dense"], specs, "cpu")["dense"]
        for side in sides:
            worker, options = run.GPU_SIDES[side]
            file = out / f"dense{a.layers}_{side.replace(' ', '_')}_memory.txt"
            options = {**options, "shape": shape, "device": "cpu", "reward": "hash", "cuda_head": True,
                       "memory_peak": str(file)}
            run.run_worker(worker, path, 0, 1, a.threads, options)  # 1 warm-up batch, then the recorded one
            print(f"\n{side}: {file}\n{file.read_text()}", flush=True)


if __name__ == "__main__":
    main()

"""What holds a GPU's memory at its peak: the allocations live at the moment of the most allocated bytes, by where
they were made. `benchmarks/run.py --device cuda --memory-peak DIR` runs one more rollout batch of each gspo side
under `torch.cuda.memory._record_memory_history` and writes this breakdown to DIR/MODEL_SIDE_memory.txt.

The allocator's trace lists every alloc and free made while recording; the allocations made before it (the weights,
AdamW's state) appear only at their free, or not at all if they outlive the recording: they are found from the
snapshot's blocks, and labelled by the frames recorded with them, if any.
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
    by = Counter()
    count = Counter()
    for size, where in at_peak.values():
        by[where] += size
        count[where] += 1
    lines = [f"peak allocated {peak / 2**30:.2f} GiB in {len(at_peak)} allocations"
             + (" (the trace filled its buffer: its start, and so this peak, may be wrong)" if truncated else ""),
             f"{'GiB':>7} {'share':>6} {'allocs':>7}  where (innermost gspo / trl / transformers frame)"]
    for where, size in by.most_common(rows):
        lines.append(f"{size / 2**30:7.3f} {size / peak:6.1%} {count[where]:7d}  {where}")
    return "\n".join(lines)


def record(path: str | Path, step: Callable[[], object]) -> None:
    """Run `step` once with the CUDA allocator's history recorded (Python stacks), write `breakdown` to `path`."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    Path(path).write_text(f"torch {torch.__version__}: one rollout batch (generation and update); "
                          f"torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\n"
                          f"{breakdown(snapshot)}\n")

"""benchmarks/memory_peak.py: what is live at a device's allocation peak: from the CUDA allocator's trace and snapshot,
or from torch.profiler's memory events on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_peak.py"
spec = importlib.util.spec_from_file_location("memory_peak", SCRIPT)
memory_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_peak)


def frames(*where: tuple[str, int, str]) -> list[dict]:
    """Innermost first, as torch records them."""
    return [{"filename": f, "line": n, "name": name} for f, n, name in where]


TORCH = ("/usr/lib/python3/site-packages/torch/nn/functional.py", 1, "linear")
HEAD = ("/repo/src/gspo/logprobs.py", 120, "chunked_logprobs")
ATTN = ("/venv/site-packages/transformers/models/qwen3/modeling_qwen3.py", 80, "forward")


def snapshot() -> dict:
    """Weights (1,000 B) allocated before the recording and live throughout, an old buffer (500 B) freed in it, then
    the head's chunk (2,000 B) and an attention buffer (700 B) live together, the chunk freed, its address reused."""
    trace = [
        {"action": "free_requested", "addr": 200, "size": 500, "frames": []},
        {"action": "free_completed", "addr": 200, "size": 500, "frames": []},
        {"action": "alloc", "addr": 300, "size": 2000, "frames": frames(TORCH, HEAD)},
        {"action": "alloc", "addr": 400, "size": 700, "frames": frames(TORCH, ATTN, HEAD)},
        {"action": "free_requested", "addr": 300, "size": 2000, "frames": []},
        {"action": "free_completed", "addr": 300, "size": 2000, "frames": []},
        {"action": "alloc", "addr": 300, "size": 100, "frames": frames(TORCH)},
    ]
    blocks = [{"address": 100, "size": 1000, "state": "active_allocated", "frames": []},
              {"address": 300, "size": 100, "state": "active_allocated", "frames": frames(TORCH)},
              {"address": 400, "size": 700, "state": "active_allocated", "frames": frames(TORCH, ATTN, HEAD)},
              {"address": 500, "size": 4000, "state": "inactive", "frames": []}]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def test_the_peak_is_the_most_bytes_live_at_once_with_what_held_them():
    peak, live, truncated = memory_peak.live_at_peak(snapshot())
    assert peak == 1000 + 2000 + 700 and not truncated  # the old buffer was freed before the chunk came
    assert live == {100: (1000, "(no stack recorded)"), 300: (2000, "gspo/logprobs.py:120 chunked_logprobs"),
                    400: (700, "transformers/models/qwen3/modeling_qwen3.py:80 forward")}


def test_the_breakdown_lists_the_largest_first_with_shares():
    text = memory_peak.breakdown(snapshot())
    lines = text.splitlines()
    assert lines[0].startswith("peak allocated 0.00 GiB in 3 allocations")
    assert "54.1%" in lines[2] and "gspo/logprobs.py:120" in lines[2]  # 2,000 of 3,700 bytes
    assert "transformers/models/qwen3" in lines[4]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records the CUDA allocator")
def test_a_recorded_step_on_cuda_reports_its_peak(tmp_path):
    """On a GPU: a step that holds 64 MiB and 32 MiB at once reports at least that, named by this file's frame."""
    def step():
        a = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(32 * 2**20, dtype=torch.uint8, device="cuda")
        del a, b

    memory_peak.record(tmp_path / "m.txt", step)
    text = (tmp_path / "m.txt").read_text()
    assert float(text.splitlines()[1].split()[2]) >= 0.09  # "peak allocated 0.09 GiB in ...": 96 MiB at once
    assert "test_memory_peak.py" in text


def test_the_cpu_replay_counts_what_the_recording_allocated_and_ignores_older_frees():
    allocations = [(1, 500, -4000, "old"),  # memory from before the recording, freed in it: not counted
                   (2, 300, 2000, "head"), (3, 400, 700, "attention"), (4, 300, -2000, "head"),
                   (5, 300, 100, "torch")]
    peak, live = memory_peak.cpu_live_at_peak(allocations)
    assert peak == 2700 and live == {300: (2000, "head"), 400: (700, "attention")}


def test_a_recorded_step_on_the_cpu_reports_its_peak_by_frame(tmp_path):
    """On the CPU (torch.profiler's memory events): a step that holds 64 MiB and 32 MiB at once, then frees them and
    runs a small backward, reports at least 96 MiB, named by this file's function."""
    def step():
        a = torch.empty(64 * 2**20, dtype=torch.uint8)
        b = torch.empty(32 * 2**20, dtype=torch.uint8)
        del a, b
        torch.nn.Linear(64, 64)(torch.randn(8, 64, requires_grad=True)).sum().backward()

    memory_peak.record(tmp_path / "m.txt", step, device="cpu")
    lines = (tmp_path / "m.txt").read_text().splitlines()
    assert lines[1].startswith("peak growth 0.09") and " in 2 allocations" in lines[1]
    assert "test_memory_peak.py" in lines[3] and "step" in lines[3] and lines[3].split()[1] == "100.0%"

"""benchmarks/run.py's GPU report: the ratios of its JSON line and issue 12's target verdicts, from raw per-side
results (what `--save` writes and `--merge` reads), so that a GPU session reads them off instead of working them
out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
spec = importlib.util.spec_from_file_location("benchmark_run", SCRIPT)
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)

GIB = 2**30


def side(times: list[float], generation: list[float], peak_gib: float) -> dict:
    return {"times": times, "rollout": generation, "update": [t - g for t, g in zip(times, generation, strict=True)],
            "peak_gpu": int(peak_gib * GIB), "peak_device": int((peak_gib + 1) * GIB)}


def test_the_report_computes_the_ratios_and_the_targets_verdicts(tmp_path, capsys):
    dense = {"trl": side([12.0, 13.0], [10.8, 11.8], 27.0),  # medians: 12.5 s, update 1.2 s
             "gspo exact": side([4.0, 4.2], [3.1, 3.3], 30.0),  # update 0.9 s: 0.75 of TRL's
             "gspo fast": side([3.6, 3.8], [2.6, 2.8], 26.0)}  # 12.5 / 3.7 = 3.38×
    moe = {"trl": side([28.0], [26.0], 50.0), "gspo fast": side([5.0], [3.0], 45.0)}  # 5.6×
    (tmp_path / "dense.json").write_text(json.dumps({"dense": dense}))
    merged = run.merge_gpu_results({"moe": moe}, str(tmp_path / "moe.json"), str(tmp_path / "dense.json"))
    assert list(merged) == ["dense", "moe"] and json.loads((tmp_path / "moe.json").read_text()) == {"moe": moe}
    summary = run.print_gpu_report(merged)
    assert abs(summary["speedup_dense_gpu"] - 12.5 / 3.7) < 1e-9
    assert abs(summary["update_ratio_dense_gpu"] - 0.9 / 1.2) < 1e-9
    assert abs(summary["speedup_moe_gpu"] - 28.0 / 5.0) < 1e-9
    assert abs(summary["peak_gpu_ratio_dense_exact"] - 30.0 / 27.0) < 1e-9
    assert "update_ratio_moe_gpu" not in summary  # no exact side for the MoE model in this run
    lines = {line.split()[0]: line for line in run.target_lines(summary)}  # by JSON key
    assert lines["speedup_dense_gpu"].startswith("  speedup_dense_gpu ≥ 3 (") and lines["speedup_dense_gpu"].endswith(
        "): 3.378, met")
    assert lines["update_ratio_dense_gpu"].endswith("): 0.750, met")
    assert lines["speedup_moe_gpu"].endswith("): 5.600, met")
    assert lines["peak_gpu_ratio_dense_exact"].endswith("): 1.111, NOT met")
    assert lines["peak_gpu_ratio_dense_fast"].endswith("): 0.963, met")
    assert lines["update_ratio_dense_gpu_compiled"].endswith("): not measured in this run")


TINY_DENSE = {"tiny": ("Qwen3Config", {**run._GPU_COMMON, "vocab_size": 4096, "hidden_size": 128,
                                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "head_dim": 32, "intermediate_size": 256})}


# the dynamic loop is the CPU's default, which the rest of the suite runs: its GPU-mode row is in the slow suite
@pytest.mark.parametrize("decode", [pytest.param("dynamic", marks=pytest.mark.slow), "static",
                                    pytest.param("compiled", marks=pytest.mark.slow)])
def test_the_gpu_modes_gspo_sides_run_a_rollout_batch_on_the_cpu(tmp_path, decode):
    """`--device cuda`'s gspo workers ("gspo exact": the engine shares the float32 policy and samples under bf16
    autocast; "gspo fast": a bf16 engine, π_old from it) run end to end on the CPU with each decode loop: a model
    saved as the GPU mode saves its own (bf16 on disk), 2 prompts × 4 completions × 16 forced tokens, one warm-up and
    one measured batch, every completion of the fixed length (`compare_gpu` raises otherwise), a generation time and
    an update after it. What a GPU session's `bench` runs, so that a crash there is found here first (with
    transformers before 5.24 the exact side's static and compiled loops failed at their first call)."""
    paths = run.build_gpu_models(tmp_path, ["tiny"], TINY_DENSE, "cpu")
    results = run.compare_gpu(paths, 1, 2, 1, 1, shape=(2, 4, 16), device="cpu", decode=decode,
                              sides=["gspo exact", "gspo fast"])
    for name, result in results["tiny"].items():
        assert len(result["times"]) == len(result["rollout"]) == 1, name
        assert 0 < result["rollout"][0] < result["times"][0], name

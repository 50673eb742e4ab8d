"""benchmarks/run.py's GPU report: the ratios of its JSON line and issue 12's target verdicts, from raw per-side
results (what `--save` writes and `--merge` reads), so that a GPU session reads them off instead of working them
out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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

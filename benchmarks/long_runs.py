"""Measure the long-run features on the demo task: dynamic sampling vs none (≥ 3 seeds: held-out accuracy, the step
it first reaches a target, wall time), whether the collapse guard ever fires on normal demo runs (false alarms), and
the guard on a run pushed into collapse on purpose (GRPO at lr 3e-3: unguarded vs guarded).

    python benchmarks/long_runs.py --out runs/long_runs [--seeds 3] [--steps 400]

Every run is `gspo.trainer.train` on configs/demo.yaml with overrides; the table is printed and written to
OUT/long_runs.md, the numbers to OUT/summary.json. A finished run is reused when the script is run again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

from gspo.cli import demo_config_path
from gspo.config import load_config
from gspo.tracking import read_metrics
from gspo.trainer import RunCollapsed, train

COLLAPSE = ["algorithm.loss=grpo", "optim.lr=3e-3", "optim.warmup_steps=80", "trainer.checkpoint_every=5",
            "trainer.eval_every=10"]


def run(out: Path, overrides: list[str]) -> dict:
    """One training run (reused if OUT/summary.json exists); its summary plus its eval and metrics records."""
    if not (out / "summary.json").exists():
        cfg = load_config(demo_config_path(), [f"trainer.out={out}", "log.progress=false", *overrides])
        with contextlib.suppress(RunCollapsed):  # summary.json says so
            train(cfg, overwrite=True)
    summary = json.loads((out / "summary.json").read_text())
    evals = read_metrics(out / "eval.jsonl") if (out / "eval.jsonl").exists() else []
    metrics = read_metrics(out / "metrics.jsonl")
    guard = read_metrics(out / "guard.jsonl") if (out / "guard.jsonl").exists() else []
    return {"summary": summary, "evals": evals, "metrics": metrics, "guard_events": guard}


def first_step(evals: list[dict], target: float) -> int | None:
    """The first evaluated step whose held-out accuracy reaches `target` (None: never)."""
    return next((e["step"] for e in evals if e["heldout_accuracy"] >= target), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/long_runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--target", type=float, default=0.6, help="held-out accuracy whose first step is reported")
    args = p.parse_args()
    out = Path(args.out)
    arms = {"plain": [], "dynamic_sampling": ["rollout.dynamic_sampling=true"]}
    results: dict = {}
    for name, extra in arms.items():
        for seed in range(args.seeds):
            print(f"{name} seed {seed}", flush=True)
            results[f"{name}_s{seed}"] = run(out / f"{name}_s{seed}",
                                             [f"trainer.seed={seed}", f"trainer.steps={args.steps}", *extra])
    cold = out / "plain_s0" / "cold_start"
    forced = {}
    for name, extra in {"collapse_unguarded": ["trainer.guard.enabled=false"], "collapse_guarded": []}.items():
        print(name, flush=True)
        forced[name] = run(out / name, [f"model.name={cold}", "cold_start=null", "trainer.steps=60", *COLLAPSE, *extra])

    lines = [f"| arm | held-out accuracy after RL | best | first step ≥ {args.target:.0%} | wall s | prompts sampled "
             "per step | guard anomalies / rollbacks |", "|---|---|---|---|---|---|---|"]
    summary: dict = {}
    for name in arms:
        runs = [results[f"{name}_s{s}"] for s in range(args.seeds)]
        after = [r["summary"]["heldout_accuracy_after_rl"] for r in runs]
        best = [max(e["heldout_accuracy"] for e in r["evals"]) for r in runs]
        reach = [first_step(r["evals"], args.target) for r in runs]
        wall = [r["summary"]["wall_seconds"] for r in runs]
        sampled = [statistics.mean(m.get("dynamic_sampled_prompts", 32) for m in r["metrics"]) for r in runs]
        anomalies = sum(int(sum(m.get("guard_anomalies", 0) for m in r["metrics"])) for r in runs)
        rollbacks = sum(r["summary"]["guard"]["rollbacks"] for r in runs)
        summary[name] = {"after": after, "best": best, "first_step_to_target": reach, "wall_seconds": wall,
                         "prompts_sampled_per_step": sampled, "guard_anomalies": anomalies, "rollbacks": rollbacks}
        lines.append(f"| {name} | {statistics.mean(after):.1%} ± {statistics.stdev(after) if len(after) > 1 else 0:.1%}"
                     f" ({', '.join(f'{a:.1%}' for a in after)}) | {statistics.mean(best):.1%} | "
                     f"{', '.join(str(r) for r in reach)} | {statistics.mean(wall):.0f} | "
                     f"{statistics.mean(sampled):.1f} | {anomalies} / {rollbacks} |")
    lines += ["", "| forced collapse (GRPO, lr 3e-3) | status | held-out accuracy by step | rollbacks |",
              "|---|---|---|---|"]
    for name, r in forced.items():
        s = r["summary"]
        curve = ", ".join(f"{e['step']}: {e['heldout_accuracy']:.0%}" for e in r["evals"])
        guard = s.get("guard") or {}
        lines.append(f"| {name} | {s['status']} | {curve} | {guard.get('rollbacks', 0)} |")
        summary[name] = {"status": s["status"], "evals": r["evals"], "guard": guard,
                         "events": [{k: v for k, v in e.items() if k != "discarded"} for e in r["guard_events"]]}
    table = "\n".join(lines)
    print(table)
    (out / "long_runs.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

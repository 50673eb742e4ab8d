"""`gspo async-study`: synchronous vs asynchronous rollouts, and GSPO's tolerance to stale engine likelihoods (§5.4).

From one cold-start model (the demo's tiny MoE on 2-digit addition), with the same seeds, data and learner steps:

    sync               rollouts and updates alternate in one process (both CPU threads)
    async_s1/s2/s4     a rollout worker process generates while the learner trains (one thread each), batches up to
                       1 / 2 / 4 policy versions stale, partial rollouts on
all GSPO with π_old taken from the engine (`old_logprobs: rollout`, no recompute), and, under async_s2:

    grpo_s2            GRPO with the engine's likelihoods as π_old, uncorrected
    gspo_s2_corr       GSPO with π_old recomputed and the mismatch corrected (sequence TIS + geometric-mean mask)
    grpo_s2_corr       GRPO with π_old recomputed and the mismatch corrected (token TIS + MIS mask)

Each run is an ordinary `gspo train` folder under DIR/seed<k>/<method>/; finished runs (and the cold start) are reused
when the study is rerun into the same DIR with the same settings, and refused before any compute, naming the keys,
when made with others (`gspo.experiments.moe_study.reusable_run`). Outputs: DIR/summary.json, and the report
(async.md and async_accuracy.png) in REPORT_DIR, by default DIR itself (as `gspo compare` writes its report.md).
Time per learner step is the mean of `time_rollout + time_update` (the learner's wait for a batch plus its update)
over the steps after the first (which includes the worker's start-up); evaluations are not in it.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from gspo.config import load_config
from gspo.experiments.moe_study import (
    STUDY_OVERRIDES,
    build_cold_start,
    check_heldout,
    record_cold_start,
    reusable_cold_start,
    reusable_run,
)
from gspo.tracking import read_metrics

log = logging.getLogger("gspo.async_study")

ASYNC = ("rollout.mode=async", "trainer.threads=1", "rollout.worker_threads=1")
METHODS: dict[str, tuple[str, ...]] = {
    "sync": ("rollout.mode=sync", "trainer.threads=2", "algorithm.old_logprobs=rollout"),
    "async_s1": (*ASYNC, "rollout.max_staleness=1", "algorithm.old_logprobs=rollout"),
    "async_s2": (*ASYNC, "rollout.max_staleness=2", "algorithm.old_logprobs=rollout"),
    "async_s4": (*ASYNC, "rollout.max_staleness=4", "algorithm.old_logprobs=rollout"),
    "grpo_s2": (*ASYNC, "rollout.max_staleness=2", "algorithm.old_logprobs=rollout", "algorithm.loss=grpo"),
    "gspo_s2_corr": (*ASYNC, "rollout.max_staleness=2", "algorithm.old_logprobs=recompute",
                     "algorithm.mismatch=tis+mask"),
    "grpo_s2_corr": (*ASYNC, "rollout.max_staleness=2", "algorithm.old_logprobs=recompute", "algorithm.loss=grpo",
                     "algorithm.mismatch=tis+mask"),
}


@dataclass
class AsyncStudyOptions:
    """What `run_study` does: `seeds` × `METHODS` runs of `steps` learner steps into `out`, the report into
    `report_dir` (None: `out`, so that a study never replaces another folder's report unless asked to)."""

    out: Path
    report_dir: Path | None = None
    seeds: int = 3
    steps: int = 100
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Refuse, before any compute, what would fail only after the runs: no seed to average, a step time with no
        step after the first (the first includes the worker's start-up), a file where a folder goes."""
        self.out = Path(self.out)
        self.report_dir = self.out if self.report_dir is None else Path(self.report_dir)
        if self.seeds < 1:
            raise ValueError(f"async-study: --seeds must be >= 1, got {self.seeds}")
        if self.steps < 2:
            raise ValueError(f"async-study: --steps must be >= 2 (the step time is the mean over the steps after the "
                             f"first, which includes the rollout worker's start-up), got {self.steps}")
        for flag, path in (("--out", self.out), ("--report-dir", self.report_dir)):
            if path.exists() and not path.is_dir():
                raise ValueError(f"async-study: {flag} {path} is a file; name a folder")


def _run_overrides(opts: AsyncStudyOptions, seed: int, name: str, model: str) -> list[str]:
    return [*STUDY_OVERRIDES, f"trainer.steps={opts.steps}", "trainer.eval_every=25", "trainer.checkpoint_every=0",
            f"trainer.seed={seed}", *opts.overrides, *METHODS[name], "cold_start=null",
            f"trainer.out={opts.out / f'seed{seed}' / name}", f"model.name={model}"]


def run_numbers(run_dir: Path) -> dict[str, Any]:
    """A run's step time, staleness and accuracy from its metrics.jsonl / eval.jsonl."""
    metrics, evals = read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "eval.jsonl")
    steps = [r["time_rollout"] + r["time_update"] for r in metrics[1:]]
    return {"step_seconds": statistics.mean(steps), "final_accuracy": evals[-1]["heldout_accuracy"],
            "rollout_share": statistics.mean(r["time_rollout"] for r in metrics[1:]) / statistics.mean(steps),
            "cold_start_accuracy": evals[0]["heldout_accuracy"],
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in metrics),
            "dropped_stale": metrics[-1].get("rollout_dropped_stale", 0.0),
            "eval_step": [r["step"] for r in evals], "heldout_accuracy": [r["heldout_accuracy"] for r in evals]}


def run_study(opts: AsyncStudyOptions) -> dict:
    """Run (or finish) every (seed, method), then write DIR/summary.json and the report; return the summary."""
    from gspo.trainer import train

    base = Path(str(resources.files("gspo") / "configs" / "demo.yaml"))  # the packaged demo config
    cold_cfg = load_config(base, [*STUDY_OVERRIDES, "trainer.seed=0", "trainer.threads=2", *opts.overrides])
    cold_dir = opts.out / "cold_start"
    configs = {}
    for seed in range(opts.seeds):  # every run's config, validated before any compute
        for name in METHODS:
            check_heldout(load_config(base, _run_overrides(opts, seed, name, cold_cfg.model.name)), "async-study")
            configs[(seed, name)] = load_config(base, _run_overrides(opts, seed, name, str(cold_dir)))
    # what an earlier call left: reused only when made with these settings (checked before any compute)
    reuse_cold = reusable_cold_start(cold_dir, cold_cfg, "async-study")
    reuse = {(seed, name): reusable_run(opts.out / f"seed{seed}" / name, cfg, "async-study", resume=False)
             for (seed, name), cfg in configs.items()}
    opts.out.mkdir(parents=True, exist_ok=True)
    if not reuse_cold:
        build_cold_start(cold_cfg, cold_dir)
        record_cold_start(cold_dir, cold_cfg)
    numbers: dict[str, dict[int, dict]] = {name: {} for name in METHODS}
    for (seed, name), cfg in configs.items():
        run_dir = opts.out / f"seed{seed}" / name
        if not reuse[(seed, name)]:
            log.info("%s, seed %d", name, seed)
            t0 = time.perf_counter()
            train(cfg, overwrite=True)
            log.info("  %.0f s", time.perf_counter() - t0)
        numbers[name][seed] = run_numbers(run_dir)
    summary = {"study": {"seeds": opts.seeds, "steps": opts.steps, "overrides": opts.overrides}}
    for name, per_seed in numbers.items():
        runs = list(per_seed.values())
        summary[name] = {key: _mean_std([r[key] for r in runs])
                         for key in ("step_seconds", "final_accuracy", "cold_start_accuracy", "staleness_mean",
                                     "dropped_stale", "rollout_share")}
        summary[name]["per_seed"] = per_seed
    sync_time = summary["sync"]["step_seconds"]["mean"]
    for name in METHODS:
        summary[name]["speedup_vs_sync"] = sync_time / summary[name]["step_seconds"]["mean"]
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(opts, summary)
    return summary


def _mean_std(values: list[float]) -> dict[str, float | None]:
    """Mean and sample standard deviation over seeds; the deviation is None (not 0) for one seed: it has none."""
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else None}


def format_mean_std(entry: dict[str, float | None], pct: bool = False) -> str:
    """"mean ± std" of a `_mean_std` entry ("± n/a (one seed)" without a deviation), as percentages with `pct`."""
    fmt = "{:.1%}" if pct else "{:.3f}"
    std = "n/a (one seed)" if entry["std"] is None else fmt.format(entry["std"])
    return f"{fmt.format(entry['mean'])} ± {std}"


def write_report(opts: AsyncStudyOptions, summary: dict) -> Path:
    """REPORT_DIR/async.md (the table) and REPORT_DIR/async_accuracy.png (held-out accuracy vs step, seed means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts.report_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in METHODS:
        per_seed = list(summary[name]["per_seed"].values())
        steps = per_seed[0]["eval_step"]
        ax.plot(steps, [statistics.mean(r["heldout_accuracy"][i] for r in per_seed) for i in range(len(steps))],
                label=name, marker="o", markersize=3)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out accuracy (mean of seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plot = opts.report_dir / "async_accuracy.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)

    def cell(name: str, key: str, pct: bool = False) -> str:
        return format_mean_std(summary[name][key], pct)

    lines = [f"# Asynchronous rollouts: measured ({summary['study']['seeds']} seeds, {summary['study']['steps']} "
             "learner steps each)", "",
             "Produced by `gspo async-study` (module docstring of `gspo.experiments.async_study`: methods and "
             "what is timed). Mean ± standard deviation over seeds.", "",
             "| method | s / learner step | vs sync | held-out accuracy after RL | cold start | mean staleness |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in METHODS:
        lines.append(f"| {name} | {cell(name, 'step_seconds')} | {summary[name]['speedup_vs_sync']:.2f}× | "
                     f"{cell(name, 'final_accuracy', True)} | {cell(name, 'cold_start_accuracy', True)} | "
                     f"{summary[name]['staleness_mean']['mean']:.2f} |")
    share = summary["sync"]["rollout_share"]["mean"]
    lines += ["", f"In the sync runs generation is {share:.0%} of a learner step and the update the rest. Overlapping "
              f"them can at best hide the generation: a bound of {1 / (1 - share):.2f}× on the time per step for "
              "this workload on this machine (the async learner also has one CPU thread instead of two).",
              "", f"![held-out accuracy]({plot.name})", ""]
    path = opts.report_dir / "async.md"
    path.write_text("\n".join(lines))
    return path

"""`gspo compare`: the MoE stability study of GSPO §5.3–5.4 (arXiv 2507.18071), at toy scale on CPU.

From one cold-start model, with identical seeds, data and compute, it trains

    gspo        GSPO (sequence ratio, ε = 3e-4 / 4e-4), no routing replay
    grpo        GRPO (token ratio, ε = 0.2 / 0.27), no routing replay
    grpo_r2     GRPO with Routing Replay (R2): the π_θ forwards use the experts of the π_old forward
    gspo_token  GSPO-token (Eq. 13) with sequence-level advantages, which §4.3 says equals GSPO

and, with `precision=True` (the default), the §5.4 precision-tolerance runs: rollouts by a bf16 copy of the fp32
trainer, with π_old taken from the engine's log-probabilities (`old_logprobs=rollout`) or recomputed by the trainer,
for GSPO and GRPO. Each run is an ordinary `gspo train` run folder under DIR/seed<k>/<method>/.

Outputs: DIR/summary.json (per method: per seed and averaged final / best held-out accuracy, mean token clip
fraction, mean expert volatility, counts of non-finite and collapsed runs; the precision figures; the verdict on each
of the paper's claims) and DIR/report.md with PNG plots next to it. The verdicts are computed from the numbers.

Cold start: by default one SFT model, built once (DIR/cold_start/, from the first seed) and shared by every seed and
method, so the seeds vary the RL data order and sampling but not the starting point — the comparison is paired and
the SFT cost is paid once. `cold_start="per-seed"` builds one per seed (DIR/seed<k>/cold_start/), so seed variance
also covers the starting model. Finished runs (and cold starts) are reused when the study is rerun into the same DIR
with the same settings (`reusable_run`, `reusable_cold_start`); a run or cold start made with other settings is
refused before any compute, naming the keys that differ, since its numbers would be reported under the new settings.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gspo.config import Config, ConfigError, config_diff, config_to_dict, load_config, validate_config
from gspo.moe import replay_support_error
from gspo.objectives import default_eps
from gspo.runfolder import RESUMABLE
from gspo.tracking import read_metrics

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------- the study

STUDY_OVERRIDES: tuple[str, ...] = (
    # On top of the demo config (tiny Qwen3-MoE, 2-digit addition, cold-start SFT to loss 0.45, lr 3e-4): a shorter RL
    # phase with half the batch, so that 4 methods × 3 seeds + 4 precision runs × 3 seeds fit in 30 min on 2 busy CPU
    # cores (~25-45 s per run). lr 1e-3 was tried too: every method first lost accuracy, so the demo's lr is kept.
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "algorithm.minibatches=4",  # 4 updates per rollout batch: 3 of them off-policy, where routing drift shows
    "optim.lr=3e-4",
    "optim.warmup_steps=20",  # optimizer steps: the first 5 RL steps
    "trainer.steps=60",
    "trainer.eval_every=10",
    "data.eval_size=200",
    "trainer.checkpoint_every=0",
    "log.tensorboard=false",
    "log.progress=false",
)

METHODS: dict[str, tuple[str, ...]] = {
    "gspo": ("algorithm.loss=gspo",),
    "grpo": ("algorithm.loss=grpo",),
    "grpo_r2": ("algorithm.loss=grpo", "algorithm.routing_replay=r2"),
    "gspo_token": ("algorithm.loss=gspo_token",),
}
"""The four compared methods: objective (with its paper's ε) and routing replay."""

PRECISION_METHODS: dict[str, tuple[str, ...]] = {
    f"{loss}_bf16_{source}": (f"algorithm.loss={loss}", "rollout.dtype=bfloat16", f"algorithm.old_logprobs={source}")
    for loss in ("gspo", "grpo")
    for source in ("rollout", "recompute")
}
"""§5.4: a bf16 rollout engine for the fp32 trainer; π_old from the engine (`rollout`) or the trainer (`recompute`)."""

COLLAPSE_FRACTION = 0.5
"""A run collapsed when its final held-out accuracy is below this fraction of the cold-start accuracy."""


@dataclass
class StudyOptions:
    """What `run_study` does. `base_config` None = the packaged demo config; `overrides` apply after the study's."""

    out: Path
    seeds: int = 3
    steps: int | None = None
    precision: bool = True
    threads: int = 1  # one intra-op thread: with other jobs on the cores, 2 threads measured ~4× slower per run
    cold_start: str = "shared"  # "shared" | "per-seed"
    base_config: Path | None = None
    overrides: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"compare: --out {self.out} is a file; name a folder for the study (new or a study's)")
        if self.seeds < 1:
            raise ValueError(f"compare: --seeds must be >= 1, got {self.seeds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"compare: --steps must be >= 1, got {self.steps}")
        if self.threads < 1:
            raise ValueError(f"compare: --threads must be >= 1, got {self.threads}")
        if self.cold_start not in ("shared", "per-seed"):
            raise ValueError(f"compare: cold_start must be 'shared' or 'per-seed', got {self.cold_start!r}")

    def methods(self) -> dict[str, tuple[str, ...]]:
        return {**METHODS, **(PRECISION_METHODS if self.precision else {})}


def _base_overrides(opts: StudyOptions, seed: int) -> list[str]:
    extra = [f"trainer.steps={opts.steps}"] if opts.steps is not None else []
    return [*STUDY_OVERRIDES, *extra, f"trainer.seed={seed}", f"trainer.threads={opts.threads}", *opts.overrides]


def _base_path(opts: StudyOptions) -> Path:
    if opts.base_config is not None:
        return Path(opts.base_config)
    return Path(str(resources.files("gspo") / "configs" / "demo.yaml"))  # the packaged demo config, as `gspo demo`'s


def study_configs(opts: StudyOptions) -> tuple[dict[int, Config], dict[tuple[int, str], list[str]]]:
    """Validate every run's config before any compute. Returns the cold-start config per seed that builds one, and
    the override list of every (seed, method) run (its model is the cold start, its cold_start section off). Raises
    ValueError for a run without held-out evaluation (the study compares held-out accuracies)."""
    base = _base_path(opts)
    cold: dict[int, Config] = {}
    runs: dict[tuple[int, str], list[str]] = {}
    for seed in range(opts.seeds):
        overrides = _base_overrides(opts, seed)
        cfg = load_config(base, overrides)
        if cfg.cold_start is None:
            raise ValueError("compare: the base config has no cold_start section; the study starts RL from a "
                             "cold-start SFT model (see the demo config)")
        if opts.precision and (cfg.model.dtype != "float32" or cfg.trainer.mixed_precision is not None):
            mp = cfg.trainer.mixed_precision
            raise ValueError(f"compare: the precision runs (§5.4) measure a bf16 rollout engine against a float32 "
                             f"trainer, but the base config's trainer computes in "
                             f"{f'{mp} autocast over ' if mp else ''}{cfg.model.dtype}: its figures would be labelled "
                             f"fp32 and mean something else. Run with --no-precision, or a float32 trainer "
                             f"(model.dtype=float32, trainer.mixed_precision unset)")
        if opts.cold_start == "per-seed" or seed == 0:
            cold[seed] = cfg
        for name, method in opts.methods().items():
            common = [*overrides, *method, "cold_start=null", f"trainer.out={opts.out / f'seed{seed}' / name}"]
            run = load_config(base, [*common, f"model.name={cfg.model.name}"])  # the cold start's folder: not yet
            check_heldout(run, "compare")
            replay = run.algorithm.routing_replay  # a dense model ran the cold start and two methods before this
            if seed == 0 and (why := replay_support_error(run.model.name, replay, run.model.trust_remote_code)):
                raise ValueError(f"compare: method {name!r} (algorithm.routing_replay={replay}): {why}")
            runs[(seed, name)] = [*common, f"model.name={_cold_start_dir(opts, seed)}"]
    return cold, runs


def check_heldout(cfg: Config, command: str) -> None:
    """Refuse a study run that would hold out no rows: the study reads each run's held-out accuracy (eval.jsonl),
    which such a run never writes, so it would fail only after every run trained."""
    d = cfg.data
    if d.eval_split is None and d.eval_path is None and d.eval_fraction is None:
        raise ValueError(f"{command}: the study needs held-out evaluation, but data.eval_split is null and no "
                         "data.eval_path / data.eval_fraction is set: leave data.eval_split on, or hold rows out")


# Keys a study run may differ in from its saved config and still be reused: where the study's folder is (a moved or
# differently spelled --out) and the cold-start folder it starts from (checked on its own, `reusable_cold_start`).
_LOCATION_KEYS = ("trainer.out", "model.name")
# What a cold start's model depends on (its study_config.yaml is compared on these).
_COLD_START_KEYS = ("model.*", "data.*", "cold_start.*", "trainer.seed", "trainer.mixed_precision")
COLD_START_RECORD = "study_config.yaml"
"""The cold-start config a study saves next to the cold-start model, to know on a rerun what built it."""


def _saved_config(path: Path) -> dict | None:
    """The config dict saved at `path` (a run's config.yaml), with defaults filled in and derived keys resolved;
    None when there is none."""
    if not path.exists():
        return None
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
        return config_to_dict(validate_config(saved), resolved=True) if isinstance(saved, dict) else {}
    except (yaml.YAMLError, UnicodeDecodeError, ConfigError):
        return {}  # unreadable: differs in every key


def _differing(saved: dict, cfg: Config, keep: Sequence[str] = (), ignore: Sequence[str] = ()) -> list[str]:
    """The dotted keys in which `saved` differs from `cfg`: only those matching `keep` (default all), not those
    matching `ignore`."""
    import fnmatch

    diff = config_diff(saved, config_to_dict(cfg, resolved=True))
    return [k for k in diff if (not keep or any(fnmatch.fnmatchcase(k, p) for p in keep))
            and not any(fnmatch.fnmatchcase(k, p) for p in ignore)]


def _refuse(command: str, where: Path, what: str, keys: list[str]) -> ValueError:
    shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")
    return ValueError(f"{command}: {where} holds a {what} made with other settings (its saved config differs in "
                      f"{shown}): reusing it would report its numbers under this call's settings. Rerun with the "
                      f"settings it was made with, study into another --out, or delete {where} to redo it")


def reusable_run(run_dir: Path, cfg: Config, command: str, *, resume: bool = True) -> bool:
    """True when `run_dir` holds a finished run (summary.json) made with `cfg`, to be reused; False when it holds
    none, or an unfinished one (which the study resumes with `cfg`, or with `resume=False` starts over). Raises
    ValueError naming the differing keys when a finished run's saved config.yaml differs from `cfg` (but for
    `_LOCATION_KEYS`), or, with `resume`, an unfinished one's in a key a resume may not change
    (`gspo.runfolder.RESUMABLE`)."""
    finished = (run_dir / "summary.json").exists()
    if not finished and not resume:
        return False
    saved = _saved_config(run_dir / "config.yaml")
    if saved is None:
        if finished:
            raise ValueError(f"{command}: {run_dir} holds a finished run without its config.yaml: the settings it "
                             f"was made with are unknown; study into another --out, or delete {run_dir} to redo it")
        return False
    keys = _differing(saved, cfg, ignore=_LOCATION_KEYS if finished else (*_LOCATION_KEYS, *RESUMABLE))
    if keys:
        raise _refuse(command, run_dir, "finished run" if finished else "started run", keys)
    return finished


def reusable_cold_start(target: Path, cfg: Config, command: str) -> bool:
    """True when `target` holds a finished cold start (sft.json) built with `cfg`'s model, data and cold_start
    settings (its `COLD_START_RECORD`), to be reused; False when it holds none. Raises ValueError naming the keys
    that differ. A cold start without the record (made before studies saved one) is reused with a warning."""
    if not (target / "sft.json").exists():
        return False
    saved = _saved_config(target / COLD_START_RECORD)
    if saved is None:
        log.warning("%s has no %s: reusing it without checking the settings it was built with", target,
                    COLD_START_RECORD)
        return True
    keys = _differing(saved, cfg, keep=_COLD_START_KEYS, ignore=("trainer.out",))
    if keys:
        raise _refuse(command, target, "cold start", keys)
    return True


def record_cold_start(target: Path, cfg: Config) -> None:
    """Save the config that built the cold start in `target` (`COLD_START_RECORD`), for `reusable_cold_start`."""
    (target / COLD_START_RECORD).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _cold_start_dir(opts: StudyOptions, seed: int) -> Path:
    return opts.out / ("cold_start" if opts.cold_start == "shared" else f"seed{seed}/cold_start")


def build_cold_start(cfg: Config, target: Path) -> dict:
    """SFT the configured model once into `target` (reused when already complete), as `gspo train` would: on the
    device `trainer.device` gives one process."""
    import torch

    from gspo.checkpoint import set_seed
    from gspo.data import load_data
    from gspo.models import load_model
    from gspo.parallel import resolve_device
    from gspo.sft import cold_start

    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    set_seed(cfg.trainer.seed)
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                                  seed=cfg.trainer.seed, attn_implementation=cfg.model.attn_implementation)
    model = model.to(resolve_device(cfg.trainer.device))
    rows = load_data(cfg.data, cfg.trainer.seed).train
    target.parent.mkdir(parents=True, exist_ok=True)
    return cold_start(cfg, target.parent, model, tokenizer, rows)  # writes target.parent / "cold_start"


def run_study(opts: StudyOptions) -> dict:
    """Run (or finish) the study into opts.out; write summary.json, report.md and the plots; return the summary."""
    from gspo.trainer import train

    wall0 = time.perf_counter()
    cold_cfgs, runs = study_configs(opts)
    base = _base_path(opts)
    configs = {key: load_config(base, overrides) for key, overrides in runs.items()}
    # what an earlier call left in opts.out: reused only when made with these settings, checked before any compute
    reuse_cold = {seed: reusable_cold_start(_cold_start_dir(opts, seed), cfg, "compare")
                  for seed, cfg in cold_cfgs.items()}
    reuse = {key: reusable_run(opts.out / f"seed{key[0]}" / key[1], cfg, "compare") for key, cfg in configs.items()}
    opts.out.mkdir(parents=True, exist_ok=True)
    timings_path = opts.out / "timings.json"  # seconds per cold start and run, kept across resumed calls
    timings: dict[str, float] = json.loads(timings_path.read_text()) if timings_path.exists() else {}

    def timed(key: str, fn, *args, **kwargs) -> Any:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        timings[key] = time.perf_counter() - t0
        timings_path.write_text(json.dumps(timings, indent=2))
        return result

    for seed, cfg in cold_cfgs.items():
        target = _cold_start_dir(opts, seed)
        if reuse_cold[seed]:
            log.info("reusing cold start %s", target)
            continue
        log.info("cold start SFT for seed %d", seed)
        timed(str(target.relative_to(opts.out)), build_cold_start, cfg, target)
        record_cold_start(target, cfg)
    for i, (seed, name) in enumerate(runs):
        run_dir = opts.out / f"seed{seed}" / name
        if reuse[(seed, name)]:
            log.info("reusing finished run %s", run_dir)
            continue
        log.info("run %d/%d: %s, seed %d", i + 1, len(runs), name, seed)
        timed(f"seed{seed}/{name}", train, configs[(seed, name)], resume=(run_dir / "config.yaml").exists())
    summary = summarize(opts, runs, timings)
    summary["study"]["wall_seconds_this_call"] = time.perf_counter() - wall0
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False, default=_json_default))
    write_report(opts.out, summary)
    return summary


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON-serialisable: {value!r}")


# ---------------------------------------------------------------------------------------------- reading the runs


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values: Sequence[Any]) -> float | None:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else None


def run_numbers(run_dir: Path) -> dict[str, Any]:
    """One run's numbers from its metrics.jsonl / eval.jsonl.

    non_finite: some update was skipped for a non-finite loss or gradient, or a logged loss / reward is non-finite.
    collapsed: the final held-out accuracy is below COLLAPSE_FRACTION × the cold-start (step 0) accuracy."""
    metrics = read_metrics(run_dir / "metrics.jsonl")
    evals = read_metrics(run_dir / "eval.jsonl")
    if not metrics or not evals:
        raise ValueError(f"compare: {run_dir} has no metrics or no held-out evaluations")
    acc = {r["step"]: r["heldout_accuracy"] for r in evals}
    cold, final = acc.get(0), evals[-1]["heldout_accuracy"]
    after = [v for s, v in acc.items() if s > 0]
    non_finite = any(r.get("skipped_updates") or any(r.get(k) is None for k in ("loss", "reward_mean"))
                     for r in metrics)
    return {
        "cold_start_accuracy": cold,
        "final_accuracy": final,
        "best_accuracy": max(after) if after else final,
        "mean_accuracy_during_rl": _mean(after),  # area under the held-out curve / number of evaluations
        "reward_mean": _mean([r.get("reward_mean") for r in metrics]),
        "clip_frac_tokens": _mean([r.get("clip_frac_tokens") for r in metrics]),
        "clip_frac_tokens_first_mb": _mean([r.get("clip_frac_tokens_first_mb") for r in metrics]),
        "expert_volatility": _mean([r.get("expert_volatility") for r in metrics]),
        "precision_ratio_std_token": _mean([r.get("precision_ratio_std_token") for r in metrics]),
        "precision_ratio_std_seq": _mean([r.get("precision_ratio_std_seq") for r in metrics]),
        "precision_ratio_std_token_step1": metrics[0].get("precision_ratio_std_token"),
        "precision_ratio_std_seq_step1": metrics[0].get("precision_ratio_std_seq"),
        "non_finite": bool(non_finite),
        "collapsed": bool(cold is not None and final is not None and final < COLLAPSE_FRACTION * cold),
        "steps": len(metrics),
        "curves": {
            "step": [r["step"] for r in metrics],
            "reward_mean": [r.get("reward_mean") for r in metrics],
            "clip_frac_tokens": [r.get("clip_frac_tokens") for r in metrics],
            "expert_volatility": [r.get("expert_volatility") for r in metrics],
            "eval_step": [r["step"] for r in evals],
            "heldout_accuracy": [r["heldout_accuracy"] for r in evals],
        },
    }


_AVERAGED = ("cold_start_accuracy", "final_accuracy", "best_accuracy", "mean_accuracy_during_rl", "reward_mean",
             "clip_frac_tokens", "clip_frac_tokens_first_mb", "expert_volatility", "precision_ratio_std_token",
             "precision_ratio_std_seq", "precision_ratio_std_token_step1", "precision_ratio_std_seq_step1")


def aggregate(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample std over seeds of every number, and the failure counts."""
    mean, std = {}, {}
    for key in _AVERAGED:
        values = _finite([r[key] for r in per_seed.values()])
        mean[key] = sum(values) / len(values) if values else None
        std[key] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
    non_finite = sum(r["non_finite"] for r in per_seed.values())
    collapsed = sum(r["collapsed"] for r in per_seed.values())
    failed = sum(r["non_finite"] or r["collapsed"] for r in per_seed.values())
    return {"mean": mean, "std": std, "non_finite_runs": non_finite, "collapsed_runs": collapsed,
            "failed_runs": failed, "runs": len(per_seed)}


def summarize(opts: StudyOptions, runs: dict[tuple[int, str], list[str]], timings: dict[str, float]) -> dict[str, Any]:
    """summary.json's content: one entry per method (per seed and averaged), the study settings, the precision
    figures and the claim verdicts."""
    names = list(opts.methods())
    per_method: dict[str, dict[int, dict]] = {n: {} for n in names}
    for seed, name in runs:
        per_method[name][seed] = run_numbers(opts.out / f"seed{seed}" / name)
    summary: dict[str, Any] = {}
    for name in names:
        per_seed = per_method[name]
        agg = aggregate(per_seed)
        summary[name] = {
            **agg.pop("mean"),
            **agg,
            "per_seed": {str(s): {k: v for k, v in r.items() if k != "curves"} for s, r in sorted(per_seed.items())},
            "curves": {str(s): r["curves"] for s, r in sorted(per_seed.items())},
        }
    cfg = load_config(_base_path(opts), runs[(0, names[0])])
    base = load_config(_base_path(opts), _base_overrides(opts, 0))
    task = base.data.task or base.data.path
    summary["study"] = {
        "seeds": opts.seeds,
        "methods": names,
        "cold_start": opts.cold_start,
        "steps": cfg.trainer.steps,
        "completions_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        "minibatches": cfg.algorithm.minibatches,
        "model": base.model.name,
        "task": f"{task} {base.data.task_options}" if base.data.task_options else task,
        "eval_size": cfg.data.eval_size,
        "threads": opts.threads,
        "overrides": [*STUDY_OVERRIDES, *([f"trainer.steps={opts.steps}"] if opts.steps else []), *opts.overrides],
        "collapse_rule": f"final held-out accuracy < {COLLAPSE_FRACTION} × cold-start accuracy",
        "wall_seconds_total": sum(timings.values()),
        "wall_seconds": timings,
    }
    summary["claims"] = claims(summary, names)
    return summary


# ---------------------------------------------------------------------------------------------------- the claims


@dataclass(frozen=True)
class Comparison:
    """Paired (same seed) difference a − b of a per-seed number: mean, standard error, and a verdict at ±2 SE."""

    mean: float
    se: float
    n: int

    @property
    def sign(self) -> int:
        """+1 if a > b beyond 2 standard errors, −1 if a < b beyond them, 0 if within (or a single seed)."""
        if self.n < 2:
            return 0
        margin = 2 * self.se
        return 1 if self.mean > margin else -1 if self.mean < -margin else 0


def paired(summary: dict, a: str, b: str, key: str) -> Comparison | None:
    """Compare methods `a` and `b` on `key`, paired by seed."""
    sa, sb = summary[a]["per_seed"], summary[b]["per_seed"]
    diffs = [sa[s][key] - sb[s][key] for s in sa if s in sb and sa[s][key] is not None and sb[s][key] is not None]
    if not diffs:
        return None
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return Comparison(sum(diffs) / len(diffs), se, len(diffs))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _acc_verdict(c: Comparison | None, better: str, worse: str, *, no_worse: bool = False) -> tuple[str, str]:
    """(verdict, evidence) for "`better` is better than `worse`" (or, with no_worse, "not worse"). One seed has no
    standard error, so it can neither show a difference nor its absence: "cannot be judged", never "holds"."""
    if c is None:
        return "not measured", ""
    if c.n < 2:
        return ("cannot be judged (one seed: no standard error; run --seeds 2 or more)",
                f"held-out accuracy averaged over the RL evaluations, {better} − {worse} = {100 * c.mean:+.1f} points "
                "on one seed")
    evidence = (f"held-out accuracy averaged over the RL evaluations, {better} − {worse} = {100 * c.mean:+.1f} points "
                f"± {100 * c.se:.1f} (paired SE over {c.n} seeds)")
    if c.sign > 0:
        return "holds", evidence
    if c.sign < 0:
        return "does not hold", evidence
    return ("holds (no significant difference)" if no_worse else "inconclusive (within seed noise)"), evidence


def claims(summary: dict, names: Sequence[str]) -> list[dict[str, str]]:
    """Each of the paper's claims this study can test, with a verdict computed from the numbers."""
    out: list[dict[str, str]] = []
    m = {n: summary[n] for n in names}
    key = "mean_accuracy_during_rl"

    g, r = m["gspo"]["clip_frac_tokens"], m["grpo"]["clip_frac_tokens"]
    if g is not None and r is not None:
        ratio = g / r if r > 0 else math.inf
        verdict = ("cannot be judged (neither clipped a token: no ratio)" if g == r == 0 else "holds" if ratio >= 100
                   else "partly holds (one order of magnitude, not two)" if ratio >= 10 else "does not hold")
        shown = "GRPO clipped none" if r == 0 else f"ratio {ratio:.0f}×"
        out.append({"claim": "GSPO clips about two orders of magnitude more tokens than GRPO (paper: ~15% vs ~0.13%)",
                    "verdict": verdict,
                    "evidence": f"mean token clip fraction GSPO {_pct(g)} vs GRPO {_pct(r)}: {shown}"})

    v, e = _acc_verdict(paired(summary, "gspo", "grpo", key), "gspo", "grpo")
    out.append({"claim": "GSPO trains more efficiently than GRPO for the same compute (despite clipping more)",
                "verdict": v, "evidence": e})

    vols = {n: m[n]["expert_volatility"] for n in ("gspo", "grpo", "grpo_r2") if m[n]["expert_volatility"] is not None}
    if vols:
        mean_vol = sum(vols.values()) / len(vols)
        out.append({"claim": "After a gradient update, a noticeable share of the experts activated for the same "
                             "rollout changes (paper: ~10% for Qwen3-30B-A3B)",
                    "verdict": "holds" if mean_vol >= 0.01 else "does not hold (routing is nearly static)",
                    "evidence": "expert volatility after the step's off-policy updates: "
                                + ", ".join(f"{n} {_pct(x)}" for n, x in vols.items())})

    c = paired(summary, "grpo_r2", "grpo", key)
    v, e = _acc_verdict(c, "grpo_r2", "grpo")
    fails = f"; failed runs GRPO {m['grpo']['failed_runs']}/{m['grpo']['runs']}, " \
            f"GRPO+R2 {m['grpo_r2']['failed_runs']}/{m['grpo_r2']['runs']}"
    if m["grpo"]["failed_runs"] > m["grpo_r2"]["failed_runs"] and v.startswith("inconclusive"):
        v = "holds (GRPO fails more often without R2)"
    out.append({"claim": "GRPO on an MoE model needs Routing Replay: without it training is unstable or worse",
                "verdict": v, "evidence": e + fails})

    v, e = _acc_verdict(paired(summary, "gspo", "grpo_r2", key), "gspo", "grpo_r2", no_worse=True)
    if m["gspo"]["failed_runs"]:
        v = f"does not hold ({m['gspo']['failed_runs']} GSPO runs failed without replay)"
    out.append({"claim": "GSPO needs no Routing Replay: without it, it does at least as well as GRPO with R2",
                "verdict": v, "evidence": e})

    c = paired(summary, "gspo_token", "gspo", key)
    v, e = _acc_verdict(c, "gspo_token", "gspo", no_worse=True)
    if c is not None and c.sign != 0:
        v = "does not hold (the two differ beyond seed noise)"
    out.append({"claim": "GSPO-token with sequence-level advantages behaves as GSPO (§4.3)", "verdict": v,
                "evidence": e})

    if "gspo_bf16_rollout" in m:
        out.extend(_precision_claims(summary, m, key))
    return out


def _precision_claims(summary: dict, m: dict, key: str) -> list[dict[str, str]]:
    out = []
    gs, gt = m["gspo_bf16_recompute"]["precision_ratio_std_seq"], m["gspo_bf16_recompute"]["precision_ratio_std_token"]
    eps_gspo, eps_grpo = default_eps("gspo")[1], default_eps("grpo")[1]
    if gs is not None and gt is not None:
        out.append({"claim": "With a lower-precision engine, the sequence ratio s_i is less noisy than the token "
                             "ratios w_{i,t} (§5.4: sequence likelihoods tolerate precision differences)",
                    "verdict": "holds" if gs < gt else "does not hold",
                    "evidence": f"bf16 engine vs fp32 trainer, same weights: std(s_i) = {gs:.2e}, std(w_i,t) = "
                                f"{gt:.2e}; relative to each objective's ε_high: std(s_i) = {gs / eps_gspo:.1f}× "
                                f"GSPO's {eps_gspo:g}, std(w_i,t) = {gt / eps_grpo:.3f}× GRPO's {eps_grpo:g}"})
    for loss in ("gspo", "grpo"):
        v, e = _acc_verdict(paired(summary, f"{loss}_bf16_rollout", f"{loss}_bf16_recompute", key),
                            f"{loss}_bf16_rollout", f"{loss}_bf16_recompute", no_worse=True)
        clip = m[f"{loss}_bf16_rollout"]["clip_frac_tokens_first_mb"]
        out.append({"claim": f"{loss.upper()} can take π_old from the bf16 engine's likelihoods (old_logprobs=rollout) "
                             f"instead of recomputing them" + (" (§5.4)" if loss == "gspo" else " (not claimed)"),
                    "verdict": v,
                    "evidence": f"{e}; tokens clipped in the on-policy minibatch by precision noise alone: "
                                f"{_pct(clip)}"})
    return out


# ------------------------------------------------------------------------------------------------ report & plots

_PLOTS = (
    ("reward.png", "reward_mean", "training reward (mean over the step's completions)", False),
    ("heldout_accuracy.png", "heldout_accuracy", "held-out accuracy (greedy)", False),
    ("clip_fraction.png", "clip_frac_tokens", "fraction of clipped tokens (log scale; cf. the paper's Fig. 2)", True),
    ("expert_volatility.png", "expert_volatility", "expert volatility after the step's updates", False),
)


def _mean_curve(curves: dict[str, dict], x_key: str, y_key: str) -> tuple[list[int], list[float], list[float],
                                                                           list[float]]:
    """Per x: mean, min and max over seeds of y (seeds lacking a point or holding null are skipped)."""
    points: dict[int, list[float]] = {}
    for c in curves.values():
        for x, y in zip(c[x_key], c[y_key], strict=True):
            if y is not None and math.isfinite(y):
                points.setdefault(x, []).append(y)
    xs = sorted(points)
    return xs, [sum(points[x]) / len(points[x]) for x in xs], [min(points[x]) for x in xs], \
        [max(points[x]) for x in xs]


def plot_methods(summary: dict, names: Sequence[str], y_key: str, path: Path, title: str, log_y: bool) -> Path | None:
    """One line per method (mean over seeds, band = min..max); None if no method has the metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    x_key = "eval_step" if y_key == "heldout_accuracy" else "step"
    curves = {name: _mean_curve(summary[name]["curves"], x_key, y_key) for name in names}
    log_y = log_y and any(y > 0 for _, mean, _, _ in curves.values() for y in mean)  # all zero: a linear axis
    drawn = False
    for name, (xs, mean, lo, hi) in curves.items():
        if log_y:
            keep = [i for i, y in enumerate(mean) if y > 0]
            xs, mean, lo, hi = ([seq[i] for i in keep] for seq in (xs, mean, lo, hi))
            lo = [max(y, min(mean) / 10) for y in lo] if mean else lo
        if not xs:
            continue
        ax.plot(xs, mean, label=name, marker="o" if len(xs) <= 12 else None, markersize=3)
        ax.fill_between(xs, lo, hi, alpha=0.15)
        drawn = True
    if not drawn:
        return None
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    if pct:
        return f"{100 * x:.2f}%" if abs(x) < 0.01 else f"{100 * x:.1f}%"
    return f"{x:.3g}"


def _mean_std(s: dict, key: str) -> str:
    return f"{_fmt(s[key], True)} ± {_fmt(s['std'][key], True)}"


def _table(summary: dict, names: Sequence[str]) -> list[str]:
    lines = ["| method | final acc. | best acc. | mean acc. during RL | clip frac. (tokens) | expert volatility | "
             "non-finite / collapsed runs |", "|---|---|---|---|---|---|---|"]
    for n in names:
        s = summary[n]
        lines.append(f"| {n} | {_mean_std(s, 'final_accuracy')} | {_mean_std(s, 'best_accuracy')} | "
                     f"{_mean_std(s, 'mean_accuracy_during_rl')} "
                     f"| {_fmt(s['clip_frac_tokens'], True)} | {_fmt(s['expert_volatility'], True)} | "
                     f"{s['non_finite_runs']} / {s['collapsed_runs']} of {s['runs']} |")
    return lines


def write_report(out: Path, summary: dict) -> Path:
    """DIR/report.md and its PNGs, from summary.json's content."""
    study = summary["study"]
    names = [n for n in study["methods"] if n in METHODS]
    precision = [n for n in study["methods"] if n in PRECISION_METHODS]
    lines = [
        "# MoE stability study: GSPO vs GRPO, Routing Replay, precision tolerance",
        "",
        f"Model `{study['model']}` on `{study['task']}`; {study['seeds']} seeds × "
        f"{len(study['methods'])} runs of {study['steps']} RL steps ({study['completions_per_step']} completions per "
        f"step, {study['minibatches']} minibatch updates per step), from a {study['cold_start']} cold-start SFT model; "
        f"held-out accuracy on {study['eval_size']} problems. Wall time {study['wall_seconds_total'] / 60:.1f} min "
        f"(torch threads per run: {study['threads']}). Values are means over seeds (± sample std); a run counts as "
        f"collapsed when {study['collapse_rule']}.",
        "",
        "## Results",
        "",
        *_table(summary, names),
        "",
        "Expert volatility (§5.3) is measured in the last minibatch forward of each step (after the step's other "
        "updates) against the routing of the π_old forward of the same tokens: the fraction of (token, layer, "
        "expert-slot) activations the router now picks differently. Under R2 it is what the router *would* change; "
        "the replayed forward uses π_old's experts.",
        "",
    ]
    for file, key, title, log_y in _PLOTS:
        if plot_methods(summary, names, key, out / file, title, log_y) is not None:
            lines += [f"![{title}]({file})", ""]
    if precision:
        lines += _precision_section(out, summary, precision)
    lines += ["## The paper's claims at this scale", "", *_claims_in_words(summary["claims"]), "",
              "| claim | verdict | evidence |", "|---|---|---|"]
    lines += [f"| {c['claim']} | **{c['verdict']}** | {c['evidence']} |" for c in summary["claims"]]
    lines += ["", "Verdicts compare per-seed paired differences against two standard errors; with few seeds and a "
              "toy model, \"inconclusive\" means the effect, if any, is smaller than the seed-to-seed noise here; "
              "\"cannot be judged\" means the runs hold no data to decide (one seed, or nothing clipped).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _claims_in_words(items: Sequence[dict[str, str]]) -> list[str]:
    """One plain sentence per verdict class: which claims hold, which do not, which the noise leaves open."""
    noise, no_data = "Cannot be decided at this scale (within seed noise)", "Cannot be judged from these runs"
    groups: dict[str, list[str]] = {"Hold": [], "Do not hold": [], noise: [], no_data: []}
    for c in items:
        v = c["verdict"]
        key = "Hold" if v.startswith(("holds", "partly")) else "Do not hold" if v.startswith("does not") else \
            noise if v.startswith("inconclusive") else no_data
        groups[key].append(c["claim"].split(" (")[0] + (" — partly" if v.startswith("partly") else ""))
    return [f"- **{k}:** " + "; ".join(v) + "." for k, v in groups.items() if v]


def _precision_section(out: Path, summary: dict, names: Sequence[str]) -> list[str]:
    lines = ["## Precision tolerance (§5.4)", "",
             "Rollouts by a bf16 copy of the fp32 trainer. Ratio noise is measured at the start of each step with "
             "identical weights (before any update): w_{i,t} = π_trainer(fp32)/π_engine(bf16) per token and "
             "s_i = exp(mean_t log w_{i,t}) per sequence; `rollout` takes π_old from the engine, `recompute` from the "
             "trainer.", "",
             "| run | std(w_i,t) | std(s_i) | clipped tokens, on-policy minibatch | final acc. | mean acc. during RL |",
             "|---|---|---|---|---|---|"]
    for n in names:
        s = summary[n]
        lines.append(f"| {n} | {_fmt(s['precision_ratio_std_token'])} | {_fmt(s['precision_ratio_std_seq'])} | "
                     f"{_fmt(s['clip_frac_tokens_first_mb'], True)} | {_fmt(s['final_accuracy'], True)} ± "
                     f"{_fmt(s['std']['final_accuracy'], True)} | {_fmt(s['mean_accuracy_during_rl'], True)} |")
    ref = summary["gspo"]
    lines += ["", f"For reference, the fp32 engine of the main runs: std(w_i,t) = "
                  f"{_fmt(ref['precision_ratio_std_token'])}, std(s_i) = {_fmt(ref['precision_ratio_std_seq'])}."]
    gspo, grpo = summary.get("gspo_bf16_rollout"), summary.get("grpo_bf16_rollout")
    noise = summary.get("gspo_bf16_recompute", {}).get("precision_ratio_std_seq")
    if gspo and grpo and noise is not None:
        eps = default_eps("gspo")[1]
        lines += ["", f"With π_old taken from the bf16 engine, precision noise alone clips "
                      f"{_fmt(gspo['clip_frac_tokens_first_mb'], True)} of GSPO's tokens in the on-policy minibatch "
                      f"(GRPO: {_fmt(grpo['clip_frac_tokens_first_mb'], True)}): std(s_i) is {noise / eps:.0f}× "
                      f"GSPO's ε_high = {eps:g}. Whether that costs accuracy is in the claims below."]
    lines.append("")
    if plot_methods(summary, names, "heldout_accuracy", out / "precision_accuracy.png",
                    "held-out accuracy, bf16 rollouts", False) is not None:
        lines += ["![held-out accuracy, bf16 rollouts](precision_accuracy.png)", ""]
    return lines

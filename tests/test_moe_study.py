"""`gspo compare` (`gspo.experiments.moe_study`): the MoE stability study end to end at a few seconds' scale, how
runs are read (collapse, non-finite), how claims get their verdicts from the numbers, reuse of finished runs, and
the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import varied_reward
from gspo.cli import main
from gspo.experiments.moe_study import (
    METHODS,
    PRECISION_METHODS,
    StudyOptions,
    aggregate,
    claims,
    paired,
    run_numbers,
    run_study,
)
from gspo.rewards import REWARDS

# the study shrunk to seconds: 2 seeds × 8 runs of 1 step of 16 completions, a 5-step cold start; a reward that
# varies within groups even for a model that cannot add yet, so that updates (and clipping, volatility) happen
TINY = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "data.train_size=200",
        "data.eval_size=8", "trainer.eval_every=0", "cold_start.steps=5", "cold_start.batch_size=16",
        "rewards.functions={varied: 1.0}", "optim.warmup_steps=0", "optim.lr=3e-3"]


@pytest.fixture(scope="module")
def study(tmp_path_factory, device):
    out = tmp_path_factory.mktemp("study")
    opts = StudyOptions(out=out, seeds=2, steps=1, threads=1, overrides=[*TINY, f"trainer.device={device}"])
    with pytest.MonkeyPatch.context() as mp:  # module-scoped, like conftest's `test_rewards`
        mp.setitem(REWARDS, "varied", varied_reward)
        yield opts, run_study(opts)


def test_study_writes_summary_report_and_plots(study):
    opts, summary = study
    on_disk = json.loads((opts.out / "summary.json").read_text())
    assert on_disk["claims"] == summary["claims"]
    for name in [*METHODS, *PRECISION_METHODS]:
        entry = on_disk[name]
        assert set(entry["per_seed"]) == {"0", "1"}
        for key in ("final_accuracy", "best_accuracy", "clip_frac_tokens", "failed_runs", "non_finite_runs",
                    "collapsed_runs"):
            assert key in entry, (name, key)
        assert 0 <= entry["final_accuracy"] <= 1 and entry["runs"] == 2
        assert (opts.out / "seed0" / name / "summary.json").exists()
    for name in ("gspo", "grpo", "grpo_r2", "gspo_token"):  # MoE with recomputed π_old: volatility is measured
        assert 0 <= on_disk[name]["expert_volatility"] <= 1
    assert on_disk["gspo_bf16_recompute"]["precision_ratio_std_token"] > 0  # bf16 engine vs fp32 trainer
    assert on_disk["study"]["wall_seconds_total"] > 0 and on_disk["study"]["seeds"] == 2
    report = (opts.out / "report.md").read_text()
    for png in ("reward.png", "heldout_accuracy.png", "clip_fraction.png", "expert_volatility.png",
                "precision_accuracy.png"):
        assert (opts.out / png).stat().st_size > 0 and f"]({png})" in report
    assert all(c["verdict"] in report for c in summary["claims"])
    assert len(summary["claims"]) == 9


def test_all_methods_of_a_seed_start_from_the_same_model_and_data(study):
    opts, _ = study
    evals = {name: (opts.out / "seed1" / name / "eval.jsonl").read_text().splitlines()[0]
             for name in [*METHODS, *PRECISION_METHODS]}
    assert len(set(evals.values())) == 1  # identical step-0 held-out evaluation: same weights, same problems
    first_rewards = {json.loads((opts.out / "seed1" / n / "metrics.jsonl").read_text().splitlines()[0])["reward_mean"]
                     for n in METHODS}
    assert len(first_rewards) == 1  # same first rollout batch (same weights, prompts and sampling seeds)


def test_rerunning_reuses_finished_runs(study, monkeypatch):
    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    opts, summary = study
    stamps = {p: p.stat().st_mtime_ns for p in opts.out.glob("seed*/*/metrics.jsonl")}
    again = run_study(opts)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert again["gspo"]["per_seed"] == summary["gspo"]["per_seed"]


# ------------------------------------------------------------------------------------------------- reading runs


def write_run(folder: Path, evals: list[float], loss=0.1, skipped=0) -> Path:
    folder.mkdir(parents=True)
    lines = [{"step": s, "reward_mean": 0.5, "loss": loss, "clip_frac_tokens": 0.1, "skipped_updates": skipped,
              "expert_volatility": 0.02} for s in (1, 2)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "eval.jsonl").write_text("".join(json.dumps({"step": s, "heldout_accuracy": a}) + "\n"
                                               for s, a in zip((0, 1, 2), evals, strict=True)))
    return folder


def test_collapse_and_non_finite_runs_are_counted(tmp_path):
    ok = run_numbers(write_run(tmp_path / "ok", [0.4, 0.6, 0.5]))
    assert (ok["final_accuracy"], ok["best_accuracy"], ok["collapsed"], ok["non_finite"]) == (0.5, 0.6, False, False)
    collapsed = run_numbers(write_run(tmp_path / "collapsed", [0.4, 0.3, 0.19]))
    assert collapsed["collapsed"] and not collapsed["non_finite"]
    nan = run_numbers(write_run(tmp_path / "nan", [0.4, 0.4, 0.4], loss=None, skipped=1))
    assert nan["non_finite"] and not nan["collapsed"]
    agg = aggregate({0: ok, 1: collapsed, 2: nan})
    assert (agg["collapsed_runs"], agg["non_finite_runs"], agg["failed_runs"], agg["runs"]) == (1, 1, 2, 3)
    assert agg["mean"]["final_accuracy"] == pytest.approx((0.5 + 0.19 + 0.4) / 3)


# ------------------------------------------------------------------------------------------------------- claims


def fake_summary(acc: dict[str, list[float]], clip: dict[str, float], failed: dict[str, int] | None = None) -> dict:
    """A summary with given per-seed mean accuracies and mean clip fractions (volatility 5%)."""
    out = {}
    for name, values in acc.items():
        out[name] = {
            "per_seed": {str(s): {"mean_accuracy_during_rl": v} for s, v in enumerate(values)},
            "clip_frac_tokens": clip.get(name, 0.01), "expert_volatility": 0.05,
            "failed_runs": (failed or {}).get(name, 0), "runs": len(values),
        }
    return out


def verdicts(summary: dict) -> dict[str, str]:
    return {c["claim"].split(":")[0].split(" (")[0]: c["verdict"] for c in claims(summary, list(summary))}


def test_claim_verdicts_follow_the_numbers():
    base = {"gspo": [0.50, 0.52, 0.55], "grpo": [0.30, 0.31, 0.36], "grpo_r2": [0.45, 0.46, 0.50],
            "gspo_token": [0.51, 0.52, 0.54]}
    v = verdicts(fake_summary(base, {"gspo": 0.15, "grpo": 0.0013}))
    assert v["GSPO clips about two orders of magnitude more tokens than GRPO"] == "holds"
    assert v["GSPO trains more efficiently than GRPO for the same compute"] == "holds"
    assert v["GRPO on an MoE model needs Routing Replay"] == "holds"
    assert v["GSPO needs no Routing Replay"] == "holds"
    assert v["GSPO-token with sequence-level advantages behaves as GSPO"].startswith("holds")
    assert v["After a gradient update, a noticeable share of the experts activated for the same rollout changes"] \
        == "holds"

    flipped = {**base, "gspo": [0.20, 0.22, 0.25]}
    v = verdicts(fake_summary(flipped, {"gspo": 0.05, "grpo": 0.01}))
    assert v["GSPO clips about two orders of magnitude more tokens than GRPO"] == "does not hold"
    assert v["GSPO trains more efficiently than GRPO for the same compute"] == "does not hold"
    assert v["GSPO needs no Routing Replay"] == "does not hold"
    assert v["GSPO-token with sequence-level advantages behaves as GSPO"].startswith("does not hold")

    noisy = {"gspo": [0.5, 0.2, 0.4], "grpo": [0.3, 0.4, 0.35], "grpo_r2": [0.35, 0.3, 0.4],
             "gspo_token": [0.5, 0.2, 0.4]}
    v = verdicts(fake_summary(noisy, {"gspo": 0.02, "grpo": 0.001}, failed={"grpo": 2}))
    assert v["GSPO trains more efficiently than GRPO for the same compute"].startswith("inconclusive")
    assert v["GSPO clips about two orders of magnitude more tokens than GRPO"].startswith("partly holds")
    assert v["GRPO on an MoE model needs Routing Replay"] == "holds (GRPO fails more often without R2)"


def test_paired_comparison_uses_seed_pairs():
    s = fake_summary({"a": [0.5, 0.6, 0.7], "b": [0.4, 0.5, 0.6]}, {})
    c = paired(s, "a", "b", "mean_accuracy_during_rl")
    assert c.mean == pytest.approx(0.1) and c.se == pytest.approx(0.0, abs=1e-12) and c.sign == 1
    single = paired(fake_summary({"a": [0.9], "b": [0.1]}, {}), "a", "b", "mean_accuracy_during_rl")
    assert single.sign == 0 and math.isinf(single.se)  # one seed never decides a claim


# ---------------------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["algorithm.minibatches=3"], "does not split into algorithm.minibatches=3"),
    # a dense model cannot replay routing: found after the cold start and two methods' runs before
    (["model.name=tiny-dense"], "method 'grpo_r2' (algorithm.routing_replay=r2)"),
    # the precision runs' figures are a bf16 engine against a float32 trainer: they would be labelled so, wrongly
    (["trainer.mixed_precision=bfloat16"], "the base config's trainer computes in bfloat16 autocast over float32"),
    (["model.dtype=bfloat16", "optim.lr=1e-2", "cold_start.lr=1e-2"], "trainer computes in bfloat16: its figures"),
])
def test_cli_rejects_bad_settings_before_compute(tmp_path, capsys, args, message):
    out = tmp_path / "study"
    assert main(["compare", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- the study


@pytest.mark.slow
@pytest.mark.timeout(1800)  # pyproject's 600 s is for the fast suite's tests
def test_default_study_end_to_end(tmp_path):
    """The study as `gspo compare --out DIR` runs it (3 seeds, 4 methods + 4 precision runs; ~20-30 min on 2 cores)."""
    out = tmp_path / "study"
    assert main(["compare", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name in [*METHODS, *PRECISION_METHODS]:
        assert summary[name]["runs"] == 3 and summary[name]["non_finite_runs"] == 0
    assert summary["gspo"]["clip_frac_tokens"] > summary["grpo"]["clip_frac_tokens"]
    assert summary["gspo"]["expert_volatility"] > 0
    assert (out / "report.md").exists()

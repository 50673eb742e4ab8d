"""95% intervals of held-out accuracy (Wilson), of the change between two evaluations of the same rows (paired,
Agresti–Min), and where a run reports them (eval.jsonl, summary.json, the demo's line). Coverage is checked by
simulation with fixed seeds: an interval that claims 95% must contain the truth about 95% of the time."""

from __future__ import annotations

import json
import math
import random

import pytest

from conftest import DEMO, tiny_overrides
from gspo.config import load_config
from gspo.evaluation import accuracy_ci95, mean_ci95, paired_change_ci95, wilson_ci95
from gspo.tracking import read_metrics
from gspo.trainer import train


def test_wilson_matches_published_values_and_never_has_zero_width():
    # textbook values of the Wilson score interval (81/263 is Newcombe 1998's worked example)
    assert wilson_ci95(0, 10) == (0.0, pytest.approx(0.2775, abs=1e-4))
    assert wilson_ci95(5, 10) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert wilson_ci95(81, 263) == (pytest.approx(0.2553, abs=1e-4), pytest.approx(0.3662, abs=1e-4))
    low, high = wilson_ci95(64, 64)
    assert high == 1.0 and 0.9 < low < 0.96  # all solved is not "exactly 100%"
    assert wilson_ci95(0, 0) == (0.0, 1.0)


def test_an_accuracy_of_0_or_1_lies_inside_its_own_interval_for_every_row_count():
    """Float rounding gave wilson_ci95(0, 3) a low of 5.6e-17 and wilson_ci95(10, 10) a high of 0.9999999999999999."""
    for n in range(1, 1001):
        assert wilson_ci95(0, n)[0] == 0.0 and wilson_ci95(n, n)[1] == 1.0, n


def test_pass_at_1s_interval_is_the_accuracys_interval():
    """With sampled evaluation the accuracy is pass@1, and it was given two intervals: Wilson's where every row's
    fraction was 0 or 1 (10 rows all 0: 0 to 0.278), the mean interval's zero width for pass@1_ci95 (0 to 0)."""
    from gspo.evaluation import pass_at_k_ci95

    for values in ([0.0] * 10, [1.0] * 10, [0.0, 1.0] * 5, [0.25, 0.5, 1.0, 0.0, 0.75]):
        ci = pass_at_k_ci95(values, 4, [1, 2, 4])
        assert (ci["pass@1_ci95_low"], ci["pass@1_ci95_high"]) == accuracy_ci95(values), values
        assert all(ci[f"pass@{k}_ci95_low"] < ci[f"pass@{k}_ci95_high"] for k in (1, 2, 4))  # never zero width


@pytest.mark.parametrize("p", [0.03, 0.3, 0.5, 0.9])
def test_wilson_covers_the_true_accuracy_about_95_percent_of_the_time(p):
    rng, rows, trials = random.Random(0), 100, 2000
    hits = 0
    for _ in range(trials):
        low, high = wilson_ci95(sum(rng.random() < p for _ in range(rows)), rows)
        hits += low <= p <= high
    assert 0.92 <= hits / trials <= 0.99


def test_accuracy_ci95_is_wilsons_for_verdicts_and_the_mean_interval_for_fractions():
    assert accuracy_ci95([1.0, 0.0, 1.0, 1.0]) == wilson_ci95(3, 4)
    assert accuracy_ci95([1.0, 0.5, 0.25, 0.75]) == mean_ci95([1.0, 0.5, 0.25, 0.75])


@pytest.mark.parametrize("p_before, p_gain, p_loss", [(0.3, 0.3, 0.02), (0.5, 0.0, 0.0), (0.2, 0.05, 0.05)])
def test_the_paired_interval_covers_the_true_change_about_95_percent_of_the_time(p_before, p_gain, p_loss):
    """Rows solved before are lost with probability p_loss, unsolved ones gained with p_gain: the true change is
    p_gain·(1 − p_before) − p_loss·p_before. Including the case where no row ever changes (zero true change)."""
    rng, rows, trials = random.Random(1), 200, 1000
    truth = p_gain * (1 - p_before) - p_loss * p_before
    hits = 0
    for _ in range(trials):
        before = [float(rng.random() < p_before) for _ in range(rows)]
        after = [float(rng.random() < p_gain) if b == 0 else float(rng.random() >= p_loss) for b in before]
        change, low, high = paired_change_ci95(before, after)
        assert change == pytest.approx(sum(after) / rows - sum(before) / rows)
        hits += low <= truth <= high
    assert 0.92 <= hits / trials <= 1.0


def test_pairing_makes_the_change_interval_much_narrower_than_two_separate_intervals():
    before = [1.0] * 60 + [0.0] * 140  # 30 % → 40 %: 20 rows gained, none lost
    after = [1.0] * 80 + [0.0] * 120
    change, low, high = paired_change_ci95(before, after)
    assert change == pytest.approx(0.1) and 0 < low < change < high
    (_, b_high), (a_low, _) = wilson_ci95(60, 200), wilson_ci95(80, 200)
    assert a_low < b_high  # the separate intervals overlap: they cannot tell
    unpaired = 2 * 1.96 * math.sqrt(0.3 * 0.7 / 200 + 0.4 * 0.6 / 200)  # as if the rows were two independent samples
    assert high - low < 0.5 * unpaired


def test_sampled_fractions_use_the_paired_mean_interval_and_lengths_must_match():
    change, low, high = paired_change_ci95([0.5, 0.25, 0.75], [0.75, 0.5, 0.75])
    assert change == pytest.approx(1 / 6) and low < change < high
    with pytest.raises(ValueError, match="same rows"):
        paired_change_ci95([1.0, 0.0], [1.0])
    assert paired_change_ci95([1.0], [0.0]) == (-1.0, -1.0, 1.0)


def test_a_run_reports_each_accuracy_and_its_change_with_intervals(tmp_path):
    out = tmp_path / "run"
    summary = train(load_config(DEMO, tiny_overrides(out, "trainer.steps=4", "data.eval_size=24")))
    evals = read_metrics(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    for e in evals:
        n = 24
        assert (e["heldout_accuracy_ci95_low"], e["heldout_accuracy_ci95_high"]) == pytest.approx(
            wilson_ci95(round(e["heldout_accuracy"] * n), n))
    assert "heldout_accuracy_change" not in evals[0]
    for e in evals[1:]:
        assert e["heldout_accuracy_change"] == pytest.approx(e["heldout_accuracy"] - evals[0]["heldout_accuracy"])
        assert e["heldout_accuracy_change_ci95_low"] <= e["heldout_accuracy_change_ci95_high"]
    ci = summary["heldout_accuracy_ci95"]
    assert ci["before_rl"] == [evals[0]["heldout_accuracy_ci95_low"], evals[0]["heldout_accuracy_ci95_high"]]
    assert ci["change"] == [evals[-1]["heldout_accuracy_change_ci95_low"],
                            evals[-1]["heldout_accuracy_change_ci95_high"]]
    assert json.loads((out / "summary.json").read_text())["heldout_accuracy_ci95"] == ci


def test_a_resumed_run_pairs_its_rows_with_the_first_evaluations_only_if_they_are_the_same_rows(tmp_path, caplog):
    """The change since the first evaluation pairs each row with itself. Resumed with other held-out rows of the same
    count (the file was edited, or rows are chosen differently since the run began), pairing by position would pair
    different problems: that change is not reported (and a warning says why); with the same rows it is."""
    rows = [{"prompt": f"{a}+{a % 5}=", "answer": str(a + a % 5)} for a in range(300, 324)]
    held = tmp_path / "held.jsonl"
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1), "solution": str(a + 1)})
                                  + "\n" for a in range(100)))

    def run(out, steps: int, resume: bool) -> list[dict]:
        train(load_config(DEMO, tiny_overrides(out, f"trainer.steps={steps}", "trainer.eval_every=1",
                                               "trainer.checkpoint_every=1", f"data.path={train_file}",
                                               "data.task=null", f"data.eval_path={held}", "cold_start=null")),
              resume=resume)
        return read_metrics(out / "eval.jsonl")

    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    same = run(tmp_path / "same", 1, False)
    same = run(tmp_path / "same", 2, True)
    assert "heldout_accuracy_change" in same[-1]
    run(tmp_path / "edited", 1, False)
    held.write_text("".join(json.dumps({**r, "prompt": r["prompt"].replace("=", "=0")}) + "\n" for r in rows))
    edited = run(tmp_path / "edited", 2, True)
    assert [e["step"] for e in edited] == [0, 1, 2] and "heldout_accuracy_change" not in edited[-1]
    assert "differ from those of the run's first evaluation" in caplog.text


def test_paired_change_interval_of_sampled_fractions_is_the_paired_t_interval_by_hand():
    """Per-row differences 0.25, 0.25, 0: mean 1/6, sample std (n − 1) 0.1443, t95(2) = 4.302653 (tables):
    1/6 ∓ 4.302653 · 0.1443 / √3. A population std (n) or the normal's 1.96 would give another interval; the
    existing tests only check low < change < high and a coverage rate."""
    from gspo.evaluation import paired_change_ci95

    change, low, high = paired_change_ci95([0.5, 0.25, 0.75], [0.75, 0.5, 0.75])
    assert change == pytest.approx(1 / 6)
    assert (low, high) == (pytest.approx(-0.1918877, abs=1e-6), pytest.approx(0.5252211, abs=1e-6))


def test_paired_change_interval_of_verdicts_is_agresti_min_by_hand():
    """200 rows, 20 gained (0 → 1), none lost. Agresti & Min (2005): add 1/2 to each of the 4 cells (n* = 202),
    then the Wald interval of the paired difference: (n12 − n21)/n* ± 1.96 √(((n12 + n21) − (n12 − n21)²/n*) / n*²)
    with n12 = 20.5, n21 = 0.5."""
    from gspo.evaluation import paired_change_ci95

    change, low, high = paired_change_ci95([1.0] * 60 + [0.0] * 140, [1.0] * 80 + [0.0] * 120)
    assert change == pytest.approx(0.1)
    assert (low, high) == (pytest.approx(0.0566944, abs=1e-6), pytest.approx(0.1413254, abs=1e-6))

"""Held-out accuracy per group of rows: several held-out files (each its own evaluation set) and `data.eval_by`, a
field such as `data_source` or `level`. Before, a run trained on mixed data reported one pooled accuracy, and a
second benchmark needed a second run of `gspo eval` per checkpoint. The verdicts here are known by construction (a
reward that reads each row's `solved` flag), so every per-group number is checked against its count."""

from __future__ import annotations

import json

import pytest

from conftest import DEMO, FLAGGED, tiny_overrides, write_jsonl
from gspo.cli import _accuracy_line, main
from gspo.config import ConfigError, load_config
from gspo.data import eval_groups, load_data
from gspo.evaluation import accuracy_by_group, accuracy_ci95, paired_change_ci95, wilson_ci95
from gspo.tracking import read_metrics
from gspo.trainer import train


def rows(first: int, count: int, solved: int, **extra) -> list[dict]:
    """`count` addition rows from `first`, the first `solved` of them marked solved."""
    return [{"prompt": f"{a}+1=", "answer": str(a + 1), "solved": i < solved, **extra}
            for i, a in enumerate(range(first, first + count))]


def test_accuracy_by_group_is_each_groups_own_accuracy_interval_and_paired_change():
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5]
    groups = ["b", "a", "b", "a", "b", "c", "c", "c"]
    first = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    metrics = accuracy_by_group(values, groups, first)
    for group in ("a", "b", "c"):
        mine = [v for v, g in zip(values, groups, strict=True) if g == group]
        before = [v for v, g in zip(first, groups, strict=True) if g == group]
        assert metrics[f"accuracy/{group}"] == pytest.approx(sum(mine) / len(mine))
        assert metrics[f"rows/{group}"] == len(mine)
        assert (metrics[f"accuracy_ci95_low/{group}"], metrics[f"accuracy_ci95_high/{group}"]) == accuracy_ci95(mine)
        assert (metrics[f"accuracy_change/{group}"], metrics[f"accuracy_change_ci95_low/{group}"],
                metrics[f"accuracy_change_ci95_high/{group}"]) == paired_change_ci95(before, mine)
    assert (metrics["accuracy_ci95_low/a"], metrics["accuracy_ci95_high/a"]) == wilson_ci95(1, 2)  # greedy verdicts
    assert not any(key.startswith("accuracy_change") for key in accuracy_by_group(values, groups))
    with pytest.raises(ValueError, match="each row needs one of each"):
        accuracy_by_group(values, groups[:-1])


def test_several_held_out_files_are_groups_each_capped_and_cleaned_on_its_own(tmp_path):
    train_file = write_jsonl(tmp_path / "train.jsonl", rows(0, 50, 0))
    a = write_jsonl(tmp_path / "gsm.jsonl", rows(100, 30, 0) + rows(0, 5, 0))  # 5 training prompts
    (tmp_path / "other").mkdir()
    b = write_jsonl(tmp_path / "math.jsonl", rows(200, 12, 0))
    data = load_data(load_config(None, [f"data.path={train_file}", f"data.eval_path=[{a}, {b}]",
                                        "data.eval_size=20"]).data, seed=0)
    assert [r["eval_set"] for r in data.heldout] == ["gsm"] * 20 + ["math"] * 12
    assert [r["data_source"] for r in data.heldout] == ["gsm"] * 20 + ["math"] * 12  # as data.path lists name them
    assert data.heldout_source["sets"]["gsm"] == {"kind": "eval_path", "path": str(a), "rows": 20, "of": 30,
                                                  "repeated_prompts": 0, "dropped_training_prompts": 5}
    assert data.heldout_source["sets"]["math"]["rows"] == data.heldout_source["sets"]["math"]["of"] == 12
    assert (data.heldout_source["rows"], data.heldout_source["of"], data.heldout_source["dropped_training_prompts"],
            data.heldout_source["repeated_prompts"]) == (32, 42, 5, 0)

    same_stem = write_jsonl(tmp_path / "other" / "gsm.jsonl", rows(300, 4, 0))  # two files named gsm: paths name them
    data = load_data(load_config(None, [f"data.path={train_file}", f"data.eval_path=[{a}, {same_stem}]"]).data, seed=0)
    assert sorted({r["eval_set"] for r in data.heldout}) == sorted([str(a), str(same_stem)])

    clash = write_jsonl(tmp_path / "clash.jsonl", rows(400, 3, 0, eval_set="x"))
    with pytest.raises(ValueError, match=r"row 0 has a field 'eval_set'"):
        load_data(load_config(None, [f"data.path={train_file}", f"data.eval_path=[{a}, {clash}]"]).data, seed=0)
    with pytest.raises(ConfigError, match="each once"):
        load_config(None, [f"data.path={train_file}", f"data.eval_path=[{a}, {a}]"])


def test_a_group_field_must_be_on_every_held_out_row_and_name_few_groups(tmp_path):
    with pytest.raises(ValueError, match=r"'level': held-out row 1 has no such field"):
        eval_groups([{"prompt": "x", "level": 1}, {"prompt": "y"}], "level")
    with pytest.raises(ValueError, match=r"'level': held-out row 0 has \[1\]"):
        eval_groups([{"prompt": "x", "level": [1]}], "level")
    with pytest.raises(ValueError, match="65 distinct values among 65 held-out rows"):
        eval_groups([{"prompt": str(i), "answer": str(i)} for i in range(65)], "answer")
    assert eval_groups([{"level": 1}, {"level": "1"}, {"level": 2}], "level") == ["1", "1", "2"]
    assert eval_groups([{"level": 1}], None) is None
    train_file = write_jsonl(tmp_path / "train.jsonl", rows(0, 10, 0))
    held = write_jsonl(tmp_path / "held.jsonl", rows(100, 3, 0))
    with pytest.raises(ValueError, match=r"data\.eval_by 'level'"):  # checked when the data loads, before any model
        train(load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", f"data.path={train_file}",
                                               "data.task=null", f"data.eval_path={held}", "data.eval_by=level")))
    with pytest.raises(ConfigError, match="nothing is held out"):
        load_config(None, ["data.eval_split=null", "data.eval_by=level"])


def test_a_run_reports_each_held_out_files_accuracy_and_gspo_eval_repeats_it(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(FLAGGED)
    train_file = write_jsonl(tmp_path / "train.jsonl", rows(0, 40, 20))
    a = write_jsonl(tmp_path / "easy.jsonl", rows(100, 8, 6))
    b = write_jsonl(tmp_path / "hard.jsonl", rows(200, 8, 2))
    out = tmp_path / "run"
    summary = train(load_config(DEMO, tiny_overrides(
        out, "cold_start=null", f"data.path={train_file}", "data.task=null", f"data.eval_path=[{a}, {b}]",
        f"rewards.functions={{{tmp_path / 'rw.py'}:flagged: 1.0}}", "trainer.steps=2", "trainer.eval_every=1")))
    assert summary["heldout_accuracy_after_rl"] == 8 / 16
    by = summary["heldout_accuracy_by"]
    assert list(by) == ["easy", "hard"]
    for group, solved in (("easy", 6), ("hard", 2)):
        assert by[group]["before_rl"] == by[group]["after_rl"] == solved / 8 and by[group]["rows"] == 8
        assert by[group]["ci95"]["after_rl"] == list(wilson_ci95(solved, 8))
        low, high = by[group]["ci95"]["change"]
        assert low < 0 < high  # no row changed its verdict: the paired interval is around 0
    evals = read_metrics(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(e["heldout_accuracy/easy"] == 0.75 and e["heldout_rows/hard"] == 8 for e in evals)
    assert "heldout_accuracy_change/easy" not in evals[0] and evals[2]["heldout_accuracy_change/easy"] == 0
    assert (out / "curves.png").stat().st_size > 0
    line = _accuracy_line(summary, "before RL", "after RL").splitlines()  # what `gspo train` prints for people
    assert line[1].startswith("  easy (8 rows): 75.0% → 75.0% (+0.0 points; 95% CI ")
    assert line[2].startswith("  hard (8 rows): 25.0% → 25.0% (+0.0 points; 95% CI ")

    assert main(["eval", str(out / "final"), "--config", str(out / "config.yaml"), "--baseline", str(out / "final"),
                 "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["by"]["easy"]["accuracy"] == 0.75 and result["by"]["hard"]["accuracy"] == 0.25
    assert result["by"]["hard"]["accuracy_ci95"] == list(wilson_ci95(2, 8))
    assert result["by"]["easy"]["baseline_accuracy"] == 0.75 and result["by"]["easy"]["accuracy_change"] == 0
    assert "  easy: 75.0% (95% CI" in captured.err and "  hard: 25.0%" in captured.err


def test_the_printed_line_names_a_group_the_first_evaluation_did_not_have():
    """A resume with other held-out rows can bring a group the first evaluation lacked: its before_rl is None, and
    printing it raised TypeError after the run had finished."""
    summary = {"heldout_accuracy_before_rl": 0.5, "heldout_accuracy_after_rl": 0.75, "heldout_same_rows": False,
               "wall_seconds": 3.0, "heldout_accuracy_by": {
                   "old": {"rows": 4, "before_rl": 0.5, "after_rl": 0.75, "ci95": None},
                   "new": {"rows": 2, "before_rl": None, "after_rl": 1.0, "ci95": None}}}
    lines = _accuracy_line(summary, "before RL", "after RL").splitlines()
    assert lines[1] == "  old (4 rows): 50.0% → 75.0% (+25.0 points)"
    assert lines[2] == "  new (2 rows): 100.0% after RL (not in the first evaluation)"


def test_gspo_eval_splits_a_files_accuracy_by_a_field(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(FLAGGED)
    data = write_jsonl(tmp_path / "d.jsonl", rows(0, 10, 7, level=1) + rows(50, 5, 1, level=2))
    base = ["eval", "tiny-moe", "--data", str(data), "--reward", f"{tmp_path / 'rw.py'}:flagged", "--max-new-tokens",
            "1"]
    assert main([*base, "--by", "level"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["accuracy"] == 8 / 15  # a fraction of rows, not a float32 mean
    assert {g: (e["accuracy"], e["rows"]) for g, e in result["by"].items()} == {"1": (0.7, 10), "2": (0.2, 5)}
    assert main([*base, "--by", "nope"]) == 2
    assert "--by 'nope': held-out row 0 has no such field" in capsys.readouterr().err
    assert main(["eval", "tiny-moe", "--config", str(DEMO), "--by", "level"]) == 2  # the config's data.eval_by
    # the config's rewards judge: these flags were silently ignored with --config
    for flag, value in (("--accuracy-threshold", "0.5"), ("--accuracy-reward", "addition"), ("--timeout", "5")):
        capsys.readouterr()
        assert main(["eval", "tiny-moe", "--config", str(DEMO), flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_gspo_eval_writes_each_rows_completion_rewards_and_verdict(tmp_path, capsys):
    """--rows-out: which rows a model gets wrong (and, with --baseline, which it gained or lost), in row order."""
    (tmp_path / "rw.py").write_text(FLAGGED)
    source = rows(0, 6, 4, level=1) + rows(50, 3, 1, level=2)
    data = write_jsonl(tmp_path / "d.jsonl", source)
    reward = f"{tmp_path / 'rw.py'}:flagged"
    out = tmp_path / "rows" / "rows.jsonl"
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", reward, "--max-new-tokens", "3", "--by",
                 "level", "--baseline", "tiny-dense", "--rows-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in records] == list(range(9)) and [r["prompt"] for r in records] == [
        r["prompt"] for r in source]
    assert [r["solved"] for r in records] == [float(r["solved"]) for r in source]
    assert all(r["rewards"] == {reward: float(s["solved"])} and r["correct"] == s["solved"]
               for r, s in zip(records, source, strict=True))
    assert [r["group"] for r in records] == ["1"] * 6 + ["2"] * 3
    assert all(r["baseline"]["solved"] == r["solved"] and r["change"] == 0 for r in records)
    assert all(isinstance(r["completion"], str) and isinstance(r["truncated"], bool) for r in records)
    assert sum(r["solved"] for r in records) == result["solved"] == 5
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", reward, "--rows-out",
                 str(data / "rows.jsonl")]) == 2  # a file as the folder: refused before evaluating


def test_a_prompt_in_several_held_out_files_is_counted_and_warned_about(tmp_path, caplog):
    """Each file's accuracy keeps its rows; a prompt in two files then counts twice in the pooled accuracy, which the
    record (`prompts_in_several_sets`) and a warning say."""
    train_file = write_jsonl(tmp_path / "train.jsonl", rows(0, 40, 20))
    a = write_jsonl(tmp_path / "a.jsonl", rows(100, 8, 6))
    b = write_jsonl(tmp_path / "b.jsonl", rows(104, 8, 2))  # its first 4 prompts are a's last 4
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", f"data.path={train_file}",
                                           "data.task=null", f"data.eval_path=[{a}, {b}]"))
    with caplog.at_level("WARNING", logger="gspo.data.heldout"):
        data = load_data(cfg.data, seed=0)
    assert len(data.heldout) == 16 and data.heldout_source["prompts_in_several_sets"] == 4
    assert "4 held-out prompts are in more than one of the data.eval_path files" in caplog.text
    c = write_jsonl(tmp_path / "c.jsonl", rows(200, 8, 2))
    clean = load_data(cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_path": [str(a), str(c)]})}).data,
                      seed=0)
    assert clean.heldout_source["prompts_in_several_sets"] == 0

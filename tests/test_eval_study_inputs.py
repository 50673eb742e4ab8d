"""Inputs of `gspo eval`, `gspo compare` and `gspo async-study` that used to be found only after compute, lose data or
give silently wrong output: --rows-out's row numbers and target, a bad --baseline, the decoding a run's figures used,
--task-options, study folders rerun with other settings, verdicts from no data, and study arguments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEMO, FLAGGED, sampler_autocasts, write_jsonl
from gspo.cli import _accuracy_line, _run_decoding, build_parser, main
from gspo.config import config_to_dict, load_config
from gspo.experiments.async_study import AsyncStudyOptions, _mean_std, format_mean_std
from gspo.experiments.moe_study import (
    COLD_START_RECORD,
    StudyOptions,
    claims,
    reusable_cold_start,
    reusable_run,
    study_configs,
)


def last_json(text: str) -> dict:
    start = text.rindex("\n{") + 1 if "\n{" in text else text.index("{")
    return json.loads(text[start:])


@pytest.fixture
def flagged(tmp_path) -> str:
    (tmp_path / "rw.py").write_text(FLAGGED)
    return f"{tmp_path / 'rw.py'}:flagged"


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if `gspo eval` loads a model: its checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr("gspo.models.load_model", refuse)


# ------------------------------------------------------------------------------------------- gspo eval --rows-out


def test_rows_out_row_is_the_files_row_after_a_skipped_prompt_and_under_size(tmp_path, capsys, flagged):
    source = [{"prompt": f"{a}+1=", "answer": str(a + 1), "solved": a % 2 == 0} for a in range(6)]
    source[1]["prompt"] = "12+" * 100  # 300 tokens: longer than the model's positions leave, skipped and counted
    data = write_jsonl(tmp_path / "d.jsonl", source)
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", flagged, "--max-new-tokens", "2",
                 "--rows-out", str(out)]) == 0
    assert last_json(capsys.readouterr().out)["skipped_prompts"] == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in records] == [0, 2, 3, 4, 5]
    assert all(r["prompt"] == source[r["row"]]["prompt"] and r["solved"] == float(source[r["row"]]["solved"])
               for r in records)
    # --size samples rows by prompt hash: `row` still names each one's row in the file
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", flagged, "--max-new-tokens", "2", "--size",
                 "3", "--rows-out", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) <= 3 and all(r["prompt"] == source[r["row"]]["prompt"] for r in records)


def test_rows_out_may_not_replace_the_data_being_evaluated(tmp_path, capsys, flagged, no_model_loading):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2", "solved": True}])
    before = data.read_text()
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", flagged, "--rows-out", str(data)]) == 2
    assert "is the data file" in capsys.readouterr().err and data.read_text() == before
    # a config's held-out file (and its training file) as well, named by another spelling of the path
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"task": None, "path": str(train), "eval_path": str(data)}}))
    for target in (tmp_path / "." / "d.jsonl", train):
        assert main(["eval", "tiny-moe", "--config", str(config), "--rows-out", str(target)]) == 2
        assert "the results would replace the data" in capsys.readouterr().err
    assert data.read_text() == before


def test_rows_out_may_not_replace_a_runs_own_record(tmp_path, capsys, no_model_loading):
    """`gspo eval RUN --rows-out RUN/eval.jsonl` replaced the run's evaluation log with the rows, silently (exit 0); a
    run's metrics.jsonl, summary.json, ... likewise. Refused before anything is loaded; another name there is fine."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "eval.jsonl").write_text('{"step": 0, "heldout_accuracy": 0.5}\n')
    for name in ("eval.jsonl", "summary.json"):
        assert main(["eval", "tiny-moe", "--size", "2", "--rows-out", str(run / name)]) == 2
        assert f"is the run's own {name} in the run folder" in capsys.readouterr().err
    assert (run / "eval.jsonl").read_text() == '{"step": 0, "heldout_accuracy": 0.5}\n'
    assert sorted(p.name for p in run.iterdir()) == ["eval.jsonl", "metrics.jsonl"]
    (tmp_path / "plain").mkdir()  # a folder that holds no run: its eval.jsonl is just a name
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["eval", "tiny-moe", "--size", "2", "--rows-out", str(tmp_path / "plain" / "eval.jsonl")])


def test_rows_out_folder_is_refused_before_the_evaluation(tmp_path, capsys, no_model_loading):
    (tmp_path / "d").mkdir()
    assert main(["eval", "tiny-moe", "--size", "2", "--rows-out", str(tmp_path / "d")]) == 2
    assert "is a folder: name a file" in capsys.readouterr().err


def test_a_failing_rows_out_write_keeps_the_printed_result(tmp_path, capsys, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("gspo.runfolder.write_jsonl", disk_full)
    assert main(["eval", "tiny-moe", "--size", "2", "--max-new-tokens", "2", "--rows-out",
                 str(tmp_path / "rows.jsonl")]) == 2
    printed = capsys.readouterr()
    assert last_json(printed.out)["rows"] == 2 and "No space left" in printed.err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_accuracy_threshold_is_refused_before_a_model_is_loaded(capsys, no_model_loading, value):
    """As rewards.accuracy_threshold is: nan evaluated every row, then blamed the reward (nothing is >= nan)."""
    assert main(["eval", "tiny-moe", "--size", "2", f"--accuracy-threshold={value}"]) == 2
    assert "--accuracy-threshold must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("baseline", ["missing", "empty"])
def test_a_bad_baseline_is_refused_before_the_model_is_evaluated(tmp_path, capsys, no_model_loading, baseline):
    (tmp_path / "empty").mkdir()
    assert main(["eval", "tiny-moe", "--size", "2", "--baseline", str(tmp_path / baseline)]) == 2
    err = capsys.readouterr().err
    assert "--baseline" in err and str(tmp_path / baseline) in err


# ------------------------------------------------------------------------------------- gspo eval RUN: its decoding


def fake_run(folder: Path, *overrides: str) -> Path:
    """A run folder as `gspo train` leaves it, without training: its config.yaml and a final model (a preset's)."""
    from gspo.models import build_preset, save_model

    cfg = load_config(DEMO, ["cold_start=null", "data.eval_size=4", "trainer.eval_max_new_tokens=2", *overrides])
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    save_model(*build_preset("tiny-moe"), folder / "final")
    return folder


def test_eval_of_a_run_follows_its_sampled_evaluation_and_says_so(tmp_path, capsys):
    run = fake_run(tmp_path / "run", "trainer.eval_samples=4", "trainer.eval_temperature=0.7", "trainer.seed=3")
    assert main(["eval", str(run)]) == 0
    printed = capsys.readouterr()
    result = last_json(printed.out)
    assert (result["samples_per_prompt"], result["temperature"], result["seed"]) == (4, 0.7, 3)
    assert "pass@4" in result and "as the run evaluates" in result["decoding"]
    assert "4 samples each at temperature 0.7, pass@1 (as the run evaluates" in printed.err
    assert main(["eval", str(run), "--samples", "1"]) == 0  # asked for greedy: said to be not the run's figure
    printed = capsys.readouterr()
    assert last_json(printed.out)["samples_per_prompt"] == 1
    assert "greedy (the run evaluates 4 samples per row at temperature 0.7" in printed.err
    cfg = load_config(DEMO, ["trainer.eval_samples=4"])
    assert _run_decoding(cfg) == "pass@1 of 4 samples per row at temperature 1"
    summary = {"heldout_accuracy_before_rl": 0.25, "heldout_accuracy_after_rl": 0.5, "wall_seconds": 1.0}
    assert _accuracy_line(summary, "before RL", "after RL", _run_decoding(cfg)).startswith(
        "held-out accuracy (pass@1 of 4 samples per row at temperature 1): 25.0% before RL")
    assert _run_decoding(load_config(DEMO, [])) is None


def test_eval_of_a_mixed_precision_run_samples_under_its_autocast_and_says_so(tmp_path, capsys, monkeypatch):
    """A run with trainer.mixed_precision samples (and evaluates) under bf16 autocast: `gspo eval RUN` decodes so
    too, and its decoding says it; a model evaluated without a run's config samples in its own dtype."""
    import gspo.evaluation

    made = sampler_autocasts(monkeypatch, gspo.evaluation)
    run = fake_run(tmp_path / "run", "trainer.mixed_precision=bfloat16", "trainer.device=cpu")
    assert main(["eval", str(run), "--size", "4", "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr()
    assert "under bfloat16 autocast (the run's trainer.mixed_precision)" in last_json(printed.out)["decoding"]
    assert "under bfloat16 autocast" in printed.err and made == [torch.bfloat16]
    assert main(["eval", str(run / "final"), "--task", "addition", "--size", "4", "--max-new-tokens", "2"]) == 0
    assert "autocast" not in last_json(capsys.readouterr().out)["decoding"] and made[1:] == [None]


@pytest.mark.parametrize(("overrides", "dtype", "said"), [
    (["model.dtype=bfloat16", "optim.lr=1e-2"], torch.bfloat16, "in bfloat16 (the run's model.dtype)"),
    (["rollout.dtype=bfloat16", "trainer.mixed_precision=bfloat16"], torch.bfloat16,
     "in bfloat16 (the run's rollout.dtype)"),
    (["rollout.dtype=float32", "trainer.mixed_precision=bfloat16"], torch.float32, "under bfloat16 autocast"),
])
def test_eval_of_a_run_decodes_in_the_precision_its_engine_evaluates_in(tmp_path, capsys, monkeypatch, overrides,
                                                                        dtype, said):
    """A run evaluates with its engine: in rollout.dtype (its own copy), else model.dtype, under the autocast only over
    float32 weights. `gspo eval RUN` loaded every model in float32: a bf16 run's accuracy was recomputed in float32
    (its greedy decodes can differ), and a bf16 engine's run was said to decode under autocast."""
    import gspo.evaluation

    made = sampler_autocasts(monkeypatch, gspo.evaluation)
    weights: list[torch.dtype] = []
    real = gspo.evaluation.evaluate

    def spy(model, *args, **kwargs):
        weights.append(next(model.parameters()).dtype)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(gspo.evaluation, "evaluate", spy)
    run = fake_run(tmp_path / "run", *overrides, "trainer.device=cpu")
    assert main(["eval", str(run), "--size", "4", "--max-new-tokens", "2"]) == 0
    decoding = last_json(capsys.readouterr().out)["decoding"]
    assert weights == [dtype] and said in decoding
    assert ("autocast" in decoding) == (dtype == torch.float32) and made == [torch.bfloat16 if dtype == torch.float32
                                                                             else None]


def test_task_options_draw_the_tasks_problems_with_them(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "tiny-moe", "--task", "addition", "--task-options", '{"digits": 2}', "--size", "6",
                 "--max-new-tokens", "2", "--rows-out", str(out)]) == 0
    assert last_json(capsys.readouterr().out)["source"]["task_options"] == {"digits": 2}
    operands = [int(x) for line in out.read_text().splitlines()
                for x in json.loads(line)["prompt"].rstrip("=").split("+")]
    assert operands and max(operands) < 100
    for bad, named in ((["--task-options", "digits=2"], "JSON object"),
                       (["--task-options", '{"digits": 2}', "--data", str(out), "--reward", "addition"], "--data")):
        assert main(["eval", "tiny-moe", *bad]) == 2
        assert named in capsys.readouterr().err


# ----------------------------------------------------------------------------- studies: reuse only the same config


def test_a_finished_run_is_reused_only_with_the_same_config(tmp_path):
    cfg = load_config(DEMO, [f"trainer.out={tmp_path / 'run'}"])
    run = tmp_path / "run"
    assert reusable_run(run, cfg, "compare") is False  # nothing there
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert reusable_run(run, load_config(DEMO, ["trainer.steps=7"]), "compare") is False  # unfinished: resumed
    with pytest.raises(ValueError, match=r"started run .* differs in optim\.lr"):
        reusable_run(run, load_config(DEMO, ["optim.lr=1e-2"]), "compare")
    assert reusable_run(run, load_config(DEMO, ["optim.lr=1e-2"]), "async-study", resume=False) is False
    (run / "summary.json").write_text("{}")
    assert reusable_run(run, cfg, "compare") is True
    assert reusable_run(run, load_config(DEMO, ["trainer.out=moved/run", "model.name=moved/cold"]), "compare")
    with pytest.raises(ValueError, match=r"finished run .* differs in trainer\.steps.*another --out"):
        reusable_run(run, load_config(DEMO, ["trainer.steps=7"]), "compare")


def test_a_finished_run_saved_with_its_eps_resolved_is_reused(tmp_path):
    """A study's finished run saved before derived keys (an objective's eps) were saved as null, i.e. with their
    values, is the same config as one that leaves them unset: reused, not refused as differing in algorithm.eps_*."""
    cfg = load_config(DEMO, [f"trainer.out={tmp_path / 'run'}"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (run / "summary.json").write_text("{}")
    assert reusable_run(run, cfg, "compare") is True


def test_a_cold_start_is_reused_only_when_built_with_the_same_settings(tmp_path, caplog):
    cfg = load_config(DEMO, [])
    target = tmp_path / "cold_start"
    assert reusable_cold_start(target, cfg, "compare") is False
    target.mkdir()
    (target / "sft.json").write_text("{}")
    assert reusable_cold_start(target, cfg, "compare") is True and COLD_START_RECORD in caplog.text  # an old study's
    (target / COLD_START_RECORD).write_text(yaml.safe_dump(config_to_dict(cfg)))
    assert reusable_cold_start(target, load_config(DEMO, ["trainer.steps=9"]), "compare") is True  # RL only
    with pytest.raises(ValueError, match=r"cold start .* differs in cold_start\.steps"):
        reusable_cold_start(target, load_config(DEMO, ["cold_start.steps=9"]), "compare")


def test_compare_refuses_a_finished_run_of_other_settings_before_any_compute(tmp_path, capsys):
    out = tmp_path / "study"
    opts = StudyOptions(out=out, seeds=1, steps=2, precision=False)
    _, runs = study_configs(opts)
    old = load_config(DEMO, [*runs[(0, "gspo")], "trainer.steps=4"])  # what an earlier call with --steps 4 left
    (out / "seed0" / "gspo").mkdir(parents=True)
    (out / "seed0" / "gspo" / "config.yaml").write_text(yaml.safe_dump(config_to_dict(old)))
    (out / "seed0" / "gspo" / "summary.json").write_text("{}")
    assert main(["compare", "--out", str(out), "--seeds", "1", "--steps", "2", "--no-precision"]) == 2
    assert "differs in trainer.steps" in capsys.readouterr().err
    assert not (out / "cold_start").exists()


def test_async_study_refuses_a_finished_run_of_other_settings_before_any_compute(tmp_path, capsys):
    from gspo.experiments.async_study import _run_overrides

    out = tmp_path / "study"
    opts = AsyncStudyOptions(out=out, seeds=1, steps=2)
    old = load_config(DEMO, [*_run_overrides(opts, 0, "sync", str(out / "cold_start")), "trainer.steps=5"])
    (out / "seed0" / "sync").mkdir(parents=True)
    (out / "seed0" / "sync" / "config.yaml").write_text(yaml.safe_dump(config_to_dict(old)))
    (out / "seed0" / "sync" / "summary.json").write_text("{}")
    assert main(["async-study", "--out", str(out), "--seeds", "1", "--steps", "2"]) == 2
    assert "differs in trainer.steps" in capsys.readouterr().err
    assert not (out / "cold_start").exists()


# ------------------------------------------------------------------------------------- verdicts need some data


def summary_of(acc: dict[str, list[float]], clip: dict[str, float]) -> dict:
    return {name: {"per_seed": {str(s): {"mean_accuracy_during_rl": v} for s, v in enumerate(values)},
                   "clip_frac_tokens": clip[name], "expert_volatility": 0.05, "failed_runs": 0, "runs": len(values)}
            for name, values in acc.items()}


def test_no_claim_holds_from_one_seed_or_from_no_clipped_token():
    summary = summary_of({"gspo": [0.0], "grpo": [0.0], "grpo_r2": [0.0], "gspo_token": [0.0]},
                         {"gspo": 0.0, "grpo": 0.0, "grpo_r2": 0.0, "gspo_token": 0.0})
    verdicts = {c["claim"].split(" (")[0]: c for c in claims(summary, list(summary))}
    clip = verdicts["GSPO clips about two orders of magnitude more tokens than GRPO"]
    assert clip["verdict"].startswith("cannot be judged") and "inf" not in clip["evidence"]
    for claim in ("GSPO trains more efficiently than GRPO for the same compute",
                  "GSPO needs no Routing Replay: without it, it does at least as well as GRPO with R2",
                  "GSPO-token with sequence-level advantages behaves as GSPO",
                  "GRPO on an MoE model needs Routing Replay: without it training is unstable or worse"):
        assert verdicts[claim]["verdict"].startswith("cannot be judged (one seed"), claim
        assert "inf" not in verdicts[claim]["evidence"]


def test_async_study_has_no_deviation_for_one_seed():
    assert _mean_std([0.5])["std"] is None and math.isclose(_mean_std([0.2, 0.4])["std"], 0.1414, rel_tol=1e-3)
    assert format_mean_std(_mean_std([0.5]), pct=True) == "50.0% ± n/a (one seed)"


# ------------------------------------------------------------------------------ study arguments, before compute


@pytest.mark.parametrize(("args", "message"), [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--steps", "1"], "--steps must be >= 2"),
    (["data.eval_split=null"], "needs held-out evaluation"),
])
def test_async_study_rejects_bad_settings_before_compute(tmp_path, capsys, args, message):
    out = tmp_path / "study"
    assert main(["async-study", "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_study_folders_that_are_files_and_runs_without_held_out_rows_are_refused(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv in (["compare", "--out", str(afile)], ["async-study", "--out", str(afile)],
                 ["async-study", "--out", str(tmp_path / "s"), "--report-dir", str(afile)]):
        assert main(argv) == 2
        assert "is a file" in capsys.readouterr().err
    assert main(["compare", "--out", str(tmp_path / "c"), "data.eval_split=null"]) == 2
    assert "needs held-out evaluation" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_async_study_report_goes_into_its_out_folder_by_default(tmp_path):
    assert build_parser().parse_args(["async-study"]).report_dir is None
    assert AsyncStudyOptions(out=tmp_path / "s").report_dir == tmp_path / "s"
    assert AsyncStudyOptions(out=tmp_path / "s", report_dir=tmp_path / "docs").report_dir == tmp_path / "docs"

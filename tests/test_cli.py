"""The `gspo` command line, in process (`gspo.cli.main`) with tiny settings, plus `python -m gspo` in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import DEMO, tiny_overrides
from gspo.cli import main
from gspo.config import ConfigError
from gspo.models import load_model
from gspo.tracking import read_metrics


def last_json(text: str) -> dict:
    """The JSON object a command printed last (the summary / result; logging goes to stderr)."""
    start = text.rindex("\n{") + 1 if "\n{" in text else text.index("{")
    return json.loads(text[start:])


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "model"
    assert main(["sft", "--out", str(out), "--steps", "3", "--batch-size", "8", "--size", "64", "--lr", "1e-3"]) == 0
    return out


def test_train_writes_metrics_and_prints_the_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(DEMO), *tiny_overrides(out, "trainer.steps=2")]) == 0
    printed = capsys.readouterr()
    summary = last_json(printed.out)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert summary == json.loads((out / "summary.json").read_text())
    low, high = summary["heldout_accuracy_ci95"]["change"]  # and one line for people, on stderr
    before, after = summary["heldout_accuracy_before_rl"], summary["heldout_accuracy_after_rl"]
    assert (f"held-out accuracy: {before:.1%} before RL → {after:.1%} after RL ({(after - before) * 100:+.1f} points; "
            f"95% CI {low * 100:+.1f} to {high * 100:+.1f} on the same rows)") in printed.err
    assert (out / "final" / "config.json").is_file()
    # the cold start's own effect: the held-out accuracy of the model it began from, and the change it made to the
    # accuracy before RL, on the same rows (the verdicts are in OUT/cold_start/sft.json)
    cold = summary["cold_start"]["before"]
    assert cold["heldout_accuracy_change"] == pytest.approx(before - cold["heldout_accuracy"])
    assert cold["heldout_accuracy_change_ci95"][0] <= cold["heldout_accuracy_change"] <= \
        cold["heldout_accuracy_change_ci95"][1]
    assert len(json.loads((out / "cold_start" / "sft.json").read_text())["before"]["rows"]) == 16
    assert (f"cold start: {cold['heldout_accuracy']:.1%} before → {before:.1%} after "
            f"{summary['cold_start']['steps']} SFT steps") in printed.err

    # a second fresh run into the same folder is refused (exit 2, nothing touched) ...
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", str(DEMO), *tiny_overrides(out, "trainer.steps=2")]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # ... while --resume continues it; options may come before overrides (a finished run has nothing left to do)
    assert main(["train", str(DEMO), "--resume", *tiny_overrides(out, "trainer.steps=2")]) == 0
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    ("override", "named"),
    [("algorithm.lossx=1", "algorithm.lossx"), ("rollout.group_size=1", "rollout.group_size"),
     ("nonsense", "nonsense")],
)
def test_invalid_config_exits_2_before_any_compute(tmp_path, capsys, override, named):
    out = tmp_path / "run"
    assert main(["train", str(DEMO), f"trainer.out={out}", override]) == 2
    err = capsys.readouterr().err
    assert "gspo train: error" in err and named in err
    assert not out.exists()


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["-v", "train", "{missing}"], ["train", "{missing}", "-v"],
                                  ["train", "{missing}", "a.b=1", "--verbose"]])
def test_verbose_goes_before_or_after_the_command(tmp_path, argv):
    """The error hint says 'run with -v for the traceback': `gspo train x.yaml -v` was refused as an unrecognized
    argument (only `gspo -v train x.yaml` worked). With -v the error is raised, traceback and all."""
    with pytest.raises(ConfigError, match="does not exist"):
        main([a.format(missing=tmp_path / "nope.yaml") for a in argv])


def test_without_verbose_a_failure_is_one_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "run with -v for the traceback" in capsys.readouterr().err


def test_unknown_option_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        main(["train", str(DEMO), f"trainer.out={out}", "--bogus"])
    assert info.value.code == 2
    assert "--bogus" in capsys.readouterr().err
    assert not out.exists()


def test_sft_writes_a_loadable_model_dir(sft_dir, capsys):
    assert (sft_dir / "config.json").is_file()
    assert any(sft_dir.glob("*.safetensors"))
    model, tokenizer = load_model(str(sft_dir))
    assert model.config.vocab_size == len(tokenizer)


@pytest.mark.parametrize("micro", [[], ["--micro-batch-tokens", "20"], ["--mixed-precision", "bfloat16"]],
                         ids=["one-forward", "micro-batches", "mixed-precision"])
def test_sft_prints_its_loss(tmp_path, capsys, monkeypatch, micro):
    """`final_loss` is the mean of the last steps' losses, as a run's cold start reports it (it was the last step's
    alone: one batch's loss under the same name)."""
    import gspo.sft

    run, losses = gspo.sft.sft, []
    monkeypatch.setattr(gspo.sft, "sft", lambda *a, **k: losses.extend(run(*a, **k)) or losses)
    out = tmp_path / "m"
    assert main(["sft", "--out", str(out), "--steps", "2", "--batch-size", "4", "--size", "16",
                 "--model", "tiny-dense", *micro]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["out"] == str(out) and math.isfinite(result["final_loss"]) and result["final_loss"] > 0
    assert result["steps"] == len(losses) == 2 and result["final_loss"] == pytest.approx(sum(losses) / 2)
    assert result["lr"] == 3e-3  # a tiny preset's default rate


def test_sft_of_a_pretrained_model_defaults_to_a_rate_it_survives(tmp_path, capsys):
    """The default --lr was the tiny presets' 3e-3 for every model: three steps of it took SmolLM2-135M-Instruct to
    0 % accuracy. A model that is not a preset (a local folder, a hub id) now gets 1e-5; --lr still sets any rate."""
    from gspo.models import build_preset, save_model

    save_model(*build_preset("tiny-dense"), tmp_path / "pretrained")
    for extra, lr in (([], 1e-5), (["--lr", "2e-4"], 2e-4)):
        out = tmp_path / f"m{len(extra)}"
        assert main(["sft", "--out", str(out), "--model", str(tmp_path / "pretrained"), "--steps", "1",
                     "--batch-size", "2", "--size", "4", *extra]) == 0
        assert last_json(capsys.readouterr().out)["lr"] == lr


def test_sft_warns_when_its_warm_up_outlasts_its_steps(tmp_path, capsys, caplog):
    """--steps 2 with the default 10 warm-up steps trained at 10-20 % of --lr without a word; --warmup-steps 0 is the
    way out."""
    args = ["sft", "--out", str(tmp_path / "m"), "--steps", "2", "--batch-size", "4", "--size", "16",
            "--model", "tiny-dense"]
    assert main(args) == 0
    assert "warmup_steps=10 is not below its 2 steps" in caplog.text
    caplog.clear()
    assert main([*args[:2], str(tmp_path / "m2"), *args[3:], "--warmup-steps", "0"]) == 0
    assert "warmup_steps" not in caplog.text


def test_sft_compile_is_refused_for_an_moe_model_before_training(tmp_path, capsys):
    assert main(["sft", "--out", str(tmp_path / "m"), "--model", "tiny-moe", "--compile", "--steps", "2"]) == 2
    assert "--compile: MoE expert dispatch" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("flag", "value"), [("--steps", "0"), ("--micro-batch-tokens", "0"),
                                             ("--warmup-steps", "-1"), ("--lr", "inf"), ("--lr", "nan")])
def test_sft_rejects_bad_arguments(tmp_path, capsys, flag, value):
    assert main(["sft", "--out", str(tmp_path / "m"), flag, value]) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_sft_refuses_an_output_folder_that_holds_a_model_before_loading_one(tmp_path, capsys, monkeypatch):
    """`gspo sft --out DIR` saved over whatever model DIR held (the --model folder itself, a previous run's model, a
    folder's own config.json), silently; other files in a new folder's place are kept, as before."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"mine": 1}')
    (model / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setattr("gspo.models.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    for args in (["--out", str(model)], ["--model", str(model), "--out", str(model)]):
        assert main(["sft", *args, "--steps", "2"]) == 2
        assert f"--out {model} already holds a model (config.json, model.safetensors)" in capsys.readouterr().err
    assert (model / "config.json").read_text() == '{"mine": 1}'
    monkeypatch.undo()
    notes = tmp_path / "new"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    assert main(["sft", "--out", str(notes), "--steps", "1", "--batch-size", "2", "--size", "4",
                 "--model", "tiny-dense"]) == 0
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "config.json").is_file()


def test_sft_refuses_an_output_folder_it_cannot_write_before_loading_a_model(tmp_path, capsys, monkeypatch):
    """Found before the model is loaded and trained (the folder checks a run's trainer.out gets), not when the trained
    model is saved."""
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "model"
    monkeypatch.setattr("gspo.models.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["sft", "--out", str(out), "--steps", "2"]) == 2
    assert f"--out {out} cannot be a folder: {tmp_path / 'afile'} is a file" in capsys.readouterr().err


def test_sft_names_the_file_row_without_a_solution_before_loading_a_model(tmp_path, capsys, monkeypatch):
    rows = [{"prompt": f"{i}+1=", "solution": str(i + 1)} for i in range(30)]
    for i in (7, 20):
        del rows[i]["solution"]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr("gspo.models.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["sft", "--out", str(tmp_path / "m"), "--data", str(data), "--size", "10", "--steps", "2"]) == 2
    assert "row 7 has no 'solution' field, the target SFT trains on (2 of 30 rows have none)" in capsys.readouterr().err


def test_eval_counts_rows_whose_text_the_tokenizer_cannot_encode(tmp_path, capsys, caplog):
    """A training run warned about them (the model sees <unk>); `gspo eval` said nothing."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "1+1=", "answer": "2"},
                                                          {"prompt": "WHAT IS 2+2=", "answer": "4"}]))
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", "addition", "--max-new-tokens", "2"]) == 0
    assert last_json(capsys.readouterr().out)["unknown_character_rows"] == 1
    assert any("of the held-out rows have characters the tokenizer maps to" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("task", ["multiply", "countdown"])
def test_eval_of_each_embedded_task_takes_its_reward(task, capsys):
    """gspo eval --task multiply looked for a reward named 'multiply' ('unknown reward'): each task names its own."""
    assert main(["eval", "tiny-dense", "--task", task, "--size", "4", "--max-new-tokens", "2"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["rows"] == 4 and result["reward_check"]["reference_solved"] == 4  # the verifier fits the task


def test_eval_prints_accuracy(sft_dir, capsys):
    assert main(["eval", str(sft_dir), "--size", "8", "--max-new-tokens", "4"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["rows"] == 8 and result["model"] == str(sft_dir)
    assert 0 <= result["accuracy"] <= 1
    assert 0 <= result["truncation_rate"] <= 1 and result["response_length"] >= 1


def test_eval_decodes_at_most_max_batch_rows_at_once_with_the_same_result(sft_dir, capsys, monkeypatch):
    from gspo.rollout import HFSampler

    results, batches = [], []
    generate = HFSampler.generate

    def counting(self, prompts, group_size, *args, **kwargs):
        batches.append(len(prompts) * group_size)
        return generate(self, prompts, group_size, *args, **kwargs)

    monkeypatch.setattr(HFSampler, "generate", counting)
    for cap in ([], ["--max-batch-rows", "3"]):
        batches.clear()
        assert main(["eval", str(sft_dir), "--size", "8", "--max-new-tokens", "4", *cap]) == 0
        results.append(last_json(capsys.readouterr().out))
    assert batches == [3, 3, 2]
    assert results[0]["accuracy"] == results[1]["accuracy"]
    assert main(["eval", str(sft_dir), "--max-batch-rows", "0"]) == 2
    assert "--max-batch-rows" in capsys.readouterr().err


def test_eval_against_a_baseline_reports_the_paired_change(sft_dir, capsys):
    """--baseline evaluates a second model on the same rows: each accuracy is the one a separate `gspo eval` gives,
    and the change comes with the interval of the paired per-row differences."""
    common = ["--size", "24", "--max-new-tokens", "4", "--reward", "conftest:varied_reward",
              "--accuracy-threshold", "0.5"]
    alone = {}
    for model in (str(sft_dir), "tiny-moe"):
        assert main(["eval", model, *common]) == 0
        alone[model] = last_json(capsys.readouterr().out)
    assert main(["eval", str(sft_dir), "--baseline", "tiny-moe", *common]) == 0
    printed = capsys.readouterr()
    result = last_json(printed.out)
    assert result["accuracy"] == alone[str(sft_dir)]["accuracy"]
    assert result["baseline"]["accuracy"] == alone["tiny-moe"]["accuracy"]
    assert result["baseline"]["accuracy_ci95"] == alone["tiny-moe"]["accuracy_ci95"]
    change = result["accuracy"] - result["baseline"]["accuracy"]
    assert change != 0  # the two models differ here, so the test can see a wrong sign or pairing
    assert result["accuracy_change"] == pytest.approx(change)
    low, high = result["accuracy_change_ci95"]
    assert -1 <= low < high <= 1 and result["accuracy_ci95"][0] <= result["accuracy"] <= result["accuracy_ci95"][1]
    # the same numbers in a line for people, on stderr (stdout stays one JSON document)
    a_low, a_high = result["accuracy_ci95"]
    assert (f"accuracy {result['accuracy']:.1%} (95% CI {a_low:.1%} to {a_high:.1%}) on 24 rows, greedy"
            in printed.err)
    assert (f"baseline {result['baseline']['accuracy']:.1%}: change {change * 100:+.1f} points (paired 95% CI "
            f"{low * 100:+.1f} to {high * 100:+.1f})" in printed.err)


def test_eval_of_a_missing_model_dir_exits_2(tmp_path, capsys):
    missing = tmp_path / "no_model"
    assert main(["eval", str(missing), "--size", "2"]) == 2
    assert str(missing) in capsys.readouterr().err


def test_demo_runs_and_plots(tmp_path, capsys):
    out = tmp_path / "demo"
    overrides = [o for o in tiny_overrides(out) if not o.startswith(("trainer.out=", "trainer.steps="))]
    assert main(["demo", "--out", str(out), "--steps", "1", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy" in printed
    assert (out / "curves.png").stat().st_size > 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]


def test_demo_without_held_out_data_or_cold_start(tmp_path, capsys):
    out = tmp_path / "demo"
    overrides = [o for o in tiny_overrides(out) if not o.startswith(("trainer.out=", "trainer.steps="))]
    assert main(["demo", "--out", str(out), "--steps", "1", *overrides, "data.eval_split=null",
                 "cold_start=null"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_accuracy_before_rl"] is None and summary["heldout_accuracy_after_rl"] is None
    assert "held-out accuracy" not in capsys.readouterr().out
    assert (out / "curves.png").is_file()


def test_demo_names_the_folder_it_wrote_when_trainer_out_is_given_instead_of_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out runs/demo, relative: it must stay empty
    out = tmp_path / "elsewhere"
    overrides = [o for o in tiny_overrides(out) if not o.startswith("trainer.steps=")]
    assert main(["demo", "--steps", "1", *overrides, "cold_start=null"]) == 0
    printed = capsys.readouterr().out
    assert f"model in {out / 'final'}" in printed and f"→ {out}" in printed and "runs/demo" not in printed
    assert "before GSPO →" in printed and "cold-start SFT" not in printed  # there was none
    assert (out / "final").is_dir() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_python_dash_m_gspo_help(argv):
    proc = subprocess.run([sys.executable, "-m", "gspo", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: gspo" in proc.stdout
    if argv == ["--help"]:
        for command in ("demo", "train", "sft", "eval"):
            assert command in proc.stdout

"""Bad inputs a user gives in the first hour (an audit of the CLI, session 18): each is a clear error before compute,
naming what was wrong and where, or is left out and counted — not a crash deep in torch, a model of NaN weights, or a
run started over on top of the old one's records."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gspo.trainer
from conftest import DEMO, tiny_overrides, write_jsonl
from gspo.checkpoint import list_checkpoints
from gspo.cli import main
from gspo.config import ConfigError, config_to_dict, load_config
from gspo.models import load_model
from gspo.parallel import resolve_device
from gspo.preflight import check
from gspo.runfolder import check_resume_config
from gspo.sft import over_positions, sft
from gspo.trainer import train

# ------------------------------------------------------------------------- demonstrations longer than the positions


def test_sft_leaves_out_and_counts_rows_longer_than_the_model_positions(caplog):
    """A learned position embedding (GPT-2, 64 positions) indexed past its end raised `IndexError: index out of
    range in self` from torch.embedding mid-SFT; such rows are now left out with a count, and a data set of only such
    rows is refused."""
    _, tokenizer = load_model("tiny-moe")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2))
    short, long = {"prompt": "1+2=", "solution": "3"}, {"prompt": "12+34=" * 20, "solution": "46"}
    assert len(tokenizer.encode(long["prompt"], add_special_tokens=False)) > 64
    assert over_positions(model, tokenizer, [short, long, short]) == [1]
    with caplog.at_level(logging.WARNING, logger="gspo.sft"):
        losses = sft(model, tokenizer, [short, long], steps=3, batch_size=8, lr=1e-3, warmup_steps=0,
                     progress=False)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert "leaves out 1 of 2 rows" in caplog.text and "row 1 is the first" in caplog.text
    with pytest.raises(ValueError, match=r"every one of the 1 rows.*64 positions"):
        sft(model, tokenizer, [long], steps=1, batch_size=2, lr=1e-3, progress=False)


def test_a_demonstration_that_exactly_fills_the_positions_is_trained_and_one_token_more_is_left_out():
    """Prompt + solution + its end token of exactly max_position_embeddings tokens use positions 0..limit-1: such a
    row fits and trains; one token more (counting the end token) is over the limit."""
    _, tokenizer = load_model("tiny-moe")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=32, n_layer=1, n_head=2))
    prompt = "12+34="
    room = 16 - len(tokenizer.encode(prompt, add_special_tokens=False)) - 1  # the end token takes one position
    fits = {"prompt": prompt, "solution": "4" * room}
    over = {"prompt": prompt, "solution": "4" * (room + 1)}
    assert len(tokenizer.encode(fits["solution"], add_special_tokens=False)) == room
    assert over_positions(model, tokenizer, [fits, over, fits]) == [1]
    losses = sft(model, tokenizer, [fits], steps=1, batch_size=2, lr=1e-3, warmup_steps=0, progress=False)
    assert len(losses) == 1 and math.isfinite(losses[0])


# ------------------------------------------------------------------------------------------------- gspo sft arguments


def test_sft_refuses_an_out_path_that_is_a_file_before_training(tmp_path, capsys):
    """It trained every step and then failed to save, losing the model."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    steps = 100_000  # would run for hours if the check came after training
    assert main(["sft", "--out", str(taken), "--steps", str(steps), "--batch-size", "8", "--size", "16"]) == 2
    assert "--out" in capsys.readouterr().err and taken.read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_command_device_error_names_the_command_option():
    with pytest.raises(ConfigError, match=r"^--device=cuda, but CUDA is not available"):
        resolve_device("cuda", key="--device")
    with pytest.raises(ConfigError, match=r"^trainer\.device=cuda"):
        resolve_device("cuda")


# ------------------------------------------------------------------------------------------------------ cold start


def test_cold_start_uses_a_native_solution_column_and_refuses_rows_without_one_before_the_model(tmp_path,
                                                                                               monkeypatch):
    """A `solution` column needs no mapping (the config used to demand `data.fields={solution: ...}`, which then
    failed on held-out files without one); training rows lacking it are found before any model is built."""
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1), "solution": str(a + 1)} for a in range(40)]
    rows[3]["solution"] = "4" * 300  # longer than tiny-moe's 256 positions: left out, and counted in summary.json
    held = [{"prompt": f"{a}+2=", "answer": str(a + 2)} for a in range(100, 108)]
    overrides = [*tiny_overrides(tmp_path / "run"), "data.task=null", "trainer.steps=1", "trainer.eval_every=0",
                 f"data.path={write_jsonl(tmp_path / 'train.jsonl', rows)}",
                 f"data.eval_path={write_jsonl(tmp_path / 'held.jsonl', held)}"]
    summary = train(load_config(DEMO, overrides))
    assert summary["status"] == "completed" and summary["cold_start"]["steps"] >= 1
    assert summary["cold_start"]["rows"] == 39 and summary["cold_start"]["left_out_over_positions"] == 1

    rows[7].pop("solution")
    write_jsonl(tmp_path / "train.jsonl", rows)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(gspo.trainer, "load_model", no_model)
    with pytest.raises(ConfigError, match=r"1 of 40 training rows have no `solution`.*row 7 first"):
        train(load_config(DEMO, [*overrides, f"trainer.out={tmp_path / 'second'}"]))


# --------------------------------------------------------------------------------------------------------- resuming


@pytest.mark.parametrize(("text", "match"), [("model: [", "not readable YAML"), ("", "holds NoneType"),
                                             ("garbage", "holds str"), (b"\xe9t\xe9: 1", "not readable YAML")])
def test_resume_with_a_damaged_saved_config_is_a_clear_error(tmp_path, text, match):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    cfg_dict = config_to_dict(load_config(DEMO, tiny_overrides(out)))
    with pytest.raises(ConfigError, match=f"cannot resume in .*config.yaml {match}" if "holds" in match
                       else f"cannot resume in .*config.yaml is {match}"):
        check_resume_config(out, cfg_dict)


def test_resume_refuses_when_every_checkpoint_is_damaged_and_keeps_the_run(tmp_path):
    """It used to start the run over from step 0 and rewrite metrics.jsonl, exit 0."""
    out = tmp_path / "run"
    overrides = tiny_overrides(out, "cold_start=null", "trainer.steps=2", "trainer.checkpoint_every=1",
                               "trainer.eval_every=0")
    train(load_config(DEMO, overrides))
    steps = list_checkpoints(out)
    assert steps
    for step_dir in (out / "checkpoints").iterdir():
        weights = step_dir / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    records, saved = (out / "metrics.jsonl").read_bytes(), (out / "config.yaml").read_bytes()
    cfg = load_config(DEMO, [*overrides, "trainer.steps=3"])
    with pytest.raises(ConfigError, match=rf"none of the {len(steps)} checkpoints .* is intact.*--overwrite"):
        check(cfg, resume=True)  # `--check --resume` refuses what the run refuses
    with pytest.raises(ConfigError, match=rf"none of the {len(steps)} checkpoints .* is intact.*--overwrite"):
        train(cfg, resume=True)
    assert (out / "metrics.jsonl").read_bytes() == records
    assert (out / "config.yaml").read_bytes() == saved  # a refused resume writes nothing


def test_a_resume_below_the_checkpoints_step_is_refused_by_check_and_run_before_writing(tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(out, "cold_start=null", "trainer.steps=2", "trainer.checkpoint_every=1",
                               "trainer.eval_every=0")
    train(load_config(DEMO, overrides))
    saved = (out / "config.yaml").read_bytes()
    cfg = load_config(DEMO, [*overrides, "trainer.steps=1"])
    for run in (check, train):
        with pytest.raises(ConfigError, match=r"trainer\.steps=1 is below the step of the checkpoint to resume from "
                                              r"\(2, .*step_00000002\)"):
            run(cfg, resume=True)
        assert (out / "config.yaml").read_bytes() == saved
    assert check(load_config(DEMO, [*overrides, "trainer.steps=3"]), resume=True)["config"]["resume_from"] \
        == "step_00000002"


def test_resume_refuses_a_finished_run_whose_checkpoints_were_deleted(tmp_path):
    """Deleting a finished run's checkpoints to save disk, then `--resume --steps N` to extend it, retrained from step
    0 and replaced its final model and records, with only an INFO line."""
    out = tmp_path / "run"
    overrides = tiny_overrides(out, "cold_start=null", "trainer.steps=2", "trainer.checkpoint_every=1",
                               "trainer.eval_every=0")
    train(load_config(DEMO, overrides))
    shutil.rmtree(out / "checkpoints")
    records = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"holds a finished run \(final/\) but no checkpoint.*model\.name=.*final"):
        train(load_config(DEMO, [*overrides, "trainer.steps=3"]), resume=True)
    assert (out / "metrics.jsonl").read_bytes() == records and (out / "final").is_dir()


def test_gspo_eval_of_a_config_with_relative_data_paths_says_where_they_are_read_from(tmp_path, monkeypatch,
                                                                                      capsys):
    """A run's config names its files as `gspo train` was given them; read from another folder, the error said only
    that 'train.jsonl' does not exist."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    write_jsonl(project / "train.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)])
    write_jsonl(project / "held.jsonl", [{"prompt": f"{a}+2=", "answer": str(a + 2)} for a in range(4)])
    config = project / "config.yaml"
    config.write_text("model: {name: tiny-moe}\ndata: {path: train.jsonl, eval_path: held.jsonl}\n"
                      "rewards: {functions: {addition: 1.0}}\n")
    monkeypatch.chdir(elsewhere)
    assert main(["eval", "tiny-moe", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl" in err and f"read from the current folder ({elsewhere})" in err


def test_gspo_eval_data_leaves_out_and_counts_a_prompt_longer_than_the_model_positions(tmp_path, capsys):
    """One over-long prompt in `gspo eval --data` refused the whole evaluation; training leaves such prompts out
    and counts them, and so does evaluation now (the tiny model has 256 positions)."""
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)] + [{"prompt": "1+" * 200 + "1=",
                                                                              "answer": "201"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", "addition", "--max-new-tokens", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 6 and result["skipped_prompts"] == 1


def test_a_config_that_is_a_folder_or_not_utf8_is_named_as_such(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {name: tiny-moe}\n")
    with pytest.raises(ConfigError, match=r"is a folder, not a YAML file \(a run's config is .*config\.yaml\)"):
        load_config(tmp_path / "run")
    (tmp_path / "latin1.yaml").write_bytes("# caf\u00e9\nmodel: {name: tiny-moe}\n# na\u00efve\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml: line 1 is not UTF-8 text"):
        load_config(tmp_path / "latin1.yaml")


def test_repeated_training_prompts_are_counted_in_the_summary_and_the_check(tmp_path):
    """10 prompts written 3 times each were trained on silently: 20 rows repeat an earlier prompt."""
    from gspo.preflight import check, format_report

    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10)] * 3
    held = [{"prompt": f"{a}+2=", "answer": str(a + 2)} for a in range(100, 108)]
    cfg = load_config(DEMO, [*tiny_overrides(tmp_path / "run"), "data.task=null", "cold_start=null",
                             "trainer.steps=1", "trainer.eval_every=0",
                             f"data.path={write_jsonl(tmp_path / 'train.jsonl', rows)}",
                             f"data.eval_path={write_jsonl(tmp_path / 'held.jsonl', held)}"])
    report = check(cfg)
    assert report["train"]["repeated_prompts"] == 20
    assert any("training rows: 30 from" in line and "(20 repeat an earlier row's prompt)" in line
               for line in format_report(report))
    assert train(cfg)["train"]["repeated_prompts"] == 20


@pytest.mark.parametrize("args", [["--profile", "prof"], ["--sides", "trl"], ["--decode", "dynamic"],
                                  ["--memory-peak", "mem"], ["--release-decode-cache"], ["--measured", "2"]])
def test_the_benchmarks_gpu_flags_are_refused_on_the_cpu_comparison(args):
    """benchmarks/run.py's --device cuda settings did nothing on the CPU comparison, after ~15 minutes of it."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{args[0]}: only with --device cuda" in proc.stderr

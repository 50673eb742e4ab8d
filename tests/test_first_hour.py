"""A new user's first hour with their own data: held-out rows that are held out, an accuracy that means "correct",
`gspo eval` that says what it scored, run folders that forgive a failed start, start-up checks, clean errors, and
the outputs users expect (curves, sample completions, progress in a log file). Each test is a finding of the issue
"Honest numbers on a user's own data" that the code before it got wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEMO, tiny_overrides, write_jsonl
from gspo.cli import main
from gspo.config import ConfigError, DataConfig, config_to_dict, load_config
from gspo.data import TASKS, load_data, load_rows, make_task, near_key, split_by_fraction
from gspo.evaluation import evaluate
from gspo.models import build_preset, load_model
from gspo.rewards import RewardRunner
from gspo.runfolder import check_resume_config
from gspo.tracking import read_metrics
from gspo.trainer import train

GSPO = [sys.executable, "-m", "gspo"]
QUICK = ["cold_start=null", "trainer.eval_every=0", "data.eval_size=8"]




def addition_rows(first: int, count: int) -> list[dict]:
    return [{"question": f"{a}+{a % 7}=", "result": str(a + a % 7)} for a in range(first, first + count)]


def own_data(tmp_path: Path, *extra: str) -> list[str]:
    """Overrides for a user's own jsonl (fields mapped) on the tiny demo settings."""
    train_file = write_jsonl(tmp_path / "train.jsonl", addition_rows(0, 60))
    return [*tiny_overrides(tmp_path / "run", *QUICK), f"data.path={train_file}", "data.task=null",
            'data.fields={prompt: question, answer: result}', *extra]


# ------------------------------------------------------------------------------------------- 1. a real held-out split


def test_a_single_file_has_no_test_split_so_a_run_without_held_out_rows_is_refused(tmp_path):
    """Before, evaluation read the training file's first rows and called them held-out. Now the start fails, says
    how to hold rows out, and leaves nothing behind."""
    with pytest.raises(ValueError, match=r"no split 'test'.*data\.eval_path.*data\.eval_fraction.*eval_split: null"):
        train(load_config(DEMO, own_data(tmp_path)))
    assert not (tmp_path / "run" / "config.yaml").exists()
    with pytest.raises(ValueError, match="no split 'test'"):
        load_rows(str(tmp_path / "train.jsonl"), split="test")


def test_eval_fraction_holds_out_by_prompt_hash_disjoint_and_reported(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(400)] * 2  # every prompt twice
    train_rows, heldout = split_by_fraction(rows, 0.1)
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in heldout}  # disjoint in prompts
    assert 0.05 < len(heldout) / len(rows) < 0.15
    assert split_by_fraction(list(reversed(rows)), 0.1)[1] == list(reversed(heldout))  # order does not matter

    summary = train(load_config(DEMO, own_data(tmp_path, "data.eval_fraction=0.2", "trainer.steps=1")))
    assert summary["heldout"]["kind"] == "eval_fraction" and summary["heldout"]["fraction"] == 0.2
    cfg = load_config(DEMO, own_data(tmp_path, "data.eval_fraction=0.2"))
    data = load_data(cfg.data, seed=0)
    assert summary["heldout"]["rows"] == len(data.heldout) > 0
    assert not {r["prompt"] for r in data.train} & {r["prompt"] for r in data.heldout}


def test_eval_path_rows_that_are_training_prompts_are_left_out_and_counted(tmp_path):
    heldout_file = write_jsonl(tmp_path / "heldout.jsonl", addition_rows(50, 20))  # rows 50-59 are training rows
    summary = train(load_config(DEMO, own_data(tmp_path, f"data.eval_path={heldout_file}", "trainer.steps=1",
                                               "data.eval_size=100")))
    assert summary["heldout"] == {"kind": "eval_path", "path": str(heldout_file), "rows": 10, "of": 10,
                                  "repeated_prompts": 0, "dropped_training_prompts": 10, "accuracy": "addition >= 1"}


def test_a_held_out_prompt_that_differs_from_a_training_prompt_only_in_case_or_spacing_is_not_held_out(tmp_path):
    """Before, only an identical prompt was left out: "What is 7 + 3?" in the training file and "what is 7 +  3? " in
    the held-out one counted as held out, so the model was scored on a problem it trained on. Now prompts are compared
    case-folded with whitespace collapsed (also across the sides of data.eval_fraction, which kept only identical
    prompts together), in conversations too."""
    assert near_key("What is 7 + 3?") == near_key(" what is 7 +  3?\n") != near_key("What is 7 + 4?")
    assert near_key([{"role": "user", "content": "Hi  there"}]) == near_key([{"content": "hi there", "role": "user"}])
    train_rows = [{"q": f"What is {a} + 3?", "a": str(a + 3)} for a in range(40)]
    held = [{"q": f" what is {a} +  3? ", "a": str(a + 3)} for a in range(30, 50)]  # 30-39: training problems
    fields = {"prompt": "q", "answer": "a"}
    data = load_data(DataConfig(path=str(write_jsonl(tmp_path / "t.jsonl", train_rows)),
                                eval_path=str(write_jsonl(tmp_path / "h.jsonl", held)), fields=fields), seed=0)
    assert data.heldout_source["dropped_training_prompts"] == 10 and len(data.heldout) == 10
    assert {near_key(r["prompt"]) for r in data.heldout}.isdisjoint(near_key(r["prompt"]) for r in data.train)

    variants = [{"q": text.format(a), "a": str(a)} for a in range(200) for text in ("Solve {}.", "solve  {}. ")]
    mixed = load_data(DataConfig(path=str(write_jsonl(tmp_path / "m.jsonl", variants)), eval_fraction=0.2,
                                 fields=fields), seed=0)
    assert mixed.heldout_source["dropped_training_prompts"] > 0  # variants that hashed to the other side
    assert {near_key(r["prompt"]) for r in mixed.heldout}.isdisjoint(near_key(r["prompt"]) for r in mixed.train)


def test_held_out_problems_are_distinct_so_none_counts_twice(tmp_path):
    """Before, the demo's 300 held-out problems were 300 draws with replacement from the 1,041 two-digit test
    problems: 261 distinct, four of them counted three times, and an interval that took 300 independent rows. Now a
    task's held-out split draws distinct problems, and a held-out file's repeated prompts (up to case and whitespace)
    are evaluated once and counted (`repeated_prompts`)."""
    drawn = make_task("addition", split="test", size=300, seed=0, digits=2)
    assert len({r["prompt"] for r in drawn}) < 300  # a draw with replacement repeats problems (261 of 300 then)
    demo = load_data(load_config(DEMO).data, seed=0)
    assert len(demo.heldout) == 300 == len({r["prompt"] for r in demo.heldout})
    assert len({TASKS["addition"].key(r) for r in demo.heldout}) == 300  # and no two are one problem (a+b, b+a)
    rows = [*addition_rows(0, 10), {"question": " 3+3= ", "result": "6"}, {"question": "3+3=", "result": "6"}]
    data = load_data(DataConfig(path=str(write_jsonl(tmp_path / "t.jsonl", addition_rows(100, 20))),
                                eval_path=str(write_jsonl(tmp_path / "h.jsonl", rows)),
                                fields={"prompt": "question", "answer": "result"}), seed=0)
    assert len(data.heldout) == 10 and data.heldout_source["repeated_prompts"] == 2
    assert data.heldout_source["rows"] == data.heldout_source["of"] == 10


def test_a_file_is_used_whole_unless_capped_and_a_cap_is_a_sample_not_the_first_rows(tmp_path):
    """Before, data.train_size defaulted to 20000 and eval_size to 200: a user's 25,000-row file lost its last 5,000
    rows and a 1,319-row test set was scored on its first 200, silently; a cap took the first rows, so a file sorted by
    difficulty gave a biased accuracy. Now every row is used unless capped, a cap keeps a sample by prompt hash (the
    same set whatever the file's order), training prompts leave the held-out rows before the cap, and each record
    says how many rows of how many."""
    big = [{"question": f"{a}+{b}=", "result": str(a + b)} for a in range(250) for b in range(100)]  # 25,000 rows
    train_file = write_jsonl(tmp_path / "train.jsonl", big)
    easy = [{"question": f"{a}+0=", "result": str(a), "level": 1} for a in range(300, 500)]
    hard = [{"question": f"{a}+{a}=", "result": str(2 * a), "level": 5} for a in range(300, 500)]
    overlap = big[:50]  # training prompts
    held = write_jsonl(tmp_path / "held.jsonl", easy + hard + overlap)  # sorted by difficulty, easy first
    fields = {"prompt": "question", "answer": "result"}
    data = load_data(DataConfig(path=str(train_file), eval_path=str(held), fields=fields), seed=0)
    assert len(data.train) == 25_000 and data.train_source == {"kind": "path", "path": str(train_file),
                                                                "split": "train", "rows": 25_000, "of": 25_000}
    assert data.heldout_source["rows"] == data.heldout_source["of"] == 400
    assert data.heldout_source["dropped_training_prompts"] == 50

    capped = load_data(DataConfig(path=str(train_file), eval_path=str(held), fields=fields, train_size=1000,
                                  eval_size=100), seed=0)
    assert capped.heldout_source["rows"] == 100 and capped.heldout_source["of"] == 400
    assert capped.train_source["rows"] == 1000 and capped.train_source["of"] == 25_000
    assert 25 <= sum(r["level"] == 5 for r in capped.heldout) <= 75  # a sample of both halves, not the easy prefix
    assert any(int(r["prompt"].split("+")[0]) >= 200 for r in capped.train)  # rows past the old 20,000 cut too
    write_jsonl(held, list(reversed(easy + hard + overlap)))
    shuffled = load_data(DataConfig(path=str(train_file), eval_path=str(held), fields=fields, eval_size=100), seed=0)
    assert {r["prompt"] for r in shuffled.heldout} == {r["prompt"] for r in capped.heldout}  # the order is irrelevant

    summary = train(load_config(DEMO, own_data(tmp_path, f"data.eval_path={held}", "data.eval_size=40",
                                               "data.train_size=30", "trainer.steps=1")))
    assert summary["train"] == {"kind": "path", "path": str(tmp_path / "train.jsonl"), "split": "train", "rows": 30,
                                "of": 60, "passes": 4 / 30}  # own_data rewrote train.jsonl: 60 rows; 1 step of 4
    assert summary["heldout"]["rows"] == 40
    assert summary["heldout"]["of"] + summary["heldout"]["dropped_training_prompts"] == 450


def test_gspo_eval_scores_every_row_of_a_file_unless_told_and_says_of_how_many(tmp_path, capsys):
    """Before, `gspo eval --data FILE` scored the file's first 500 rows, and its line said only "on 500 rows"."""
    rows = [{"prompt": f"{a}+{a % 9}=", "answer": str(a + a % 9)} for a in range(600)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    base = ["eval", "tiny-moe", "--data", str(data), "--reward", "addition", "--max-new-tokens", "2"]
    assert main(base) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rows"] == 600 and "on 600 rows" in captured.err
    assert main([*base, "--size", "50"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["rows"] == 50 and result["source"]["of"] == 600 and "on 50 of 600 rows" in captured.err


def test_gspo_eval_of_a_run_folder_is_its_final_model_on_its_held_out_rows(tmp_path, capsys):
    """`gspo eval RUN` is what a user types first; it failed with "has no config.json". Now it means RUN/final
    with --config RUN/config.yaml (said on stderr), and a run without a final model names what to evaluate."""
    run = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(run, "cold_start=null", "trainer.steps=1", "trainer.eval_every=0")))
    assert main(["eval", str(run / "final"), "--config", str(run / "config.yaml")]) == 0
    explicit = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run), "--baseline", str(run)]) == 0
    captured = capsys.readouterr()
    short = json.loads(captured.out)
    assert f"{run} is a training run: evaluating {run / 'final'}" in captured.err
    assert (short["model"], short["baseline"]["model"]) == (str(run / "final"), str(run / "final"))
    assert short["rows"] == explicit["rows"] == 16 and short["accuracy"] == explicit["accuracy"]
    assert short["accuracy_change"] == 0
    shutil.rmtree(run / "final")
    assert main(["eval", str(run)]) == 2
    assert f"without a final model (it stopped or is still running): name its latest checkpoint, {run}" \
        in capsys.readouterr().err


def test_an_eval_file_that_is_the_training_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="every held-out row's prompt is also a training prompt"):
        train(load_config(DEMO, own_data(tmp_path, f"data.eval_path={tmp_path / 'train.jsonl'}")))


def test_gspo_eval_with_a_split_that_does_not_exist_exits_2(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", "addition", "--split", "nonexistent"]) == 2
    assert "no split 'nonexistent'" in capsys.readouterr().err
    assert main(["eval", "tiny-moe", "--task", "addition", "--split", "nonexistent", "--size", "4"]) == 2


def test_gspo_eval_refuses_a_size_below_1_instead_of_using_the_default(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    for source in (["--data", str(data), "--reward", "addition"], ["--task", "addition"]):
        assert main(["eval", "tiny-moe", *source, "--size", "0"]) == 2
        assert "0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- 2. accuracy means "correct"


def flagged(prompt: str, completion: str, **row) -> float:
    """1 on the rows marked solved, whatever the model wrote: a known accuracy for any model."""
    return 1.0 if row["solved"] else 0.0


def always_one(prompt: str, completion: str, **row) -> float:
    return 1.0


def test_accuracy_does_not_depend_on_the_weights(tmp_path):
    """Same model, same rows: 3 of 8 solved whatever the weights (before: {flagged: 0.5} gave 0 %, and a bonus
    reward of weight 2 made every row "correct")."""
    model, tokenizer = build_preset("tiny-moe")
    rows = [{"prompt": f"{i}+1=", "solved": i < 3} for i in range(8)]
    accuracies = [
        evaluate(model, tokenizer, rows, RewardRunner(weights), 2, accuracy_reward="flagged")["accuracy"]
        for weights in ([(flagged, 1.0)], [(flagged, 0.5)], [(flagged, 1.0), (always_one, 2.0)])
    ]
    assert accuracies == [3 / 8] * 3


def test_several_rewards_without_a_verifier_need_the_accuracy_reward_named():
    with pytest.raises(ConfigError, match=r"rewards\.accuracy_reward: with several reward functions"):
        load_config(None, ["rewards.functions={a.b:c: 1.0, a.b:d: 0.5}"])
    cfg = load_config(None, ["rewards.functions={addition: 0.5, mymod:length: 2.0}"])
    assert cfg.rewards.accuracy_reward == "addition"  # the one built-in verifier
    with pytest.raises(ConfigError, match="'nope' is not one of the reward functions"):
        load_config(None, ["rewards.accuracy_reward=nope"])


# ------------------------------------------------------------------------------------------- 3. gspo eval is honest


def test_gspo_eval_on_a_file_needs_a_reward(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    assert main(["eval", "tiny-moe", "--data", str(data)]) == 2  # before: scored with `addition`, exit 0
    assert "--data needs --reward" in capsys.readouterr().err


def test_gspo_eval_exits_1_when_the_reward_fails_on_every_row(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "gold": "2"}, {"prompt": "2+2=", "gold": "4"}])
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", "addition"]) == 1  # rows have no `answer`
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["rows_with_reward_failures"] == 2 and result["reward_failures"] == {"addition": 2}
    assert "failed on every one of the 2 rows" in captured.err
    # a file that lists a problem twice: kept (--rows-out rows are the file's), but the JSON and a warning say so
    repeated = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"},
                                                   {"prompt": " 1+1= ", "answer": "2"}])
    assert main(["eval", "tiny-moe", "--data", str(repeated), "--reward", "addition"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["rows"] == 3 and result["source"]["repeated_prompts"] == 1
    assert "1 of the 3 rows repeat an earlier row's prompt" in captured.err
    # with --baseline each model's counters are its own, not the sum over both models' calls
    assert main(["eval", "tiny-moe", "--data", str(data), "--reward", "addition", "--baseline", "tiny-dense"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["reward_failures"] == result["baseline"]["reward_failures"] == {"addition": 2}
    assert result["reward_timeouts"] == result["baseline"]["reward_timeouts"] == {"addition": 0}


def test_gspo_eval_checks_its_reward_on_the_rows_own_answers(tmp_path, capsys):
    """A verifier that cannot parse the rows' answers gave 0 % with exit 0: a number that measures nothing. Now
    `gspo eval` scores the rows' own answers too (`gspo.preflight.reward_checks`): none judged solved exits 1, and a
    reward that pays for another row's answer is warned about."""
    (tmp_path / "rw.py").write_text("def boxed(prompt, completion, answer, **row):\n"
                                    "    return float('\\\\boxed{' + answer + '}' in completion)\n"
                                    "def anything(prompt, completion, **row):\n"
                                    "    return float(bool(completion.strip()))\n")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(12)])
    base = ["eval", "tiny-moe", "--data", str(data), "--max-new-tokens", "2"]
    assert main([*base, "--reward", f"{tmp_path / 'rw.py'}:boxed"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["reward_check"]["reference_solved"] == 0
    assert "judges none of the 12 checked rows' own answer solved" in captured.err
    assert main([*base, "--reward", f"{tmp_path / 'rw.py'}:anything"]) == 0
    assert "warning: the accuracy reward judges another row's answer solved on 12 of 12" in capsys.readouterr().err
    assert main([*base, "--reward", "addition"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_gspo_eval_reuses_a_training_config(tmp_path, capsys):
    heldout_file = write_jsonl(tmp_path / "heldout.jsonl", addition_rows(100, 12))
    overrides = own_data(tmp_path, f"data.eval_path={heldout_file}", "trainer.steps=1", "data.eval_size=12")
    summary = train(load_config(DEMO, overrides))
    run = tmp_path / "run"
    assert main(["eval", str(run / "final"), "--config", str(run / "config.yaml")]) == 0  # its eval_size: 12
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 12 and result["source"]["kind"] == "eval_path"
    assert result["accuracy"] == summary["heldout_accuracy_after_rl"]  # the same rows, rewards and decoding
    assert main(["eval", str(run / "final"), "--config", str(run / "config.yaml"), "--data", "x.jsonl"]) == 2


# --------------------------------------------------------------------------------------- 4. run folders that forgive


def test_a_failed_start_does_not_block_the_corrected_command(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK, "trainer.steps=1", "model.name=tiny-moee")]) == 2
    assert "tiny-moee" in capsys.readouterr().err
    assert not (out / "config.yaml").exists()
    assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK, "trainer.steps=1")]) == 0


def test_overwrite_starts_over_and_keeps_the_users_files(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK, "trainer.steps=1")]) == 0
    (out / "notes.txt").write_text("mine")
    assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK, "trainer.steps=2")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["train", str(DEMO), "--overwrite", *tiny_overrides(out, *QUICK, "trainer.steps=2")]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_accepts_what_does_not_change_the_math_and_names_what_it_refuses(tmp_path):
    base = [*QUICK, "trainer.checkpoint_every=1", "trainer.device=cpu"]
    train(load_config(DEMO, tiny_overrides(tmp_path / "run", *base, "trainer.steps=2")))
    moved = tmp_path / "moved"
    (tmp_path / "run").rename(moved)  # a moved folder, more steps, other threads, logging, memory settings: accepted
    memory = ["trainer.micro_batch_tokens=32", "trainer.gradient_checkpointing=true", "rollout.max_batch_rows=8"]
    summary = train(load_config(DEMO, tiny_overrides(moved, *base, "trainer.steps=3", "trainer.threads=2",
                                                     "log.progress=true", "trainer.eval_every=1", *memory)),
                    resume=True)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert [r["step"] for r in read_metrics(moved / "metrics.jsonl")] == [1, 2, 3]
    assert yaml.safe_load((moved / "config.yaml").read_text())["trainer"]["steps"] == 3
    with pytest.raises(ConfigError, match=r"differs in optim\.lr, rollout\.group_size, which would change the "
                                          r"training math or what its evaluations measure \(a resume may change only: "
                                          r"trainer\.steps"):
        train(load_config(DEMO, tiny_overrides(moved, *base, "trainer.steps=4", "optim.lr=1e-3",
                                               "rollout.group_size=2")), resume=True)
    with pytest.raises(ConfigError, match="can extend a run, not shorten it"):
        train(load_config(DEMO, tiny_overrides(moved, *base, "trainer.steps=2")), resume=True)


def test_a_resume_with_other_held_out_rows_does_not_claim_a_change_on_the_same_rows(tmp_path, capsys):
    """The held-out file edited between a run and its resume: before and after RL are then on different rows, so the
    summary says so, reports no paired interval, and the printed line does not claim "on the same rows". An edited
    training file is said too (`train.changed_on_resume`)."""
    heldout = write_jsonl(tmp_path / "heldout.jsonl", addition_rows(100, 8))
    args = own_data(tmp_path, f"data.eval_path={heldout}", "trainer.checkpoint_every=1", "trainer.eval_every=1")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    assert main(["train", str(cfg), *args, "trainer.steps=2"]) == 0
    first = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert first["heldout_same_rows"] is True and first["heldout_accuracy_ci95"]["change"] is not None
    assert "on the same rows" in capsys.readouterr().err  # the line for people (stdout is the summary's JSON)
    write_jsonl(heldout, addition_rows(200, 8))
    assert main(["train", str(cfg), *args, "trainer.steps=3", "--resume"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["heldout_same_rows"] is False and summary["heldout_accuracy_ci95"]["change"] is None
    line = capsys.readouterr().err
    assert "NOT on the same rows" in line and "on the same rows)" not in line.replace("NOT on the same rows", "")
    assert "changed_on_resume" not in summary["train"]  # the training rows are those the run began with
    write_jsonl(tmp_path / "train.jsonl", addition_rows(300, 60))  # now they are not: said, not silently trained on
    assert main(["train", str(cfg), *args, "trainer.steps=4", "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["train"]["changed_on_resume"] is True


def test_a_resume_may_change_the_cold_starts_micro_batch_budget_not_its_batch(tmp_path):
    """The saved config of a run with a cold start against a new one (`check_resume_config`, what `--resume` runs)."""
    saved = load_config(DEMO, tiny_overrides(tmp_path))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(saved)))
    budget = load_config(DEMO, tiny_overrides(tmp_path, "cold_start.micro_batch_tokens=64"))
    assert check_resume_config(tmp_path, config_to_dict(budget)) == ["cold_start.micro_batch_tokens"]
    batch = load_config(DEMO, tiny_overrides(tmp_path, "cold_start.batch_size=8"))
    with pytest.raises(ConfigError, match=r"differs in cold_start\.batch_size"):
        check_resume_config(tmp_path, config_to_dict(batch))


# ------------------------------------------------------------------------------------------------ 5. start-up checks


def test_data_path_alone_means_no_task():
    assert load_config(None, ["data.path=mine.jsonl"]).data.task is None
    with pytest.raises(ConfigError, match=r"set only one of data\.task \('addition'\) and data\.path"):
        load_config(None, ["data.path=mine.jsonl", "data.task=addition"])


def test_a_reward_module_in_the_working_directory_is_found_by_the_gspo_command(tmp_path):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        def exact(prompt, completion, **row):
            return float(completion.strip() == row["answer"])
    '''))
    train_file = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)}
                                                        for i in range(40)])
    gspo = Path(sys.executable).parent / "gspo"  # the console script: no cwd on sys.path (unlike python -m)
    proc = subprocess.run([str(gspo), "train", str(DEMO), *tiny_overrides(tmp_path / "run", *QUICK),
                           "trainer.steps=1", f"data.path={train_file}", "data.task=null", "data.eval_split=null",
                           "rewards.functions={my_rewards:exact: 1.0}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


def no_row_kwargs(prompt: str, completion: str) -> float:
    return 0.0


def test_a_reward_without_row_keywords_is_refused_at_start_with_the_expected_signature(tmp_path, monkeypatch):
    from gspo.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "no_row_kwargs", no_row_kwargs)
    with pytest.raises(ValueError, match=r"reward 'no_row_kwargs' cannot be called with a data row .*"
                                         r"def reward\(prompt: str, completion: str, \*\*row\)"):
        train(load_config(DEMO, tiny_overrides(tmp_path / "run", *QUICK, "rewards.functions={no_row_kwargs: 1}")))
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before any model was built or file written


def test_a_reward_named_by_file_path(tmp_path):
    module = tmp_path / "scoring.py"
    module.write_text("def half(prompt, completion, **row):\n    return 0.5\n")
    runner = RewardRunner({f"{module}:half": 1.0})
    assert runner(["p"], ["c"], [{}])[0].tolist() == [0.5]


def test_a_duplicate_yaml_section_is_an_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  out: runs/a\nrollout:\n  group_size: 4\ntrainer:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'trainer' \\(first at line 1\\)"):
        load_config(config)


def test_characters_a_preset_tokenizer_cannot_encode_are_warned_and_counted(tmp_path, caplog):
    train_file = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"What is {i}+1?\n", "answer": str(i + 1)}
                                                        for i in range(30)] + [{"prompt": "2+2=", "answer": "4"}])
    overrides = [*tiny_overrides(tmp_path / "run", *QUICK), "trainer.steps=1", f"data.path={train_file}",
                 "data.task=null", "data.eval_split=null"]
    with caplog.at_level("WARNING", logger="gspo.trainer"):
        summary = train(load_config(DEMO, overrides))
    assert summary["unknown_character_rows"] == {"train": 30, "eval": 0}
    warnings = [r.getMessage() for r in caplog.records if "<unk>" in r.getMessage()]
    assert len(warnings) == 1 and "'W'" in warnings[0] and "'\\n'" in warnings[0]


# ----------------------------------------------------------------------------------------- 8. clean one-line errors


def test_an_output_path_that_is_a_file_or_unwritable_is_a_one_line_error(tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("")
    for out, said in ((a_file, "is a file"), (a_file / "run", "is a file"), (Path("/sys/gspo-run"), "not writable")):
        assert main(["train", str(DEMO), *tiny_overrides(out, *QUICK)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_missing_tracker_package_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    import gspo.trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the missing package was noticed")

    monkeypatch.setattr(gspo.trainer, "load_model", no_model)
    for logger in ("wandb", "mlflow"):
        if __import__("importlib.util").util.find_spec(logger) is not None:
            continue  # installed here: nothing to refuse
        assert main(["train", str(DEMO), *tiny_overrides(tmp_path / "run", *QUICK, f"log.{logger}={{}}")]) == 2
        err = capsys.readouterr().err
        assert f"log.{logger}" in err and f"pip install 'gspo[{logger}]'" in err


def test_ctrl_c_ends_with_a_resume_hint_and_exit_130(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT back to its default in the child, as at a terminal: a suite started as a background job of a
    # non-interactive shell (`cmd &`) inherits it ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([*GSPO, "train", str(DEMO), *tiny_overrides(out, *QUICK, "trainer.steps=500",
                                                                        "trainer.checkpoint_every=1")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not ((out / "metrics.jsonl").exists()
                                               and len(read_metrics(out / "metrics.jsonl")) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert last.startswith("gspo train: interrupted at step") and "last checkpoint is step" in last
    assert last.endswith("--resume")


@pytest.mark.parametrize("command", ["train", "demo"])
def test_the_resume_hint_is_the_command_that_was_run_as_shell_words(command):
    """The demo's hint dropped --steps and every override (the pasted command was refused, or silently trained 400
    steps); the train hint lost the quoting of an override with spaces ("model.lora={r: 4, alpha: 8}")."""
    import argparse
    import shlex

    from gspo.cli import _resume_hint

    overrides = ["model.lora={r: 4, alpha: 8}", "rollout.group_size=4"]
    args = argparse.Namespace(command=command, config="my run.yaml", overrides=overrides, out="runs/x y", steps=6)
    error = KeyboardInterrupt()
    error.step, error.checkpoint_step = 3, 2
    hint = _resume_hint(args, error)
    assert hint.startswith(" at step 3; its last checkpoint is step 2. Continue with: ")
    words = shlex.split(hint.split("Continue with: ", 1)[1])
    head = ["train", "my run.yaml"] if command == "train" else ["demo", "--out", "runs/x y", "--steps", "6"]
    assert words == ["gspo", *head, *overrides, "--resume"]


# ---------------------------------------------------------------------------------------- 9. what users expect


def test_gspo_train_writes_curves_samples_and_progress_lines_to_a_log_file(tmp_path):
    out = tmp_path / "run"
    log_file = tmp_path / "train.log"
    with open(log_file, "w") as handle:  # not a terminal: no bar, progress lines instead
        proc = subprocess.run([*GSPO, "train", str(DEMO), *tiny_overrides(out, "cold_start=null", "trainer.steps=4",
                                                                          "log.progress=true", "log.samples=3",
                                                                          "log.tensorboard=true")],
                              stdout=handle, stderr=subprocess.STDOUT, timeout=300)
    text = log_file.read_text()
    assert proc.returncode == 0, text[-2000:]
    assert (out / "curves.png").stat().st_size > 0
    samples = read_metrics(out / "samples.jsonl")
    assert [s["step"] for s in samples] == [0] * 3 + [2] * 3 + [4] * 3
    assert set(samples[0]) >= {"prompt", "completion", "reward", "correct", "answer"}
    for step in (1, 2, 3, 4):
        assert f"train {step}/4 ({step / 4:.0%})" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0}).Reload()
    assert "heldout_samples/text_summary" in events.Tags()["tensors"]
    # the held-out accuracy curve starts before RL (step 0, as in eval.jsonl); metrics.jsonl keeps RL steps only
    evals = read_metrics(out / "eval.jsonl")
    assert [e.step for e in events.Scalars("heldout_accuracy")] == [e["step"] for e in evals] == [0, 2, 4]
    curve = [e.value for e in events.Scalars("heldout_accuracy")]
    assert curve == pytest.approx([e["heldout_accuracy"] for e in evals])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_held_out_accuracy_is_what_the_samples_say(tmp_path):
    """The logged samples and their verdicts agree with the accuracy reward (not with a weighted sum)."""
    train(load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.steps=1",
                                           "log.samples=16", "data.eval_size=16")))
    samples = read_metrics(tmp_path / "run" / "samples.jsonl")
    evals = read_metrics(tmp_path / "run" / "eval.jsonl")
    for step in (0, 1):
        verdicts = [s["correct"] for s in samples if s["step"] == step]
        assert len(verdicts) == 16
        assert sum(verdicts) / 16 == pytest.approx(next(e for e in evals if e["step"] == step)["heldout_accuracy"])
    torch.testing.assert_close(torch.tensor([s["reward"] for s in samples if s["step"] == 1]).mean(),
                               torch.tensor(evals[-1]["heldout_reward_mean"]))


def test_trainer_epochs_is_passes_over_the_training_rows_and_every_run_says_how_many(tmp_path):
    """trainer.epochs: 1 is 60 rows / 4 prompts = 15 steps whose prompts are each training row once; a run given in
    steps reports its passes over the rows too (summary.json train.passes)."""
    summary = train(load_config(DEMO, [*own_data(tmp_path, "data.eval_fraction=0.2", "log.rollouts=16",
                                                 "trainer.epochs=1"), "trainer.steps=null"]))
    rows = summary["train"]["rows"]
    assert summary["steps"] == -(-rows // 4)  # ceil(1 × rows / 4)
    assert summary["train"]["passes"] == pytest.approx(summary["steps"] * 4 / rows)
    drawn = [r["prompt"] for r in read_metrics(tmp_path / "run" / "rollouts.jsonl") if r["group"] in range(4)]
    prompts = [p for i, p in enumerate(drawn) if i % 4 == 0]  # each group's 4 completions share their prompt
    first_pass = prompts[:rows]
    assert len(first_pass) == len(set(first_pass)) == rows  # each training row once
    cfg = load_config(DEMO, own_data(tmp_path, "data.eval_fraction=0.2", "trainer.steps=3"))
    assert cfg.trainer.steps == 3 and cfg.trainer.epochs is None
    with pytest.raises(ConfigError, match=r"set one of trainer\.steps \(3\) and trainer\.epochs \(1\)"):
        load_config(DEMO, own_data(tmp_path, "trainer.steps=3", "trainer.epochs=1"))
    assert load_config(None, []).trainer.steps == 100


LATER = '''
CALLS = [0]

def later(prompt: str, completion: str, **row) -> float:
    """0 for the first 8 calls (the first evaluation's 8 rows), 1 after: the held-out accuracy rises at step 1."""
    CALLS[0] += 1
    return float(CALLS[0] > 8)
'''


def test_save_best_keeps_the_policy_of_the_best_evaluation_and_says_it_is_optimistic(tmp_path):
    """trainer.save_best: OUT/best is the policy of the evaluation with the highest held-out accuracy (here step 1:
    0 % at step 0, 100 % at steps 1 and 2; a tie keeps the earlier), the weights of that step's checkpoint, while
    OUT/final is step 2's; summary.json names its step and warns that the accuracy that chose it is optimistic."""
    from safetensors.torch import load_file

    (tmp_path / "rw.py").write_text(LATER)
    out = tmp_path / "run"
    summary = train(load_config(DEMO, tiny_overrides(
        out, "cold_start=null", "data.eval_size=8", "trainer.steps=2", "trainer.eval_every=1",
        "trainer.checkpoint_every=1", "trainer.save_best=true", "optim.lr=3e-3", "rewards.check=false",  # counted
        f"rewards.functions={{conftest:varied_reward: 1.0, {tmp_path / 'rw.py'}:later: 0.0}}",
        f"rewards.accuracy_reward={tmp_path / 'rw.py'}:later")))
    assert [e["heldout_accuracy"] for e in read_metrics(out / "eval.jsonl")] == [0.0, 1.0, 1.0]
    assert summary["best"]["step"] == 1 and summary["best"]["heldout_accuracy"] == 1.0
    assert "optimistic" in summary["best"]["note"]
    best, final = (load_model(str(out / name))[0].state_dict() for name in ("best", "final"))
    step1 = load_file(out / "checkpoints" / "step_00000001" / "model" / "model.safetensors")  # the raw state dict
    assert step1.keys() <= best.keys() and all(torch.equal(best[k], step1[k]) for k in step1)  # lm_head: tied
    assert any(not torch.equal(best[k], final[k]) for k in best)  # step 2 trained on
    with pytest.raises(ConfigError, match="nothing is held out"):
        load_config(DEMO, ["trainer.save_best=true", "data.eval_split=null"])


def test_data_kept_where_the_run_writes_its_own_files_is_refused_before_it_is_lost(tmp_path, capsys):
    """A held-out file named eval.jsonl in trainer.out (a project folder used as the run folder) was read, then
    replaced by the run's evaluation log: `--check` said 0 warnings and the run exited 0 with the data gone. Any
    input at or inside a path the run writes (RUN_FILES) is refused, before any compute, the file untouched."""
    out = tmp_path / "run"
    out.mkdir()
    rows = "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10))
    (out / "eval.jsonl").write_text(rows)
    (tmp_path / "train.jsonl").write_text(rows.replace("+", "+1"))  # other prompts
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    args = [*tiny_overrides(out, *QUICK), "data.task=null"]
    for flags in (["--check"], [], ["--overwrite"]):
        assert main(["train", str(cfg), *flags, *args, f"data.path={tmp_path / 'train.jsonl'}",
                     f"data.eval_path={out / 'eval.jsonl'}"]) == 2
        err = capsys.readouterr().err
        assert "data.eval_path" in err and "the run's own 'eval.jsonl'" in err and "would be lost" in err
        assert (out / "eval.jsonl").read_text() == rows
        assert [p.name for p in out.iterdir()] == ["eval.jsonl"]
    (out / "final").mkdir()
    (out / "final" / "train.jsonl").write_text(rows)
    assert main(["train", str(cfg), "--check", *args, f"data.path={out / 'final' / 'train.jsonl'}",
                 "data.eval_fraction=0.2"]) == 2
    assert "is inside the run's own 'final'" in capsys.readouterr().err
    # a data folder holding trainer.out: the run's eval.jsonl joined the folder's test split (`eval` is one of its
    # names), and the next run or a resume failed to load the folder ("CastError") or read the log as rows
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(rows.replace("+", "+1"))
    (tmp_path / "data" / "test.jsonl").write_text(rows)
    assert main(["train", str(cfg), "--check", *tiny_overrides(tmp_path / "data" / "runs" / "x", *QUICK),
                 "data.task=null", f"data.path={tmp_path / 'data'}"]) == 2
    assert "is inside the data folder" in capsys.readouterr().err


def test_a_users_config_kept_in_trainer_out_is_not_replaced(tmp_path):
    """A config written by hand inside trainer.out (`gspo train runs/x/config.yaml trainer.out=runs/x`) was replaced by
    the run's resolved config, comments and all, and --overwrite would delete it: refused before any compute. A
    config.yaml gspo wrote (a failed start's, a finished run's) is its own and is replaced as before."""
    out = tmp_path / "run"
    out.mkdir()
    mine = DEMO.read_text() + "# my notes on this run\n"
    (out / "config.yaml").write_text(mine)
    for flags in ({}, {"overwrite": True}, {"resume": True}):  # --resume of a folder without a run is a start
        with pytest.raises(ConfigError, match=r"holds a config\.yaml that gspo did not write"):
            train(load_config(out / "config.yaml", tiny_overrides(out, *QUICK)), **flags)
        assert (out / "config.yaml").read_text() == mine and sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    (out / "config.yaml").unlink()
    cfg = load_config(DEMO, tiny_overrides(out, *QUICK, "trainer.steps=1"))
    train(cfg)
    saved = (out / "config.yaml").read_text()
    assert train(load_config(out / "config.yaml"), overwrite=True)["status"] == "completed"  # gspo's own: replaced
    assert (out / "config.yaml").read_text() == saved

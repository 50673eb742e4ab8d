"""Bad reward functions get a clear error naming them, or are isolated and counted; never a silent exit.

A reward that calls sys.exit() while scoring is that function's failure (named, with the row), not the end of the
process; one that calls sys.exit() (argparse) at import is a reward error, not a gspo usage error; a local file named
like a standard-library module is said to be shadowed; a reward that fails on every row's own answer stops a
rewards.on_error=fail run before any compute, with the function and its first exception named."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import DEMO, tiny_overrides
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.rewards import RewardFailure, RewardRunner, batched, resolve_reward
from gspo.rewards.checks import (
    RewardCheckFailed,
    reference_text,
    reward_checks,
    reward_warnings,
    split_warnings,
)
from gspo.trainer import train

ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]


def exits(prompt: str, completion: str, **row) -> float:
    sys.exit(3)


def interrupted(prompt: str, completion: str, **row) -> float:
    raise KeyboardInterrupt


def raises(prompt: str, completion: str, **row) -> float:
    raise RuntimeError("boom")


def exact(prompt: str, completion: str, answer: str, **row) -> float:
    return float(completion.strip() == answer)


def strict(prompt: str, completion: str, answer: str, **row) -> float:
    """Right on the references, but int("") raises on an empty completion."""
    return float(int(completion) == int(answer))


def score(runner: RewardRunner, completions: list[str]) -> tuple:
    rows = ROWS[: len(completions)]
    return runner([r["prompt"] for r in rows], completions, rows)


# ------------------------------------------------------------------------------------------- sys.exit while scoring


@pytest.mark.parametrize("timeout_s", [None, 5.0])  # called inline, and in the deadline pool's threads
def test_sys_exit_in_a_reward_is_its_named_failure_in_fail_mode(timeout_s):
    runner = RewardRunner([(exits, 1.0)], on_error="fail", timeout_s=timeout_s)
    with pytest.raises(RewardFailure, match=r"'exits' failed on row 0: called sys\.exit\(3\)") as info:
        score(runner, ["2"])
    assert isinstance(info.value.__cause__, SystemExit)
    assert runner.failures == {"exits": 1}


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_sys_exit_in_a_reward_is_isolated_and_counted_in_zero_mode(timeout_s):
    runner = RewardRunner([(exits, 1.0), (exact, 1.0)], on_error="zero", timeout_s=timeout_s)
    rewards, stats = score(runner, ["1", "3", "x"])
    assert rewards.tolist() == [1.0, 0.0, 0.0]  # the other function's scores are kept
    assert stats["reward_failures"] == 3 and runner.failures == {"exits": 3, "exact": 0}


def test_sys_exit_in_a_batched_reward_fails_its_batch_rows():
    runner = RewardRunner([(batched(lambda prompts, completions, **cols: sys.exit(1)), 1.0)], on_error="zero")
    _, stats = score(runner, ["1", "2"])
    assert stats["reward_failures"] == 2


@pytest.mark.parametrize("on_error", ["fail", "zero"])
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_ctrl_c_in_a_reward_still_stops_the_run(on_error, timeout_s):
    with pytest.raises(KeyboardInterrupt):
        score(RewardRunner([(interrupted, 1.0)], on_error=on_error, timeout_s=timeout_s), ["1"])


def test_a_model_program_that_exits_is_a_wrong_answer_for_the_code_reward_not_a_failure():
    """The sandbox runs the program in another process: its sys.exit is an exit status (score 0), never a SystemExit
    in the trainer."""
    runner = RewardRunner({"code": 1.0}, on_error="fail", timeout_s=30)
    rewards, stats = runner(["p"], ["import sys\nsys.exit(0)\n"], [{"tests": "assert True"}])
    assert rewards.tolist() == [0.0] and stats["reward_failures"] == 0


# ------------------------------------------------------------------------------------------- sys.exit at import


ARGPARSE = "import argparse\np = argparse.ArgumentParser()\np.add_argument('--data', required=True)\n" \
           "args = p.parse_args()\ndef score(prompt, completion, **row): return 0.0\n"


@pytest.mark.parametrize("form", ["file", "module"])
def test_a_reward_module_that_exits_at_import_is_a_named_reward_error(tmp_path, monkeypatch, form):
    name = f"argparse_rw_{form}"
    (tmp_path / f"{name}.py").write_text(ARGPARSE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gspo", "train", "c.yaml"])
    spec = f"{tmp_path / name}.py:score" if form == "file" else f"{name}:score"
    with pytest.raises(ValueError, match=r"importing module .* called sys\.exit\(2\) \(does it parse command-line"):
        resolve_reward(spec)
    assert name not in sys.modules  # a failed import leaves nothing behind: a fixed file loads on the next try
    (tmp_path / f"{name}.py").write_text("def score(prompt, completion, **row): return 0.0\n")
    assert resolve_reward(spec)("p", "c") == 0.0


def test_gspo_train_says_the_reward_module_exited_not_that_gspo_was_misused(tmp_path, capsys):
    (tmp_path / "argparse_rw_cli.py").write_text(ARGPARSE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    code = main(["train", str(cfg), "--check", *tiny_overrides(tmp_path / "run", "cold_start=null"),
                 f"rewards.functions={{{tmp_path / 'argparse_rw_cli.py'}:score: 1.0}}"])
    err = capsys.readouterr().err
    assert code == 2 and "called sys.exit(2)" in err and "argparse_rw_cli.py" in err
    assert "gspo train: error: reward" in err


# --------------------------------------------------------------------------------- a local file named like stdlib


def test_a_local_file_named_like_a_stdlib_module_is_said_to_be_shadowed(tmp_path, monkeypatch):
    (tmp_path / "code.py").write_text("def exact(prompt, completion, answer, **row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"not \./code\.py.*name the file instead \(code\.py:exact\)"):
        resolve_reward("code:exact")
    assert resolve_reward("code.py:exact")("p", "c", answer="1") == 1.0  # the form the message suggests works


def test_a_missing_function_in_the_users_own_module_gets_no_shadowing_note(tmp_path, monkeypatch):
    (tmp_path / "own_rw_module.py").write_text("def other(prompt, completion, **row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="has no attribute 'exact'") as info:
        resolve_reward("own_rw_module:exact")
    assert "Note" not in str(info.value)


# ------------------------------------------------------------------------------ failures on the known answers


def test_a_reward_failing_on_every_reference_stops_a_fail_mode_run_naming_it_and_its_exception():
    runner = RewardRunner([(raises, 1.0)], on_error="fail")
    before = runner.state_dict()
    with pytest.raises(RewardCheckFailed, match=r"'raises' fails on all 8 .*row 0 .*RuntimeError: boom") as info:
        reward_checks(runner, ROWS, "raises", 1.0)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, RewardFailure)  # exit 2; what a run raises
    assert runner.state_dict() == before and runner.on_error == "fail"  # the check's calls are not the run's


def test_sys_exit_on_every_reference_stops_a_fail_mode_run_too():
    with pytest.raises(RewardCheckFailed, match=r"'exits' .*called sys\.exit\(3\)"):
        reward_checks(RewardRunner([(exits, 1.0)], on_error="fail"), ROWS, "exits", 1.0)


def test_failures_are_one_warning_per_function_naming_it_and_its_first_exception():
    """Zero mode: not fatal, but one line per function for both splits (was six unnamed lines), and a failed
    verdict is not also reported as an answer judged wrong."""
    runner = RewardRunner([(raises, 1.0), (strict, 1.0)], on_error="zero")
    found = {split: reward_checks(runner, ROWS, "strict", 1.0) for split in ("train", "heldout")}
    lines = split_warnings(found)
    assert len(lines) == 2, lines
    assert sum("'raises'" in line for line in lines) == sum("'strict'" in line for line in lines) == 1
    boom = next(line for line in lines if "'raises'" in line)
    assert "RuntimeError: boom" in boom and "8 of 8 training rows' own answer" in boom
    assert "8 of 8 held-out rows' own answer" in boom and "counted and scored 0" in boom
    assert "ValueError" in next(line for line in lines if "'strict'" in line)
    assert found["train"]["reference_solved"] == 8 and found["train"]["failures"]["raises"]["reference"]["rows"] == 8
    json.dumps(found)  # summary.json keeps it


def test_a_reward_failing_on_some_references_is_a_warning_in_fail_mode():
    def half(prompt: str, completion: str, answer: str, **row) -> float:
        if int(answer) % 2:
            raise KeyError("odd")
        return float(completion == answer)

    found = reward_checks(RewardRunner([(half, 1.0)], on_error="fail"), ROWS, "half", 1.0)
    assert found["reference_wrong"] == 0  # the failed rows are failures, not answers judged wrong
    (line,) = reward_warnings(found, "training")
    assert "'half' fails on 4 of 8 training rows' own answer" in line and "KeyError: 'odd'" in line
    assert "on_error=fail a run stops" in line


def test_a_fail_mode_run_whose_reward_fails_on_every_answer_stops_before_any_compute(tmp_path, capsys):
    (tmp_path / "bad_rw.py").write_text("def raises(prompt, completion, **row):\n    raise RuntimeError('boom')\n")
    args = [*tiny_overrides(tmp_path / "run", "cold_start=null"),
            f"rewards.functions={{{tmp_path / 'bad_rw.py'}:raises: 1.0}}"]
    with pytest.raises(RewardCheckFailed, match="boom"):
        train(load_config(DEMO, args))
    assert not [p for p in (tmp_path / "run").rglob("*")]  # no config, metrics or evaluation written
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    assert main(["train", str(cfg), "--check", *args]) == 2
    err = capsys.readouterr().err
    assert "bad_rw.py:raises' fails on all" in err and "RuntimeError: boom" in err


def test_a_row_lacking_a_field_the_reward_requires_is_refused_before_compute_naming_it(tmp_path, capsys):
    """Before, only the first row's fields were checked against each reward's signature: a later row without the
    `answer` that `exact` requires passed `--check` with no warning, and the run stopped with a TypeError at the
    first step that drew it, after the first evaluation had been computed and written."""
    runner = RewardRunner([(exact, 1.0)])
    with pytest.raises(ValueError, match=r"training row 2: reward 'exact' cannot be called .*'answer'"):
        runner.check_rows([*ROWS[:2], {"prompt": "5+1="}, *ROWS[2:]], where="training row")
    runner.check_rows(ROWS, where="training row")  # every row has it: nothing to say
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS[:3], {"prompt": "9+1="}, *ROWS[3:]]))
    (tmp_path / "rw.py").write_text("def exact(prompt, completion, answer, **row):\n"
                                    "    return float(completion.strip() == answer)\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    args = [*tiny_overrides(tmp_path / "run", "cold_start=null"), f"data.path={data}", "data.task=null",
            "data.eval_split=null", f"rewards.functions={{{tmp_path / 'rw.py'}:exact: 1.0}}"]
    assert main(["train", str(cfg), "--check", *args]) == 2
    assert "training row 3: reward" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_reward_comparing_with_a_number_is_told_answers_arrive_as_text(tmp_path):
    """A file whose answers are JSON numbers and a reward written for them (`int(completion) == answer`): the answers
    reach the reward as text ("42"), so it judged every right answer wrong, and the warning only said "check the
    reward's answer format". It now says that a number in the data arrives as its text."""
    def numeric(prompt: str, completion: str, answer, **row) -> float:
        return float(completion.strip().isdigit() and int(completion) == answer)

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": a + 1}) + "\n" for a in range(8)))
    from gspo.data import load_rows
    rows = load_rows(str(data))
    found = reward_checks(RewardRunner([(numeric, 1.0)]), rows, "numeric", 1.0)
    (line,) = reward_warnings(found, "training")
    assert "8 of 8 training rows' own answer wrong" in line and "reach it as text: a number in the data" in line


def test_a_boolean_answer_is_no_reference_text():
    """A row whose `answer` is a JSON true/false has no answer text to check (str(True) is "True", which no verifier
    of that row is meant to accept): it is left out, like a multi-turn solution."""
    assert reference_text({"answer": True}, "answer", "q", None) is None
    assert reference_text({"answer": 0}, "answer", "q", None) == "0"


def test_answers_equal_up_to_surrounding_whitespace_are_not_another_rows_different_answer():
    """The neighbour check scores a row with the next row's answer only where that answer differs from its own: "42"
    and "42 " are the same answer, and a verifier that strips it must not be reported as accepting a wrong one."""
    def stripped(prompt: str, completion: str, answer: str, **row) -> float:
        return float(completion.strip() == answer.strip())

    rows = [{"prompt": "40+2=", "answer": "42"}, {"prompt": "41+1=", "answer": "42 "}]
    found = reward_checks(RewardRunner([(stripped, 1.0)]), rows, "stripped", 1.0)
    assert (found["neighbour_rows"], found["neighbour_solved"]) == (0, 0)
    assert reward_warnings(found, "training") == []


def test_a_failure_on_another_rows_answer_names_the_row_it_was_scored_for():
    """The neighbour check skips rows whose next answer is the same; a failure there is reported with the row it was
    scored for (not its position among the rows scored), and the completion that made it fail."""
    def picky(prompt: str, completion: str, answer: str, **row) -> float:
        if completion != answer:
            raise ValueError("not this row's answer")
        return 1.0

    rows = [{"prompt": f"q{i}=", "answer": a} for i, a in enumerate(["1", "1", "2", "3"])]
    found = reward_checks(RewardRunner([(picky, 1.0)], on_error="zero"), rows, "picky", 1.0)
    assert found["neighbour_rows"] == 3  # row 0's next answer is its own
    first = found["failures"]["picky"]["neighbour"]["first"]
    assert (first["row"], first["completion"]) == (1, "2")


def test_a_reference_judged_wrong_is_reported_even_when_another_function_fails_on_it():
    """Only the accuracy reward's own failure makes a verdict a failure rather than a wrong one: a format reward
    that raises on the references does not hide an accuracy reward that rejects every one of them."""
    def never(prompt: str, completion: str, **row) -> float:
        return 0.0

    found = reward_checks(RewardRunner([(raises, 1.0), (never, 1.0)], on_error="zero"), ROWS, "never", 1.0)
    assert found["reference_solved"] == 0 and found["reference_wrong"] == 8
    assert any("judges 8 of 8 training rows' own answer wrong" in w for w in reward_warnings(found, "training"))


def test_a_function_failing_on_references_and_empty_completions_is_told_to_return_a_number_for_every_one():
    """The advice "return 0 for an empty completion" fits a function that fails on empty completions only; one that
    also fails on some references gets the general advice."""
    def half(prompt: str, completion: str, answer: str, **row) -> float:
        if int(answer) % 2:
            raise KeyError("odd")
        return float(int(completion) == int(answer))  # int("") raises

    found = reward_checks(RewardRunner([(half, 1.0)], on_error="fail"), ROWS, "half", 1.0)
    (line,) = reward_warnings(found, "training")
    assert "a run stops at its first failure; return a number for every completion" in line
    assert "return 0 for it instead" not in line


def test_the_check_counts_the_rows_it_sampled_and_those_with_a_text_answer_apart():
    """A row without a text `solution` or `answer` (a multi-turn demonstration with no answer) is sampled but not
    checked: `sampled` and `rows` differ, which `--check` prints ("3 with a text answer, a sample of 4")."""
    rows = [*ROWS[:3], {"prompt": "chat", "solution": [{"role": "assistant", "content": "hi"}]}]
    found = reward_checks(RewardRunner([(exact, 1.0)]), rows, "exact", 1.0)
    assert (found["sampled"], found["rows"], found["reference_solved"]) == (4, 3, 3)


# ----------------------------------------------------------------------------------------------------- weights


def test_all_zero_reward_weights_are_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="every weight is 0"):
        load_config(DEMO, ["rewards.functions={addition: 0}"])


def test_reward_check_results_name_no_function_when_none_fails():
    found = reward_checks(RewardRunner([(exact, 1.0)]), ROWS, "exact", 1.0)
    assert found["failures"] == {} and reward_warnings(found, "training") == []


# -------------------------------------------------------------------------------------- what a reward function returns


@pytest.mark.parametrize("value", [10**400, 10**5000, -(10**400)], ids=["1e400", "1e5000", "-1e400"])
def test_an_int_beyond_float_range_is_that_rows_failure_not_an_overflow_error(value):
    """float(10**400) raises OverflowError, which escaped isolation even with on_error="zero"."""
    runner = RewardRunner([(lambda prompt, completion, **row: value, 1.0)], on_error="zero", timeout_s=None)
    rewards, stats = score(runner, ["1", "2"])
    assert rewards.tolist() == [0.0, 0.0] and stats["reward_failures"] == 2
    with pytest.raises(RewardFailure, match=r"returned a value too large for a float: an int of \d+ bits"):
        score(RewardRunner([(lambda prompt, completion, **row: value, 1.0)], on_error="fail", timeout_s=None), ["1"])


def test_zero_dim_tensors_and_a_classifiers_one_column_are_read_as_numbers():
    """A per-row reward returning torch.tensor(0.5) or np.array(0.25) (what `.mean()` of a score gives), and a batched
    one returning a classifier's [N, 1] logits, were refused row by row as non-numbers."""
    import numpy as np
    import torch

    @batched
    def logits(prompts, completions, **rows):
        return torch.tensor([[0.5], [0.75]])

    for fn, want in ((lambda prompt, completion, **row: torch.tensor(0.5), [0.5, 0.5]),
                     (lambda prompt, completion, **row: np.array(0.25), [0.25, 0.25]), (logits, [0.5, 0.75])):
        rewards, stats = score(RewardRunner([(fn, 1.0)], on_error="fail", timeout_s=None), ["1", "2"])
        assert rewards.tolist() == want and stats["reward_failures"] == 0


def test_a_batch_reward_without_the_batched_decorator_is_told_to_add_it():
    """TRL's reward signature takes the batch (`prompts, completions`); without @batched each call gets one row and
    returns a list, which failed as "a non-number list" with no word of the decorator."""
    def trl_style(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    with pytest.raises(RewardFailure, match=r"non-number list.*needs the @gspo\.rewards\.batched decorator"):
        score(RewardRunner([(trl_style, 1.0)], on_error="fail", timeout_s=None), ["1"])


def test_a_reward_that_prints_does_not_break_gspo_trains_json_on_stdout(tmp_path, capsys):
    """`gspo train` prints its summary as one JSON document on stdout; a reward (or environment, or tool) that printed
    interleaved its lines with it."""
    (tmp_path / "chatty_rw.py").write_text("def score(prompt, completion, **row):\n    print('scoring', completion)\n"
                                           "    return float(completion.strip() == row['answer'])\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(DEMO.read_text())
    code = main(["train", str(cfg), *tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.steps=1"),
                 f"rewards.functions={{{tmp_path / 'chatty_rw.py'}:score: 1.0}}"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["status"] == "completed"
    assert "scoring" in err


def test_a_reward_that_prints_does_not_break_gspo_evals_json_on_stdout(tmp_path, capsys):
    """`gspo eval` prints its result as one JSON document on stdout, with a baseline too: a reward's prints go to
    stderr."""
    (tmp_path / "chatty_rw.py").write_text("def score(prompt, completion, **row):\n    print('scoring', completion)\n"
                                           "    return float(completion.strip() == row['answer'])\n")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    code = main(["eval", "tiny-moe", "--baseline", "tiny-dense", "--data", str(data), "--reward",
                 f"{tmp_path / 'chatty_rw.py'}:score", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["rows"] == 4 and "baseline" in json.loads(out)
    assert err.count("scoring") >= 8  # both models' completions were scored, and said so on stderr


# ----------------------------------------------------------------------------- rewards.on_error: what a failure trains


@pytest.mark.parametrize("on_error", ["mask", "zero"])
def test_completions_a_reward_failed_on_leave_the_loss_and_their_groups_baseline_under_mask(tmp_path, monkeypatch,
                                                                                            on_error):
    """A judge that times out now and then: under `zero` its failures are trained as reward-0 answers (and drag their
    groups' means down); under `mask` such a completion has no trained token and advantage 0, and the others of its
    group get the advantages of the group without it. Either way each failure is counted and marked in
    rollouts.jsonl."""
    from conftest import assert_left_out_of_groups, assert_reward_metrics_counted, flaky_reward
    from gspo.rewards import REWARDS
    from gspo.tracking import read_metrics

    monkeypatch.setitem(REWARDS, "flaky", flaky_reward)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, f"rewards.on_error={on_error}", "rewards.functions={flaky: 1.0}",
                                           "rewards.check=false", "trainer.steps=2", "trainer.eval_every=0",
                                           "log.rollouts=16", "rollout.group_size=4"))
    assert train(cfg)["status"] == "completed"
    records = read_metrics(tmp_path / "rollouts.jsonl")
    assert_left_out_of_groups(records, "reward_failed", on_error == "mask", steps=2, groups=4)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["reward_failures"] > 0 for r in metrics)
    assert_reward_metrics_counted(records, metrics, "reward_failed", on_error == "mask")
    # the function's own mean, too: over the rows it scored, a masked failure's 0 no score
    assert [r["reward/flaky"] for r in metrics] == pytest.approx([
        sum(x["reward"] for x in records if x["step"] == r["step"] and not (on_error == "mask" and x["reward_failed"]))
        / sum(x["step"] == r["step"] and not (on_error == "mask" and x["reward_failed"]) for x in records)
        for r in metrics], abs=1e-6)
    if on_error == "mask":
        assert [r["reward_failed_masked"] for r in metrics] == [r["reward_failures"] / 16 for r in metrics]
    else:
        assert "reward_failed_masked" not in metrics[0]


def short_fail(prompt: str, completion: str, **row) -> float:
    """A judge that gives up on short answers (fails on completions of at most 3 characters), else `varied_reward`:
    its failures are not spread evenly over the lengths."""
    from conftest import varied_reward

    if len(completion) <= 3:
        raise TimeoutError("judge gave up")
    return varied_reward(prompt, completion)


def test_the_lengths_of_solved_and_unsolved_completions_leave_out_the_masked_failures(tmp_path, monkeypatch):
    """`response_length_unsolved` is over the completions that count, as `accuracy` is: one whose judge failed under
    `rewards.on_error: mask` has no verdict (it counted among the unsolved: 5.3 tokens where the unsolved that were
    judged had 7.3, with a judge that fails on short answers)."""
    from gspo.rewards import REWARDS
    from gspo.tracking import read_metrics

    monkeypatch.setitem(REWARDS, "short_fail", short_fail)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "rewards.on_error=mask", "rewards.functions={short_fail: 1.0}",
                                           "rewards.check=false", "trainer.steps=2", "trainer.eval_every=0",
                                           "log.rollouts=16", "rollout.max_new_tokens=8", "rollout.stop=[a, e, i, o]"))
    assert train(cfg)["status"] == "completed"
    records, metrics = read_metrics(tmp_path / "rollouts.jsonl"), read_metrics(tmp_path / "metrics.jsonl")

    def mean_tokens(step: int, solved: bool, counted_only: bool) -> float | None:
        tokens = [r["tokens"] for r in records if r["step"] == step and r["solved"] == solved
                  and not (counted_only and r["reward_failed"])]
        return sum(tokens) / len(tokens) if tokens else None

    assert any(mean_tokens(m["step"], False, True) != mean_tokens(m["step"], False, False) for m in metrics)
    for m in metrics:
        for name, solved in (("solved", True), ("unsolved", False)):
            expected = mean_tokens(m["step"], solved, True)
            assert m.get(f"response_length_{name}") == (None if expected is None else pytest.approx(expected))


def test_batches_scored_apart_under_mask_count_every_row_a_function_scored():
    """Under `rewards.on_error: mask` a batch whose calls all succeeded has the same stats keys as one with a masked
    failure: dynamic sampling's rounds merge `reward_rows/<name>` over every round (a round without a failure counted
    none of its rows: 3 of 8 scored rows reported), and torchrun's processes sum the same keys in the same order."""
    from gspo.rewards import merge_reward_stats

    def picky(prompt: str, completion: str, **row) -> float:
        if completion == "boom":
            raise RuntimeError("judge down")
        return float(completion == row["answer"])

    runner = RewardRunner([(picky, 1.0)], on_error="mask")
    failed = runner.score([r["prompt"] for r in ROWS[:4]], ["boom", "2", "3", "x"], ROWS[:4])
    clean = runner.score([r["prompt"] for r in ROWS[4:]], ["5", "6", "x", "y"], ROWS[4:])
    assert sorted(failed.stats) == sorted(clean.stats)
    merged = merge_reward_stats([(failed.stats, 4), (clean.stats, 4)])
    assert merged["reward_rows/picky"] == 7 and merged["reward_failures"] == 1
    assert merged["reward/picky"] == pytest.approx(4 / 7)  # 2 of the 3 scored rows, then 2 of 4


# ------------------------------------------------------------------------- rewards.code: the code reward's options


def test_the_code_rewards_options_are_set_in_the_config(monkeypatch):
    """`make_code_reward`'s options (the sandbox's limits, partial credit, the third-party modules a program may import)
    reached a run only through a module of the user's own (`my_rewards:slow_code`): `rewards.code` now sets them for
    the built-in `code` reward, checked when the runner is built, so a YAML config trains on rows that import a
    module of the trainer's environment (here one of the test's own, in a folder every user can read)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="gspo-test-cfg-packages-")  # not tmp_path: pytest's folders are closed (0700)
    (Path(folder) / "gspo_cfg_helper.py").write_text("def double(x):\n    return 2 * x\n")
    for path in (Path(folder), Path(folder) / "gspo_cfg_helper.py"):
        path.chmod(0o755)
    monkeypatch.syspath_prepend(folder)
    try:
        tests = "from gspo_cfg_helper import double\nassert quadruple(3) == double(double(3))\n"
        program = "```python\nfrom gspo_cfg_helper import double\ndef quadruple(x):\n    return double(double(x))\n```"
        cfg = load_config(DEMO, ["rewards.functions={code: 1.0}", "rewards.code.timeout_s=20",
                                 "rewards.code.packages=[gspo_cfg_helper]"])
        runner = RewardRunner.from_config(cfg.rewards, on_error="fail")
        assert runner.functions[0].call_timeout_s == 20  # the deadline warning reads it
        assert runner(["p"], [program], [{"tests": tests}])[0].tolist() == [1.0]
        plain = RewardRunner.from_config(load_config(DEMO, ["rewards.functions={code: 1.0}"]).rewards,
                                         on_error="zero")
        assert plain(["p"], [program], [{"tests": tests}])[0].tolist() == [0.0]  # not importable there
        with pytest.raises(ValueError, match=r"rewards\.code: .*nonexistent_module"):
            RewardRunner.from_config(load_config(DEMO, ["rewards.functions={code: 1.0}",
                                                        "rewards.code.packages=[nonexistent_module]"]).rewards)
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("override, match", [
    ("rewards.code.timeout_s=20", r"rewards\.code sets \['timeout_s'\].*does not use"),  # without `code`: no effect
    ("rewards.code.timeout=20", r"timeout"),  # a key it does not have
    ("rewards.code.memory_mb=0", r"memory_mb"),
])
def test_code_reward_options_that_would_do_nothing_or_are_wrong_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, [override])


def _code_rows(path, bad: int) -> None:
    good = [{"prompt": f"Write f{i}(x) returning x + {i}.", "tests": f"assert f{i}(1) == {1 + i}"} for i in range(4)]
    broken = [{"prompt": "Write g(x).", "tests": "```python\nassert g(1) == 2\n```"},  # a Markdown fence: not Python
              {"prompt": "Write h(x).", "tests": "def helper():\n    return 1\n"}][:bad]  # runs nothing that can fail
    path.write_text("".join(json.dumps(r) + "\n" for r in good + broken))


def test_rows_the_code_reward_can_never_judge_are_left_out_before_the_run_and_counted(tmp_path, caplog):
    """A code row whose tests are not Python (a stray Markdown fence) or run nothing that can fail made every call on
    it fail: under on_error=fail the run stopped the first time the row was drawn, hours in; under zero / mask it was
    trained on as a 0 or masked step after step. Such rows are now left out when the run starts, counted (summary.json
    `unscorable_rows`, `--check`'s warnings) with the first one's reason in the log."""
    from gspo.preflight import check, warnings
    from gspo.trainer import prepare

    data = tmp_path / "code.jsonl"
    _code_rows(data, bad=2)
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "data.task=null",
                                           f"data.path={data}", "data.eval_split=null",
                                           "rewards.functions={code: 1.0}", "rewards.accuracy_reward=code"))
    with caplog.at_level("WARNING", logger="gspo.rewards"):
        setup = prepare(cfg, create_out=False)
    assert [r["prompt"][:8] for r in setup.train_rows] == [f"Write f{i}" for i in range(4)]
    assert setup.unscorable_rows == {"train": 2, "eval": 0}
    assert "left out 2 of 6 training rows" in caplog.text and "not valid Python" in caplog.text
    assert any("2 training rows are left out" in w for w in warnings(check(cfg)))
    _code_rows(data, bad=0)
    assert prepare(cfg, create_out=False).unscorable_rows == {"train": 0, "eval": 0}
    data.write_text(json.dumps({"prompt": "Write g(x).", "tests": "def helper():\n    pass\n"}) + "\n")
    with pytest.raises(ValueError, match="no training row can be judged by the rewards"):
        prepare(cfg, create_out=False)


def test_each_held_out_sets_unscorable_rows_are_counted_apart_from_its_long_prompts(tmp_path):
    """With a list of data.eval_path files, summary.json's `heldout.sets` says of each file how many rows were left
    out for a prompt over the token limit (`skipped_prompts`, as the run's own `skipped_prompts` counts) and how many
    because the rewards can never judge them (`unscorable_rows`): the second counted among the first (a set with 2
    unscorable rows and no long prompt said `skipped_prompts: 2`), so the sets' counts disagreed with the run's."""
    from gspo.trainer import prepare

    train_rows, first, second = tmp_path / "train.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    _code_rows(train_rows, bad=0)
    broken = [{"prompt": "Write g(x).", "tests": "```python\nassert g(1) == 2\n```"},
              {"prompt": "Write h(x).", "tests": "def helper():\n    return 1\n"}]
    good = [{"prompt": f"Write k{i}(x) returning x - {i}.", "tests": f"assert k{i}(1) == {1 - i}"} for i in range(3)]
    first.write_text("".join(json.dumps(r) + "\n" for r in good[:2] + broken))
    second.write_text("".join(json.dumps(r) + "\n" for r in good[2:]))
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "data.task=null",
                                           f"data.path={train_rows}", f"data.eval_path=[{first}, {second}]",
                                           "rewards.functions={code: 1.0}", "rewards.accuracy_reward=code"))
    setup = prepare(cfg, create_out=False)
    assert setup.unscorable_rows == {"train": 0, "eval": 2} and setup.skipped_prompts == {"train": 0, "eval": 0}
    sets = setup.heldout_source["sets"]
    assert [(sets[name]["rows"], sets[name]["skipped_prompts"], sets[name]["unscorable_rows"])
            for name in ("first", "second")] == [(2, 0, 2), (1, 0, 0)]


def test_gspo_eval_leaves_out_the_rows_the_code_reward_can_never_judge(tmp_path, capsys):
    """`gspo eval` evaluates the rows a run would: one the rewards can never judge is left out and counted with the
    apart from the prompts it skips for length (`unscorable_rows`, not `skipped_prompts`), instead of being scored
    unsolved with a reward failure."""
    data = tmp_path / "code.jsonl"
    _code_rows(data, bad=2)
    code = main(["eval", "tiny-moe", "--data", str(data), "--reward", "code", "--max-new-tokens", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["rows"] == 4 and out["unscorable_rows"] == 2 and "skipped_prompts" not in out

"""Tests for gspo.rewards: the built-in rewards, resolving specs, and RewardRunner's weighting and failure handling."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
import threading
import time
from fractions import Fraction

import pytest
import torch

import gspo.rewards as rewards_module
from gspo.config import load_config
from gspo.data import make_task
from gspo.rewards import (
    REWARDS,
    RewardFailure,
    RewardRunner,
    Routes,
    addition_reward,
    answer_extractor,
    batched,
    countdown_reward,
    math_reward,
    parse_arithmetic,
    resolve_reward,
)
from gspo.rewards import deadline as deadline_module

# ---- addition --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("579", 1.0),
        ("579 ", 1.0),
        ("  579", 1.0),
        ("579 is the sum", 1.0),
        ("579.", 1.0),
        ("5790", 0.0),
        ("0579", 0.0),
        ("57", 0.0),
        ("-579", 0.0),
        ("", 0.0),
        ("the answer is 579", 0.0),
        ("5 79", 0.0),
    ],
)
def test_addition_reward(completion: str, expected: float) -> None:
    assert addition_reward("123+456=", completion, answer="579") == expected


def test_addition_reward_negative_and_int_answers() -> None:
    assert addition_reward("p", "-12", answer="-12") == 1.0
    assert addition_reward("p", "12", answer="-12") == 0.0
    assert addition_reward("p", "12", answer=12) == 1.0


def test_addition_reward_scores_task_solutions_1_and_others_0() -> None:
    rows = make_task("addition", size=50, seed=4)
    for row, other in zip(rows, rows[1:] + rows[:1], strict=True):
        assert addition_reward(row["prompt"], row["solution"], answer=row["answer"]) == 1.0
        if other["answer"] != row["answer"]:
            assert addition_reward(row["prompt"], other["solution"], answer=row["answer"]) == 0.0


def test_addition_reward_rejects_bad_rows() -> None:
    with pytest.raises(ValueError, match="'answer'"):
        addition_reward("1+1=", "2")
    with pytest.raises(ValueError, match="integer answer"):
        addition_reward("1+1=", "2", answer="2.0")


# ---- countdown -------------------------------------------------------------------------------------------------------


def test_parse_arithmetic() -> None:
    assert parse_arithmetic("1+2*3") == (Fraction(7), [1, 2, 3])
    assert parse_arithmetic(" (1 + 2) * 3 ") == (Fraction(9), [1, 2, 3])
    assert parse_arithmetic("10-4-3") == (Fraction(3), [10, 4, 3])  # left-associative
    assert parse_arithmetic("8/4/2") == (Fraction(1), [8, 4, 2])
    assert parse_arithmetic("7/2") == (Fraction(7, 2), [7, 2])  # exact, not integer, division
    for bad in ["", "1+", "(1+2", "1+2)", "-1+2", "1**2", "2(3)", "1/0", "1/(2-2)", "07+1", "x", "1e3", "__import__"]:
        with pytest.raises(ValueError):
            parse_arithmetic(bad)
    with pytest.raises(ValueError, match="nested"):
        parse_arithmetic("(" * 200 + "1" + ")" * 200)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("25+7*3", 1.0),  # 46
        ("(25-3)*7", 0.0),  # 154
        ("7*3+25", 1.0),
        (" 25 + 3*7 ", 1.0),
        ("25+7+7+7", 0.0),  # 7 used three times
        ("25+21", 0.0),  # 21 is not given
        ("46", 0.0),
        ("25+7*3=46", 0.0),  # not just an expression
        ("", 0.0),
        ("25+7*3+3-3", 0.0),  # 3 used twice
        ("__import__('os')", 0.0),
    ],
)
def test_countdown_reward(completion: str, expected: float) -> None:
    prompt = "3,7,25:46="
    assert countdown_reward(prompt, completion) == expected  # numbers and target from the prompt
    assert countdown_reward(prompt, completion, numbers=[3, 7, 25], answer="46") == expected  # ... from the row


def test_countdown_reward_allows_repeated_given_numbers_and_subsets() -> None:
    assert countdown_reward("3,3,10:16=", "3+3+10") == 1.0
    assert countdown_reward("3,3,10:13=", "3+10") == 1.0
    assert countdown_reward("p", "3/4*8", numbers=[3, 4, 8], answer=6) == 1.0


def test_countdown_reward_scores_task_solutions() -> None:
    for row in make_task("countdown", size=200, seed=5):
        fields = {k: v for k, v in row.items() if k != "prompt"}
        assert countdown_reward(row["prompt"], row["solution"], **fields) == 1.0
        assert countdown_reward(row["prompt"], row["solution"]) == 1.0
        assert countdown_reward(row["prompt"], row["solution"] + "+1", **fields) == 0.0


def test_countdown_reward_rejects_unusable_rows() -> None:
    with pytest.raises(ValueError, match="'numbers' and 'answer'"):
        countdown_reward("reach 10 with 3 and 7", "3+7")
    with pytest.raises(ValueError, match="bad numbers"):
        countdown_reward("p", "3+7", numbers=["three"], answer="10")


# ---- math ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("so the result is \\boxed{42}", "42", 1.0),
        ("She sold 48 + 24 = 72 clips in total, so 72", "72", 1.0),
        ("The answer is $\\frac{1}{3}$", "0.5", 0.0),
        ("I do not know", "0.5", 0.0),
        ("", "7", 0.0),
    ],
)
def test_math_reward(completion: str, answer: str, expected: float) -> None:
    assert math_reward("q", completion, answer=answer) == expected


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    # LaTeX gold answers without $ (MATH's, verl's ground_truth): plain parsing kept their leading number or nothing
    ("6", "6\\pi", 0.0), ("\\boxed{6\\pi}", "6\\pi", 1.0), ("2", "2^{10}", 0.0), ("\\boxed{1024}", "2^{10}", 1.0),
    ("3", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{\\sqrt{5}}", "\\sqrt{5}", 1.0), ("0.75", "\\dfrac{3}{4}", 1.0), ("\\boxed{B}", "A", 0.0),
    # numbers in scientific notation (a jsonl 0.00001 loads as "1e-05"): their value, not their mantissa
    ("1", "1e-05", 0.0), ("0.00001", "1e-05", 1.0), ("1", "1e+20", 0.0), ("\\boxed{10^{20}}", "1e+20", 1.0),
    ("2.5", "2.5e-06", 0.0),
    ("18.90", "\\$18.90", 1.0), ("18.91", "\\$18.90", 0.0),  # an escaped dollar sign is not a delimiter
])
def test_math_reward_reads_gold_answers_as_written_in_math_datasets(completion, answer, expected) -> None:
    assert math_reward("q", completion, answer=answer) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("completion", ["The answer is 10^10^10", "\\boxed{10^{10^{10}}}", "$10^{10^{10}}$",
                                        "9**9**9**9", "(10^10)^(10^10)", "\\boxed{10^{1000000000}}",
                                        "\\boxed{2^{2^{2^{2^{2}}}}}"])
def test_math_reward_does_not_evaluate_a_power_tower_in_a_worker_thread(completion) -> None:
    """sympy computed 10**(10**10) holding the GIL: the runner's deadline never fired and a step hung for hours."""
    from gspo.rewards.builtin import _math_answer

    runner = RewardRunner({"math": 1.0}, timeout_s=5.0)
    scores = runner.score(["q"], [completion], [{"answer": "1"}])
    assert scores.total.tolist() == [0.0] and not scores.failed["math"].any() and _math_answer(completion) is None


def test_last_number_is_a_verifier_the_accuracy_reward_defaults_to() -> None:
    """It was missing from VERIFIERS: beside a shaping reward, the config asked to name the accuracy reward."""
    cfg = load_config(None, ["rewards.functions={last_number: 1.0, conftest:varied_reward: 0.1}"])
    assert cfg.rewards.accuracy_reward == "last_number"


def test_math_reward_needs_a_parseable_answer() -> None:
    with pytest.raises(ValueError, match="'answer'"):
        math_reward("q", "1")
    with pytest.raises(ValueError, match="could not parse the gold answer"):
        math_reward("q", "1", answer="no number here")


# ---- resolve_reward --------------------------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module `gspo_test_user_rewards` importable from a temporary directory."""
    (tmp_path / "gspo_test_user_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_reward(prompt, completion, **row):
                return float(len(completion))

            class Scorers:
                @staticmethod
                def always_one(prompt, completion, **row):
                    return 1.0

            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "gspo_test_broken_rewards.py").write_text("import module_that_does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "gspo_test_user_rewards"


def test_resolve_registry_names() -> None:
    assert set(REWARDS) == {"addition", "code", "countdown", "last_number", "math"}
    for name, fn in REWARDS.items():
        assert resolve_reward(name) is fn
    assert resolve_reward("gspo.rewards.builtin:addition_reward") is addition_reward
    assert resolve_reward("gspo.rewards.builtin.addition_reward") is addition_reward


def test_resolve_import_paths(user_module: str) -> None:
    fn = resolve_reward(f"{user_module}:length_reward")
    assert fn("p", "abcd") == 4.0
    assert resolve_reward(f"{user_module}.length_reward") is fn
    assert resolve_reward(f"{user_module}:Scorers.always_one")("p", "c") == 1.0


def test_resolve_errors(user_module: str) -> None:
    known = r"\['addition', 'code', 'countdown', 'last_number', 'math'\]"
    with pytest.raises(ValueError, match=r"unknown reward 'adition'.*" + known):
        resolve_reward("adition")
    with pytest.raises(ValueError, match=r"'gspo_test_broken_rewards:f'.*ModuleNotFoundError.*module_that_does_not"):
        resolve_reward("gspo_test_broken_rewards:f")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg_xyz'"):
        resolve_reward("no_such_pkg_xyz.fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="not a function"):
        resolve_reward(f"{user_module}:NOT_CALLABLE")
    for bad in ("", ":fn", "mod:"):
        with pytest.raises(ValueError, match="reward spec"):
            resolve_reward(bad)


# ---- RewardRunner ----------------------------------------------------------------------------------------------------

PROMPTS = ["1+2=", "10+20=", "5+5="]
ROWS = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ["3", "30", "10"], strict=True)]


def test_runner_weighted_sum_is_exact(user_module: str) -> None:
    runner = RewardRunner([("addition", 0.5), (f"{user_module}:length_reward", -0.25)])
    completions = ["3", "31", "10 "]
    rewards, stats = runner(PROMPTS, completions, ROWS)
    assert rewards.dtype == torch.float32 and rewards.shape == (3,)
    expected = [0.5 * 1 - 0.25 * 1, 0.5 * 0 - 0.25 * 2, 0.5 * 1 - 0.25 * 3]
    assert rewards.tolist() == expected
    assert stats == {"reward/addition": 2 / 3, f"reward/{user_module}:length_reward": 2.0, "reward_failures": 0.0,
                     "reward_timeouts": 0.0, "unfinished_thinking": 0.0}
    assert runner.failures == {"addition": 0, f"{user_module}:length_reward": 0}


def test_runner_accepts_dicts_and_callables() -> None:
    def bonus(prompt, completion, **row):
        return 1

    runner = RewardRunner({"addition": 2.0})
    assert runner(PROMPTS, ["3", "30", "0"], ROWS)[0].tolist() == [2.0, 2.0, 0.0]
    runner = RewardRunner([("addition", 1.0), (bonus, 0.5)])
    rewards, stats = runner(PROMPTS, ["3", "30", "0"], ROWS)
    assert rewards.tolist() == [1.5, 1.5, 0.5]
    assert stats["reward/bonus"] == 1.0


def test_runner_passes_row_fields_but_not_prompt_twice() -> None:
    seen = []

    def spy(prompt, completion, **row):
        seen.append((prompt, completion, row))
        return 0.0

    RewardRunner([(spy, 1.0)])(["p"], ["c"], [{"prompt": "p", "completion": "old", "answer": "a", "k": 1}])
    assert seen == [("p", "c", {"answer": "a", "k": 1})]


def _flaky(kind: str):
    """A reward that misbehaves on row 1 in the given way and returns 1.0 elsewhere."""
    bad = {"none": None, "nan": math.nan, "inf": -math.inf, "str": "1.0", "list": [1.0]}

    def flaky(prompt, completion, **row):
        if prompt != "bad":
            return 1.0
        if kind == "raise":
            raise KeyError("missing_key_xyz")
        return bad[kind]

    return flaky


FAILURE_KINDS = [
    ("raise", r"raised KeyError: 'missing_key_xyz'"),
    ("none", r"returned None"),
    ("nan", r"returned a non-finite value nan"),
    ("inf", r"returned a non-finite value -inf"),
    ("str", r"returned a non-number str: '1\.0'"),
    ("list", r"returned a non-number list: \[1\.0\] \(a function that scores the whole batch at once needs the "
             r"@gspo\.rewards\.batched decorator\)"),
]


@pytest.mark.parametrize(("kind", "reason"), FAILURE_KINDS)
def test_runner_fail_mode_raises_with_details(kind: str, reason: str) -> None:
    runner = RewardRunner([(_flaky(kind), 1.0)], on_error="fail")
    completion = "a long completion " * 10
    with pytest.raises(
        RewardFailure, match=rf"'flaky' failed on row 1: {reason}; completion starts 'a long comp"
    ) as info:
        runner(["ok", "bad", "ok"], ["c", completion, "c"], [{}, {}, {}])
    assert completion not in str(info.value)  # only a prefix is shown
    assert runner.failures == {"flaky": 1}
    if kind == "raise":
        assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(("kind", "reason"), FAILURE_KINDS)
def test_runner_zero_mode_counts_and_warns_once(kind: str, reason: str, caplog) -> None:
    runner = RewardRunner([(_flaky(kind), 2.0), ("addition", 1.0)], on_error="zero")
    prompts, completions = ["bad", "ok", "bad"], ["3", "3", "5"]
    rows = [{"answer": "3"}, {"answer": "3"}, {"answer": "4"}]
    with caplog.at_level(logging.WARNING, logger="gspo.rewards"):
        rewards, stats = runner(prompts, completions, rows)
        rewards2, stats2 = runner(prompts, completions, rows)
    assert rewards.tolist() == rewards2.tolist() == [1.0, 3.0, 0.0]
    assert stats["reward_failures"] == stats2["reward_failures"] == 2.0
    assert stats["reward/flaky"] == pytest.approx(1 / 3)
    assert runner.failures == {"flaky": 4, "addition": 0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per function and kind, not per row or call
    assert "'flaky' failed on row 0" in warnings[0].getMessage()


def test_runner_bools_count_as_numbers() -> None:
    runner = RewardRunner([(lambda p, c, **r: c == "yes", 1.0)])
    assert runner(["a", "b"], ["yes", "no"], [{}, {}])[0].tolist() == [1.0, 0.0]


def test_runner_validates_construction(user_module: str) -> None:
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardRunner({"nope": 1.0})
    for weight in (math.nan, math.inf, "1", True):
        with pytest.raises(ValueError, match=r"weight of reward 'addition' must be a finite number"):
            RewardRunner([("addition", weight)])
    with pytest.raises(ValueError, match="listed twice"):
        RewardRunner([("addition", 1.0), ("addition", 2.0)])
    with pytest.raises(ValueError, match="on_error"):
        RewardRunner({"addition": 1.0}, on_error="ignore")
    with pytest.raises(ValueError, match="pair"):
        RewardRunner(["addition"])


def test_runner_validates_inputs() -> None:
    runner = RewardRunner({"addition": 1.0})
    with pytest.raises(ValueError, match="2 prompts, 1 completions and 2 rows"):
        runner(["1+1=", "1+2="], ["2"], [{"answer": "2"}, {"answer": "3"}])
    with pytest.raises(ValueError, match="no completions"):
        runner([], [], [])
    with pytest.raises(ValueError, match="row 0 needs"):
        runner(["1+1="], [None], [{"answer": "2"}])


# ---- deadlines -------------------------------------------------------------------------------------------------------


@pytest.fixture
def hang_on():
    """A reward scoring 1.0 that blocks (until the test ends) on completions named "hang"."""
    release = threading.Event()

    def hang(prompt: str, completion: str, **row) -> float:
        if completion == "hang":
            release.wait()
        return 1.0

    yield hang
    release.set()  # let the abandoned threads finish


def test_a_hanging_call_times_out_is_counted_and_the_runner_goes_on(hang_on, caplog) -> None:
    """The batch's calls share one deadline: the hanging call is abandoned and the call queued behind it (one worker)
    is never started; both are timeouts, and the batch took the deadline, not one deadline per call."""
    runner = RewardRunner([(hang_on, 1.0)], on_error="zero", timeout_s=0.5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gspo.rewards"):
        rewards, stats = runner(["p"] * 3, ["a", "hang", "b"], [{}] * 3)
    assert time.monotonic() - t0 < 5
    assert rewards.tolist() == [1.0, 0.0, 0.0]
    assert stats["reward_failures"] == 2.0 and stats["reward_timeouts"] == 2.0
    assert runner.failures == runner.timeouts == {"hang": 2}
    assert any("failed on row 1: timed out after 0.5 s" in r.getMessage() for r in caplog.records)
    # the stuck thread was replaced: the next batch is scored as usual
    assert runner(["p"] * 2, ["c", "d"], [{}] * 2)[0].tolist() == [1.0, 1.0]


def test_many_hanging_calls_cost_one_deadline_not_one_each(hang_on) -> None:
    """16 hanging calls with 4 workers at 0.5 s: one deadline (~0.5 s), where per-call deadlines took 16 / 4 × 0.5 s."""
    runner = RewardRunner([(hang_on, 1.0)], on_error="zero", timeout_s=0.5, workers=4)
    t0 = time.monotonic()
    rewards, stats = runner(["p"] * 16, ["hang"] * 16, [{}] * 16)
    assert time.monotonic() - t0 < 1.9  # 4 sequential deadlines would be >= 2 s
    assert rewards.tolist() == [0.0] * 16 and stats["reward_timeouts"] == 16.0


def _timed_map(pool, calls: list, rounds: int, release: threading.Event) -> tuple[list, float]:
    """`pool.map(calls, rounds=rounds)` and the seconds it took; `release` is set afterwards whatever happened, so that
    the calls hung on it end."""
    t0 = time.monotonic()
    try:
        outcomes = pool.map(calls, rounds=rounds)
    finally:
        release.set()
    return outcomes, time.monotonic() - t0


def test_a_hung_call_frees_its_worker_for_the_calls_queued_behind_it() -> None:
    """An episode driver's batch: 7 environment steps on 2 workers, 4 rounds of 1 s. The first step hangs, the six
    others take 0.8 s each. Holding its worker to the batch's deadline (4 s) left one worker for 4.8 s of healthy
    steps, and the last ones timed out; abandoned after its own second, its fresh replacement takes the queue and
    every healthy step finishes (~3.2 s)."""
    release = threading.Event()
    pool = deadline_module.DeadlinePool(workers=2, timeout_s=1.0)
    calls = [(release.wait, (), {}), *[(lambda i=i: time.sleep(0.8) or i, (), {}) for i in range(6)]]
    outcomes, seconds = _timed_map(pool, calls, 4, release)
    assert outcomes[0].timed_out
    assert [o.value for o in outcomes[1:]] == list(range(6)) and not any(o.timed_out for o in outcomes[1:])
    assert seconds < 3.9
    assert pool.map([(lambda: 7, (), {})] * 3)[2].value == 7  # the pool goes on with its replaced worker


def test_calls_that_hang_on_every_worker_are_abandoned_at_their_own_time_limit() -> None:
    """With every worker hung, no call starts or ends to wake the caller: it must still wake at the hung calls' own
    time limit (0.5 s), abandon them and let fresh workers run the queued calls, not sleep to the batch's deadline
    (3 rounds: 1.5 s) and skip them."""
    release = threading.Event()
    pool = deadline_module.DeadlinePool(workers=2, timeout_s=0.5)
    calls = [(release.wait, (), {}), (release.wait, (), {}), (lambda: 1, (), {}), (lambda: 2, (), {})]
    outcomes, seconds = _timed_map(pool, calls, 3, release)
    assert [o.timed_out for o in outcomes] == [True, True, False, False]
    assert [o.value for o in outcomes[2:]] == [1, 2]
    assert seconds < 1.4


def test_a_batch_whose_last_call_is_abandoned_ends_then_not_at_its_deadline() -> None:
    """A batch of 3 rounds (1.5 s) whose only call hangs is over when that call is abandoned at its own limit (0.5 s):
    the caller returns then, not at the batch's deadline."""
    release = threading.Event()
    pool = deadline_module.DeadlinePool(workers=1, timeout_s=0.5)
    (outcome,), seconds = _timed_map(pool, [(release.wait, (), {})], 3, release)
    assert outcome.timed_out and seconds < 1.2


def test_a_call_abandoned_at_its_own_limit_is_counted_once_and_the_skipped_calls_never_run() -> None:
    """One worker, 0.4 s a call, 2 rounds (0.8 s): the first call is abandoned at 0.4 s, the second one, started by
    the fresh worker, at the deadline, and the third is skipped. The pool counts each stuck thread once, and a
    skipped call is not run later by a fresh worker (a tool call or sandbox run nobody waits for). Once the stuck
    calls return, their threads end and are no longer counted."""
    release, ran = threading.Event(), threading.Event()
    pool = deadline_module.DeadlinePool(workers=1, timeout_s=0.4)
    try:
        outcomes = pool.map([(release.wait, (), {}), (release.wait, (), {}), (ran.set, (), {})], rounds=2)
        assert [o.timed_out for o in outcomes] == [True, True, True]
        assert pool.stuck == 2
        assert not ran.wait(0.3)
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while pool.stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stuck == 0


def test_an_abandoned_call_that_returns_later_does_not_end_the_batch_early() -> None:
    """The first call is abandoned at its own limit (0.5 s) and returns at 0.7 s, while the second (0.5 s to 0.8 s on
    the fresh worker) still runs: the late return is ignored, and the batch waits for the second call's value."""
    pool = deadline_module.DeadlinePool(workers=1, timeout_s=0.5)
    calls = [(lambda: time.sleep(0.7) or "late", (), {}), (lambda: time.sleep(0.3) or "on time", (), {})]
    outcomes = pool.map(calls, rounds=4)
    assert outcomes[0].timed_out and outcomes[0].value is None
    assert not outcomes[1].timed_out and outcomes[1].value == "on time"


def test_a_hanging_call_in_fail_mode_raises(hang_on) -> None:
    runner = RewardRunner([(hang_on, 1.0)], timeout_s=0.5)
    with pytest.raises(RewardFailure, match=r"'hang' failed on row 1: timed out after 0\.5 s"):
        runner(["p"] * 2, ["a", "hang"], [{}] * 2)


def test_too_many_stuck_calls_stop_whatever_on_error_says(hang_on, monkeypatch) -> None:
    monkeypatch.setattr(rewards_module, "MAX_STUCK_CALLS", 2)
    runner = RewardRunner([(hang_on, 1.0)], on_error="zero", timeout_s=0.5, workers=3)
    with pytest.raises(RewardFailure, match=r"3 reward calls that timed out .* are still running in background"):
        runner(["p"] * 3, ["hang"] * 3, [{}] * 3)


def test_workers_run_concurrently_and_keep_the_call_order() -> None:
    """Four calls that each wait for all four to have started can only finish if they run at the same time."""
    barrier = threading.Barrier(4, timeout=30)

    def meet(prompt: str, completion: str, **row) -> float:
        barrier.wait()
        return float(completion)

    runner = RewardRunner([(meet, 1.0)], workers=4, timeout_s=None)
    rewards, stats = runner(["p"] * 4, ["3", "1", "4", "1"], [{}] * 4)
    assert rewards.tolist() == [3.0, 1.0, 4.0, 1.0] and stats["reward_failures"] == 0.0


def test_a_hung_reward_thread_does_not_keep_the_interpreter_alive() -> None:
    """The abandoned threads are daemons: a process whose reward hung still exits (a thread pool would join them)."""
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('deadline', {deadline_module.__file__!r})\n"
        "deadline = sys.modules['deadline'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(deadline)\n"
        "(outcome,) = deadline.DeadlinePool(1, 0.2).map([(time.sleep, (3600,), {})])\n"
        "print(outcome.timed_out)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stderr


def test_a_deadline_pool_refuses_no_workers_and_a_zero_time_limit() -> None:
    """A pool without workers never runs a call, and a time limit of 0 s times every call out: both are refused when
    the pool is made (an environment's tools use a pool directly, not through RewardRunner's own checks)."""
    for workers in (0, -1):
        with pytest.raises(ValueError, match="workers"):
            deadline_module.DeadlinePool(workers=workers)
    for timeout_s in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match="timeout_s"):
            deadline_module.DeadlinePool(workers=1, timeout_s=timeout_s)
    assert deadline_module.DeadlinePool(workers=1, timeout_s=1e-3).timeout_s == 1e-3


def test_runner_validates_timeout_and_workers() -> None:
    for timeout_s in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="timeout_s"):
            RewardRunner({"addition": 1.0}, timeout_s=timeout_s)
    for workers in (0, 1.5, True):
        with pytest.raises(ValueError, match="workers"):
            RewardRunner({"addition": 1.0}, workers=workers)


@pytest.mark.parametrize("completion, expected", [
    ("57 + 58 = 115", 1.0), ("115", 1.0), ("115 is wrong, it is 116", 0.0), ("no number", 0.0), ("-115", 0.0),
    ("1150", 0.0), ("x = 115.0", 1.0),
    # a decimal is one number (it read "115.5" as 115 and 5), a comma before 3 digits a thousands separator only
    ("it is 1.115", 0.0), ("it is 115.5", 0.0), ("The answer is 1,15.", 0.0), ("(1,1,5)", 0.0), ("1,115", 0.0),
    ("The answer is \u2212115", 0.0),  # a Unicode minus is a minus
])
def test_last_number_reward_reads_the_last_number(completion, expected):
    from gspo.rewards import REWARDS

    assert REWARDS["last_number"]("q", completion, answer="115") == expected


def test_addition_answer_of_a_lone_minus_sign_is_no_answer():
    """maj@k votes on `addition_reward`'s answer: a completion that is only "-" (or "- 5") gives no answer, not the
    answer "-" (which would win votes over real answers when the policy writes junk)."""
    extract = answer_extractor(addition_reward)
    assert extract("-") is None and extract(" - 5") is None and extract("-x") is None
    assert extract("-5 ok") == "-5" and extract("12") == "12"


def test_a_failed_call_is_never_solved_even_at_a_threshold_of_zero():
    """`correct`: a call that failed scores 0 but is not solved, whatever the threshold (a reward model's accuracy
    threshold may be 0 or negative)."""
    def judge(prompt, completion, **row):
        if completion == "boom":
            raise RuntimeError("judge down")
        return 0.0

    scores = RewardRunner([(judge, 1.0)], on_error="zero", timeout_s=None).score(["p", "p"], ["fine", "boom"],
                                                                                  [{}, {}])
    assert scores.failed["judge"].tolist() == [False, True]
    assert scores.correct("judge", threshold=0.0).tolist() == [True, False]
    assert scores.correct("judge", threshold=-1.0).tolist() == [True, False]


def test_a_batched_reward_returning_too_many_values_fails_every_row():
    """A batched reward must return exactly N values: too many is a counted failure of every row (on_error=zero),
    not a crash of the runner."""
    @batched
    def judge(prompts, completions, **columns):
        return [1.0] * (len(completions) + 1)

    runner = RewardRunner([(judge, 1.0)], on_error="zero", timeout_s=None)
    scores = runner.score(["p"] * 3, ["a", "b", "c"], [{"prompt": "p"}] * 3)
    assert scores.failed["judge"].tolist() == [True] * 3 and runner.failures == {"judge": 3}
    assert scores.total.tolist() == [0.0] * 3


def test_judge_names_the_accuracy_reward_that_scored_each_row():
    """With routes and several accuracy rewards, each row's judge (whose answer maj@k votes on) is the one that scored
    it, not always the first listed."""
    def fa(prompt, completion, **row):
        return 1.0

    def fb(prompt, completion, **row):
        return 1.0

    runner = RewardRunner([(fa, 1.0), (fb, 1.0)], timeout_s=None,
                          routes=Routes("data_source", {"a": ["fa"], "b": ["fb"]}))
    rows = [{"data_source": "b"}, {"data_source": "a"}, {"data_source": "b"}]
    scores = runner.score(["p"] * 3, ["x"] * 3, rows)
    assert scores.judge(["fa", "fb"]) == ["fb", "fa", "fb"]
    assert scores.judge(["fb", "fa"]) == ["fb", "fa", "fb"]


def test_parentheses_are_accepted_up_to_the_nesting_limit_and_refused_one_past_it() -> None:
    """`_MAX_NESTING` levels of parentheses still parse (a model may over-parenthesise a valid answer); one more is
    refused, so the bound on the parser's recursion is exactly the documented one."""
    from gspo.rewards.builtin import _MAX_NESTING

    assert parse_arithmetic("(" * _MAX_NESTING + "1" + ")" * _MAX_NESTING) == (Fraction(1), [1])
    with pytest.raises(ValueError, match="nested"):
        parse_arithmetic("(" * (_MAX_NESTING + 1) + "1" + ")" * (_MAX_NESTING + 1))


def test_countdown_reads_whichever_of_numbers_and_target_the_row_lacks_from_the_prompt() -> None:
    """A row with only `numbers` or only `answer` still scores: the missing one comes from the `n1,...:target=`
    prompt, rather than the row being reported as bad data."""
    assert countdown_reward("3,7,25:46=", "25+7*3", numbers=[3, 7, 25]) == 1.0
    assert countdown_reward("3,7,25:46=", "25+7*3", answer="46") == 1.0
    assert countdown_reward("3,7,25:47=", "25+7*3", numbers=[3, 7, 25]) == 0.0


def test_last_number_keeps_a_comma_before_four_digits_as_a_separator_between_numbers() -> None:
    """Only a comma before exactly three digits is a thousands separator: "1,2345" is the numbers 1 and 2345, not
    12345, so its last number is 2345."""
    assert REWARDS["last_number"]("q", "1,2345", answer="2345") == 1.0
    assert REWARDS["last_number"]("q", "1,2345", answer="12345") == 0.0


def test_math_reward_does_not_evaluate_an_exponent_of_five_digits() -> None:
    """An exponent of 5 or more digits is not evaluated (sympy may hold the GIL for hours on it): such a completion
    scores 0 and gives no answer, even when it equals the gold answer; a 4-digit exponent is still evaluated. In a
    child process with a deadline: without the guard the calls would hold the GIL, which no pytest timeout
    interrupts, so a regression would hang the suite instead of failing this test."""
    pytest.importorskip("math_verify")
    check = ("from gspo.rewards.builtin import _math_answer, math_reward as m; "
             "assert m('q', '$2^{10000}$', answer='2^{10000}') == 0.0 and _math_answer('$2^{10000}$') is None; "
             "assert m('q', '$10^{10^{10}}$', answer='1') == 0.0; "
             "assert m('q', '$2^{9999}$', answer='2^{9999}') == 1.0")
    try:
        done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("math_reward evaluated a huge power: still running after 120 s")
    assert done.returncode == 0, done.stderr

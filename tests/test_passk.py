"""pass@k (Chen et al. 2021, Eq. 1), maj@k and their interval: the pure functions against hand computations, then
`evaluate(samples_per_prompt=n)` on a tiny model and `gspo eval --samples N` (output keys and flag validation)."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

from conftest import varied_reward
from gspo.cli import main
from gspo.evaluation import evaluate, maj_at_k, mean_ci95, pass_at_k, pass_at_k_ci95, t95, vote_answer
from gspo.models import build_preset, save_model
from gspo.rewards import REWARDS, RewardRunner, answer_extractor, with_answer

# ------------------------------------------------------------------------------------------------ pass@k estimator


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),  # no correct sample: never solved, whatever k
        (5, 4, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (5, 5, 1, 1.0),
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
    ],
)
def test_pass_at_k_matches_hand_computation(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_form_and_stays_stable_for_large_n():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)
    # C(2000, 1000) overflows a float; the product form does not form it
    exact = 1 - Fraction(math.comb(1000, 100), math.comb(2000, 100))
    assert pass_at_k(2000, 1000, 100) == pytest.approx(float(exact), abs=1e-12)
    assert pass_at_k(2000, 1, 100) == pytest.approx(100 / 2000, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


# --------------------------------------------------------------------------------------------------------- maj@k


@pytest.mark.parametrize(
    ("answers", "correct", "k", "expected"),
    [
        (["7", "7", "8"], [True, True, False], 3, 1.0),  # the majority is right
        (["8", "8", "7"], [False, False, True], 3, 0.0),  # a right minority does not count
        (["8", "7"], [False, True], 2, 0.0),  # a tie goes to the first answer to occur ...
        (["7", "8"], [True, False], 2, 1.0),  # ... whichever it is
        (["8", "7", "7", "8"], [False, True, True, False], 4, 0.0),  # 2-2 tie: "8" occurred first
        ([None, None, "7"], [False, False, True], 3, 1.0),  # samples without an answer do not vote
        ([None, None, None], [False, False, False], 3, 0.0),  # no votes at all
        (["7", "8", "8"], [True, False, False], 1, 1.0),  # only the first k samples vote
        (["7", "8", "8"], [True, False, False], 3, 0.0),
        (["7", "7"], [False, True], 2, 1.0),  # an answer is right if any of its samples was judged right
    ],
)
def test_maj_at_k_on_hand_made_votes(answers, correct, k, expected):
    assert maj_at_k(answers, correct, k) == expected


def test_maj_at_k_rejects_bad_k_and_mismatched_verdicts():
    with pytest.raises(ValueError, match="maj_at_k"):
        maj_at_k(["1", "2"], [True, False], 3)
    with pytest.raises(ValueError, match="maj_at_k"):
        maj_at_k(["1", "2"], [True], 1)


def test_vote_answer_normalises_whitespace_and_abstains_on_empty_text():
    assert vote_answer("  579 \n ok ") == vote_answer("579 ok") == "579 ok"
    assert vote_answer("579") != vote_answer("5 79")
    assert vote_answer("") is None and vote_answer(" \n\t") is None


# ------------------------------------------------------------------------------------------------ the 95% interval


def test_ci_is_the_t_interval_around_the_mean():
    values = [0.2, 0.5, 0.9, 0.4]
    mean = sum(values) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    low, high = mean_ci95(values)
    assert low < mean < high
    # Student's t with 3 degrees of freedom (3.182): the normal's 1.96 gave an interval 38 % narrower
    assert (low, high) == pytest.approx((mean - 3.182446 * std / 2, mean + 3.182446 * std / 2), abs=1e-6)


@pytest.mark.parametrize("df, table", [(1, 12.706205), (2, 4.302653), (3, 3.182446), (4, 2.776445), (7, 2.364624),
                                       (10, 2.228139), (15, 2.131450), (30, 2.042272), (100, 1.983972),
                                       (1000, 1.962339)])
def test_t95_is_students_97_5_percent_quantile(df, table):
    assert t95(df) == pytest.approx(table, abs=1e-6)  # published tables, 6 decimals


def test_t95_tends_to_the_normal_quantile():
    assert 1.959964 < t95(100_000) < t95(10_000) < t95(1000)
    assert t95(100_000) == pytest.approx(1.959964, abs=1e-4)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t95(0)


def test_ci_has_zero_width_when_all_problems_agree_and_stays_in_0_1():
    low, high = mean_ci95([0.7] * 5)
    assert low == high == pytest.approx(0.7)
    assert mean_ci95([1.0, 1.0, 1.0, 1.0, 0.0]) == (pytest.approx(0.245, abs=1e-3), 1.0)  # 0.8 ± 0.555, clipped at 1
    assert mean_ci95([0.3]) == (0.0, 1.0)  # one problem: no spread to estimate


# ------------------------------------------------------------------------------------------ evaluate(n > 1) on a model


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny-moe")


ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": i} for i in range(8)]


def make_recorder(seen: list[tuple[int, str, float]]):
    def digits(prompt: str, completion: str, **row) -> float:
        """The fraction of digits (varies between samples of a random model); records every call."""
        value = varied_reward(prompt, completion)
        seen.append((row["id"], completion, value))
        return value

    return digits


def test_evaluate_with_samples_reports_pass_and_maj_at_k(tiny):
    model, tokenizer = tiny
    seen: list[tuple[int, str, float]] = []
    rewards = RewardRunner([(make_recorder(seen), 1.0)], timeout_s=None)
    result = evaluate(model, tokenizer, ROWS, rewards, 4, samples_per_prompt=4, ks=(4, 1, 2), accuracy_threshold=0.5)

    assert len(seen) == 4 * len(ROWS) and {i for i, _, _ in seen} == set(range(len(ROWS)))
    solved = [sum(v >= 0.5 for i, _, v in seen if i == row) for row in range(len(ROWS))]
    per_sample = sum(solved) / (4 * len(ROWS))
    assert 0 < per_sample < 1  # a property the checks below can fail on
    assert result["accuracy"] == pytest.approx(per_sample) and result["pass@1"] == pytest.approx(per_sample)
    assert result["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in solved) / len(ROWS))
    assert result["pass@4"] == pytest.approx(sum(c > 0 for c in solved) / len(ROWS))
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    assert result["pass@1"] < result["pass@4"]  # some row was solved by some but not all of its samples
    for k in (1, 2, 4):
        assert result[f"pass@{k}_ci95_low"] <= result[f"pass@{k}_ci95_high"]
        assert result[f"pass@{k}_ci95_low"] <= result[f"pass@{k}"] <= result[f"pass@{k}_ci95_high"]
        assert 0 <= result[f"maj@{k}"] <= 1
    assert result["reward_mean"] == pytest.approx(sum(v for _, _, v in seen) / len(seen), abs=1e-6)


def test_evaluate_samples_are_reproducible_whatever_the_batch_size(tiny):
    model, tokenizer = tiny
    rewards = RewardRunner([(varied_reward, 1.0)], timeout_s=None)
    run = lambda batch_size, seed=0: evaluate(model, tokenizer, ROWS, rewards, 4, batch_size=batch_size,  # noqa: E731
                                              samples_per_prompt=4, ks=(1, 2, 4), accuracy_threshold=0.5, seed=seed)
    first = run(256)
    assert run(256) == first
    assert run(4) == first  # one row per generate call: the same completions
    assert run(256, seed=1) != first  # another seed draws other completions


def test_evaluate_majority_votes_on_answer_of(tiny):
    """One answer for every sample: maj@k is then whether that answer is right, i.e. the verdict shared by all."""
    model, tokenizer = tiny
    rows = [{"prompt": f"{i}+1=", "solved": i < 3} for i in range(8)]
    rewards = RewardRunner([(lambda prompt, completion, **row: float(row["solved"]), 1.0)], timeout_s=None)
    result = evaluate(model, tokenizer, rows, rewards, 2, samples_per_prompt=3, ks=(1, 3),
                      answer_of=lambda completion: "same")
    assert result["maj@1"] == result["maj@3"] == result["pass@3"] == 3 / 8
    no_votes = evaluate(model, tokenizer, rows, rewards, 2, samples_per_prompt=3, ks=(3,),
                        answer_of=lambda completion: None)
    assert no_votes["maj@3"] == 0.0 and no_votes["pass@3"] == 3 / 8


def test_evaluate_votes_on_the_answer_the_accuracy_reward_extracts(tiny):
    """Without answer_of, maj@k votes on the accuracy reward's `with_answer` extractor (here: one answer for all)."""
    model, tokenizer = tiny
    rows = [{"prompt": f"{i}+1=", "solved": i < 3} for i in range(8)]

    @with_answer(lambda completion: "same")
    def solved(prompt, completion, **row):
        return float(row["solved"])

    rewards = RewardRunner([(varied_reward, 0.5), (solved, 1.0)], timeout_s=None)
    result = evaluate(model, tokenizer, rows, rewards, 2, samples_per_prompt=3, ks=(3,), accuracy_reward="solved")
    assert result["maj@3"] == result["pass@3"] == 3 / 8
    plain = RewardRunner([(lambda prompt, completion, **row: float(row["solved"]), 1.0)], timeout_s=None)
    texts = evaluate(model, tokenizer, rows, plain, 2, samples_per_prompt=3, ks=(3,))  # no extractor: whole text
    assert texts["maj@3"] == evaluate(model, tokenizer, rows, plain, 2, samples_per_prompt=3, ks=(3,),
                                      answer_of=vote_answer)["maj@3"]


@pytest.mark.parametrize("extract", [lambda completion: 1 / 0, lambda completion: [completion]])
def test_a_failing_answer_extractor_is_a_clear_error(tiny, extract):
    """An extractor that raises, or returns an unhashable answer, stops the evaluation naming it and the completion."""
    model, tokenizer = tiny
    rewards = RewardRunner([(with_answer(extract)(lambda prompt, completion, **row: 1.0), 1.0)], timeout_s=None)
    with pytest.raises(ValueError, match=r"maj@k: the answer extractor .*<lambda> failed on the completion"):
        evaluate(model, tokenizer, ROWS, rewards, 2, samples_per_prompt=2, ks=(2,))


@pytest.mark.parametrize(("name", "gold", "completions"), [
    ("addition", "115", ["115", " 115 ok", "115\n", "1150", "-115", "", "abc", "0115"]),
    ("last_number", "115", ["57 + 58 = 115", "115", "it is 1,150", "115 or 116", "none", "-115"]),
])
def test_built_in_answers_are_what_the_reward_checks(name, gold, completions):
    """A completion is correct exactly when its extracted answer is the gold one: equal answers get equal verdicts,
    so one vote is one verdict."""
    fn = REWARDS[name]
    extract = answer_extractor(fn)
    assert extract is not None
    for completion in completions:
        answer = extract(completion)
        assert (fn("", completion, answer=gold) == 1.0) == (answer is not None and str(answer) == gold), completion
    assert extract("57 + 58 = 115" if name == "last_number" else "115 ok") == extract("115")


def test_math_answer_is_math_verifys_parse():
    pytest.importorskip("math_verify")
    extract = answer_extractor(REWARDS["math"])
    assert extract("so the answer is $\\boxed{\\frac{1}{2}}$") == extract("The answer: $\\frac{1}{2}$")
    assert extract("no answer here") is None
    # equal numbers written differently are one vote; different ones are not
    assert {extract(c) for c in ("0.5", "1/2", "$\\frac{2}{4}$", "the answer is 50%")} == {"1/2"}
    assert extract("3.0") == extract("3") == "3" != extract("3.5")
    assert extract("$\\sqrt{8}$") == extract("$2\\sqrt{2}$") != extract("$\\sqrt{2}$")
    # ... as the verifier judges them
    assert [REWARDS["math"]("", c, answer="1/2") for c in ("0.5", "$\\frac{2}{4}$", "50%", "3.0")] == [1, 1, 1, 0]
    assert [REWARDS["math"]("", c, answer="3") for c in ("3.0", "3", "3.5")] == [1, 1, 0]
    assert answer_extractor(REWARDS["countdown"]) is None  # many expressions reach a target: no single answer


def test_default_evaluate_stays_greedy(tiny):
    model, tokenizer = tiny
    rewards = RewardRunner([(varied_reward, 1.0)], timeout_s=None)
    greedy = evaluate(model, tokenizer, ROWS, rewards, 4, accuracy_threshold=0.5)
    assert sorted(greedy) == ["accuracy", "accuracy_ci95_high", "accuracy_ci95_low", "response_length",
                              "reward_failure_rate", "reward_mean", "truncation_rate"]
    assert evaluate(model, tokenizer, ROWS, rewards, 4, accuracy_threshold=0.5, samples_per_prompt=1,
                    temperature=0.5, seed=3) == greedy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"samples_per_prompt": 0}, "samples_per_prompt"), ({"samples_per_prompt": 4, "ks": (5,)}, "ks"),
     ({"samples_per_prompt": 4, "ks": ()}, "ks"), ({"samples_per_prompt": 4, "ks": (0, 1)}, "ks"),
     ({"samples_per_prompt": 2, "temperature": 0.0}, "temperature"), ({"samples_per_prompt": 2, "top_p": 0}, "top_p")],
)
def test_evaluate_rejects_bad_sampling_arguments(tiny, kwargs, match):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=match):
        evaluate(model, tokenizer, ROWS, RewardRunner([(varied_reward, 1.0)]), 4, **kwargs)


# ------------------------------------------------------------------------------------------------------ gspo eval


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("passk") / "model"
    save_model(*build_preset("tiny-moe"), out)
    return out


def eval_json(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.rindex("\n{") + 1:] if "\n{" in out else out[out.index("{"):])


def test_gspo_eval_with_samples_prints_pass_and_maj_at_k(model_dir, capsys, monkeypatch):
    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    assert main(["eval", str(model_dir), "--size", "8", "--max-new-tokens", "4", "--reward", "varied",
                 "--accuracy-threshold", "0.5", "--samples", "4", "--k", "1,2,4"]) == 0
    result = eval_json(capsys)
    assert result["samples_per_prompt"] == 4 and result["temperature"] == 1.0 and result["top_p"] == 1.0
    for k in (1, 2, 4):
        low, high = result[f"pass@{k}_ci95"]
        assert low <= result[f"pass@{k}"] <= high
        assert 0 <= result[f"maj@{k}"] <= 1
        assert f"pass@{k}_ci95_low" not in result
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    assert result["pass@1"] == pytest.approx(result["accuracy"])
    assert result["solved_samples"] == round(result["accuracy"] * 32)


def test_gspo_eval_default_is_greedy_without_pass_keys(model_dir, capsys):
    assert main(["eval", str(model_dir), "--size", "4", "--max-new-tokens", "4"]) == 0
    result = eval_json(capsys)
    assert result["samples_per_prompt"] == 1 and result["temperature"] is None
    assert not [key for key in result if key.startswith(("pass@", "maj@"))]
    assert "solved" in result and "rows_with_reward_failures" in result


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--samples", "4", "--k", "1,8"], "--k"), (["--samples", "4", "--k", "0"], "--k"),
     (["--samples", "4", "--k", "two"], "--k"), (["--k", "2"], "--k"), (["--samples", "0"], "--samples"),
     (["--samples", "4", "--temperature", "0"], "--temperature"),
     (["--samples", "4", "--temperature", "-1"], "--temperature"), (["--samples", "4", "--top-p", "1.5"], "--top-p"),
     (["--temperature", "0.7"], "--temperature")],
)
def test_gspo_eval_validates_sampling_flags_before_loading_anything(tmp_path, capsys, flags, named):
    missing = tmp_path / "no_model"  # a model that does not exist: the flag's error must come first
    assert main(["eval", str(missing), "--size", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and str(missing) not in err


def test_trainer_logs_heldout_pass_at_k_when_asked(tmp_path):
    """trainer.eval_samples > 1: every evaluation logs pass@k for k = 1, 2, 4 and maj@k, pass@k non-decreasing in k."""
    from conftest import DEMO, tiny_overrides
    from gspo.config import load_config
    from gspo.tracking import read_metrics
    from gspo.trainer import train

    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, "trainer.steps=1", "trainer.eval_samples=4",
                                           "trainer.eval_temperature=1.0")))
    for record in read_metrics(out / "eval.jsonl"):
        passes = [record[f"heldout_pass@{k}"] for k in (1, 2, 4)]
        assert passes == sorted(passes) and "heldout_maj@4" in record
        assert record["heldout_pass@1"] == pytest.approx(record["heldout_accuracy"])
        assert record["heldout_pass@4_ci95_low"] <= record["heldout_pass@4"] <= record["heldout_pass@4_ci95_high"]


def test_a_shard_with_its_row_offset_draws_the_rows_own_samples(tiny):
    """Several processes each evaluate a shard: with its offset, a shard's rows get the samples (and so the solved
    fractions) they get in one call on all the rows, and the intervals recomputed from every row's values
    (`pass_at_k_ci95`) are the one call's."""
    model, tokenizer = tiny
    rewards = RewardRunner([(varied_reward, 1.0)], timeout_s=None)
    kwargs = {"samples_per_prompt": 4, "ks": [1, 2, 4], "seed": 5, "accuracy_threshold": 0.3}
    whole: list[float] = []
    result = evaluate(model, tokenizer, ROWS, rewards, 6, row_values=whole, **kwargs)
    parts: list[float] = []
    for start, stop in ((0, 3), (3, len(ROWS))):
        evaluate(model, tokenizer, ROWS[start:stop], rewards, 6, row_values=parts, row_offset=start, **kwargs)
    assert parts == whole
    assert 0 < sum(whole) < len(whole)  # the verdicts vary, so the comparison means something
    intervals = pass_at_k_ci95(whole, 4, [1, 2, 4])
    assert intervals == {key: result[key] for key in intervals}
    unshifted: list[float] = []
    evaluate(model, tokenizer, ROWS[3:], rewards, 6, row_values=unshifted, **kwargs)
    assert unshifted != whole[3:]  # without the offset, the shard draws the first rows' samples


@pytest.mark.parametrize("n", [1, 3])
def test_evaluate_ends_completions_at_the_runs_stop_strings(tiny, n):
    """Held-out completions end where training ones do (`rollout.stop`): each is the completion decoded without the
    stop string, cut right after its first occurrence (the audit found evaluation decoding on to the token budget)."""
    model, tokenizer = tiny
    rows = [{"prompt": f"{i}+{i}=", "id": i} for i in range(8)]

    def completions(stop: tuple[str, ...]) -> list[str]:
        seen: list[tuple[int, str, float]] = []
        rewards = RewardRunner([(make_recorder(seen), 1.0)], timeout_s=None)
        evaluate(model, tokenizer, rows, rewards, 12, samples_per_prompt=n, ks=(n,), stop=stop, batch_size=4 * n)
        return [c for _, c, _ in sorted(seen, key=lambda t: t[0])]  # row order; a row's samples in their order

    free = completions(())
    text = "".join(free)
    mark = max(set(text), key=text.count)  # the commonest character of the free completions
    assert sum(mark in c[:-1] for c in free) >= 2  # the free completions run past the mark, so the check can fail
    for a, b in zip(free, completions((mark,)), strict=True):
        assert b == (a[:a.index(mark) + 1] if mark in a else a)


def test_shards_of_an_evaluation_merge_into_the_evaluation_of_all_rows():
    """Several processes evaluate shards; their merge must equal one evaluation of every row. Tool-call fractions are
    over calls, not rows: a shard without calls (validity NaN) used to turn the merged validity into NaN, and shards
    with unequal calls were weighted by rows."""
    from gspo.agent.episodes import EPISODE_COUNTS, count_metrics
    from gspo.evaluation import merge_shards

    keys = (*EPISODE_COUNTS, "tool_calls", "invalid_calls", "tool_failures")
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (10, len(keys)), generator=gen)
    rows[6:, keys.index("tool_calls")] = 0  # the last shard calls no tool
    rows[:, keys.index("invalid_calls")] = torch.minimum(rows[:, keys.index("invalid_calls")],
                                                         rows[:, keys.index("tool_calls")])
    rows[:, keys.index("tool_failures")] = torch.minimum(rows[:, keys.index("tool_failures")],
                                                         rows[:, keys.index("tool_calls")]
                                                         - rows[:, keys.index("invalid_calls")])
    whole = count_metrics(rows, keys)
    shards = [(count_metrics(rows[a:b], keys), b - a) for a, b in ((0, 2), (2, 6), (6, 10))]
    assert math.isnan(shards[2][0]["tool_call_validity"]) and not math.isnan(whole["tool_call_validity"])
    merged = merge_shards([*shards, ({}, 0)])  # a process with no rows adds nothing
    assert merged.keys() == whole.keys()
    assert all(merged[k] == pytest.approx(whole[k], abs=1e-6) for k in whole)
    assert math.isnan(merge_shards([shards[2]])["tool_call_validity"])  # no call anywhere: still NaN


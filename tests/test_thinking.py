"""Rewards of reasoning models judge the answer after the thinking block (`gspo.rewards.thinking`): a thought cut off
mid-way is no answer, not a source of numbers for the verifier. Pure rules first, then the runner with the real
verifiers (Math-Verify included), then evaluation, the trainer and the command line on the tiny model."""

from __future__ import annotations

import json

import pytest

from conftest import DEMO, tiny_overrides
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.evaluation import evaluate
from gspo.models import build_preset, save_model
from gspo.rewards import RewardRunner, after_thinking, batched, final_answer
from gspo.rewards.thinking import check_think_tags
from gspo.rollout import HFSampler, SamplingParams
from gspo.tracking import read_metrics
from gspo.trainer import train

TRUNCATED = "<think>\nWe need 12*3. 12*3 = 36. So the answer is 36. But wait, let me check by"
FINISHED = "<think>\nWe need 12*3 = 36.\n</think>\n\nThe answer is \\boxed{36}."
QWEN3_NO_THINKING = "<|im_start|>user\n12*3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>12*3?<｜Assistant｜><think>\n"


# ---------------------------------------------------------------------------------------------------- final_answer


@pytest.mark.parametrize(("prompt", "completion", "expected"), [
    ("q", "The answer is 36.", "The answer is 36."),  # no reasoning: the completion as it is
    ("q", FINISHED, "\n\nThe answer is \\boxed{36}."),  # after the close tag
    ("q", TRUNCATED, None),  # opened, never closed: no answer
    ("q", "<think>a</think> 7 <think>b", None),  # a second thought left open
    ("q", "<think>a</think> 7 <think>b</think> 8", " 8"),  # the last block's answer
    (R1_PROMPT, "12*3 = 36.\n</think>\n\n36", "\n\n36"),  # the template opened the block
    (R1_PROMPT, "12*3 = 36. So 36", None),  # ... and it never closed
    (QWEN3_NO_THINKING, "36", "36"),  # Qwen3 enable_thinking=false: a closed, empty block in the prompt
    ("Reason inside <think> tags, then answer. 12*3?", "36", "36"),  # a prompt that mentions the tag opens nothing
    ("Assistant: <think>", "12*3 = 36. So 36", None),  # R1-Zero's prompt ends with the open tag
    ("q", "</think>36", "36"),  # a close tag alone (its open tag was in a template the prompt does not show)
])
def test_final_answer(prompt, completion, expected):
    assert final_answer(prompt, completion) == expected


def test_other_tags():
    tags = ("<reasoning>", "</reasoning>")
    assert final_answer("q", "<reasoning>5</reasoning>6", tags) == "6"
    assert final_answer("q", "<reasoning>5", tags) is None
    assert final_answer("q", "<think>5", tags) == "<think>5"  # other tags are plain text


@pytest.mark.parametrize("tags", [["<think>"], ["<think>", ""], ["<t>", "<t>"], ["<t", "<t>"], "<think>",
                                  ["a", "b", "c"], [1, 2], ["<think>", " </think>"], ["<think>\n", "</think>"]])
def test_bad_tags_are_refused(tags):
    with pytest.raises(ValueError, match="think_tags"):
        check_think_tags(tags)


# ----------------------------------------------------------------------------------------------------------- runner


def test_verifiers_give_no_credit_for_a_thought_cut_off():
    """The failure this prevents: Math-Verify and the last-number check both find 36 in the unfinished thought."""
    rows = [{"answer": "36"}] * 3
    completions = [TRUNCATED, FINISHED, "<think>36</think>\n\nIt is 35."]
    whole = RewardRunner({"math": 1.0, "last_number": 1.0}, timeout_s=None, think_tags=None)
    assert whole.score(["q"] * 3, completions, rows).values["math"].tolist() == [1.0, 1.0, 0.0]
    runner = RewardRunner({"math": 1.0, "last_number": 1.0}, timeout_s=None)
    scored = runner.score(["q"] * 3, completions, rows)
    assert scored.values["math"].tolist() == [0.0, 1.0, 0.0]
    assert scored.values["last_number"].tolist() == [0.0, 1.0, 0.0]
    assert scored.stats["unfinished_thinking"] == 1.0
    assert "unfinished_thinking" not in whole.score(["q"], [TRUNCATED], rows[:1]).stats


def test_unmarked_functions_see_the_whole_completion_and_marked_ones_the_answer():
    seen: dict[str, list] = {"raw": [], "answer": [], "batched": []}

    def raw(prompt, completion, **row):
        seen["raw"].append(completion)
        return float(completion.startswith("<think>") and "</think>" in completion)  # a format reward

    @after_thinking
    def answer(prompt, completion, **row):
        seen["answer"].append(completion)
        return 0.0

    @after_thinking
    @batched
    def judge(prompts, completions, **columns):
        seen["batched"].extend(completions)
        return [0.0] * len(completions)

    runner = RewardRunner([(raw, 1.0), (answer, 1.0), (judge, 1.0)], timeout_s=None)
    scored = runner.score(["q", "q", R1_PROMPT], [FINISHED, TRUNCATED, "x</think>y"], [{}] * 3)
    assert seen["raw"] == [FINISHED, TRUNCATED, "x</think>y"]
    assert seen["answer"] == seen["batched"] == ["\n\nThe answer is \\boxed{36}.", "", "y"]
    assert scored.values["raw"].tolist() == [1.0, 0.0, 0.0]
    assert scored.texts["answer"] == seen["answer"] and scored.texts["raw"] == seen["raw"]
    texts = runner.score(["q"], [TRUNCATED], [{}]).texts
    assert texts["answer"] == [""] and texts["raw"] == [TRUNCATED]


def test_every_builtin_verifier_and_reward_models_judge_the_answer():
    from gspo.rewards import REWARDS, RewardModel
    from gspo.rewards.thinking import judges_final_answer

    assert all(judges_final_answer(REWARDS[name]) for name in ("addition", "countdown", "last_number", "math", "code"))
    assert RewardModel.after_thinking is True


def test_addition_reward_ignores_a_thought_before_the_answer():
    runner = RewardRunner({"addition": 1.0}, timeout_s=None)
    scored = runner.score(["12+34="] * 2, ["<think>46</think>46", "<think>46"], [{"answer": "46"}] * 2)
    assert scored.values["addition"].tolist() == [1.0, 0.0]


# ------------------------------------------------------------------------------- evaluation, trainer, command line

TAGS = ("a", "b")  # characters of the tiny vocabulary that an untrained model writes now and then


def _unfinished(prompt: str, completion: str) -> bool:
    """The rule, restated: the completion's last 'a' comes after its last 'b'."""
    return completion.rfind("a") > completion.rfind("b")


def test_evaluate_reports_unfinished_thinking_and_votes_on_the_answers():
    model, tokenizer = build_preset("tiny-dense", seed=3)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(24)]
    runner = RewardRunner({"addition": 1.0}, timeout_s=None, think_tags=TAGS)
    result = evaluate(model, tokenizer, rows, runner, 16, samples_per_prompt=4, temperature=1.0, ks=[4], seed=1)
    # the same completions (a row's samples are a function of the seed and its position), recounted by hand
    sampler = HFSampler(model, tokenizer, SamplingParams(temperature=1.0, max_new_tokens=16))
    from gspo.evaluation import _SEED_MIX

    batch = sampler.generate([r["prompt"] for r in rows], 4, [1 * _SEED_MIX + i for i in range(24)])
    expected = sum(_unfinished("", c) for c in batch.completions) / len(batch.completions)
    assert 0 < expected < 1  # both kinds occur, so the count is tested
    assert result["unfinished_thinking_rate"] == pytest.approx(expected)
    plain = evaluate(model, tokenizer, rows, RewardRunner({"addition": 1.0}, timeout_s=None, think_tags=None), 16)
    assert "unfinished_thinking_rate" not in plain


def recording_reward(prompt: str, completion: str, **row) -> float:
    """Records the raw completions it sees (it is not marked `after_thinking`)."""
    RECORDED.append(completion)
    return 0.0


RECORDED: list[str] = []


def test_trainer_logs_the_unfinished_rate_of_each_step(tmp_path, caplog):
    RECORDED.clear()
    steps, eval_rows = 2, 8
    cfg = load_config(DEMO, tiny_overrides(
        tmp_path, "cold_start=null", f"trainer.steps={steps}", "trainer.eval_every=0", f"data.eval_size={eval_rows}",
        "rewards.functions={addition: 1.0, test_thinking:recording_reward: 0.0}", "rewards.accuracy_reward=addition",
        "rewards.think_tags=[a, b]", "rewards.timeout_s=null", "rewards.check=false"))  # counts its calls
    train(cfg)
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert len(RECORDED) == eval_rows + steps * n + eval_rows  # evaluations at step 0 and at the last step
    rollouts = RECORDED[eval_rows:eval_rows + steps * n]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["unfinished_thinking_rate"] for r in records] == pytest.approx(
        [sum(_unfinished("", c) for c in rollouts[k * n:(k + 1) * n]) / n for k in range(steps)])
    assert 0 < sum(_unfinished("", c) for c in rollouts) < len(rollouts)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [e["heldout_unfinished_thinking_rate"] for e in evals] == pytest.approx(
        [sum(_unfinished("", c) for c in part) / eval_rows for part in (RECORDED[:eval_rows], RECORDED[-eval_rows:])])
    # an untrained model rarely ends within 4 tokens: the first evaluation says its accuracy measures the budget
    assert evals[0]["heldout_truncation_rate"] >= 0.5
    warned = [r.getMessage() for r in caplog.records if "-token budget without ending" in r.getMessage()]
    assert len(warned) == 1 and "trainer.eval_max_new_tokens" in warned[0]


def test_no_budget_warning_when_most_completions_end(caplog):
    from gspo.trainer import _warn_cut_off

    _warn_cut_off({"truncation_rate": 0.3, "unfinished_thinking_rate": 0.2}, 64, "trainer.eval_max_new_tokens")
    _warn_cut_off({"truncation_rate": 0.1}, 64, "trainer.eval_max_new_tokens")
    assert not [r for r in caplog.records if "token budget" in r.getMessage()]
    _warn_cut_off({"truncation_rate": 0.1, "unfinished_thinking_rate": 0.6}, 64, "trainer.eval_max_new_tokens")
    assert "and 60% never finished their reasoning" in caplog.records[-1].getMessage()


def test_cut_off_episodes_are_warned_about_with_the_environments_limits(caplog):
    """Multi-turn: an episode is cut by env.max_turns / env.max_tokens or an unfinished turn, and its last reply is
    scored; the single-turn advice (raise trainer.eval_max_new_tokens, 'count as unsolved') misled."""
    from gspo.trainer import _warn_cut_off

    _warn_cut_off({"truncation_rate": 0.75}, 16, "trainer.eval_max_new_tokens", episodes=True)
    message = caplog.records[-1].getMessage()
    assert "75% of the held-out episodes" in message and "env.max_turns, env.max_tokens" in message
    assert "eval_max_new_tokens" not in message and "unsolved" not in message


def test_config_refuses_bad_tags_and_accepts_null(tmp_path):
    with pytest.raises(ConfigError, match=r"rewards\.think_tags"):
        load_config(DEMO, tiny_overrides(tmp_path, "rewards.think_tags=[x]"))
    assert load_config(DEMO, tiny_overrides(tmp_path, "rewards.think_tags=null")).rewards.think_tags is None
    assert load_config(DEMO, tiny_overrides(tmp_path)).rewards.think_tags == ["<think>", "</think>"]


def _printed(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


def test_gspo_eval_think_tags(tmp_path, capsys):
    folder = tmp_path / "model"
    save_model(*build_preset("tiny-dense", seed=3), folder)
    base = ["eval", str(folder), "--size", "16", "--samples", "2", "--temperature", "1"]
    assert main([*base, "--think-tags", "a,b"]) == 0
    tagged_rate = _printed(capsys)["unfinished_thinking_rate"]
    assert 0 <= tagged_rate <= 1
    assert main([*base, "--think-tags", "none"]) == 0
    assert "unfinished_thinking_rate" not in _printed(capsys)
    assert main([*base, "--think-tags", "a"]) == 2
    assert "--think-tags" in capsys.readouterr().err
    assert main([*base, "--think-tags", "a, b"]) == 0  # spaces after the comma are the user's, not the tag's
    assert _printed(capsys)["unfinished_thinking_rate"] == tagged_rate

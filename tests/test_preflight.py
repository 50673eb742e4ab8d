"""`gspo train CONFIG --check` (`gspo.preflight`): it refuses what the run refuses, writes nothing, predicts what the
run then does (rows, evaluations, checkpoints and their size), and finds the accuracy rewards that would make a run's
numbers meaningless — one that rejects the rows' own answers, one that accepts an empty or another row's answer."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from conftest import DEMO, tiny_overrides
from gspo.checkpoint import checkpoint_path, list_checkpoints
from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.evaluation import wilson_ci95
from gspo.preflight import check, disk_needed, measure, plan, shared_passages, warnings
from gspo.rewards import RewardFailure, RewardRunner
from gspo.rewards.checks import reference_text, reward_checks, reward_warnings
from gspo.tracking import read_metrics
from gspo.trainer import train

REWARDS = '''
def boxed(prompt, completion, answer, **row):
    """Wants \\\\boxed{answer}; the rows' solutions are plain numbers."""
    return float("\\\\boxed{" + answer + "}" in completion)

def anything(prompt, completion, **row):
    """Pays for any answer at all, right or wrong."""
    return float(bool(completion.strip()))

def always(prompt, completion, **row):
    return 1.0
'''


def own_rows(tmp_path: Path) -> list[str]:
    """Overrides for a user's jsonl files (60 training, 20 held-out addition rows) and a reward module."""
    def write(name: str, first: int, count: int) -> Path:
        rows = [{"question": f"{a}+{a % 7}=", "result": str(a + a % 7)} for a in range(first, first + count)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp_path / name

    (tmp_path / "rw.py").write_text(REWARDS)
    return [*tiny_overrides(tmp_path / "run", "cold_start=null"), f"data.path={write('train.jsonl', 0, 60)}",
            f"data.eval_path={write('heldout.jsonl', 100, 20)}", "data.task=null", "data.train_size=null",
            "data.eval_size=null", "data.fields={prompt: question, answer: result, solution: result}"]


def test_check_writes_nothing_and_predicts_the_run(tmp_path):
    """The report's rows, evaluation steps, checkpoints and checkpoint size are those the run then has."""
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.checkpoint_every=2",
                                           "trainer.keep_checkpoints=1"))
    report = check(cfg)
    assert not (tmp_path / "run").exists()
    summary = train(cfg)
    run = tmp_path / "run"
    plan = report["plan"]
    assert plan["evaluations"] == [r["step"] for r in read_metrics(run / "eval.jsonl")] == [0, 2, 3]
    assert plan["checkpoints"] == [2, 3] and plan["checkpoints_kept"] == 1 == len(list_checkpoints(run))
    assert plan["completions"] == 3 * 4 * 4 and plan["optimizer_steps"] == 3 * 4
    assert report["train"]["rows"] == summary["train"]["rows"] == 200
    assert report["heldout"]["rows"] == summary["heldout"]["rows"] == 16
    saved = sum(f.stat().st_size for f in checkpoint_path(run, 3).rglob("*") if f.is_file())
    assert abs(report["model"]["checkpoint_bytes"] - saved) / saved < 0.05
    folder = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())  # 1 checkpoint, final, logs
    assert saved < folder <= report["model"]["disk_bytes"]  # (while step 3's was written, step 2's was still there)
    r = report["rewards"]["heldout"]  # the built-in addition verifier on the task's own answers
    assert (r["field"], r["rows"], r["reference_solved"], r["empty_solved"], r["neighbour_solved"]) == \
        ("solution", 16, 16, 0, 0)
    assert r["neighbour_rows"] > 0 and r["seconds_per_completion"] > 0 and warnings(report) == []


@pytest.mark.parametrize(("reward", "finding"), [
    ("boxed", r"judges 60 of 60 training rows' own solution wrong \(e\.g\. row 0: '0'\)"),
    ("anything", r"judges another row's solution solved on \d+ of \d+ training rows"),
    ("always", r"judges an empty completion solved on 60 of 60 training rows"),
])
def test_an_accuracy_reward_that_cannot_tell_right_from_wrong_is_found(tmp_path, capsys, reward, finding):
    args = [*own_rows(tmp_path), f"rewards.functions={{{tmp_path / 'rw.py'}:{reward}: 1.0}}"]
    report = check(load_config(DEMO, args))
    assert any(re.search(finding, w) for w in warnings(report)), warnings(report)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(DEMO.read_text())
    assert main(["train", str(cfg_file), "--check", *args]) == 1  # the run would start; its numbers would not hold
    err = capsys.readouterr().err
    assert "warning: the accuracy reward judges" in err and "nothing was computed or written" in err
    assert not (tmp_path / "run").exists()


def test_a_run_folder_on_a_disk_without_room_for_its_checkpoints_is_warned_about(tmp_path, monkeypatch):
    monkeypatch.setattr("gspo.preflight._free_bytes", lambda out: 10_000_000)  # 10 MB: less than one checkpoint
    report = check(load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null")))
    assert report["model"]["disk_bytes"] > report["model"]["disk_free_bytes"] == 10_000_000
    assert any("a checkpoint will fail to be written" in w for w in warnings(report))


def test_a_clean_check_exits_0_and_an_error_exits_2_as_the_run_would(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(DEMO.read_text())
    args = own_rows(tmp_path)  # the built-in addition verifier: the rows' answers are right, others are not
    assert main(["train", str(cfg_file), "--check", *args]) == 0
    out = capsys.readouterr().out
    assert "training rows: 60 from" in out and "own solution judged solved 60/60" in out and "plan: 3 steps" in out
    assert "float32, sdpa attention" in out  # model.attn_implementation=None: the model's default
    assert main(["train", str(cfg_file), "--check", *args, "rollout.group_size=0"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err
    # nothing held out (data.eval_split: null, as the README offers): the report and its warning, not a KeyError
    assert main(["train", str(cfg_file), "--check", *args, "data.eval_split=null", "data.eval_path=null"]) == 1
    assert "plan: 3 steps" in capsys.readouterr().out


def test_check_refuses_what_a_resume_would_refuse_and_names_the_checkpoint_it_would_take(tmp_path):
    args = tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.eval_every=0")
    train(load_config(DEMO, args))
    with pytest.raises(ValueError, match="--resume"):  # a run is there: resume or overwrite it
        check(load_config(DEMO, args))
    with pytest.raises(ConfigError, match=r"algorithm\.loss"):
        check(load_config(DEMO, [*args, "algorithm.loss=grpo"]), resume=True)
    report = check(load_config(DEMO, [*args, "trainer.steps=5"]), resume=True)
    assert report["config"]["resume_from"] == checkpoint_path(tmp_path / "run", 3).name
    assert report["config"]["changed"] == ["trainer.steps"]


def test_a_reference_closes_the_thought_a_prompt_opens():
    """An R1-style prompt ends with <think>: a correct completion closes it before answering, so the check scores
    the reference that way (else every reference would read as an unfinished thought, i.e. no answer)."""
    assert reference_text({"answer": 42}, "answer", "q<think>\n", ("<think>", "</think>")) == "</think>42"
    assert reference_text({"answer": 42}, "answer", "q", ("<think>", "</think>")) == "42"
    assert reference_text({"solution": [{"role": "assistant"}]}, "solution", "q", None) is None
    rows = [{"prompt": f"{a}+1=<think>", "answer": str(a + 1)} for a in range(8)]
    found = reward_checks(RewardRunner({"addition": 1.0}), rows, "addition", 1.0)
    assert (found["field"], found["reference_solved"], found["empty_solved"], found["neighbour_solved"]) == \
        ("answer", 8, 0, 0)


def test_held_out_rows_that_share_a_passage_with_a_training_prompt_are_found_but_not_a_shared_template():
    """A held-out problem copied into the training data with other wording around it (another dataset's copy) is
    reported; the instruction every row carries is not (it is in more than 1 % of the rows, and at least 5)."""
    template = "Solve the problem and put your final answer within a box at the very end. "
    problem = "A train leaves the station at noon travelling at sixty miles per hour towards the city"
    train = [{"prompt": template + f"Problem {i}: add {i} and {i + 1} then double it."} for i in range(300)]
    train[123] = {"prompt": f"Here is a question. {problem.upper()}; when does it arrive?"}
    held = [{"prompt": template + f"Problem {i}: multiply {i} by {i + 2} and halve it."} for i in range(50)]
    held[7] = {"prompt": template + problem + ". How far has it gone by 3 pm?"}
    found = shared_passages(train, held)
    assert found["rows"] == 1 and found["examples"][0]["heldout_row"] == 7
    assert found["examples"][0]["heldout_prompt"] == held[7]["prompt"][:80]  # findable when the numbering is not
    assert found["examples"][0]["training_row"] == 123
    assert found["examples"][0]["passage"] in problem.casefold()
    assert shared_passages(train, held, n=40)["rows"] == 0  # no passage that long is shared


def test_a_multi_turn_demonstration_is_checked_by_its_answer(tmp_path):
    """The calculator task's tool-use rows have a list of messages as their solution: their reference is the answer
    the final reply must give; the direct rows' is their text solution."""
    config = Path(__file__).parents[1] / "configs" / "calculator.yaml"
    report = check(load_config(config, [f"trainer.out={tmp_path / 'run'}", "data.train_size=300",
                                        "data.eval_size=20"]))
    r = report["rewards"]["train"]
    assert r["field"] == "solution or answer" and r["rows"] == r["sampled"] == 200
    assert (r["reference_solved"], r["empty_solved"], r["neighbour_solved"]) == (200, 0, 0)


def test_solutions_longer_than_the_new_token_budget_are_warned_about(tmp_path):
    """A budget that cannot hold the demonstrated answers (and the end token) cuts every such completion off; the
    training rows' two-digit answers need 3 tokens with it, the limit here is 2."""
    report = check(load_config(DEMO, [*own_rows(tmp_path), "rollout.max_new_tokens=2",
                                      "trainer.eval_max_new_tokens=4"]))
    t = report["train"]["solution_tokens"]
    assert t["over"] == sum(len(str(a + a % 7)) + 1 > 2 for a in range(60)) > 0 and t["budget"] == 2
    assert report["heldout"]["solution_tokens"]["over"] == 0  # held-out: 4 new tokens
    assert any("training rows' solutions need more than rollout.max_new_tokens=2" in w for w in warnings(report))


def test_a_run_checks_its_accuracy_reward_at_the_start_and_says_so_in_its_summary(tmp_path, caplog):
    """Without --check, a run whose verifier rejects every gold answer trained on zero rewards and reported 0 %
    accuracy without a word. Now it warns at the start and summary.json keeps the finding."""
    args = [*own_rows(tmp_path), f"rewards.functions={{{tmp_path / 'rw.py'}:boxed: 1.0}}", "trainer.steps=1"]
    summary = train(load_config(DEMO, args))
    found = summary["reward_check"]
    assert found["train"]["reference_solved"] == 0 == found["heldout"]["reference_solved"]
    assert "rewards.check: the accuracy reward judges 60 of 60 training rows' own solution wrong" in caplog.text
    off = train(load_config(DEMO, [*args, f"trainer.out={tmp_path / 'off'}", "rewards.check=false"]))
    assert off["reward_check"] is None


def test_a_reward_that_raises_on_an_empty_completion_is_found_and_the_runs_counters_do_not_see_the_check():
    def strict(prompt, completion, answer, **row):
        return float(int(completion) == int(answer))  # int("") raises

    runner = RewardRunner({strict: 1.0})
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(10)]
    before = runner.state_dict()
    found = reward_checks(runner, rows, runner.names[0], 1.0)
    assert found["failed"] == {"reference": 0, "empty": 10, "neighbour": 0} and found["reference_solved"] == 10
    assert runner.state_dict() == before and runner.on_error == "fail"
    with pytest.raises(RewardFailure):  # the run's own calls fail as configured
        runner.score(["1+1="], [""], [{"answer": "2"}])
    assert any("fails on an empty completion (10 of 10 training rows): with rewards.on_error=fail a run stops" in w
               for w in reward_warnings(found, "training"))


def test_a_lora_run_is_planned_with_its_adapters(tmp_path):
    """With model.lora only the adapters train and a checkpoint holds them and their AdamW moments: the estimate is
    the run's real checkpoint, not the whole model's. The cold start and final/merged are whole models: the folder's
    estimate counts them so (it counted them at the adapters' size: 459 kB for a 14.8 MB folder)."""
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "model.lora={r: 16, alpha: 32, merged_final: true}",
                                           "trainer.steps=1", "trainer.eval_every=0"))
    report = check(cfg)
    m = report["model"]
    assert 0 < m["trainable"] < m["parameters"] / 10
    train(cfg)
    saved = sum(f.stat().st_size for f in checkpoint_path(tmp_path / "run", 1).rglob("*") if f.is_file())
    assert abs(m["checkpoint_bytes"] - saved) / saved < 0.25  # the RNG state, tokenizer and JSON files count
    assert m["checkpoint_bytes"] < report["model"]["parameters"] * 4 / 2  # far below the full model's weights
    folder = sum(f.stat().st_size for f in (tmp_path / "run").rglob("*") if f.is_file())
    assert abs(m["disk_bytes"] - folder) / folder < 0.1  # logs, tokenizers and configs are not counted


def test_measure_times_a_few_steps_elsewhere_and_estimates_the_run(tmp_path, capsys):
    """`--measure` runs a few steps of the config in a temporary folder (trainer.out untouched) and scales them to the
    planned run: the first step, the others at the measured median pace, and every planned evaluation."""
    args = tiny_overrides(tmp_path / "run", "trainer.steps=40", "trainer.eval_every=10")
    cfg = load_config(DEMO, args)
    report = check(cfg)
    t = measure(cfg, report["plan"], steps=3)
    assert not (tmp_path / "run").exists()
    assert t["step_seconds"] == pytest.approx(t["rollout_seconds"] + t["update_seconds"]) and t["step_seconds"] > 0
    assert t["eval_seconds"] > 0 and 0 < t["response_length"] <= 4  # rollout.max_new_tokens=4
    assert report["plan"]["evaluations"] == [0, 10, 20, 30, 40]
    assert t["run_seconds"] == pytest.approx(t["first_step_seconds"] + 39 * t["step_seconds"] + 5 * t["eval_seconds"])
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(DEMO.read_text())
    assert main(["train", str(cfg_file), "--measure", *args]) == 0
    captured = capsys.readouterr()
    assert "measured (5 steps of the model as loaded, no cold start)" in captured.out and "the run ≈" in captured.out
    assert "nothing was written to trainer.out" in captured.err and not (tmp_path / "run").exists()
    assert f"gspo train {cfg_file} --measure: " in captured.err  # it said --check


def test_measure_under_torchrun_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """Every torchrun process would time steps in a folder of its own, with collectives over different runs."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(DEMO.read_text())
    assert main(["train", str(cfg_file), "--measure", *tiny_overrides(tmp_path / "run")]) == 2
    assert "--measure times steps in one process" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_warmup_as_long_as_the_run_is_warned_about_at_check_and_at_start(tmp_path, caplog):
    """optim.warmup_steps counts optimizer steps (4 per RL step here): 200 of them in a 3-step run (12 optimizer
    steps) keep the learning rate at 6 % of optim.lr at most, which --check and the run's log now say."""
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "optim.warmup_steps=200"))
    assert any(re.search(r"optim\.warmup_steps=200 is not below the run's 12 optimizer steps.*reaches 6% of", w)
               for w in warnings(check(cfg))), warnings(check(cfg))
    with caplog.at_level(logging.WARNING, logger="gspo.trainer"):
        train(cfg)
    assert "optim.warmup_steps=200 is not below the run's 12 optimizer steps" in caplog.text
    assert not any("warmup_steps" in w for w in warnings(check(load_config(DEMO, tiny_overrides(
        tmp_path / "other", "cold_start=null", "optim.warmup_steps=11")))))


def test_the_plan_counts_checkpoints_kept_and_held_out_tokens_as_the_run_spends_them(tmp_path):
    """With no periodic checkpoint none is kept (not trainer.keep_checkpoints of them); the evaluations' token bound
    uses trainer.eval_max_new_tokens where set (the held-out budget, not rollout.max_new_tokens)."""
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "trainer.checkpoint_every=0", "trainer.keep_checkpoints=3",
                                           "trainer.eval_max_new_tokens=7", "trainer.eval_samples=2"))
    p = plan(cfg, train_rows=60, eval_rows=16)
    assert p["checkpoints"] == [] and p["checkpoints_kept"] == 0
    assert p["evaluations"] == [0, 2, 3]
    assert p["eval_tokens_max"] == 3 * 16 * 2 * 7  # evaluations × rows × samples × eval_max_new_tokens
    assert p["generated_tokens_max"] == 3 * 4 * 4 * 4  # training completions × rollout.max_new_tokens
    # multi-turn: eval_max_new_tokens is one turn's budget; an episode, held-out or not, is capped by env.max_tokens
    episodes = load_config(DEMO, tiny_overrides(tmp_path / "env", "trainer.checkpoint_every=0", "env.name=tools",
                                                "env.max_tokens=48", "data.chat=always",
                                                "trainer.eval_max_new_tokens=7", "trainer.eval_samples=2"))
    assert plan(episodes, train_rows=60, eval_rows=16)["eval_tokens_max"] == 3 * 16 * 2 * 48


def test_the_disk_estimate_counts_the_best_model_beside_the_final_one(tmp_path):
    """trainer.save_best keeps OUT/best as well as OUT/final: the run's folder holds one more model."""
    weights, checkpoint = 1_000, 3_000
    plain = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.keep_checkpoints=2"))
    best = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.keep_checkpoints=2",
                                            "trainer.save_best=true"))
    assert disk_needed(plain, weights, checkpoint, 5) == 3 * checkpoint + weights
    assert disk_needed(best, weights, checkpoint, 5) == 3 * checkpoint + 2 * weights


def test_a_held_out_prompt_of_exactly_the_passage_length_is_compared_too():
    """A prompt of exactly `PASSAGE_WORDS` words is one passage (its last and only one): copied into a training prompt,
    it is found."""
    held = [{"prompt": "one two three four five six seven eight"}]
    train = [{"prompt": "Here: one two three four five six seven eight."}]
    assert shared_passages(train, held)["rows"] == 1


def test_a_passage_every_held_out_row_carries_is_a_template_even_when_few_training_rows_have_it():
    """The held-out file's own instruction (in more than max(5, 1 %) of its rows) is a template: a training row that
    carries it too does not make every held-out row look copied."""
    template = "Answer with a single number and nothing else please thank you. "
    held = [{"prompt": template + f"What is {i} plus {i + 3}?"} for i in range(20)]
    train = [{"prompt": template + "What is 1000 minus 1?"}] + [{"prompt": f"Add {i} and {i}."} for i in range(30)]
    assert shared_passages(train, held)["rows"] == 0


def test_the_reports_lengths_interval_and_update_size_are_those_of_the_rows_and_the_config(tmp_path):
    """On 20 prompts of 20 different lengths the 95th percentile is the 19th (nearest rank), below the longest; the
    held-out interval is a half width (±); an update forward is one minibatch's rows (prompts × completions /
    minibatches), each as long as the longest prompt plus the new-token budget; and one training solution in 20 over
    the budget (more than 1 %) is warned about."""
    def write(name: str, lengths: range) -> Path:
        rows = [{"question": "1" * k + "+0=", "result": "1" * k} for k in lengths]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp_path / name

    report = check(load_config(DEMO, [
        *tiny_overrides(tmp_path / "run", "cold_start=null", "algorithm.minibatches=2", "algorithm.epochs=1"),
        f"data.path={write('train.jsonl', range(1, 21))}", f"data.eval_path={write('heldout.jsonl', range(21, 41))}",
        "data.task=null", "data.train_size=null", "data.eval_size=null",
        "data.fields={prompt: question, answer: result, solution: result}"]))
    p = report["train"]["prompt_tokens"]
    assert p["rows"] == 20 and p["min"] < p["median"] < p["p95"] < p["max"]
    low, high = wilson_ci95(10, 20)
    assert report["heldout"]["ci95_half_width"] == pytest.approx((high - low) / 2)
    m = report["model"]
    assert m["update_rows"] == 4 * 4 // 2 and m["update_row_tokens_max"] == p["max"] + 4
    report["train"]["solution_tokens"] = {**report["train"]["solution_tokens"], "over": 1, "rows": 20}
    assert any("1 of 20 training rows' solutions need more than" in w for w in warnings(report))


def test_a_reset_prompt_as_long_as_the_prompt_limit_is_within_it(tmp_path):
    """`--check` counts the sampled reset prompts longer than the run's prompt limit; one of exactly the limit fits
    (a false "over" would make `--check` exit 1 on a run that is fine)."""
    from types import SimpleNamespace

    from gspo.agent.env import make_env_factory
    from gspo.models import build_preset
    from gspo.preflight import reset_sample

    module = tmp_path / "fixed_env.py"
    module.write_text("class Fixed:\n    def reset(self, row):\n        return '12*34='\n"
                      "    def step(self, action):\n        raise NotImplementedError\n")
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", f"env.name={module}:Fixed", "algorithm.loss=gspo_token",
                                           "data.chat=always", "env.max_tokens=48", "rollout.max_new_tokens=8"))
    _, tok = build_preset("tiny-dense", seed=0)
    n = len(tok("12*34=", add_special_tokens=False)["input_ids"])
    rows = [{"prompt": f"{a}*2=", "answer": str(2 * a)} for a in range(3)]
    setup = SimpleNamespace(cfg=cfg, tokenizer=tok, make_env=make_env_factory(cfg.env)[0], train_rows=rows,
                            eval_rows=rows, prompt_limits=(n, n - 1), tool_schemas=None)
    found = reset_sample(setup)
    assert (found["training"]["max"], found["training"]["over"]) == (n, 0)
    assert found["held-out"]["over"] == 3


def test_measure_paces_the_run_by_the_steps_after_the_first(tmp_path, monkeypatch):
    """The first step pays for warm-up: the pace is the median of the later steps' times only, as the metrics of the
    timed steps record them."""
    import gspo.tracking

    seen = {}
    read = gspo.tracking.read_metrics
    monkeypatch.setattr(gspo.tracking, "read_metrics", lambda path, **kw: seen.setdefault(Path(path).name, [])
                        .append(read(path, **kw)) or seen[Path(path).name][-1])
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start=null", "trainer.eval_every=0"))
    t = measure(cfg, plan(cfg, 200, 16), steps=2)
    records = seen["metrics.jsonl"][-1]  # the timed steps' metrics, as measure read them
    assert len(records) == 2
    assert t["rollout_seconds"] == records[1]["time_rollout"] and t["update_seconds"] == records[1]["time_update"]
    assert t["first_step_seconds"] == records[0]["time_rollout"] + records[0]["time_update"]


def test_a_pretrained_models_cold_start_at_the_presets_rate_is_warned(tmp_path, caplog):
    """cold_start.lr defaults to the tiny presets' 3e-3 (random weights), which took SmolLM2-135M-Instruct to 0 % in
    3 steps: for a model that is not a preset, --check and the run's log say so; a preset, or a pretrained model at
    1e-5, is not warned about."""
    from gspo.models import build_preset, save_model

    save_model(*build_preset("tiny-moe"), tmp_path / "pretrained")
    said = "cold_start.lr=0.003 is a rate for the tiny presets' random weights"

    def cfg(*extra: str):
        return load_config(DEMO, tiny_overrides(tmp_path / "run", "cold_start.steps=1", "trainer.steps=1", *extra))

    assert any(said in w for w in warnings(check(cfg(f"model.name={tmp_path / 'pretrained'}"))))
    assert not any("cold_start.lr" in w for w in warnings(check(cfg())))  # the tiny-moe preset
    assert not any("cold_start.lr" in w for w in warnings(check(cfg(f"model.name={tmp_path / 'pretrained'}",
                                                                     "cold_start.lr=1e-5"))))
    with caplog.at_level(logging.WARNING, logger="gspo.sft"):
        train(cfg(f"model.name={tmp_path / 'pretrained'}"))
    assert said in caplog.text

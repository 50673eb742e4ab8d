"""Long runs: dynamic sampling, overlong shaping and filtering, and the collapse guard (detection, rollback, stop)."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import DEMO, SimulatedCrash, crash_after, safetensors_of, tiny_overrides, varied_reward
from gspo.checkpoint import checkpoint_path, list_checkpoints
from gspo.config import ConfigError, GuardConfig, load_config
from gspo.guard import CollapseGuard, GuardSettings, best_checkpoint, good_checkpoint
from gspo.optim import make_optimizer, scale_lr
from gspo.rewards import REWARDS
from gspo.rewards.shaping import add_overlong_penalty, overlong_penalty
from gspo.runfolder import clear_run
from gspo.schedule import refill_prompts
from gspo.tracking import read_metrics
from gspo.trainer import RunCollapsed, TrainingError, guard_settings, train
from gspo.trajectory import Trajectory, concat

# ------------------------------------------------------------------------------------------------ overlong shaping


def test_overlong_penalty_is_daPO_eq_13():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then a ramp to -1 at 10, -1 beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 11])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, 10, 4), expected)
    assert torch.equal(overlong_penalty(lengths, 10, 4, penalty=0.5), 0.5 * expected)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 11)


def test_add_overlong_penalty_adds_to_the_reward_and_reports_its_mean():
    total, stats = add_overlong_penalty(torch.tensor([1.0, 1.0]), {"reward/x": 1.0}, torch.tensor([2, 4]), 4, 2, 1.0)
    assert torch.equal(total, torch.tensor([1.0, 0.0])) and stats == {"reward/x": 1.0, "reward/overlong": -0.5}
    same, stats = add_overlong_penalty(torch.tensor([1.0]), {}, torch.tensor([4]), 4, None, 1.0)
    assert torch.equal(same, torch.tensor([1.0])) and stats == {}


def test_overlong_buffer_may_be_the_whole_budget_but_not_zero():
    """L_cache = L_max is a ramp over the whole budget (0 at length 0, -1 at L_max); L_cache = 0 would divide by zero,
    so it is refused rather than giving -inf / nan rewards."""
    lengths = torch.tensor([0, 2, 4, 5])
    assert torch.equal(overlong_penalty(lengths, 4, 4), torch.tensor([0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 4, 0)


def test_overlong_buffer_longer_than_the_budget_is_refused():
    with pytest.raises(ConfigError, match="overlong_buffer"):
        load_config(DEMO, ["rewards.overlong_buffer=7"])  # the demo generates 6 tokens


# ------------------------------------------------------------------------------------------ trajectories, prompts


def _traj(rows: list[list[int]], prompt_len: int, groups: list[int], first: int = 0) -> Trajectory:
    n, t = len(rows), max(map(len, rows))
    ids = torch.zeros(n, t, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return Trajectory(prompt_ids=torch.full((n, prompt_len), first + 1), prompt_mask=torch.ones(n, prompt_len,
                      dtype=torch.long), completion_ids=ids, completion_mask=mask, logprobs=-mask.float(),
                      truncated=torch.zeros(n, dtype=torch.bool), completions=[str(r) for r in rows],
                      prompt_index=torch.tensor(groups))


def test_concat_pads_to_the_widest_and_continues_the_prompt_index():
    a = _traj([[1], [2]], prompt_len=2, groups=[0, 0])
    b = _traj([[3, 4, 5], [6]], prompt_len=3, groups=[0, 0], first=5)
    both = concat([a, b], pad_id=0)
    assert both.completion_ids.tolist() == [[1, 0, 0], [2, 0, 0], [3, 4, 5], [6, 0, 0]]
    assert both.completion_mask.sum(-1).tolist() == [1, 1, 3, 1]
    assert both.prompt_mask.tolist()[0] == [0, 1, 1] and both.prompt_mask.tolist()[2] == [1, 1, 1]
    assert both.prompt_index.tolist() == [0, 0, 1, 1]
    assert both.completions == ["[1]", "[2]", "[3, 4, 5]", "[6]"]


def test_take_keeps_whole_groups_and_renumbers_them():
    traj = _traj([[1], [2], [3], [4], [5], [6]], prompt_len=1, groups=[0, 0, 1, 1, 2, 2])
    taken = traj.take(torch.tensor([4, 5, 0, 1]))
    assert taken.completion_ids[:, 0].tolist() == [5, 6, 1, 2]
    assert taken.prompt_index.tolist() == [0, 0, 1, 1]
    assert taken.completions == ["[5]", "[6]", "[1]", "[2]"]


def test_refill_prompts_are_a_pure_function_of_step_and_round():
    rows = [{"prompt": str(i)} for i in range(50)]
    a, seeds_a = refill_prompts(3, 1, rows, 10, seed=0)
    assert (a, seeds_a) == refill_prompts(3, 1, rows, 10, seed=0)
    b, seeds_b = refill_prompts(3, 2, rows, 10, seed=0, start=10)
    assert a != b and not set(seeds_a) & set(seeds_b)
    many, _ = refill_prompts(0, 1, rows[:3], 7, seed=0)  # more than the rows: cycles through them
    assert len(many) == 7 and {r["prompt"] for r in many} == {"0", "1", "2"}


def test_a_steps_refill_rounds_sample_distinct_prompts_other_than_its_own():
    """Each round drew from its own permutation of every row: the step's own prompts (known constant) came back and
    a prompt could be kept twice. Now the rounds continue one permutation of the other rows."""
    from gspo.schedule import prompt_indices
    rows = [{"prompt": str(i)} for i in range(20)]
    own = prompt_indices(3, 4, len(rows), 0)
    drawn, start = [], 0
    for round_, count in enumerate((5, 6, 5), start=1):  # 16 = every row but the step's own 4
        got, _ = refill_prompts(3, round_, rows, count, seed=0, start=start, exclude=own)
        drawn += [int(r["prompt"]) for r in got]
        start += count
    assert sorted(drawn) == sorted(set(range(20)) - set(own))


# ------------------------------------------------------------------------------------------------ the guard, pure


def _healthy(step: int, rng: random.Random) -> dict:
    return {"reward_mean": 0.3 + 0.002 * step + rng.gauss(0, 0.04), "entropy": 0.5 + rng.gauss(0, 0.03),
            "clip_frac_tokens": 0.35 + rng.gauss(0, 0.05), "ratio_max": 1.004 + abs(rng.gauss(0, 0.001)),
            "ratio_min": 0.996 - abs(rng.gauss(0, 0.001)), "loss": 0.0, "grad_norm": 1.0, "skipped_updates": 0.0}


def test_guard_never_flags_a_noisy_improving_run():
    rng = random.Random(0)
    guard = CollapseGuard(GuardSettings())
    verdicts = [guard.observe(step, _healthy(step, rng)) for step in range(1, 400)]
    assert not any(v.flags for v in verdicts)


def test_guard_catches_a_reward_collapse_after_patience_steps():
    rng = random.Random(1)
    guard = CollapseGuard(GuardSettings(patience=3))
    for step in range(1, 21):
        assert not guard.observe(step, _healthy(step, rng)).flags
    dip = guard.observe(21, {**_healthy(21, rng), "reward_mean": 0.05})
    assert dip.flags.keys() == {"reward"} and not dip.collapsed  # one bad step is not a collapse
    assert not guard.observe(22, _healthy(22, rng)).collapsed
    verdicts = [guard.observe(s, {**_healthy(s, rng), "reward_mean": 0.02}) for s in (23, 24, 25)]
    assert [v.collapsed for v in verdicts] == [False, False, True]
    assert verdicts[-1].first_step == 21  # the episode began with the dip: fewer than `patience` healthy steps since


def test_guard_state_round_trip_gives_the_same_verdicts():
    rng = random.Random(2)
    a = CollapseGuard(GuardSettings())
    steps = [_healthy(s, rng) for s in range(1, 30)] + [{**_healthy(30, rng), "entropy": 2.0}] * 3
    for s, m in enumerate(steps[:25], 1):
        a.observe(s, m)
    b = CollapseGuard(GuardSettings())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through JSON, as in a checkpoint
    for s, m in enumerate(steps[25:], 26):
        va, vb = a.observe(s, m), b.observe(s, m)
        assert (va.flags, va.collapsed, va.first_step) == (vb.flags, vb.collapsed, vb.first_step)
    assert va.collapsed and "entropy" in va.flags


@pytest.mark.parametrize("key, value", [("entropy", 0.1), ("entropy", 1.5), ("clip_frac_tokens", 0.9),
                                        ("ratio_max", 1.5), ("ratio_min", 0.5)])
def test_guard_flags_each_watched_metric(key, value):
    rng = random.Random(3)
    guard = CollapseGuard(GuardSettings())
    for step in range(1, 21):
        guard.observe(step, _healthy(step, rng))
    assert list(guard.observe(21, {**_healthy(21, rng), key: value}).flags) == [
        {"clip_frac_tokens": "clip_frac"}.get(key, key.split("_")[0] if key == "entropy" else key)]


def test_guard_entropy_rule_leaves_a_near_deterministic_policys_small_changes_alone():
    """A multi-turn GSPO run at 100 % held-out accuracy had entropy ~0.013 nats; 0.041 broke the factor-2 band three
    steps in a row and the guard rolled it back. With entropy_floor (the config's default 0.05 nats) a change that
    small is no anomaly; a real jump still is, and without the floor the same steps are flagged."""
    rng = random.Random(4)
    steps = [{**_healthy(s, rng), "entropy": 0.013 + rng.gauss(0, 0.001)} for s in range(1, 21)]
    for floor, small_flagged in ((0.0, True), (GuardConfig().entropy_floor, False)):
        guard = CollapseGuard(GuardSettings(entropy_floor=floor))
        for step, metrics in enumerate(steps, 1):
            guard.observe(step, metrics)
        small = guard.observe(21, {**_healthy(21, rng), "entropy": 0.041})
        assert ("entropy" in small.flags) is small_flagged
        assert "entropy" in guard.observe(22, {**_healthy(22, rng), "entropy": 0.5}).flags  # a real jump


def test_guard_ratio_rule_leaves_ratios_inside_the_clip_range_alone():
    """A token-level objective (GRPO, ε_high 0.27) moves single tokens' ratios to 1.1 by design: with the floor
    log(1 + ε_high) that is no anomaly (it was a false alarm on a healthy GRPO run); beyond it, it still is."""
    rng = random.Random(3)
    guard = CollapseGuard(GuardSettings(ratio_floor=math.log1p(0.27)))
    for step in range(1, 21):
        guard.observe(step, _healthy(step, rng))
    assert guard.observe(21, {**_healthy(21, rng), "ratio_max": 1.1, "ratio_min": 0.9}).flags == {}
    assert list(guard.observe(22, {**_healthy(22, rng), "ratio_max": 1.5}).flags) == ["ratio_max"]


def test_guard_ratio_floor_of_a_run_covers_healthy_off_policy_sequence_ratios(tmp_path):
    """GSPO's sequence ratio (baseline ~1.005) reached 1.15 on healthy steps of an async calculator run: under the
    run's floor (trainer.guard.ratio_floor 1.25, above GSPO's 1 + ε_high) that is no anomaly; 1.4 still is. GRPO's
    floor is its clip range, 1 + ε_high, where that is wider."""
    gspo = guard_settings(load_config(DEMO, tiny_overrides(tmp_path)))
    assert gspo.ratio_floor == pytest.approx(math.log(1.25))
    grpo = guard_settings(load_config(DEMO, tiny_overrides(tmp_path, "algorithm.loss=grpo",
                                                           "algorithm.eps_high=0.4")))
    assert grpo.ratio_floor == pytest.approx(math.log1p(0.4))
    rng = random.Random(3)
    guard = CollapseGuard(gspo)
    for step in range(1, 21):
        guard.observe(step, {**_healthy(step, rng), "ratio_max": 1.005 + rng.uniform(0, 0.01)})
    assert guard.observe(21, {**_healthy(21, rng), "ratio_max": 1.15, "ratio_min": 0.85}).flags == {}
    assert list(guard.observe(22, {**_healthy(22, rng), "ratio_max": 1.4}).flags) == ["ratio_max"]


def test_guard_reports_non_finite_steps_and_leaves_them_to_max_bad_steps():
    guard = CollapseGuard(GuardSettings(patience=2))
    verdicts = [guard.observe(1, {"loss": math.nan, "reward_mean": 0.1}),
                guard.observe(2, {"loss": 0.0, "reward_mean": 0.1, "skipped_updates": 1.0}),
                guard.observe(3, {"loss": math.inf, "reward_mean": 0.1})]
    assert all("non_finite" in v.flags for v in verdicts)  # from the first step, before any baseline
    assert not any(v.collapsed for v in verdicts) and guard.history == []  # nor part of the baseline


def test_good_checkpoint_is_the_last_one_no_anomalous_step_saw():
    # anomalies from step 16 on: the weights after 15 steps produced step 16's rollouts, so 15 is not clean
    assert good_checkpoint([0, 10, 15, 20], first_anomalous=16) == 10
    assert good_checkpoint([0, 10, 15, 20], first_anomalous=17) == 15
    assert good_checkpoint([5], first_anomalous=6) is None


def test_rollback_after_a_slow_slide_goes_back_to_a_checkpoint_near_the_best_reward():
    """A reward that slides slowly drags the guard's baseline down with it: the latest clean checkpoint (14: recent
    reward 0.575) is already the slide's; the rollback target is the latest one within reward_drop / 4 of the best."""
    baselines = {2: None, 4: 0.8, 6: 0.8, 8: 0.8, 10: 0.775, 12: 0.675, 14: 0.575, 16: 0.475}
    assert good_checkpoint(sorted(baselines), 17) == 14  # without baselines: the latest clean one
    assert good_checkpoint(sorted(baselines), 17, baselines, tolerance=0.125) == 10  # 0.775 >= 0.8 - 0.1
    assert good_checkpoint(sorted(baselines), 17, {**baselines, 10: 0.6}, tolerance=0.125) == 8
    assert good_checkpoint([2, 4], 5, {2: None, 4: None}) == 2  # no baselines yet (warm-up): the latest clean one
    assert good_checkpoint([2, 4], 3, {2: 0.5}) is None  # nothing clean
    assert good_checkpoint([4, 6], 9, {4: -0.5, 6: -0.55}, tolerance=0.125) == 6  # negative rewards: |best|
    assert best_checkpoint(baselines) == 8 and best_checkpoint({2: None}) is None  # the latest of the best


def test_guard_reward_baseline_is_the_median_of_the_last_warmup_healthy_steps():
    guard = CollapseGuard(GuardSettings(window=6, warmup=4))
    rewards = [0.8, 0.8, 0.8, 0.8, 0.7, 0.6, 0.5]
    seen = []
    for step, r in enumerate(rewards, 1):
        guard.observe(step, {"reward_mean": r})
        seen.append(guard.reward_baseline())
    assert seen[:3] == [None] * 3 and seen[3] == 0.8
    assert seen[-1] == pytest.approx(0.65)  # median of 0.8, 0.7, 0.6, 0.5 (the window's median would be 0.75)


def test_scale_lr_scales_the_schedule_from_now_on():
    layer = torch.nn.Linear(2, 2)
    opt, sched = make_optimizer(layer, 1e-3, total_steps=10, warmup_steps=4)
    other_opt, other = make_optimizer(torch.nn.Linear(2, 2), 1e-3, total_steps=10, warmup_steps=4)
    for _ in range(3):
        opt.step(), sched.step(), other_opt.step(), other.step()
    scale_lr(opt, sched, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * other_opt.param_groups[0]["lr"])
    opt.step(), sched.step(), other_opt.step(), other.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * other_opt.param_groups[0]["lr"])
    assert sched.state_dict()["base_lrs"] == [pytest.approx(5e-4)]


# ------------------------------------------------------------------------------------------------ in the trainer


@pytest.fixture
def counted_reward(monkeypatch):
    """A reward registered as `fading`: varied (digit fraction) for the first `healthy` RL steps' completions,
    0 for every completion after them, counting calls (16 completions per step in the tiny config)."""
    calls = {"n": 0, "healthy": 10}

    def fading(prompt: str, completion: str, **row) -> float:
        calls["n"] += 1
        if calls["n"] > 16 * calls["healthy"]:
            return 0.0
        return 0.2 + 0.6 * sum(c.isdigit() for c in completion) / max(1, len(completion))

    monkeypatch.setitem(REWARDS, "fading", fading)
    monkeypatch.setitem(REWARDS, "constant", lambda prompt, completion, **row: 0.5)
    return calls


GUARDED = ["rewards.functions={fading: 1.0}", "rewards.check=false", "trainer.steps=24", "trainer.eval_every=0",
           "data.eval_size=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3", "trainer.guard.window=6",
           "trainer.guard.warmup=4", "trainer.guard.patience=2", "trainer.guard.max_rollbacks=1",
           # only the reward rule, which these tests drive: the clip-fraction, ratio and entropy rules fire on the tiny
           # run's own noise where its numerics differ (on an H100, clip_frac_tokens 0.28 → 0.63 at step 5)
           "trainer.guard.clip_jump=1.0", "trainer.guard.ratio_jump=1000", "trainer.guard.entropy_factor=1000"]


def test_guard_rolls_back_once_then_stops_with_status_collapsed(tmp_path, counted_reward):
    out = tmp_path / "run"
    with pytest.raises(RunCollapsed, match="collapse at step"):
        train(load_config(DEMO, tiny_overrides(out, *GUARDED, "cold_start=null")))  # no evaluation before SFT:
    summary = json.loads((out / "summary.json").read_text())  # the reward's calls are counted
    assert summary["status"] == "collapsed" and "reward" in summary["error"] and summary["guard"]["rollbacks"] == 1
    # what the stopped run has to show: its held-out accuracy before RL and at its last evaluation, its checkpoint
    assert summary["last_checkpoint"] == max(list_checkpoints(out))
    assert summary["heldout_accuracy_last"]["step"] == 0  # eval_every=0: only before RL
    assert summary["heldout_accuracy_before_rl"] == summary["heldout_accuracy_last"]["accuracy"]
    [event] = read_metrics(out / "guard.jsonl")
    # the reward fell to 0 from step 11: steps 11-12 anomalous, rollback to a checkpoint that step 11 did not see
    assert event["first_anomalous_step"] == 11 and event["to_checkpoint"] <= 9 and event["lr_scale"] == 0.5
    assert [r["step"] for r in event["discarded"]] == list(range(event["to_checkpoint"] + 1, event["step"] + 1))
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == sorted(set(steps))  # one line per step: the discarded ones are gone
    # the rolled-back checkpoint was saved again with the guard's new state, so a resume keeps the lower lr
    state = json.loads((checkpoint_path(out, event["to_checkpoint"]) / "state.json").read_text())["state"]
    assert state["guard"]["rollbacks"] == 1 and state["guard"]["lr_scale"] == 0.5
    assert all(s <= summary["steps_done"] for s in list_checkpoints(out))
    lrs = {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl")}
    assert lrs[event["to_checkpoint"] + 1] < event["discarded"][0]["lr"]  # the replayed step runs at the lower lr
    # --overwrite of the collapsed run (clear_run) leaves nothing of it, guard.jsonl included
    (out / "notes.txt").write_text("mine")
    clear_run(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_best_policy_from_steps_the_guard_rolled_back_is_labelled(tmp_path, counted_reward, monkeypatch):
    """trainer.save_best keeps OUT/best when the guard discards the steps it came from (it was measured; its weights
    are real), but its evaluation then leaves eval.jsonl: summary.json says so instead of naming a step whose record
    is gone. The accuracy reward here solves the held-out rows only once the training reward has collapsed, so the
    best evaluation is one of the steps the rollback discards."""
    def write(name: str, first: int, count: int, mark: str) -> str:
        rows = [{"question": f"{a}+{a % 7}=", "result": str(a + a % 7), "mark": mark}
                for a in range(first, first + count)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    def collapsed_held_out(prompt: str, completion: str, mark: str = "", **row) -> float:
        return float(mark == "heldout" and counted_reward["n"] > 16 * counted_reward["healthy"])

    monkeypatch.setitem(REWARDS, "late", collapsed_held_out)
    out = tmp_path / "run"
    with pytest.raises(RunCollapsed):
        train(load_config(DEMO, tiny_overrides(
            out, *GUARDED, "cold_start=null", "trainer.eval_every=1", "trainer.save_best=true",
            "rewards.functions={fading: 1.0, late: 0.0}", "rewards.accuracy_reward=late", "data.task=null",
            f"data.path={write('train.jsonl', 0, 200, 'train')}", "data.train_size=null", "data.eval_size=null",
            f"data.eval_path={write('heldout.jsonl', 300, 4, 'heldout')}",
            "data.fields={prompt: question, answer: result}")))
    summary = json.loads((out / "summary.json").read_text())
    rollback = read_metrics(out / "guard.jsonl")[0]
    best = summary["best"]
    assert best["heldout_accuracy"] == 1.0 and best["step"] > rollback["to_checkpoint"]
    assert best["discarded_by_rollback"] is True and "rolled back by the collapse guard" in best["note"]
    discarded = {r["step"]: r for r in rollback["discarded"]}
    assert discarded[best["step"]]["heldout_accuracy"] == 1.0  # where its evaluation is kept
    assert (out / "best" / "config.json").is_file()


def test_a_best_policy_measured_after_the_checkpoint_a_run_resumes_from_is_the_one_named(tmp_path, monkeypatch):
    """OUT/best is not versioned with the checkpoints: written at step 3 (accuracy 1.0), after the step-2 checkpoint,
    then the run crashed; the resumed run's summary named step 2's record (0.5) while OUT/best held step 3's weights.
    OUT/best/best.json says what it holds, and the resumed run names that, labelled."""
    accuracy_of_eval = [0.0, 0.25, 0.5, 1.0, 0.25, 0.25]  # evaluation k (4 held-out rows each): step 0, 1, 2, 3, 3, 4
    calls = {"n": 0}

    def scripted(prompt: str, completion: str, mark: str = "", **row) -> float:
        if mark != "heldout":
            return 0.0
        k, i = divmod(calls["n"], 4)
        calls["n"] += 1
        return float(i < accuracy_of_eval[k] * 4)

    def write(name: str, first: int, count: int, mark: str) -> str:
        rows = [{"question": f"{a}+{a % 7}=", "result": str(a + a % 7), "mark": mark}
                for a in range(first, first + count)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(tmp_path / name)

    monkeypatch.setitem(REWARDS, "scripted", scripted)
    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    out = tmp_path / "run"
    cfg = load_config(DEMO, tiny_overrides(
        out, "cold_start=null", "rewards.check=false", "trainer.steps=4", "trainer.eval_every=1",
        "trainer.checkpoint_every=2", "trainer.save_best=true", "rewards.functions={varied: 1.0, scripted: 0.0}",
        "rewards.accuracy_reward=scripted", "data.task=null", f"data.path={write('train.jsonl', 0, 200, 'train')}",
        "data.train_size=null", "data.eval_size=null", f"data.eval_path={write('heldout.jsonl', 300, 4, 'heldout')}",
        "data.fields={prompt: question, answer: result}"))
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(3)])
    step3 = safetensors_of(out / "best")
    summary = train(cfg, resume=True)
    assert [(e["step"], e["heldout_accuracy"]) for e in read_metrics(out / "eval.jsonl")] == [
        (0, 0.0), (1, 0.25), (2, 0.5), (3, 0.25), (4, 0.25)]  # step 3 measured again after the resume
    assert (summary["best"]["step"], summary["best"]["heldout_accuracy"]) == (3, 1.0)
    assert summary["best"]["discarded_by_resume"] and "resumed from" in summary["best"]["note"]
    held = safetensors_of(out / "best")
    assert all(torch.equal(held[k], step3[k]) for k in step3)  # what summary.json names is what OUT/best holds


def test_guard_rolls_back_a_slow_slide_to_the_best_checkpoint_kept_from_pruning(tmp_path, monkeypatch):
    """The reward holds at 0.8 for about 8 steps, then loses 0.05 a step: the guard flags it at step 16 (below half
    the best baseline), when the latest clean checkpoint (14) already scores about 0.5. The run rolls back to
    checkpoint 8, the best, which keep_checkpoints=2 alone would have pruned at step 12; the old rule took 14."""
    calls = {"n": 0}

    def sliding(prompt: str, completion: str, **row) -> float:
        calls["n"] += 1
        step = (calls["n"] - 1) // 16 + 1  # 16 completions per step (and 4 held-out rows scored at step 0)
        return 0.8 if step <= 8 else 0.8 - 0.05 * (step - 8)

    monkeypatch.setitem(REWARDS, "sliding", sliding)
    out = tmp_path / "run"
    with pytest.raises(RunCollapsed):
        train(load_config(DEMO, tiny_overrides(out, *GUARDED, "rewards.functions={sliding: 1.0}",
                                               "trainer.keep_checkpoints=2")))
    [event] = read_metrics(out / "guard.jsonl")
    assert event["first_anomalous_step"] == 16 and event["to_checkpoint"] == 8
    state = json.loads((checkpoint_path(out, 8) / "state.json").read_text())["state"]
    assert state["guard"]["reward_baseline"] == pytest.approx(0.8)


def test_guard_warn_only_logs(tmp_path, counted_reward):
    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, *GUARDED, "trainer.guard.action=warn", "trainer.steps=14")))
    records = read_metrics(out / "metrics.jsonl")
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    assert [r["step"] for r in records] == list(range(1, 15))
    assert sum(r["guard_anomalies"] for r in records) >= 2 and not (out / "guard.jsonl").exists()


def test_a_collapse_dynamic_sampling_finds_no_signal_in_is_the_guards_to_handle(tmp_path, counted_reward):
    """The reward falls to 0 for every completion: with dynamic sampling no group has signal, which stopped the run
    with 'the task is too hard' before the guard saw the step (no rollback, no summary.json). Now it is a collapse:
    rolled back once, then stopped with status collapsed; without the guard, a failure with summary.json."""
    out = tmp_path / "run"
    dynamic = ["rollout.dynamic_sampling=true", "rollout.dynamic_max_rounds=2", "cold_start=null"]
    with pytest.raises(RunCollapsed, match=r"collapse at step .*equal rewards"):
        train(load_config(DEMO, tiny_overrides(out, *GUARDED, *dynamic)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "collapsed" and summary["guard"]["rollbacks"] == 1
    [event] = read_metrics(out / "guard.jsonl")
    assert event["lr_scale"] == 0.5 and event["to_checkpoint"] < event["step"]
    counted_reward["n"] = 0
    with pytest.raises(TrainingError, match="equal rewards"):
        train(load_config(DEMO, tiny_overrides(tmp_path / "warn", *GUARDED, *dynamic, "trainer.guard.action=warn")))
    assert json.loads((tmp_path / "warn" / "summary.json").read_text())["status"] == "failed"


def test_dynamic_sampling_trains_on_full_batches_of_informative_groups(tmp_path, counted_reward):
    counted_reward["healthy"] = 10**9
    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, "rewards.functions={fading: 1.0, addition: 0.0}",
                                           "rollout.dynamic_sampling=true", "rollout.overlong_filter=true",
                                           "rewards.overlong_buffer=2", "trainer.steps=2")))
    for record in read_metrics(out / "metrics.jsonl"):
        assert record["dynamic_rounds"] >= 1 and record["dynamic_sampled_prompts"] >= 4
        assert "reward/overlong" in record and "overlong_filtered" in record


@pytest.mark.parametrize("engine", [[], ["rollout.dtype=bfloat16"]])
def test_dynamic_sampling_on_a_constant_reward_stops_with_a_clear_error(tmp_path, counted_reward, engine):
    """With an engine that holds its own weights (rollout.dtype), the first round released them and the refill round
    failed: "generate: this engine's weights were released"; the engine is released after the last round."""
    out = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"every one of the \d+ groups sampled in 2 rounds.*equal rewards"):
        train(load_config(DEMO, tiny_overrides(out, "rewards.functions={constant: 1.0}", *engine,
                                               "rollout.dynamic_sampling=true", "rollout.dynamic_max_rounds=2")))


def test_dynamic_sampling_resumes_exactly(tmp_path, monkeypatch):
    """A run with dynamic sampling killed after step 3 and resumed from its step-2 checkpoint ends with the same
    weights and metrics as an uninterrupted one: the extra rounds' prompts and seeds are functions of the step."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)  # per test: the registry stays as the other tests expect
    extra = ["rewards.functions={addition: 1.0, varied: 0.5}", "rollout.dynamic_sampling=true", "trainer.steps=4",
             "trainer.checkpoint_every=2", "trainer.device=cpu"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(DEMO, tiny_overrides(whole, *extra)))
    cfg = load_config(DEMO, tiny_overrides(parts, *extra))
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(3)])
    train(cfg, resume=True)
    a, b = safetensors_of(whole / "final"), safetensors_of(parts / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = ("tokens_per_second", "time_rollout", "time_update", "time_eval")
    rows = [[{k: v for k, v in r.items() if k not in drop} for r in read_metrics(out / "metrics.jsonl")]
            for out in (whole, parts)]
    assert rows[0] == rows[1] and all("dynamic_rounds" in r for r in rows[0])


def test_guard_a_collapse_after_patience_healthy_steps_starts_its_own_episode():
    """A dip followed by `patience` healthy steps is over: a later collapse's first_step is its own first anomalous
    step, not the old dip (the rollback would go back further than needed). The existing test covers only the
    case of fewer than `patience` healthy steps in between."""
    import random

    from gspo.guard import CollapseGuard, GuardSettings

    rng = random.Random(1)
    guard = CollapseGuard(GuardSettings(patience=3))
    for step in range(1, 21):
        assert not guard.observe(step, _healthy(step, rng)).flags
    assert guard.observe(21, {**_healthy(21, rng), "reward_mean": 0.05}).flags.keys() == {"reward"}
    for step in (22, 23, 24):  # patience healthy steps: the dip's episode is over
        assert not guard.observe(step, _healthy(step, rng)).flags
    verdicts = [guard.observe(s, {**_healthy(s, rng), "reward_mean": 0.02}) for s in (25, 26, 27)]
    assert [v.collapsed for v in verdicts] == [False, False, True]
    assert verdicts[-1].first_step == 25


def _fake_round(calls: list, g: int):
    """A `sample` for keep_informative: row i's G completions are tokens 100·i + j, its rewards row["rewards"]."""
    from gspo.rollout.dynamic import Scored

    def sample(rows: list[dict], seeds: list[int]) -> Scored:
        calls.append([r["i"] for r in rows])
        ids = torch.tensor([[r["i"]] for r in rows for _ in range(g)])
        completion = torch.tensor([[100 * r["i"] + j] for r in rows for j in range(g)])
        n = len(rows) * g
        traj = Trajectory(prompt_ids=ids, prompt_mask=torch.ones_like(ids), completion_ids=completion,
                          completion_mask=torch.ones_like(completion), logprobs=torch.zeros(n, 1),
                          truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n,
                          prompt_index=torch.arange(len(rows)).repeat_interleave(g))
        rewards = torch.tensor([float(x) for r in rows for x in r["rewards"]])
        return Scored(traj, rewards, {"solved": float(len(rows))}, 1.0)
    return sample


def _rows(n: int, informative, g: int = 2) -> list[dict]:
    return [{"i": i, "prompt": str(i), "rewards": [0.0, 1.0][:g] if informative(i) else [1.0] * g} for i in range(n)]


def test_dynamic_sampling_keeps_the_first_informative_groups_whole_with_their_rewards():
    from gspo.rollout.dynamic import keep_informative
    from gspo.schedule import step_prompts
    p, g, seed = 4, 2, 0
    rows = _rows(40, lambda i: i % 5 == 0, g)
    ro = SimpleNamespace(prompts_per_step=p, group_size=g, dynamic_max_rounds=6)
    calls: list = []
    sample = _fake_round(calls, g)
    for step in range(50):  # a step that needs three rounds or more, within the 40 rows
        calls.clear()
        kept, every = keep_informative(step, rows, sample(*step_prompts(step, rows, p, seed)), sample, ro, seed,
                                       pad_id=0)
        if len(calls) >= 3 and sum(map(len, calls)) <= 40:
            break
    assert len(calls) >= 3

    sampled = [i for call in calls for i in call]
    assert len(sampled) == len(set(sampled))  # every round samples prompts no earlier round of the step did
    assert kept.stats["dynamic_rounds"] == len(calls)
    assert kept.stats["dynamic_sampled_prompts"] == len(sampled) and kept.stats["dynamic_filled_groups"] == 0
    assert kept.stats["solved"] == len(sampled)  # the rounds' counts are summed
    assert len(every.rewards) == len(sampled) * g and every.counted.all() and every.solved is None
    informative_in_order = [i for i in sampled if i % 5 == 0][:p]
    heads = kept.traj.prompt_ids[::g, 0].tolist()
    assert heads == informative_in_order  # the first P informative groups, in the order they were sampled
    for k, i in enumerate(heads):  # each group whole: its own completions and rewards
        assert kept.traj.prompt_ids[k * g:(k + 1) * g, 0].tolist() == [i] * g
        assert kept.traj.completion_ids[k * g:(k + 1) * g, 0].tolist() == [100 * i + j for j in range(g)]
        assert kept.rewards[k * g:(k + 1) * g].tolist() == rows[i]["rewards"]
    assert kept.traj.prompt_index.tolist() == torch.arange(p).repeat_interleave(g).tolist()


def test_dynamic_sampling_tops_up_with_constant_groups_when_the_rounds_run_out_and_fails_with_none():
    from gspo.rollout.dynamic import NoSignal, keep_informative
    from gspo.schedule import prompt_indices, refill_prompts, step_prompts
    p, g, seed = 4, 2, 0
    ro = SimpleNamespace(prompts_per_step=p, group_size=g, dynamic_max_rounds=2)
    step = next(s for s in range(50) if 0 not in prompt_indices(s, p, 40, seed))  # row 0 is not among its own
    constant = _rows(40, lambda i: False, g)
    calls: list = []
    sample = _fake_round(calls, g)
    with pytest.raises(NoSignal, match="in 2 rounds"):
        keep_informative(step, constant, sample(*step_prompts(step, constant, p, seed)), sample, ro, seed, pad_id=0)
    assert len(calls) == 2

    rows = _rows(40, lambda i: i < 3, g)  # three informative prompts among 40

    def refill_hits(s: int) -> int:  # informative rows in the refill of step s (16 rows: 4 × the 4 prompts missing)
        own = prompt_indices(s, p, 40, seed)
        return -1 if set(own) & {0, 1, 2} else sum(r["i"] < 3 for r in refill_prompts(s, 1, rows, 16, seed,
                                                                                          exclude=own)[0])
    step = next(s for s in range(200) if refill_hits(s) in (1, 2))
    calls.clear()
    kept, _ = keep_informative(step, rows, sample(*step_prompts(step, rows, p, seed)), sample, ro, seed, pad_id=0)
    assert len(calls) == 2 == kept.stats["dynamic_rounds"]  # dynamic_max_rounds rounds in all, the first included
    assert kept.stats["dynamic_filled_groups"] == p - refill_hits(step) and len(kept.rewards) == p * g
    assert kept.traj.prompt_ids[0, 0].item() < 3 and kept.rewards[:g].tolist() == [0.0, 1.0]  # informative first

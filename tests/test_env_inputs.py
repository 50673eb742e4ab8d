"""A user's own environment misbehaving, as a new user's would: it edits its row, returns a malformed Step, is slow,
fails on every episode, or cannot be built. Each is isolated and counted with its reason told once, or refused before
any compute; never a silently wrong number (an environment that edited its row made 0 % → 100 % held-out accuracy)."""

from __future__ import annotations

import logging
import math
import re
import threading
import time

import pytest
import torch

import gspo.trainer
from conftest import DEMO, tiny_overrides
from gspo.agent import EpisodeLimits, EpisodeRunner, Step, build_env, episode_metrics
from gspo.config import ConfigError, load_config
from gspo.models import VOCAB_CHARS, build_preset
from gspo.rollout import HFSampler, SamplingParams
from gspo.trainer import train

ROWS = [{"prompt": "12*34=", "answer": "408"}, {"prompt": "5*6=", "answer": "30"}]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model, tok = build_preset("tiny-moe", seed=0)
    return model.eval(), tok


def runner(policy, make_env, **limits) -> EpisodeRunner:
    """Episodes of the untrained tiny model whose turns end at their first character (every character stops)."""
    model, tok = policy
    engine = HFSampler(model, tok, SamplingParams(max_new_tokens=5, stop=tuple(VOCAB_CHARS)))
    return EpisodeRunner(engine, tok, make_env, EpisodeLimits(**{"max_turns": 3, "max_tokens": 60, **limits}))


def column(traj, key: str) -> list[float]:
    return traj.extras["episode"][:, traj.extras["episode_keys"].index(key)].tolist()


class Edits:
    """Rewrites the row it is given, as a careless environment might (the answer it then checks against)."""

    def reset(self, row):
        row["answer"], row["prompt"] = "0", row["prompt"] + " edited"
        return row["prompt"]

    def step(self, action):
        return Step(done=True)


def test_an_environment_that_edits_its_row_edits_a_copy(policy):
    rows = [dict(r) for r in ROWS]
    runner(policy, Edits).run(rows, 2, [1, 2])
    assert rows == ROWS


class Returns:
    """Returns what the row's `kind` says from its first step."""

    counts = "mine"  # one name, not the characters m, i, n, e

    def reset(self, row):
        self.kind = row["kind"]
        return row["prompt"]

    def step(self, action):
        return {
            "none_reward": lambda: Step(done=True, reward=None),
            "nan_reward": lambda: Step(done=True, reward=math.nan),
            "text_reward": lambda: Step(done=True, reward="high"),
            "text_done": lambda: Step(done="False", reward=1.0),
            "text_info": lambda: Step(done=True, info={"mine": "lots"}),
            "tuple": lambda: ("obs", 1.0, True, {}),
            "fine": lambda: Step(done=True, reward=0.5, info={"mine": 2.0}),
        }[self.kind]()


def test_malformed_steps_are_failures_of_their_episodes_with_the_reason_told_once(policy, caplog):
    """Step.reward=None was a TypeError traceback, "high" a bare "could not convert string to float", NaN a run-ending
    "reward at index 0 is nan" blaming the reward functions, done="False" silently ended the episode. All are now
    that episode's environment failure, not a truncation, each kind's reason logged once."""
    kinds = ["none_reward", "nan_reward", "text_reward", "text_done", "text_info", "tuple", "fine"]
    rows = [{"prompt": "1=", "kind": k} for k in kinds]
    with caplog.at_level(logging.WARNING, logger="gspo.agent.episodes"):
        traj = runner(policy, Returns).run(rows, 2, list(range(len(kinds))))
    assert column(traj, "env_failures") == [1.0] * 12 + [0.0] * 2
    assert not traj.truncated.any()  # the policy did not run out of tokens: truncation_rate stays honest
    assert torch.isfinite(traj.token_rewards).all() and traj.token_rewards.sum(-1).tolist()[-2:] == [0.5, 0.5]
    for told in ("Step.reward is None", "Step.done is 'False'", "Step.info is {'mine': 'lots'}", "returned tuple"):
        assert caplog.text.count(told) == 1, told
    assert caplog.text.count("Step.reward is") == 1  # None, NaN and "high" are one kind: the first is told
    assert episode_metrics(traj)["env/mine"] == pytest.approx(4.0 / 14)  # the fine episodes' 2 each, per episode


def test_a_batch_whose_every_episode_failed_is_warned_about(policy, caplog):
    rows = [{"prompt": "1=", "kind": "tuple"}]
    with caplog.at_level(logging.WARNING, logger="gspo.agent.episodes"):
        traj = runner(policy, Returns).run(rows, 2, [0])
    assert column(traj, "env_failures") == [1.0, 1.0]
    assert "every one of the 2 episodes of a batch ended in an environment failure" in caplog.text


class Slow:
    """Healthy, but each step takes `delay` seconds (`hang` for the rows that say so)."""

    def reset(self, row):
        self.delay = 30.0 if row.get("hang") else 0.25
        return row["prompt"]

    def step(self, action):
        time.sleep(self.delay)
        return Step(done=True, reward=1.0)


def test_step_timeout_is_per_step_not_for_all_the_episodes_of_a_turn(policy):
    """8 steps of 0.25 s on 2 workers take 1 s: under one 0.5 s deadline for the whole turn, half the healthy episodes
    were reported as environment failures. A hanging step is still cut, and counted as a timeout."""
    traj = runner(policy, Slow, step_timeout_s=0.5, workers=2).run(ROWS * 2, 2, [1, 2, 3, 4])
    assert column(traj, "env_failures") == [0.0] * 8 and traj.token_rewards.sum(-1).tolist() == [1.0] * 8
    t0 = time.monotonic()
    hung = runner(policy, Slow, step_timeout_s=0.5, workers=4).run([{"prompt": "1=", "hang": True}, ROWS[0]], 2,
                                                                   [1, 2])
    assert time.monotonic() - t0 < 5
    assert column(hung, "env_timeouts") == [1.0, 1.0, 0.0, 0.0] and column(hung, "env_failures")[:2] == [1.0, 1.0]
    assert episode_metrics(hung)["episode_env_timeouts"] == 0.5


class Meets:
    """A reset that waits on a service: for the resets of the 3 other episodes of a batch of 4 (a barrier: `meet`
    rows), or for one that never answers (`hang` rows)."""

    barrier = threading.Barrier(4)

    def reset(self, row):
        if row.get("hang"):
            threading.Event().wait(20)  # a service that never answers (20 s here)
        elif row.get("meet"):
            self.barrier.wait(timeout=10)
        return row["prompt"]

    def step(self, action):
        return Step(done=True, reward=1.0)


def test_resets_run_in_the_step_pool_under_the_step_timeout(policy):
    """Resets ran one after another in the caller's thread with no deadline: 4 resets of 1 s took 4 s, and a reset
    that never returned hung the run. They run `workers` at a time (here all 4 meet at a barrier, which resets one at
    a time break), and one past env.step_timeout_s stops the run naming its row, as a reset that raises does."""
    Meets.barrier.reset()
    traj = runner(policy, Meets, workers=4, step_timeout_s=30).run([{**r, "meet": True} for r in ROWS], 2, [1, 2])
    assert traj.token_rewards.sum(-1).tolist() == [1.0] * 4
    with pytest.raises(ValueError, match=r"reset on row 1 took longer than env.step_timeout_s=0.5 s"):
        runner(policy, Meets, workers=2, step_timeout_s=0.5).run([{"prompt": "1="}, {"prompt": "2=", "hang": True}],
                                                                 1, [1, 2])


class FlakyResets:
    """Resets fail on the rows that say so (a service that did not answer), every one of them with `all`."""

    def reset(self, row):
        if row.get("down"):
            raise ConnectionError("environment service unavailable")
        return row["prompt"]

    def step(self, action):
        return Step(done=True, reward=1.0)


def test_a_failed_reset_ends_only_its_own_episodes_under_on_failure_mask(policy, caplog):
    """A reset that failed stopped the whole run, even when the environment's service missed one call in a
    thousand. With isolate_resets (env.on_failure=mask) its episodes end before they start: no tokens, counted as
    environment failures (their loss mask is empty, so they leave the loss and their groups' baselines), told once;
    the others play. A batch whose every reset fails is still the error (a broken environment, not a flaky one)."""
    rows = [{"prompt": "1=", "down": True}, {"prompt": "2="}]
    with caplog.at_level(logging.WARNING, logger="gspo.agent.episodes"):
        traj = runner(policy, FlakyResets, isolate_resets=True).run(rows, 2, [1, 2])
    assert column(traj, "env_failures") == [1.0, 1.0, 0.0, 0.0]
    assert traj.loss_mask.sum(-1).tolist()[:2] == [0, 0] and all(n > 0 for n in traj.loss_mask.sum(-1).tolist()[2:])
    assert traj.token_rewards.sum(-1).tolist() == [0.0, 0.0, 1.0, 1.0] and traj.completions[:2] == ["", ""]
    assert caplog.text.count("reset failed on row 0 (ConnectionError") == 1
    with pytest.raises(ValueError, match=r"reset failed on row 0 \(ConnectionError.*every other reset of the batch"):
        runner(policy, FlakyResets, isolate_resets=True).run([rows[0], rows[0]], 2, [1, 2])
    with pytest.raises(ValueError, match=r"reset failed on row 0 \(ConnectionError: environment service \w+\)$"):
        runner(policy, FlakyResets).run(rows, 2, [1, 2])  # env.on_failure=train: there is nothing to train


class Notes:
    """Answers every reply with the row's `note` as its observation, never ending the episode."""

    def reset(self, row):
        self.note = row["note"]
        return row["prompt"]

    def step(self, action):
        return Step(observation=self.note)


def test_episodes_near_the_context_limit_are_asked_for_what_fits(policy):
    """A 40-position model, episodes of up to 20 tokens. Row A's prompt is 20 tokens (the longest a row may have)
    and its 15-token observations leave it 4 tokens after its second turn; row B has 18 left. One generate call for
    both with B's 5 new tokens asked 20 + 16 + 5 = 41 positions for A, which the engine refuses: the run stopped. A
    now waits for a call of its own within its budget; every request fits, A's replies stay within its budget."""
    _, tok = policy
    model, _ = build_preset("tiny-moe", seed=0)
    model.config.max_position_embeddings = 40
    engine = HFSampler(model.eval(), tok, SamplingParams(max_new_tokens=5, stop=tuple(VOCAB_CHARS)))
    asked = []
    generate = engine.generate
    engine.generate = lambda prompts, *a, params: asked.append([len(q) + params.max_new_tokens for q in prompts]) \
        or generate(prompts, *a, params=params)
    rows = [{"prompt": "1+2+3+4+5+6+7+8+9+1=", "note": "0123456789abcde"}, {"prompt": "5*6=", "note": "x"}]
    traj = EpisodeRunner(engine, tok, Notes, EpisodeLimits(max_turns=3, max_tokens=20)).run(rows, 1, [1, 2])
    assert len(tok("1+2+3+4+5+6+7+8+9+1=", add_special_tokens=False)["input_ids"]) == 20
    assert max(map(max, asked)) <= 40 and len(asked) > 3  # a turn ran as two calls
    assert traj.completion_mask.sum(-1).tolist()[0] <= 20

    with pytest.raises(ValueError, match=r"reset prompt for row 0 \(prompt '1\+2.*has 21 tokens; with "
                                         r"env.max_tokens=20 an episode needs 41 positions, more than the engine's 40"):
        EpisodeRunner(engine, tok, Notes, EpisodeLimits(max_turns=3, max_tokens=20)).run(
            [{"prompt": "1+2+3+4+5+6+7+8+9+10=", "note": ""}], 1, [1])


# ---------------------------------------------------------------------------- environments that cannot be built


ENVS = """
from gspo.agent import Step


class Raises:
    def __init__(self, size: int = 1):
        raise RuntimeError("no board of that size")


class NoStep:
    def reset(self, row):
        return row["prompt"]


class Takes:
    def __init__(self, size: int = 1):
        self.size = size

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        return Step(done=True)
"""


@pytest.mark.parametrize(("name", "options", "message"), [
    ("Raises", {}, r"building an environment failed \(RuntimeError: no board of that size\)"),
    ("Takes", {"sise": 3}, r"building an environment failed \(TypeError: .*unexpected keyword argument 'sise'"),
    ("NoStep", {}, r"NoStep has no step method"),
])
def test_an_environment_that_cannot_be_built_is_refused_before_the_model(tmp_path, monkeypatch, name, options,
                                                                         message):
    """These were tracebacks after the model was built (and config.yaml written), and `--check` said ready."""
    module = tmp_path / "my_envs.py"
    module.write_text(ENVS)
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", f"env.name={module}:{name}", f"env.options={options}",
                                           "algorithm.loss=gspo_token", "data.chat=always"))
    with pytest.raises(ConfigError, match=rf"env\.name={module}:{name}: {message}"):
        build_env(cfg)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the environment was checked")

    monkeypatch.setattr(gspo.trainer, "load_model", no_model)
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()


RESETS = """
from gspo.agent import Step


class Picky:
    def __init__(self, refuse: bool = False):
        self.refuse = refuse

    def reset(self, row):
        if self.refuse:
            raise KeyError("board")
        return row["prompt"]

    def step(self, action):
        return Step(done=True)
"""


def test_check_resets_the_environment_on_sample_rows_before_the_run_would(tmp_path, capsys):
    """A reset that fails was found at the first rollout, after the model was built; `--check` said ready."""
    from gspo.cli import main

    module = tmp_path / "resets.py"
    module.write_text(RESETS)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(DEMO.read_text())
    args = [*tiny_overrides(tmp_path / "run", f"env.name={module}:Picky", "algorithm.loss=gspo_token",
                            "data.chat=always", "env.max_tokens=48", "rollout.max_new_tokens=8")]
    assert main(["train", str(cfg_file), "--check", *args]) == 0
    assert f"environment: {module}:Picky; training rows: 8 reset, prompts ≤" in capsys.readouterr().out
    assert main(["train", str(cfg_file), "--check", *args, "env.options={refuse: true}"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"env\.name={re.escape(str(module))}:Picky: reset failed on training row 0 \(KeyError", err)


def test_check_warns_when_the_tokenizer_cannot_write_the_parsers_calls(tmp_path):
    """The default hermes format on the tiny character vocabulary (no `<`, `{` or `"`): the tool could never be called
    and tool_call_rate stayed 0 with no word. The `call` format it can write."""
    from gspo.preflight import check, warnings

    calc = ["data.task=multiply", "data.task_options={digits_a: 2, digits_b: 1}", "data.chat=always",
            "rewards.functions={addition: 1.0}", "env.max_tokens=48", "rollout.max_new_tokens=8",
            "algorithm.loss=gspo_token", "cold_start=null"]
    hermes = check(load_config(DEMO, tiny_overrides(tmp_path / "a", *calc, "env.parser=hermes")))
    assert hermes["env"]["unwritable_calls"] == ["calc"]
    assert any("cannot write a call of calc in env.parser=hermes's format" in w for w in warnings(hermes))
    call = check(load_config(DEMO, tiny_overrides(tmp_path / "b", *calc, "env.parser=call")))
    assert call["env"]["unwritable_calls"] == [] and not any("cannot write a call" in w for w in warnings(call))


FLAKY = """
import zlib

from gspo.agent import Step


class Flaky:
    '''Fails the step of about a third of the episodes (by the reply's checksum: within groups, not whole groups),
    and with fail_resets every 7th reset.'''

    resets = 0

    def __init__(self, fail_resets=False):
        self.fail_resets = fail_resets

    def reset(self, row):
        Flaky.resets += 1
        if self.fail_resets and Flaky.resets % 7 == 0:
            raise ConnectionError("sandbox service unavailable")
        return row["prompt"]

    def step(self, action):
        if zlib.crc32(action.encode()) % 3 == 0:
            raise ConnectionError("sandbox service unavailable")
        return Step(done=True)
"""


@pytest.mark.parametrize("on_failure", ["mask", "train"])
def test_episodes_the_environment_failed_leave_the_loss_and_their_groups_baseline(tmp_path, monkeypatch, on_failure):
    """An episode ended by an environment failure was scored and trained as the policy's own doing (a broken service
    taught the policy to avoid what it was doing). With env.on_failure=mask (the default) it has no trained token and
    advantage 0, and the other episodes of its group get the advantages of the group without it; `train` keeps the
    old behaviour. Under mask a reset that fails is such a failure too (every 7th here); under train it stops the
    run, so the train run's resets do not fail."""
    from conftest import assert_left_out_of_groups, assert_reward_metrics_counted, varied_reward
    from gspo.rewards import REWARDS
    from gspo.tracking import read_metrics

    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    module = tmp_path / "flaky_envs.py"
    module.write_text(FLAKY)
    options = "{fail_resets: true}" if on_failure == "mask" else "{}"
    cfg = load_config(DEMO, tiny_overrides(tmp_path / "run", f"env.name={module}:Flaky", f"env.on_failure={on_failure}",
                                           f"env.options={options}",
                                           "data.chat=always", "env.max_tokens=48", "rollout.max_new_tokens=8",
                                           "rewards.functions={varied: 1.0}", "rewards.check=false", "trainer.steps=2",
                                           "trainer.eval_every=0", "log.rollouts=16", "rollout.group_size=4"))
    import gspo.trainer

    learned, learn = [], gspo.trainer.learn

    def spy(model, optimizer, scheduler, traj, *args, **kwargs):  # the learner's view of which rows left the loss
        out = traj.extras.get("out_of_loss")
        learned.append((None if out is None else out.cpu(), (~traj.completion_mask.bool().any(-1)).cpu()))
        return learn(model, optimizer, scheduler, traj, *args, **kwargs)

    monkeypatch.setattr(gspo.trainer, "learn", spy)
    summary = train(cfg)
    assert summary["status"] == "completed" and summary["skipped_updates"] == 0  # episodes of no tokens: finite loss
    # under mask the learner is told the failed episodes, the failed resets' episodes of no tokens among them (they
    # leave its normaliser: `test_a_row_of_no_tokens_the_batch_left_out_of_the_loss_leaves_the_normaliser`)
    assert len(learned) == 2
    for out, empty in learned:
        assert (out is not None and bool(out[empty].all()) and empty.any()) if on_failure == "mask" else out is None
    records = read_metrics(tmp_path / "run" / "rollouts.jsonl")
    assert_left_out_of_groups(records, "env_failure", on_failure == "mask", steps=2, groups=4)
    assert any(r["tokens"] == 0 for r in records) == (on_failure == "mask")  # a failed reset: an episode of no tokens
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["episode_env_failures"] > 0 for r in metrics)
    assert_reward_metrics_counted(records, metrics, "env_failure", on_failure == "mask")
    assert ("env_failed_masked" in metrics[0]) == (on_failure == "mask")

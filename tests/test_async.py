"""Asynchronous rollouts (issue 16): staleness bookkeeping, per-token versions of partial rollouts, the worker
processes under the trainer (staleness bound, back-pressure, a killed worker, resume)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import time
import zlib

import pytest
import torch

from conftest import DEMO, SimulatedCrash, crash_after, tiny_overrides
from gspo.checkpoint import find_latest_checkpoint, verify_checkpoint
from gspo.config import ConfigError, load_config
from gspo.models import build_preset
from gspo.rewards import REWARDS
from gspo.rollout import HFSampler, SamplingParams, policy_weights
from gspo.rollout.workers import AsyncRollouts, staleness_metrics, token_staleness, worker_policy
from gspo.schedule import step_prompts
from gspo.tracking import read_metrics
from gspo.trainer import TrainingError, prepare, train
from gspo.trajectory import NO_VERSION, Trajectory

ASYNC = ["rollout.mode=async", "trainer.steps=5", "cold_start.steps=2", "trainer.eval_every=0", "data.eval_size=8"]


def traj_with_versions(versions: list[list[int]], mask: list[list[int]]) -> Trajectory:
    v, m = torch.tensor(versions), torch.tensor(mask)
    n, t = v.shape
    return Trajectory(prompt_ids=torch.ones(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                      completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=m, logprobs=torch.zeros(n, t),
                      truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n,
                      prompt_index=torch.arange(n), versions=v)


def test_staleness_by_hand():
    traj = traj_with_versions([[3, 3, 2, NO_VERSION], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]])
    assert token_staleness(traj, 4).tolist() == [[1, 1, 2, 0], [3, 3, 4, 4]]
    m = staleness_metrics(traj, 4)
    ages = [1, 1, 2, 3, 3, 4, 4]  # the 7 loss tokens
    assert m["staleness_mean"] == pytest.approx(sum(ages) / 7) and m["staleness_max"] == 4
    fractions = [m[f"staleness_frac_{b}"] for b in ("0", "1", "2", "3", "4+")]
    assert fractions == pytest.approx([0, 2 / 7, 1 / 7, 2 / 7, 2 / 7])


def test_a_partial_rollout_keeps_each_tokens_version_and_log_prob():
    """Weights that arrive mid-generation are used from the next token on; the tokens before keep the old version
    and exactly the log-probs (and tokens) of a generation that never saw the new weights."""
    model, tok = build_preset("tiny-moe", seed=0)
    other, _ = build_preset("tiny-moe", seed=1)
    params = SamplingParams(max_new_tokens=10)
    reference = HFSampler(model, tok, params, own_copy=True).generate(["1+2=", "33+4="], 3, [5, 6])
    engine = HFSampler(model, tok, params, own_copy=True)
    calls = []

    def arrive() -> None:  # after the 4th token, version 7 arrives
        calls.append(1)
        if len(calls) == 4:
            engine.update_weights(policy_weights(other), 7)

    engine.between_tokens = arrive
    partial = engine.generate(["1+2=", "33+4="], 3, [5, 6])
    live = partial.completion_mask.bool()
    expected = torch.where(torch.arange(partial.versions.shape[1]) < 4, 0, 7).expand_as(live)
    assert torch.equal(partial.versions[live], expected[live])
    assert (partial.versions[~live] == NO_VERSION).all()
    assert torch.equal(partial.completion_ids[:, :4], reference.completion_ids[:, :4])
    assert torch.equal(partial.logprobs[:, :4], reference.logprobs[:, :4])
    assert not torch.equal(partial.logprobs[:, 4:][live[:, 4:]], reference.logprobs[:, 4:][live[:, 4:]])


def async_cfg(out, *extra):
    return load_config(DEMO, tiny_overrides(out, *ASYNC, "trainer.device=cpu", *extra))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_worker_samples_the_policy_in_its_dtype_as_the_sync_engine_does(tmp_path, dtype):
    """A worker built the policy from its config alone: float32 whatever model.dtype was, so a bf16 run's async
    rollouts were sampled in float32 where its sync engine samples in bf16 (the log-probs π_old comes from differ)."""
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "rollout.mode=async", f"model.dtype={dtype}", "optim.lr=1e-2",
                                           "cold_start.lr=1e-2", "model.name=tiny-dense"))
    policy, tokenizer = build_preset("tiny-dense", dtype=getattr(torch, dtype))
    worker = worker_policy(policy.config, cfg, "cpu")
    engine = HFSampler(worker, tokenizer, SamplingParams(max_new_tokens=2), own_copy=True)
    assert {p.dtype for p in worker.parameters()} == {getattr(torch, dtype)} and engine.dtype == getattr(torch, dtype)


def test_async_training_stays_within_the_staleness_bound_and_stops_its_workers(tmp_path):
    summary = train(async_cfg(tmp_path, "rollout.max_staleness=1"))
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 and r["rollout_dropped_stale"] == 0 for r in records)
    assert records[0]["staleness_max"] == 0  # the first batch is sampled by the initial policy
    assert not multiprocessing.active_children()


def test_back_pressure_bounds_how_far_workers_run_ahead(tmp_path):
    """A slow learner: the workers stop at the staleness bound and the bounded queue, never unbounded."""
    slow = lambda done, metrics: time.sleep(0.5)  # noqa: E731
    train(async_cfg(tmp_path, "rollout.max_staleness=2"), callbacks=[slow])
    for r in read_metrics(tmp_path / "metrics.jsonl"):
        assert r["rollout_ahead"] <= 2 + 1 + 1  # the bound, the queue slot, the one being generated
        assert r["staleness_max"] <= 2


def half_constant(prompt: str, completion: str, **row) -> float:
    """A reward (module level: the workers import it) constant for about half the prompts (by checksum), so that
    those groups carry no signal, and a checksum of the completion (varied within a group) for the others."""
    return 0.5 if zlib.crc32(prompt.encode()) % 2 else zlib.crc32(completion.encode()) % 1000 / 1000


def test_async_workers_fill_their_batches_with_informative_groups(tmp_path, monkeypatch):
    """rollout.dynamic_sampling with async rollouts: each worker refills its batch until P groups have varied rewards,
    so every trained batch is informative, the staleness bound still holds, and the learner never waits on a batch
    index that the bound keeps the workers from sampling (one batch per step, as without the filter)."""
    monkeypatch.setitem(REWARDS, "half_constant", half_constant)
    summary = train(async_cfg(tmp_path, "rewards.functions={half_constant: 1.0}", "rollout.dynamic_sampling=true",
                              "rollout.max_staleness=1", "log.rollouts=8"))
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 and r["dynamic_filled_groups"] == 0 for r in records)
    assert sum(r["dynamic_sampled_prompts"] for r in records) > 5 * 4  # refill rounds ran (P = 4)
    assert any(r["zero_variance_groups"] > 0 for r in records)  # over what was sampled: constant groups were there
    # the workers' per-function values come with the kept rows: each logged group (2 per step) is an informative one
    logged = read_metrics(tmp_path / "rollouts.jsonl")
    assert [r["step"] for r in logged] == [s for s in range(1, 6) for _ in range(8)]
    for step in range(1, 6):
        for group in (0, 1):
            mine = [r for r in logged if r["step"] == step and r["group"] == group]
            assert [r["rewards"] for r in mine] == [{"half_constant": r["reward"]} for r in mine]
            assert len({r["reward"] for r in mine}) > 1
    assert not multiprocessing.active_children()


def constant(prompt: str, completion: str, **row) -> float:
    return 0.5


def test_async_dynamic_sampling_on_a_constant_reward_stops_with_the_sync_error(tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "constant", constant)
    with pytest.raises(TrainingError, match=r"equal rewards.*dynamic_sampling"):
        train(async_cfg(tmp_path, "rewards.functions={constant: 1.0}", "rollout.dynamic_sampling=true",
                        "rollout.dynamic_max_rounds=2"))
    assert not multiprocessing.active_children()


def test_a_killed_worker_is_restarted_and_generates_its_batch_again(tmp_path, caplog):
    """The batch a killed worker held (generating, waiting for weights, or blocked sending it) is generated again by
    its replacement, so every batch of prompts is trained, in order (one worker); it used to be lost."""
    def kill_worker(done: int, metrics: dict) -> None:
        if done == 2:
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)

    with caplog.at_level(logging.WARNING, logger="gspo.rollout.workers"):
        summary = train(async_cfg(tmp_path, "trainer.steps=6"), callbacks=[kill_worker])
    assert summary["status"] == "completed"
    assert "rollout worker 0 died (killed by SIGKILL: out of memory, or kill -9); restarted" in caplog.text
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [int(r["rollout_batch_index"]) for r in records] == [0, 1, 2, 3, 4, 5]
    last = records[-1]
    assert last["step"] == 6 and last["rollout_worker_restarts"] == 1 and last["rollout_lost_batches"] == 0
    assert last["rollout_retried_batches"] in (0, 1)  # 0 when it died between two batches (rare)


def kill_own_worker_on_marked_prompts(prompt: str, completion: str, **row) -> float:
    """A reward (module level: the workers import it) that kills its worker process on the prompts listed in
    GSPO_TEST_FATAL_PROMPTS: a batch that takes down every worker that generates it."""
    if prompt in json.loads(os.environ.get("GSPO_TEST_FATAL_PROMPTS", "[]")):
        os.kill(os.getpid(), signal.SIGKILL)
    return zlib.crc32(completion.encode()) % 1000 / 1000


def test_a_batch_that_kills_its_worker_twice_is_counted_lost_and_the_run_goes_on(tmp_path, monkeypatch):
    """Batch 2 kills whichever worker scores it: it is tried once more, then counted as lost (not retried for good:
    the run would only stop at the restart limit), and the run trains the other batches."""
    cfg = async_cfg(tmp_path, "rewards.functions={kill_own_worker_on_marked_prompts: 1.0}", "rewards.check=false",
                    "trainer.steps=3")
    monkeypatch.setitem(REWARDS, "kill_own_worker_on_marked_prompts", kill_own_worker_on_marked_prompts)
    rows, _ = step_prompts(2, prepare(cfg).train_rows, cfg.rollout.prompts_per_step, cfg.trainer.seed)
    monkeypatch.setenv("GSPO_TEST_FATAL_PROMPTS", json.dumps([r["prompt"] for r in rows]))
    summary = train(cfg)
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [int(r["rollout_batch_index"]) for r in records] == [0, 1, 3]
    last = records[-1]
    assert (last["rollout_worker_restarts"], last["rollout_retried_batches"], last["rollout_lost_batches"]) == (2, 1, 1)
    assert not multiprocessing.active_children()


def test_a_resume_loses_a_pending_batch_that_already_killed_a_worker_at_its_next_death(tmp_path, monkeypatch):
    """A checkpoint keeps which of the batches in flight a worker already died generating (`rollout_retried`), so a
    resumed run counts such a batch as lost at its next death, as the run that saved it would have (it used to forget,
    and try the batch twice more); the other batches go on."""
    cfg = async_cfg(tmp_path, "rewards.functions={kill_own_worker_on_marked_prompts: 1.0}", "rewards.check=false")
    monkeypatch.setitem(REWARDS, "kill_own_worker_on_marked_prompts", kill_own_worker_on_marked_prompts)
    setup = prepare(cfg)
    rows, _ = step_prompts(1, setup.train_rows, cfg.rollout.prompts_per_step, cfg.trainer.seed)
    monkeypatch.setenv("GSPO_TEST_FATAL_PROMPTS", json.dumps([r["prompt"] for r in rows]))
    rollouts = AsyncRollouts(cfg, setup.model, setup.tokenizer, setup.train_rows, policy_weights(setup.model), 2,
                             start_index=3, pending=[1], retried=[1])
    try:
        assert rollouts.state_dict()["rollout_retried"] == [1]
        taken = []
        for version in (2, 3):
            item, _ = rollouts.next(version)
            taken.append(item.index)
            rollouts.publish(policy_weights(setup.model), version + 1)
        assert taken == [3, 4]
        assert (rollouts.counts["worker_restarts"], rollouts.counts["retried_batches"],
                rollouts.counts["lost_batches"]) == (1, 0, 1)
        assert rollouts.state_dict()["rollout_pending"] == rollouts.state_dict()["rollout_retried"] == []
    finally:
        rollouts.close()
    assert not multiprocessing.active_children()


@pytest.mark.timeout(300)
def test_batches_lost_beyond_the_staleness_bound_do_not_stall_the_workers(tmp_path):
    """Each lost batch index used up a version of the bound for good: with max_staleness=0 the first worker death left
    every worker waiting for a version the learner could not publish (the run hung). Killed at three steps here."""
    def kill_worker(done: int, metrics: dict) -> None:
        if done in (1, 2, 3):
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)

    summary = train(async_cfg(tmp_path, "trainer.steps=5", "rollout.max_staleness=0"), callbacks=[kill_worker])
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [int(r["rollout_batch_index"]) for r in records] == [0, 1, 2, 3, 4]  # the killed workers' batches again
    assert records[-1]["rollout_worker_restarts"] == 3 and records[-1]["rollout_lost_batches"] == 0
    assert all(r["staleness_max"] == 0 for r in records)  # the bound still holds for what is trained


def test_an_async_run_resumes_after_a_crash_from_its_checkpoint(tmp_path):
    cfg = async_cfg(tmp_path, "trainer.checkpoint_every=2")
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(3)])
    assert not multiprocessing.active_children()  # the crash stopped the workers too
    checkpoint = find_latest_checkpoint(tmp_path)
    assert checkpoint.name.endswith("2")
    summary = train(cfg, resume=True)
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # step 3 of the crashed run is redone


def test_async_settings_on_a_sync_run_are_refused_not_ignored(tmp_path):
    for setting in ("rollout.workers=2", "rollout.max_staleness=3", "rollout.partial=false"):
        with pytest.raises(ConfigError, match=r"only apply to rollout\.mode=async"):
            load_config(DEMO, tiny_overrides(tmp_path, setting))
    assert load_config(DEMO, tiny_overrides(tmp_path, "rollout.mode=async", "rollout.workers=2")).rollout.workers == 2
    assert load_config(DEMO, tiny_overrides(tmp_path, "rollout.mode=async", "rollout.engine=vllm")).rollout.engine \
        == "vllm"  # workers run their own vLLM engines (tests/test_vllm.py runs them)
    servers = ["rollout.mode=async", "rollout.engine=vllm_server", "rollout.workers=2", "rollout.partial=false"]
    cfg = load_config(DEMO, tiny_overrides(tmp_path, *servers, "rollout.vllm.server_url=[http://a:1,http://b:2]"))
    assert cfg.rollout.vllm.server_urls == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match=r"its own server: rollout\.vllm\.server_url lists 3"):
        load_config(DEMO, tiny_overrides(tmp_path, *servers,
                                         "rollout.vllm.server_url=[http://a:1,http://b:2,http://c:3]"))
    with pytest.raises(ConfigError, match=r"a list is for rollout\.mode=async"):
        load_config(DEMO, tiny_overrides(tmp_path, "rollout.engine=vllm_server",
                                         "rollout.vllm.server_url=[http://a:1,http://b:2]"))
    with pytest.raises(ConfigError, match=r"rollout\.partial .* needs an engine in the worker process"):
        load_config(DEMO, tiny_overrides(tmp_path, *servers[:3], "rollout.vllm.server_url=[http://a:1,http://b:2]"))
    with pytest.raises(ConfigError, match="lists a server twice"):
        load_config(DEMO, tiny_overrides(tmp_path, *servers, "rollout.vllm.server_url=[http://a:1,http://a:1]"))
    with pytest.raises(ConfigError, match="must look like http"):
        load_config(DEMO, tiny_overrides(tmp_path, *servers, "rollout.vllm.server_url=[http://a:1,b:2]"))


def slow_on_marked_prompts(prompt: str, completion: str, **row) -> float:
    """A reward (module level: the workers import it) that takes 0.25 s per completion of the prompts listed in
    GSPO_TEST_SLOW_PROMPTS, so that the batch holding them arrives well after the batches claimed after it."""
    if prompt in json.loads(os.environ.get("GSPO_TEST_SLOW_PROMPTS", "[]")):
        time.sleep(0.25)
    return zlib.crc32(completion.encode()) % 1000 / 1000


def test_a_resume_generates_again_the_batches_in_flight_at_its_checkpoint(tmp_path, monkeypatch):
    """Two workers, batch 1 slow: batches 0 and 2 are trained first, so the checkpoint of step 2 continues at index 3
    with batch 1 still in flight. A resume from it used to skip batch 1's prompts for good; it now generates batch 1
    again first (claimed before index 3), so batch 1 is among the three the resumed run trains, and no index is
    trained twice. (Which of 3, 4 and 5 fill the other two steps is the workers' race: an earlier version of this
    test that asked for exactly 0-4 failed once with 0, 1, 2, 3, 5.)"""
    cfg = async_cfg(tmp_path, "rollout.workers=2", "rollout.worker_threads=1", "rollout.max_staleness=2",
                    "trainer.checkpoint_every=2", "rewards.functions={slow_on_marked_prompts: 1.0}",
                    "rewards.check=false")
    monkeypatch.setitem(REWARDS, "slow_on_marked_prompts", slow_on_marked_prompts)
    rows, _ = step_prompts(1, prepare(cfg).train_rows, cfg.rollout.prompts_per_step, cfg.trainer.seed)
    monkeypatch.setenv("GSPO_TEST_SLOW_PROMPTS", json.dumps([r["prompt"] for r in rows]))
    with pytest.raises(SimulatedCrash):
        train(cfg, callbacks=[crash_after(2)])
    state = verify_checkpoint(find_latest_checkpoint(tmp_path))["state"]
    assert (state["rollout_index"], state["rollout_pending"]) == (3, [1])  # trained 0 and 2; 1 in flight
    monkeypatch.delenv("GSPO_TEST_SLOW_PROMPTS")  # batch 1 at its own pace again: the run ends with batch 4
    summary = train(cfg, resume=True)
    assert summary["status"] == "completed"
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    trained = [int(r["rollout_batch_index"]) for r in records]
    assert trained[:2] == [0, 2] and 1 in trained[2:] and len(set(trained)) == 5, trained
    assert records[-1]["rollout_lost_batches"] == records[-1]["rollout_dropped_stale"] == 0
    assert not multiprocessing.active_children()


def test_the_batches_a_resume_generates_again_come_first_and_use_no_version_of_the_bound(tmp_path):
    """Resumed at version 2 with index 3 next and index 1 pending, under max_staleness=0: index 1 is claimed first,
    and index 3 waits for version 3, as the bound requires (were batch 1 counted as skipped, index 3 would be sampled
    under version 2 and one of the two batches would be dropped as stale)."""
    cfg = async_cfg(tmp_path, "rollout.workers=2", "rollout.worker_threads=1", "rollout.max_staleness=0")
    setup = prepare(cfg)
    rollouts = AsyncRollouts(cfg, setup.model, setup.tokenizer, setup.train_rows, policy_weights(setup.model), 2,
                             start_index=3, pending=[1])
    try:
        assert rollouts.state_dict()["rollout_pending"] == [1]
        taken = []
        for version in (2, 3, 4):
            item, _ = rollouts.next(version)
            taken.append(item.index)
            assert item.traj.versions[item.traj.completion_mask.bool()].eq(version).all()
            rollouts.publish(policy_weights(setup.model), version + 1)
        assert taken == [1, 3, 4] and rollouts.counts["dropped_stale"] == 0
        assert rollouts.state_dict()["rollout_index"] == 5
        assert rollouts.state_dict()["rollout_pending"] == []
    finally:
        rollouts.close()


def test_the_reward_failures_of_a_batch_dropped_as_stale_are_counted(tmp_path):
    """A batch dropped as stale was scored all the same, but its reward failures never reached the run's counts
    (summary.json's reward_failures): the next batch taken carries them. Here every call fails (on_error=zero): batch
    1, sampled under version 1, is dropped at version 3, so batch 2 carries 2 × 8 failures, not 8."""
    from multiprocessing.connection import wait

    (tmp_path / "rw.py").write_text("def down(prompt, completion, **row):\n    raise RuntimeError('judge down')\n")
    cfg = async_cfg(tmp_path, "rollout.workers=1", "rollout.worker_threads=1", "rollout.max_staleness=0",
                    f"rewards.functions={{{tmp_path / 'rw.py'}:down: 1.0}}", "rewards.on_error=zero",
                    "rewards.check=false", "rewards.accuracy_reward=null")
    setup = prepare(cfg)
    completions = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    rollouts = AsyncRollouts(cfg, setup.model, setup.tokenizer, setup.train_rows, policy_weights(setup.model), 0)
    try:
        first, _ = rollouts.next(0)
        rollouts.publish(policy_weights(setup.model), 1)
        assert wait(rollouts.readers, timeout=120)  # batch 1, sampled under version 1, has arrived
        rollouts.publish(policy_weights(setup.model), 3)
        taken, _ = rollouts.next(3)
        assert (first.index, taken.index, rollouts.counts["dropped_stale"]) == (0, 2, 1)
        assert sum(first.failures["failures"].values()) == completions
        assert sum(taken.failures["failures"].values()) == 2 * completions
        assert rollouts.dropped_failures == {}
    finally:
        rollouts.close()
    assert not multiprocessing.active_children()

"""Micro-batches (`trainer.micro_batch_tokens`): a minibatch share run as several forwards and backwards bounded by a
token budget gives the update of one forward (every objective, the KL term, MoE), keeps the on-policy minibatch
exactly on-policy and never runs a forward over the budget. (Processes whose shares split into different counts:
`tests/test_parallel_state.py`.)"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEMO, ragged_trajectory, record_objective, tiny_overrides
from gspo import learner as learner_module
from gspo.config import load_config
from gspo.learner import LearnSettings, _equalise, learn, micro_batches
from gspo.logprobs import completion_logprobs
from gspo.models import build_preset
from gspo.objectives import OBJECTIVES
from gspo.tracking import read_metrics
from gspo.trainer import train

# ------------------------------------------------------------------------------------------------ the split


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=24), st.integers(1, 120))
def test_micro_batches_partition_the_rows_within_the_budget(lengths, budget):
    rows = torch.arange(len(lengths)) * 3  # row indices of a share: not 0..n-1
    length_of = torch.zeros(3 * len(lengths), dtype=torch.long)
    length_of[rows] = torch.tensor(lengths)
    micros = micro_batches(rows, length_of, budget)
    assert sorted(torch.cat(micros).tolist()) == rows.tolist()  # every row once
    for m in micros:
        assert len(m) == 1 or len(m) * int(length_of[m].max()) <= budget
    assert [t.tolist() for t in micro_batches(rows, length_of, None)] == [rows.tolist()]


@pytest.mark.parametrize("budget", [0, -5, 2.5, True])
def test_a_budget_that_is_not_a_positive_int_is_refused(budget):
    """What the config refuses for trainer.micro_batch_tokens, the library refuses too (sft and learn call this)."""
    with pytest.raises(ValueError, match="micro_batch_tokens must be an int >= 1"):
        micro_batches(torch.arange(4), torch.full((4,), 10), budget)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(0, 12))
def test_equalise_splits_to_the_count_keeping_every_row_once(sizes, extra):
    start, micros = 0, []
    for size in sizes:
        micros.append(torch.arange(start, start + size))
        start += size
    count = len(sizes) + extra
    if count > start:  # more micro-batches than rows: a share smaller than another process's
        with pytest.raises(ValueError, match="as many rows"):
            _equalise(micros, count)
        return
    out = _equalise(micros, count)
    assert len(out) == count and all(len(m) for m in out)
    assert torch.cat(out).sort().values.tolist() == list(range(start))


# ------------------------------------------------------------------------------------------------ learn()


def run_learn(preset: str, loss: str, budget: int | None, *, kl_beta: float = 0.0, forwards: list | None = None):
    """One `learn` call (2 minibatches, SGD so that a gradient difference shows 1:1 in the weights); returns (the
    weights' change, metrics)."""
    model, _ = build_preset(preset, seed=1)
    ref = copy.deepcopy(model).eval() if kl_beta else None
    traj = ragged_trajectory(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    spec = OBJECTIVES[loss]
    settings_ = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12,
                              kl_beta=kl_beta, micro_batch_tokens=budget)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25])
    with pytest.MonkeyPatch.context() as mp:
        if forwards is not None:
            def spy(m, p_ids, p_mask, c_ids, c_mask, *a, **k):
                if m is model:
                    forwards.append(len(p_ids) * int((p_mask.sum(-1) + c_mask.sum(-1)).max()))
                return completion_logprobs(m, p_ids, p_mask, c_ids, c_mask, *a, **k)
            mp.setattr(learner_module, "completion_logprobs", spy)
        metrics = learn(model, optimizer, scheduler, traj, advantages, [torch.tensor([0, 2, 4, 6, 1]),
                                                                        torch.tensor([3, 5, 7])],
                        settings_, ref_model=ref)
    delta = {k: v - start[k] for k, v in model.state_dict().items()}
    return delta, metrics


def assert_same_update(a: tuple, b: tuple) -> None:
    (delta_a, m_a), (delta_b, m_b) = a, b
    scale = max(float(d.abs().max()) for d in delta_a.values())
    assert scale > 1e-4  # the update is not vacuous
    gap = max(float((delta_a[k] - delta_b[k]).abs().max()) for k in delta_a)
    assert gap <= 1e-5 * scale, f"weights differ by {gap:.2e} against updates of {scale:.2e}"
    assert m_a.keys() == m_b.keys() and m_a["micro_batches"] == 1 < m_b["micro_batches"]
    for key in m_a.keys() - {"micro_batches"}:  # every metric the same, but the count of forwards
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("loss", sorted(OBJECTIVES))
def test_micro_batches_give_the_update_of_one_forward(loss):
    forwards: list[int] = []
    one = run_learn("tiny-dense", loss, None)
    micro = run_learn("tiny-dense", loss, 24, forwards=forwards)
    assert_same_update(one, micro)
    assert len(forwards) > 4  # π_old and 2 updates ran as more than one forward per minibatch
    assert max(forwards) <= 24  # every row fits the budget (≤ 9 + 12 tokens), so every forward does


def test_micro_batches_with_the_kl_term_and_an_moe_model():
    for preset in ("tiny-dense", "tiny-moe"):
        assert_same_update(run_learn(preset, "gspo", None, kl_beta=0.1), run_learn(preset, "gspo", 30, kl_beta=0.1))


# ------------------------------------------------------------------------------------------------ the trainer


@pytest.fixture
def spy_gspo(monkeypatch):
    """(logprobs, old_logprobs, mask) of every call of the gspo objective."""
    return record_objective(monkeypatch, "gspo")


@pytest.mark.parametrize("moe", ["none", "r2"])
def test_a_run_with_micro_batches_stays_exactly_on_policy(tmp_path, spy_gspo, moe, monkeypatch):
    """The demo's tiny MoE with a budget of about two rows: π_old and the first update use the same micro-batches, so
    the on-policy minibatch's ratios are exactly 1 in every micro-batch (with routing replay too)."""
    counts: list[int] = []  # micro-batches of each minibatch, in order

    def equalise(micros, count):
        out = _equalise(micros, count)
        counts.append(len(out))
        return out

    monkeypatch.setattr(learner_module, "_equalise", equalise)
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start=null", "trainer.steps=2", "trainer.eval_every=0",
                                           "rewards.functions={conftest.varied_reward: 1.0}",
                                           "trainer.micro_batch_tokens=24", f"algorithm.routing_replay={moe}",
                                           "data.eval_size=1"))
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["clip_frac_tokens_first_mb"] for r in records] == [0.0, 0.0]
    assert len(counts) == 2 * 4 and max(counts) > 1  # micro-batches ran
    assert [r["micro_batches"] for r in records] == [sum(counts[:4]) / 4, sum(counts[4:]) / 4]
    calls, moved = iter(spy_gspo), []
    for k, count in enumerate(counts):  # each micro-batch's loss, then the minibatch's metrics when split
        for lp, old, mask in [next(calls) for _ in range(count + (count > 1))]:
            if k % 4 == 0:  # a step's first minibatch: π_θ = π_old bit for bit
                assert torch.equal(lp[mask], old[mask]), f"step {k // 4 + 1}: ratio ≠ 1 on-policy"
            else:
                moved.append(not torch.equal(lp[mask], old[mask]))
    assert any(moved) and next(calls, None) is None  # the later minibatches moved: the check is not vacuous
    if moe == "r2":
        assert all(0 <= r["expert_volatility"] <= 1 for r in records)


TWO_STEPS = ("cold_start=null", "trainer.steps=2", "trainer.eval_every=0", "trainer.checkpoint_every=1",
             "data.eval_size=1")  # a checkpoint after step 1, to resume from


def failing_on_call(real, call: int, error: Exception):
    """`real`, except that its `call`-th call (from 1) raises `error`: step `call` of a run fails there."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)"),
], ids=["cuda", "cpu"])
def test_out_of_memory_in_the_update_advises_a_budget_and_the_run_resumes_with_it(tmp_path, monkeypatch, error):
    """An update that runs out of memory (GPU or CPU allocator) stops with the setting to change (a budget below what
    the forward held), and the run continues from its checkpoint with that budget (a key a resume may change)."""
    import re

    from gspo import trainer as trainer_module
    from gspo.trainer import TrainingError

    overrides = tiny_overrides(tmp_path, *TWO_STEPS)
    real_learn = trainer_module.learn
    monkeypatch.setattr(trainer_module, "learn", failing_on_call(real_learn, 2, error))
    with pytest.raises(TrainingError, match="out of memory in the update of step 2") as info:
        train(load_config(DEMO, overrides))
    advice = re.search(r"trainer\.micro_batch_tokens=(\d+)", str(info.value))
    assert advice and "--resume" in str(info.value), str(info.value)
    held = int(re.search(r"held up to ([\d,]+) tokens", str(info.value)).group(1).replace(",", ""))
    assert int(advice.group(1)) < held
    monkeypatch.setattr(trainer_module, "learn", real_learn)
    train(load_config(DEMO, [*overrides, advice.group(0)]), resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_out_of_memory_while_sampling_advises_a_row_cap_and_the_run_resumes_with_it(tmp_path, monkeypatch):
    """Sampling that runs out of memory names rollout.max_batch_rows (below the rows it sampled at once); the run
    continues from its checkpoint with the cap, sampling in batches of whole groups."""
    from gspo import trainer as trainer_module
    from gspo.trainer import TrainingError

    overrides = tiny_overrides(tmp_path, *TWO_STEPS)
    real_collect = trainer_module.collect
    monkeypatch.setattr(trainer_module, "collect", failing_on_call(
        real_collect, 2, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")))
    with pytest.raises(TrainingError, match=r"sampling step 2's rollouts \(16 completions.*rollout.max_batch_rows below"
                                            r" 16 \(then --resume\)"):
        train(load_config(DEMO, overrides))
    monkeypatch.setattr(trainer_module, "collect", real_collect)
    train(load_config(DEMO, [*overrides, "rollout.max_batch_rows=8"]), resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_cold_start_sft_with_micro_batches_takes_the_same_steps(monkeypatch):
    """`sft(micro_batch_tokens=...)` (cold_start.micro_batch_tokens, `gspo sft --micro-batch-tokens`):
    each forward within the budget, the same losses and (plain SGD, so that gradients show 1:1) the same weights."""
    from gspo import sft as sft_module
    from gspo.data import make_task

    def sgd(model, lr, steps, **kwargs):
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    monkeypatch.setattr(sft_module, "make_optimizer", sgd)
    rows = make_task("addition", split="train", size=64, seed=0)
    results = []
    for budget in (None, 40):
        forwards: list[int] = []
        model, tokenizer = build_preset("tiny-moe", seed=3)

        def spy(m, p_ids, p_mask, c_ids, c_mask, *a, forwards=forwards, **k):
            forwards.append(len(p_ids) * int((p_mask.sum(-1) + c_mask.sum(-1)).max()))
            return completion_logprobs(m, p_ids, p_mask, c_ids, c_mask, *a, **k)

        monkeypatch.setattr(sft_module, "completion_logprobs", spy)
        losses = sft_module.sft(model, tokenizer, rows, steps=3, batch_size=16, lr=0.5, progress=False,
                                micro_batch_tokens=budget)
        results.append((losses, {k: v.detach().clone() for k, v in model.named_parameters()}, forwards))
    (losses_a, weights_a, forwards_a), (losses_b, weights_b, forwards_b) = results
    assert len(forwards_a) == 3 and len(forwards_b) > 3 and max(forwards_b) <= 40
    assert losses_b == pytest.approx(losses_a, rel=1e-5)
    start = {k: v.detach() for k, v in build_preset("tiny-moe", seed=3)[0].named_parameters()}
    scale = max(float((weights_a[k] - start[k]).abs().max()) for k in start)
    gap = max(float((weights_a[k] - weights_b[k]).abs().max()) for k in start)
    assert scale > 1e-3 and gap <= 1e-5 * scale, (gap, scale)


def test_the_cold_start_section_passes_its_budget_to_sft(tmp_path, monkeypatch):
    from gspo import sft as sft_module

    seen = {}
    monkeypatch.setattr(sft_module, "sft", lambda *a, **k: seen.update(k) or [1.0])
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "cold_start.micro_batch_tokens=64",
                                           "trainer.micro_batch_tokens=16"))
    model, tokenizer = build_preset("tiny-dense")
    sft_module.cold_start(cfg, tmp_path, model, tokenizer, [])
    assert seen["micro_batch_tokens"] == 64


def test_other_runtime_errors_in_the_update_are_not_called_out_of_memory(tmp_path, monkeypatch):
    from gspo import trainer as trainer_module

    def broken(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")

    monkeypatch.setattr(trainer_module, "learn", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        train(load_config(DEMO, tiny_overrides(tmp_path, "cold_start=null", "trainer.eval_every=0",
                                               "data.eval_size=1")))
    assert "memory" not in str(info.value)


def test_out_of_memory_in_the_cold_start_advises_its_budget_and_the_same_command_then_runs(tmp_path, monkeypatch):
    from gspo import sft as sft_module
    from gspo.trainer import TrainingError

    overrides = tiny_overrides(tmp_path, "trainer.steps=1", "trainer.eval_every=0", "data.eval_size=1")
    real_sft = sft_module.sft

    def sft_out_of_memory(*args, **kwargs):
        if kwargs["micro_batch_tokens"] is None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real_sft(*args, **kwargs)

    monkeypatch.setattr(sft_module, "sft", sft_out_of_memory)
    with pytest.raises(TrainingError, match=r"cold start's SFT \(16 rows per step\): set cold_start\.micro_batch_"
                                            r"tokens .*run the command again"):
        train(load_config(DEMO, overrides))
    summary = train(load_config(DEMO, [*overrides, "cold_start.micro_batch_tokens=64"]))  # no --resume, no --overwrite
    assert summary["status"] == "completed" and (tmp_path / "cold_start" / "sft.json").is_file()

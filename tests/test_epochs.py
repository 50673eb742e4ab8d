"""Several passes over a rollout batch (`algorithm.epochs`, PPO's epochs; TRL's num_iterations): each pass updates
on every row once, in its own minibatches, and every pass is against the rollout batch's π_old, computed once."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from conftest import DEMO, ragged_trajectory, record_objective, tiny_overrides
from gspo.config import ConfigError, load_config
from gspo.learner import LearnSettings, learn
from gspo.models import build_preset
from gspo.objectives import OBJECTIVES
from gspo.optim import make_optimizer
from gspo.tracking import read_metrics
from gspo.trainer import train

FIRST = [torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])]
SECOND = [torch.tensor([7, 6, 1, 0]), torch.tensor([2, 3, 4, 5])]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25])


def sgd(model: torch.nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # stateless: a gradient difference shows 1:1
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def test_a_second_pass_updates_every_row_again_against_the_same_old_policy(monkeypatch):
    model, _ = build_preset("tiny-dense", seed=1)
    traj = ragged_trajectory(model)
    calls = record_objective(monkeypatch, "gspo")
    spec = OBJECTIVES["gspo"]  # the spy
    settings = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12)

    two = copy.deepcopy(model)
    metrics = learn(two, *sgd(two), traj, ADVANTAGES, FIRST, settings, later_epochs=[SECOND])
    assert len(calls) == 4 and metrics["skipped_updates"] == 0
    old = torch.zeros_like(traj.logprobs)
    for rows, (_, old_rows, _) in zip(FIRST, calls[:2], strict=True):
        old[rows] = old_rows
    for rows, (_, old_rows, _) in zip(SECOND, calls[2:], strict=True):
        assert torch.equal(old_rows, old[rows])  # the second pass sees the first pass's π_old, not a new one
    new, first_old, mask = calls[0]
    assert torch.equal(new[mask], first_old[mask])  # the first update is on-policy (ratios exactly 1) ...
    new, second_old, mask = calls[2]
    assert not torch.allclose(new[mask], second_old[mask])  # ... the second pass is not

    # the same as a second learn() call on the second split, taking the first call's π_old as given
    calls.clear()
    again = copy.deepcopy(model)
    optimizer, scheduler = sgd(again)
    learn(again, optimizer, scheduler, traj, ADVANTAGES, FIRST, settings)
    learn(again, optimizer, scheduler, dataclasses.replace(traj, logprobs=old), ADVANTAGES, SECOND,
          dataclasses.replace(settings, old_logprobs="rollout"))
    start, a, b = model.state_dict(), two.state_dict(), again.state_dict()
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-4 and gap <= 1e-6 * moved


@pytest.mark.parametrize("later, match", [([[torch.tensor([0, 1, 2, 3])]], "8 distinct rows, .* got 4"),
                                          ([[torch.tensor([0, 1, 2, 3]), torch.tensor([3, 4, 5, 6])]], "7 distinct")])
def test_a_later_pass_must_take_as_many_distinct_rows(later, match):
    model, _ = build_preset("tiny-dense", seed=1)
    spec = OBJECTIVES["gspo"]
    with pytest.raises(ValueError, match=match):
        learn(model, *sgd(model), ragged_trajectory(model), ADVANTAGES, FIRST,
              LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high), later_epochs=later)


def test_a_run_with_two_passes_steps_the_optimizer_and_the_schedule_twice_as_often(tmp_path):
    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, "algorithm.epochs=2", "trainer.steps=3", "optim.warmup_steps=0")))
    metrics = read_metrics(out / "metrics.jsonl")
    assert [m["clip_frac_tokens_first_mb"] for m in metrics] == [0.0, 0.0, 0.0]  # still exactly on-policy first
    # the cosine schedule spans steps × minibatches × epochs = 24 optimizer steps; after step 1 it has taken 8
    cfg = load_config(DEMO, tiny_overrides(out))
    optimizer, scheduler = make_optimizer(torch.nn.Linear(1, 1), cfg.optim.lr, 3 * cfg.algorithm.minibatches * 2,
                                          warmup_steps=0, min_lr_ratio=cfg.optim.min_lr_ratio)
    used = []
    for _ in range(cfg.algorithm.minibatches * 2):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: nothing moves, the schedule advances
        scheduler.step()
    assert metrics[0]["lr"] == pytest.approx(sum(used) / len(used))  # the rates step 1's 8 updates used
    assert metrics[1]["lr"] < scheduler.get_last_lr()[0] < metrics[0]["lr"]  # decaying: after step 1 is step 2's


def test_epochs_below_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.epochs"):
        load_config(DEMO, tiny_overrides(tmp_path, "algorithm.epochs=0"))


def test_step_seeds_are_derived_from_the_run_seed_the_step_and_the_position():
    """Each step's prompts get their own seeds: the same position at another step is sampled with another seed (a
    run would otherwise draw the same random stream for prompt j at every step)."""
    from gspo.schedule import derive_seed, step_prompts
    rows = [{"prompt": str(i)} for i in range(10)]
    _, s0 = step_prompts(0, rows, 4, seed=7)
    _, s1 = step_prompts(1, rows, 4, seed=7)
    assert s0 == [derive_seed(7, "rollout", 0, j) for j in range(4)]
    assert s1 == [derive_seed(7, "rollout", 1, j) for j in range(4)]
    assert not set(s0) & set(s1) and len(set(s0)) == 4
    assert step_prompts(0, rows, 4, seed=8)[1] != s0


def test_each_epoch_is_a_fresh_permutation_taken_in_consecutive_slices():
    """Steps walk through one permutation of the rows per epoch, `count` rows a step with no gap or overlap, and the
    next epoch is another permutation (seeded by the epoch), not the first one again."""
    from gspo.schedule import prompt_indices
    n, count = 10, 5
    walk = [i for step in range(6) for i in prompt_indices(step, count, n, seed=3)]  # three epochs
    epochs = [walk[k * n:(k + 1) * n] for k in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    odd = [i for step in range(4) for i in prompt_indices(step, 3, n, seed=3)]  # 12 rows: an epoch and 2 more
    assert odd[:n] == epochs[0] and sorted(odd[:n]) == list(range(n))

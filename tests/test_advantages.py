"""Properties of group advantages (Eq. 6)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.advantages import group_advantages, zero_variance_groups


def test_paper_example():
    adv = group_advantages(torch.tensor([0.8, 0.4, 0.6]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]), atol=1e-6, rtol=0)


def test_equal_groups_give_exact_zeros_and_are_reported():
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 7.0, 7.0, 7.0])
    adv = group_advantages(rewards, 3)
    assert torch.all(adv[:3] == 0) and torch.all(adv[6:] == 0)
    assert torch.isfinite(adv).all()
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, True]


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 5),
    size=st.integers(2, 8),
    data=st.data(),
    scale=st.sampled_from(["group", "batch", "none"]),
)
def test_each_group_is_centred_and_unit_sample_std(groups, size, data, scale):
    values = data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=groups * size,
                                max_size=groups * size))
    rewards = torch.tensor(values)
    adv = group_advantages(rewards, size, scale=scale).view(groups, size)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.sum(-1), torch.zeros(groups), atol=1e-5, rtol=0)
    flat = zero_variance_groups(rewards, size)
    if scale == "group":
        std = adv.std(-1, correction=1)
        torch.testing.assert_close(std[~flat], torch.ones(int((~flat).sum())), atol=1e-5, rtol=0)
    if scale == "none":
        r = rewards.view(groups, size)
        expected = torch.where(flat[:, None], 0.0, r - r.mean(-1, keepdim=True))
        torch.testing.assert_close(adv, expected)
    assert torch.all(adv[flat] == 0)


def test_batch_scale_divides_by_batch_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, 2, scale="batch")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]) / rewards.std())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_names_its_index(bad):
    with pytest.raises(ValueError, match="index 4"):
        group_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0, bad, 0.0]), 2)


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(6), 1)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="token")


def test_arguments_of_the_wrong_kind_are_refused_by_name():
    """A negative eps let an all-equal group through to 0/0 (NaN advantages, no error); a float group size or a list of
    rewards failed deep in torch (`view()` / `.dim()`)."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got -1"):
        group_advantages(rewards, 4, eps=-1)
    with pytest.raises(ValueError, match=r"eps must be"):
        zero_variance_groups(rewards, 4, eps=math.nan)
    with pytest.raises(ValueError, match=r"group_size must be an int, got 4\.0"):
        group_advantages(rewards, 4.0)
    with pytest.raises(ValueError, match=r"rewards must be a torch\.Tensor, got list"):
        group_advantages(rewards.tolist(), 4)
    assert torch.isfinite(group_advantages(rewards, 4, eps=0)).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_flat_groups_whose_mean_rounds_get_exact_zero_advantages(scale):
    """float32 mean of [0.9, 0.9, 0.9] is not 0.9 (r − mean leaves ±6e-8): the documented "exactly 0, no rounding
    residue" needs the explicit where(flat, 0, ...), which hypothesis' exact rewards {0, .25, .5, 1} never exercise."""
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0, 0.5])
    assert (rewards[:3] - rewards[:3].mean() != 0).any()  # the premise: the residue exists
    adv = group_advantages(rewards, 3, scale=scale)
    assert torch.all(adv[:3] == 0)
    assert (adv[3:] != 0).any()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_completions_that_do_not_count_leave_their_groups_baseline(scale):
    """`valid` (env.on_failure=mask): a group's statistics are over its valid members, which get the advantages of
    the group without the others; the others get 0. Each group here has one invalid member, so the valid ones are
    groups of 3; a group of 4 whose only valid member is one gets 0 everywhere (no baseline)."""
    torch.manual_seed(0)
    rewards = torch.rand(12)
    valid = torch.ones(12, dtype=torch.bool)
    valid[[1, 4, 11]] = False
    adv = group_advantages(rewards, 4, scale=scale, valid=valid)
    expected = group_advantages(rewards[valid], 3, scale=scale)
    torch.testing.assert_close(adv[valid], expected)
    assert adv[~valid].tolist() == [0.0, 0.0, 0.0]
    alone = torch.tensor([True, False, False, False])
    assert group_advantages(torch.tensor([0.9, 0.1, 0.2, 0.3]), 4, scale=scale, valid=alone).tolist() == [0.0] * 4
    every = torch.ones(12, dtype=torch.bool)
    torch.testing.assert_close(group_advantages(rewards, 4, scale=scale, valid=every),
                               group_advantages(rewards, 4, scale=scale))
    # dynamic sampling's test, over the same members: a group varied only by a member that does not count has none
    varied_by_one = torch.tensor([0.5, 0.5, 0.5, 0.9, 0.1, 0.5, 0.5, 0.5])
    out = torch.tensor([False, False, False, True, True, False, False, False])
    assert zero_variance_groups(varied_by_one, 4).tolist() == [False, False]
    assert zero_variance_groups(varied_by_one, 4, valid=~out).tolist() == [True, True]
    assert zero_variance_groups(rewards, 4, valid=alone.repeat(3)).tolist() == [True] * 3  # one member: no signal
    with pytest.raises(ValueError, match="valid must be a bool tensor of the rewards' shape"):
        group_advantages(rewards, 4, valid=valid[:6])
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        group_advantages(rewards, 4, valid=valid.float())

"""Train–inference mismatch correction (gspo.correction): each equation against hand computations, the level each
objective gets, TIS as advantage scaling, masks, config rules, and a bf16-engine run through the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEMO, tiny_overrides, varied_reward
from gspo.config import ConfigError, load_config
from gspo.correction import (
    DEFAULT_MASK_BOUNDS,
    Correction,
    apply_correction,
    mismatch_metrics,
    resolve_correction,
    sequence_keep_mask,
    sequence_log_ratio,
    sequence_tis_weights,
    token_keep_mask,
    token_log_ratio,
    token_tis_weights,
)
from gspo.objectives import OBJECTIVES, Objective, cispo_loss, grpo_loss, gspo_loss, gspo_token_loss, process_normaliser
from gspo.rewards import REWARDS
from gspo.tracking import read_metrics
from gspo.trainer import learn_settings, train


@pytest.fixture(autouse=True)
def varied(monkeypatch):
    """The `varied` reward for this module's trainer runs, registered per test."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)



def ratios(rho: list[list[float]], engine: float = -1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old_logprobs, engine_logprobs, mask) whose ρ = π_old/μ are `rho` (rows padded with NaN garbage, masked)."""
    width = max(len(r) for r in rho)
    mask = torch.tensor([[t < len(r) for t in range(width)] for r in rho])
    log_rho = torch.tensor([[math.log(r[t]) if t < len(r) else math.nan for t in range(width)] for r in rho])
    eng = torch.where(mask, torch.full_like(log_rho, engine), torch.full_like(log_rho, -math.inf))
    return eng + log_rho, eng, mask


# ------------------------------------------------------------------------------------------------------ the equations


def test_token_log_ratio_is_zero_off_the_mask_whatever_is_there():
    old, eng, mask = ratios([[2.0, 0.5], [3.0]])
    log_rho = token_log_ratio(old, eng, mask)
    torch.testing.assert_close(log_rho, torch.tensor([[math.log(2), math.log(0.5)], [math.log(3), 0.0]]))


def test_token_tis_caps_the_ratio():
    old, eng, mask = ratios([[0.5, 1.5, 3.0, 20.0]])
    w = token_tis_weights(token_log_ratio(old, eng, mask), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0, 2.0]]))
    assert not w.requires_grad


def test_token_mis_keeps_ratios_within_the_bounds():
    old, eng, mask = ratios([[0.4, 0.6, 1.0, 1.9, 2.5], [1.0]])
    keep = token_keep_mask(token_log_ratio(old, eng, mask), mask, 0.5, 2.0)
    assert keep.tolist() == [[False, True, True, True, False], [True, False, False, False, False]]


def test_geometric_mean_masks_sequences_not_tokens():
    """A: every token within the token bounds, geometric mean 1.2 outside sequence bounds [0.9, 1.1] → dropped. B:
    two tokens outside the token bounds (4 and 1/4), geometric mean (4 · 1/4 · 1 · 1)^(1/4) = 1 → kept at either
    sequence bounds, where MIS drops them."""
    old, eng, mask = ratios([[1.2, 1.2], [4.0, 0.25, 1.0, 1.0], []])
    log_rho = token_log_ratio(old, eng, mask)
    seq = sequence_log_ratio(log_rho, mask)
    torch.testing.assert_close(seq, torch.tensor([math.log(1.2), 0.0, 0.0]))
    assert sequence_keep_mask(seq, 0.9, 1.1).tolist() == [False, True, True]
    assert sequence_keep_mask(seq, *DEFAULT_MASK_BOUNDS["sequence"]).tolist() == [True, True, True]
    assert token_keep_mask(log_rho, mask, *DEFAULT_MASK_BOUNDS["token"]).tolist() == [
        [True, True, False, False], [False, False, True, True], [False] * 4]
    torch.testing.assert_close(sequence_tis_weights(torch.tensor([math.log(3.0), math.log(0.5)]), 2.0),
                               torch.tensor([2.0, 0.5]))


def test_mismatch_metrics_by_hand():
    """ρ = 2, 1/2 (sequence 1), e^0.1 (sequence 2), an empty sequence: k3 = mean over the 3 tokens of ρ − 1 − log ρ;
    log-ppl ratio = mean over the 2 non-empty sequences of −mean_t log ρ = (0 − 0.1) / 2."""
    old, eng, mask = ratios([[2.0, 0.5], [math.exp(0.1)], []])
    m = mismatch_metrics(old, eng, mask)
    k3 = ((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5)) + (math.exp(0.1) - 1 - 0.1)) / 3
    assert m["mismatch_kl_k3"] == pytest.approx(k3, rel=1e-5)
    assert m["mismatch_log_ppl_ratio"] == pytest.approx(-0.05, rel=1e-5)
    same = mismatch_metrics(eng, eng, mask)
    assert same == {"mismatch_kl_k3": 0.0, "mismatch_log_ppl_ratio": 0.0}


# ---------------------------------------------------------------------------------------------- which level applies


def test_each_objective_declares_its_ratio_level():
    levels = {name: spec.ratio_level for name, spec in OBJECTIVES.items()}
    assert levels == {"gspo": "sequence", "gspo_token": "sequence", "grpo": "token", "dapo": "token",
                      "dr_grpo": "token", "cispo": "token"}


def test_auto_is_on_only_for_recomputed_pi_old_with_async_rollouts():
    gspo, grpo = OBJECTIVES["gspo"], OBJECTIVES["grpo"]
    kw = {"tis_cap": 2.0, "mask_bounds": None}
    assert resolve_correction("auto", gspo, recompute=True, asynchronous=False, **kw) is None
    assert resolve_correction("auto", gspo, recompute=False, asynchronous=True, **kw) is None
    assert resolve_correction("off", gspo, recompute=True, asynchronous=True, **kw) is None
    assert resolve_correction("auto", gspo, recompute=True, asynchronous=True, **kw) == Correction(
        "sequence", 2.0, DEFAULT_MASK_BOUNDS["sequence"])
    assert resolve_correction("mask", grpo, recompute=True, asynchronous=False, tis_cap=3.0,
                              mask_bounds=(0.2, 5.0)) == Correction("token", None, (0.2, 5.0))
    assert resolve_correction("tis", grpo, recompute=True, asynchronous=False, **kw) == Correction("token", 2.0)
    with pytest.raises(ValueError, match="old_logprobs=rollout"):
        resolve_correction("tis", gspo, recompute=False, asynchronous=False, **kw)
    plain = Objective(loss=gspo_loss, eps_low=0.2, eps_high=0.2, normalise_by="tokens", summary="no token advantages")
    assert resolve_correction("auto", plain, recompute=True, asynchronous=True, **kw) == Correction(
        "token", None, DEFAULT_MASK_BOUNDS["token"])
    with pytest.raises(ValueError, match="token_advantages"):
        resolve_correction("tis", plain, recompute=True, asynchronous=True, **kw)


def test_learn_settings_resolves_auto_from_the_rollout_mode():
    assert learn_settings(load_config(DEMO)).mismatch is None
    assert learn_settings(load_config(DEMO, ["rollout.mode=async"])).mismatch == Correction(
        "sequence", 2.0, DEFAULT_MASK_BOUNDS["sequence"])
    assert learn_settings(load_config(DEMO, ["rollout.mode=async", "algorithm.old_logprobs=rollout"])).mismatch is None
    assert learn_settings(load_config(DEMO, ["algorithm.loss=dapo", "algorithm.mismatch=tis",
                                             "algorithm.tis_cap=3"])).mismatch == Correction("token", 3.0)


# ------------------------------------------------------------------------------------ TIS as advantage scaling, masks


def batch(seed: int = 0, rows: int = 4, width: int = 5):
    """(logprobs leaf, old, engine, advantages, mask) in float64 with ragged lengths and a few off-policy tokens."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2 - 0.1
    logprobs = (old + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=0)  # log-probs
    logprobs.requires_grad_(True)
    engine = (old - 0.8 * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=0)
    mask = torch.arange(width)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]
    return logprobs, old, engine, torch.randn(rows, generator=g, dtype=torch.float64), mask


def test_token_tis_by_advantage_scaling_equals_the_weighted_grpo_loss():
    """grpo with [B, T] advantages Â_i·w_t is −1/B Σ_i 1/|y_i| Σ_t w_t min(r Â_i, clip(r) Â_i), value and gradient;
    cispo's likewise weights each token's sg[clip(r)] Â_i log π_θ."""
    logprobs, old, engine, adv, mask = batch()
    corr = Correction("token", tis_cap=1.5)
    scaled, keep, metrics = apply_correction(corr, old, engine, adv, mask)
    assert keep is mask or torch.equal(keep, mask)
    w = torch.exp(old - engine).clamp(max=1.5)
    torch.testing.assert_close(torch.where(mask, scaled, 0), torch.where(mask, adv[:, None] * w, 0))
    assert metrics["mismatch_truncated_frac"] == pytest.approx(float(((old - engine).exp() > 1.5)[mask].float().mean()))

    loss, _ = grpo_loss(logprobs, old, scaled, mask)
    (grad,) = torch.autograd.grad(loss, logprobs)
    r = torch.exp(logprobs - old)
    a = adv[:, None]
    term = w * torch.minimum(r * a, r.clamp(0.8, 1.27) * a)
    reference = -(torch.where(mask, term, 0).sum(-1) / mask.sum(-1)).mean()
    (ref_grad,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, ref_grad)

    loss, _ = cispo_loss(logprobs, old, scaled, mask)
    ref = -torch.where(mask, w * r.detach().clamp(0.0, 1.28) * a * logprobs, 0).sum() / mask.sum()
    torch.testing.assert_close(loss, ref)


def test_per_row_token_advantages_are_the_row_advantage_exactly():
    """The [B] path is unchanged: [B, T] advantages equal to Â_i along each row give the same loss."""
    logprobs, old, _, adv, mask = batch(1)
    for loss_fn in (grpo_loss, cispo_loss):
        assert torch.equal(loss_fn(logprobs, old, adv[:, None].expand_as(old).clone(), mask)[0],
                           loss_fn(logprobs, old, adv, mask)[0])


def test_sequence_tis_scales_each_rows_advantage():
    logprobs, old, engine, adv, mask = batch(2)
    corr = Correction("sequence", tis_cap=1.2)
    w = torch.exp(sequence_log_ratio(token_log_ratio(old, engine, mask), mask)).clamp(max=1.2)
    scaled, _, _ = apply_correction(corr, old, engine, adv, mask)
    torch.testing.assert_close(scaled, adv * w)
    token_adv = torch.randn(old.shape, dtype=old.dtype)
    scaled_rows, _, _ = apply_correction(corr, old, engine, token_adv, mask)
    torch.testing.assert_close(scaled_rows, token_adv * w[:, None])
    gspo_token_loss(logprobs, old, scaled_rows, mask)  # gspo_token takes the scaled [B, T] advantages


@pytest.mark.parametrize(("loss_fn", "level"), [(grpo_loss, "token"), (gspo_loss, "sequence")])
def test_masked_tokens_get_zero_gradient(loss_fn, level):
    logprobs, old, engine, adv, mask = batch(3)
    _, keep, metrics = apply_correction(Correction(level, bounds=(0.7, 1.4)), old, engine, adv, mask)
    dropped = mask & ~keep
    assert dropped.any() and keep.any()
    assert metrics["mismatch_masked_frac"] == pytest.approx(float(dropped.sum() / mask.sum()))
    loss, _ = loss_fn(logprobs, old, adv, keep, eps_low=1.0, eps_high=100.0)  # nothing clipped: only the mask zeroes
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.all(grad[dropped] == 0) and torch.all(grad[keep] != 0)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_all_masked_minibatch_is_zero_not_nan(name):
    spec = OBJECTIVES[name]
    logprobs, old, _, adv, mask = batch(4)
    engine = old - 5.0  # ρ = e^5 everywhere: every token and sequence is outside the bounds
    scaled, keep, metrics = apply_correction(Correction(spec.ratio_level, 2.0, (0.5, 2.0)), old, engine, adv, mask)
    assert not keep.any() and metrics["mismatch_masked_frac"] == 1.0
    kept_rows = keep.any(-1) | ~mask.any(-1)
    count = spec.count(keep[kept_rows], 5)
    loss, m = spec(logprobs, old, scaled, keep, normaliser=process_normaliser(count))
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert float(loss.detach()) == 0.0 and torch.all(grad == 0)
    assert all(math.isfinite(v) for v in m.values())


# ------------------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.mismatch=mask", "algorithm.mask_bounds=[1.2, 2.0]"], "0 < low < 1 < high"),
        (["algorithm.mismatch=mask", "algorithm.mask_bounds=[0.5, 0.9]"], "0 < low < 1 < high"),
        (["algorithm.mismatch=mask", "algorithm.mask_bounds=[0.0, 2.0]"], "0 < low < 1 < high"),
        (["algorithm.tis_cap=1.0"], "greater than 1"),
        (["algorithm.tis_cap=0.5"], "greater than 1"),
        (["algorithm.old_logprobs=rollout", "algorithm.mismatch=tis"], "old_logprobs=rollout"),
        (["algorithm.old_logprobs=rollout", "algorithm.mismatch=tis+mask"], "π_old is μ"),
        (["algorithm.mismatch=off", "algorithm.mask_bounds=[0.5, 2.0]"], "masks nothing"),
        (["algorithm.mismatch=tis", "algorithm.mask_bounds=[0.5, 2.0]"], "mismatch=tis masks nothing"),
        # auto corrects only recomputed π_old with async rollouts: in a sync run, or with π_old from the engine, the
        # bounds and the cap were accepted and unused
        (["algorithm.mask_bounds=[0.9, 1.1]"], r"mismatch=auto .*this run: recompute, sync\) masks nothing"),
        (["algorithm.mask_bounds=[0.9, 1.1]", "algorithm.old_logprobs=rollout", "rollout.mode=async",
          "rollout.partial=false"], r"this run: rollout, async\) masks nothing"),
        (["algorithm.tis_cap=5"], r"tis_cap=5 is set but algorithm\.mismatch=auto .* weights nothing"),
        (["algorithm.tis_cap=5", "algorithm.mismatch=mask"], r"mismatch=mask weights nothing \(no TIS\)"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_config_defaults():
    algo = load_config(DEMO).algorithm
    assert (algo.mismatch, algo.tis_cap, algo.mask_bounds) == ("auto", 2.0, None)
    assert load_config(DEMO, ["algorithm.old_logprobs=rollout", "algorithm.mismatch=off"])
    algo = load_config(DEMO, ["algorithm.mismatch=tis+mask", "algorithm.mask_bounds=[0.9, 1.2]"]).algorithm
    assert algo.mask_bounds == (0.9, 1.2)
    # where the correction applies, its bounds and cap are taken: auto with async rollouts, or explicit in sync
    for extra in (["rollout.mode=async"], ["algorithm.mismatch=tis+mask"]):
        cfg = load_config(DEMO, ["algorithm.mask_bounds=[0.9, 1.2]", "algorithm.tis_cap=3", *extra])
        assert learn_settings(cfg).mismatch == Correction("sequence", 3.0, (0.9, 1.2))


# ---------------------------------------------------------------------------------------- through the trainer, bf16


@pytest.mark.parametrize("bounds", [None, "[0.99999, 1.00001]"], ids=["default-bounds", "tight-bounds"])
def test_training_with_a_bf16_engine_reports_finite_mismatch_metrics(tmp_path, bounds):
    """Two steps with `tis+mask` against a bf16 rollout engine: the metrics are there and finite; bounds so tight that
    bf16 noise drops most sequences still train without a NaN or a skipped update."""
    extra = [] if bounds is None else [f"algorithm.mask_bounds={bounds}"]
    cfg = load_config(DEMO, tiny_overrides(tmp_path, "trainer.steps=2", "cold_start=null", "trainer.eval_every=0",
                                           "rollout.dtype=bfloat16", "algorithm.mismatch=tis+mask",
                                           "rewards.functions={addition: 1.0, varied: 0.5}", *extra))
    train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("mismatch_kl_k3", "mismatch_log_ppl_ratio", "mismatch_masked_frac", "mismatch_truncated_frac"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["mismatch_kl_k3"] > 0  # a bf16 engine's log-probabilities differ from the fp32 trainer's
        assert 0 <= r["mismatch_masked_frac"] <= 1 and 0 <= r["mismatch_truncated_frac"] <= 1
        assert math.isfinite(r["loss"]) and r["skipped_updates"] == 0
        if bounds is not None:
            assert r["mismatch_masked_frac"] > 0.5

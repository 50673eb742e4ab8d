"""Properties of the objectives: closed-form gradients (Eqs. 10, 11, 17), equivalences, masking, clipping,
robustness."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.config import ConfigError, load_config
from gspo.objectives import (
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    OBJECTIVES,
    Objective,
    cispo_loss,
    dapo_loss,
    default_eps,
    dr_grpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    kl_to_reference,
    process_normaliser,
    register_objective,
    seq_mean_token_mean,
    sequence_log_ratio,
    token_mean,
)


def make_batch(seed: int, batch: int = 6, length: int = 7, spread: float = 1e-3, empty_row: bool = False):
    """Random (logprobs leaf, old_logprobs, advantages, mask) with ragged lengths ≥ 1 (or one empty row)."""
    g = torch.Generator().manual_seed(seed)
    # float64 so that the closed forms can be compared tightly
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 - 0.1
    logprobs = (old + spread * torch.randn(batch, length, generator=g, dtype=torch.float64)).clamp(max=0)  # log-probs
    logprobs.requires_grad_(True)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if empty_row:
        mask[0] = False
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    return logprobs, old, adv, mask


def grad_of(loss_fn, logprobs, *args, **kwargs) -> tuple[torch.Tensor, dict]:
    logprobs.grad = None
    loss, metrics = loss_fn(logprobs, *args, **kwargs)
    loss.backward()
    return logprobs.grad.clone(), metrics


seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------------------------------------------------------- Eq. 7


def test_sequence_log_ratio_is_masked_mean_of_token_log_ratios():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = torch.tensor([(0.5 + 0.0 - 1.0) / 3, 0.5])
    torch.testing.assert_close(sequence_log_ratio(lp, old, mask), expected)


# ------------------------------------------------------------------------------------------- closed-form gradients


@settings(max_examples=40, deadline=None)
@given(seed=seeds, spread=st.sampled_from([0.0, 1e-5, 1e-4, 1e-2, 0.3]))
def test_gspo_gradient_equals_eq10(seed, spread):
    """∂(−J)/∂ log π_θ(y_{i,t}) = −1/B · s_i Â_i / |y_i| on unclipped sequences, 0 on clipped ones and padding."""
    lp, old, adv, mask = make_batch(seed, spread=spread)
    grad, _ = grad_of(gspo_loss, lp, old, adv, mask)
    s = torch.exp(sequence_log_ratio(lp.detach(), old, mask))
    clipped = ((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4))
    lengths = mask.sum(-1)
    per_seq = torch.where(clipped, 0.0, -s * adv / lengths / lp.shape[0])
    expected = torch.where(mask, per_seq[:, None].expand_as(lp), 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, spread=st.sampled_from([0.0, 1e-3, 0.1, 0.5]))
def test_grpo_gradient_equals_eq11(seed, spread):
    """∂(−J)/∂ log π_θ(y_{i,t}) = −1/B · Â_i w_{i,t} / |y_i| on unclipped tokens, 0 on clipped tokens and padding."""
    lp, old, adv, mask = make_batch(seed, spread=spread)
    grad, _ = grad_of(grpo_loss, lp, old, adv, mask)
    w = torch.exp(lp.detach() - old)
    a = adv[:, None]
    clipped = ((a > 0) & (w > 1.27)) | ((a < 0) & (w < 0.8))
    expected = -a * w / mask.sum(-1, keepdim=True) / lp.shape[0]
    expected = torch.where(mask & ~clipped, expected, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, spread=st.sampled_from([0.0, 1e-4, 1e-2]))
def test_gspo_token_gradient_equals_eq17(seed, spread):
    """With per-token advantages: −1/B · s_i Â_{i,t} / |y_i| on tokens whose clipped branch is not taken."""
    lp, old, _, mask = make_batch(seed, spread=spread)
    adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grad, _ = grad_of(gspo_token_loss, lp, old, adv, mask)
    s = torch.exp(sequence_log_ratio(lp.detach(), old, mask))[:, None]
    clipped = ((adv > 0) & (s > 1 + 4e-4)) | ((adv < 0) & (s < 1 - 3e-4))
    expected = torch.where(mask & ~clipped, -s * adv / mask.sum(-1, keepdim=True) / lp.shape[0], 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------------- equivalences


@settings(max_examples=40, deadline=None)
@given(seed=seeds, spread=st.sampled_from([0.0, 1e-4, 3e-4, 1e-2]), empty=st.booleans())
def test_gspo_token_equals_gspo_for_sequence_advantages(seed, spread, empty):
    lp, old, adv, mask = make_batch(seed, spread=spread, empty_row=empty)
    g1, m1 = grad_of(gspo_loss, lp, old, adv, mask)
    l1 = gspo_loss(lp, old, adv, mask)[0]
    for token_adv in (adv, adv[:, None].expand_as(lp).clone()):
        g2, m2 = grad_of(gspo_token_loss, lp, old, token_adv, mask)
        l2 = gspo_token_loss(lp, old, token_adv, mask)[0]
        torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-15)
        assert m2 == pytest.approx(m1, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("far", [-80.0, 80.0])
def test_gspo_token_equals_gspo_where_a_sequence_ratio_hits_the_clamp(far):
    """A sequence whose mean log-ratio is beyond ±LOG_RATIO_CLAMP gets no gradient from GSPO (the clamp's); GSPO-token
    sent it e^20 ≈ 4.9e8 times the log-probability's gradient through its detached s_i."""
    lp = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -1.0, -2.0]], dtype=torch.float64)
    old = lp.clone()
    (old if far > 0 else lp)[0, 1] -= abs(far)  # row 0: mean log-ratio ±26.7, past the clamp; row 1 on-policy
    lp.requires_grad_(True)
    adv, mask = torch.tensor([-1.0 if far > 0 else 1.0, 1.0], dtype=torch.float64), torch.ones(2, 3)
    g1, _ = grad_of(gspo_loss, lp, old, adv, mask)
    assert (g1[0] == 0).all() and (g1[1] != 0).any()  # so the comparison can fail
    for token_adv in (adv, adv[:, None].expand_as(lp).clone()):
        g2, _ = grad_of(gspo_token_loss, lp, old, token_adv, mask)
        torch.testing.assert_close(g2, g1, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(gspo_token_loss(lp, old, token_adv, mask)[0], gspo_loss(lp, old, adv, mask)[0])


@settings(max_examples=30, deadline=None)
@given(seed=seeds)
def test_on_policy_gspo_and_grpo_gradients_coincide(seed):
    """π_old = π_θ (detached): all ratios are 1 and Eq. 10 = Eq. 11."""
    lp, _, adv, mask = make_batch(seed)
    old = lp.detach().clone()
    g_gspo, m_gspo = grad_of(gspo_loss, lp, old, adv, mask)
    g_grpo, m_grpo = grad_of(grpo_loss, lp, old, adv, mask)
    torch.testing.assert_close(g_gspo, g_grpo, rtol=1e-12, atol=1e-15)
    assert m_gspo["clip_frac_tokens"] == m_grpo["clip_frac_tokens"] == 0.0
    assert m_gspo["ratio_mean"] == m_grpo["ratio_mean"] == 1.0
    assert m_gspo["approx_kl"] == 0.0


def test_loss_averages_over_sequences_not_tokens():
    """Eq. 5 weighs each response 1/G whatever its length (TRL's default `dapo` weights by length — not GSPO)."""
    old = torch.full((2, 4), -1.0)
    lp = old.clone().requires_grad_(True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = gspo_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(0.0)  # −(1·1 + 1·(−1)) / 2
    loss.backward()
    # per-sequence gradient mass is equal in magnitude: the short sequence gets 1/1, the long 4 × 1/4.
    assert lp.grad[0].abs().sum().item() == pytest.approx(lp.grad[1].abs().sum().item())


# -------------------------------------------------------------------------------------------------------- masking


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=15, deadline=None)
@given(seed=seeds, garbage=st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -7.0]), extra=st.integers(1, 4))
def test_masked_garbage_changes_nothing(name, seed, garbage, extra):
    """Appending masked columns holding NaN/±inf/huge values changes neither loss, gradient nor metrics."""
    loss_fn = OBJECTIVES[name]
    lp, old, adv, mask = make_batch(seed, spread=1e-2, empty_row=seed % 2 == 0)
    g1, m1 = grad_of(loss_fn, lp, old, adv, mask)
    l1 = loss_fn(lp, old, adv, mask)[0]

    pad = torch.full((lp.shape[0], extra), garbage)
    lp2 = torch.cat([lp.detach(), pad], 1).requires_grad_(True)
    old2 = torch.cat([old, pad.flip(0)], 1)
    mask2 = torch.cat([mask, torch.zeros_like(pad, dtype=torch.bool)], 1)
    kwargs = {"max_tokens": lp.shape[1]} if name == "dr_grpo" else {}
    if name == "dr_grpo":
        g1, m1 = grad_of(loss_fn, lp, old, adv, mask, **kwargs)
        l1 = loss_fn(lp, old, adv, mask, **kwargs)[0]
    g2, m2 = grad_of(loss_fn, lp2, old2, adv, mask2, **kwargs)
    l2 = loss_fn(lp2, old2, adv, mask2, **kwargs)[0]
    torch.testing.assert_close(l2, l1, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g2[:, : lp.shape[1]], g1, rtol=1e-12, atol=1e-15)
    assert torch.all(g2[:, lp.shape[1]:] == 0)
    assert m2 == pytest.approx(m1, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_empty_sequence_contributes_nothing(name):
    lp, old, adv, mask = make_batch(3, spread=1e-2)
    lp_e = torch.cat([torch.full((1, lp.shape[1]), math.nan), lp.detach()]).requires_grad_(True)
    old_e = torch.cat([torch.full((1, lp.shape[1]), -math.inf), old])
    mask_e = torch.cat([torch.zeros(1, lp.shape[1], dtype=torch.bool), mask])
    adv_e = torch.cat([torch.tensor([5.0]), adv])
    loss, metrics = OBJECTIVES[name](lp_e, old_e, adv_e, mask_e)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(lp_e.grad[0] == 0) and torch.isfinite(lp_e.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


# ------------------------------------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_clip_blocks_gradient_only_in_the_advantage_direction(name):
    """s_i beyond 1+ε_high with Â > 0 (or below 1−ε_low with Â < 0) → zero gradient; the other side still learns."""
    loss_fn = OBJECTIVES[name]
    old = torch.full((4, 3), -1.0)
    shift = torch.tensor([1e-3, -1e-3, -1e-3, 1e-3])[:, None]  # s ≈ 1.001, 0.999, 0.999, 1.001
    lp = (old + shift).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    grad, metrics = grad_of(loss_fn, lp, old, adv, mask)
    assert torch.all(grad[0] == 0) and torch.all(grad[1] == 0)  # clipped: ratio moved in the advantage's direction
    assert torch.all(grad[2] != 0) and torch.all(grad[3] != 0)  # pessimistic side: min keeps the unclipped branch
    assert metrics["clip_frac_seqs"] == 0.5 and metrics["clip_frac_tokens"] == 0.5


def test_grpo_clip_is_per_token():
    old = torch.full((1, 4), -1.0)
    lp = (old + torch.tensor([[0.5, 0.0, -0.5, 0.1]])).requires_grad_(True)  # w = 1.65, 1, 0.61, 1.105
    grad, metrics = grad_of(grpo_loss, lp, old, torch.tensor([1.0]), torch.ones(1, 4))
    assert grad[0, 0] == 0 and (grad[0, 1:] != 0).all()
    assert metrics["clip_frac_tokens"] == 0.25 and metrics["clip_frac_seqs"] == 1.0


def test_clip_fraction_counts_tokens_of_clipped_sequences():
    old = torch.full((2, 4), -1.0)
    lp = old + torch.tensor([[1e-2], [0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    _, metrics = gspo_loss(lp, old, torch.tensor([1.0, 1.0]), mask)
    assert metrics["clip_frac_tokens"] == pytest.approx(3 / 4)
    assert metrics["clip_frac_seqs"] == pytest.approx(1 / 2)
    assert metrics["ratio_max"] == pytest.approx(math.exp(1e-2))
    assert metrics["ratio_min"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------------- robustness


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=20, deadline=None)
@given(seed=seeds, scale=st.sampled_from([1e2, 1e4, 1e8, 1e30]))
def test_finite_for_extreme_finite_inputs(name, seed, scale):
    """Huge log-ratios (both signs) give a finite loss, finite gradients and finite metrics."""
    lp, old, adv, mask = make_batch(seed)
    sign = torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed)).sign()
    # log-probabilities stay <= 0: the log-ratio is +scale where π_old is the far one, -scale where π_θ is
    lp, old = lp.detach() - scale * (sign < 0), old - scale * (sign > 0)
    grad, metrics = grad_of(OBJECTIVES[name], lp.float().requires_grad_(True), old.float(), adv.float() * scale, mask)
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["ratio_max"] <= math.exp(LOG_RATIO_CLAMP) * 1.0001


def test_low_precision_inputs_are_computed_in_float32():
    lp, old, adv, mask = make_batch(0, spread=1e-3)
    loss16, _ = gspo_loss(lp.detach().bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert loss16.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "old_logprobs": a["old_logprobs"][:, :-1]}, "old_logprobs shape"),
        (lambda a: {**a, "mask": a["mask"][:-1]}, "mask shape"),
        (lambda a: {**a, "advantages": a["advantages"][:-1]}, "advantages shape"),
        (lambda a: {**a, "old_logprobs": a["old_logprobs"].float()}, "old_logprobs dtype"),
        (lambda a: {**a, "logprobs": a["logprobs"][0]}, r"logprobs must be \[B, T\]"),
        (lambda a: {**a, "mask": a["mask"] * 2}, "must hold only 0 and 1"),
        (lambda a: {**a, "advantages": a["advantages"].long()}, "advantages must be a floating-point"),
    ],
)
def test_bad_inputs_raise_value_error_naming_them(change, message):
    lp, old, adv, mask = make_batch(0)
    args = change({"logprobs": lp, "old_logprobs": old, "advantages": adv, "mask": mask.long()})
    with pytest.raises(ValueError, match=message):
        gspo_loss(**args)


def test_token_advantages_only_where_allowed():
    lp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="advantages shape"):
        gspo_loss(lp, old, adv[:, None].expand_as(lp), mask)
    grpo_loss(lp, old, adv[:, None].expand_as(lp), mask)  # token-level losses take [B, T] (per-token TIS weights)
    with pytest.raises(ValueError, match="advantages shape"):
        grpo_loss(lp, old, adv[:, None].expand_as(lp)[:, :-1], mask)


def test_bad_clip_range_raises():
    lp, old, adv, mask = make_batch(0)
    with pytest.raises(ValueError, match="eps_low"):
        gspo_loss(lp, old, adv, mask, eps_low=-0.1)


# --------------------------------------------------------------------------------------------------------- baselines


def test_default_eps_are_the_papers():
    assert default_eps("gspo") == (3e-4, 4e-4)
    assert default_eps("gspo_token") == (3e-4, 4e-4)
    assert default_eps("grpo") == (0.2, 0.27)
    assert default_eps("dapo") == (0.2, 0.28)
    assert default_eps("dr_grpo") == (0.2, 0.27)
    assert default_eps("cispo") == (1.0, 0.28)
    with pytest.raises(ValueError, match="unknown objective"):
        default_eps("ppo")


def test_dapo_weighs_tokens_equally_and_dr_grpo_uses_a_constant():
    old = torch.full((2, 4), -1.0)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0])
    g_dapo, _ = grad_of(dapo_loss, old.clone().requires_grad_(True), old, adv, mask)
    assert torch.allclose(g_dapo[mask.bool()], torch.tensor(-1 / 5))  # one token-mean over 5 tokens
    g_dr, _ = grad_of(dr_grpo_loss, old.clone().requires_grad_(True), old, adv, mask, max_tokens=8)
    assert torch.allclose(g_dr[mask.bool()], torch.tensor(-1 / (2 * 8)))  # 1/B · 1/L, no 1/|y_i|
    g_grpo, _ = grad_of(grpo_loss, old.clone().requires_grad_(True), old, adv, mask)
    assert g_grpo[0, 0] == pytest.approx(-1 / 2) and g_grpo[1, 0] == pytest.approx(-1 / 8)


def test_cispo_keeps_gradient_of_truncated_tokens_with_clipped_weight():
    old = torch.full((1, 2), -1.0)
    lp = (old + torch.tensor([[1.0, 0.0]])).requires_grad_(True)  # w = e, 1
    grad, metrics = grad_of(cispo_loss, lp, old, torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(grad, torch.tensor([[-1.28 / 2, -1.0 / 2]]))
    assert metrics["clip_frac_tokens"] == 0.5


@pytest.mark.parametrize("estimator", sorted(KL_ESTIMATORS))
def test_kl_to_reference_is_zero_at_reference_and_positive_elsewhere(estimator):
    lp, old, _, mask = make_batch(0, spread=0.1)
    assert kl_to_reference(old, old, mask, estimator=estimator).item() == 0.0
    assert kl_to_reference(lp.detach(), old, mask, estimator=estimator).item() > 0
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_to_reference(old, old, mask, estimator="k1")


@pytest.mark.parametrize("seed", range(5))
def test_kl_estimators_expected_gradients_are_those_of_their_divergences(seed):
    """Exactly, over one token's distribution (V outcomes, each weighted by π_θ, as sampling weights them, the
    sample held fixed as a loss term holds it): k2's expected gradient is ∇KL(π_θ‖π_ref), the penalty's meaning;
    k3's (GRPO's) is ∇KL(π_ref‖π_θ), the forward one; and k3's expected value is KL(π_θ‖π_ref) (unbiased)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    ref = (2 * torch.randn(9, generator=g, dtype=torch.float64)).log_softmax(-1)
    logp = theta.log_softmax(-1)
    p = logp.exp()
    reverse, forward = (p * (logp - ref)).sum(), (ref.exp() * (ref - logp)).sum()
    grad = {name: torch.autograd.grad(x, theta, retain_graph=True)[0] for name, x in
            [("reverse", reverse), ("forward", forward),
             *((e, (p.detach() * KL_ESTIMATORS[e](ref - logp)).sum()) for e in KL_ESTIMATORS)]}
    torch.testing.assert_close(grad["k2"], grad["reverse"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad["k3"], grad["forward"], rtol=1e-10, atol=1e-12)
    assert (grad["k3"] - grad["reverse"]).abs().max() > 1e-3  # the two divergences' gradients differ here
    torch.testing.assert_close((p * KL_ESTIMATORS["k3"](ref - logp)).sum(), reverse, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------ registry and metadata


def test_registry_metadata_of_the_built_in_objectives():
    by = {name: spec.normalise_by for name, spec in OBJECTIVES.items()}
    assert by == {"gspo": "sequences", "gspo_token": "sequences", "grpo": "sequences", "dapo": "tokens",
                  "dr_grpo": "budget", "cispo": "tokens"}
    assert [name for name, spec in OBJECTIVES.items() if not spec.token_advantages] == ["gspo"]
    assert {name: spec.advantage_scale for name, spec in OBJECTIVES.items() if spec.advantage_scale != "group"} == {
        "dr_grpo": "none"}
    assert OBJECTIVES["dr_grpo"].allowed_scales == ("none",)
    assert all(spec.allowed_scales == ("group", "batch", "none") for name, spec in OBJECTIVES.items()
               if name != "dr_grpo")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_spec_agrees_with_its_function(name):
    """The spec's ε are the function's own defaults (standalone calls and registry calls agree), and token_advantages
    says exactly whether the function accepts [B, T] advantages; calling the spec uses its ε."""
    spec = OBJECTIVES[name]
    params = inspect.signature(spec.loss).parameters
    assert (params["eps_low"].default, params["eps_high"].default) == (spec.eps_low, spec.eps_high)
    assert params["normaliser"].kind is inspect.Parameter.KEYWORD_ONLY and params["normaliser"].default is None
    lp, old, adv, mask = make_batch(0, spread=1e-2)
    assert torch.equal(spec(lp, old, adv, mask)[0], spec.loss(lp, old, adv, mask)[0])
    token_adv = adv[:, None].expand_as(lp).clone()
    if spec.token_advantages:
        spec(lp, old, token_adv, mask)
    else:
        with pytest.raises(ValueError, match="advantages shape"):
            spec(lp, old, token_adv, mask)


def _float32_batch(seed: int, batch: int = 6, length: int = 9):
    """float32 (as in training) with ragged lengths, some empty rows and masked garbage."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 3
    lp = (old + 0.05 * torch.randn(batch, length, generator=g)).clamp(max=0)
    adv = torch.randn(batch, generator=g)
    mask = torch.arange(length)[None, :] < torch.randint(0, length + 1, (batch,), generator=g)[:, None]
    return lp, old.masked_fill(~mask, math.nan), adv, mask


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@settings(max_examples=25, deadline=None)
@given(seed=seeds)
def test_local_count_as_normaliser_is_bit_identical(name, seed):
    """normaliser = the local count (what one process passes) gives exactly the loss, gradient and metrics of the
    default (None, the code before normalisers existed)."""
    spec = OBJECTIVES[name]
    lp, old, adv, mask = _float32_batch(seed)
    count = spec.count(mask, max_new_tokens=lp.shape[1])  # dr_grpo's default L is T
    results = []
    for kwargs in ({}, {"normaliser": process_normaliser(count, 1)}, {"normaliser": count} if count else {}):
        leaf = lp.clone().requires_grad_(True)
        loss, metrics = spec(leaf, old, adv, mask, **kwargs)
        (grad,) = torch.autograd.grad(loss, leaf)
        results.append((loss, grad, metrics))
    for loss, grad, metrics in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert metrics == results[0][2]


@settings(max_examples=50, deadline=None)
@given(seed=seeds, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_aggregations_with_the_local_count_are_the_old_formulas_bit_for_bit(seed, dtype):
    """The old expressions, literally: x.sum() / B (a Python int) and x.sum() / mask.sum().clamp(min=1) (an int
    tensor) against the new ones given the count as a Python float."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 11, generator=g, dtype=dtype)
    mask = torch.rand(7, 11, generator=g) > 0.4
    lengths = mask.sum(-1).clamp(min=1).to(dtype)
    old_seq = (torch.where(mask, x, 0.0).sum(-1) / lengths).sum() / x.shape[0]
    old_tok = torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)
    assert torch.equal(seq_mean_token_mean(x, mask, float(x.shape[0])), old_seq)
    assert torch.equal(token_mean(x, mask, float(mask.sum().clamp(min=1))), old_tok)
    assert torch.equal(seq_mean_token_mean(x, mask), old_seq) and torch.equal(token_mean(x, mask), old_tok)


def _one_vs_two_processes(spec: Objective, seed: int, max_new_tokens: int = 12, dtype=torch.float64):
    """Gradient of one process on the whole minibatch, and the average (DDP's all-reduce) of the gradients of two
    processes holding unequal shares (2 and 4 rows, different token counts, each trimmed to its own longest
    response), each dividing by process_normaliser(global count, 2)."""
    lp, old, adv, mask = make_batch(seed, batch=6, length=9, spread=1e-2)
    lp = lp.detach().to(dtype).requires_grad_(True)
    old = old.to(dtype)
    adv = adv.to(dtype)
    shares = [slice(0, 2), slice(2, 6)]
    total = sum(spec.count(mask[s], max_new_tokens) for s in shares)
    assert total == spec.count(mask, max_new_tokens)
    grads = []
    for s in shares:
        width = max(int(mask[s].sum(-1).max()), 1)
        loss, _ = spec(lp[s, :width], old[s, :width], adv[s], mask[s, :width],
                       normaliser=process_normaliser(total, world_size=2))
        grads.append(torch.autograd.grad(loss, lp)[0])
    ddp = (grads[0] + grads[1]) / 2
    loss, _ = spec(lp, old, adv, mask, normaliser=process_normaliser(spec.count(mask, max_new_tokens), 1))
    (one,) = torch.autograd.grad(loss, lp)
    return one, ddp, mask, shares


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_two_processes_give_the_one_process_gradient(name, dtype):
    for seed in range(5):
        one, ddp, mask, shares = _one_vs_two_processes(OBJECTIVES[name], seed, dtype=dtype)
        assert one.abs().sum() > 0
        torch.testing.assert_close(ddp, one, rtol=1e-6, atol=1e-9)
    if OBJECTIVES[name].normalise_by == "tokens":  # the shares' token counts differ, so this is not trivially 1:1
        assert mask[shares[0]].sum() * 2 != mask[shares[1]].sum()


def test_without_global_normaliser_two_processes_would_differ():
    """Why the normaliser is needed: dapo with each process's local token count is not the one-process gradient."""
    lp, old, adv, mask = make_batch(1, batch=6, length=9, spread=1e-2)
    grads = [torch.autograd.grad(dapo_loss(lp[s], old[s], adv[s], mask[s])[0], lp)[0]
             for s in (slice(0, 2), slice(2, 6))]
    (one,) = torch.autograd.grad(dapo_loss(lp, old, adv, mask)[0], lp)
    assert not torch.allclose((grads[0] + grads[1]) / 2, one)


def test_kl_to_reference_takes_the_sequence_normaliser():
    lp, ref, _, mask = make_batch(2, spread=0.1)
    assert torch.equal(kl_to_reference(lp, ref, mask, normaliser=float(lp.shape[0])), kl_to_reference(lp, ref, mask))
    grads = [torch.autograd.grad(kl_to_reference(lp[s], ref[s], mask[s], normaliser=process_normaliser(6, 2)), lp)[0]
             for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close((grads[0] + grads[1]) / 2,
                               torch.autograd.grad(kl_to_reference(lp, ref, mask), lp)[0], rtol=1e-9, atol=1e-12)


def test_an_all_empty_minibatch_has_zero_loss_with_the_global_normaliser():
    lp, old, adv, _ = make_batch(0)
    mask = torch.zeros(lp.shape, dtype=torch.bool)
    for spec in OBJECTIVES.values():
        normaliser = process_normaliser(spec.count(mask, 9), world_size=2)
        loss, metrics = spec(lp, old, adv, mask, normaliser=normaliser)
        assert loss.item() == 0 and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf])
def test_bad_normaliser_raises(bad):
    lp, old, adv, mask = make_batch(0)
    for spec in OBJECTIVES.values():
        with pytest.raises(ValueError, match="normaliser"):
            spec(lp, old, adv, mask, normaliser=bad)


# ------------------------------------------------------------------------------------ Dr.GRPO's generation budget


def test_dr_grpo_count_is_rows_times_the_generation_budget():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    assert OBJECTIVES["dr_grpo"].count(mask, max_new_tokens=16) == 4 * 16
    assert OBJECTIVES["gspo"].count(mask, max_new_tokens=16) == 4
    assert OBJECTIVES["dapo"].count(mask, max_new_tokens=16) == 6
    with pytest.raises(ValueError, match="generation budget"):
        OBJECTIVES["dr_grpo"].count(mask, max_new_tokens=2)  # a response longer than L: L is not the budget
    with pytest.raises(ValueError, match="max_new_tokens"):
        OBJECTIVES["gspo"].count(mask, max_new_tokens=0)


def test_dr_grpo_with_the_budget_does_not_depend_on_the_longest_completion():
    """Same responses padded to T=6 or T=10 (the minibatch's longest completion varies): with normaliser B·L,
    L = max_new_tokens, loss and gradient are the same; the standalone default L = T is not — that was the bug of a
    learner that did not pass the budget."""
    spec, budget = OBJECTIVES["dr_grpo"], 16
    lp, old, adv, mask = make_batch(4, batch=5, length=6, spread=0.1)
    pad = torch.full((5, 4), -2.0, dtype=lp.dtype)
    lp10 = torch.cat([lp.detach(), pad], 1).requires_grad_(True)
    old10, mask10 = torch.cat([old, pad], 1), torch.cat([mask, torch.zeros(5, 4, dtype=torch.bool)], 1)
    n6, n10 = spec.count(mask, budget), spec.count(mask10, budget)
    assert n6 == n10 == 5 * budget
    loss6, _ = spec(lp, old, adv, mask, normaliser=process_normaliser(n6))
    loss10, _ = spec(lp10, old10, adv, mask10, normaliser=process_normaliser(n10))
    assert loss6.item() == pytest.approx(loss10.item(), rel=1e-12) and loss6.item() != 0
    g6, g10 = torch.autograd.grad(loss6, lp)[0], torch.autograd.grad(loss10, lp10)[0]
    torch.testing.assert_close(g10[:, :6], g6, rtol=1e-12, atol=1e-15)
    default6, default10 = spec(lp, old, adv, mask)[0], spec(lp10, old10, adv, mask10)[0]
    assert default6.item() == pytest.approx(loss6.item() * budget / 6)  # L = T = 6
    assert default10.item() != pytest.approx(default6.item())  # L = T = 10: the loss moved with the padding
    with pytest.raises(ValueError, match="not both"):
        spec(lp, old, adv, mask, max_tokens=budget, normaliser=n6)


# ------------------------------------------------------------------------------- adding an objective: one entry


def _reinforce_loss(logprobs, old_logprobs, advantages, mask, eps_low=0.1, eps_high=0.15, *, normaliser=None):
    """Toy token-mean REINFORCE: −1/N Σ_i Σ_t Â_i log π_θ(y_{i,t}), N = Σ|y_i| unless given."""
    mask = mask.bool()
    total = torch.where(mask, logprobs * advantages[:, None], 0.0).sum()
    return -total / (float(mask.sum().clamp(min=1)) if normaliser is None else normaliser), {}


def test_a_registry_entry_is_all_an_objective_needs():
    """Register a toy objective: the config accepts it with the spec's ε and advantage scale, enforces its allowed
    scales, and the normaliser protocol makes it multi-process exact — no other code knows its name."""
    spec = Objective(loss=_reinforce_loss, eps_low=0.1, eps_high=0.15, normalise_by="tokens",
                     advantage_scale="batch", allowed_scales=("batch", "none"), summary="toy token-mean REINFORCE")
    assert "reinforce" not in OBJECTIVES
    try:
        assert register_objective("reinforce", spec) is spec
        with pytest.raises(ValueError, match="already registered"):
            register_objective("reinforce", spec)
        algo = load_config(overrides=["algorithm.loss=reinforce"]).algorithm
        assert (algo.eps_low, algo.eps_high, algo.advantage_scale) == (0.1, 0.15, "batch")
        assert load_config(overrides=["algorithm.loss=reinforce", "algorithm.advantage_scale=none"])
        with pytest.raises(ConfigError, match=r"reinforce requires algorithm\.advantage_scale 'batch' or 'none', "
                                              r"got 'group' \(toy token-mean REINFORCE\)"):
            load_config(overrides=["algorithm.loss=reinforce", "algorithm.advantage_scale=group"])
        assert default_eps("reinforce") == (0.1, 0.15)
        one, ddp, _, _ = _one_vs_two_processes(spec, seed=0)
        torch.testing.assert_close(ddp, one, rtol=1e-6, atol=1e-9)
    finally:
        OBJECTIVES.pop("reinforce", None)
    with pytest.raises(ConfigError, match=r"algorithm\.loss 'reinforce' is not one of"):
        load_config(overrides=["algorithm.loss=reinforce"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"normalise_by": "rows"}, "normalise_by"),
        ({"advantage_scale": "group", "allowed_scales": ("none",)}, "advantage_scale"),
        ({"allowed_scales": ()}, "allowed_scales"),
        ({"allowed_scales": ("group", "rank")}, "allowed_scales"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"summary": "two\nlines"}, "summary"),
    ],
)
def test_bad_objective_specs_are_refused(change, message):
    fields = {"loss": _reinforce_loss, "eps_low": 0.1, "eps_high": 0.15, "normalise_by": "tokens", "summary": "toy"}
    with pytest.raises(ValueError, match=message):
        Objective(**{**fields, **change})
    with pytest.raises(TypeError, match="Objective"):
        register_objective("toy", _reinforce_loss)


# ------------------------------------------------------------------------------------ inputs of a hand-written loop


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_on_policy_call_with_one_forward_has_the_detached_gradient(name):
    """`loss(lp, lp, ...)`, π_old the same forward: π_old is a constant of the objective, so the gradient is Eq. 10/11's
    at ratio 1. Before, gspo/grpo/dapo/dr_grpo differentiated through π_old too and the gradient was exactly 0."""
    lp, _, adv, mask = make_batch(0)
    same, _ = grad_of(OBJECTIVES[name].loss, lp, lp, adv, mask)
    detached, _ = grad_of(OBJECTIVES[name].loss, lp, lp.detach(), adv, mask)
    assert same.abs().sum() > 0
    torch.testing.assert_close(same, detached, rtol=0, atol=0)


def test_gspo_token_clips_exactly_as_gspo_at_the_clip_edge():
    """s_{i,t} = sg[s_i]·exp(lp − sg[lp]) is s_i in value only if lp − sg[lp] is formed first (exactly 0): summed as
    (log s_i + lp) − lp, float32 rounding of about ulp(|lp|) flipped the clip decisions of sequences within ~1e-6 of
    1 + ε_high, so GSPO-token and GSPO clipped different sequences."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(512, 32, generator=g) * 10
    edge = math.log1p(4e-4) + (torch.rand(512, 1, generator=g) - 0.5) * 4e-6  # log s_i within 2e-6 of the edge
    lp = (old + edge).requires_grad_(True)
    mask, adv = torch.ones_like(old, dtype=torch.bool), torch.ones(512)
    g_seq, m_seq = grad_of(gspo_loss, lp, old, adv, mask)
    g_tok, m_tok = grad_of(gspo_token_loss, lp, old, adv, mask)
    assert 0 < m_seq["clip_frac_seqs"] < 1  # the batch straddles the edge
    assert m_tok["clip_frac_seqs"] == m_seq["clip_frac_seqs"] and m_tok["clip_frac_tokens"] == m_seq["clip_frac_tokens"]
    assert torch.equal((g_tok != 0).any(-1), (g_seq != 0).any(-1))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_empty_batch_has_loss_zero(name):
    """A loop that filters out zero-advantage groups can be left with none: loss 0, not 0/0."""
    empty = torch.zeros(0, 5)
    loss, _ = OBJECTIVES[name].loss(empty, empty, torch.zeros(0), empty.bool())
    assert loss.item() == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "advantages": torch.tensor([1.0, math.nan, 0.0, 1.0, 0.0, -1.0])},
         r"advantages must be finite; \[1\] is nan"),
        (lambda a: {**a, "advantages": a["advantages"].tolist()}, "advantages must be a torch.Tensor, got list"),
        (lambda a: {**a, "logprobs": a["logprobs"].exp()}, r"logprobs must be log-probabilities \(<= 0\).*"
                                                           "probabilities or logits passed instead"),
        (lambda a: {**a, "old_logprobs": a["old_logprobs"].exp()}, r"old_logprobs must be log-probabilities"),
    ],
)
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_values_that_cannot_be_log_probabilities_or_advantages_are_refused(name, change, message):
    """A NaN advantage made a NaN loss while every metric read healthy (clip 0, ratio 1); probabilities passed for
    log-probabilities made a plausible number."""
    lp, old, adv, mask = make_batch(0)
    args = change({"logprobs": lp, "old_logprobs": old, "advantages": adv, "mask": mask})
    with pytest.raises(ValueError, match=message):
        OBJECTIVES[name].loss(**args)


def test_non_finite_logprobs_are_left_to_the_learner_and_masked_garbage_to_the_mask():
    """A non-finite π_θ (a diverged model) is not refused here: the learner skips and counts that update. A positive
    or NaN value at a padding position is never looked at."""
    lp, old, adv, mask = make_batch(0, empty_row=True)
    loss, _ = gspo_loss(lp.detach().masked_fill(~mask, 5.0), old.masked_fill(~mask, math.nan), adv, mask)
    assert math.isfinite(loss.item())
    nan_lp = lp.detach().clone()
    nan_lp[1, 0] = math.nan
    assert math.isnan(gspo_loss(nan_lp, old, adv, mask)[0].item())


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_kl_to_reference_takes_log_ref_minus_log_policy(estimator):
    """kl_to_reference's log r is log π_ref − log π_θ (GRPO's k3: r − 1 − log r is unbiased for KL(π_θ‖π_ref) on
    samples of π_θ). k3 is not symmetric in log r, so swapping the operands changes the value: check it by hand
    for one token π_θ = 1/2, π_ref = 1/4 (log r = −log 2), masked padding and a second, longer row included."""
    lp = torch.log(torch.tensor([[0.5, 0.5, 1.0], [0.5, 0.25, 0.5]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.9, 1.0], [0.5, 0.5, 0.125]], dtype=torch.float64))
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    est = {"k3": lambda x: math.expm1(x) - x, "k2": lambda x: 0.5 * x * x}[estimator]
    row0 = est(math.log(0.25 / 0.5))
    row1 = (est(0.0) + est(math.log(0.5 / 0.25)) + est(math.log(0.125 / 0.5))) / 3
    got = kl_to_reference(lp, ref, mask, estimator=estimator)
    assert got.item() == pytest.approx((row0 + row1) / 2, rel=1e-12)

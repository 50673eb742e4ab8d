"""A step's update metrics mean what their names say, over every minibatch of the step: ratio_max / ratio_min are the
largest / smallest ratio of any update, the fractions and means are over all the step's tokens, sequences or ratios
(not means of per-minibatch values), an update with no entries leaves them alone, and micro-batches change nothing.
(The same across processes: tests/test_distributed.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import DEMO, ragged_trajectory, sgd_learn, tiny_overrides
from gspo.config import load_config
from gspo.learner import LearnSettings, learn
from gspo.models import build_preset
from gspo.objectives import LOG_RATIO_CLAMP, OBJECTIVES
from gspo.tracking import read_metrics
from gspo.trainer import train

pytestmark = pytest.mark.usefixtures("test_rewards")

STEPS, MINIBATCHES = 2, 4  # the demo's 4 minibatches of 4 rows (TINY: 4 prompts × 4 completions)
RUN = ["cold_start=null", f"trainer.steps={STEPS}", "rewards.functions={varied: 1.0}", "optim.lr=3e-3",
       "optim.warmup_steps=0", "algorithm.mismatch=off", "trainer.eval_every=0", "data.eval_size=1"]
UPDATE_METRICS = ("ratio_max", "ratio_min", "ratio_mean", "clip_frac_tokens", "clip_frac_seqs", "approx_kl", "entropy",
                  "clip_frac_tokens_first_mb", "loss")


def record_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[dict]:
    """Every call of the registered objective `name`: its tensors, ε and the metrics it returned."""
    calls, inner = [], OBJECTIVES[name]

    def spy(logprobs, old_logprobs, advantages, mask, **kw):
        loss, metrics = inner.loss(logprobs, old_logprobs, advantages, mask, **kw)
        calls.append({"logprobs": logprobs.detach().clone(), "old": old_logprobs.clone(), "adv": advantages.clone(),
                      "mask": mask.bool().clone(), "eps_low": kw["eps_low"], "eps_high": kw["eps_high"],
                      "metrics": metrics})
        return loss, metrics

    monkeypatch.setitem(OBJECTIVES, name, dataclasses.replace(inner, loss=spy))
    return calls


def recomputed(call: dict, level: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From one call's tensors, independently of the objective: its valid ratios (s_i of the non-empty sequences, or
    w_{i,t} of the masked tokens), which masked tokens are clipped, and the k3 KL of each masked token."""
    mask, adv = call["mask"], call["adv"]
    log_w = torch.where(mask, call["logprobs"] - call["old"], 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if level == "sequence":
        nonempty = mask.any(-1)
        s = torch.exp(log_w.sum(-1) / mask.sum(-1).clamp(min=1))
        clipped = ((adv > 0) & (s > 1 + call["eps_high"])) | ((adv < 0) & (s < 1 - call["eps_low"]))
        ratios, clipped = s[nonempty], (clipped & nonempty)[:, None] & mask
    else:
        w, a = torch.exp(log_w), adv[:, None]
        clipped = ((a > 0) & (w > 1 + call["eps_high"])) | ((a < 0) & (w < 1 - call["eps_low"]))
        ratios, clipped = w[mask], clipped & mask
    return ratios, clipped, (torch.expm1(log_w) - log_w)[mask]


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_a_steps_metrics_are_over_all_its_minibatches(tmp_path, monkeypatch, loss):
    """The logged ratio_max / ratio_min are the extrema of every ratio the step's updates saw (not the mean of the
    minibatches' extrema), clip_frac_tokens is clipped tokens / tokens of the step, approx_kl the KL per token of the
    step, clip_frac_seqs and ratio_mean over its sequences / ratios: recomputed from the objective's inputs."""
    calls = record_calls(monkeypatch, loss)
    train(load_config(DEMO, tiny_overrides(tmp_path, *RUN, f"algorithm.loss={loss}")))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(calls) == STEPS * MINIBATCHES and len(records) == STEPS
    level = OBJECTIVES[loss].ratio_level
    spread = 0.0
    for step, record in enumerate(records):
        step_calls = calls[step * MINIBATCHES:(step + 1) * MINIBATCHES]
        parts = [recomputed(call, level) for call in step_calls]
        ratios = torch.cat([r for r, _, _ in parts])
        clipped = sum(int(c.sum()) for _, c, _ in parts)
        tokens = sum(int(call["mask"].sum()) for call in step_calls)
        seqs = [(c.any(-1), call["mask"].any(-1)) for (_, c, _), call in zip(parts, step_calls, strict=True)]
        assert record["ratio_max"] == pytest.approx(float(ratios.max()), rel=1e-6)
        assert record["ratio_min"] == pytest.approx(float(ratios.min()), rel=1e-6)
        assert record["ratio_mean"] == pytest.approx(float(ratios.double().mean()), rel=1e-6)
        assert record["clip_frac_tokens"] == pytest.approx(clipped / tokens, rel=1e-9)
        assert record["clip_frac_seqs"] == pytest.approx(
            sum(int(c.sum()) for c, _ in seqs) / sum(int(n.sum()) for _, n in seqs), rel=1e-9)
        assert record["approx_kl"] == pytest.approx(float(torch.cat([k for _, _, k in parts]).double().mean()),
                                                    rel=1e-5, abs=1e-9)
        maxima = [call["metrics"]["ratio_max"] for call in step_calls]  # the objective's, minibatch by minibatch
        assert max(maxima) == pytest.approx(float(ratios.max()), rel=1e-6)
        spread = max(spread, max(maxima) - sum(maxima) / len(maxima))
    assert spread > 1e-3  # the minibatches' maxima differ: their mean would not pass the checks above
    assert any(r["clip_frac_tokens"] > 0 for r in records)


FIRST, SECOND = torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])  # two minibatches of ragged_trajectory


def learn_with_rows_out_of_the_loss(rows: torch.Tensor, **settings) -> dict:
    """`learn` (GSPO, as OBJECTIVES holds it now) on the tiny dense preset's ragged trajectory, minibatches FIRST then
    SECOND, with `rows` left out of the loss mask (as rollout.overlong_filter leaves truncated rows): its metrics."""
    model, _ = build_preset("tiny-dense", seed=1)
    traj = ragged_trajectory(model)
    loss_mask = traj.loss_mask.clone()
    loss_mask[rows] = 0
    spec = OBJECTIVES["gspo"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return learn(model, optimizer, scheduler, dataclasses.replace(traj, loss_mask=loss_mask),
                 torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25]), [FIRST, SECOND],
                 LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, **settings))


def test_an_update_without_entries_leaves_the_metrics_alone(monkeypatch):
    """The second minibatch's rows have no response token left in the loss mask: its ratios (the objective's 1.0 over
    nothing) and its empty token counts change neither ratio_max, ratio_min nor any fraction, which are the first
    minibatch's. π_old is the rollout's (the model's log-probabilities plus noise), so the first minibatch's ratios are
    not 1 and the empty update's 1.0 would move both extrema."""
    calls = record_calls(monkeypatch, "gspo")
    metrics = learn_with_rows_out_of_the_loss(SECOND, old_logprobs="rollout", max_new_tokens=12)
    (one, empty) = (c["metrics"] for c in calls)
    assert empty["count_ratios"] == empty["count_tokens"] == 0 and empty["ratio_max"] == empty["ratio_min"] == 1.0
    assert one["ratio_min"] < 1 < one["ratio_max"] and 0 < one["clip_frac_tokens"] < 1  # so the checks can fail
    for key in ("ratio_max", "ratio_min", "ratio_mean", "clip_frac_tokens", "clip_frac_seqs", "approx_kl"):
        assert metrics[key] == one[key], key
    assert metrics["clip_frac_tokens_first_mb"] == one["clip_frac_tokens"]
    assert not any(key.startswith("count_") for key in metrics)  # the counts weigh the metrics, they are not logged


def test_a_first_minibatch_without_loss_tokens_gives_no_entropy_not_a_non_finite_one():
    """The first minibatch's rows all left the loss (as rollout.overlong_filter does when all were truncated): its
    entropy is a mean of nothing. It was logged as NaN, and the collapse guard flagged every such healthy step
    'entropy not finite' and kept it out of its baseline."""
    from gspo.guard import CollapseGuard, GuardSettings
    metrics = learn_with_rows_out_of_the_loss(FIRST)
    assert "entropy" not in metrics and metrics["skipped_updates"] == 0 and metrics["loss"] == metrics["loss"]
    assert CollapseGuard(GuardSettings()).observe(1, {**metrics, "reward_mean": 0.5}).flags == {}


def test_a_kl_term_without_its_reference_model_is_an_error():
    """learn(kl_beta > 0) without ref_model left the KL term out silently."""
    model, _ = build_preset("tiny-dense", seed=1)
    spec = OBJECTIVES["gspo"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with pytest.raises(ValueError, match=r"kl_beta=0\.1 needs the reference model"):
        learn(model, optimizer, scheduler, ragged_trajectory(model), torch.ones(8), [torch.arange(8)],
              LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, kl_beta=0.1))


def test_micro_batches_do_not_change_a_steps_metrics(tmp_path):
    """The same run with micro-batches of at most 18 tokens (rows of 8-11 tokens: one or two rows a forward) logs the
    update metrics of the run without, to the rounding by which the two runs' weights differ."""
    runs = {}
    for name, extra in (("whole", []), ("micro", ["trainer.micro_batch_tokens=18"])):
        train(load_config(DEMO, tiny_overrides(tmp_path / name, *RUN, "trainer.device=cpu", *extra)))
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["micro_batches"] for r in runs["whole"]] == [1.0] * STEPS
    assert all(r["micro_batches"] > 1 for r in runs["micro"])
    for whole, micro in zip(runs["whole"], runs["micro"], strict=True):
        for key in UPDATE_METRICS:
            assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.25, -0.25])
"""One advantage per row of `ragged_trajectory`'s 8 rows."""


def tiny_ragged() -> tuple[torch.nn.Module, object]:
    """The tiny dense preset (seed 1, as `assert_sgd_on_the_loss_by_hand` rebuilds it) and its ragged trajectory."""
    model, _ = build_preset("tiny-dense", seed=1)
    return model, ragged_trajectory(model)


def assert_sgd_on_the_loss_by_hand(delta: dict, traj, mb: torch.Tensor, loss_of, lr: float = 0.5) -> float:
    """`delta` (an `sgd_learn` update of tiny-dense, seed 1, at rate `lr`) is −lr × the gradient of
    `loss_of(log π_θ, π_old)` computed by hand on a fresh copy of that model over rows `mb`; returns the largest
    weight change (so that a caller can check the update is not vacuous)."""
    from gspo.logprobs import completion_logprobs

    model, _ = build_preset("tiny-dense", seed=1)
    model.train()
    with torch.no_grad():
        old, _ = completion_logprobs(model, *traj.rows(mb))
    lp, _ = completion_logprobs(model, *traj.rows(mb))
    loss_of(lp, old).backward()
    scale = 0.0
    for name, p in model.named_parameters():
        if p.grad is not None:
            want = -lr * p.grad
            scale = max(scale, float(want.abs().max()))
            torch.testing.assert_close(delta[name], want, rtol=1e-4, atol=1e-7)
    return scale


@pytest.mark.parametrize("loss", ["dapo", "dr_grpo", "cispo", "gspo"])
def test_learn_divides_each_update_by_its_objectives_own_count(loss):
    """One `learn` update (one minibatch, plain SGD, no clipping of the gradient norm) moves the weights exactly as
    SGD on the objective called by hand with its own normaliser: Σ|y_i| (dapo, cispo), B·L (dr_grpo, L =
    max_new_tokens), B (gspo). The other learner tests compare learn() with learn() (micro-batches, processes), so a
    learner dividing every objective by the row count B passes them all."""

    spec = OBJECTIVES[loss]
    advantages = ADVANTAGES
    mb = torch.tensor([0, 2, 4, 6, 1, 3])
    model, _ = build_preset("tiny-dense", seed=1)
    traj = ragged_trajectory(model)
    delta, _ = sgd_learn(model, traj, advantages, [mb], LearnSettings(
        objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12, grad_clip=None))
    kwargs = {"max_tokens": 12} if loss == "dr_grpo" else {}
    mask = traj.loss_mask[mb].bool()
    scale = assert_sgd_on_the_loss_by_hand(delta, traj, mb, lambda lp, old: spec.loss(
        lp, old, advantages[mb], mask, eps_low=spec.eps_low, eps_high=spec.eps_high, **kwargs)[0])
    assert scale > 1e-5  # the update is not vacuous


def test_sequences_dropped_by_the_mismatch_mask_leave_the_normaliser():
    """GSPO with a Geo-RS sequence mask (`Correction(level="sequence", bounds=...)`): rows whose engine
    log-probabilities are far from π_old leave the loss, and the update is the by-hand GSPO update over the kept
    rows divided by their number (1/B_kept, as rejection sampling would), not by every row of the minibatch."""
    import dataclasses

    from gspo.correction import Correction

    spec = OBJECTIVES["gspo"]
    advantages = ADVANTAGES
    mb = torch.arange(8)
    model, traj = tiny_ragged()
    dropped = torch.tensor([1, 4, 6])
    engine = traj.logprobs.clone()
    engine[dropped] = engine[dropped] - 2.0 * traj.completion_mask[dropped]  # ρ̄ = e² > 2: outside [0.5, 2]
    traj = dataclasses.replace(traj, logprobs=engine)
    delta, metrics = sgd_learn(model, traj, advantages, [mb], LearnSettings(
        objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12, grad_clip=None,
        mismatch=Correction(level="sequence", bounds=(0.5, 2.0))))
    assert metrics["mismatch_masked_frac"] > 0
    keep = traj.loss_mask.bool().clone()
    keep[dropped] = False
    assert_sgd_on_the_loss_by_hand(delta, traj, mb, lambda lp, old: spec.loss(
        lp, old, advantages, keep, eps_low=spec.eps_low, eps_high=spec.eps_high,
        normaliser=float(8 - len(dropped)))[0])


FIRST_PASS = [torch.tensor([0, 5]), torch.tensor([2, 7]), torch.tensor([4, 1]), torch.tensor([6, 3])]


def reused_and_full_pass(monkeypatch, make, extra=lambda model: {}) -> tuple[tuple, tuple]:
    """`sgd_learn` of GSPO over FIRST_PASS on a fresh (model, traj) from `make()`, with π_old recomputed as the learner
    does by default (the first minibatch's from its update's own forward) and with the full π_old pass, which a
    mismatch correction still runs (here one that keeps every row). Each run's metrics get "forwards": whether each
    log-prob forward kept a graph. `extra(model)`: further sgd_learn arguments (hooks on that model, ...)."""
    import gspo.learner
    from gspo.correction import Correction

    forwards = []
    inner = gspo.learner.completion_logprobs
    monkeypatch.setattr(gspo.learner, "completion_logprobs",
                        lambda *a, **k: forwards.append(torch.is_grad_enabled()) or inner(*a, **k))
    spec = OBJECTIVES["gspo"]
    runs = []
    for mismatch in (None, Correction(level="sequence", bounds=(1e-30, 1e30))):
        forwards.clear()
        model, traj = make()
        delta, metrics = sgd_learn(model, traj, ADVANTAGES, FIRST_PASS, LearnSettings(
            objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12, grad_clip=None,
            mismatch=mismatch), **extra(model))
        runs.append((delta, {**metrics, "forwards": list(forwards)}))
    return runs[0], runs[1]


def assert_same_update_and_metrics(reused: tuple, full_pass: tuple) -> None:
    """The reused run's weight update is the full pass's bit for bit (and not vacuous); so is every metric but the
    forwards and the correction's own fractions."""
    (delta, metrics), (full_delta, full) = reused, full_pass
    for key in delta:
        assert torch.equal(delta[key], full_delta[key]), key
    assert max(float(d.abs().max()) for d in delta.values()) > 1e-5  # the update is not vacuous
    for key, value in full.items():
        if key not in ("forwards", "mismatch_masked_frac", "mismatch_truncated_frac"):
            assert metrics[key] == value, key


def test_the_first_minibatchs_own_forward_is_its_pi_old(monkeypatch):
    """π_old recomputed without a mismatch correction: the first update's forward, at the same weights, is also its
    rows' π_old, so the π_old pass runs over the other minibatches only (3 no-grad forwards and 4 with gradient for
    4 minibatches, where it was 4 and 4). The update and the metrics are those of the full pass — the first
    minibatch's ratios exactly 1, nothing clipped there, the mismatch measured over every row — which a correction
    still runs (it needs every row's π_old before the first update: here one that keeps every row)."""
    reused, full_pass = reused_and_full_pass(monkeypatch, tiny_ragged)
    metrics, full = reused[1], full_pass[1]
    assert metrics["forwards"] == [False] * 3 + [True] * 4 and full["forwards"] == [False] * 4 + [True] * 4
    assert metrics["clip_frac_tokens_first_mb"] == 0.0 and metrics["clip_frac_tokens"] > 0  # later ones are off-policy
    assert_same_update_and_metrics(reused, full_pass)
    assert any(key.startswith("mismatch_") and key in metrics for key in full)


@pytest.mark.parametrize("replay", ["none", "r2"])
def test_an_moe_policys_first_minibatch_takes_its_pi_old_and_its_routing_from_its_own_forward(monkeypatch, replay):
    """The same reuse for an MoE policy, whose routing hook captures π_old's routing (over the padded layout): the
    first update's forward records its rows' π_old routing, so the π_old pass runs over the other minibatches only.
    With routing replay off or R2 (which replays that routing in the later updates), the weight update of two passes,
    the expert volatility (measured on the last update: the first minibatch's rows again) and every other metric are
    those of the full π_old pass, bit for bit; the first minibatch's ratios are exactly 1."""
    from gspo.hooks import MoERouting

    def tiny_moe() -> tuple[torch.nn.Module, object]:
        model, _ = build_preset("tiny-moe", seed=1)
        return model, ragged_trajectory(model)

    # a second pass whose last update (where volatility is measured) is on the first minibatch's rows again
    second_pass = [torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([6, 7]), torch.tensor([0, 5])]
    reused, full_pass = reused_and_full_pass(monkeypatch, tiny_moe, lambda model: {
        "hooks": [MoERouting(model, replay)], "lr": 2.0, "later_epochs": [second_pass]})
    metrics, full = reused[1], full_pass[1]
    assert metrics["forwards"] == [False] * 3 + [True] * 8 and full["forwards"] == [False] * 4 + [True] * 8
    assert metrics["clip_frac_tokens_first_mb"] == 0.0
    assert metrics["expert_volatility"] > 0  # the routers moved: the routing compared is not vacuous
    assert_same_update_and_metrics(reused, full_pass)


@pytest.mark.parametrize("loss", ["gspo", "dr_grpo"])
def test_rows_the_overlong_filter_drops_leave_the_normaliser(loss):
    """Rows left out of the loss mask though they have completion tokens (rollout.overlong_filter's truncated rows)
    are out of the sample: the update is the by-hand one over the other rows divided by their count (B_kept for
    GSPO, B_kept · L for Dr. GRPO), as the mismatch mask's dropped rows are and as a token normaliser leaves their
    tokens out. With 1/B the filter scaled each step's update by the fraction it kept."""
    import dataclasses

    spec = OBJECTIVES[loss]
    advantages = ADVANTAGES
    mb = torch.arange(8)
    model, traj = tiny_ragged()
    dropped = torch.tensor([0, 3, 5])
    keep = traj.loss_mask.clone()
    keep[dropped] = 0
    traj = dataclasses.replace(traj, loss_mask=keep)
    delta, _ = sgd_learn(model, traj, advantages, [mb], LearnSettings(
        objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=12, grad_clip=None))
    kept_rows = 8 - len(dropped)
    normaliser = float(kept_rows) if loss == "gspo" else float(kept_rows * 12)
    scale = assert_sgd_on_the_loss_by_hand(delta, traj, mb, lambda lp, old: spec.loss(
        lp, old, advantages, keep.bool(), eps_low=spec.eps_low, eps_high=spec.eps_high, normaliser=normaliser)[0])
    assert scale > 1e-5


def test_rows_out_of_the_loss_leave_the_kl_terms_normaliser_too():
    """The KL-to-reference term, like the objective, averages over the rows in the loss: rows left out of the loss
    mask though they have completion tokens (rollout.overlong_filter's truncated rows, a failed judge's under
    rewards.on_error=mask) add no KL, so dividing by every row scaled β (and the logged `kl_ref`) by the fraction of
    rows kept: here 5 of 8, kl_ref 0.0204 where the kept rows' mean is 0.0326. The update is the by-hand one of
    GSPO + β·KL, both over the 5 kept rows, and `kl_ref` is their mean per-sequence KL."""
    from gspo.logprobs import completion_logprobs
    from gspo.objectives import kl_to_reference

    spec, beta, mb = OBJECTIVES["gspo"], 0.5, torch.arange(8)
    model, traj = tiny_ragged()
    keep = traj.loss_mask.clone()
    keep[torch.tensor([0, 3, 5])] = 0
    traj = dataclasses.replace(traj, loss_mask=keep)
    reference, _ = build_preset("tiny-dense", seed=2)
    with torch.no_grad():
        ref_lp, _ = completion_logprobs(reference.eval(), *traj.rows(mb))
    delta, metrics = sgd_learn(model, traj, ADVANTAGES, [mb], LearnSettings(
        objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, kl_beta=beta, grad_clip=None),
        ref_model=reference)

    def loss_of(lp, old):
        kl = kl_to_reference(lp, ref_lp, keep.bool(), normaliser=5.0)
        loss_of.kl = float(kl.detach())
        return spec.loss(lp, old, ADVANTAGES, keep.bool(), eps_low=spec.eps_low, eps_high=spec.eps_high,
                         normaliser=5.0)[0] + beta * kl

    assert assert_sgd_on_the_loss_by_hand(delta, traj, mb, loss_of) > 1e-5
    assert loss_of.kl > 1e-3 and metrics["kl_ref"] == pytest.approx(loss_of.kl, rel=1e-5)


def test_a_row_of_no_tokens_the_batch_left_out_of_the_loss_leaves_the_normaliser():
    """An episode whose reset failed has no token; under env.on_failure=mask the batch leaves it out of the loss
    (`traj.extras["out_of_loss"]`, set by `collect`), so it leaves the objective's row count too: GSPO over the 7
    other rows divides by 7, not 8 (a failed reset scaled the step's update by 7/8). A row of no tokens the batch
    keeps is a sample of zero, counted as before."""
    spec, mb = OBJECTIVES["gspo"], torch.arange(8)
    model, traj = tiny_ragged()
    empty = traj.completion_mask.clone()
    empty[2] = 0
    traj = dataclasses.replace(traj, completion_mask=empty, loss_mask=empty.clone(),
                               logprobs=traj.logprobs * empty)
    settings = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, grad_clip=None)
    for left_out, rows in ((True, 7.0), (False, 8.0)):
        model, _ = build_preset("tiny-dense", seed=1)
        out = torch.zeros(8, dtype=torch.bool)
        out[2] = left_out
        delta, _ = sgd_learn(model, dataclasses.replace(traj, extras={"out_of_loss": out}), ADVANTAGES, [mb],
                             settings)

        def loss_of(lp, old, rows=rows):
            return spec.loss(lp, old, ADVANTAGES, empty.bool(), eps_low=spec.eps_low, eps_high=spec.eps_high,
                             normaliser=rows)[0]

        assert assert_sgd_on_the_loss_by_hand(delta, traj, mb, loss_of) > 1e-5

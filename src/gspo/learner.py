"""The learner: π_old, then one optimizer update per minibatch of the rollout batch (the paper's algorithm, §2 / §4).

    π_old      the engine's own log-probabilities (§5.4), or a no-grad forward of the trainer before the first update
               (the first minibatch's: its update's own forward, detached; the weights are the same)
    mismatch   with π_old recomputed: how far it is from the engine's μ, and optionally a correction by π_old/μ
               (TIS weights on the advantages, masks on the loss mask: `gspo.correction`)
    for each minibatch k (the batch shuffled and split; every update but the first is off-policy):
        log π_θ       a forward of the policy as it is after k updates
        loss          the objective (e.g. GSPO, Eq. 5 with the sequence ratio of Eq. 7), normalised by its global count
        step          backward, grad-norm clip, AdamW; skipped on every process if anything is non-finite
                      (under float16 compute the loss is scaled for the backward: `gspo.optim.loss_scaler`)

A minibatch larger than `micro_batch_tokens` runs as micro-batches, each a forward and a backward whose gradients add
up to the minibatch's: every objective is a sum over rows divided by a normaliser counted on the whole minibatch
(what lets processes split a minibatch too), so only the activations of one micro-batch are alive at a time. π_old,
the reference model and every update of a minibatch use the same micro-batches (a row's logits depend in the last
bits on the rows that share its forward: the on-policy minibatch's ratios stay exactly 1).

Everything else (MoE routing capture and replay, precision diagnostics) is a hook (`gspo.hooks`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gspo.correction import Correction, apply_correction, mismatch_metrics
from gspo.hooks import LearnHook
from gspo.logprobs import completion_logprobs, fused_head
from gspo.models import compiled_layers
from gspo.objectives import COUNT_KEYS, METRIC_AGGREGATION, Metrics, Objective, kl_to_reference, process_normaliser
from gspo.optim import overflowed, settle_scale, step_schedule
from gspo.parallel import ProcessGroup, autocast, gradient_sync, whole
from gspo.trajectory import Trajectory

__all__ = ["LearnSettings", "learn", "micro_batches"]


@dataclass(frozen=True)
class LearnSettings:
    """How the learner uses one rollout batch (from the config's algorithm, rollout and optim sections)."""

    objective: Objective
    eps_low: float
    eps_high: float
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    temperature: float = 1.0  # the sampling temperature: log π_θ is taken of logits / temperature, as sampled
    max_new_tokens: int = 16  # the generation budget (Dr.GRPO's constant L)
    kl_beta: float = 0.0
    kl_estimator: str = "k3"  # gspo.objectives.KL_ESTIMATORS
    grad_clip: float | None = 1.0
    mixed_precision: str | None = None
    mismatch: Correction | None = None  # the train–inference mismatch correction (None: none), for recomputed π_old
    micro_batch_tokens: int | None = None  # padded tokens per forward/backward (None: a minibatch share at once)
    compile: bool = False  # decoder layers and the head's float32 passes compiled for π_old and the updates
    # (`compiled_layers`, `fused_head`)


def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int | None) -> list[torch.Tensor]:
    """`rows` (row indices of a minibatch share) split into micro-batches of at most `budget` padded tokens: B rows
    cost B × their longest `lengths[row]`. Rows are taken longest first, so rows of similar length share a forward; a
    row longer than the budget is a micro-batch of its own. `budget` None: one micro-batch, `rows` as given."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"micro_batch_tokens must be an int >= 1 or None, got {budget!r}")
    if budget is None or len(rows) == 0:
        return [rows]
    lengths = lengths.to(rows.device)[rows]
    order = torch.argsort(lengths, descending=True, stable=True)
    micros, current, width = [], [], 0
    for row, length in zip(rows[order].tolist(), lengths[order].tolist(), strict=True):
        if current and (len(current) + 1) * width > budget:
            micros.append(current)
            current = []
        if not current:  # a micro-batch's first row is its longest: its width
            width = length
        current.append(row)
    micros.append(current)
    return [torch.tensor(m, dtype=rows.dtype, device=rows.device) for m in micros]


def _equalise(micros: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`micros` made `count` long (the most any process runs for this minibatch: under FSDP every forward is a
    collective) by halving the micro-batch with the most rows. The processes' shares have equal row counts (the
    trainer's split), so `count` never exceeds this share's rows."""
    micros = list(micros)
    while len(micros) < count:
        i = max(range(len(micros)), key=lambda j: len(micros[j]))
        if len(micros[i]) < 2:
            raise ValueError(f"a minibatch share of {sum(map(len, micros))} rows cannot run as {count} micro-batches: "
                             "every process needs a share of as many rows")
        half = (len(micros[i]) + 1) // 2
        micros[i:i + 1] = [micros[i][:half], micros[i][half:]]
    return micros


_NO_EXTREMUM = {"max": -math.inf, "min": math.inf}  # the max / min of no entries (yet)


def _extremum(how: str, a: float, b: float) -> float:
    """max(a, b) ("max") or min(a, b) ("min"); NaN if either is (Python's max and min may drop a NaN)."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b) if how == "max" else min(a, b)


class _StepMetrics:
    """A step's update metrics, accumulated update by update on each process, then combined over the processes: the
    same whatever the number of processes and micro-batches, and meaning what their names say.

        counted    a mean over entries, given with their count: the objective's (`METRIC_AGGREGATION`: fractions and
                   means over tokens, sequences or ratios) and the first update's `entropy`; the step's value is
                   Σ mean·count / Σ count over every update and process, the mean over all their entries
        extremum   `ratio_max` / `ratio_min`: the max / min over every update and process that has entries
        averaged   `loss`, `kl_ref` and what else the objective gives without a count: averaged over the updates, then
                   over the processes (a process's loss is W × its share's sum / the minibatch's count, so the mean
                   over the W processes is the minibatch's loss); a hook's update metrics: as the hook gives them,
                   averaged over the processes

    Over no entries at all, a counted metric or an extremum is the value the objective gives for none; one given as
    None there (`entropy`: no mean of nothing, which the collapse guard would read as a numerical failure) is left
    out of the step's metrics."""

    def __init__(self, updates: int) -> None:
        self.updates = updates
        self.averaged: dict[str, float] = {}
        self.totals: dict[str, float] = {}  # Σ mean·count
        self.counts: dict[str, float] = {}  # Σ count
        self.extrema: dict[str, dict[str, float]] = {"max": {}, "min": {}}
        self.empty: dict[str, float] = {}  # the value given over no entries

    def add(self, key: str, value: float | None, how: str = "mean", count: float = 1.0) -> None:
        """`value`, the mean ("mean"), max or min ("max", "min") of `count` entries (None only for none)."""
        if count == 0:
            self.empty[key] = value
        if how == "mean":
            self.totals[key] = self.totals.get(key, 0.0) + (value * count if count else 0.0)
            self.counts[key] = self.counts.get(key, 0.0) + count
        else:
            seen = self.extrema[how].get(key, _NO_EXTREMUM[how])
            self.extrema[how][key] = _extremum(how, seen, value) if count else seen

    def update(self, metrics: Metrics) -> None:
        """One update's metrics: the objective's (with their counts), `loss`, `kl_ref`."""
        for key, value in metrics.items():
            if key in METRIC_AGGREGATION:
                how, count_key = METRIC_AGGREGATION[key]
                self.add(key, value, how, metrics.get(count_key, 1.0))
            elif key not in COUNT_KEYS:
                self.averaged[key] = self.averaged.get(key, 0.0) + value / self.updates

    def combine(self, group: ProcessGroup) -> dict[str, float]:
        """The step's metrics, from every process's: sums and counts summed, extrema by max / min, the rest averaged."""
        sums = {**{f"total:{k}": v for k, v in self.totals.items()},
                **{f"count:{k}": v for k, v in self.counts.items()}}
        reduced = group.reduce_metrics_by_op({"mean": self.averaged, "sum": sums, **self.extrema})
        metrics, sums = reduced["mean"], reduced["sum"]
        metrics.update({k: sums[f"total:{k}"] / sums[f"count:{k}"] if sums[f"count:{k}"] else self.empty[k]
                        for k in self.totals})
        for how in self.extrema:
            metrics.update({k: self.empty.get(k, v) if v == _NO_EXTREMUM[how] else v for k, v in reduced[how].items()})
        return {k: v for k, v in metrics.items() if v is not None}


def learn(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, traj: Trajectory, advantages: torch.Tensor,
          minibatches: Sequence[torch.Tensor], settings: LearnSettings, group: ProcessGroup | None = None,
          ref_model: nn.Module | None = None, hooks: Sequence[LearnHook] = (),
          later_epochs: Sequence[Sequence[torch.Tensor]] = (),
          scaler: torch.amp.GradScaler | None = None) -> dict[str, float]:
    """One update per minibatch of `traj` (each process: its share of each minibatch's row indices), then one per
    minibatch of each of `later_epochs` (further passes over the same rows, each split its own way, against the same
    π_old); returns the step's metrics: the objective's metrics over the entries of every update and process (e.g.
    clip_frac_tokens: clipped tokens / tokens, ratio_max: the largest ratio; `_StepMetrics`), `loss` (averaged over
    the updates), `entropy` and `clip_frac_tokens_first_mb` (over the first update's tokens), `grad_norm`,
    `skipped_updates`, `lr` (the mean of the rates the updates used: the scheduler's rate after them is the next
    step's), `micro_batches` (forwards per update, 1 without a budget), the hooks' metrics; with π_old
    recomputed, the train–inference mismatch (`gspo.correction.mismatch_metrics`) and what its correction masked and
    truncated (0 when off).

    `scaler` (`gspo.optim.loss_scaler`, for float16 compute): each backward is of the loss times its scale, the
    gradients are unscaled before clipping, and the scale is settled after every update (`gspo.optim.settle_scale`).
    An update whose loss is finite but whose scaled gradient is not, under a scale above 1, overflowed: it is skipped
    and the scale halved, as loss scaling does, and counted in `overflow_updates` (with `loss_scale`, the scale after
    the step), not in `skipped_updates`: the run is not failing. Any other non-finite update is a failure: skipped,
    counted in `skipped_updates`, the scale kept."""
    s, group = settings, group or ProcessGroup()
    if s.kl_beta > 0 and ref_model is None:  # the KL term would silently be left out
        raise ValueError(f"learn: kl_beta={s.kl_beta:g} needs the reference model (ref_model=)")
    mask = traj.loss_mask.bool()
    per_pass = sum(len(mb) for mb in minibatches)
    for e, later in enumerate(later_epochs, start=2):  # under torchrun a process's rows differ between passes
        rows = torch.cat(list(later))
        if len(rows) != per_pass or len(rows.unique()) != len(rows):
            raise ValueError(f"learn: pass {e} (later_epochs[{e - 2}]) must take {per_pass} distinct rows, as the "
                             f"first pass's minibatches do, got {len(rows)} ({len(rows.unique())} distinct)")
    updates = [*minibatches, *(mb for later in later_epochs for mb in later)]  # every update's share, in order
    model.train()
    for hook in hooks:
        hook.start(traj)

    def amp() -> contextlib.AbstractContextManager:
        return autocast(group, s.mixed_precision)

    def forwards(enter) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for hook in hooks:
            stack.enter_context(enter(hook))
        stack.enter_context(amp())
        stack.enter_context(compiled_layers(model, s.compile))
        stack.enter_context(fused_head(s.compile))
        return stack

    # The micro-batches of each minibatch share, the same for π_old, the reference and every update; as many on every
    # process (under FSDP each forward is a collective). Costed on the layout the forwards will see.
    micros_of = [[mb] for mb in updates]
    if s.micro_batch_tokens is not None:
        padded = any(h.keeps_layout("old") or h.keeps_layout("update") for h in hooks)
        lengths = (torch.full((len(traj),), traj.prompt_ids.shape[1] + traj.completion_ids.shape[1]) if padded
                   else traj.prompt_mask.sum(-1) + traj.completion_mask.sum(-1))
        split = [micro_batches(mb, lengths, s.micro_batch_tokens) for mb in updates]
        counts = group.all_max([len(m) for m in split])
        micros_of = [_equalise(m, c) for m, c in zip(split, counts, strict=True)]

    # π_old. The forward runs on the same row groups as the updates: a row's logits depend in the last bits on which
    # rows share its batch (matmul blocking, MoE expert grouping), and with other groups the on-policy first minibatch
    # would see ratios of 1 ± 1e-7 instead of exactly 1. The first minibatch's π_old is its first update's own forward
    # (the weights are the same), detached, unless a mismatch correction needs every row's π_old before that update:
    # one forward of the rollout batch's four fewer, and ratios exactly 1 on any device (a no-grad forward may take
    # other kernels than one that keeps its graph). Hooks capture that forward's π_old state (MoE routing) in
    # `first_update_forward`, over π_old's layout.
    old_layout = any(h.keeps_layout("old") for h in hooks)
    reuse = s.old_logprobs == "recompute" and s.mismatch is None
    if s.old_logprobs == "rollout":
        old_logprobs = traj.logprobs
    else:
        old_logprobs = torch.zeros_like(traj.logprobs)
        with torch.no_grad():  # the first pass: every row once
            for r in (r for micros in micros_of[int(reuse):len(minibatches)] for r in micros):
                with forwards(lambda h, r=r: h.old_forward(r)):
                    old_logprobs[r] = completion_logprobs(model, *traj.rows(r), temperature=s.temperature,
                                                          trim_padding=not old_layout)[0]

    # Train–inference mismatch, ρ = π_old/μ on the whole batch (the same on every process). Off, nothing the loss
    # sees changes; on, TIS scales the advantages and the masks shrink the loss mask, and a normalising count leaves
    # out the sequences the correction dropped, as rejection sampling would (`counted`, below). The KL-to-reference
    # term and the entropy keep the full mask: they are regularisers and diagnostics, not importance-sampled estimates.
    loss_adv, loss_mask, batch_metrics = advantages, mask, {}

    def old_done() -> None:
        """Once every row's π_old is known (after the π_old pass, or with `reuse` after the first update's forwards):
        the processes' rows merged, the hooks told, the mismatch measured (and corrected)."""
        nonlocal old_logprobs, loss_adv, loss_mask, batch_metrics
        if s.old_logprobs == "recompute":
            old_logprobs = group.merge_rows(old_logprobs, minibatches)
            batch_metrics = mismatch_metrics(old_logprobs, traj.logprobs, mask)
            batch_metrics.update(mismatch_masked_frac=0.0, mismatch_truncated_frac=0.0)
            if s.mismatch is not None:
                loss_adv, loss_mask, fracs = apply_correction(s.mismatch, old_logprobs, traj.logprobs, advantages, mask)
                batch_metrics.update(fracs)
        for hook in hooks:
            hook.old_done(group, minibatches)

    if not reuse:
        old_done()
    # the rows in the objective: those with a token in the loss, and those that never had one (a sample of zero) unless
    # the batch left them out of the loss (`traj.extras["out_of_loss"]`: an episode whose reset failed, under
    # env.on_failure=mask, has no token to mask); a row dropped by the correction or by rollout.overlong_filter is out
    # of the sample, not a sample of zero (as a token normaliser leaves its tokens out). (With `reuse` old_done changes
    # no mask: there is no correction.)
    no_tokens = ~traj.completion_mask.bool().any(-1)
    if (out_of_loss := traj.extras.get("out_of_loss")) is not None:
        no_tokens &= ~out_of_loss.to(no_tokens.device)
    counted = loss_mask.any(-1) | no_tokens
    # the rows the KL-to-reference term averages over, the same way but by the full mask (a regulariser: the
    # correction's drops keep their KL; the rows out of the loss before the learner, e.g. filtered, add none): every
    # update's count read to the host at once (one device sync per step, not one per minibatch)
    kl_counted = mask.any(-1) | no_tokens
    kl_rows = torch.stack([kl_counted[mb].sum() for mb in updates]).tolist() if updates else []

    grad_norms, rates, skipped, overflows, n = [], [], 0, 0, len(updates)
    step_metrics = _StepMetrics(n)
    logprobs = torch.zeros_like(old_logprobs)  # π_θ of this process's rows, filled micro-batch by micro-batch
    entropy = torch.zeros_like(old_logprobs)
    with_ref = ref_model is not None and s.kl_beta > 0
    ref_logprobs = torch.zeros_like(old_logprobs) if with_ref else None
    for k, (mb, micros) in enumerate(zip(updates, micros_of, strict=True)):
        first_old = reuse and k == 0  # this update's forward is its rows' π_old forward too
        trim = not (old_layout if first_old else any(h.keeps_layout("update") for h in hooks))
        # normalised by the count over every process's share: N processes' averaged gradients = one process's
        count_mask = loss_mask[mb][counted[mb]]
        count, rows = group.all_sum([s.objective.count(count_mask, s.max_new_tokens), float(kl_rows[k])])
        normaliser = process_normaliser(count, group.world_size)
        for j, r in enumerate(micros):
            with gradient_sync(model, j == len(micros) - 1):  # DDP: one all-reduce, after the last backward
                with forwards(lambda h, k=k, r=r, first_old=first_old: h.first_update_forward(r, n == 1)
                              if first_old else h.update_forward(k, r, k == n - 1)):
                    lp, ent = completion_logprobs(model, *traj.rows(r), temperature=s.temperature,
                                                  with_entropy=k == 0, trim_padding=trim)
                if first_old:
                    old_logprobs[r] = lp.detach()
                loss, m = s.objective.loss(lp, old_logprobs[r], loss_adv[r], loss_mask[r], eps_low=s.eps_low,
                                           eps_high=s.eps_high, normaliser=normaliser)
                total = loss
                if with_ref:
                    with torch.no_grad(), amp():
                        ref_lp, _ = completion_logprobs(ref_model, *traj.rows(r), temperature=s.temperature,
                                                        trim_padding=True)
                    total = total + s.kl_beta * kl_to_reference(
                        lp, ref_lp, mask[r], normaliser=process_normaliser(rows, group.world_size),
                        estimator=s.kl_estimator)
                (total if scaler is None else scaler.scale(total)).backward()
            logprobs[r] = lp.detach()
            if ent is not None:
                entropy[r] = ent
            if with_ref:
                ref_logprobs[r] = ref_lp
        if first_old:
            old_done()
        if len(micros) > 1:  # the minibatch's metrics and loss value, as one forward would have computed them
            with torch.no_grad():
                loss, m = s.objective.loss(logprobs[mb], old_logprobs[mb], loss_adv[mb], loss_mask[mb],
                                           eps_low=s.eps_low, eps_high=s.eps_high, normaliser=normaliser)
        if with_ref:
            kl = kl_to_reference(logprobs[mb], ref_logprobs[mb], mask[mb],
                                 normaliser=process_normaliser(rows, group.world_size), estimator=s.kl_estimator)
            loss = loss.detach() + s.kl_beta * kl
            m["kl_ref"] = float(kl)
        for hook in hooks:
            step_metrics.averaged.update(hook.update_metrics(k, mb, logprobs[mb], old_logprobs))
        if k == 0:  # the on-policy minibatch: when π_old is recomputed its ratios are exactly 1 and nothing is clipped
            first = entropy[mb][mask[mb]]  # none on any process (e.g. all truncated under overlong_filter): no value
            step_metrics.add("entropy", float(first.mean()) if first.numel() else None, count=first.numel())
            step_metrics.add("clip_frac_tokens_first_mb", m["clip_frac_tokens"], count=m.get("count_tokens", 1.0))
        if scaler is not None:  # the gradients as they are, in float32 (a non-finite one marks an overflow)
            scaler.unscale_(optimizer)
        # under FSDP2 a DTensor; with torch 2.9 a partial norm, whose float() is this process's part (clipping itself
        # used the whole norm)
        grad_norm = whole(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip or float("inf")))
        rates.append(optimizer.param_groups[0]["lr"])  # this update's rate (the scheduler then sets the next one's)
        failed = False
        if group.all_finite(loss.detach(), grad_norm):  # every process steps, or none does
            optimizer.step()
            grad_norms.append(float(grad_norm))
        elif overflowed(scaler, scaler is not None and group.all_finite(loss.detach())):
            overflows += 1  # the scale was too large: settle_scale halves it
        else:  # never let a non-finite update touch the weights
            skipped, failed = skipped + 1, True
        if scaler is not None:
            settle_scale(scaler, failed)
        step_schedule(scheduler)
        optimizer.zero_grad(set_to_none=True)
        m["loss"] = float(loss.detach())
        step_metrics.update(m)
    metrics = step_metrics.combine(group)
    # no update applied: NaN where one was skipped as non-finite (a failure the guard sees); where every one overflowed
    # a float16 loss scale, no gradient norm to give (left out, as the scale halves: not a failure)
    if grad_norms or skipped:
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
    metrics.update(skipped_updates=float(skipped), lr=sum(rates) / n,
                   micro_batches=sum(map(len, micros_of)) / n, **batch_metrics)
    if scaler is not None:
        scale = float(scaler.get_scale())
        spread = group.reduce_metrics_by_op({"max": {"scale": scale}, "min": {"scale": scale}})
        if spread["max"]["scale"] != spread["min"]["scale"]:  # each process would scale its gradients differently
            raise RuntimeError(f"the float16 loss scale differs between processes ({spread['min']['scale']:g} to "
                               f"{spread['max']['scale']:g}): their overflow checks disagreed")
        metrics.update(overflow_updates=float(overflows), loss_scale=scale)
    for hook in hooks:
        metrics.update(hook.batch_metrics(traj, old_logprobs))
    return metrics

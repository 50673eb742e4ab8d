"""The learner: π_old, then one optimizer update per minibatch of the rollout batch (the paper's algorithm, §2 / §4).

    π_old      the engine's own log-probabilities (§5.4), or a no-grad forward of the trainer before the first update
    mismatch   with π_old recomputed: how far it is from the engine's μ, and optionally a correction by π_old/μ
               (TIS weights on the advantages, masks on the loss mask: `gspo.correction`)
    for each minibatch k (the batch shuffled and split; every update but the first is off-policy):
        log π_θ       a forward of the policy as it is after k updates
        loss          the objective (e.g. GSPO, Eq. 5 with the sequence ratio of Eq. 7), normalised by its global count
        step          backward, grad-norm clip, AdamW; skipped on every process if anything is non-finite

Everything else (MoE routing capture and replay, precision diagnostics) is a hook (`gspo.hooks`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gspo.correction import Correction, apply_correction, mismatch_metrics
from gspo.hooks import LearnHook
from gspo.logprobs import completion_logprobs
from gspo.objectives import Objective, kl_to_reference, process_normaliser
from gspo.parallel import ProcessGroup, autocast
from gspo.trajectory import Trajectory

__all__ = ["LearnSettings", "learn"]


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
    grad_clip: float | None = 1.0
    mixed_precision: str | None = None
    mismatch: Correction | None = None  # the train–inference mismatch correction (None: none), for recomputed π_old


def learn(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, traj: Trajectory, advantages: torch.Tensor,
          minibatches: Sequence[torch.Tensor], settings: LearnSettings, group: ProcessGroup | None = None,
          ref_model: nn.Module | None = None, hooks: Sequence[LearnHook] = ()) -> dict[str, float]:
    """One update per minibatch of `traj` (each process: its share of each minibatch's row indices); returns the
    step's metrics: the objective's metrics averaged over the updates (and the processes), `loss`, `entropy` (first
    update), `clip_frac_tokens_first_mb`, `grad_norm`, `skipped_updates`, `lr`, the hooks' metrics; with π_old
    recomputed, the train–inference mismatch (`gspo.correction.mismatch_metrics`) and what its correction masked and
    truncated (0 when off)."""
    s, group = settings, group or ProcessGroup()
    mask = traj.loss_mask.bool()
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
        return stack

    # π_old. The forward runs on the same row groups as the updates: a row's logits depend in the last bits on which
    # rows share its batch (matmul blocking, MoE expert grouping), and with other groups the on-policy first minibatch
    # would see ratios of 1 ± 1e-7 instead of exactly 1.
    if s.old_logprobs == "rollout":
        old_logprobs = traj.logprobs
    else:
        old_logprobs = torch.zeros_like(traj.logprobs)
        trim = not any(h.keeps_layout("old") for h in hooks)
        with torch.no_grad():
            for mb in minibatches:
                with forwards(lambda h, mb=mb: h.old_forward(mb)):
                    old_logprobs[mb] = completion_logprobs(model, *traj.rows(mb), temperature=s.temperature,
                                                           trim_padding=trim)[0]
        old_logprobs = group.merge_rows(old_logprobs, minibatches)
    for hook in hooks:
        hook.old_done(group, minibatches)

    # Train–inference mismatch, ρ = π_old/μ on the whole batch (the same on every process). Off, nothing the loss
    # sees changes; on, TIS scales the advantages and the masks shrink the loss mask, and a normalising count leaves
    # out the sequences the correction dropped (`kept`), as rejection sampling would. The KL-to-reference term and the
    # entropy keep the full mask: they are regularisers and diagnostics, not importance-sampled estimates.
    loss_adv, loss_mask, kept, batch_metrics = advantages, mask, None, {}
    if s.old_logprobs == "recompute":
        batch_metrics = mismatch_metrics(old_logprobs, traj.logprobs, mask)
        batch_metrics.update(mismatch_masked_frac=0.0, mismatch_truncated_frac=0.0)
        if s.mismatch is not None:
            loss_adv, loss_mask, fracs = apply_correction(s.mismatch, old_logprobs, traj.logprobs, advantages, mask)
            kept = loss_mask.any(-1) | ~mask.any(-1)
            batch_metrics.update(fracs)

    sums: dict[str, float] = {}
    grad_norms, skipped, n = [], 0, len(minibatches)
    for k, mb in enumerate(minibatches):
        trim = not any(h.keeps_layout("update") for h in hooks)
        with forwards(lambda h, k=k, mb=mb: h.update_forward(k, mb, k == n - 1)):
            logprobs, entropy = completion_logprobs(model, *traj.rows(mb), temperature=s.temperature,
                                                    with_entropy=k == 0, trim_padding=trim)
        for hook in hooks:
            sums.update(hook.update_metrics(k, mb, logprobs, old_logprobs))
        # normalised by the count over every process's share: N processes' averaged gradients = one process's
        count_mask = mask[mb] if kept is None else loss_mask[mb][kept[mb]]
        count, rows = group.all_sum([s.objective.count(count_mask, s.max_new_tokens), float(len(mb))])
        loss, m = s.objective.loss(logprobs, old_logprobs[mb], loss_adv[mb], loss_mask[mb], eps_low=s.eps_low,
                                   eps_high=s.eps_high, normaliser=process_normaliser(count, group.world_size))
        if ref_model is not None and s.kl_beta > 0:
            with torch.no_grad(), amp():
                ref_logprobs, _ = completion_logprobs(ref_model, *traj.rows(mb), temperature=s.temperature,
                                                      trim_padding=True)
            kl = kl_to_reference(logprobs, ref_logprobs, mask[mb],
                                 normaliser=process_normaliser(rows, group.world_size))
            loss = loss + s.kl_beta * kl
            m["kl_ref"] = float(kl.detach())
        if entropy is not None:
            m["entropy"] = float(entropy[mask[mb]].mean())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip if s.grad_clip else float("inf"))
        if group.all_finite(loss, grad_norm):  # every process steps, or none does
            optimizer.step()
            grad_norms.append(float(grad_norm))
        else:  # never let a non-finite update touch the weights
            skipped += 1
        with warnings.catch_warnings():  # torch warns when the schedule steps before the (skipped) first update
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        m["loss"] = float(loss.detach())
        for key, v in m.items():
            sums[key] = sums.get(key, 0.0) + v / n
        if k == 0:  # the on-policy minibatch: when π_old is recomputed its ratios are exactly 1 and nothing is clipped
            sums["clip_frac_tokens_first_mb"] = m["clip_frac_tokens"]
    if "entropy" in sums:
        sums["entropy"] *= n  # logged from the first minibatch only
    metrics = group.mean_metrics(sums)
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
                   skipped_updates=float(skipped), lr=scheduler.get_last_lr()[0], **batch_metrics)
    for hook in hooks:
        metrics.update(hook.batch_metrics(traj, old_logprobs))
    return metrics

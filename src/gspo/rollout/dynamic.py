"""DAPO's dynamic sampling (`rollout.dynamic_sampling`): a group whose G rewards are all equal has advantage 0 and
teaches nothing, so further prompts are sampled until P groups with varied rewards are at hand.

One function serves both collection paths: the synchronous `gspo.trainer.collect` (its `sample` generates on every
process and gathers) and each asynchronous rollout worker (`gspo.rollout.workers`), which fills its batch the same
way before sending it. Round r ≥ 1 of step (or batch) i samples `schedule.refill_prompts(i, r, ...)`: the next rows of
a permutation of those step i's first round did not sample, a pure function of the run seed, i and the earlier rounds'
sizes, so a resumed run samples what an uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo.advantages import zero_variance_groups
from gspo.rewards import merge_reward_stats
from gspo.schedule import prompt_indices, refill_prompts
from gspo.trajectory import Trajectory, concat

if TYPE_CHECKING:
    from gspo.config import RolloutConfig


class NoSignal(RuntimeError):
    """Every group sampled in every round had equal rewards: there is nothing to train on."""


@dataclass
class Scored:
    """One round of sampling: P' prompts × G completions, their rewards and reward statistics."""

    traj: Trajectory
    rewards: torch.Tensor  # [P'·G] weighted reward sums
    stats: dict[str, float]  # per-function means (`reward/...`) and counts (failures, `solved`)
    seconds: float


@dataclass
class Sampled:
    """Every completion sampled for a step (all of dynamic sampling's rounds), as the step's reward metrics describe
    it (`reward_mean`, `accuracy`, `zero_variance_groups`: what was sampled, not only what was kept), over the
    completions that count: one a reward call failed on under `rewards.on_error: mask`, or whose environment failed
    under `env.on_failure: mask`, has no score (its 0 would pull the mean down)."""

    rewards: torch.Tensor  # [M]
    counted: torch.Tensor  # [M] bool (`gspo.rewards.counted_completions`)
    solved: torch.Tensor | None  # [M] bool, rewards.accuracy_reward's verdicts (`traj.extras["solved"]`); None without

    @classmethod
    def of(cls, parts: Sequence[Scored], counted: Callable[[Trajectory], torch.Tensor | None] | None = None
           ) -> Sampled:
        """The completions of `parts` (rounds in order); `counted(traj)` as `keep_informative` takes it."""
        rewards = torch.cat([part.rewards for part in parts])
        masks = [None if counted is None else counted(part.traj) for part in parts]
        ok = torch.cat([torch.ones(len(part.rewards), dtype=torch.bool) if m is None else m.cpu()
                        for part, m in zip(parts, masks, strict=True)]).to(rewards.device)
        verdicts = [part.traj.extras.get("solved") for part in parts]
        solved = None if any(v is None for v in verdicts) else torch.cat([v.bool().cpu() for v in verdicts])
        return cls(rewards, ok, None if solved is None else solved.to(rewards.device))

    def to(self, device: torch.device | str) -> Sampled:
        return Sampled(self.rewards.to(device), self.counted.to(device),
                       None if self.solved is None else self.solved.to(device))

    def metrics(self, group_size: int) -> dict[str, float]:
        """`reward_mean`, `reward_std`, `accuracy` (solved as rewards.accuracy_reward says) and
        `zero_variance_groups` (the fraction of groups without reward variance among their counted members) over
        the counted completions (NaN for a mean over none)."""
        values = self.rewards[self.counted]
        out = {"reward_mean": float(values.mean()) if len(values) else math.nan,
               "reward_std": float(values.std()) if len(values) > 1 else math.nan}
        if self.solved is not None:
            out["accuracy"] = float(self.solved[self.counted].float().mean()) if len(values) else math.nan
        out["zero_variance_groups"] = float(zero_variance_groups(self.rewards, group_size,
                                                                 valid=self.counted).float().mean())
        return out


def keep_informative(step: int, train_rows: list[dict], first: Scored,
                     sample: Callable[[list[dict], list[int]], Scored], ro: RolloutConfig, seed: int, *, pad_id: int,
                     world_size: int = 1, counted: Callable[[Trajectory], torch.Tensor | None] | None = None,
                     ) -> tuple[Scored, Sampled]:
    """While fewer than P (`ro.prompts_per_step`) of the groups sampled so far have varied rewards, `sample` another
    round (as many prompts as the informative rate so far says are needed, at most 4P, a multiple of `world_size` so
    that every process gets whole groups), up to `ro.dynamic_max_rounds` rounds in all; then keep the first P
    informative groups, topped up with constant ones (counted: `dynamic_filled_groups`) if the rounds ran out.
    `counted(traj)`: the completions whose rewards count ([N] bool, None: all; `gspo.rewards.counted_completions`),
    so that a group varied only by a completion that does not count (a failed judge, a failed environment) is not
    taken for an informative one.

    Returns the kept batch (its stats: the rounds' counts summed, per-function means weighted by completions, and
    `dynamic_rounds` / `dynamic_sampled_prompts` / `dynamic_filled_groups`) and every sampled completion (`Sampled`:
    the step's reward metrics describe what was sampled, not what was kept). Raises NoSignal when no group was
    informative."""
    p, g = ro.prompts_per_step, ro.group_size
    own = prompt_indices(step, p, len(train_rows), seed)  # the first round's rows: refills draw from the others
    parts = [first]

    def varied(part: Scored) -> torch.Tensor:
        return ~zero_variance_groups(part.rewards, g, valid=None if counted is None else counted(part.traj))

    informative = [varied(first)]
    kept, sampled = int(informative[0].sum()), len(first.rewards) // g
    while kept < p and len(parts) < ro.dynamic_max_rounds:
        n = min(math.ceil((p - kept) * sampled / max(kept, sampled / 8)), 4 * p)
        n = math.ceil(n / world_size) * world_size
        rows, seeds = refill_prompts(step, len(parts), train_rows, n, seed, start=sampled - len(own), exclude=own)
        parts.append(sample(rows, seeds))
        informative.append(varied(parts[-1]))
        kept, sampled = kept + int(informative[-1].sum()), sampled + n
    if kept == 0:
        raise NoSignal(
            f"step {step + 1}: every one of the {sampled} groups sampled in {len(parts)} rounds (rollout."
            f"dynamic_max_rounds) had equal rewards for all its {g} completions (the first: all "
            f"{float(first.rewards[0]):g}), so dynamic sampling has nothing to train on: the task is too hard or too "
            "easy for the policy, or the reward does not depend on the completion. Check the rewards, or set "
            "rollout.dynamic_sampling=false")
    flags = torch.cat(informative).cpu()
    chosen = torch.cat([flags.nonzero().flatten(), (~flags).nonzero().flatten()])[:p]  # informative first, in order
    every = Sampled.of(parts, counted)
    rows = (chosen[:, None] * g + torch.arange(g)).flatten().to(every.rewards.device)
    stats = merge_reward_stats([(part.stats, len(part.rewards)) for part in parts])  # row-weighted means
    stats.update(dynamic_rounds=float(len(parts)), dynamic_sampled_prompts=float(sampled),
                 dynamic_filled_groups=float(max(p - kept, 0)))
    traj = concat([part.traj for part in parts], pad_id=pad_id).take(rows)
    return Scored(traj, every.rewards[rows], stats, sum(part.seconds for part in parts)), every

"""The rollout-engine protocol: everything the trainer asks of an engine (the built-in sampler, vLLM in process, a vLLM
server, or your own), so that a new engine implements this and touches no trainer code.

The trainer's use of an engine, once per RL step:

    traj = engine.generate(prompts, group_size, seeds)        # collect: a `Trajectory`, versions = engine.version
    engine.release()                                          # learn: the engine frees what it can
    engine.update_weights(named_tensors, version=step + 1)    # sync: the new policy, as a stream of (name, tensor)

and for evaluation `engine.generate(prompts, 1, seeds, params=greedy)`: the same weights, other sampling settings.
The weight stream yields the policy's full (unsharded) tensors one at a time, under the names of the bare model's
`state_dict()`; DDP, FSDP and LoRA policies all feed it the same way (`gspo.rollout.weights.policy_weights`). Under
FSDP producing each tensor is a collective, so every process's engine consumes the whole stream, except an engine
that samples from the trainer's own tensors (`shares_weights`), which reads none of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gspo.trajectory import Trajectory


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. `top_k=0` and `top_p=1.0` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


def check_request(prompts: list[str | list[int]], group_size: int, seeds: list[int]) -> None:
    """Raise ValueError for a `generate` request no engine can serve: no prompts, group_size < 1, not one seed per
    prompt."""
    if not prompts:
        raise ValueError("generate: prompts is empty")
    if group_size < 1:
        raise ValueError(f"generate: group_size must be >= 1, got {group_size}")
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: got {len(seeds)} seeds for {len(prompts)} prompts (need one per prompt)")


class RolloutEngine(Protocol):
    """Generates trajectories from the policy's current weights and receives new weights after every step."""

    version: int  # policy version of the weights it samples from (0 as built; the trainer's step count after a sync)
    shares_weights: bool  # samples from the trainer's own tensors: `update_weights` has nothing to read
    pad_id: int  # the token its trajectories are padded with
    # Optional: `max_context` (int | None), the most tokens a prompt and its completion may have together; an
    # episode driver (gspo.agent.episodes) keeps its requests within it.

    def generate(self, prompts: list[str | list[int]], group_size: int, seeds: list[int],
                 params: SamplingParams | None = None) -> Trajectory:
        """Sample `group_size` responses for each prompt (rows g·G .. g·G+G−1 answer prompt g; a prompt is text,
        tokenized without special tokens, or token ids taken as they are, so that a multi-turn episode continues from
        its exact tokens); prompt i's group is a function of `seeds[i]` alone, so results do not depend on which other
        prompts share the batch (or the process). `params` replaces the engine's own sampling settings for this call
        (e.g. greedy evaluation). Every generated token's `versions` entry is `self.version`."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Sample from these weights from now on (the stream: see the module doc); `version` becomes `self.version`."""
        ...

    def release(self) -> None:
        """Free the memory the engine can give back until the next `update_weights` (e.g. its own weight copy), so that
        it does not coexist with the trainer's gradients and optimizer state; a no-op where there is nothing to free."""
        ...

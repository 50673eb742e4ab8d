"""The rollout-engine interface: what the trainer asks of any engine (built-in sampler, vLLM, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


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


@dataclass
class RolloutBatch:
    """G completions for each of P prompts, laid out group-contiguous: rows g*G .. g*G+G-1 share prompt g.

    Shapes: N = P*G rows, S = padded prompt length, T = padded completion length.
    """

    prompt_ids: torch.Tensor  # [N, S] left-padded
    prompt_mask: torch.Tensor  # [N, S] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on generated tokens (EOS included), 0 on padding
    logprobs: torch.Tensor  # [N, T] float32 log-prob of each sampled token under the sampling distribution, 0 on pad
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens without EOS or a stop string
    completions: list[str]  # [N] decoded completion text (stop string included, EOS excluded)
    prompt_index: torch.Tensor  # [N] long: index into the `prompts` list that was passed to generate
    extras: dict = field(default_factory=dict)  # engine-specific (e.g. MoE routing for R3)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


def check_request(prompts: list[str], group_size: int, seeds: list[int]) -> None:
    """Raise ValueError for a `generate` request no engine can serve: no prompts, group_size < 1, not one seed per
    prompt."""
    if not prompts:
        raise ValueError("generate: prompts is empty")
    if group_size < 1:
        raise ValueError(f"generate: group_size must be >= 1, got {group_size}")
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: got {len(seeds)} seeds for {len(prompts)} prompts (need one per prompt)")


class RolloutEngine(Protocol):
    """Generates completions and receives new weights after each optimizer step."""

    def generate(self, prompts: list[str], group_size: int, seeds: list[int]) -> RolloutBatch:
        """Sample `group_size` completions for each prompt; prompt i's group is a function of `seeds[i]` alone,
        so results do not depend on which other prompts share the batch (or the process)."""
        ...

    def update_weights(self, model: nn.Module) -> None:
        """Make the engine sample from `model`'s current weights."""
        ...

"""The token-level trajectory: what a rollout engine returns and everything downstream consumes.

A `Trajectory` holds N responses to prompts, as token ids laid out for one training forward: the prompt left-padded
to S tokens, then the response right-padded to T tokens. The response is everything after the prompt: in a
single-turn rollout the sampled tokens; in a multi-turn episode also the environment's tokens between turns (tool
output), which the model attends to but is not trained on. Hence two masks over the response:

    completion_mask  [N, T]  1 on every real response token (the forward's attention mask after the prompt)
    loss_mask        [N, T]  1 on the tokens the policy generated, which the objective trains on (⊆ completion_mask)

and, per token, the engine's log-probability (π_old when taken from the engine, §5.4) and the policy version that
generated it (equal within a step for synchronous rollouts; several in one response once rollouts are partial).
Rows are group-contiguous: rows g·G .. g·G+G−1 answer prompt g (`prompt_index`).

`pad_left` / `pad_right` are the one padding layout of the library (prompts left, responses right); the sampler, the
engine-neutral assembly of vLLM samples, the distributed gather and SFT use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from gspo.moe import FREE

__all__ = ["Trajectory", "concat", "pad_left", "pad_right"]

NO_VERSION = -1
"""`versions` of response tokens the policy did not generate (padding, tool output)."""


def pad_left(rows: Sequence[Sequence[int]], pad_id: int,
             width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows left-padded with `pad_id` to `width` (default: the longest row): (ids, mask) [N, width] long."""
    return _pad(rows, pad_id, width, left=True)


def pad_right(rows: Sequence[Sequence[int]], pad_id: int,
              width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows right-padded with `pad_id` to `width` (default: the longest row): (ids, mask) [N, width] long."""
    return _pad(rows, pad_id, width, left=False)


def _pad(rows: Sequence[Sequence[int]], pad_id: int, width: int | None,
         left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.as_tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def _pad_dim1(x: torch.Tensor, before: int, after: int, value: float) -> torch.Tensor:
    """`x` [N, L, ...] with `before` / `after` entries of `value` added along dim 1."""
    if not before and not after:
        return x
    shape = list(x.shape)
    parts = [x.new_full([shape[0], before, *shape[2:]], value)] if before else []
    parts.append(x)
    if after:
        parts.append(x.new_full([shape[0], after, *shape[2:]], value))
    return torch.cat(parts, 1)


@dataclass
class Trajectory:
    """N responses with their prompts, token by token; see the module doc for the layout.

    Shapes: N rows, S = padded prompt length, T = padded response length.
    """

    prompt_ids: torch.Tensor  # [N, S] long, left-padded
    prompt_mask: torch.Tensor  # [N, S] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] long, right-padded
    completion_mask: torch.Tensor  # [N, T] 1 on real response tokens (attended to)
    logprobs: torch.Tensor  # [N, T] float32: the engine's log-prob of each generated token (as sampled), 0 elsewhere
    truncated: torch.Tensor  # [N] bool: hit the token budget without EOS or a stop string
    completions: list[str]  # [N] decoded response text (stop string included, EOS excluded)
    prompt_index: torch.Tensor  # [N] long: index into the prompts passed to `generate`
    loss_mask: torch.Tensor | None = None  # [N, T] 1 on tokens the policy generated, trained on (None: completion_mask)
    versions: torch.Tensor | None = None  # [N, T] long: policy version that generated each token, NO_VERSION elsewhere
    token_rewards: torch.Tensor | None = None  # [N, T] float32 per-token rewards where an environment gives them
    # per-row data carried with the rows (tensors: first dim N): MoE routing for R3 ([N, S + T, layers, k]), the
    # rewards' per-function values and verdicts (`gspo.rewards.score_trajectory`), the rows a masked failure left out
    # of the loss ("out_of_loss", [N] bool, `gspo.trainer.collect`: the learner's normaliser leaves them out)
    extras: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask
        if self.versions is None:
            self.versions = torch.full_like(self.completion_ids, NO_VERSION)
        shape = tuple(self.completion_ids.shape)
        for name in ("completion_mask", "loss_mask", "logprobs", "versions", "token_rewards"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"Trajectory.{name} has shape {tuple(value.shape)}, but completion_ids is {shape}")
        if tuple(self.prompt_mask.shape) != tuple(self.prompt_ids.shape) or self.prompt_ids.shape[0] != shape[0]:
            raise ValueError(f"Trajectory: prompt_ids {tuple(self.prompt_ids.shape)} and prompt_mask "
                             f"{tuple(self.prompt_mask.shape)} must match each other and the {shape[0]} response rows")

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def token_mask(self) -> torch.Tensor:
        """[N, S + T] bool: the real tokens of the training forward (prompt then response)."""
        return torch.cat([self.prompt_mask, self.completion_mask], 1).bool()

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask) of rows `idx`: a training forward's inputs."""
        return self.prompt_ids[idx], self.prompt_mask[idx], self.completion_ids[idx], self.completion_mask[idx]

    def to(self, device: torch.device | str) -> Trajectory:
        """The same trajectory with every tensor (extras included) on `device`."""
        moved = {name: getattr(self, name).to(device) for name in _TENSORS}
        if self.token_rewards is not None:
            moved["token_rewards"] = self.token_rewards.to(device)
        extras = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}
        return replace(self, **moved, extras=extras)

    def take(self, idx: torch.Tensor) -> Trajectory:
        """Rows `idx` (in that order) as a trajectory of their own, `prompt_index` renumbered 0, 1, ... in order of
        first appearance (whole groups taken in order stay group-contiguous)."""
        idx = idx.to(self.completion_ids.device)
        picked = {name: getattr(self, name)[idx] for name in _TENSORS}
        _, picked["prompt_index"] = torch.unique_consecutive(picked["prompt_index"], return_inverse=True)
        if self.token_rewards is not None:
            picked["token_rewards"] = self.token_rewards[idx]
        extras = {k: v[idx] if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}
        return replace(self, **picked, completions=[self.completions[i] for i in idx.tolist()], extras=extras)

    def padded(self, prompt_len: int, width: int, pad_id: int) -> Trajectory:
        """Prompts left-padded to `prompt_len` and responses right-padded to `width` (`pad_id`, masks 0, log-probs 0,
        versions NO_VERSION, routing FREE): the layout of a wider batch this one is concatenated into."""
        s, t = self.prompt_ids.shape[1], self.completion_ids.shape[1]
        left, right = prompt_len - s, width - t
        if left < 0 or right < 0:
            raise ValueError(f"cannot pad a [{s}, {t}] trajectory to the narrower [{prompt_len}, {width}]")
        extras = dict(self.extras)
        if "routing" in extras:
            r = extras["routing"]
            extras["routing"] = torch.cat([_pad_dim1(r[:, :s], left, 0, FREE), _pad_dim1(r[:, s:], 0, right, FREE)], 1)
        return replace(
            self,
            prompt_ids=_pad_dim1(self.prompt_ids, left, 0, pad_id),
            prompt_mask=_pad_dim1(self.prompt_mask, left, 0, 0),
            completion_ids=_pad_dim1(self.completion_ids, 0, right, pad_id),
            completion_mask=_pad_dim1(self.completion_mask, 0, right, 0),
            loss_mask=_pad_dim1(self.loss_mask, 0, right, 0),
            logprobs=_pad_dim1(self.logprobs, 0, right, 0.0),
            versions=_pad_dim1(self.versions, 0, right, NO_VERSION),
            token_rewards=None if self.token_rewards is None else _pad_dim1(self.token_rewards, 0, right, 0.0),
            extras=extras,
        )


def concat(parts: Sequence[Trajectory], pad_id: int) -> Trajectory:
    """The rows of `parts` in order, re-padded to the widest prompt and response (`Trajectory.padded`);
    `prompt_index` continues from one part to the next (part k's prompts follow part k − 1's)."""
    s = max(p.prompt_ids.shape[1] for p in parts)
    t = max(p.completion_ids.shape[1] for p in parts)
    wide = [p.padded(s, t, pad_id) for p in parts]
    offsets = [0]
    for p in parts[:-1]:
        offsets.append(offsets[-1] + (int(p.prompt_index.max()) + 1 if len(p) else 0))
    tensors = {name: torch.cat([getattr(p, name) for p in wide]) for name in _TENSORS if name != "prompt_index"}
    rewards = [p.token_rewards for p in wide]
    extras = {k: torch.cat([p.extras[k] for p in wide]) if isinstance(v, torch.Tensor) else v
              for k, v in wide[0].extras.items()}
    return Trajectory(**tensors, completions=[c for p in parts for c in p.completions],
                      prompt_index=torch.cat([p.prompt_index + o for p, o in zip(parts, offsets, strict=True)]),
                      token_rewards=None if any(r is None for r in rewards) else torch.cat(rewards), extras=extras)


_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask", "logprobs", "versions",
            "truncated", "prompt_index")

"""Engine-neutral request checks and trajectory assembly: what every engine does around its own sampling loop.

An engine tokenizes the prompts (`encode_prompts`: no special tokens, as the trainer's forwards see them, each prompt
checked against the engine's length limit), samples, and lays its samples out as a `Trajectory` (`assemble`, for
engines that return one completion at a time, such as vLLM). `pad_id` and `eos_ids` are how every engine pads and
recognises the end of a completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gspo.moe import FREE, ROUTING_DTYPE
from gspo.rollout.base import check_request
from gspo.trajectory import NO_VERSION, Trajectory, pad_left, pad_right

__all__ = ["Sample", "assemble", "encode_prompts", "eos_ids", "output_rows", "pad_id", "place_routing"]


def pad_id(tokenizer) -> int:
    """The token that pads prompts and completions: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer needs a pad_token_id (or at least an eos_token_id to pad with)")
    return int(pad)


def eos_ids(tokenizer, generation_config: Any = None) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS plus any `generation_config.eos_token_id` lists (chat models
    often list several), in that order, without repeats."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    extra = getattr(generation_config, "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else extra or []:
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def output_rows(model: Any) -> int | None:
    """The rows of `model`'s output head: the token ids an engine samples over (more than the tokenizer's words for
    Qwen's padded embedding); None when the model has no linear head to read it from."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "out_features", None)


def encode_prompts(tokenizer, prompts: list[str | list[int]], group_size: int, seeds: list[int], max_new_tokens: int,
                   max_len: int | None = None, limit_name: str = "max_len",
                   vocab_size: int | None = None) -> list[list[int]]:
    """Validate a `generate` request and tokenize its prompts without special tokens; a prompt given as token ids (a
    multi-turn episode's context, `gspo.agent.episodes`) is taken as it is. Raises ValueError for a prompt that
    tokenizes to nothing, ids that are not ints in the vocabulary (the model's `vocab_size` when given: Qwen's
    embedding has 151,936 rows for a 151,669-word tokenizer, and an engine samples over all of them, so an episode
    feeds such ids back), or a prompt whose tokens plus `max_new_tokens` exceed `max_len` (named `limit_name`)."""
    check_request(prompts, group_size, seeds)
    encoded = [list(p) if isinstance(p, (list, tuple)) else tokenizer(p, add_special_tokens=False)["input_ids"]
               for p in prompts]
    vocab = max(len(tokenizer), vocab_size or 0)
    for i, ids in enumerate(encoded):
        if isinstance(prompts[i], (list, tuple)) and not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"generate: prompt {i} is a list of token ids, but not all are ints in [0, {vocab})")
        if not ids:
            raise ValueError(f"generate: prompt {i} tokenizes to zero tokens: {prompts[i]!r}")
        if max_len is not None and len(ids) + max_new_tokens > max_len:
            raise ValueError(f"generate: prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"is {len(ids) + max_new_tokens} > {limit_name}={max_len}")
    return encoded


@dataclass
class Sample:
    """One completion as an engine returned it."""

    prompt: list[int]  # prompt token ids
    tokens: list[int]  # sampled token ids (EOS included when the completion ended with it)
    logprobs: list[float]  # log-probability of each sampled token under the distribution it was drawn from
    truncated: bool  # stopped at max_new_tokens (not at EOS or a stop string)
    routing: Any = None  # [len(prompt) + len(tokens) - 1, layers, k] routed experts (R3), or None
    versions: list[int] | None = None  # the policy version each token was sampled with (partial rollouts), or None


def place_routing(samples: list[Sample], prompt_len: int, width: int) -> torch.Tensor:
    """The samples' routed experts in the training forward's layout: [N, S + T, layers, k] int16, FREE where nothing
    was routed (padding, and each completion's last token, which the engine never feeds back).

    Sample i's routing covers its prompt tokens then its completion tokens but the last; the prompt is left-padded to
    `prompt_len` (S) and the completion right-padded to `width` (T), as in a `Trajectory`."""
    first = next((s.routing for s in samples if s.routing is not None), None)
    if first is None or any(s.routing is None for s in samples):
        raise ValueError("place_routing: every sample needs its routed experts (was enable_return_routed_experts on?)")
    layers, k = first.shape[1], first.shape[2]
    out = torch.full((len(samples), prompt_len + width, layers, k), FREE, dtype=ROUTING_DTYPE)
    for i, s in enumerate(samples):
        r = torch.as_tensor(s.routing)
        p, c = len(s.prompt), len(s.tokens)
        if tuple(r.shape) != (p + c - 1, layers, k):
            raise ValueError(f"place_routing: sample {i} has routing of shape {tuple(r.shape)}, expected "
                             f"({p + c - 1}, {layers}, {k}) for {p} prompt and {c} completion tokens")
        out[i, prompt_len - p:prompt_len] = r[:p].to(ROUTING_DTYPE)
        out[i, prompt_len:prompt_len + c - 1] = r[p:].to(ROUTING_DTYPE)
    return out


def assemble(samples: list[Sample], group_size: int, tokenizer, pad: int, eos: list[int], version: int = 0,
             with_routing: bool = False) -> Trajectory:
    """Lay out engine samples (group-contiguous: sample g·G + j is completion j of prompt g) as a `Trajectory` whose
    tokens were generated by policy `version`, or by the per-token `Sample.versions` where a sample has them.

    Prompts are left-padded and completions right-padded with `pad`; a completion's text is its tokens decoded without
    a final EOS and without special tokens (stop strings are kept, as `HFSampler` does); one that ends with EOS is not
    truncated. Tensors are on the CPU."""
    if not samples or len(samples) % group_size:
        raise ValueError(f"assemble: {len(samples)} samples do not form groups of {group_size}")
    for i, s in enumerate(samples):
        if not s.tokens or len(s.tokens) != len(s.logprobs):
            raise ValueError(f"assemble: sample {i} has {len(s.tokens)} tokens and {len(s.logprobs)} logprobs")
        if s.versions is not None and len(s.versions) != len(s.tokens):
            raise ValueError(f"assemble: sample {i} has {len(s.tokens)} tokens and {len(s.versions)} versions")
    prompt_ids, prompt_mask = pad_left([s.prompt for s in samples], pad)
    completion_ids, completion_mask = pad_right([s.tokens for s in samples], pad)
    logprobs = torch.zeros(completion_ids.shape, dtype=torch.float32)
    versions = torch.where(completion_mask.bool(), version, NO_VERSION)
    for i, s in enumerate(samples):
        logprobs[i, :len(s.tokens)] = torch.tensor(s.logprobs, dtype=torch.float32)
        if s.versions is not None:
            versions[i, :len(s.tokens)] = torch.tensor(s.versions, dtype=versions.dtype)
    completions = [tokenizer.decode(s.tokens[:-1] if s.tokens[-1] in eos else s.tokens, skip_special_tokens=True)
                   for s in samples]
    extras = {"routing": place_routing(samples, prompt_ids.shape[1], completion_ids.shape[1])} if with_routing else {}
    return Trajectory(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=logprobs,
        # a completion that ends with EOS finished, whatever the engine says: vLLM releases that checked the length
        # limit before EOS reported "length" for an EOS sampled exactly at max_tokens
        truncated=torch.tensor([s.truncated and s.tokens[-1] not in eos for s in samples], dtype=torch.bool),
        completions=completions,
        prompt_index=torch.arange(len(samples) // group_size).repeat_interleave(group_size),
        versions=versions,
        extras=extras,
    )

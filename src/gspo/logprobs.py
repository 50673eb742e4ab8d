"""Per-token log-probabilities of given completions under a causal LM (teacher forcing)."""

from __future__ import annotations

import torch
from torch import nn


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | x, y_<t) / temperature-scaled, for every completion token: returns (logprobs [N, T] float32,
    entropy [N, T] float32 or None). Prompts are left-padded, completions right-padded; position ids count real
    tokens only, so left padding does not shift positions (same convention as the rollout sampler).

    Only the T+1 last positions' logits are computed (`logits_to_keep`), so the prompt never costs a vocab
    projection. The temperature matches the sampler's: π_θ and π_old must be the same distribution family.
    Entropy is of the temperature-scaled distribution, detached (a diagnostic).
    """
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    t = completion_ids.shape[1]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=t + 1,
        use_cache=False,
    ).logits[:, :-1].float()  # [N, T, V]: position t predicts completion token t
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    logprobs = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy

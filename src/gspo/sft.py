"""Cold-start supervised fine-tuning (a recipe): teach the format and a first policy from demonstrations, so that RL
starts from a model whose samples sometimes earn reward (the paper's RL starts from a cold-start model)."""

from __future__ import annotations

import logging
import random

import torch
from torch import nn

from gspo.logprobs import completion_logprobs
from gspo.optim import make_optimizer

log = logging.getLogger(__name__)


def encode_pairs(
    tokenizer, prompts: list[str], completions: list[str], add_eos: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize (prompt, completion) pairs: prompts left-padded, completions right-padded with EOS appended.
    Returns prompt_ids, prompt_mask [N, S] and completion_ids, completion_mask [N, T]."""
    pad = tokenizer.pad_token_id
    p_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    c_ids = [tokenizer.encode(c, add_special_tokens=False) + ([tokenizer.eos_token_id] if add_eos else [])
             for c in completions]
    s, t = max(map(len, p_ids)), max(map(len, c_ids))
    prompt_ids = torch.tensor([[pad] * (s - len(x)) + x for x in p_ids])
    prompt_mask = torch.tensor([[0] * (s - len(x)) + [1] * len(x) for x in p_ids])
    completion_ids = torch.tensor([x + [pad] * (t - len(x)) for x in c_ids])
    completion_mask = torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in c_ids])
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def sft(
    model: nn.Module,
    tokenizer,
    rows: list[dict],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int = 10,
    seed: int = 0,
    solution_field: str = "solution",
    progress: bool = True,
) -> list[float]:
    """Minimise the token-mean negative log-likelihood of `row[solution_field]` + EOS given `row["prompt"]`, for
    `steps` AdamW steps on random batches. Returns the loss per step."""
    missing = [i for i, r in enumerate(rows) if not isinstance(r.get(solution_field), str)]
    if missing:
        raise ValueError(f"cold-start SFT needs a string {solution_field!r} in every row; row {missing[0]} has none "
                         f"({len(missing)} rows in total)")
    from tqdm.auto import tqdm

    optimizer, scheduler = make_optimizer(model, lr, steps, warmup_steps=warmup_steps, min_lr_ratio=0.0)
    rng = random.Random(seed)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="cold-start SFT", disable=not progress, leave=False)
    for _ in bar:
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        enc = encode_pairs(tokenizer, [r["prompt"] for r in batch], [r[solution_field] for r in batch])
        logprobs, _ = completion_logprobs(model, *enc)
        mask = enc[3].bool()
        loss = -logprobs[mask].mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses

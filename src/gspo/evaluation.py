"""Held-out evaluation: greedy decoding on held-out rows, scored by the run's rewards, with what accuracy means made
explicit (`rewards.accuracy_reward` >= `rewards.accuracy_threshold`, see `gspo.config.resolve_accuracy_reward`)."""

from __future__ import annotations

from typing import Any

import torch

from gspo.config import resolve_accuracy_reward
from gspo.rewards import RewardRunner
from gspo.rollout import HFSampler, SamplingParams

__all__ = ["evaluate", "format_samples"]


def evaluate(model, tokenizer, rows: list[dict], rewards: RewardRunner, max_new_tokens: int,
             batch_size: int = 256, sampler=None, accuracy_reward: str | None = None,
             accuracy_threshold: float = 1.0, samples: list[dict] | None = None,
             n_samples: int = 0) -> dict[str, float]:
    """Greedy decoding on `rows`, scored by `rewards`. Returns row means: `accuracy` (the fraction solved: the
    unweighted value of `accuracy_reward` (default: the only function, or the only built-in verifier) is at least
    `accuracy_threshold`, so other rewards' weights do not change it), `reward_mean` (the weighted sum),
    `reward_failure_rate` (rows on which some reward function failed), `response_length`, `truncation_rate`. The
    first `n_samples` rows' prompts, completions, rewards and verdicts are appended to `samples`. `sampler`: the
    rollout engine to decode with (the run's own, with greedy settings for this call); default an HFSampler on
    `model`."""
    greedy = SamplingParams(top_k=1, max_new_tokens=max_new_tokens)
    sampler = sampler or HFSampler(model, tokenizer, greedy)
    accuracy_reward = resolve_accuracy_reward(rewards.names, accuracy_reward, key="evaluate(accuracy_reward=...)")
    scores, correct, failed, lengths, truncated = [], [], [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        batch = sampler.generate(prompts, 1, [0] * len(prompts), params=greedy)
        scored = rewards.score(prompts, batch.completions, chunk)
        scores.append(scored.total)
        correct.append(scored.correct(accuracy_reward, accuracy_threshold))
        failed.append(scored.rows_failed())
        lengths.append(batch.completion_mask.sum(-1).float().cpu())
        truncated.append(batch.truncated.float().cpu())
        if samples is not None and len(samples) < n_samples:
            for i in range(min(n_samples - len(samples), len(chunk))):
                samples.append({"prompt": prompts[i], "completion": batch.completions[i],
                                "reward": float(scored.total[i]), "correct": bool(correct[-1][i]),
                                **({"answer": chunk[i]["answer"]} if "answer" in chunk[i] else {})})
    return {
        "accuracy": float(torch.cat(correct).float().mean()),
        "reward_mean": float(torch.cat(scores).mean()),
        "reward_failure_rate": float(torch.cat(failed).float().mean()),
        "response_length": float(torch.cat(lengths).mean()),
        "truncation_rate": float(torch.cat(truncated).mean()),
    }


def format_samples(step: int, samples: list[dict]) -> str:
    """Sample completions as a Markdown table (TensorBoard's text tab renders it)."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", "⏎")

    lines = [f"held-out samples at step {step}", "", "| prompt | completion | reward | correct |", "|---|---|---|---|"]
    lines += [f"| {cell(x['prompt'])} | {cell(x['completion'])} | {x['reward']:.3g} | {x['correct']} |"
              for x in samples]
    return "\n".join(lines)

"""An MoE update phase whose first minibatch takes its π_old from its update's own forward, against the full π_old pass.

    .venv/bin/python benchmarks/pi_old_reuse.py [--rounds 3] [--threads 2]

With π_old recomputed and no mismatch correction, `gspo.learner.learn` runs the no-grad π_old forward over three of
the four minibatches: the first one's π_old (and, for an MoE policy, its π_old routing: `MoERouting`) comes from its
first update's forward, at the same weights. The full pass is what a mismatch correction still needs; here it is
forced by a correction whose bounds keep every row (the same update, bit for bit: `tests/test_update_metrics.py`).
This times `learn` on benchmarks/run.py's models (tiny_moe, and medium_moe: 58.8M parameters, 16 experts) over a
rollout batch of run.py's shape (8 prompts × 8 completions × 16 tokens, 4 minibatches, GSPO), alternating the two
settings for `--rounds` rounds of 1 warm-up + 3 measured calls each, and prints the median seconds per update phase,
their ratio, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import run  # benchmarks/run.py: this script's folder is on sys.path
import torch


def trajectory(model: torch.nn.Module, vocab: int, prompts: int = 8, group: int = 8, prompt_len: int = 6,
               new_tokens: int = 16):
    """A rollout batch of random tokens (every completion its full length) with the model's own log-probs as μ."""
    from gspo.logprobs import completion_logprobs
    from gspo.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    n = prompts * group
    prompt_ids = torch.randint(2, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    completion_ids = torch.randint(2, vocab, (n, new_tokens), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return Trajectory(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, logprobs=lp, truncated=torch.zeros(n, dtype=torch.bool),
                      completions=[""] * n, prompt_index=torch.arange(n) // group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from gspo.correction import Correction
    from gspo.hooks import MoERouting
    from gspo.learner import LearnSettings, learn
    from gspo.models import build_preset
    from gspo.objectives import OBJECTIVES

    spec = OBJECTIVES["gspo"]
    settings = {
        "reused": LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=16),
        "full pass": LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=16,
                                   mismatch=Correction(level="sequence", bounds=(1e-30, 1e30)))}
    results = {}
    print(f"{'model':<11} {'full pass s':>12} {'reused s':>9} {'reused / full':>14}")
    for name in ("tiny_moe", "medium_moe"):
        torch.manual_seed(0)
        if name == "tiny_moe":
            model, _ = build_preset("tiny-moe", seed=0)
        else:
            model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**run.MODELS[name]["config"]),
                                                     attn_implementation="sdpa")
        traj = trajectory(model, model.config.vocab_size)
        advantages = torch.randn(len(traj), generator=torch.Generator().manual_seed(1))
        minibatches = list(torch.randperm(len(traj), generator=torch.Generator().manual_seed(2)).chunk(4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        seconds: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(a.rounds):
            for key, s in settings.items():
                for i in range(4):  # 1 warm-up + 3 measured
                    t0 = time.perf_counter()
                    learn(model, optimizer, scheduler, traj, advantages, minibatches, s, hooks=[MoERouting(model)])
                    if i:
                        seconds[key].append(time.perf_counter() - t0)
        full, reused = statistics.median(seconds["full pass"]), statistics.median(seconds["reused"])
        results[name] = {"full_pass_s": round(full, 4), "reused_s": round(reused, 4), "ratio": round(reused / full, 3)}
        print(f"{name:<11} {full:>12.3f} {reused:>9.3f} {reused / full:>13.3f}x")
    print(json.dumps({"pi_old_reuse_moe": results}))


if __name__ == "__main__":
    main()

"""gspo vs TRL per RL step on this CPU, plus the memory, padding and sampler rows: prints one table, then one JSON line.

    bash benchmarks/setup.sh                        # once: .venv-bench with torch (CPU), transformers, TRL, gspo
    .venv-bench/bin/python benchmarks/run.py        # ~15 min on 2 busy cores; --quick for a smoke run

What is compared (both sides, per model): the same saved model (weights and config, loaded from the same folder), the
same "a+b=" prompts (gspo's addition task), 8 prompts × 8 completions × exactly 16 new tokens per rollout batch, the
same objective (GSPO: sequence-level ratio, ε 3e-4 / 4e-4, β = 0, group-normalised advantages), 4 minibatches = 4
AdamW updates with grad-norm clipping 1.0 per rollout batch, fp32, no gradient checkpointing. Completion length is
forced on both sides: TRL gets `generation_kwargs={"min_new_tokens": 16}` (transformers masks EOS until then), gspo's
sampler gets no EOS ids (`engine.eos_ids = []`: a sampled EOS id is an ordinary token and does not end its row), so
each side generates and trains on 64 × 16 = 1,024 completion tokens per rollout batch.

gspo runs through its real code path: `gspo.trainer.rl_step` with a validated `Config`, `load_model`, `HFSampler`
and `make_optimizer`, i.e. what `gspo train` runs. TRL runs `GRPOTrainer.train()` with
`importance_sampling_level="sequence"`, `loss_type="grpo"` (GSPO in TRL's terms), `steps_per_generation=4`; a callback
stamps the end of every optimizer step, so a rollout batch is 4 consecutive steps (generation included).

Each measurement is a fresh subprocess (warm-up batches discarded), and the sides alternate A/B/A/B so that load from
other jobs on the machine hits both alike; times are medians over all measured batches, ratios are of medians.
Peak memory is the subprocess's peak RSS (`ru_maxrss`); "growth" is that peak minus the RSS just before the first
step (the model, the optimizer and the imports are already in it), i.e. what the steps themselves needed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS, GROUP, NEW_TOKENS, MINIBATCHES = 8, 8, 16, 4

# The two model sizes of the comparison. tiny = gspo's `tiny-moe` preset (1.78M parameters); medium = a 58.8M Qwen3-MoE.
MODELS: dict[str, dict] = {
    "tiny_moe": {"preset": "tiny-moe"},
    "medium_moe": {
        "config": {
            "vocab_size": 2048, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1024, "moe_intermediate_size": 256,
            "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256,
            "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None,
        },
    },
}


# ------------------------------------------------------------------------------------------------------------ helpers


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_models(root: Path) -> dict[str, Path]:
    """Save each benchmark model (seeded random weights + gspo's character tokenizer) to `root/NAME`, once."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from gspo.models import build_preset, build_tokenizer, save_model

    paths = {}
    for name, spec in MODELS.items():
        path = root / name
        paths[name] = path
        if (path / "config.json").exists():
            continue
        if "preset" in spec:
            model, tokenizer = build_preset(spec["preset"], seed=0)
        else:
            tokenizer = build_tokenizer()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**spec["config"]), attn_implementation="sdpa")
        save_model(model, tokenizer, path)
    return paths


def addition_rows(n: int = 2048) -> list[dict]:
    from gspo.data import make_task

    return make_task("addition", split="train", size=n, seed=0, digits=2)


# ------------------------------------------------------------------------------------------------------------ workers


def gspo_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Time `batches` rollout batches of `gspo.trainer.rl_step` (after `warmup` more)."""
    import torch

    from gspo.config import validate_config
    from gspo.models import load_model
    from gspo.moe import is_moe
    from gspo.optim import make_optimizer
    from gspo.rewards import RewardRunner
    from gspo.rollout import HFSampler, SamplingParams
    from gspo.trainer import RLStep, rl_step

    cfg = validate_config({
        "model": {"name": path, **options.get("model", {})},
        "rollout": {"prompts_per_step": PROMPTS, "group_size": GROUP, "max_new_tokens": NEW_TOKENS,
                    **options.get("rollout", {})},
        "algorithm": {"loss": "gspo", "minibatches": MINIBATCHES, "kl_beta": 0.0, **options.get("algorithm", {})},
        "optim": {"lr": 1e-5, "grad_clip": 1.0},
        "trainer": options.get("trainer", {}),
    })
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype)
    apply = getattr(__import__("gspo.models", fromlist=["apply_speed_options"]), "apply_speed_options", None)
    if apply is not None:
        apply(model, cfg)
    rows = addition_rows()
    optimizer, scheduler = make_optimizer(model, cfg.optim.lr, 1000, betas=cfg.optim.betas)
    ro = cfg.rollout
    engine = HFSampler(model, tokenizer, SamplingParams(temperature=ro.temperature, max_new_tokens=ro.max_new_tokens),
                       dtype=ro.dtype)
    engine.eos_ids = []  # fixed-length completions: EOS is an ordinary token here (TRL side: min_new_tokens)
    ctx = RLStep(cfg, engine, RewardRunner(cfg.rewards.functions), moe=is_moe(model))
    model.train()
    times, tokens = [], []
    rss0 = rss_bytes()
    for step in range(warmup + batches):
        t0 = time.perf_counter()
        metrics = rl_step(step, model, optimizer, scheduler, rows, ctx)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(metrics["response_length"] * PROMPTS * GROUP)
    return {"times": times, "tokens": tokens, "rss_before": rss0, "peak_rss": peak_rss_bytes()}


def trl_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Time `batches` rollout batches of TRL's GRPOTrainer in GSPO mode (after `warmup` more)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo.rewards import addition_reward

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options.get("from_pretrained", {}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in addition_rows()])

    def reward(prompts, completions, answer, **_):
        return [addition_reward(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    stamps: list[float] = []
    rss: list[int] = []

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            rss.append(rss_bytes())
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=10**6, use_cpu=True, seed=0,
            per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES, gradient_accumulation_steps=1,
            steps_per_generation=MINIBATCHES, num_generations=GROUP, num_iterations=1,
            max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
            temperature=1.0, top_p=1.0, importance_sampling_level="sequence", loss_type="grpo",
            epsilon=3e-4, epsilon_high=4e-4, beta=0.0, learning_rate=1e-5, max_grad_norm=1.0,
            gradient_checkpointing=False, bf16=False, disable_dropout=True, log_completions=False,
            max_steps=MINIBATCHES * (warmup + batches), dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Stamp()])
        trainer.train()
    ends = stamps[::MINIBATCHES]  # train begin, then the end of every 4th optimizer step
    times = [b - a for a, b in zip(ends, ends[1:], strict=False)][warmup:]
    return {"times": times, "tokens": [PROMPTS * GROUP * NEW_TOKENS] * len(times), "rss_before": rss[0],
            "peak_rss": peak_rss_bytes()}


WORKERS = {"gspo": gspo_worker, "trl": trl_worker}


def run_worker(side: str, path: Path, batches: int, warmup: int, threads: int, options: dict | None = None) -> dict:
    """Run one measurement in a fresh subprocess of this interpreter; returns its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--path", str(path),
           "--batches", str(batches), "--warmup", str(warmup), "--threads", str(threads),
           "--options", json.dumps(options or {})]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--path")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--options", default="{}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="tiny_moe,medium_moe")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        result = WORKERS[a.worker](a.path, a.batches, a.warmup, json.loads(a.options))
        print(json.dumps(result))
        return
    raise SystemExit("driver not written yet")


if __name__ == "__main__":
    main()

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
Peak memory is the subprocess's peak RSS (VmHWM); "growth" is that peak minus the RSS just before the first
step (the model, the optimizer and the imports are already in it), i.e. what the steps themselves needed.
"""

from __future__ import annotations

import argparse
import itertools
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
# "fast": the rollout engine's dtype for "gspo fast" on that model, from the sampler rows below: bf16 sampling pays
# where matmuls dominate (58.8M: 1.5x the fp32 sampler) and costs where per-op overhead does (tiny: 0.75x).
MODELS: dict[str, dict] = {
    "tiny_moe": {"preset": "tiny-moe", "fast": {"rollout": {"dtype": None}}},
    "medium_moe": {
        "fast": {"rollout": {"dtype": "bfloat16"}},
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
    """Peak resident set size of this process so far: VmHWM, which (unlike ru_maxrss, inherited from the parent
    across fork + exec on Linux) starts afresh with the process's own address space."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
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
        if "config" not in spec:
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
    rows = addition_rows()
    optimizer, scheduler = make_optimizer(model, cfg.optim.lr, 1000, betas=cfg.optim.betas)
    ro = cfg.rollout
    engine = HFSampler(model, tokenizer, SamplingParams(temperature=ro.temperature, max_new_tokens=ro.max_new_tokens),
                       dtype=ro.dtype)
    engine.eos_ids = []  # fixed-length completions: EOS is an ordinary token here (TRL side: min_new_tokens)
    ctx = RLStep(cfg, engine, RewardRunner(cfg.rewards.functions), moe=is_moe(model))
    model.train()
    times, tokens, rollout = [], [], []
    rss0 = rss_bytes()
    for step in range(warmup + batches):
        t0 = time.perf_counter()
        metrics = rl_step(step, model, optimizer, scheduler, rows, ctx)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(metrics["response_length"] * PROMPTS * GROUP)
            rollout.append(metrics["time_rollout"])
    return {"times": times, "tokens": tokens, "rollout": rollout, "rss_before": rss0, "peak_rss": peak_rss_bytes()}


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
            gradient_checkpointing=False, bf16=options.get("bf16", False), disable_dropout=True, log_completions=False,
            max_steps=MINIBATCHES * (warmup + batches), dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Stamp()])
        trainer.train()
    ends = stamps[::MINIBATCHES]  # train begin, then the end of every 4th optimizer step
    times = [b - a for a, b in itertools.pairwise(ends)][warmup:]
    return {"times": times, "tokens": [PROMPTS * GROUP * NEW_TOKENS] * len(times), "rss_before": rss[0],
            "peak_rss": peak_rss_bytes()}


def padding_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Training-forward time (log-probs forward + backward) of ragged rows vs the same rows without padding.

    32 rows with 6-token prompts; completions of 48 or 208 tokens, interleaved (a typical RL batch: some short, some
    long answers). "no padding": the same rows forwarded as two padding-free batches (16 × 48, 16 × 208): same real
    tokens, same attention work. "ragged, trimmed": `trim_padding` (length buckets); "ragged, padded": the padded
    [N, S+T] layout. Also a uniform spread of lengths (8..248, same total) trimmed and padded. Timed alternately.
    """
    import torch

    from gspo.logprobs import completion_logprobs
    from gspo.models import load_model

    model, _ = load_model(path)
    model.train()
    g = torch.Generator().manual_seed(0)
    rows = 32
    prompt = torch.randint(3, 52, (rows, 6), generator=g)

    def batch(lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        width = int(lengths.max())
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        p = prompt[: len(lengths)]
        return p, torch.ones_like(p), torch.randint(3, 52, (len(lengths), width), generator=g) * mask, mask

    bimodal = torch.tensor([48, 208] * (rows // 2))
    uniform = torch.tensor([8 + 15 * k for k in range(rows // 2)] + [248 - 15 * k for k in range(rows // 2)])
    cases = {"bimodal, trimmed": ([batch(bimodal)], True), "bimodal, padded": ([batch(bimodal)], False),
             "no padding": ([batch(torch.full((rows // 2,), 48)), batch(torch.full((rows // 2,), 208))], True),
             "uniform, trimmed": ([batch(uniform)], True), "uniform, padded": ([batch(uniform)], False)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(warmup + batches):
        for name, (parts, trim) in cases.items():
            t0 = time.perf_counter()
            for b in parts:
                logprobs, _ = completion_logprobs(model, *b, trim_padding=trim)
                logprobs.sum().backward()
            model.zero_grad(set_to_none=True)
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "real_tokens": int(bimodal.sum() + 6 * rows), "padded_tokens": rows * (208 + 6)}


def sampler_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Built-in sampler tokens/s (64 rows × 16 tokens) vs one no-grad forward over the same tokens (the bound)."""
    import torch

    from gspo.models import load_model
    from gspo.rollout import HFSampler, SamplingParams

    model, tokenizer = load_model(path)
    prompts = [r["prompt"] for r in addition_rows()[:PROMPTS]]
    out = {}
    for dtype in (None, "bfloat16"):
        engine = HFSampler(model, tokenizer, SamplingParams(max_new_tokens=NEW_TOKENS), dtype=dtype)
        engine.eos_ids = []
        sample_times, forward_times = [], []
        for rep in range(warmup + batches):
            t0 = time.perf_counter()
            b = engine.generate(prompts, GROUP, list(range(PROMPTS)))
            t1 = time.perf_counter()
            ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
            mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
            with torch.inference_mode():
                engine.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=False, logits_to_keep=NEW_TOKENS)
            t2 = time.perf_counter()
            if rep >= warmup:
                sample_times.append(t1 - t0)
                forward_times.append(t2 - t1)
        out[dtype or "float32"] = {"sample": sample_times, "forward": forward_times,
                                   "tokens": int(b.completion_mask.sum())}
    return out


WORKERS = {"gspo": gspo_worker, "trl": trl_worker, "padding": padding_worker, "sampler": sampler_worker}


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


# What is compared with what. "exact" is the same computation as TRL's, step for step (fp32 sampling, π_old
# recomputed by a no-grad forward). "fast" uses what the GSPO paper itself recommends (§5.4): π_old taken from the
# rollout engine (`old_logprobs=rollout`) instead of recomputed, and on the 58.8M model a bf16 rollout engine
# (MODELS[...]["fast"]; sampling only: the trainer's forwards, gradients and AdamW stay fp32). Same objective, updates
# and tokens. On the 58.8M model, the bf16 mixed-precision rows compare like with like: TRL with `bf16=True`
# (autocast over fp32 weights) against gspo fast with `trainer.mixed_precision=bfloat16` (the same).
# side: (worker, options, baseline side of its ratio)
SIDES: dict[str, tuple[str, dict, str]] = {
    "trl": ("trl", {}, "trl"),
    "gspo exact": ("gspo", {}, "trl"),
    "gspo fast": ("gspo", {"algorithm": {"old_logprobs": "rollout"}}, "trl"),
    "trl bf16": ("trl", {"bf16": True}, "trl bf16"),
    "gspo bf16": ("gspo", {"algorithm": {"old_logprobs": "rollout"}, "trainer": {"mixed_precision": "bfloat16"}},
                  "trl bf16"),
}
MODEL_SIDES = {"tiny_moe": ["trl", "gspo exact", "gspo fast"], "medium_moe": list(SIDES)}
HEADLINE = "gspo fast"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def compare(paths: dict[str, Path], models: list[str], rounds: int, threads: int, sizes: dict[str, tuple[int, int]]
            ) -> dict[str, dict[str, dict]]:
    """For each model, `rounds` rounds of TRL and every gspo configuration, alternating (order reversed every other
    round); returns {model: {side: {"times", "peak_rss", "growth"}}}."""
    results: dict[str, dict[str, dict]] = {}
    for model in models:
        sides = MODEL_SIDES[model]
        batches, warmup = sizes[model]
        results[model] = {side: {"times": [], "rollout": [], "peak_rss": 0, "growth": 0} for side in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                worker, options, _ = SIDES[side]
                if worker == "gspo" and side != "gspo exact":  # fast and bf16: the model's rollout engine dtype
                    options = {**options, **MODELS[model]["fast"]}
                out = run_worker(worker, paths[model], batches, warmup, threads, options)
                if any(t != PROMPTS * GROUP * NEW_TOKENS for t in out["tokens"]):
                    raise RuntimeError(f"{side} generated {out['tokens']} tokens per batch, not the fixed length")
                acc = results[model][side]
                acc["times"] += out["times"]
                acc["rollout"] += out.get("rollout", [])
                acc["peak_rss"] = max(acc["peak_rss"], out["peak_rss"])
                acc["growth"] = max(acc["growth"], out["peak_rss"] - out["rss_before"])
                print(f"  {model:>10} round {r + 1}/{rounds} {side:>10}: "
                      f"{' '.join(f'{t:.3f}' for t in out['times'])} s", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of every measurement (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds per model (default 3)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    p.add_argument("--memory-lengths", default="1024,2048,4096,8192", help="completion lengths of the memory rows")
    p.add_argument("--quick", action="store_true", help="1 round, fewer batches, memory at 1k and 4k only")
    a = p.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(WORKERS[a.worker](a.path, a.batches, a.warmup, json.loads(a.options))))
        return

    import platform

    import logprobs_memory  # benchmarks/ is on sys.path: this script's folder
    import torch
    import transformers
    import trl

    rounds = 1 if a.quick else a.rounds
    sizes = {"tiny_moe": (3, 1), "medium_moe": (1, 1)} if a.quick else {"tiny_moe": (6, 2), "medium_moe": (3, 1)}
    models = a.models.split(",")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs, {a.threads} threads, {rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp))
        results = compare(paths, models, rounds, a.threads, sizes)
        padding = run_worker("padding", paths["tiny_moe"], 3 if a.quick else 6, 1, a.threads)
        samplers = {m: run_worker("sampler", paths[m], 2 if a.quick else 4, 1, a.threads) for m in models}
    lengths = [1024, 4096] if a.quick else [int(x) for x in a.memory_lengths.split(",")]
    memory_rows, memory_ratios = logprobs_memory.table(lengths, 64)

    summary = print_report(results, padding, samplers, memory_rows, memory_ratios, models)
    print(json.dumps(summary))


def print_report(results: dict, padding: dict, samplers: dict, memory_rows: list[dict], memory_ratios: dict,
                 models: list[str]) -> dict:
    """Print the tables; return the summary that is the last line of output."""
    import logprobs_memory

    mib = 2**20
    tokens = PROMPTS * GROUP * NEW_TOKENS
    summary: dict[str, float | None] = {}
    print(f"\nper rollout batch: {PROMPTS} prompts × {GROUP} completions × {NEW_TOKENS} tokens, "
          f"{MINIBATCHES} minibatch updates, GSPO ε 3e-4/4e-4, β=0; bf16 rows: ratio against TRL bf16")
    print(f"{'model':>10} | {'run':>10} | {'s / batch':>9} | {'TRL / this':>10} | {'tokens/s':>8} | "
          f"{'peak RSS':>9} | {'growth':>8} | {'rollout s':>9} | {'updates s':>9}")
    for model in models:
        for side, r in results[model].items():
            base = results[model][SIDES[side][2]]
            trl_time, t = median(base["times"]), median(r["times"])
            phases = "        - |         -"
            if r["rollout"]:  # gspo: rl_step's own split (rollout = sampling; updates = the rest)
                roll = median(r["rollout"])
                upd = median([a - b for a, b in zip(r["times"], r["rollout"], strict=True)])
                phases = f"{roll:>9.3f} | {upd:>9.3f}"
                if side == HEADLINE:  # what gspo would reach with free sampling: the fp32 updates' bound
                    summary[f"speedup_bound_{model}"] = trl_time / upd
            print(f"{model:>10} | {side:>10} | {t:>9.3f} | {trl_time / t:>9.2f}× | {tokens / t:>8.0f} | "
                  f"{r['peak_rss'] / mib:>5.0f} MiB | {r['growth'] / mib:>4.0f} MiB | {phases}")
            if SIDES[side][0] == "gspo":
                key = "" if side == HEADLINE else "_" + side.split()[-1]
                summary[f"speedup_{model}{key}"] = trl_time / t
                summary[f"peak_rss_ratio_{model}{key}"] = r["peak_rss"] / base["peak_rss"]
    print(f"\npadding in the training forward (tiny_moe, log-probs forward + backward, 32 rows; bimodal: "
          f"{padding['real_tokens']:,} real tokens, {padding['padded_tokens']:,} in the padded layout)")
    base = median(padding["times"]["no padding"])
    for name, ts in padding["times"].items():
        print(f"{name:>16}: {median(ts) * 1e3:7.1f} ms  ({median(ts) / base:.2f}× no padding)")
    summary["padding_ragged_over_unpadded"] = median(padding["times"]["bimodal, trimmed"]) / base
    print("\nbuilt-in sampler vs the forward-only bound (one no-grad forward over the same tokens)")
    for model in models:
        for dtype, r in samplers[model].items():
            sample, forward = r["tokens"] / median(r["sample"]), r["tokens"] / median(r["forward"])
            print(f"{model:>10} {dtype:>8}: sampler {sample:8.0f} tokens/s | bound {forward:8.0f} tokens/s | "
                  f"{sample / forward:.2f} of the bound")
            summary[f"sampler_over_bound_{model}_{dtype}"] = sample / forward
    print()
    logprobs_memory.print_table(memory_rows, memory_ratios)
    summary["logprob_peak_memory_ratio"] = memory_ratios.get(4096)
    return summary


if __name__ == "__main__":
    main()

"""gspo vs TRL per RL step on this CPU, plus the memory, padding and sampler rows: prints one table, then one JSON line.

    bash benchmarks/setup.sh                        # once: .venv-bench with torch (CPU), transformers, TRL, gspo
    .venv-bench/bin/python benchmarks/run.py        # ~15 min on 2 busy cores; --quick for a smoke run
    python benchmarks/run.py --device cuda [--models dense|moe] [--quick]   # one GPU: see "GPU mode" below

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

GPU mode (`--device cuda`, one CUDA GPU, an environment with torch for CUDA, transformers and TRL): the same A/B
machinery and workers on two random-init models at Qwen3's vocabulary (151,936; gspo's character tokenizer padded
with plain tokens so that every id decodes): `dense` = Qwen3-0.6B's shape (28 layers, hidden 1,024, tied head) and
`moe` = Qwen3-30B-A3B's layer shape with 4 layers (hidden 2,048, 128 experts top-8; 2.8B parameters). Per rollout
batch 16 prompts × 8 completions × exactly 256 new tokens, 4 minibatches, GSPO as above, float32 weights and AdamW
with bf16 autocast on both sides (TRL `bf16=True`; gspo `trainer.mixed_precision=bfloat16`), no gradient
checkpointing, a pseudo-random reward of the completion text (`hash_reward`: a random-init model never solves the
task, and advantages must be non-zero for the updates to be real). Sides: TRL; "gspo exact" (π_old recomputed by a
no-grad forward, as TRL does; the float32 policy samples under the trainer's bf16 autocast, as TRL's does);
"gspo fast" (a bf16 rollout engine and π_old from it, §5.4); on request (`--sides exact-compiled,fast-compiled`) the
same two with `trainer.compile` (the decoder layers compiled for the training forwards and backwards).
Clocks are read after torch.cuda.synchronize(); generation / update split: gspo's `rl_step` timings, TRL's
`_generate` timed (its old-log-prob forward counts as update on both sides); peak GPU memory is
torch.cuda.max_memory_allocated() of the worker (model, AdamW state and the steps), and "peak device" the most memory
the device had in use while the worker ran its batches (total − free, polled every 5 ms: what nvidia-smi shows, i.e.
the caching allocator's reserved memory, the CUDA context, and memory mapped outside the allocator's count, such as
the KV caches that `--release-decode-cache` (rollout.release_decode_cache on gspo's sides) unmaps during the updates
while torch still counts them allocated). Each model is built once, saved in bf16 and loaded in float32 by every
worker. The last line's JSON has speedup_{dense,moe}_gpu (TRL / gspo fast, per
rollout batch), speedup_*_gpu_exact, and update_ratio_*_gpu (gspo exact update / TRL update: the same work on both);
the compiled sides add the same keys ending in _compiled; peak_device_ratio_* are the device-level peaks' ratios.
Before it, one line per target of issue 12 (GPU_TARGETS): the value, met or NOT met, or not measured in this run.
A full run of both models takes longer than 10 minutes: run `--models dense` and `--models moe` separately, and
where one model's sides do not fit one call, split them: `--sides trl --save trl.json --no-sampler`, then
`--sides exact,fast --merge trl.json` (one table, the ratios across the calls).
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
from collections.abc import Callable
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


def hash_reward(prompt: str, completion: str, **row) -> float:
    """GPU mode's reward: pseudo-random in [0, 1) from the completion text, the same on both sides, so that group
    advantages are non-zero (a random-init model never solves the addition task)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(completion.encode(), digest_size=4).digest(), "big") / 2**32


def worker_shape(options: dict) -> tuple[int, int, int, str]:
    """(prompts, completions per prompt, new tokens, device) of a worker: the CPU mode's unless `options` says."""
    prompts, group, tokens = options.get("shape", (PROMPTS, GROUP, NEW_TOKENS))
    return prompts, group, tokens, options.get("device", "cpu")


def sync(device: str) -> None:
    """Wait for the GPU's queued work before a clock is read (a no-op on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def gpu_peak_bytes(device: str) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


class DevicePeak:
    """The most device memory in use (total − free) while open, polled every `every` seconds by a thread; 0 off CUDA.
    It counts what torch's allocator statistics do not see as freed: memory unmapped by torch_memory_saver."""

    def __init__(self, device: str, every: float = 0.005) -> None:
        import threading

        self.device, self.every, self.peak = device, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.every)

    def __enter__(self) -> DevicePeak:
        if self.device == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def gspo_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Time `batches` rollout batches of `gspo.trainer.rl_step` (after `warmup` more)."""
    from gspo.config import validate_config
    from gspo.models import load_model
    from gspo.optim import make_optimizer
    from gspo.parallel import init_distributed
    from gspo.rewards import RewardRunner
    from gspo.rollout import make_engine
    from gspo.trainer import RLStep, default_hooks, rl_step

    prompts, group, new_tokens, device = worker_shape(options)
    if options.get("cuda_head"):  # the chunked head as on CUDA: a bf16 matmul under autocast, CUDA's tiles
        import gspo.logprobs

        gspo.logprobs.HEAD_AUTOCAST_DEVICES = frozenset({*gspo.logprobs.HEAD_AUTOCAST_DEVICES, device})
        gspo.logprobs.LOGPROB_CHUNK_MIB[device] = gspo.logprobs.LOGPROB_CHUNK_MIB["cuda"]
        gspo.logprobs.LOGPROB_CHUNK_ROWS[device] = gspo.logprobs.LOGPROB_CHUNK_ROWS["cuda"]
    rewards = {"functions": {"run:hash_reward": 1.0}} if options.get("reward") == "hash" else {}
    cfg = validate_config({
        "model": {"name": path, **options.get("model", {})},
        "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": new_tokens,
                    **options.get("rollout", {})},
        "algorithm": {"loss": "gspo", "minibatches": MINIBATCHES, "kl_beta": 0.0, **options.get("algorithm", {})},
        "optim": {"lr": 1e-5, "grad_clip": 1.0},
        **({"rewards": rewards} if rewards else {}),
        "trainer": {"device": device, **options.get("trainer", {})},
    })
    process_group = init_distributed(cfg.trainer.parallel, cfg.trainer.device)  # one process: this device
    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype)
    model = model.to(process_group.device)
    rows = addition_rows()
    optimizer, scheduler = make_optimizer(model, cfg.optim.lr, 1000, betas=cfg.optim.betas)
    engine = make_engine(cfg, model, tokenizer, out=tempfile.gettempdir())  # as gspo train builds it (the hf engine)
    engine.eos_ids = []  # fixed-length completions: EOS is an ordinary token here (TRL side: min_new_tokens)
    ctx = RLStep(cfg, engine, RewardRunner(cfg.rewards.functions), hooks=default_hooks(cfg, model), group=process_group)
    model.train()
    times, tokens, rollout = [], [], []
    rss0 = rss_bytes()
    with DevicePeak(device) as device_peak:
        for step in range(warmup + batches):
            sync(device)
            t0 = time.perf_counter()
            metrics = rl_step(step, model, optimizer, scheduler, rows, ctx)
            sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
                tokens.append(metrics["response_length"] * prompts * group)
                rollout.append(metrics["time_rollout"])
    peak_gpu = gpu_peak_bytes(device)
    if options.get("profile"):  # one more rollout batch under torch.profiler, after the timed ones
        profile_step(options["profile"], device, lambda: rl_step(warmup + batches, model, optimizer, scheduler, rows,
                                                                 ctx))
    if options.get("memory_peak"):  # one more with the allocator's history: what is live at the peak
        from memory_peak import record

        record(options["memory_peak"], lambda: rl_step(warmup + batches + 1, model, optimizer, scheduler, rows, ctx),
               device)
    return {"times": times, "tokens": tokens, "rollout": rollout, "rss_before": rss0, "peak_rss": peak_rss_bytes(),
            "peak_gpu": peak_gpu, "peak_device": device_peak.peak}


def profile_step(path: str, device: str, step: Callable[[], object], rows: int = 40) -> None:
    """Run `step` once under torch.profiler (CPU, and CUDA on a GPU) and write its op tables to `path`: by the ops'
    own device time (where the kernels' time goes), then by their own CPU time (launch and Python overhead, and
    host syncs: a `cudaStreamSynchronize` / `item` row is the CPU waiting for the GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    with profile(activities=activities) as prof:
        step()
        sync(device)
    table = prof.key_averages()
    by = ["self_cuda_time_total"] if device == "cuda" else []
    text = "\n\n".join(f"sorted by {key}\n{table.table(sort_by=key, row_limit=rows)}"
                        for key in (*by, "self_cpu_time_total"))
    Path(path).write_text(f"torch {torch.__version__}, one rollout batch (generation and update)\n\n{text}\n")


def trl_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """Time `batches` rollout batches of TRL's GRPOTrainer in GSPO mode (after `warmup` more)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo.rewards import addition_reward

    n_prompts, group, new_tokens, device = worker_shape(options)
    score = hash_reward if options.get("reward") == "hash" else addition_reward
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options.get("from_pretrained", {}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in addition_rows()])

    def reward(prompts, completions, answer, **_):
        return [score(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    stamps: list[float] = []
    rss: list[int] = []
    generation: list[float] = []
    recording, recorded, peak = None, 0, []
    if options.get("memory_peak"):  # one more rollout batch, recorded: what is live at its memory peak
        from memory_peak import Recording

        recording, recorded = Recording(options["memory_peak"], device), 1

    class Stamp(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            rss.append(rss_bytes())
            sync(device)
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            stamps.append(time.perf_counter())
            if recording is not None and state.global_step == MINIBATCHES * (warmup + batches):
                peak.append(gpu_peak_bytes(device))  # the measured batches' (a CUDA recording resets it)
                recording.start()  # the next step generates the recorded batch

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=10**6, use_cpu=device != "cuda",
            seed=0, per_device_train_batch_size=n_prompts * group // MINIBATCHES, gradient_accumulation_steps=1,
            steps_per_generation=MINIBATCHES, num_generations=group, num_iterations=1,
            max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens},
            temperature=1.0, top_p=1.0, importance_sampling_level="sequence", loss_type="grpo",
            epsilon=3e-4, epsilon_high=4e-4, beta=0.0, learning_rate=1e-5, max_grad_norm=1.0,
            gradient_checkpointing=False, bf16=options.get("bf16", False), disable_dropout=True, log_completions=False,
            max_steps=MINIBATCHES * (warmup + batches + recorded), dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[Stamp()])
        if options.get("time_generation") and hasattr(trainer, "_generate"):  # GPU mode: TRL 1.16's sampling call
            generate = trainer._generate

            def timed_generate(*args, **kwargs):
                sync(device)
                t0 = time.perf_counter()
                result = generate(*args, **kwargs)
                sync(device)
                generation.append(time.perf_counter() - t0)
                return result

            trainer._generate = timed_generate
        with DevicePeak(device) as device_peak:
            trainer.train()
        if recording is not None:
            recording.stop()
    ends = stamps[::MINIBATCHES]  # train begin, then the end of every 4th optimizer step
    times = [b - a for a, b in itertools.pairwise(ends)][warmup:warmup + batches]
    return {"times": times, "tokens": [n_prompts * group * new_tokens] * len(times), "rss_before": rss[0],
            "peak_rss": peak_rss_bytes(), "rollout": generation[warmup:warmup + len(times)],
            "peak_gpu": peak[0] if peak else gpu_peak_bytes(device), "peak_device": device_peak.peak}


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


def gpu_sampler_worker(path: str, batches: int, warmup: int, options: dict) -> dict:
    """GPU mode's sampler rows: a bf16 engine's tokens/s at GPU_SHAPE with each decode loop (the first call, which
    compiles, timed apart), against the forward-only bound: one no-grad forward over the same [rows, prompt + new]
    tokens (what the decode loop computes, in a single pass)."""
    import torch

    from gspo.models import load_model
    from gspo.moe import config_has_experts
    from gspo.rollout import HFSampler, SamplingParams

    n_prompts, group, new_tokens, device = worker_shape(options)
    model, tokenizer = load_model(path)
    model = model.to(device)
    prompts = [r["prompt"] for r in addition_rows()[:n_prompts]]
    out: dict = {}
    # An MoE decode step cannot be captured in a CUDA graph (gspo.rollout.sampler.resolve_decode): its rows are the
    # dynamic loop and the static cache run eagerly.
    for decode in ("dynamic", "static") if config_has_experts(model.config) else ("dynamic", "compiled"):
        engine = HFSampler(model, tokenizer, SamplingParams(max_new_tokens=new_tokens), dtype="bfloat16",
                           decode=decode)
        engine.eos_ids = []
        times = []
        for _ in range(warmup + batches):
            sync(device)
            t0 = time.perf_counter()
            b = engine.generate(prompts, group, list(range(n_prompts)))
            sync(device)
            times.append(time.perf_counter() - t0)
        ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
        mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
        forward = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                engine.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=False, logits_to_keep=new_tokens)
            sync(device)
            forward.append(time.perf_counter() - t0)
        out[decode] = {"first": times[0], "sample": times[warmup:], "forward": forward,
                       "tokens": int(b.completion_mask.sum())}
        del engine
        torch.cuda.empty_cache()
    return out


WORKERS = {"gspo": gspo_worker, "trl": trl_worker, "padding": padding_worker, "sampler": sampler_worker,
           "gpu_sampler": gpu_sampler_worker}


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


# ------------------------------------------------------------------------------------------------------------ GPU mode

GPU_SHAPE = (16, 8, 256)  # prompts × completions × forced new tokens per rollout batch (4 minibatches, as above)
GPU_VOCAB = 151_936  # Qwen3's
_GPU_COMMON = {"vocab_size": GPU_VOCAB, "max_position_embeddings": 4096, "rope_theta": 1_000_000.0,
               "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None}
# name: (transformers config class, its arguments)
GPU_MODELS: dict[str, tuple[str, dict]] = {
    # Qwen3-0.6B (596M parameters)
    "dense": ("Qwen3Config", {**_GPU_COMMON, "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072}),
    # Qwen3-30B-A3B's layer (hidden 2,048, 32/4 heads, 128 experts top-8, expert FFN 768), 4 layers (2.80B parameters)
    "moe": ("Qwen3MoeConfig", {**_GPU_COMMON, "hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 32,
                               "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                               "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                               "norm_topk_prob": True, "decoder_sparse_step": 1}),
}
MIXED = {"trainer": {"mixed_precision": "bfloat16"}}
COMPILED = {"trainer": {"mixed_precision": "bfloat16", "compile": True}}  # + the decoder layers compiled for training
FAST = {"rollout": {"dtype": "bfloat16"}, "algorithm": {"old_logprobs": "rollout"}}
# side: (worker, options). Both sides: float32 weights and AdamW, bf16 autocast.
GPU_SIDES: dict[str, tuple[str, dict]] = {
    "trl": ("trl", {"bf16": True}),
    "gspo exact": ("gspo", MIXED),
    "gspo fast": ("gspo", {**MIXED, **FAST}),
    "exact compiled": ("gspo", COMPILED),  # the same, with trainer.compile (dense models; not run by default)
    "fast compiled": ("gspo", {**COMPILED, **FAST}),
}
GPU_DEFAULT_SIDES = ["trl", "gspo exact", "gspo fast"]
GPU_HEADLINE, GPU_LIKE_FOR_LIKE = "gspo fast", "gspo exact"
GPU_SIDE_NAMES = {"trl": "trl", "exact": "gspo exact", "fast": "gspo fast", "exact-compiled": "exact compiled",
                  "fast-compiled": "fast compiled"}  # --sides
# summary keys of a side: its JSON names (`print_gpu_report`)
GPU_SUMMARY_KEYS = {GPU_HEADLINE: ("speedup_{m}_gpu", "update_ratio_{m}_gpu_fast", "peak_gpu_ratio_{m}_fast"),
                    GPU_LIKE_FOR_LIKE: ("speedup_{m}_gpu_exact", "update_ratio_{m}_gpu", "peak_gpu_ratio_{m}_exact"),
                    "fast compiled": ("speedup_{m}_gpu_compiled", "update_ratio_{m}_gpu_fast_compiled",
                                      "peak_gpu_ratio_{m}_fast_compiled"),
                    "exact compiled": ("speedup_{m}_gpu_exact_compiled", "update_ratio_{m}_gpu_compiled",
                                       "peak_gpu_ratio_{m}_exact_compiled")}


# issue 12's targets for this comparison, by JSON key: (key, bound, "min" (at least) or "max" (at most), what it is)
GPU_TARGETS = [
    ("speedup_dense_gpu", 3.0, "min", "s / batch, TRL over gspo fast, 0.6B shape"),
    ("update_ratio_dense_gpu", 0.8, "max", "update phase, gspo exact over TRL, 0.6B shape"),
    ("speedup_moe_gpu", 5.0, "min", "s / batch, TRL over gspo fast, MoE shape"),
    ("peak_gpu_ratio_dense_exact", 1.0, "max", "peak GPU memory, gspo exact over TRL, 0.6B shape"),
    ("peak_gpu_ratio_dense_fast", 1.0, "max", "peak GPU memory, gspo fast over TRL, 0.6B shape"),
    ("update_ratio_dense_gpu_compiled", 0.8, "max", "update phase, gspo exact + trainer.compile over TRL, 0.6B"),
]


def target_lines(summary: dict) -> list[str]:
    """One line per issue-12 target: the measured value and whether it is met, or that this run did not measure it."""
    lines = []
    for key, bound, kind, what in GPU_TARGETS:
        value = summary.get(key)
        sign = "≥" if kind == "min" else "≤"
        if value is None:
            lines.append(f"  {key} {sign} {bound:g} ({what}): not measured in this run")
            continue
        met = value >= bound if kind == "min" else value <= bound
        lines.append(f"  {key} {sign} {bound:g} ({what}): {value:.3f}, {'met' if met else 'NOT met'}")
    return lines


def padded_tokenizer(vocab_size: int):
    """gspo's character tokenizer (same specials, characters and ids) followed by plain tokens <x0>, <x1>, ... up to
    `vocab_size`, so that every id a model of that vocabulary samples decodes to text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gspo.models import SPECIAL_TOKENS, VOCAB_CHARS

    tokens = [*SPECIAL_TOKENS, *VOCAB_CHARS]
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens))]
    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(tokens)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096)


def build_gpu_models(root: Path, names: list[str], specs: dict[str, tuple[str, dict]], device: str) -> dict[str, Path]:
    """Save each model (seeded random init on `device`, stored in bf16) and its padded tokenizer to `root/NAME`."""
    import torch
    import transformers

    from gspo.models import save_model

    paths = {}
    for name in names:
        config_class, kwargs = specs[name]
        config = getattr(transformers, config_class)(**kwargs)
        tokenizer = padded_tokenizer(config.vocab_size)
        assert len(tokenizer) == config.vocab_size, (len(tokenizer), config.vocab_size)
        torch.manual_seed(0)
        with torch.device(device):  # a 2.8B init on the CPU takes minutes
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        paths[name] = root / name
        save_model(model.to("cpu", torch.bfloat16), tokenizer, paths[name])
        del model
        print(f"  built {name}: {params / 1e9:.2f}B parameters", flush=True)
    return paths


def compare_gpu(paths: dict[str, Path], rounds: int, threads: int, batches: int, warmup: int,
                shape: tuple[int, int, int] = GPU_SHAPE, device: str = "cuda",
                decode: str = "auto", sides: list[str] | None = None,
                profile: str | None = None, release: bool = False,
                memory_peak: str | None = None) -> dict[str, dict[str, dict]]:
    """For each model, `rounds` rounds of every GPU side (or of `sides`), alternating (order reversed every other
    round), each a fresh worker subprocess, gspo's engine decoding with `decode` (rollout.decode) and, with `release`,
    rollout.release_decode_cache; returns {model: {side: {"times", "rollout", "update", "peak_gpu", "peak_device"}}}.
    `profile` (a folder): each gspo side's worker of the last round profiles one more rollout batch into
    `profile/MODEL_SIDE.txt` (`profile_step`); `memory_peak` (a folder): every side's worker of the last round runs
    one more again (TRL: one more rollout batch), whose allocations live at its peak go to
    `memory_peak/MODEL_SIDE_memory.txt` (`memory_peak.Recording`)."""
    results: dict[str, dict[str, dict]] = {}
    sides = sides or GPU_DEFAULT_SIDES
    for model, path in paths.items():
        results[model] = {side: {"times": [], "rollout": [], "update": [], "peak_gpu": 0, "peak_device": 0}
                          for side in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                worker, options = GPU_SIDES[side]
                options = {**options, "shape": list(shape), "device": device, "reward": "hash", "time_generation": True}
                stem = f"{model}_{side.replace(' ', '_')}"
                if worker == "gspo":
                    options["rollout"] = {**options.get("rollout", {}), "decode": decode,
                                          **({"release_decode_cache": True} if release else {})}
                    if profile is not None and r == rounds - 1:
                        options["profile"] = str(Path(profile) / f"{stem}.txt")
                if memory_peak is not None and r == rounds - 1:
                    options["memory_peak"] = str(Path(memory_peak) / f"{stem}_memory.txt")
                # a compiled side compiles in its first batch and again when a dimension first changes (then as
                # dynamic): one more warm-up batch keeps that out of the measured ones
                warm = warmup + 1 if options.get("trainer", {}).get("compile") else warmup
                out = run_worker(worker, path, batches, warm, threads, options)
                if any(t != shape[0] * shape[1] * shape[2] for t in out["tokens"]):
                    raise RuntimeError(f"{side} generated {out['tokens']} tokens per batch, not the fixed length")
                acc = results[model][side]
                acc["times"] += out["times"]
                if len(out["rollout"]) == len(out["times"]):  # generation time of each measured batch
                    acc["rollout"] += out["rollout"]
                    acc["update"] += [t - g for t, g in zip(out["times"], out["rollout"], strict=True)]
                else:
                    print(f"  {side}: no generation / update split ({len(out['rollout'])} generation times for "
                          f"{len(out['times'])} batches)", flush=True)
                acc["peak_gpu"] = max(acc["peak_gpu"], out["peak_gpu"])
                acc["peak_device"] = max(acc["peak_device"], out["peak_device"])
                split = (f" (generation {' '.join(f'{g:.3f}' for g in out['rollout'])} s; peak "
                         f"{out['peak_gpu'] / 2**30:.1f} GiB, device {out['peak_device'] / 2**30:.1f} GiB)")
                print(f"  {model:>5} round {r + 1}/{rounds} {side:>10}: "
                      f"{' '.join(f'{t:.3f}' for t in out['times'])} s{split}", flush=True)
    return results


def print_gpu_report(results: dict[str, dict[str, dict]], shape: tuple[int, int, int] = GPU_SHAPE) -> dict:
    """Print the GPU table; return the summary that is the last line of output."""
    tokens = shape[0] * shape[1] * shape[2]
    summary: dict[str, float | None] = {}
    print(f"\nper rollout batch: {shape[0]} prompts × {shape[1]} completions × {shape[2]} tokens, {MINIBATCHES} "
          "minibatch updates, GSPO ε 3e-4/4e-4, β=0, fp32 weights + bf16 autocast on both sides")
    print(f"{'model':>5} | {'run':>14} | {'s / batch':>9} | {'TRL / this':>10} | {'tokens/s':>8} | "
          f"{'generation s':>12} | {'update s':>8} | {'update / TRL':>12} | {'peak GPU':>9} | {'peak device':>11}")
    for model, by_side in results.items():
        trl = by_side.get("trl", {"times": [], "update": [], "peak_gpu": 0})  # absent: ratios are nan
        trl_device = trl.get("peak_device", 0)  # (absent from results saved before it was measured)
        trl_time, trl_update = median(trl["times"]), median(trl["update"])
        for side, r in by_side.items():
            t, gen, update = median(r["times"]), median(r["rollout"]), median(r["update"])
            print(f"{model:>5} | {side:>14} | {t:>9.3f} | {trl_time / t:>9.2f}× | {tokens / t:>8.0f} | "
                  f"{gen:>12.3f} | {update:>8.3f} | {update / trl_update:>11.2f}× | "
                  f"{r['peak_gpu'] / 2**30:>5.2f} GiB | {r.get('peak_device', 0) / 2**30:>7.2f} GiB")
            if side in GPU_SUMMARY_KEYS:
                speedup, update_ratio, peak = (k.format(m=model) for k in GPU_SUMMARY_KEYS[side])
                summary[speedup] = trl_time / t
                summary[update_ratio] = update / trl_update
                summary[peak] = r["peak_gpu"] / trl["peak_gpu"] if trl["peak_gpu"] else None
                summary[peak.replace("peak_gpu", "peak_device")] = (r.get("peak_device", 0) / trl_device
                                                                    if trl_device else None)
    return {k: None if isinstance(v, float) and v != v else v for k, v in summary.items()}  # nan: no TRL side


def main_gpu(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`--device cuda`: the GPU A/B (module docstring, "GPU mode")."""
    import platform

    import torch

    if not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}, CUDA build "
                     f"{torch.version.cuda or 'none'}, torch.cuda.is_available() is False). Run it on a machine with "
                     "a GPU, or leave --device out for the CPU comparison.")
    try:
        import transformers
        import trl
    except ImportError as e:
        parser.error(f"--device cuda compares against TRL, which this environment lacks ({e}): pip install trl")
    models = (a.models or ",".join(GPU_MODELS)).split(",")
    unknown = [m for m in models if m not in GPU_MODELS]
    if unknown:
        parser.error(f"--device cuda: unknown model(s) {unknown}; GPU models: {', '.join(GPU_MODELS)}")
    sides = [GPU_SIDE_NAMES.get(x, x) for x in a.sides.split(",")] if a.sides else GPU_DEFAULT_SIDES
    if unknown := [x for x in sides if x not in GPU_SIDES]:
        parser.error(f"--sides: unknown {unknown}; sides: {', '.join(GPU_SIDE_NAMES)}")
    for flag, folder in (("--profile", a.profile), ("--memory-peak", a.memory_peak)):  # before minutes of compute
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            parser.error(f"{flag} {folder} is a file: it names a folder for the tables")
    if a.measured < 1:
        parser.error(f"--measured {a.measured}: at least 1 measured batch per side")
    rounds, batches, warmup = (1, 1, 1) if a.quick else (a.rounds, a.measured, 1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, trl {trl.__version__}, python {platform.python_version()}, "
          f"{a.threads} threads, {rounds} rounds × ({warmup} warm-up + {batches} measured batches) per side",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_gpu_models(Path(tmp), models, GPU_MODELS, "cuda")
        options = {"shape": list(GPU_SHAPE), "device": "cuda"}
        samplers = {} if a.no_sampler else {m: run_worker("gpu_sampler", p, batches, 1, a.threads, options)
                                             for m, p in paths.items()}
        print_gpu_samplers(samplers)
        for folder in (a.profile, a.memory_peak):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        results = compare_gpu(paths, rounds, a.threads, batches, warmup, decode=a.decode, sides=sides,
                              profile=a.profile, release=a.release_decode_cache, memory_peak=a.memory_peak)
    results = merge_gpu_results(results, a.save, a.merge)
    summary = {"device": torch.cuda.get_device_name(), "quick": a.quick,
               "release_decode_cache": a.release_decode_cache, **print_gpu_report(results)}
    print("\nissue 12's targets (from the sides in the table above):",
          *target_lines(summary), sep="\n")
    for model, by_decode in samplers.items():
        for decode, r in by_decode.items():
            summary[f"sampler_tokens_per_s_{model}_{decode}"] = r["tokens"] / median(r["sample"])
    print(json.dumps(summary))


def merge_gpu_results(results: dict[str, dict[str, dict]], save: str | None, merge: str | None
                      ) -> dict[str, dict[str, dict]]:
    """`--save FILE` writes this call's raw results (JSON); `--merge FILE,...` adds the results of earlier calls
    (e.g. `--sides trl` in one 10-minute call, `--sides exact,fast` in the next) before the table is printed, so
    that the ratios compare sides measured on the same machine in separate calls."""
    if save:
        Path(save).write_text(json.dumps(results))
    merged: dict[str, dict[str, dict]] = {}
    for earlier in (merge.split(",") if merge else []):
        for model, by_side in json.loads(Path(earlier).read_text()).items():
            merged.setdefault(model, {}).update(by_side)
    for model, by_side in results.items():
        merged.setdefault(model, {}).update(by_side)
    return merged


def print_gpu_samplers(samplers: dict[str, dict[str, dict]]) -> None:
    """The GPU sampler rows: tokens/s of each decode loop against the forward-only bound."""
    rows, group, new_tokens = GPU_SHAPE
    print(f"\nbuilt-in sampler, bf16 engine, {rows * group} rows × {new_tokens} tokens, vs the forward-only bound "
          "(one no-grad forward over the same tokens)")
    for model, by_decode in samplers.items():
        for decode, r in by_decode.items():
            sample, bound = r["tokens"] / median(r["sample"]), r["tokens"] / median(r["forward"])
            print(f"{model:>5} {decode:>8}: {sample:8.0f} tokens/s | bound {bound:9.0f} tokens/s | "
                  f"{sample / bound:.3f} of the bound | first call {r['first']:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads of every measurement (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds per model (default 3)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default): the CPU comparison; cuda: the GPU comparison (module docstring)")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)} (cpu; default: all) "
                   f"or {', '.join(GPU_MODELS)} (cuda; default: both)")
    p.add_argument("--decode", default="auto", choices=["auto", "dynamic", "static", "compiled"],
                   help="cuda: gspo's rollout.decode in the A/B (default auto: compiled on CUDA)")
    p.add_argument("--no-sampler", action="store_true", help="cuda: leave out the sampler rows")
    p.add_argument("--release-decode-cache", action="store_true",
                   help="cuda: gspo's sides give the compiled decode loop's KV-cache memory back during the updates "
                        "(rollout.release_decode_cache; needs torch_memory_saver)")
    p.add_argument("--sides", default=None, help="cuda: comma-separated subset of trl, exact, fast (default: all)")
    p.add_argument("--profile", default=None, help="cuda: a folder; each gspo side profiles one more rollout batch "
                   "(torch.profiler op tables by device and CPU time) into FOLDER/MODEL_SIDE.txt")
    p.add_argument("--memory-peak", default=None, help="cuda: a folder; each side (TRL's too) runs one more rollout "
                   "batch with the allocator's history recorded and writes what is live at its peak, by where it was "
                   "allocated (benchmarks/memory_peak.py; on the CPU: python benchmarks/memory_peak.py)")
    p.add_argument("--save", default=None, help="cuda: write this call's raw results to this JSON file")
    p.add_argument("--merge", default=None, help="cuda: comma-separated JSON files of earlier calls' --save, "
                   "printed in one table with this call's")
    p.add_argument("--memory-lengths", default="1024,2048,4096,8192", help="completion lengths of the memory rows")
    p.add_argument("--quick", action="store_true", help="1 round, fewer batches, memory at 1k and 4k only (cuda: 1 "
                   "round of 1 warm-up + 1 measured batch per side)")
    p.add_argument("--measured", type=int, default=3, help="cuda: measured rollout batches per side and round, after "
                   "1 warm-up (default 3)")
    a = p.parse_args()
    if a.worker:
        import torch

        torch.set_num_threads(a.threads)
        print(json.dumps(WORKERS[a.worker](a.path, a.batches, a.warmup, json.loads(a.options))))
        return
    if a.device == "cuda":
        main_gpu(a, p)
        return
    gpu_only = {"--decode": a.decode != "auto", "--no-sampler": a.no_sampler, "--sides": a.sides, "--save": a.save,
                "--merge": a.merge, "--profile": a.profile, "--memory-peak": a.memory_peak,
                "--release-decode-cache": a.release_decode_cache, "--measured": a.measured != 3}
    if given := [flag for flag, value in gpu_only.items() if value]:
        p.error(f"{', '.join(given)}: only with --device cuda (the CPU comparison has no such setting)")

    import platform

    import logprobs_memory  # benchmarks/ is on sys.path: this script's folder
    import torch
    import transformers
    import trl

    rounds = 1 if a.quick else a.rounds
    sizes = {"tiny_moe": (3, 1), "medium_moe": (1, 1)} if a.quick else {"tiny_moe": (6, 2), "medium_moe": (3, 1)}
    models = (a.models or ",".join(MODELS)).split(",")
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

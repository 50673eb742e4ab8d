"""The GSPO training loop (a recipe): rollout → rewards → group advantages → N off-policy minibatch updates → log.

Everything it calls is a component (objectives, advantages, rollout engine, rewards, data, checkpoint, tracking);
this file owns only the loop, the optimizer and the run folder:

    OUT/config.yaml        the validated config, defaults resolved (a resume must match it)
    OUT/cold_start/        the cold-start SFT model, when `cold_start` is configured
    OUT/metrics.jsonl      one object per RL step;   OUT/eval.jsonl  held-out evaluations (step 0 = before RL)
    OUT/checkpoints/       crash-safe checkpoints;   OUT/final/      the final model, a HF model directory
    OUT/summary.json       what the run achieved, or (status "failed") why it stopped

A run can be killed at any moment and resumed (`train(cfg, resume=True)`, `gspo train ... --resume`) to the same
weights and the same metrics.jsonl / eval.jsonl as an uninterrupted run: every file above is written to a temporary
name and renamed into place (config.yaml, eval.jsonl, summary.json, cold_start/, final/), appended with fsync
(metrics.jsonl, whose lines after the resumed checkpoint are dropped), or a verified checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from gspo.advantages import group_advantages, zero_variance_groups
from gspo.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint, set_seed
from gspo.config import Config, ConfigError, config_to_dict, resolve_accuracy_reward
from gspo.data import load_data
from gspo.distributed import Dist, NullLogger, init_distributed
from gspo.logprobs import completion_logprobs
from gspo.models import enable_gradient_checkpointing, load_model, save_model
from gspo.moe import RoutingCapture, is_moe, require_replay_support, routing_change
from gspo.objectives import OBJECTIVES, kl_to_reference
from gspo.optim import check_update_precision, make_optimizer
from gspo.rewards import RewardRunner
from gspo.rollout import HFSampler, RolloutBatch, SamplingParams, eval_sampler, make_engine
from gspo.runfolder import (
    check_output_dir,
    check_resume_config,
    clear_run,
    publish_dir,
    run_started,
    write_atomic,
    write_jsonl,
)
from gspo.schedule import derive_seed, drop_long_prompts, prompt_indices, prompt_token_limit, unknown_character_rows
from gspo.tracking import MetricsLogger, Progress, check_trackers, plot_curves, read_metrics

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run stopped because training itself went wrong (e.g. too many steps without a finite update)."""


# ------------------------------------------------------------------------------------------------------ evaluation


def evaluate(model, tokenizer, rows: list[dict], rewards: RewardRunner, max_new_tokens: int,
             batch_size: int = 256, sampler=None, accuracy_reward: str | None = None,
             accuracy_threshold: float = 1.0, samples: list[dict] | None = None,
             n_samples: int = 0) -> dict[str, float]:
    """Greedy decoding on `rows`, scored by `rewards`. Returns row means: `accuracy` (the fraction solved: the
    unweighted value of `accuracy_reward` (default: the only function, or the only built-in verifier) is at least
    `accuracy_threshold`, so other rewards' weights do not change it), `reward_mean` (the weighted sum),
    `reward_failure_rate` (rows on which some reward function failed), `response_length`, `truncation_rate`. The
    first `n_samples` rows' prompts, completions, rewards and verdicts are appended to `samples`. `sampler`: a greedy
    rollout engine to decode with (e.g. vLLM's, see `gspo.rollout.eval_sampler`); default an HFSampler on `model`."""
    sampler = sampler or HFSampler(model, tokenizer, SamplingParams(top_k=1, max_new_tokens=max_new_tokens))
    accuracy_reward = resolve_accuracy_reward(rewards.names, accuracy_reward, key="evaluate(accuracy_reward=...)")
    scores, correct, failed, lengths, truncated = [], [], [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        batch = sampler.generate(prompts, 1, [0] * len(prompts))
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


# ------------------------------------------------------------------------------------------------------ one RL step


@dataclass
class RLStep:
    """Everything one RL step needs besides the model and optimizer."""

    cfg: Config
    engine: HFSampler
    rewards: RewardRunner
    ref_model: torch.nn.Module | None = None
    moe: bool = False  # the policy has MoE routers with an adapter: routing is captured (volatility) and replayable
    # (so its forwards keep the padded [N, S+T] token layout; without capture they trim padding: gspo.logprobs)
    dist: Dist = field(default_factory=Dist)  # the processes of a torchrun run (one process: no-ops)


def _routing_capture(ctx: RLStep, model, replay: torch.Tensor | None, mb: torch.Tensor):
    """Capture the routing of one minibatch forward (MoE models), replaying `replay[mb]` when given."""
    if not ctx.moe:
        return contextlib.nullcontext(None)
    return RoutingCapture(model, replay=None if replay is None else replay[mb])


def _precision_ratio_metrics(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, float]:
    """Ratio noise between the trainer's and the engine's log-probabilities of the same tokens under the same weights
    (§5.4): std over tokens of w_{i,t} = π_trainer/π_engine, and std over sequences of s_i = exp(mean_t log w_{i,t}).
    Non-zero only through numerics (e.g. a bf16 engine for an fp32 trainer); GRPO clips w, GSPO clips s."""
    log_w = torch.where(mask, trainer_logprobs - engine_logprobs, trainer_logprobs.new_zeros(()))
    nonempty = mask.any(-1)
    log_s = log_w.sum(-1)[nonempty] / mask.sum(-1)[nonempty]
    w = log_w[mask].exp()
    return {
        "precision_ratio_std_token": float(w.std()) if w.numel() > 1 else 0.0,
        "precision_ratio_std_seq": float(log_s.exp().std()) if log_s.numel() > 1 else 0.0,
    }


def _rows(batch: RolloutBatch, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return batch.prompt_ids[idx], batch.prompt_mask[idx], batch.completion_ids[idx], batch.completion_mask[idx]


def rl_step(step: int, model, optimizer, scheduler, train_rows: list[dict], ctx: RLStep) -> dict[str, float]:
    """One step of the paper's loop; returns its metrics."""
    cfg, algo, ro = ctx.cfg, ctx.cfg.algorithm, ctx.cfg.rollout
    t0 = time.perf_counter()

    # 1. rollout: P prompts × G completions, each prompt's sampling seeded by (run seed, step, prompt position)
    idx = prompt_indices(step, ro.prompts_per_step, len(train_rows), cfg.trainer.seed)
    rows = [train_rows[i] for i in idx]
    seeds = [derive_seed(cfg.trainer.seed, "rollout", step, j) for j in range(len(rows))]
    mine = ctx.dist.shard(len(rows))  # this process's prompts (whole groups; all of them in a one-process run)
    batch = ctx.engine.generate([r["prompt"] for r in rows[mine]], ro.group_size, seeds[mine])
    if hasattr(ctx.engine, "release_weights"):  # an own-copy engine frees its copy until update_weights below
        ctx.engine.release_weights()
    t_rollout = time.perf_counter() - t0

    # 2. rewards and group advantages (Eq. 6); every process then holds the whole batch
    row_of = [rows[mine][int(i)] for i in batch.prompt_index]
    scored = ctx.rewards.score([r["prompt"] for r in row_of], batch.completions, row_of)
    solved = scored.correct(cfg.rewards.accuracy_reward, cfg.rewards.accuracy_threshold)
    rewards, reward_stats = scored.total, {**scored.stats, "solved": float(solved.sum())}  # a count: summed
    batch, rewards, reward_stats = ctx.dist.gather_rollouts(batch, rewards, reward_stats, ctx.rewards,
                                                            pad_id=getattr(ctx.engine, "pad_id", 0))
    advantages = group_advantages(rewards, ro.group_size, scale=algo.advantage_scale)
    mask = batch.completion_mask.bool()

    # the batch is shuffled and split into minibatches; all but the first update are off-policy
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step)))
    perm = perm.to(mask.device)  # drawn on the CPU (the same on every device), used to index the batch's tensors
    minibatches = [ctx.dist.share(mb) for mb in perm.chunk(algo.minibatches)]  # each process: its share of each

    # 3. π_old: the engine's own logprobs (§5.4), or a no-grad forward of the trainer before the first update. The
    # forward runs on the same row groups as the updates: a row's logits depend in the last bits on which rows share
    # its batch (matmul blocking, MoE expert grouping), and with other groups the on-policy first minibatch would see
    # ratios of 1 ± 1e-7 instead of exactly 1.
    # MoE (§5.3): the π_old forward records each token's routing (the router's own choice; under R3 it runs with the
    # engine's routing replayed), which R2 replays in the π_θ forwards and expert volatility is measured against.
    model.train()
    amp = functools.partial(ctx.dist.autocast, cfg.trainer.mixed_precision)  # trainer.mixed_precision, or a no-op
    engine_routing = batch.extras.get("routing")  # R3: the rollout engine's routing, [N, S+T, layers, k]
    token_mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).bool()  # real tokens of the forward
    old_routing = None
    if algo.old_logprobs == "rollout":
        old_logprobs = batch.logprobs
    else:
        old_logprobs = torch.zeros_like(batch.logprobs)
        with torch.no_grad():
            for mb in minibatches:
                with _routing_capture(ctx, model, engine_routing, mb) as cap, amp():
                    old_logprobs[mb] = completion_logprobs(model, *_rows(batch, mb), temperature=ro.temperature,
                                                           trim_padding=not ctx.moe)[0]
                if cap is not None:
                    chosen = cap.take().chosen
                    if old_routing is None:
                        old_routing = chosen.new_empty((len(batch), token_mask.shape[1], *chosen.shape[1:]))
                    old_routing[mb] = chosen.view(len(mb), token_mask.shape[1], *chosen.shape[1:])
    old_logprobs, old_routing = ctx.dist.merge_rows(old_logprobs, minibatches), ctx.dist.merge_rows(old_routing,
                                                                                                     minibatches)
    replay = {"r2": old_routing, "r3": engine_routing}.get(algo.routing_replay)

    # 4. minibatch updates
    objective = OBJECTIVES[algo.loss]
    sums: dict[str, float] = {}
    grad_norms, skipped = [], 0
    # MoE routing is captured where it is used (replay; volatility against π_old's routing), over the full [N, S+T]
    # layout, and then every π_θ forward keeps that layout too, so the first minibatch's ratios stay exactly 1. Without
    # either (dense, or old_logprobs=rollout and no replay) the forwards trim padding and install no hooks.
    full_layout = ctx.moe and (old_routing is not None or replay is not None)
    for k, mb in enumerate(minibatches):
        capture = _routing_capture(ctx, model, replay, mb) if full_layout else contextlib.nullcontext(None)
        with capture as cap, amp():
            logprobs, entropy = completion_logprobs(model, *_rows(batch, mb), temperature=ro.temperature,
                                                    with_entropy=k == 0, trim_padding=not full_layout)
        if cap is not None and old_routing is not None and k == len(minibatches) - 1 and k > 0:
            # §5.3 volatility, measured for free on the last minibatch: after the step's k updates, the fraction of its
            # tokens' expert activations that the router now picks differently from π_old's (whatever is replayed)
            chosen = cap.take().chosen.view(old_routing[mb].shape)
            sums["expert_volatility"] = routing_change(old_routing[mb], chosen, token_mask[mb])
        if k == 0 and algo.old_logprobs == "rollout":  # same weights: trainer vs engine numerics alone (§5.4)
            sums.update(_precision_ratio_metrics(logprobs.detach(), old_logprobs[mb], mask[mb]))
        loss, m = objective(logprobs, old_logprobs[mb], advantages[mb], mask[mb],
                            eps_low=algo.eps_low, eps_high=algo.eps_high)
        loss = loss * ctx.dist.loss_scale(algo.loss, mask[mb])  # gradient averaging over processes = 1 process
        if ctx.ref_model is not None and algo.kl_beta > 0:
            with torch.no_grad(), amp():
                ref_logprobs, _ = completion_logprobs(ctx.ref_model, *_rows(batch, mb), temperature=ro.temperature,
                                                      trim_padding=True)
            kl = kl_to_reference(logprobs, ref_logprobs, mask[mb])
            loss = loss + algo.kl_beta * kl
            m["kl_ref"] = float(kl.detach())
        if entropy is not None:
            m["entropy"] = float(entropy[mask[mb]].mean())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip else float("inf"))
        if ctx.dist.all_finite(loss, grad_norm):  # every process steps, or none does
            optimizer.step()
            grad_norms.append(float(grad_norm))
        else:  # never let a non-finite update touch the weights
            skipped += 1
        with warnings.catch_warnings():  # torch warns when the schedule steps before the (skipped) first update
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        m["loss"] = float(loss.detach())
        for key, v in m.items():
            sums[key] = sums.get(key, 0.0) + v / algo.minibatches
        if k == 0:  # the on-policy minibatch: when π_old is recomputed its ratios are exactly 1 and nothing is clipped
            sums["clip_frac_tokens_first_mb"] = m["clip_frac_tokens"]
    if "entropy" in sums:
        sums["entropy"] *= algo.minibatches  # logged from the first minibatch only
    sums = ctx.dist.mean_metrics(sums)
    ctx.engine.update_weights(model)
    t_total = time.perf_counter() - t0

    lengths = batch.completion_mask.sum(-1).float()
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": reward_stats.pop("solved") / len(batch),  # solved as rewards.accuracy_reward says
        "response_length": float(lengths.mean()),
        "truncation_rate": float(batch.truncated.float().mean()),
        "zero_variance_groups": float(zero_variance_groups(rewards, ro.group_size).float().mean()),
        **sums,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
        "skipped_updates": float(skipped),
        "lr": scheduler.get_last_lr()[0],
        "tokens_per_second": float(lengths.sum()) / t_total,
        "time_rollout": t_rollout,
        "time_update": t_total - t_rollout,
        **reward_stats,
    }
    if algo.old_logprobs == "recompute":  # how far the engine's π_old is from the trainer's (precision mismatch)
        diff = (batch.logprobs - old_logprobs)[mask].abs()
        metrics["rollout_logprob_diff"] = float(diff.mean())
        metrics.update(_precision_ratio_metrics(old_logprobs, batch.logprobs, mask))
    if engine_routing is not None and old_routing is not None:  # R3's train–inference routing discrepancy
        metrics["rollout_routing_mismatch"] = routing_change(engine_routing, old_routing, token_mask)
    return metrics


# ------------------------------------------------------------------------------------------------------------ train


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run: where it stopped and the checkpoint a `--resume` would continue from."""

    def __init__(self, out: Path, step: int | None, checkpoint_step: int | None) -> None:
        super().__init__(f"interrupted in {out}")
        self.out, self.step, self.checkpoint_step = out, step, checkpoint_step


def _start_checks(cfg: Config, out: Path, cfg_dict: dict, resume: bool, overwrite: bool) -> list[str]:
    """What can be checked before any model is built, so that a bad setting costs nothing and leaves nothing behind:
    the output folder, whether it holds a run, what a resume changes (returned), the trackers' packages."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in trainer.out and --overwrite deletes it: pass one of them")
    check_output_dir(out)
    if run_started(out) and not resume and not overwrite:
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, --overwrite to delete it and "
                          "start over, or choose another trainer.out")
    changed = check_resume_config(out, cfg_dict) if resume else []
    try:
        check_trackers(wandb=cfg.log.wandb, mlflow=cfg.log.mlflow)
    except ImportError as e:
        raise ConfigError(f"log.{e.name}: {e}") from None
    return changed


def _plot_run(cfg: Config, out: Path, evals: list[dict]) -> None:
    """OUT/curves.png: training reward, held-out accuracy and clip fraction vs step (a plotting failure is logged,
    never fatal: the numbers are in metrics.jsonl and eval.jsonl)."""
    if not (out / "metrics.jsonl").exists():
        return
    source = cfg.data.task or Path(cfg.data.path).name
    try:
        plot_curves(out / "metrics.jsonl", out / "curves.png", extra=evals,
                    keys=["reward_mean", "heldout_accuracy", "clip_frac_tokens"],
                    title=f"{cfg.algorithm.loss} on {Path(cfg.model.name).name} / {source}")
    except Exception as e:
        log.warning("could not draw %s: %s", out / "curves.png", e)


def _format_samples(step: int, samples: list[dict]) -> str:
    """Sample completions as a Markdown table (TensorBoard's text tab renders it)."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", "⏎")

    lines = [f"held-out samples at step {step}", "", "| prompt | completion | reward | correct |", "|---|---|---|---|"]
    lines += [f"| {cell(x['prompt'])} | {cell(x['completion'])} | {x['reward']:.3g} | {x['correct']} |"
              for x in samples]
    return "\n".join(lines)


def train(cfg: Config, resume: bool = False, stop_after: int | None = None, overwrite: bool = False) -> dict:
    """Run (or resume) a GSPO training run as configured; returns the summary (also written to OUT/summary.json).

    Everything that can be checked without compute is checked first (the output folder, the data and its held-out
    rows, the reward functions against a data row, the trackers), then the model is built and checked; only then
    is anything written, so a start that fails leaves nothing that blocks the corrected command (`gspo.runfolder`).
    `overwrite` deletes a previous run in trainer.out first; `resume` continues it (a config that differs only in
    `gspo.runfolder.RESUMABLE` settings is accepted, e.g. more `trainer.steps` to extend a finished run).

    `stop_after` (for tests: an interruption at a known point) returns as a crash would right after step
    `stop_after` (counted from the start of the run, not of this call) was logged and, if the schedule says so,
    checkpointed: no OUT/final/ and no summary.json are written; the return value is {"stopped_after": step}.
    `train(cfg, resume=True)` then continues from the latest checkpoint (or starts over when there is none yet).

    Raises TrainingError (after writing summary.json with status "failed") when `trainer.max_bad_steps` consecutive
    steps had all their updates skipped for a non-finite loss or gradient norm; CheckpointError when a checkpoint
    cannot be written (earlier checkpoints stay intact and resumable); RunInterrupted on Ctrl-C.
    """
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1, got {stop_after}")
    wall0 = time.perf_counter()
    par = init_distributed(cfg.trainer.parallel, cfg.trainer.device)  # torchrun's processes, or just this one
    out = Path(cfg.trainer.out)
    cfg_dict = config_to_dict(cfg)
    changed = par.main_first(lambda: _start_checks(cfg, out, cfg_dict, resume, overwrite))
    data = load_data(cfg.data, cfg.trainer.seed)
    rewards = RewardRunner(cfg.rewards.functions, on_error=cfg.rewards.on_error, timeout_s=cfg.rewards.timeout_s,
                           workers=cfg.rewards.workers)
    rewards.check_rows(data.train)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    set_seed(cfg.trainer.seed)

    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                                  seed=cfg.trainer.seed)
    if cfg.trainer.gradient_checkpointing:  # train-mode forwards only: the sampler (eval mode) keeps its KV cache
        try:
            enable_gradient_checkpointing(model)
        except ValueError as e:
            raise ConfigError(f"trainer.gradient_checkpointing: {e}") from None
    for key, lr in [("optim.lr", cfg.optim.lr)] + ([("cold_start.lr", cfg.cold_start.lr)] if cfg.cold_start else []):
        try:  # bf16/fp16 weights that an AdamW step of this size cannot move: refused before any compute
            check_update_precision([p for p in model.parameters() if p.requires_grad], lr)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if cfg.algorithm.routing_replay != "none":  # a hub model's family is only known now: fail before any compute
        try:
            require_replay_support(model, cfg.algorithm.routing_replay)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        par.check_sizes(cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.algorithm.minibatches)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ro = cfg.rollout
    eval_tokens = cfg.trainer.eval_max_new_tokens or ro.max_new_tokens
    train_rows, skipped_train = drop_long_prompts(data.train, tokenizer,
                                                  prompt_token_limit(cfg, model, ro.max_new_tokens), "training")
    eval_rows, skipped_eval = [], 0
    if data.heldout:
        eval_rows, skipped_eval = drop_long_prompts(data.heldout, tokenizer,
                                                    prompt_token_limit(cfg, model, eval_tokens), "held-out")
    heldout_source = {**data.heldout_source, "rows": len(eval_rows)} if eval_rows else {"kind": "none"}
    unknown = {"train": unknown_character_rows(tokenizer, train_rows, "training",
                                               ("prompt", "solution") if cfg.cold_start else ("prompt",)),
               "eval": unknown_character_rows(tokenizer, eval_rows, "held-out")}

    # every check passed: from here on the run writes into its folder
    if par.is_main:
        if overwrite:
            removed = clear_run(out)
            if removed:
                log.info("--overwrite: deleted %s from %s", ", ".join(removed), out)
        if changed:
            log.info("resuming with changed settings: %s", ", ".join(changed))
        write_atomic(out / "config.yaml", yaml.safe_dump(cfg_dict, sort_keys=False))
    par.barrier()
    model = par.place(model)

    checkpoint = par.main_first(lambda: find_latest_checkpoint(out)) if resume else None  # rank 0 repairs first
    # on a resume the checkpoint's weights replace the cold-start ones, but the KL reference is the cold-start model
    cold_start = None  # rank 0 trains and saves it; the other processes then load it
    if cfg.cold_start is not None:
        cold_start = par.main_first(lambda: cold_start(cfg, out, model, tokenizer, train_rows))
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algorithm.kl_beta > 0 else None

    total_updates = cfg.trainer.steps * cfg.algorithm.minibatches

    def build_optimizer(module):
        return make_optimizer(
            module, cfg.optim.lr, total_updates, weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas,
            warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio,
            cosine=cfg.optim.schedule == "cosine")

    optimizer, scheduler = build_optimizer(model)
    start, bad_steps = 0, 0  # bad_steps: consecutive steps whose updates were all skipped (non-finite)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, scheduler=scheduler)
        start, bad_steps = state["step"], state.get("bad_steps", 0)
        if start > cfg.trainer.steps:
            raise ConfigError(f"trainer.steps={cfg.trainer.steps} is below the step of the checkpoint to resume from "
                              f"({start}, {checkpoint}): a resume can extend a run, not shorten it")
        wall0 -= state.get("wall_seconds", 0.0)  # the run's wall time up to that checkpoint (not the lost work after)
        # counts up to the checkpoint, so that the summary covers the whole run, not just this process
        rewards.failures.update(state.get("reward_failures", {}))
        rewards.timeouts.update(state.get("reward_timeouts", {}))
        log.info("resumed from %s at step %d", checkpoint, start)
    elif resume:
        log.info("no checkpoint in %s yet: starting the run over", out)

    par.watch_counters(rewards)  # the run's reward-failure totals so far (restored from the checkpoint)
    engine = make_engine(cfg, model, tokenizer, out=out, dist=par)  # before wrapping: it may copy the full model
    greedy = eval_sampler(cfg, engine, model, tokenizer, eval_tokens)
    moe = is_moe(model)
    model, optimizer, scheduler = par.wrap(model, optimizer, scheduler, build_optimizer,
                                           cfg.trainer.mixed_precision)  # DDP / FSDP2; one process: as is
    ref_model = par.wrap_frozen(ref_model, cfg.trainer.mixed_precision)
    ctx = RLStep(cfg, engine, rewards, ref_model, moe=moe, dist=par)
    logger = MetricsLogger(out, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, mlflow=cfg.log.mlflow,
                           resume_step=start if resume else None, run_config=cfg_dict) if par.is_main else NullLogger()
    # evaluations (and their sample completions) up to the checkpoint are kept; a run restarting at 0 redoes step 0
    evals, samples = ([r for r in read_metrics(out / name) if r["step"] <= start]
                      if start > 0 and (out / name).exists() else [] for name in ("eval.jsonl", "samples.jsonl"))

    def run_eval(step: int) -> dict[str, float]:
        shown: list[dict] = []
        scores = par.evaluate(lambda part: evaluate(
            model, tokenizer, part, rewards, eval_tokens, sampler=greedy, accuracy_reward=cfg.rewards.accuracy_reward,
            accuracy_threshold=cfg.rewards.accuracy_threshold, samples=shown, n_samples=cfg.log.samples),
            eval_rows, rewards)  # sharded over the processes (rank 0 holds the first rows: its samples)
        result = {f"heldout_{k}": v for k, v in scores.items()}
        evals.append({"step": step, **result})
        if par.is_main:
            write_jsonl(out / "eval.jsonl", evals)
            if shown:
                samples.extend({"step": step, **x} for x in shown)
                write_jsonl(out / "samples.jsonl", samples)
                logger.log_text(step, "heldout_samples", _format_samples(step, shown))
        return result

    done = start
    progress = Progress(total=cfg.trainer.steps, initial=start, every=cfg.log.progress_every,
                        disable=None if cfg.log.progress and par.is_main else True,
                        keys=("reward_mean", "heldout_accuracy", "clip_frac_tokens"))
    try:
        if start == 0 and eval_rows:
            run_eval(0)
        for step in range(start, cfg.trainer.steps):
            metrics = rl_step(step, model, optimizer, scheduler, train_rows, ctx)
            done = step + 1
            # the last step is always evaluated: the summary's accuracy after RL must be measured after RL
            if eval_rows and (done == cfg.trainer.steps or (cfg.trainer.eval_every
                                                            and done % cfg.trainer.eval_every == 0)):
                metrics.update(run_eval(done))
            logger.log(done, metrics)
            progress.update(done, metrics)
            bad_steps = bad_steps + 1 if metrics["skipped_updates"] == cfg.algorithm.minibatches else 0
            if cfg.trainer.checkpoint_every and (done % cfg.trainer.checkpoint_every == 0 or done == cfg.trainer.steps):
                with par.full_state(model, optimizer) as (full_model, full_optimizer):  # None but on rank 0
                    if full_model is not None:
                        save_checkpoint(out, done, model=full_model, tokenizer=tokenizer, optimizer=full_optimizer,
                                        scheduler=scheduler,
                                        state={"step": done, "data_position": done * ro.prompts_per_step,
                                               "bad_steps": bad_steps, "reward_failures": dict(rewards.failures),
                                               "reward_timeouts": dict(rewards.timeouts),
                                               "wall_seconds": time.perf_counter() - wall0},
                                        keep_last=cfg.trainer.keep_checkpoints)
            if cfg.trainer.max_bad_steps is not None and bad_steps >= cfg.trainer.max_bad_steps:
                error = (f"stopped at step {done}: the last {bad_steps} steps (trainer.max_bad_steps) had every update "
                         f"skipped for a non-finite loss or gradient norm, so the weights stopped changing; "
                         f"lower optim.lr, keep optim.grad_clip, or check the rewards and the model's dtype")
                if par.is_main:
                    write_atomic(out / "summary.json", json.dumps({
                        "status": "failed", "error": error, "steps_done": done, "steps": cfg.trainer.steps,
                        "skipped_updates": _skipped_updates(out), "wall_seconds": time.perf_counter() - wall0,
                    }, indent=2))
                    _plot_run(cfg, out, evals)
                raise TrainingError(error)
            if stop_after is not None and done >= stop_after and done < cfg.trainer.steps:
                return {"stopped_after": done}
    except KeyboardInterrupt:
        latest = find_latest_checkpoint(out)
        raise RunInterrupted(out, done, None if latest is None else int(latest.name.split("_")[-1])) from None
    finally:
        progress.close()
        logger.close()

    final_tmp = out / ".final.tmp"
    with par.full_state(model) as (full_model, _):
        if full_model is not None:
            shutil.rmtree(final_tmp, ignore_errors=True)
            save_model(full_model, tokenizer, final_tmp)
            publish_dir(final_tmp, out / "final")
    if par.is_main:
        _plot_run(cfg, out, evals)
    summary = {
        "status": "completed",
        "heldout_accuracy_before_rl": evals[0]["heldout_accuracy"] if evals else None,
        "heldout_accuracy_after_rl": evals[-1]["heldout_accuracy"] if evals else None,
        "heldout": {**heldout_source,
                    "accuracy": f"{cfg.rewards.accuracy_reward} >= {cfg.rewards.accuracy_threshold:g}"},
        "steps": cfg.trainer.steps,
        "cold_start": cold_start,
        "wall_seconds": time.perf_counter() - wall0,
        "reward_failures": dict(rewards.failures),
        "reward_timeouts": dict(rewards.timeouts),
        "skipped_updates": _skipped_updates(out),
        "skipped_prompts": {"train": skipped_train, "eval": skipped_eval},
        "unknown_character_rows": unknown,
    }
    if par.is_main:
        write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    par.barrier()  # no process returns before the final model and summary exist
    return summary


def _skipped_updates(out: Path) -> int:
    """Optimizer updates skipped (non-finite) over the whole run, from metrics.jsonl (which survives resumes; None
    where this process cannot see it, e.g. a rank on another machine)."""
    path = out / "metrics.jsonl"
    return int(sum(r.get("skipped_updates") or 0 for r in read_metrics(path))) if path.exists() else None

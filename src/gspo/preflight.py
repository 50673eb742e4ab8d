"""`gspo train CONFIG --check`: what a run would check and do, before any GPU hour is spent on it.

It runs the set-up a run runs (`gspo.trainer.prepare`: the config, the output folder and a resume's settings, the data
and its held-out rows, the rewards' signatures and routes, the model, the chat template, the prompts' lengths) and
then reports, computing nothing and writing nothing:

- the rows: how many train and are held out (of how many), their prompts' lengths in tokens against the limit, their
  solutions' lengths against the new-token budget (a budget that cannot hold the answers cuts every one off), the
  held-out groups, how wide a 95 % interval of held-out accuracy can be on that many rows, and the held-out rows
  that share an 8-word passage with a training prompt (`shared_passages`: a problem reworded or copied between
  datasets, which the split's check of equal prompts cannot see);
- **the rewards on known answers** (`gspo.rewards.checks`, which every run also does): each row's own reference
  (its `solution`, else its `answer`) should be judged solved, an empty completion and another row's different
  reference should not. A verifier that rejects the gold answers (a format it cannot parse) makes RL learn nothing;
  one that accepts an empty or a wrong answer makes every reported accuracy meaningless — both are found here in
  seconds instead of after a run;
- the plan: steps, completions, generated tokens at most, optimizer steps, evaluations, checkpoints, the model's
  parameters, and what the run folder takes on disk against the free space there.

`warnings` lists what makes the run's numbers doubtful; `gspo train --check` exits 1 when there is any.
"""

from __future__ import annotations

import copy
import math
import re
import shutil
import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gspo.config import Config
from gspo.evaluation import wilson_ci95
from gspo.optim import warmup_warning
from gspo.rewards.checks import split_warnings
from gspo.sft import pretrained_lr_warning

__all__ = ["MEASURE_STEPS", "PASSAGE_WORDS", "check", "checkpoint_bytes", "format_report", "measure", "plan",
           "shared_passages", "warnings"]

PASSAGE_WORDS = 8
"""How many consecutive words a held-out prompt must share with a training prompt to be reported (open-r1's
decontamination uses 8-grams too)."""


def _passages(text: str, n: int) -> list[tuple[str, ...]]:
    """`text`'s passages of `n` consecutive words (case-folded), the i-th starting at its i-th word."""
    words = re.findall(r"\w+", text.casefold())
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def shared_passages(train_rows: Sequence[dict], eval_rows: Sequence[dict], n: int = PASSAGE_WORDS) -> dict[str, Any]:
    """Held-out rows that share a passage of `n` consecutive words (case-folded) with a training prompt: the same
    problem reworded, or copied between datasets, which the split check (equal prompts up to case and whitespace,
    `gspo.data.near_key`) cannot see. A passage in more than max(5, 1 %) of the training or of the held-out rows is
    a template (a system prompt, an instruction every row carries); a shared passage counts only where it has no word
    of a template (so "…the very end. Problem 12" is not one problem). Returns `rows` (how many held-out rows share
    one) and up to three `examples` (held-out row among `eval_rows` and its prompt's start, training row, the
    passage: the held-out file's own numbering differs once training prompts are dropped from it)."""
    held = [_passages(r["prompt"], n) for r in eval_rows]
    wanted = {g for grams in held for g in grams}
    in_train: Counter = Counter()
    first: dict[tuple[str, ...], int] = {}
    for j, row in enumerate(train_rows):
        for gram in set(_passages(row["prompt"], n)) & wanted:
            in_train[gram] += 1
            first.setdefault(gram, j)
    in_held = Counter(g for grams in held for g in set(grams))
    template = {g for g in wanted if in_train[g] > max(5, len(train_rows) // 100)
                or in_held[g] > max(5, len(eval_rows) // 100)}
    found = []
    for i, grams in enumerate(held):
        covered = {k for start, g in enumerate(grams) if g in template for k in range(start, start + n)}
        shared = [g for start, g in enumerate(grams) if g in first and g not in template
                  and covered.isdisjoint(range(start, start + n))]
        if shared:
            found.append({"heldout_row": i, "heldout_prompt": eval_rows[i]["prompt"][:80],
                          "training_row": first[shared[0]], "passage": " ".join(shared[0])})
    return {"words": n, "rows": len(found), "examples": found[:3]}


def plan(cfg: Config, train_rows: int, eval_rows: int) -> dict[str, Any]:
    """What `cfg` (trainer.steps resolved) will do: completions sampled and trained on, new tokens generated at most,
    optimizer steps, the steps it evaluates at and checkpoints at (as `gspo.trainer.train` schedules them)."""
    t, ro, al = cfg.trainer, cfg.rollout, cfg.algorithm
    steps = t.steps
    new_tokens = cfg.env.max_tokens if cfg.env else ro.max_new_tokens
    evals = sorted({0, steps, *(range(t.eval_every, steps + 1, t.eval_every) if t.eval_every else ())}) \
        if eval_rows else []
    checkpoints = sorted({steps, *range(t.checkpoint_every, steps + 1, t.checkpoint_every)}) \
        if t.checkpoint_every and steps else []
    completions = steps * ro.prompts_per_step * ro.group_size
    return {"steps": steps, "prompts_per_step": ro.prompts_per_step, "group_size": ro.group_size,
            "completions": completions, "at_least": ro.dynamic_sampling,
            "passes": steps * ro.prompts_per_step / train_rows, "new_tokens_per_completion": new_tokens,
            "generated_tokens_max": completions * new_tokens,
            "optimizer_steps": steps * al.minibatches * al.epochs, "warmup_steps": cfg.optim.warmup_steps,
            "evaluations": evals,
            "eval_tokens_max": len(evals) * eval_rows * cfg.trainer.eval_samples
            # an episode is capped by env.max_tokens whatever a turn's budget (eval_max_new_tokens is one turn's)
            * (new_tokens if cfg.env else cfg.trainer.eval_max_new_tokens or new_tokens),
            "checkpoints": checkpoints, "checkpoints_kept": min(len(checkpoints), t.keep_checkpoints)}


def checkpoint_bytes(model: nn.Module) -> tuple[int, int, int, int]:
    """(parameters, trainable parameters, bytes of the weights as saved, bytes of a checkpoint): a LoRA model saves
    its adapters only; a checkpoint adds AdamW's two moments per trainable weight (`gspo.checkpoint`), to within its
    small files."""
    params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    adapters = hasattr(model, "peft_config")
    saved = trainable if adapters else list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in saved)
    return params, sum(p.numel() for p in trainable), weights, weights + 2 * sum(p.numel() * p.element_size()
                                                                                  for p in trainable)


def disk_needed(cfg: Config, weights: int, checkpoint: int, checkpoints: int, full: int | None = None) -> int:
    """Bytes a run's folder holds at most: of its `checkpoints`, trainer.keep_checkpoints and the one being written
    before the oldest is pruned; the final model, and OUT/best and OUT/cold_start when configured. The final and best
    models are saved `weights` (a LoRA run: its adapters, plus the merged model with lora.merged_final); the cold start
    is a whole model, `full` bytes (default `weights`: no LoRA). Logs, metrics and a guard's extra checkpoints are not
    counted."""
    full = weights if full is None else full
    keep = cfg.trainer.keep_checkpoints
    held = checkpoints if checkpoints <= keep else keep + 1
    lora = cfg.model.lora
    model = weights + (full if lora is not None and lora.merged_final else 0)  # final/, best/
    return held * checkpoint + (1 + cfg.trainer.save_best) * model + (cfg.cold_start is not None) * full


def _free_bytes(out: Path) -> int:
    """Free bytes on the file system that holds `out` (or would: its nearest existing folder)."""
    return shutil.disk_usage(next(p for p in [out, *out.parents] if p.exists())).free


def check(cfg: Config, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Run `gspo.trainer.prepare` and report what it found and what the run would do (module docstring). Raises as
    the run would (ConfigError / ValueError / OSError) on anything that would stop it; writes nothing."""
    from gspo.lora import apply_lora
    from gspo.sft import demonstration_format, over_positions
    from gspo.trainer import check_rewards, prepare

    setup = prepare(cfg, resume=resume, overwrite=overwrite, create_out=False)
    cfg, tokenizer, rewards = setup.cfg, setup.tokenizer, setup.rewards
    full = checkpoint_bytes(setup.model)[2]  # the whole model's weights (a cold start, LoRA's merged model)
    model = setup.model if cfg.model.lora is None else apply_lora(setup.model, cfg.model.lora)
    params, trainable, weights, size = checkpoint_bytes(model)
    accuracy, threshold = cfg.rewards.accuracy_reward, cfg.rewards.accuracy_threshold

    def lengths(rows: list[dict], field: str = "prompt", budget: int | None = None) -> dict[str, int] | None:
        """Token counts of the rows' text `field` (min, median, 95th percentile, max, rows); with `budget`, how many
        need more than it with their end token (`over`)."""
        texts = [r[field] for r in rows if isinstance(r.get(field), str)]
        if not texts:
            return None
        n = sorted(len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"])
        found = {"min": n[0], "median": int(statistics.median(n)), "p95": n[math.ceil(0.95 * len(n)) - 1],
                 "max": n[-1], "rows": len(n)}
        return found if budget is None else {**found, "budget": budget, "over": sum(k + 1 > budget for k in n)}

    heldout_n = len(setup.eval_rows)
    low, high = wilson_ci95(heldout_n // 2, heldout_n) if heldout_n else (math.nan, math.nan)
    steps = plan(cfg, len(setup.train_rows), heldout_n)
    train_lengths = lengths(setup.train_rows)
    share = (cfg.rollout.prompts_per_step * cfg.rollout.group_size  # one process's rows of an update
             // (cfg.algorithm.minibatches * setup.group.world_size))
    latest = setup.checkpoint
    cs = cfg.cold_start
    demonstrated = [r for r in setup.train_rows if isinstance(r.get("solution"), (str, list))]
    too_long = len(over_positions(model, tokenizer, demonstrated,
                                  chat_format=demonstration_format(cfg, tokenizer, demonstrated))
                   if cs is not None else [])
    return {
        "env": None if setup.make_env is None else reset_sample(setup),
        "config": {"out": str(setup.out), "resume": resume, "changed": setup.changed,
                   "resume_from": None if latest is None else latest.name},
        "cold_start": None if cs is None else {"steps_max": cs.steps, "batch_size": cs.batch_size, "lr": cs.lr,
                                               "target_loss": cs.target_loss, "rows": len(demonstrated),
                                               "over_positions": too_long},
        "train": {**setup.train_source, "prompt_tokens": train_lengths,
                  "solution_tokens": lengths(setup.train_rows, "solution", steps["new_tokens_per_completion"]),
                  "prompt_limit": setup.prompt_limits[0], "skipped_long": setup.skipped_prompts["train"],
                  "unscorable": setup.unscorable_rows["train"], "unknown_characters": setup.unknown["train"]},
        "heldout": {**setup.heldout_source, "prompt_tokens": lengths(setup.eval_rows),
                    "solution_tokens": lengths(setup.eval_rows, "solution", setup.eval_tokens),
                    "prompt_limit": setup.prompt_limits[1], "skipped_long": setup.skipped_prompts["eval"],
                    "unscorable": setup.unscorable_rows["eval"], "unknown_characters": setup.unknown["eval"],
                    "groups": dict(Counter(setup.eval_group)) if setup.eval_group is not None else None,
                    "ci95_half_width": (high - low) / 2 if heldout_n else None,
                    "shared_passages": shared_passages(setup.train_rows, setup.eval_rows)},
        "rewards": {"functions": dict(zip(rewards.names, rewards.weights, strict=True)), "accuracy": accuracy,
                    "threshold": threshold, **check_rewards(setup),
                    "deadline": setup.reward_deadline},
        "plan": steps,
        "model": {"name": cfg.model.name, "parameters": params, "trainable": trainable,
                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                  "attention": getattr(model.config, "_attn_implementation", None),
                  "checkpoint_bytes": size,
                  "disk_bytes": disk_needed(cfg, weights, size, len(steps["checkpoints"]), full),
                  "disk_free_bytes": _free_bytes(setup.out),
                  "update_rows": share,
                  "update_row_tokens_max": train_lengths["max"] + steps["new_tokens_per_completion"],
                  "micro_batch_tokens": cfg.trainer.micro_batch_tokens},
    }


ENV_SAMPLE = 8
"""Training and held-out rows each on which `--check` resets an environment."""


def reset_sample(setup) -> dict[str, Any]:
    """An environment reset on the first `ENV_SAMPLE` training and held-out rows, as an episode would be (a copy of
    the row): a reset that raises or returns no prompt raises ValueError naming the row, as the run would at its
    first rollout after the model was built; the reset prompts' token lengths against the run's prompt limit."""
    cfg, tokenizer = setup.cfg, setup.tokenizer
    found: dict[str, Any] = {"name": cfg.env.name, "parser": cfg.env.parser if cfg.env.name == "tools" else None}
    for rows, name, limit in ((setup.train_rows, "training", setup.prompt_limits[0]),
                              (setup.eval_rows, "held-out", setup.prompt_limits[1])):
        lengths = []
        for i, row in enumerate(rows[:ENV_SAMPLE]):
            try:
                prompt = setup.make_env().reset(copy.deepcopy(row))
            except Exception as exc:
                raise ValueError(f"env.name={cfg.env.name}: reset failed on {name} row {i} ({type(exc).__name__}: "
                                 f"{exc})") from exc
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"env.name={cfg.env.name}: reset returned {prompt!r:.80} for {name} row {i}, not a "
                                 "prompt string")
            lengths.append(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        if lengths:
            found[name] = {"rows": len(lengths), "max": max(lengths), "limit": limit,
                           "over": sum(limit is not None and n > limit for n in lengths)}
    found["unwritable_calls"] = unwritable_calls(cfg, tokenizer, setup.tool_schemas or [])
    return found


CALL_EXAMPLES = {"hermes": '<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>', "call": "{name}(1)"}
"""A call of each `env.parser` format, its tool's name in `{name}`."""


def unwritable_calls(cfg: Config, tokenizer, schemas: list[dict]) -> list[str]:
    """The tools whose call in `env.parser`'s format has characters the tokenizer cannot encode (its unknown token):
    the policy can never write it, so the tool is never used and nothing else says so (hermes with a character
    vocabulary that has no `<`, `{` or `"`)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if cfg.env.name != "tools" or unk is None:
        return []
    names = [s["function"]["name"] for s in schemas]
    calls = [CALL_EXAMPLES[cfg.env.parser].format(name=n) for n in names]
    ids = tokenizer(calls, add_special_tokens=False)["input_ids"] if calls else []
    return [n for n, i in zip(names, ids, strict=True) if unk in i]


MEASURE_STEPS = 5
"""RL steps `measure` times (the first pays for warm-up; the others' medians give the time per step)."""


def measure(cfg: Config, planned: dict[str, Any], steps: int = MEASURE_STEPS) -> dict[str, Any]:
    """Time `steps` RL steps of `cfg` in a temporary folder, then the duration of the run `planned` (`plan`) at that
    pace: the policy is the model as loaded (no cold start), nothing is checkpointed or logged beyond metrics, and
    trainer.out is not touched. Returns the median seconds per step after the first (rollout and update), the first
    step's, an evaluation's (the held-out rows, at the last step), the completions' mean length, and
    `run_seconds`: the first step + the others at the measured pace + the planned evaluations (not the cold
    start)."""
    from gspo.tracking import read_metrics
    from gspo.trainer import train

    t = cfg.trainer
    with tempfile.TemporaryDirectory(prefix="gspo-measure-") as tmp:
        trial = cfg.model_copy(update={
            "cold_start": None,
            "trainer": t.model_copy(update={"out": tmp, "steps": steps, "epochs": None, "eval_every": 0,
                                            "checkpoint_every": 0, "save_best": False}),
            "rewards": cfg.rewards.model_copy(update={"check": False}),
            "log": cfg.log.model_copy(update={"tensorboard": False, "wandb": None, "mlflow": None, "progress": False,
                                              "samples": 0, "rollouts": 0})})
        train(trial)
        records = read_metrics(Path(tmp) / "metrics.jsonl")
    later = records[1:] or records
    rollout = statistics.median(r["time_rollout"] for r in later)
    update = statistics.median(r["time_update"] for r in later)
    evaluation = records[-1].get("time_eval")
    first = records[0]["time_rollout"] + records[0]["time_update"]
    return {"steps": steps, "step_seconds": rollout + update, "rollout_seconds": rollout, "update_seconds": update,
            "first_step_seconds": first, "eval_seconds": evaluation,
            "response_length": statistics.fmean(r["response_length"] for r in records),
            "run_seconds": first + (planned["steps"] - 1) * (rollout + update)
            + len(planned["evaluations"]) * (evaluation or 0.0)}


def warnings(report: dict[str, Any]) -> list[str]:
    """What in a `check` report makes the run's numbers doubtful: references judged wrong, empty or wrong answers
    judged right, no held-out rows, prompts dropped as too long."""
    found = split_warnings(report["rewards"])
    if report["rewards"].get("deadline"):
        found.append(report["rewards"]["deadline"])
    shared = report["heldout"]["shared_passages"]
    if shared["rows"]:
        e = shared["examples"][0]
        found.append(f"{shared['rows']} held-out rows share a passage of {shared['words']} words with a training "
                     f"prompt (e.g. held-out row {e['heldout_row']} of those evaluated, {e['heldout_prompt']!r}, and "
                     f"training row {e['training_row']}: {e['passage']!r}): the same problem reworded or copied is not "
                     "held out; only prompts equal up to case and whitespace are left out")
    if note := warmup_warning(report["plan"]["warmup_steps"], report["plan"]["optimizer_steps"]):
        found.append(note)
    if unwritable := (report.get("env") or {}).get("unwritable_calls"):
        found.append(f"the tokenizer cannot write a call of {', '.join(unwritable)} in env.parser="
                     f"{report['env']['parser']}'s format (characters it encodes as its unknown token): the policy "
                     "can never call them (another env.parser, e.g. call)")
    for name, r in ((report.get("env") or {}).items()):
        if isinstance(r, dict) and r["over"]:
            found.append(f"the environment's reset prompts of {r['over']} of {r['rows']} sampled {name} rows are "
                         f"longer than the {r['limit']} tokens a prompt may have (up to {r['max']}); a reset prompt "
                         "that leaves less than env.max_tokens of the model's positions stops the run, naming its row")
    if (cs := report["cold_start"]) and (note := pretrained_lr_warning(report["model"]["name"], cs["lr"])):
        found.append(note)
    if (cs := report["cold_start"]) and cs["over_positions"]:
        found.append(f"{cs['over_positions']} of {cs['rows']} training rows' prompt + solution are longer than the "
                     "model's positions (max_position_embeddings): the cold start leaves them out")
    m = report["model"]
    if m["disk_bytes"] > m["disk_free_bytes"]:
        found.append(f"the run's checkpoints and models take up to ≈ {_size(m['disk_bytes'])} and "
                     f"{report['config']['out']} has {_size(m['disk_free_bytes'])} free: a checkpoint will fail to be "
                     "written (trainer.keep_checkpoints, trainer.checkpoint_every, or another trainer.out)")
    if report["heldout"].get("kind") == "none":
        found.append("no held-out rows: the run reports training reward only, no held-out accuracy "
                     "(data.eval_split, data.eval_path or data.eval_fraction)")
    for split, name, key in (("train", "training", "rollout.max_new_tokens"),
                             ("heldout", "held-out", "trainer.eval_max_new_tokens")):
        t = report[split].get("solution_tokens")
        if t and t["over"] > t["rows"] / 100:
            found.append(f"{t['over']} of {t['rows']} {name} rows' solutions need more than {key}={t['budget']} "
                         f"tokens with their end token (the longest {t['max']}): completions like them are cut off "
                         "before they answer")
        if report[split].get("skipped_long"):
            found.append(f"{report[split]['skipped_long']} {name} prompts are longer than "
                         f"{report[split]['prompt_limit']} tokens and are left out")
        if report[split].get("unscorable"):
            found.append(f"{report[split]['unscorable']} {name} rows are left out: the rewards can never judge them "
                         "(the log names the first and why, e.g. code tests that are not Python)")
        if report[split].get("unknown_characters"):
            found.append(f"{report[split]['unknown_characters']} {name} rows have characters the tokenizer cannot "
                         "encode")
    return found


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


_KINDS = {"reference": "own answers", "empty": "empty completions", "neighbour": "other rows' answers"}


def format_report(report: dict[str, Any]) -> list[str]:
    """A `check` report as the lines `gspo train --check` prints."""
    from gspo.trainer import rows_line

    lines = []
    for split, name in (("train", "training"), ("heldout", "held-out")):
        s = report[split]
        line = f"{name} rows: {rows_line(s)}"
        if split == "train" and s.get("repeated_prompts"):
            line += f" ({s['repeated_prompts']} repeat an earlier row's prompt)"
        if s.get("prompt_tokens"):
            p = s["prompt_tokens"]
            limit = "no limit" if s["prompt_limit"] is None else f"limit {s['prompt_limit']}"
            line += (f"; prompts {p['min']}-{p['max']} tokens (median {p['median']}, 95th percentile {p['p95']}; "
                     f"{limit})")
        lines.append(line)
        if t := s.get("solution_tokens"):
            lines.append(f"  solutions {t['min']}-{t['max']} tokens (median {t['median']}, 95th percentile "
                         f"{t['p95']}): {t['over']} of {t['rows']} need more than the {t['budget']} new tokens")
    h = report["heldout"]
    if h.get("ci95_half_width") is not None:
        lines.append(f"  a held-out accuracy near 50 % on {h['rows']} rows has a 95 % interval of "
                     f"±{h['ci95_half_width'] * 100:.1f} points")
    if h.get("shared_passages") and h.get("rows"):
        lines.append(f"  held-out rows sharing an {h['shared_passages']['words']}-word passage with a training prompt: "
                     f"{h['shared_passages']['rows']}")
    if h.get("groups"):
        lines.append("  held-out groups: " + ", ".join(f"{g}: {n}" for g, n in h["groups"].items()))
    rw = report["rewards"]
    accuracy = rw["accuracy"] if isinstance(rw["accuracy"], str) else ", ".join(rw["accuracy"])
    lines.append(f"rewards: {', '.join(f'{n} × {w:g}' for n, w in rw['functions'].items())}; solved: {accuracy} "
                 f"≥ {rw['threshold']:g}")
    for split, name in (("train", "training"), ("heldout", "held-out")):
        r = rw[split]
        if r is None:
            lines.append(f"  {name} rows: no `solution` or `answer` to check the accuracy reward on")
            continue
        of = report[split]["rows"]
        sample = f" (a sample of {r['sampled']} of {of})" if r["sampled"] < of else ""
        if r["rows"] < r["sampled"]:
            sample = f" ({r['rows']} with a text {r['field']}{sample.replace(' (', ', ').rstrip(')')})"
        lines.append(f"  {name} rows{sample}: own {r['field']} judged solved {r['reference_solved']}/"
                     f"{r['rows']}; an empty completion {r['empty_solved']}/{r['rows']}; another row's {r['field']} "
                     f"{r['neighbour_solved']}/{r['neighbour_rows']}"
                     + ("; a function failed on " + ", ".join(f"{n} {_KINDS[kind]}" for kind, n in r["failed"].items()
                                                              if n)
                        if any(r["failed"].values()) else ""))
    timed = [r["seconds_per_completion"] for r in (rw["train"], rw["heldout"]) if r is not None]
    if timed:
        per, step = max(timed), report["plan"]["prompts_per_step"] * report["plan"]["group_size"]
        lines.append(f"  scoring took {per * 1e3:.2g} ms per completion here: ≈ {per * step:.2g} s per step of "
                     f"{step:,} completions")
    c = report["config"]
    if c["resume"]:
        lines.append(f"resume: from {c['resume_from'] or 'the start (no checkpoint yet)'}"
                     + (f"; changed settings: {', '.join(c['changed'])}" if c["changed"] else ""))
    if env := report.get("env"):
        sampled = [f"{name} rows: {r['rows']} reset, prompts ≤ {r['max']} tokens" for name, r in env.items()
                   if isinstance(r, dict)]
        lines.append(f"environment: {env['name']}; " + "; ".join(sampled))
    if cs := report["cold_start"]:
        until = f" (until the running loss reaches {cs['target_loss']:g})" if cs["target_loss"] else ""
        lines.append(f"cold start: SFT on the rows' solutions, ≤ {cs['steps_max']} steps × {cs['batch_size']} "
                     f"rows{until}")
    p = report["plan"]
    at_least = "at least " if p["at_least"] else ""
    lines.append(f"plan: {p['steps']} steps × {p['prompts_per_step']} prompts × {p['group_size']} completions = "
                 f"{at_least}{p['completions']:,} completions ({p['passes']:.2f} passes over the training rows)")
    lines.append(f"  ≤ {p['new_tokens_per_completion']} new tokens each (≤ {_count(p['generated_tokens_max'])} "
                 f"generated tokens), {p['optimizer_steps']:,} optimizer steps")
    evals = p["evaluations"]
    lines.append(f"  {len(evals)} evaluations" + (f" (steps {', '.join(map(str, evals[:3]))}"
                                                   f"{', ...' if len(evals) > 3 else ''}) of {h['rows']} rows "
                                                   f"(≤ {_count(p['eval_tokens_max'])} generated tokens)"
                                                   if evals else "")
                 + f", {len(p['checkpoints'])} checkpoints ({p['checkpoints_kept']} kept)")
    m = report["model"]
    lines.append(f"model: {m['name']}, {_count(m['parameters'])} parameters ({_count(m['trainable'])} trained), "
                 f"{m['dtype']}, {m['attention']} attention; a checkpoint ≈ {_size(m['checkpoint_bytes'])}; "
                 "the run's folder takes up to ≈ "
                 f"{_size(m['disk_bytes'])} ({_size(m['disk_free_bytes'])} free there)")
    if t := report.get("measured"):
        lines.append(f"measured ({t['steps']} steps of the model as loaded, no cold start): {t['step_seconds']:.3g} s "
                     f"per step (rollout {t['rollout_seconds']:.3g}, update {t['update_seconds']:.3g}; the first "
                     f"{t['first_step_seconds']:.3g})"
                     + (f", an evaluation {t['eval_seconds']:.3g} s" if t["eval_seconds"] is not None else "")
                     + f"; completions of {t['response_length']:.1f} tokens on average → the run ≈ "
                     f"{_duration(t['run_seconds'])} at that pace")
    budget = m["micro_batch_tokens"]
    rows, tokens = m["update_rows"], m["update_row_tokens_max"]
    lines.append(f"  an update forward: {rows} rows × ≤ {tokens} tokens = ≤ {rows * tokens:,} padded tokens"
                 + (f" (trainer.micro_batch_tokens={budget}: micro-batches of ≤ {budget})" if budget else ""))
    return lines

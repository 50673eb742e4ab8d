"""`gspo` command line: demo | train | sft | eval | compare | async-study. Configuration is validated before any
model is built."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import sys
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from gspo.config import SFT_LR, Config, ConfigError, accuracy_means, load_config

if TYPE_CHECKING:
    from gspo.rewards import RewardRunner


def demo_config_path() -> Path:
    """The packaged demo config (also at configs/demo.yaml in the repository)."""
    return Path(str(resources.files("gspo") / "configs" / "demo.yaml"))


def _cmd_train(args: argparse.Namespace) -> int:
    from gspo.parallel import shutdown
    from gspo.trainer import train

    cfg = load_config(args.config, args.overrides)
    if args.check or args.measure:
        return _check(cfg, args)
    with contextlib.redirect_stdout(sys.stderr):  # a reward, environment or tool that prints: not into the JSON
        summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    decoding = _run_decoding(cfg)
    # under torchrun: leave the process group cleanly, after success only. On a failure the error propagates with the
    # group alive, so that it is reported first: tearing the group down while another process waits in a collective
    # can abort this one (SIGABRT) before its traceback is printed.
    shutdown()
    if int(os.environ.get("RANK", "0")) == 0:  # one summary, not one per process
        print(json.dumps(summary, indent=2))
        if line := _accuracy_line(summary, "before RL", "after RL", decoding):
            print(line, file=sys.stderr)  # stdout stays one JSON document
    return 0


def _check(cfg, args: argparse.Namespace) -> int:
    """`--check`: the run's set-up and a report (`gspo.preflight`), nothing computed or written (`--measure`: and a
    few RL steps timed in a temporary folder). Exit 0: ready; 1: the run would start, but something makes its numbers
    doubtful (printed); errors exit 2 as the run would."""
    from gspo.preflight import check, format_report, measure, warnings

    if args.measure and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would time its own folder
        raise ConfigError("--measure times steps in one process: run it without torchrun (--check works under it)")
    report = check(cfg, resume=args.resume, overwrite=args.overwrite)
    if args.measure:
        report["measured"] = measure(cfg, report["plan"])
    found = warnings(report)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: one report
        return 1 if found else 0
    print("\n".join(format_report(report)))
    for line in found:
        print(f"warning: {line}", file=sys.stderr)
    command = "gspo demo" if args.command == "demo" else f"gspo train {args.config}"
    done = ("nothing was written to trainer.out (the timed steps ran in a temporary folder)" if args.measure
            else "nothing was computed or written")
    print(f"{command} {'--measure' if args.measure else '--check'}: {len(found)} warning(s); {done}", file=sys.stderr)
    return 1 if found else 0


def _run_decoding(cfg: Config) -> str | None:
    """How a run of `cfg` decodes its held-out rows, for its accuracy line: None for greedy (the default), else the
    sampled pass@1 it reports (trainer.eval_samples > 1), which `gspo eval MODEL --samples 1` would not reproduce."""
    t = cfg.trainer
    return None if t.eval_samples == 1 else f"pass@1 of {t.eval_samples} samples per row at temperature " \
                                            f"{t.eval_temperature:g}"


def _accuracy_line(summary: dict, before_label: str, after_label: str, decoding: str | None = None) -> str | None:
    """A run's held-out accuracy before and after RL with the change and its paired 95% interval, as one line (with
    `decoding`, `_run_decoding`'s phrase, when it was not greedy), then one indented line per group of rows
    (data.eval_by); None without held-out data (data.eval_split=null)."""
    before, after = summary.get("heldout_accuracy_before_rl"), summary.get("heldout_accuracy_after_rl")
    if before is None or after is None:
        return None

    def change(before: float, after: float, intervals: dict | None) -> str:
        pair = (intervals or {}).get("change")
        interval = f"; 95% CI {pair[0] * 100:+.1f} to {pair[1] * 100:+.1f}" if pair else ""
        return f"({(after - before) * 100:+.1f} points{interval}"

    same = summary.get("heldout_same_rows", True)  # False: a resume changed the held-out rows (no paired change)
    rows = "on the same rows" if same else "NOT on the same rows: the held-out rows changed since the first evaluation"
    lines = _cold_start_line(summary, before)
    how = f" ({decoding})" if decoding else ""
    lines += [f"held-out accuracy{how}: {before:.1%} {before_label} → {after:.1%} {after_label} "
             f"{change(before, after, summary.get('heldout_accuracy_ci95'))} {rows}) in "
             f"{summary['wall_seconds']:.0f} s"]
    for group, entry in (summary.get("heldout_accuracy_by") or {}).items():  # data.eval_by
        if entry.get("before_rl") is None:  # a group only later evaluations have (a resume changed the held-out rows)
            lines.append(f"  {group} ({entry['rows']} rows): {entry['after_rl']:.1%} {after_label} (not in the first "
                         "evaluation)")
            continue
        lines.append(f"  {group} ({entry['rows']} rows): {entry['before_rl']:.1%} → {entry['after_rl']:.1%} "
                     f"{change(entry['before_rl'], entry['after_rl'], entry['ci95'])})")
    return "\n".join(lines)


def _cold_start_line(summary: dict, after: float) -> list[str]:
    """The held-out accuracy the cold start began from and what it made of it (with the paired 95% interval of the
    change), as a line; none when the run had no cold start or did not measure it (a resumed cold start)."""
    cold = summary.get("cold_start") or {}
    before = cold.get("before")
    if not before:
        return []
    pair = before.get("heldout_accuracy_change_ci95")
    change = (f" ({(after - before['heldout_accuracy']) * 100:+.1f} points; 95% CI {pair[0] * 100:+.1f} to "
              f"{pair[1] * 100:+.1f} on the same rows)") if pair else ""
    return [f"cold start: {before['heldout_accuracy']:.1%} before → {after:.1%} after {cold['steps']} SFT steps"
            f"{change}"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from gspo.trainer import train

    overrides = [f"trainer.out={args.out}", *args.overrides]
    if args.steps is not None:
        overrides.append(f"trainer.steps={args.steps}")
    cfg = load_config(demo_config_path(), overrides)
    if args.check or args.measure:
        return _check(cfg, args)
    cs = cfg.cold_start
    until = f"until loss {cs.target_loss}, at most " if cs is not None and cs.target_loss else ""
    cold = f"cold-start SFT ({until}{cs.steps} steps) then " if cs is not None else ""
    steps = f"{cfg.trainer.steps} GSPO steps" if cfg.trainer.steps else f"{cfg.trainer.epochs:g} epochs of GSPO steps"
    print(f"gspo demo: {cold}{steps} of "
          f"{cfg.rollout.prompts_per_step} prompts × {cfg.rollout.group_size} completions on the embedded "
          f"{cfg.model.name} / {cfg.data.task} task → {cfg.trainer.out}", flush=True)
    summary = train(cfg, resume=args.resume, overwrite=args.overwrite)
    out = Path(cfg.trainer.out)  # --out, or a trainer.out=... override after it
    before = "after cold-start SFT" if cfg.cold_start is not None else "before GSPO"  # (demo cold_start=null)
    if line := _accuracy_line(summary, before, "after GSPO", _run_decoding(cfg)):
        print(line)
    print(f"wrote {out / 'metrics.jsonl'}, {out / 'summary.json'}, {out / 'curves.png'}, model in {out / 'final'}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    import math

    from gspo.checkpoint import set_seed
    from gspo.config import DataConfig
    from gspo.data import TASK_ROWS, DataSplits, load_rows, make_task, render_chat, subset_rows
    from gspo.models import check_compile_support, load_model, save_model
    from gspo.parallel import resolve_device
    from gspo.runfolder import check_output_dir
    from gspo.sft import final_loss, rows_without_solution, sft

    if args.lr is None:
        from gspo.models import PRESETS

        args.lr = SFT_LR["preset" if args.model in PRESETS else "pretrained"]
    if args.steps < 1 or args.batch_size < 1 or not 0 < args.lr < math.inf or args.warmup_steps < 0:
        raise ConfigError("sft: --steps and --batch-size must be >= 1, --lr a finite number > 0 and --warmup-steps "
                          ">= 0")
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 1:
        raise ConfigError(f"sft: --micro-batch-tokens must be >= 1, got {args.micro_batch_tokens}")
    _check_size(args)
    args.seed = 0 if args.seed is None else args.seed
    options = _task_options(args)
    check_output_dir(Path(args.out), create=False, key="sft: --out")  # found before training, not when saving
    _check_sft_out(Path(args.out))
    template = _chat_template_arg(args)
    device = resolve_device(args.device, key="--device")
    if args.data is not None:  # every row, or --size N of them chosen by prompt hash
        every = load_rows(args.data, split=args.split or "train", fields=_fields(args))
        missing = rows_without_solution(every)
        if missing:  # named by the file's row, before the model is loaded
            raise ConfigError(f"sft: {args.data}: row {missing[0]} has no 'solution' field, the target SFT trains on "
                              f"({len(missing)} of {len(every)} rows have none): map a column to it with --fields "
                              "'{\"solution\": \"COLUMN\"}'")
        rows = subset_rows(every, args.size)
    else:
        rows = make_task(args.task or "addition", split=args.split or "train", size=args.size or TASK_ROWS["train"],
                         seed=args.seed, **options)
    set_seed(args.seed)
    model, tokenizer = load_model(args.model, seed=args.seed)  # float32 weights: --mixed-precision computes over them
    model = model.to(device)
    if args.compile:
        try:
            check_compile_support(model, device)
        except ValueError as e:
            raise ConfigError(f"sft: --compile: {e}") from None
    rows = render_chat(DataSplits(train=rows, heldout=[]), DataConfig(chat_template=args.chat_template),
                       tokenizer).train  # message prompts
    if template is not None:  # the saved model renders conversations as they were trained (as `gspo train` saves)
        tokenizer.chat_template = template
    t0 = time.perf_counter()
    losses = sft(model, tokenizer, rows, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                 warmup_steps=args.warmup_steps, micro_batch_tokens=args.micro_batch_tokens,
                 mixed_precision=args.mixed_precision, compile=args.compile)
    save_model(model, tokenizer, args.out)
    print(json.dumps({"out": args.out, "steps": len(losses), "lr": args.lr, "final_loss": final_loss(losses),
                      "seconds": time.perf_counter() - t0}))
    return 0


def _check_sft_out(out: Path) -> None:
    """Raise ConfigError, before any model is loaded, when the `gspo sft --out` folder already holds a model (a
    config.json, weights, tokenizer or adapter files): saving would replace its files without a word (the --model
    folder itself, a previous run's model), and leave a sharded model's other weight files beside the new ones."""
    if not out.is_dir():
        return
    found = sorted(p.name for p in out.iterdir()
                   if p.name in ("config.json", "adapter_config.json") or p.name.startswith("tokenizer")
                   or p.suffix in (".safetensors", ".bin"))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ConfigError(f"sft: --out {out} already holds a model ({shown}): saving there would replace it; name a "
                          "new folder, or delete this one first")


def _chat_template_arg(args: argparse.Namespace) -> str | None:
    """The text of `--chat-template FILE` (None when not given), read before any model is loaded: a missing file is a
    ConfigError naming the option."""
    if args.chat_template is None:
        return None
    path = Path(args.chat_template).expanduser()
    if not path.is_file():
        raise ConfigError(f"--chat-template {args.chat_template!r} is not a file (a Jinja chat template)")
    return path.read_text(encoding="utf-8")


def _check_size(args: argparse.Namespace) -> None:
    if args.size is not None and args.size < 1:
        raise ConfigError(f"--size must be >= 1 (rows), got {args.size}; leave it out for every row")


def _task_options(args: argparse.Namespace) -> dict:
    """`--task-options JSON`: the embedded task's options (as a config's data.task_options, e.g. '{"digits": 2}'),
    only with an embedded task; {} when not given. The task checks the names and values when it draws."""
    if args.task_options is None:
        return {}
    if args.data is not None or getattr(args, "config", None) is not None:
        raise ConfigError("--task-options are an embedded task's (--task) options: leave them out with --data, and "
                          "with --config use data.task_options=... overrides")
    try:
        options = json.loads(args.task_options)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--task-options must be a JSON object such as '{{\"digits\": 2}}': {e}") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--task-options must be a JSON object such as '{{\"digits\": 2}}', got "
                          f"{args.task_options!r}")
    return options


def _fields(args: argparse.Namespace) -> dict[str, str] | None:
    if not args.fields:
        return None
    try:
        fields = json.loads(args.fields)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--fields must be a JSON object such as '{{\"prompt\": \"question\"}}': {e}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"--fields must be a JSON object mapping our field names to columns, got {args.fields!r}")
    return fields


def _think_tags(args: argparse.Namespace) -> tuple[str, str] | None:
    """`--think-tags OPEN,CLOSE` as a pair (default `gspo.rewards.THINK_TAGS`), 'none' as None."""
    from gspo.rewards.thinking import THINK_TAGS, check_think_tags

    if args.think_tags is None:
        return THINK_TAGS
    if args.think_tags.strip().lower() == "none":
        return None
    try:
        return check_think_tags([tag.strip() for tag in args.think_tags.split(",")], "--think-tags")
    except ValueError as exc:
        raise ConfigError(f"{exc} (write OPEN,CLOSE, e.g. --think-tags '<think>,</think>', or none)") from None


def _eval_config(args: argparse.Namespace) -> Config | None:
    """`gspo eval --config`'s training config with the key=value overrides (and --size as data.eval_size), loaded
    and checked before anything else: its rows, rewards and evaluation settings; None without --config (then no
    override may be given)."""
    _check_size(args)
    if args.config is None:
        if args.overrides:
            raise ConfigError(f"key=value overrides ({' '.join(args.overrides)}) apply to --config only")
        _task_options(args)  # checked now (and refused with --data), used when the task draws its rows
        return None
    if (args.data is not None or args.task is not None or args.reward or args.split or args.fields
            or args.think_tags is not None or args.by is not None or args.task_options is not None
            or args.accuracy_reward is not None or args.accuracy_threshold is not None or args.timeout is not None):
        raise ConfigError("--config takes the data, split, fields and rewards from the config: leave out --task, "
                          "--task-options, --data, --split, --fields, --reward, --accuracy-reward, "
                          "--accuracy-threshold, --timeout, --think-tags and --by (or leave out --config; "
                          "rewards.think_tags=null, rewards.accuracy_reward=..., rewards.accuracy_threshold=..., "
                          "rewards.timeout_s=..., data.task_options=... and data.eval_by=FIELD are overrides)")
    size = [] if args.size is None else [f"data.eval_size={args.size}"]  # default: the config's eval_size
    return load_config(args.config, [*args.overrides, *size])


def _eval_setup(args: argparse.Namespace, cfg: Config | None):
    """(rows, reward runner, accuracy reward, threshold, new tokens, data section, config, groups, row numbers) for
    `gspo eval`: a training config's held-out rows (as `DataSplits`), rewards, data section and the config itself
    (`cfg`, `_eval_config`'s; with an `env` section the rows are evaluated as episodes), or --task / --data rows with
    --reward, the default data section (message prompts rendered with the model's chat template) and no config; each
    row's group for the split of the accuracy (data.eval_by / --by; None: no split); each row's number in its source
    (--rows-out's `row`: a --data file's row, also under --size; else its place among the held-out rows)."""
    from gspo.config import DataConfig, check_model_threshold, resolve_accuracy_reward
    from gspo.data import (
        TASKS,
        DataSplits,
        eval_group_field,
        eval_groups,
        load_data,
        load_rows,
        make_task,
        repeated_prompts,
        subset_rows,
    )
    from gspo.data.heldout import TRAINING_ONLY_FIELDS
    from gspo.parallel import resolve_device
    from gspo.rewards import RewardRunner

    if cfg is not None and args.chat_template is not None:
        raise ConfigError("--chat-template is for --data / --task rows; with --config, override its "
                          f"data.chat_template={args.chat_template} instead")
    _chat_template_arg(args)  # a missing file: before any model is loaded
    if cfg is not None:
        try:
            data = load_data(cfg.data, cfg.trainer.seed)
        except FileNotFoundError as e:  # a run's config names its files as `gspo train` was given them
            named = [p for v in (cfg.data.path, cfg.data.eval_path) for p in ([v] if isinstance(v, str) else v or [])]
            if all(Path(p).expanduser().is_absolute() for p in named):
                raise
            raise FileNotFoundError(f"{e}; relative data paths in {args.config} are read from the current folder "
                                    f"({Path.cwd()}), and were written for the one `gspo train` ran in: run from "
                                    "there, or override them (data.path=..., data.eval_path=...)") from None
        if not data.heldout:
            raise ConfigError(f"{args.config} holds out no rows (data.eval_split is null and no data.eval_path / "
                              "data.eval_fraction): set one with an override, e.g. data.eval_path=FILE")
        r = cfg.rewards
        runner = RewardRunner.from_config(r, resolve_device(args.device, key="--device"), on_error="zero")
        tokens = args.max_new_tokens or cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens
        heldout = DataSplits(train=[], heldout=data.heldout, heldout_source=data.heldout_source)
        groups = eval_groups(data.heldout, eval_group_field(cfg.data))
        numbers = list(range(len(data.heldout)))
        return heldout, runner, r.accuracy_reward, r.accuracy_threshold, tokens, cfg.data, cfg, groups, numbers
    if args.data is not None and args.task is not None:
        raise ConfigError("pass --task (an embedded task) or --data (a file or dataset), not both")
    if args.data is not None:
        if not args.reward:
            raise ConfigError("--data needs --reward: the reward function(s) that score its rows (a registered "
                              "name such as math, or module:function / file.py:function), or reuse a training "
                              "config with --config")
        every = load_rows(args.data, split=args.split, fields=_fields(args),  # evaluated only: no solution needed
                          optional=TRAINING_ONLY_FIELDS)
        rows = subset_rows(every, args.size)  # --size N: a sample by prompt hash, never the first N rows
        place = {id(row): i for i, row in enumerate(every)}
        numbers = [place[id(row)] for row in rows]  # each kept row's row in the file
        source = {"kind": "file", "path": args.data, "split": args.split, "rows": len(rows), "of": len(every)}
        repeats = repeated_prompts(rows)
        if repeats:  # kept (--rows-out's `row` is the file's row), but said: such a problem weighs more
            source["repeated_prompts"] = repeats
            print(f"gspo eval: warning: {repeats} of the {len(rows)} rows repeat an earlier row's prompt (up to case "
                  "and whitespace): each counts in the accuracy, so those problems weigh more (a run's held-out "
                  "rows keep each prompt once)", file=sys.stderr)
    else:
        task, options = args.task or "addition", _task_options(args)
        rows = make_task(task, split=args.split or "test", size=500 if args.size is None else args.size,
                         seed=args.seed or 0, distinct=True, **options)  # each problem once
        source = {"kind": "task_split", "task": task, "split": args.split or "test",
                  **({"task_options": options} if options else {})}
        numbers = list(range(len(rows)))
    data = DataSplits(train=[], heldout=rows, heldout_source=source)
    names = args.reward or [TASKS[args.task or "addition"].reward]  # multiply's answers: the addition verifier
    runner = RewardRunner({name: 1.0 for name in names}, on_error="zero",
                          timeout_s=30.0 if args.timeout is None else args.timeout,
                          model_options={"device": resolve_device(args.device, key="--device")},
                          think_tags=_think_tags(args))
    accuracy = resolve_accuracy_reward(names, args.accuracy_reward, key="--accuracy-reward")
    if args.accuracy_threshold is None:
        check_model_threshold(accuracy, "--accuracy-threshold")
    threshold = 1.0 if args.accuracy_threshold is None else args.accuracy_threshold
    groups = eval_groups(rows, args.by, "--by")
    return (data, runner, accuracy, threshold, args.max_new_tokens or 16, DataConfig(chat_template=args.chat_template),
            None, groups, numbers)


def _eval_sampling(args: argparse.Namespace,
                   cfg: Config | None) -> tuple[int, float | None, float | None, list[int], int, str]:
    """(samples per row, temperature, top-p, ks, seed, how: the decoding in words) for `gspo eval`, validated before
    anything is loaded: --samples N >= 1; with N > 1 --temperature > 0 (default 1) and --top-p in (0, 1] (default
    1); with N = 1 (greedy decoding) neither may ask for sampling; --k a comma-separated list of ints in [1, N]
    (default 1, 2, 4, ... up to N, and N); --seed (default 0). With a training config (`cfg`: --config, or a run
    folder) the defaults are how its run evaluates its held-out rows (`gspo.trainer`'s eval settings), so that
    `gspo eval RUN` reproduces the run's figures: trainer.eval_samples, eval_temperature and trainer.seed."""
    trainer = cfg.trainer if cfg is not None else None
    n = args.samples if args.samples is not None else trainer.eval_samples if trainer is not None else 1
    run_samples = trainer is not None and trainer.eval_samples > 1
    seed = args.seed if args.seed is not None else trainer.seed if trainer is not None else 0
    if args.temperature is None and trainer is not None and n > 1:
        args.temperature = trainer.eval_temperature
    if n < 1:
        raise ConfigError(f"--samples must be >= 1 (completions per row), got {n}")
    temperature, top_p = args.temperature, args.top_p
    if n == 1:
        if temperature not in (None, 0.0) or top_p not in (None, 1.0):
            raise ConfigError("--samples 1 decodes greedily: --temperature and --top-p apply to sampled evaluation, "
                              "pass --samples N (N > 1) with them")
        temperature = top_p = None
    else:
        temperature = 1.0 if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        if not 0 < temperature < float("inf"):
            raise ConfigError(f"--temperature must be > 0 with --samples {n} > 1, got {temperature:g}")
        if not 0 < top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {top_p:g}")
    if args.k is None:
        ks = sorted({*(2 ** i for i in range(n.bit_length()) if 2 ** i <= n), n})
    else:
        try:
            ks = [int(k) for k in args.k.split(",")]
        except ValueError:
            raise ConfigError(f"--k must be comma-separated integers such as 1,4,8, got {args.k!r}") from None
        if not all(1 <= k <= n for k in ks):
            raise ConfigError(f"--k: every k must be in [1, --samples={n}], got {args.k}")
    if n == 1:
        how = "greedy"
        if run_samples:  # asked for with --samples 1: not the run's figure
            how += (f" (the run evaluates {trainer.eval_samples} samples per row at temperature "
                    f"{trainer.eval_temperature:g}: its held-out figures are their pass@1, not this)")
    else:
        how = f"{n} samples each at temperature {temperature:g}, pass@1"
        if args.samples is None:
            how += " (as the run evaluates: its trainer.eval_samples and eval_temperature)"
    return n, temperature, top_p, ks, seed, how


def _cmd_eval(args: argparse.Namespace) -> int:
    from gspo.agent import build_env, make_episode_runner
    from gspo.data import render_chat
    from gspo.evaluation import evaluate, paired_change_ci95
    from gspo.models import load_model
    from gspo.parallel import resolve_device
    from gspo.rewards.checks import reward_checks, reward_warnings
    from gspo.rollout import HFSampler, SamplingParams
    from gspo.schedule import unknown_character_rows

    _eval_run_folders(args)
    cfg = _eval_config(args)
    n, temperature, top_p, ks, seed, how = _eval_sampling(args, cfg)
    if args.max_batch_rows is not None and args.max_batch_rows < 1:
        raise ConfigError(f"--max-batch-rows must be >= 1, got {args.max_batch_rows}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.accuracy_threshold is not None and not math.isfinite(args.accuracy_threshold):  # as rewards.accuracy_...
        raise ConfigError(f"--accuracy-threshold must be a finite number (solved = the accuracy reward's value >= "
                          f"it), got {args.accuracy_threshold}")
    _check_eval_paths(args, cfg)  # the models and --rows-out: wrong ones fail now, not after an evaluation
    data, rewards, accuracy_reward, threshold, new_tokens, data_cfg, cfg, groups, numbers = _eval_setup(args, cfg)
    batch = args.max_batch_rows or (cfg.rollout.max_batch_rows if cfg is not None else None) or 256
    rewards.check_rows(data.heldout, accuracy_reward, "held-out row")
    make_env, tools = build_env(cfg) if cfg is not None else (None, None)  # env: the rows are episodes
    sampling = {} if n == 1 else {"samples_per_prompt": n, "temperature": temperature, "top_p": top_p, "ks": ks,
                                  "seed": seed}
    # the precision the run's engine evaluates in: its own copy's rollout.dtype, else the policy's model.dtype, under
    # trainer.mixed_precision's autocast when that is float32 (as `HFSampler` applies it)
    dtype = (cfg.rollout.dtype or cfg.model.dtype) if cfg is not None else "float32"
    if dtype != "float32":
        how += f", in {dtype} (the run's {'rollout' if cfg.rollout.dtype else 'model'}.dtype)"
    autocast = cfg.trainer.mixed_precision if cfg is not None and dtype == "float32" else None
    if autocast is not None:
        how += f", under {autocast} autocast (the run's trainer.mixed_precision)"
    sampling["stop"] = cfg.rollout.stop if cfg is not None else []  # a run's completions end at its stop strings
    checked: dict | None = None
    kept: list[int] | None = None  # the rows evaluated: with --config, those its run evaluates (_rows_the_run_keeps)
    unscorable = 0  # rows left out because the rewards can never judge them (the others left out are too long)
    unknown: int | None = None  # rows with text the model's tokenizer cannot encode

    def run(name: str) -> tuple[dict, list[float], dict[str, dict[str, int]], list[dict]]:
        """Evaluate model `name` on the rows (rendered with its own chat template): its result (each interval as one
        [low, high] pair), each row's solved fraction, its own reward failures and timeouts per function
        ({"reward_failures": ..., "reward_timeouts": ...}), and with --rows-out each row's first completion with its
        rewards and verdict."""
        nonlocal checked, kept, unknown, unscorable
        model, tokenizer = load_model(name, dtype=dtype)
        rows = render_chat(data, data_cfg, tokenizer, tools=tools).heldout
        if kept is None:  # decided with the evaluated model's tokenizer; a --baseline gets the same rows
            kept, unscorable = _rows_the_run_keeps(cfg, model, tokenizer, rows, new_tokens, rewards)
        rows = [rows[i] for i in kept]
        if unknown is None:  # text the tokenizer maps to <unk>: the model never saw it (warned, as a run warns)
            unknown = unknown_character_rows(tokenizer, rows, "held-out")
        if checked is None:  # the verifier on the rows' own answers, an empty one and another row's
            wanted = cfg is None or cfg.rewards.check  # a config's rewards.check=false turns it off
            checked = (reward_checks(rewards, rows, accuracy_reward, threshold) if wanted else None) or {}
        model = model.to(resolve_device(args.device, key="--device"))
        engine = episodes = None
        if make_env is not None:
            params = SamplingParams(max_new_tokens=new_tokens, stop=tuple(sampling["stop"]))
            engine = HFSampler(model, tokenizer, params, autocast=autocast)
            episodes = make_episode_runner(cfg, engine, tokenizer, make_env)
        values: list[float] = []
        shown: list[dict] = []
        before = {"reward_failures": dict(rewards.failures), "reward_timeouts": dict(rewards.timeouts)}
        result = evaluate(model, tokenizer, rows, rewards, new_tokens, batch_size=batch,
                          accuracy_reward=accuracy_reward, accuracy_threshold=threshold, sampler=engine,
                          episodes=episodes, row_values=values, samples=shown, autocast=autocast,
                          n_samples=len(rows) if args.rows_out else 0, **sampling)
        result = {key.removesuffix("_low"): [value, result[key.replace("_low", "_high")]]
                  if key.endswith("_ci95_low") else value
                  for key, value in result.items() if not key.endswith("_ci95_high")}
        now = {"reward_failures": rewards.failures, "reward_timeouts": rewards.timeouts}
        own = {kind: {k: v - before[kind].get(k, 0) for k, v in now[kind].items()} for kind in now}
        return result, values, own, shown

    with contextlib.redirect_stdout(sys.stderr):  # a reward, environment or tool that prints: not into the JSON
        result, values, failures, shown = run(args.model)
    skipped = len(data.heldout) - len(values) - unscorable  # prompts over the limit
    if groups is not None:
        groups = [groups[i] for i in kept]
    completions = len(values) * n
    failed = round(result["reward_failure_rate"] * completions)
    counts = ({"solved": round(result["accuracy"] * len(values)), "rows_with_reward_failures": failed} if n == 1 else
              {"solved_samples": round(result["accuracy"] * completions), "samples_with_reward_failures": failed})
    comparison, failed_all, failures_shown = {}, failed == completions, failures["reward_failures"]
    base_values: list[float] | None = None
    base_shown: list[dict] = []
    if args.baseline is not None:  # the same rows, rewards and sampling: the change with its paired interval
        with contextlib.redirect_stdout(sys.stderr):
            base, base_values, base_failures, base_shown = run(args.baseline)
        change, low, high = paired_change_ci95(base_values, values)
        comparison = {"baseline": {"model": args.baseline, "accuracy": base["accuracy"],
                                   "accuracy_ci95": base["accuracy_ci95"], "reward_mean": base["reward_mean"],
                                   **base_failures,
                                   **{k: base[k] for k in ("unfinished_thinking_rate",) if k in base}},
                      "accuracy_change": change, "accuracy_change_ci95": [low, high]}
        if round(base["reward_failure_rate"] * completions) == completions and not failed_all:
            failed_all, failures_shown = True, base_failures["reward_failures"]
    by = {} if groups is None else {"by": _by_group(values, groups, base_values)}
    print(json.dumps({"model": args.model, "rows": len(values), "source": data.heldout_source,
                      **({"skipped_prompts": skipped} if skipped else {}),
                      **({"unscorable_rows": unscorable} if unscorable else {}),
                      **({"unknown_character_rows": unknown} if unknown else {}), "decoding": how,
                      "samples_per_prompt": n, "temperature": temperature, "top_p": top_p,
                      **({"seed": seed} if n > 1 else {}), **result, **counts,
                      "accuracy_means": accuracy_means(accuracy_reward, threshold), **failures, **comparison, **by,
                      "reward_check": checked or None}), flush=True)
    print(_eval_line(result, len(values), data.heldout_source.get("of"), how, new_tokens, comparison),
          *_group_lines(by.get("by", {})), sep="\n", file=sys.stderr)  # stdout stays JSON
    if args.rows_out:  # after the result is printed: a failing write cannot lose the evaluation
        _write_rows(Path(args.rows_out), [numbers[i] for i in kept], shown, values, groups, base_shown, base_values)
    for line in reward_warnings(checked or None, "evaluated"):
        print(f"gspo eval: warning: {line}", file=sys.stderr)
    if failed_all:
        print(f"gspo eval: error: a reward function failed on every one of the {completions} "
              f"{'rows' if n == 1 else 'completions'} of a model "
              f"(failures by function: {failures_shown}); the accuracy above measures nothing. Check the "
              "reward (--reward) and the rows' fields (--fields)", file=sys.stderr)
        return 1
    if checked and checked["reference_solved"] == 0:
        print(f"gspo eval: error: the accuracy reward judges none of the {checked['rows']} checked rows' own "
              f"{checked['field']} solved, so the accuracy above measures nothing. Check the reward (--reward) "
              "and the rows' answer field (--fields)", file=sys.stderr)
        return 1
    return 0


def _check_eval_paths(args: argparse.Namespace, cfg: Config | None) -> None:
    """`gspo eval`'s paths, checked before anything is loaded (an error found after an evaluation loses it): MODEL
    and --baseline, when they name a local folder, are model folders (a preset or hub id is checked when loaded); a
    --baseline that is MODEL itself is said; --rows-out names a file (not a folder) in a writable folder, and none of
    the data being evaluated (--data, or --config's data.path / data.eval_path), which the results would replace, nor
    a record a run folder holds (`RUN_FILES`: its eval.jsonl, metrics.jsonl, summary.json, ...)."""
    from gspo.models import check_model_source
    from gspo.runfolder import RUN_FILES, run_started

    for name, what in ((args.model, "MODEL"), (args.baseline, "--baseline")):
        try:
            if name is not None:
                check_model_source(name)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{what}: {e}") from None
    if args.baseline is not None and Path(args.baseline).resolve() == Path(args.model).resolve():
        print(f"gspo eval: note: --baseline {args.baseline} is the evaluated model itself: the change is 0 by "
              "construction", file=sys.stderr)
    if not args.rows_out:
        return
    out = Path(args.rows_out).expanduser()
    if out.is_dir():
        raise ConfigError(f"--rows-out {args.rows_out} is a folder: name a file, e.g. {out / 'rows.jsonl'}")
    data = [args.data] if args.data is not None else []
    if cfg is not None:
        data += [p for v in (cfg.data.path, cfg.data.eval_path) for p in ([v] if isinstance(v, str) else v or [])]
    for source in data:
        src = Path(source).expanduser()
        if not src.exists():
            continue
        inside = src.is_dir() and src.resolve() in out.resolve().parents
        if inside or src.resolve() == out.resolve() or (out.exists() and out.samefile(src)):
            where = f"inside the data folder {source}" if inside else f"the data file {source}"
            raise ConfigError(f"--rows-out {args.rows_out} is {where} being evaluated: the results would replace "
                              "the data; name another file")
    if out.name in RUN_FILES and run_started(out.parent):  # `gspo eval RUN --rows-out RUN/eval.jsonl`
        raise ConfigError(f"--rows-out {args.rows_out} is the run's own {out.name} in the run folder {out.parent}: "
                          f"the rows would replace the run's record; name another file, e.g. "
                          f"{out.with_name('rows.jsonl')}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--rows-out {args.rows_out}: cannot create its folder ({e})") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--rows-out {args.rows_out}: its folder {out.parent} is not writable")


def _rows_the_run_keeps(cfg: Config | None, model, tokenizer, rows: list[dict], new_tokens: int,
                        rewards: RewardRunner) -> tuple[list[int], int]:
    """The indices of the held-out `rows` a run of `cfg` evaluates: those whose prompt fits its prompt-token limit
    (`data.max_prompt_tokens`, and what the model's positions leave after `new_tokens`, or a multi-turn episode's
    `env.max_tokens`) and that the `rewards` can judge (`RewardRunner.drop_unscorable`), as `gspo.trainer.prepare`
    keeps them, so that `gspo eval RUN` scores the run's rows. Without a config (--data, --task): those that fit the
    model's positions with `new_tokens` after them (one longer prompt used to refuse the whole evaluation) and that
    the rewards can judge; the others are left out, warned about and counted: the number of rows left out because the
    rewards cannot judge them is returned with the indices (`unscorable_rows`; the rest are `skipped_prompts`)."""
    from gspo.schedule import drop_long_prompts, prompt_token_limit

    if cfg is None:
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        room = None if positions is None else positions - new_tokens
        if room is not None and room < 1:
            raise ConfigError(f"--max-new-tokens {new_tokens} leaves no room for a prompt in the model's "
                              f"{positions} positions")
        limit = (room, f"the model has {positions} positions and --max-new-tokens keeps {new_tokens} of them for "
                       "the completion: shorten the prompts or lower --max-new-tokens")
    else:
        limit = prompt_token_limit(cfg, model, cfg.env.max_tokens if cfg.env else new_tokens)
    judged, unscorable = rewards.drop_unscorable(drop_long_prompts(rows, tokenizer, limit, "held-out")[0], "held-out")
    kept = {id(row) for row in judged}
    return [i for i, row in enumerate(rows) if id(row) in kept], unscorable


def _eval_run_folders(args: argparse.Namespace) -> None:
    """`gspo eval RUN` for a run folder (it has config.yaml, not config.json): its final model, and its config's
    held-out rows unless --config, --data or --task say otherwise; `--baseline RUN2` is RUN2's final model and
    `--config RUN` is RUN/config.yaml. A run without final/ (stopped or still training) is refused with what to name
    instead."""
    def final(path: str, what: str) -> str:
        run = Path(path)
        if not (run / "config.yaml").is_file() or (run / "config.json").is_file():
            return path
        if not (run / "final").is_dir():
            kept = sorted((run / "checkpoints").glob("step_*/model"))
            hint = f"its latest checkpoint, {kept[-1]}" if kept else "a model folder"
            raise ConfigError(f"{what} {path} is a training run without a final model (it stopped or is still "
                              f"running): name {hint}{' or ' + str(run / 'best') if (run / 'best').is_dir() else ''}"
                              f", with --config {run / 'config.yaml'} for its held-out rows")
        return str(run / "final")

    if args.config is not None and Path(args.config).is_dir():
        args.config = str(Path(args.config) / "config.yaml")
    model = final(args.model, "MODEL")
    if model != args.model and args.config is None and args.data is None and args.task is None:
        args.config = str(Path(args.model) / "config.yaml")
    if model != args.model:
        print(f"gspo eval: {args.model} is a training run: evaluating {model}"
              + (f" on the held-out rows of {args.config}" if args.config else ""), file=sys.stderr)
    args.model = model
    if args.baseline is not None:
        args.baseline = final(args.baseline, "--baseline")


def _write_rows(path: Path, numbers: list[int], shown: list[dict], values: list[float], groups: list[str] | None,
                base_shown: list[dict], base_values: list[float] | None) -> None:
    """`gspo eval --rows-out`: one JSON line per evaluated row, in row order: its number in the source (`row`,
    `numbers`: a --data file's row even when rows before it were skipped or --size sampled, so that it joins back to
    the file), prompt, (first) completion, rewards and verdict, its solved fraction (`solved`: 0/1 greedy, the
    fraction of --samples), its group (--by), and with --baseline the baseline's completion, rewards and solved
    fraction and the row's `change` (> 0: gained)."""
    from gspo.runfolder import write_jsonl

    records = []
    for i, (record, solved) in enumerate(zip(shown, values, strict=True)):
        out = {"row": numbers[i], **record, "solved": solved, **({"group": groups[i]} if groups is not None else {})}
        if base_values is not None:
            base = base_shown[i]
            out["baseline"] = {"completion": base["completion"], "reward": base["reward"], "rewards": base["rewards"],
                               "solved": base_values[i]}
            out["change"] = solved - base_values[i]
        records.append(out)
    write_jsonl(path, records)


def _by_group(values: list[float], groups: list[str], baseline: list[float] | None) -> dict[str, dict]:
    """`gspo eval`'s accuracy of each group of rows (--by / data.eval_by), with its interval and row count, and with
    --baseline the baseline's accuracy and the change with its paired interval (`accuracy_by_group`)."""
    from gspo.evaluation import accuracy_by_group

    flat = accuracy_by_group(values, groups, baseline)
    base = accuracy_by_group(baseline, groups) if baseline is not None else {}
    result = {}
    for group in sorted(set(groups)):
        entry = {"accuracy": flat[f"accuracy/{group}"], "rows": flat[f"rows/{group}"],
                 "accuracy_ci95": [flat[f"accuracy_ci95_low/{group}"], flat[f"accuracy_ci95_high/{group}"]]}
        if baseline is not None:
            entry |= {"baseline_accuracy": base[f"accuracy/{group}"],
                      "accuracy_change": flat[f"accuracy_change/{group}"],
                      "accuracy_change_ci95": [flat[f"accuracy_change_ci95_low/{group}"],
                                               flat[f"accuracy_change_ci95_high/{group}"]]}
        result[group] = entry
    return result


def _group_lines(by: dict[str, dict]) -> list[str]:
    """`gspo eval`'s accuracy of each group (`_by_group`), one indented line each."""
    lines = []
    for group, entry in by.items():
        low, high = entry["accuracy_ci95"]
        line = f"  {group}: {entry['accuracy']:.1%} (95% CI {low:.1%} to {high:.1%}) on {entry['rows']} rows"
        if "accuracy_change" in entry:
            low, high = entry["accuracy_change_ci95"]
            line += (f"; baseline {entry['baseline_accuracy']:.1%}: change {entry['accuracy_change'] * 100:+.1f} "
                     f"points (paired 95% CI {low * 100:+.1f} to {high * 100:+.1f})")
        lines.append(line)
    return lines


def _eval_line(result: dict, rows: int, of: int | None, how: str, tokens: int, comparison: dict) -> str:
    """`gspo eval`'s result as one line: the accuracy with its interval on how many of the source's rows, how it
    decoded (`how`, `_eval_sampling`'s), what cut completions short, and the change against --baseline with its
    paired interval."""
    low, high = result["accuracy_ci95"]
    count = f"{rows} of {of}" if of is not None and of != rows else f"{rows}"
    parts = [f"gspo eval: accuracy {result['accuracy']:.1%} (95% CI {low:.1%} to {high:.1%}) on {count} rows, {how}"]
    if result["truncation_rate"] > 0:
        parts.append(f"{result['truncation_rate']:.0%} hit the {tokens}-token budget")
    if result.get("unfinished_thinking_rate"):
        parts.append(f"{result['unfinished_thinking_rate']:.0%} never finished their reasoning")
    line = ", ".join(parts)
    if comparison:
        base, (low, high) = comparison["baseline"], comparison["accuracy_change_ci95"]
        line += (f"; baseline {base['accuracy']:.1%}: change {comparison['accuracy_change'] * 100:+.1f} points "
                 f"(paired 95% CI {low * 100:+.1f} to {high * 100:+.1f})")
    return line


def _cmd_async_study(args: argparse.Namespace) -> int:
    from gspo.experiments.async_study import METHODS, AsyncStudyOptions, format_mean_std, run_study

    opts = AsyncStudyOptions(out=Path(args.out), report_dir=None if args.report_dir is None else Path(args.report_dir),
                             seeds=args.seeds, steps=args.steps, overrides=list(args.overrides))
    print(f"gspo async-study: {', '.join(METHODS)} × {opts.seeds} seeds → {opts.out}", flush=True)
    summary = run_study(opts)
    for name in METHODS:
        s = summary[name]
        print(f"  {name:14s} {s['step_seconds']['mean']:.3f} s/step ({s['speedup_vs_sync']:.2f}× sync), held-out "
              f"accuracy {format_mean_std(s['final_accuracy'], pct=True)}")
    print(f"wrote {opts.out / 'summary.json'} and {opts.report_dir / 'async.md'}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from gspo.experiments.moe_study import StudyOptions, run_study

    opts = StudyOptions(out=Path(args.out), seeds=args.seeds, steps=args.steps, precision=args.precision,
                        threads=args.threads, cold_start=args.cold_start,
                        base_config=Path(args.config) if args.config else None, overrides=list(args.overrides))
    n_runs = opts.seeds * len(opts.methods())
    print(f"gspo compare: {', '.join(opts.methods())} × {opts.seeds} seeds ({n_runs} runs) → {opts.out}", flush=True)
    summary = run_study(opts)
    for name in opts.methods():
        s = summary[name]
        vol = "" if s["expert_volatility"] is None else f", expert volatility {s['expert_volatility']:.1%}"
        print(f"  {name:20s} final accuracy {s['final_accuracy']:.1%} (best {s['best_accuracy']:.1%}), clipped "
              f"tokens {s['clip_frac_tokens']:.2%}{vol}, failed runs {s['failed_runs']}/{s['runs']}")
    for c in summary["claims"]:
        print(f"  [{c['verdict']}] {c['claim']}")
    print(f"wrote {opts.out / 'summary.json'} and {opts.out / 'report.md'} in "
          f"{summary['study']['wall_seconds_this_call'] / 60:.1f} min")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo", description="Group Sequence Policy Optimization for LMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="cold-start SFT then GSPO on the embedded tiny MoE and task (offline, CPU)")
    p.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the demo config's)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="delete the run in --out first and start over")
    p.add_argument("--check", action="store_true", help="as gspo train --check: the checks and the plan, no compute")
    p.add_argument("--measure", action="store_true", help="as gspo train --measure: --check and a few timed steps")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="RL training from a YAML config")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    p.add_argument("--resume", action="store_true", help="continue the run in trainer.out from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete the run in trainer.out first and start over")
    p.add_argument("--check", action="store_true",
                   help="check everything the run checks, score the accuracy reward on the rows' known answers, "
                        "print the plan; compute and write nothing (exit 0 ready, 1 warnings, 2 errors)")
    p.add_argument("--measure", action="store_true",
                   help="--check, and time a few RL steps (in a temporary folder, the model as loaded) to estimate "
                        "the run's duration")
    p.set_defaults(func=_cmd_train)

    def data_args(p: argparse.ArgumentParser, task_size: int, more: str = "") -> None:
        p.add_argument("--task", default=None, help="embedded task (default addition, unless --data is given)")
        p.add_argument("--data", default=None, help="jsonl/parquet file, saved dataset or hub id")
        p.add_argument("--split", default=None,
                       help="split of --task (default: train for sft, test for eval) or of a --data source that has "
                            "several (a single file is one split)")
        p.add_argument("--fields", default=None, help='JSON field mapping, e.g. \'{"prompt": "question"}\'')
        p.add_argument("--size", type=int, default=None,
                       help=f"rows: a --data source's every row, or N of them chosen by prompt hash (never its first "
                            f"N); --task draws N problems (default {task_size}){more}")
        p.add_argument("--task-options", default=None, metavar="JSON",
                       help='the --task\'s options as a config\'s data.task_options, e.g. \'{"digits": 2}\' (the demo '
                            "trains on 2-digit addition; the task's default is 3 digits)")
        p.add_argument("--seed", type=int, default=None,
                       help="draws of --task and sampled decoding (default 0; gspo eval with a config: its "
                            "trainer.seed)")
        p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: the GPU when there is one (default), else the CPU")
        p.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template file that replaces the model tokenizer's for message prompts (as "
                            "data.chat_template; gspo eval with --config: its data.chat_template)")

    p = sub.add_parser("sft", help="cold-start supervised fine-tuning on demonstrations (`solution` field)")
    p.add_argument("--out", required=True, help="output HF model directory")
    p.add_argument("--model", default="tiny-moe", help="preset, local HF directory or hub id")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {SFT_LR['preset']:g} for the tiny presets, "
                        f"{SFT_LR['pretrained']:g} for any other model: the presets' rate took SmolLM2-135M to 0%% "
                        "accuracy in 3 steps)")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="steps of linear warm-up to --lr, then a cosine decay to 0 (default 10)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="at most this many padded tokens per forward/backward (gradients accumulated: the same step)")
    p.add_argument("--mixed-precision", choices=("bfloat16", "float16"), default=None,
                   help="bf16 / fp16 forwards and backwards over the float32 weights (as trainer.mixed_precision; "
                        "float16 with a dynamic loss scale)")
    p.add_argument("--compile", action="store_true",
                   help="compile each decoder layer for the forwards and backwards (as trainer.compile; dense models)")
    data_args(p, 20000)  # --task default: TASK_ROWS['train']
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("eval", help="accuracy of a model on held-out rows (a task, a dataset, or a config's): greedy, "
                                    "or pass@k / maj@k over --samples N sampled completions per row")
    p.add_argument("model", help="preset, local HF directory (e.g. RUN/best), hub id, or a run folder RUN: its final "
                                  "model on its config's held-out rows (RUN/final --config RUN/config.yaml)")
    p.add_argument("--config", default=None,
                   help="a training config (e.g. RUN/config.yaml): its held-out rows, fields, rewards and accuracy")
    p.add_argument("--by", default=None,
                   help="a field of the rows whose values split the accuracy (e.g. data_source or level): each value "
                        "gets its accuracy and interval (with --config: its data.eval_by)")
    p.add_argument("--rows-out", default=None, metavar="FILE",
                   help="write one JSON line per row: prompt, completion, each reward, verdict, solved fraction (and "
                        "with --baseline the baseline's, and the change): which rows a model gets wrong")
    p.add_argument("--baseline", default=None,
                   help="a second model evaluated on the same rows: adds its accuracy and the change with its paired "
                        "95%% interval")
    p.add_argument("--reward", action="append", default=None,
                   help="reward function: a registered name, module:function, file.py:function, or model:PATH "
                        "(a reward model) (repeatable; default: the --task's; required with --data)")
    p.add_argument("--accuracy-reward", default=None,
                   help="with several --reward: the one whose value >= --accuracy-threshold means solved")
    p.add_argument("--accuracy-threshold", type=float, default=None,
                   help="solved = the accuracy reward's value >= this (default 1.0; required for a reward model)")
    p.add_argument("--think-tags", default=None,
                   help="OPEN,CLOSE of a reasoning model's thinking block (default <think>,</think>): the built-in "
                        "verifiers and reward models judge the text after it; 'none': the whole completion")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for a batch of reward calls (default 30; with --config: rewards.timeout_s)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 16, or the config's")
    p.add_argument("--samples", type=int, default=None,
                   help="completions sampled per row (default 1: greedy decoding; with a run folder or --config, as "
                        "its run evaluates: trainer.eval_samples); N > 1 adds pass@k and maj@k, reproducible per "
                        "--seed")
    p.add_argument("--temperature", type=float, default=None,
                   help="with --samples N > 1: > 0 (default 1; with a config, its trainer.eval_temperature)")
    p.add_argument("--top-p", type=float, default=None, help="with --samples N > 1: nucleus in (0, 1] (default 1)")
    p.add_argument("--k", default=None,
                   help="with --samples N: the k of pass@k / maj@k, comma-separated, each <= N (default 1,2,4,...,N)")
    p.add_argument("--max-batch-rows", type=int, default=None,
                   help="completions decoded at once (KV-cache memory; default: the --config's rollout.max_batch_rows, "
                        "else 256); the results do not depend on it")
    data_args(p, 500, "; with --config, its data.eval_size")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of --config")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("compare", help="MoE stability study: gspo, grpo, grpo_r2, gspo_token (+ bf16 precision runs)")
    p.add_argument("--out", required=True, help="study folder: summary.json, report.md, plots, one folder per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the study's, 60)")
    p.add_argument("--no-precision", dest="precision", action="store_false",
                   help="skip the §5.4 precision-tolerance runs (bf16 rollouts, π_old from the engine or recomputed)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per run (default 1: the tiny model's ops are too small to split well)")
    p.add_argument("--cold-start", choices=("shared", "per-seed"), default="shared",
                   help="one cold-start SFT model for all seeds (default) or one per seed")
    p.add_argument("--config", default=None, help="base YAML config (default: the demo config)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("async-study", help="sync vs async rollouts (staleness 1, 2, 4) and GSPO/GRPO tolerance to "
                                           "stale engine likelihoods, with and without mismatch correction")
    p.add_argument("--out", default="runs/async_study", help="run folders and summary.json (default runs/async_study)")
    p.add_argument("--report-dir", default=None,
                   help="where async.md and its plot go (default: --out; --report-dir docs regenerates the "
                        "repository's docs/async.md)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--steps", type=int, default=100, help="learner steps per run (default 100)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    p.set_defaults(func=_cmd_async_study)
    for command in sub.choices.values():  # `gspo train c.yaml -v`, as an error's hint says, and `gspo -v train ...`
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="debug logging, and a failure's traceback")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse leaves overrides that follow an option (`train c.yaml --resume a.b=1`) unparsed
        if not hasattr(args, "overrides") or any(x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-save "Writing model shards" bars would drown the training bar
    try:
        return args.func(args)
    except KeyboardInterrupt as e:  # Ctrl-C: where it stopped and how to go on, not 20 frames of traceback
        if args.verbose:
            raise
        print(f"gspo {args.command}: interrupted{_resume_hint(args, e)}", file=sys.stderr)
        return 130  # the shell's convention for SIGINT
    except (ConfigError, ValueError, OSError) as e:  # OSError: unreadable / unwritable paths, a full disk, ...
        if args.verbose:
            raise
        print(f"gspo {args.command}: error: {e}  (run with -v for the traceback)", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a run that stopped with a report of its own: exit 1, the message without a traceback
        if args.verbose or not isinstance(e, _reported_failures()):
            raise
        print(f"gspo {args.command}: {type(e).__name__}: {e}  (run with -v for the traceback)", file=sys.stderr)
        return 1


def _resume_hint(args: argparse.Namespace, error: KeyboardInterrupt) -> str:
    """For an interrupted run: the step it reached, its last checkpoint and the command that continues it."""
    step, checkpoint = getattr(error, "step", None), getattr(error, "checkpoint_step", None)
    where = f" at step {step}" if step is not None else ""
    if args.command == "train":
        words = ["gspo", "train", args.config, *args.overrides, "--resume"]
    elif args.command == "demo":  # the same settings: --out, --steps and every override, as given
        steps = [] if args.steps is None else ["--steps", str(args.steps)]
        words = ["gspo", "demo", "--out", args.out, *steps, *args.overrides, "--resume"]
    else:
        return where
    command = shlex.join(words)  # pasted into a shell, each override stays one word ("model.lora={r: 4}")
    kept = (f"; its last checkpoint is step {checkpoint}" if checkpoint is not None
            else "; it has no checkpoint yet (a resume starts over, reusing a finished cold start)")
    return f"{where}{kept}. Continue with: {command}"


def _reported_failures() -> tuple[type[RuntimeError], ...]:
    """Errors that stop a run with a clear message: an unwritable checkpoint, a failing reward, too many steps
    without a finite update. (Imported here, not at the top: `gspo --help` must not pay for torch.)"""
    from gspo.checkpoint import CheckpointError
    from gspo.rewards import RewardFailure
    from gspo.trainer import TrainingError

    return CheckpointError, RewardFailure, TrainingError


if __name__ == "__main__":
    raise SystemExit(main())

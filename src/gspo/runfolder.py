"""The run folder (`trainer.out`): its atomic files, whether it already holds a run, and what a resume may change.

It also owns the durable-write helpers every other module uses (`write_atomic`, `fsync_dir`, `fsync_tree`): one
implementation of "write to a temporary name, fsync, rename, fsync the folder". It imports no other gspo module that
writes files (checkpoint, tracking), so that they can import it.

A run folder is *started* once it holds what a run computed: metrics, a checkpoint, a cold-start model, a summary or
a final model. A start that failed before that (a typo in the model name, a missing file, a bad reward) leaves only
files that do not count, so the corrected command simply runs; a started run is continued with `--resume` or
replaced with `--overwrite` (which deletes only the files gspo writes, never anything else in the folder).

A resume continues the saved run, so its config must be the saved one, except for settings that do not change the
training math (`RESUMABLE`): extending `trainer.steps`, threads, logging, evaluation and checkpoint cadence, reward
timeouts, the device, the micro-batch budget, gradient checkpointing and the sampler's batch cap (a run that ran out
of memory resumes with them), and the folder's own location (a moved folder resumes).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gspo.config import ConfigError, config_diff, config_to_dict, validate_config

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "RESUMABLE",
    "RUN_FILES",
    "check_inputs_outside_run_files",
    "check_output_dir",
    "check_resume_config",
    "clear_run",
    "fsync_dir",
    "fsync_tree",
    "publish_dir",
    "run_started",
    "write_atomic",
    "write_jsonl",
]

log = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"
"""OUT/checkpoints/: where `gspo.checkpoint` keeps a run's checkpoints."""

# What gspo writes in a run folder (and all that --overwrite deletes); hidden temporaries are `.NAME.tmp` / `.old`.
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "samples.jsonl", "rollouts.jsonl", "summary.json",
             "curves.png", "tb",
             CHECKPOINTS_DIRNAME, "cold_start", "cold_start.tmp", "final", "best", "weight_sync",
             "guard.jsonl", "trackers.json")
# Config keys (fnmatch patterns) a resume may change: none of them changes what the optimizer computes.
RESUMABLE = ("trainer.steps", "trainer.epochs", "trainer.save_best", "trainer.threads", "trainer.out",
             "trainer.eval_every", "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.max_bad_steps",
             "trainer.device", "trainer.micro_batch_tokens", "model.attn_implementation",
             "cold_start.micro_batch_tokens", "trainer.gradient_checkpointing", "trainer.compile",
             "rollout.max_batch_rows", "rollout.release_decode_cache",
             "trainer.guard.*", "log.*",
             "rewards.timeout_s", "rewards.workers", "rewards.check", "rewards.reward_model.batch_size",
             "rewards.reward_model.device",
             "rollout.vllm.server_url", "rollout.vllm.weight_sync_dir",
             "rollout.vllm.request_timeout", "rollout.vllm.max_concurrent_requests")


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace the file `path` by `data` (a str is written as UTF-8) in one rename after an fsync, then fsync the
    folder: a reader (or a resume after a crash) sees the old or the new content, never a torn file, and the new name
    survives a power loss. The temporary file is `.NAME.tmp` next to it, removed if the write fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a directory so that the names created in (or renamed into) it survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file under `folder`, then every directory, deepest first: before a folder is published by rename,
    so that a power loss cannot leave the published name pointing at files whose data never reached the disk."""
    for current, _, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(Path(current) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(current)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as JSON Lines, written atomically (`write_atomic`)."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def publish_dir(tmp: Path, target: Path) -> None:
    """Make the finished folder `tmp` appear as `target` in one rename (fsynced first); an existing `target` is
    replaced: moved aside, then deleted once the new one is in place."""
    fsync_tree(tmp)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def check_output_dir(out: Path, create: bool = True, key: str = "trainer.out") -> None:
    """Raise ConfigError, before any compute, when `out` cannot be a run folder: it (or a parent) is a file, or it
    cannot be created or written (read-only file system, no permission). Creates the folder if it is missing, unless
    `create` is false (`gspo train --check`, `gspo sft`): then the nearest existing folder on its path is probed
    instead. The error names the setting `key` (`--out` for a command's option)."""
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{key} {out} cannot be a folder: {parent} is a file")
    where = out if create else next(p for p in [out, *out.parents] if p.exists())
    probe = where / f".gspo-write-test-{uuid.uuid4().hex}"
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as e:
        raise ConfigError(f"{key} {out} is not writable: {e.strerror or e} ({type(e).__name__}, errno "
                          f"{e.errno}); choose another folder") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def run_started(out: Path) -> bool:
    """Whether `out` holds a run that computed something (metrics, a checkpoint, a cold-start or final model, a
    summary); a config.yaml alone (a start that failed before its first step) does not count."""
    metrics = out / "metrics.jsonl"
    checkpoints = out / CHECKPOINTS_DIRNAME
    return ((metrics.is_file() and metrics.stat().st_size > 0)
            or (checkpoints.is_dir() and any(checkpoints.iterdir()))
            or any((out / name).exists() for name in ("cold_start", "summary.json", "final")))


def check_config_file(out: Path) -> None:
    """Raise ConfigError when `out/config.yaml` is a file gspo did not write (a user's config kept in the run folder):
    the run would replace it with its resolved config, and `--overwrite` would delete it. gspo writes it as
    `yaml.safe_dump(..., sort_keys=False)` of a mapping, so its own file reads back and dumps to the same text; a
    hand-written one (comments, other layout) does not."""
    path = out / "config.yaml"
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = yaml.safe_load(text)
        ours = isinstance(data, dict) and yaml.safe_dump(data, sort_keys=False) == text
    except yaml.YAMLError:
        ours = False
    if not ours:
        raise ConfigError(f"trainer.out {out} holds a config.yaml that gspo did not write: a run writes its resolved "
                          f"config there (and --overwrite deletes it), which would lose this one. Keep your config "
                          f"outside trainer.out, or choose another trainer.out")


def check_inputs_outside_run_files(out: Path, inputs: Mapping[str, str | Sequence[str] | None]) -> None:
    """Raise ConfigError when an input the run reads (`inputs`: a config key -> a local path or a list of them, e.g.
    data.eval_path) exists at, or inside, a path the run writes in `out` (`RUN_FILES`): a held-out file kept as
    `OUT/eval.jsonl` would be replaced by the run's evaluation log (and deleted by --overwrite), silently; or when it
    is a folder that holds `out` (data.path: . with trainer.out: runs/x): the run's eval.jsonl would then be read as
    the folder's `eval` (test) split by the next run or a resume. Sources that do not exist here (a hub id) are not
    paths and are not checked."""
    written = {(out / name).resolve(): name for name in RUN_FILES}
    for key, value in inputs.items():
        for source in [value] if isinstance(value, str) else list(value or []):
            path = Path(source).expanduser()
            if not path.exists():
                continue
            resolved = path.resolve()
            if path.is_dir() and (resolved == out.resolve() or resolved in out.resolve().parents):
                raise ConfigError(f"trainer.out {out} is inside the data folder {source} ({key}): the files the run "
                                  "writes there (eval.jsonl, metrics.jsonl, ...) would be read as data by the next "
                                  "run or a resume. Choose a trainer.out outside it, or keep the data in a folder of "
                                  "its own")
            for run_path, name in written.items():
                if resolved == run_path or run_path in resolved.parents:
                    where = "" if resolved == run_path else "inside "
                    raise ConfigError(f"{key} {source} is {where}the run's own {name!r} in trainer.out {out}: the "
                                      "run writes it (and --overwrite deletes it), so this data would be lost. Move "
                                      "it out of trainer.out, or choose another trainer.out")


def clear_run(out: Path) -> list[str]:
    """Delete what gspo wrote in `out` (`RUN_FILES` and its hidden temporaries), nothing else; returns the names."""
    removed = []
    if not out.is_dir():
        return removed
    for entry in out.iterdir():
        hidden_tmp = entry.name.startswith(".") and (entry.name.endswith(".tmp") or entry.name.endswith(".old"))
        if entry.name in RUN_FILES or hidden_tmp:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
    return sorted(removed)


def check_resume_config(out: Path, cfg_dict: dict[str, Any]) -> list[str]:
    """Compare the run's saved config with the new one; returns the changed keys a resume accepts (`RESUMABLE`), and
    raises ConfigError naming the ones it refuses (they change the training math, or what the run's evaluations
    measure: held-out verdicts before and after are paired) and the ones it would accept."""
    saved_path = out / "config.yaml"
    if not saved_path.exists():
        return []
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot resume in {out}: its saved {saved_path.name} is not readable YAML ({e}); restore "
                          "it, or start a new run (another trainer.out, or --overwrite)") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"cannot resume in {out}: its saved {saved_path.name} holds {type(saved).__name__}, not a "
                          "config; restore it, or start a new run (another trainer.out, or --overwrite)")
    # compared as the runs resolve them (an objective's eps left unset is saved as null): a run saved before a key
    # existed had that key's default
    with contextlib.suppress(ConfigError):
        saved = config_to_dict(validate_config(saved), resolved=True)
    with contextlib.suppress(ConfigError):
        cfg_dict = config_to_dict(validate_config(cfg_dict), resolved=True)
    diff = config_diff(saved, cfg_dict)
    refused = [key for key in diff if not any(fnmatch.fnmatchcase(key, pattern) for pattern in RESUMABLE)]
    if refused:
        raise ConfigError(f"cannot resume in {out}: its saved config differs in {', '.join(refused)}, which would "
                          "change the training math or what its evaluations measure (a resume may change only: "
                          f"{', '.join(RESUMABLE)}); use the saved config, or start a new run (another trainer.out, "
                          "or --overwrite)")
    return diff

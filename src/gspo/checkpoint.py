"""Crash-safe training state: atomic, verified checkpoints that a run resumes from exactly where it stopped.

Layout of a run's output folder OUT::

    OUT/checkpoints/step_00000040/
        model/          Hugging Face model directory (safetensors weights only) + tokenizer files
        optimizer.pt    optimizer.state_dict()      } torch.save, loaded back with weights_only=True
        scheduler.pt    scheduler.state_dict()      } (no arbitrary pickles are ever unpickled)
        rng.pt          torch / CUDA / python / numpy RNG states
        state.json      the caller's trainer state + a manifest (path, size, sha256 of every file above)
        COMPLETE        written last; holds the sha256 of state.json

Why each piece exists:

* Everything is written into a hidden ``.tmp-step_XXXXXXXX-<pid>`` folder, every file and folder is fsynced, and only
  then is the folder renamed to its final name. A rename is atomic on POSIX, so a crash (or a full disk) at any moment
  leaves either the old set of checkpoints or the old set plus one complete new checkpoint, never a half-written
  ``step_*`` folder.
* The manifest and the COMPLETE marker catch what atomic rename cannot: a file truncated or corrupted later (a copy
  interrupted between machines, a flaky disk). :func:`find_latest_checkpoint` verifies sizes and hashes and falls back
  to the previous checkpoint, with a warning saying which one was skipped and why.
* RNG states are saved so that a resumed run draws the same random numbers the uninterrupted run would have drawn.

Only one process may save into a given OUT (in multi-process training: rank 0). POSIX only (directory fsync).
Under FSDP, `gspo.parallel.state` writes a *sharded* variant of this folder (every process its own shards, no weights
gathered) through the same temporary folder, manifest, COMPLETE marker, atomic publish and pruning (`_begin_save`,
`_seal`, `_publish`, `_prune`); :func:`verify_checkpoint` and :func:`find_latest_checkpoint` treat both alike.
The durable writes themselves (`write_atomic`, `fsync_dir`, `fsync_tree`) are `gspo.runfolder`'s.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gspo.runfolder import CHECKPOINTS_DIRNAME, fsync_dir, fsync_tree, write_atomic

logger = logging.getLogger(__name__)

MODEL_DIRNAME = "model"
STATE_FILENAME = "state.json"
COMPLETE_FILENAME = "COMPLETE"
FORMAT_VERSION = 1

_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"  # a checkpoint being written
_ASIDE_PREFIX = ".old-"  # an existing checkpoint of the same step, moved aside while its replacement is put in place
_TRASH_PREFIX = ".trash-"  # a pruned checkpoint, moved out of the way before deletion so it is never seen half-deleted
_ASIDE_RE = re.compile(r"^\.old-(step_\d{8,})-\d+$")
_HASH_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk is incomplete, corrupt, or does not fit the given objects."""


def checkpoint_path(out_dir: str | os.PathLike, step: int) -> Path:
    """The folder where the checkpoint of `step` lives (or will live) inside the run folder `out_dir`."""
    return Path(out_dir) / CHECKPOINTS_DIRNAME / f"step_{step:08d}"


# ----------------------------------------------------------------------------------------------------------- saving


def save_checkpoint(
    out_dir: str | os.PathLike,
    step: int,
    *,
    model: Any,
    tokenizer: Any | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    state: dict[str, Any],
    keep_last: int = 2,
    keep: Collection[int] = (),
) -> Path:
    """Atomically write the full training state of `step` to ``OUT/checkpoints/step_{step:08d}`` and return that path.

    `model` is a Hugging Face ``PreTrainedModel``, `tokenizer` its tokenizer (or None), `scheduler` an LR scheduler
    (or None), `state` any JSON-serialisable dict (step, data position, ...) that :func:`load_checkpoint` returns.
    After the new checkpoint is in place, checkpoints of earlier steps beyond the newest `keep_last` (counting the
    new one) are deleted, except those of the steps in `keep`. An existing checkpoint of the same step (re-saving
    after a resume) is replaced safely.

    On any failure the temporary folder is removed, earlier checkpoints are left untouched and a
    :class:`CheckpointError` is raised whose ``__cause__`` is the original exception.
    """
    _check_save_args(step, keep_last, state)
    tmp, final = _begin_save(out_dir, step)
    try:
        _write_checkpoint(
            tmp, step, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, state=state
        )
        _publish(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: clean up, then let them through as they are
            raise
        raise _save_error(exc, step, final) from exc
    _prune(final.parent, step, keep_last, keep)
    return final


def _check_save_args(step: int, keep_last: int, state: dict[str, Any]) -> None:
    """Fail before anything touches the disk on a bad step, keep_last or state (see :func:`save_checkpoint`)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"keep_last must be an int >= 1 (the checkpoint just written is always kept), got {keep_last!r}"
        )
    _check_json_state(state)


def _begin_save(out_dir: str | os.PathLike, step: int) -> tuple[Path, Path]:
    """Create OUT/checkpoints/, clean what crashed saves left there, and return the (not yet created) temporary
    folder to write the checkpoint of `step` into and the final folder :func:`_publish` renames it to."""
    root = Path(out_dir) / CHECKPOINTS_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    final = checkpoint_path(out_dir, step)
    return root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}", final


def _save_error(exc: BaseException, step: int, final: Path) -> CheckpointError:
    """The error a failed save raises: where, why, and that earlier checkpoints are intact."""
    hint = " (the disk is full: free space or lower keep_last)" if getattr(exc, "errno", None) == errno.ENOSPC else ""
    return CheckpointError(
        f"could not write the checkpoint of step {step} to {final}{hint}: {type(exc).__name__}: {exc}. "
        "Earlier checkpoints were left untouched."
    )


def _check_json_state(state: dict[str, Any]) -> None:
    """Fail before anything touches the disk if `state` cannot be stored as strict JSON."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"state must be JSON-serialisable without NaN/inf (it is stored in {STATE_FILENAME}): {exc}"
        ) from exc


def _write_checkpoint(tmp: Path, step: int, *, model, tokenizer, optimizer, scheduler, state) -> None:
    """Write every file of the checkpoint into `tmp`, fsync it all, and write COMPLETE last."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model_dir = tmp / MODEL_DIRNAME
    _save_model(model, model_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(model_dir)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(_get_rng_state(), tmp / "rng.pt")
    _seal(tmp, step, state, _manifest(tmp))


def _seal(tmp: Path, step: int, state: dict[str, Any], manifest: dict[str, dict[str, Any]], **extra: Any) -> None:
    """Finish the checkpoint folder `tmp` whose files are all written: state.json (the caller's `state`, the
    `manifest` of those files, any `extra` keys), an fsync of everything, and COMPLETE last."""
    document = {"format_version": FORMAT_VERSION, "step": step, "state": state, "manifest": manifest, **extra}
    write_atomic(tmp / STATE_FILENAME, json.dumps(document, indent=2, allow_nan=False))
    fsync_tree(tmp)
    write_atomic(tmp / COMPLETE_FILENAME, _sha256(tmp / STATE_FILENAME))  # fsyncs tmp: COMPLETE's name is durable


def _save_model(model: Any, model_dir: Path) -> None:
    """save_pretrained in safetensors, with tensor names exactly as in ``model.state_dict()``.

    transformers 5 by default renames some tensors on save (e.g. fused MoE experts back to per-expert tensors, the
    "original format"); that file would not load back with ``load_state_dict``, so we ask for the in-memory layout.
    transformers 5 still reads such a folder with ``from_pretrained``. A peft (LoRA) model's ``save_pretrained``
    writes its adapter only (adapter_config.json, adapter_model.safetensors), read back by :func:`_load_adapter`.
    """
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        kwargs["save_original_format"] = False
    if "save_embedding_layers" in inspect.signature(model.save_pretrained).parameters:  # peft: the base embeddings are
        kwargs["save_embedding_layers"] = False  # frozen, not trained; "auto" would look the base model up on the Hub
    model.save_pretrained(model_dir, **kwargs)
    pickled = [p.name for p in model_dir.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".pkl"}]
    if pickled:
        raise CheckpointError(f"save_pretrained wrote pickle weight files {pickled}; only safetensors are allowed")
    if not any(model_dir.glob("*.safetensors")):
        raise CheckpointError(f"save_pretrained wrote no .safetensors file into {model_dir}")


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` folder to `final`; an existing `final` is moved aside first and deleted afterwards.

    If we crash between the two renames, the old checkpoint sits in ``.old-step_*`` and is moved back by
    :func:`_restore_set_aside` (called by the next save and by :func:`find_latest_checkpoint`).
    """
    parent = final.parent
    aside = parent / f"{_ASIDE_PREFIX}{final.name}-{os.getpid()}" if final.exists() else None
    if aside is not None:
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        if aside is not None:
            os.rename(aside, final)
        raise
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)  # whatever is left is removed by the next save


def _prune(root: Path, step: int, keep_last: int, keep: Collection[int] = ()) -> None:
    """Delete checkpoints of steps before `step` beyond the newest `keep_last` (the `step` one counts as one); those
    of the steps in `keep` stay, and do not count."""
    steps = _step_dirs(root)
    older = sorted((s for s in steps if s < step and s not in keep), reverse=True)
    for s in older[keep_last - 1 :]:
        trash = root / f"{_TRASH_PREFIX}{steps[s].name}-{os.getpid()}"
        os.rename(steps[s], trash)
        shutil.rmtree(trash, ignore_errors=True)
    newer = sorted(steps[s].name for s in steps if s > step)
    if newer:
        logger.warning(
            "checkpoints of later steps than %d exist in %s (%s); find_latest_checkpoint will prefer them",
            step,
            root,
            ", ".join(newer),
        )


def _clean_leftovers(root: Path) -> None:
    """Remove what crashed saves left behind: temporary folders, set-aside copies already replaced, pruned folders."""
    _restore_set_aside(root)
    for entry in root.iterdir():
        if entry.name.startswith((_TMP_PREFIX, _ASIDE_PREFIX, _TRASH_PREFIX)):
            logger.info("removing leftover %s from an interrupted checkpoint save", entry)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _restore_set_aside(root: Path) -> None:
    """Move a checkpoint that a crashed re-save had set aside back to its name, if nothing replaced it."""
    for entry in root.iterdir():
        match = _ASIDE_RE.match(entry.name)
        if match and entry.is_dir() and not (root / match.group(1)).exists():
            logger.warning("restoring %s, set aside by a save that was interrupted", root / match.group(1))
            os.rename(entry, root / match.group(1))
            fsync_dir(root)


# ------------------------------------------------------------------------------------------------- finding, verifying


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of the checkpoint folder `path` (``step_00000006``: 6), read from its name."""
    match = _STEP_DIR_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step_NNNNNNNN)")
    return int(match.group(1))


def _step_dirs(root: Path) -> dict[int, Path]:
    """step -> folder for every ``step_*`` folder in `root` (complete or not)."""
    found: dict[int, Path] = {}
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR_RE.match(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = entry
    return found


def verify_checkpoint(path: str | os.PathLike, *, part: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Check that the checkpoint folder `path` is complete and intact and return its parsed state.json document.

    Raises :class:`CheckpointError` saying what is wrong: no COMPLETE marker (the write never finished), state.json
    not matching the marker, or a file of the manifest missing, of the wrong size, or with the wrong sha256.
    `part` = (i, n) checks only every n-th file of the manifest from the i-th: n processes verifying one checkpoint
    together (`gspo.parallel.state`) each read 1/n of it.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    marker = path / COMPLETE_FILENAME
    if not marker.is_file():
        raise CheckpointError(f"no {COMPLETE_FILENAME} marker (the save was interrupted)")
    state_file = path / STATE_FILENAME
    if not state_file.is_file():
        raise CheckpointError(f"{STATE_FILENAME} is missing")
    if _sha256(state_file) != marker.read_text().strip():
        raise CheckpointError(f"{STATE_FILENAME} does not match the sha256 recorded in {COMPLETE_FILENAME}")
    try:
        document = json.loads(state_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{STATE_FILENAME} is not valid JSON: {exc}") from exc
    if document.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"unsupported checkpoint format_version {document.get('format_version')!r}")
    index, count = part
    for rel, expected in list(document["manifest"].items())[index::count]:
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{rel} is missing")
        size = file.stat().st_size
        if size != expected["size"]:
            raise CheckpointError(f"{rel} has {size} bytes, the manifest says {expected['size']} (truncated?)")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{rel} does not match its sha256 in the manifest (corrupted)")
    return document


def find_latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete and intact checkpoint of the run in `out_dir`, or None if there is none.

    Newer checkpoints that fail :func:`verify_checkpoint` are skipped with a warning naming them and the reason.
    A checkpoint that an interrupted re-save of the same step had moved aside is first moved back to its name.
    """
    root = Path(out_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return None
    _restore_set_aside(root)
    steps = _step_dirs(root)
    for step in sorted(steps, reverse=True):
        try:
            verify_checkpoint(steps[step])
        except CheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", steps[step], exc)
            continue
        return steps[step]
    return None


def list_checkpoints(out_dir: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint folders of the run in `out_dir`, oldest first (not verified: `load_checkpoint`
    verifies the one it loads)."""
    root = Path(out_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    _restore_set_aside(root)
    return sorted(_step_dirs(root))


# ----------------------------------------------------------------------------------------------------------- loading


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
) -> dict[str, Any]:
    """Verify the checkpoint at `path`, load weights, optimizer and scheduler state and RNG states; return `state`.

    The weights are loaded into the existing `model` (its device and dtype are kept). Raises
    :class:`CheckpointError` if the checkpoint is corrupt or does not fit the given model / optimizer / scheduler.
    """
    path = Path(path)
    document = verify_checkpoint(path)
    _load_verified(path, model, optimizer, scheduler)
    return document["state"]


def _load_verified(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """:func:`load_checkpoint` after the verification (done by the caller)."""
    _load_model_weights(model, path / MODEL_DIRNAME)
    optimizer.load_state_dict(_torch_load(path / "optimizer.pt"))
    _load_scheduler(path, scheduler)
    _set_rng_state(_torch_load(path / "rng.pt"))


def _load_scheduler(path: Path, scheduler: Any | None) -> None:
    """Restore `scheduler` from the checkpoint at `path`; an error if only one of them has a scheduler."""
    scheduler_file = path / "scheduler.pt"
    if scheduler is not None and not scheduler_file.is_file():
        raise CheckpointError(f"{path} has no scheduler state, but a scheduler was given to restore")
    if scheduler is None and scheduler_file.is_file():
        raise CheckpointError(f"{path} has scheduler state, but no scheduler was given to restore it into")
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(scheduler_file))
        _rates_from_schedule(scheduler)


def _rates_from_schedule(scheduler: Any) -> None:
    """Set the optimizer's learning rates to what `scheduler`'s schedule gives at its restored step (a LambdaLR: base
    rate × factor, as its `step` computes them; other schedulers keep the restored rates). The optimizer's state holds
    the rates the saved run's schedule set: a resume that extends trainer.steps (a longer decay) took its first
    update at the old schedule's rate, the rest at the new one's. Unchanged for a resume of the same schedule."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    rates = [base * factor(scheduler.last_epoch) for factor, base in zip(lambdas, scheduler.base_lrs, strict=True)]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() returns


def _torch_load(file: Path) -> Any:
    """torch.load restricted to tensors and plain containers (no code can run from a tampered file)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{file} holds objects other than tensors and plain containers; refusing to unpickle it "
            f"(torch.load weights_only=True): {str(exc).splitlines()[0]}"
        ) from exc


def _load_model_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Load every safetensors file in `model_dir` into `model`; only tied copies may be absent from the files.

    Hugging Face drops a tied tensor (``lm_head.weight`` tied to ``embed_tokens.weight``) from the file; it is
    filled by loading the tensor it shares storage with, so it is accepted as missing. Anything else missing or
    unexpected is an error: a checkpoint silently loading half its weights would be a wrong resume.
    """
    weights = _read_weights(model_dir)
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        _load_adapter(model, model_dir, weights)
        return
    try:
        result = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # shape mismatches are raised even with strict=False
        raise CheckpointError(f"the weights in {model_dir} do not fit the model: {exc}") from exc
    if result.unexpected_keys:
        raise CheckpointError(f"the weights in {model_dir} have tensors the model lacks: {result.unexpected_keys}")
    untied = [key for key in result.missing_keys if not _is_tied_to_loaded(model, key, weights)]
    if untied:
        raise CheckpointError(f"the weights in {model_dir} lack tensors of the model (not tied ones): {untied}")


def _load_adapter(model: Any, model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    """Load a LoRA (peft) model's checkpoint: its adapter tensors only, as `PeftModel.save_pretrained` wrote them in
    `_save_model` (the frozen base weights are not saved; the resumed run rebuilds them from `model.name`). The
    tensor names must be exactly the model's adapter names: a checkpoint of another rank or other targets is an
    error, as is one written without LoRA."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = set(get_peft_model_state_dict(model))
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"the weights in {model_dir} do not fit the LoRA adapters: missing {missing[:5]} "
                              f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
    try:
        set_peft_model_state_dict(model, weights)
    except RuntimeError as exc:  # shape mismatches (another rank)
        raise CheckpointError(f"the adapter weights in {model_dir} do not fit the model: {exc}") from exc


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `model_dir` (on the CPU)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def _is_tied_to_loaded(model: torch.nn.Module, key: str, loaded: dict[str, torch.Tensor]) -> bool:
    """Whether the model tensor `key` shares its memory with a tensor that was loaded, i.e. it is tied to it."""
    tensors = model.state_dict(keep_vars=True)
    target = tensors[key]
    if target.numel() == 0:
        return False
    return any(
        other in tensors and tensors[other].data_ptr() == target.data_ptr() and tensors[other].shape == target.shape
        for other in loaded
    )


# --------------------------------------------------------------------------------------------------------------- RNG


def set_seed(seed: int) -> None:
    """Seed python `random`, numpy's global RNG (if numpy is installed) and torch (CPU and all CUDA devices)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)


def _get_rng_state() -> dict[str, Any]:
    """All global RNG states, as tensors and tuples/lists of numbers so that ``torch.load(weights_only=True)`` can
    read them back."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        states["numpy"] = (str(name), keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian))
    return states


def _set_rng_state(states: dict[str, Any]) -> None:
    """Restore what :func:`_get_rng_state` saved; a generator that cannot be restored here is reported, not fatal."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "torch_cuda" in states:
        cuda_states = states["torch_cuda"]
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "the checkpoint has RNG states of %d CUDA devices, which cannot be restored here", len(cuda_states)
            )
    if "numpy" in states:
        try:
            import numpy as np
        except ImportError:
            logger.warning("the checkpoint has a numpy RNG state, but numpy is not installed")
        else:
            name, keys, pos, has_gauss, cached_gaussian = states["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))


# ------------------------------------------------------------------------------------------------------------- files


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path, files: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """relative path -> size and sha256 of every file under `folder` (state.json and COMPLETE are added later), or
    of the given `files` under it only (processes hashing one folder together each take a share)."""
    if files is None:
        files = [file for file in sorted(folder.rglob("*")) if file.is_file()]
    return {
        file.relative_to(folder).as_posix(): {"size": file.stat().st_size, "sha256": _sha256(file)} for file in files
    }

"""The training state of a (possibly wrapped) policy: checkpoints (`save_state`, `load_state`) and the final model
(`full_state`).

Checkpoints are `gspo.checkpoint`'s crash-safe folders (written into a temporary folder, a manifest of sha256s, a
COMPLETE marker, one atomic rename, pruning: all of it implemented once, there), in one of two layouts:

* **one-process** (one process and DDP): `gspo.checkpoint.save_checkpoint` of the bare model, written by rank 0.
* **sharded** (FSDP): every process writes only its own shards of the weights and the optimizer state with
  torch.distributed.checkpoint (DCP), so nothing is gathered onto one process (under FSDP the full state need not fit
  one machine)::

      OUT/checkpoints/step_00000040/
          sharded/         DCP: .metadata and __<rank>_0.distcp per process; {"model": ..., "optimizer": ...}
                           keyed by parameter name (get_model_state_dict / get_optimizer_state_dict)
          model/           config.json and tokenizer files (no weights)
          scheduler.pt     the LR scheduler's state_dict()
          rng/rank_00000.pt ...   every process's RNG states
          state.json       the trainer state, the manifest of every file above, "layout": "sharded", "world_size"
          COMPLETE         written last

  Rank 0 prepares the temporary folder and, once every process has written its shards and hashed its share of the
  files, writes state.json and COMPLETE and renames the folder into place: a crash at any moment leaves the earlier
  checkpoints and at most one complete new one, and `gspo.checkpoint.find_latest_checkpoint` verifies (and skips)
  sharded checkpoints exactly like one-process ones. Every process writes into OUT: it must be a file system they all
  see (one machine, or a shared file system across machines).

Either layout loads into one process, DDP, or FSDP over any number of processes: DCP reshards a sharded checkpoint
as it reads it, and a one-process checkpoint loads into FSDP as full tensors of which each process keeps its shards.
Unlike the one-process layout (read with `torch.load(weights_only=True)`), DCP's `.metadata` and the non-tensor
entries (optimizer hyperparameters) are pickles: the manifest detects corruption, it does not make a folder from an
untrusted source safe to load.

All three functions are collective under torchrun: every process calls them, in the same order. A failure on one
process raises a CheckpointError on every process, so that none is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo import checkpoint as ckpt
from gspo.checkpoint import CheckpointError
from gspo.parallel.group import ProcessGroup
from gspo.rollout.weights import unwrap_model

__all__ = ["FullModelView", "full_state", "load_state", "save_state"]

log = logging.getLogger(__name__)

LAYOUT = "sharded"  # state.json's "layout" of a sharded checkpoint (a one-process checkpoint has none)
SHARDED_DIRNAME = "sharded"
RNG_DIRNAME = "rng"


# ----------------------------------------------------------------------------------------------------------- saving


def save_state(group: ProcessGroup, out, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
               tokenizer, state: dict, keep_last: int, keep: Collection[int] = ()) -> None:
    """Checkpoint the training state of `step` into OUT/checkpoints/step_{step:08d} (collective).

    One process and DDP: the one-process layout, written by rank 0. FSDP: the sharded layout (module docstring).
    `state` is the trainer's JSON state that `load_state` returns; checkpoints of earlier steps beyond the newest
    `keep_last` are deleted, except those of the steps in `keep`. Raises CheckpointError on every process if the
    save failed anywhere (earlier checkpoints are then untouched)."""
    model = unwrap_model(model)  # the HF model and its names (under FSDP its parameters are the sharded ones)
    if group.fsdp:
        _save_sharded(group, out, step, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
                      state=state, keep_last=keep_last, keep=keep)
        return

    def save() -> None:
        if group.is_main:
            ckpt.save_checkpoint(out, step, model=model, tokenizer=tokenizer, optimizer=optimizer,
                                 scheduler=scheduler, state=state, keep_last=keep_last, keep=keep)

    _on_all(group, save)


def _save_sharded(group: ProcessGroup, out, step: int, *, model, optimizer, scheduler, tokenizer, state,
                  keep_last, keep=()) -> None:
    """The sharded save, in phases that every process ends together (`_on_all`)."""
    ckpt._check_save_args(step, keep_last, state)  # the same arguments everywhere: every process fails alike
    final = ckpt.checkpoint_path(out, step)
    tmp: Path | None = None

    def failed(exc: Exception) -> str:
        return str(ckpt._save_error(exc, step, final))

    def begin() -> Path | None:  # rank 0: the temporary folder, with what the checkpoint needs one copy of
        nonlocal tmp
        if not group.is_main:
            return None
        tmp, _ = ckpt._begin_save(out, step)
        (tmp / ckpt.MODEL_DIRNAME).mkdir(parents=True)
        (tmp / RNG_DIRNAME).mkdir()
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(tmp / ckpt.MODEL_DIRNAME)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / ckpt.MODEL_DIRNAME)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        return tmp

    try:
        folder = _on_all(group, begin, failed)[0]
        _on_all(group, lambda: _write_shards(group, folder, model, optimizer), failed)
        files = _on_all(group, lambda: _files(folder) if group.is_main else None, failed)[0]
        shares = _on_all(group, lambda: ckpt._manifest(folder, files[group.rank::group.world_size]), failed)
        manifest = dict(sorted(entry for share in shares for entry in share.items()))

        def publish() -> None:
            if group.is_main:
                ckpt._seal(folder, step, state, manifest, layout=LAYOUT, world_size=group.world_size)
                ckpt._publish(folder, final)

        _on_all(group, publish, failed)
    except BaseException:
        if tmp is not None:  # rank 0 (a crash leaves it to the next save's cleanup)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _on_all(group, lambda: ckpt._prune(final.parent, step, keep_last, keep) if group.is_main else None)


def _write_shards(group: ProcessGroup, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """This process's shards of the weights and optimizer state (DCP, collective) and its RNG states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rng = ckpt._get_rng_state()
    dcp.save({"model": _checkpointed(model, get_model_state_dict(model)),
              "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder / SHARDED_DIRNAME)
    torch.save(rng, folder / RNG_DIRNAME / f"rank_{group.rank:05d}.pt")


def _checkpointed(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """What of the model's `state` a checkpoint holds: all of it, but for a LoRA (peft) model only the trainable
    adapter tensors, as in one-process checkpoints (the frozen base is rebuilt from model.name on resume: a 70B base
    is not written at every checkpoint)."""
    if not hasattr(model, "peft_config"):
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {key: value for key, value in state.items() if key in trainable}


def _files(folder: Path) -> list[Path]:
    """Every file under `folder`, as rank 0 sees them (so that every process hashes its share of the same list)."""
    return [file for file in sorted(folder.rglob("*")) if file.is_file()]


def _on_all(group: ProcessGroup, fn: Callable[[], Any], describe: Callable[[Exception], str] = str) -> list[Any]:
    """Run `fn` on this process and return every process's result, in rank order. If it raised on any process, raise
    a CheckpointError naming each failure (`describe`d) on every process: none may go on to wait forever in a
    collective for a process that gave up. One process: `[fn()]`, whose errors propagate as they are."""
    if not group.enabled:
        return [fn()]
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:
        error = exc
    outcomes = group.all_gather_object((result, None if error is None else describe(error)))
    failures = [f"rank {rank}: {message}" for rank, (_, message) in enumerate(outcomes) if message is not None]
    if failures:
        raise CheckpointError("; ".join(failures)) from error
    return [value for value, _ in outcomes]


# ----------------------------------------------------------------------------------------------------------- loading


def load_state(group: ProcessGroup, path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Load the checkpoint at `path`, of either layout, into the (wrapped) `model`, its `optimizer` (built on the
    wrapped model) and `scheduler`, and restore the RNG states; returns the checkpoint's `state` (collective).

    The checkpoint is verified first (every process hashes its share of the files). A sharded checkpoint is read by
    DCP, resharded to this run's processes (or whole, for one process or DDP); a one-process checkpoint into FSDP is
    read whole by every process, which keeps its shards. Raises CheckpointError if the checkpoint is corrupt or does
    not fit the model / optimizer / scheduler."""
    path = Path(path)
    model = unwrap_model(model)  # the HF model and its names (under FSDP its parameters are the sharded ones)
    document = _verify(group, path)
    if document.get("layout") == LAYOUT:
        _load_sharded(group, path, model, optimizer, document)
    elif group.fsdp:
        _load_full_into_fsdp(group, path, model, optimizer)
    else:
        _on_all(group, lambda: ckpt._load_verified(path, model, optimizer, scheduler))
        return document["state"]
    ckpt._load_scheduler(path, scheduler)
    ckpt._set_rng_state(ckpt._torch_load(_rng_file(group, path, document)))
    return document["state"]


def _verify(group: ProcessGroup, path: Path) -> dict:
    """`verify_checkpoint`, with the hashing shared out over the processes; returns state.json's document."""
    document: dict = {}

    def verify() -> None:
        document.update(ckpt.verify_checkpoint(path, part=(group.rank, group.world_size)))

    _on_all(group, verify, lambda exc: f"{path} is not a complete, intact checkpoint: {exc}")
    return document


def _load_sharded(group: ProcessGroup, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  document: dict) -> None:
    """Read a sharded checkpoint into the FSDP `model` (DCP reshards) or into the bare model (one process, DDP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    try:
        # the state dicts to read into: this process's shards under FSDP, full tensors otherwise
        state = {"model": _checkpointed(model, get_model_state_dict(model)),
                 "optimizer": get_optimizer_state_dict(model, optimizer)}
        with warnings.catch_warnings():  # one process reading a sharded checkpoint is what we mean to do
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path / SHARDED_DIRNAME)
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not hasattr(model, "peft_config")))
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    except Exception as exc:  # DCP raises on every process alike
        raise CheckpointError(f"the sharded checkpoint {path} (written by {document.get('world_size')} processes) "
                              f"does not fit the model and optimizer: {type(exc).__name__}: {exc}") from exc


def _load_full_into_fsdp(group: ProcessGroup, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read a one-process checkpoint into the FSDP `model`: every process reads the full tensors and keeps its
    shards; the optimizer state, saved keyed by parameter index, is keyed by parameter name for that."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    files: dict = {}

    def read() -> None:
        files["weights"] = ckpt._read_weights(path / ckpt.MODEL_DIRNAME)
        files["saved"] = ckpt._torch_load(path / "optimizer.pt")

    _on_all(group, read, lambda exc: f"could not read {path}: {type(exc).__name__}: {exc}")
    weights, saved = files["weights"], files["saved"]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    peft = hasattr(model, "peft_config")
    if peft:  # peft's adapter files: the trainable tensors, named without the adapter's name
        weights = _adapter_weights(model, names, weights, path)
    try:
        result = set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    except RuntimeError as exc:
        raise CheckpointError(f"the weights in {path} do not fit the model: {exc}") from exc
    params = dict(model.named_parameters(remove_duplicate=False))
    untied = [key for key in result.missing_keys  # a tied copy (lm_head ~ embed_tokens) is absent from the files
              if not any(params.get(key) is not None and params.get(key) is params.get(name) for name in weights)
              and not (peft and key not in names)]  # LoRA: the frozen base comes from model.name
    if result.unexpected_keys or untied:
        raise CheckpointError(f"the weights in {path} do not fit the model: unexpected {result.unexpected_keys}, "
                              f"missing {untied}")
    try:
        by_name = {"state": {names[i]: s for i, s in saved["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    except (IndexError, KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"the optimizer state in {path} does not fit the optimizer: {exc}") from exc


def _adapter_weights(model: nn.Module, trainable: list[str], weights: dict[str, torch.Tensor],
                     path: Path) -> dict[str, torch.Tensor]:
    """A one-process LoRA checkpoint's adapter tensors (named as `PeftModel.save_pretrained` writes them: without the
    adapter's name) under the model's parameter names; CheckpointError unless they are exactly its adapters."""
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    saved_as = {name: name.replace(f".{adapter}.", ".") for name in trainable}
    missing = sorted(set(saved_as.values()) - weights.keys())
    unexpected = sorted(weights.keys() - set(saved_as.values()))
    if missing or unexpected:
        raise CheckpointError(f"the weights in {path} do not fit the LoRA adapters: missing {missing[:5]} "
                              f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})")
    return {name: weights[saved] for name, saved in saved_as.items()}


def _rng_file(group: ProcessGroup, path: Path, document: dict) -> Path:
    """This process's saved RNG states: its own in a sharded checkpoint of as many processes, else rank 0's (a
    one-process checkpoint's, or, with another number of processes, the same ones on every process)."""
    if document.get("layout") != LAYOUT:
        return path / "rng.pt"
    if document.get("world_size") == group.world_size:
        return path / RNG_DIRNAME / f"rank_{group.rank:05d}.pt"
    log.info("%s was saved by %s processes, this run has %d: every process restores rank 0's RNG states", path,
             document.get("world_size"), group.world_size)
    return path / RNG_DIRNAME / "rank_00000.pt"


# ----------------------------------------------------------------------------------------------------- final model


@contextlib.contextmanager
def full_state(group: ProcessGroup, model: nn.Module) -> Iterator[Any]:
    """The model as a one-process run saves it (anything with `save_pretrained`) on rank 0, None elsewhere: for
    OUT/final/, a plain Hugging Face model directory.

    One process / DDP: the bare model. FSDP (collective: every process enters): a view holding the full weights,
    gathered once onto rank 0's CPU."""
    model = unwrap_model(model)  # the HF model and its names (under FSDP its parameters are the sharded ones)
    if not group.fsdp:
        yield model if group.is_main else None
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen: set[int] = set()  # tied parameters (one object, several names): keep the first name, as HF saves
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            weights.pop(name, None)
        seen.add(id(param))
    yield FullModelView(model, weights) if group.is_main else None


class FullModelView:
    """What saving a model needs of it (`save_pretrained`), for an FSDP model whose full weights were gathered into
    `weights` (a LoRA policy: `model` is the peft model, `weights` its full state dict: `gspo.lora.save_lora_final`)."""

    def __init__(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self.model = model
        self.weights = weights

    def save_pretrained(self, save_directory, save_original_format: bool = True, **kwargs) -> None:
        if "save_original_format" in inspect.signature(self.model.save_pretrained).parameters:
            kwargs["save_original_format"] = save_original_format
        self.model.save_pretrained(save_directory, state_dict=self.weights, **kwargs)

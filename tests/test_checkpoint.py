"""Tests for gspo.checkpoint: exact round trips, RNG restore, pruning, and surviving crashes and corruption."""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from gspo import checkpoint as ckpt
from gspo.checkpoint import (
    CheckpointError,
    checkpoint_path,
    find_latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    set_seed,
    verify_checkpoint,
)

CONFIG = dict(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    tie_word_embeddings=True,
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(30)} | {"<unk>": 30, "<eos>": 31}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def make_training(seed: int = 0):
    """A tiny tied-embedding Qwen3 with an AdamW optimizer and LambdaLR scheduler."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def save(out: Path, step: int, training, **kwargs) -> Path:
    model, optimizer, scheduler = training
    state = kwargs.pop("state", {"step": step, "data_position": 3 * step})
    return save_checkpoint(
        out,
        step,
        model=model,
        tokenizer=make_tokenizer(),
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        **kwargs,
    )


def assert_optimizer_states_equal(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key in a["state"]:
        for name, value in a["state"][key].items():
            other = b["state"][key][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other


@pytest.fixture
def training():
    model, optimizer, scheduler = make_training()
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def test_round_trip_is_exact(tmp_path, training):
    model, optimizer, scheduler = training
    path = save(tmp_path, 5, training, state={"step": 5, "data_position": 17, "nested": {"a": [1, 2.5]}})
    assert path == checkpoint_path(tmp_path, 5) == tmp_path / "checkpoints" / "step_00000005"
    assert (path / "COMPLETE").is_file()
    assert not list((path / "model").glob("*.bin"))
    assert (path / "model" / "tokenizer.json").is_file()

    fresh_model, fresh_optimizer, fresh_scheduler = make_training(seed=1)
    assert not torch.equal(fresh_model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    state = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer, scheduler=fresh_scheduler)

    assert state == {"step": 5, "data_position": 17, "nested": {"a": [1, 2.5]}}
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fresh_model.lm_head.weight.data_ptr() == fresh_model.model.embed_tokens.weight.data_ptr()  # still tied
    assert_optimizer_states_equal(optimizer.state_dict(), fresh_optimizer.state_dict())
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()

    # Training continues identically from the restored state.
    set_seed(7)
    train_step(model, optimizer, scheduler)
    set_seed(7)
    train_step(fresh_model, fresh_optimizer, fresh_scheduler)
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_resume_on_a_longer_schedule_takes_its_first_update_at_the_new_schedules_rate(tmp_path):
    """A resume that extends trainer.steps restores the step on a longer warm-up + cosine schedule: the first update
    after it runs at the new schedule's rate there (it ran at the old schedule's final rate, 1e-4 instead of 6.5e-4)."""
    from gspo.optim import make_optimizer, warmup_cosine

    model, _, _ = make_training()
    optimizer, scheduler = make_optimizer(model, 1e-3, 16, warmup_steps=4)
    for _ in range(16):  # no gradients: only the schedule moves
        optimizer.step()
        scheduler.step()
    path = save(tmp_path, 16, (model, optimizer, scheduler))
    optimizer, scheduler = make_optimizer(model, 1e-3, 32, warmup_steps=4)
    load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
    want = 1e-3 * warmup_cosine(32, 4, 0.1)(16)
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == want
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1e-3 * warmup_cosine(32, 4, 0.1)(17)


def test_rng_states_are_restored(tmp_path, training):
    set_seed(123)
    path = save(tmp_path, 1, training)
    expected = (torch.rand(4), random.random(), np.random.rand(3), torch.randint(0, 100, (3,)))
    set_seed(999)
    load_checkpoint(path, model=training[0], optimizer=training[1], scheduler=training[2])
    again = (torch.rand(4), random.random(), np.random.rand(3), torch.randint(0, 100, (3,)))
    assert torch.equal(expected[0], again[0])
    assert expected[1] == again[1]
    np.testing.assert_array_equal(expected[2], again[2])
    assert torch.equal(expected[3], again[3])


def test_rng_file_loads_with_weights_only(tmp_path, training):
    random.gauss(0, 1)  # makes python's state carry a cached gaussian float
    np.random.standard_normal()  # and numpy's a cached one
    path = save(tmp_path, 1, training)
    states = torch.load(path / "rng.pt", weights_only=True)
    assert set(states) >= {"torch", "python", "numpy"}


def test_set_seed_is_reproducible_and_validated():
    set_seed(3)
    first = (torch.rand(2), random.random(), np.random.rand())
    set_seed(3)
    assert torch.equal(first[0], torch.rand(2)) and first[1] == random.random() and first[2] == np.random.rand()
    with pytest.raises(ValueError, match="seed"):
        set_seed(-1)


def test_keep_last_prunes_older_checkpoints(tmp_path, training):
    for step in (10, 20, 30, 40):
        save(tmp_path, step, training, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000030", "step_00000040"]
    save(tmp_path, 50, training, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000050"]
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 60, training, keep_last=0)


def test_kept_steps_survive_pruning_and_do_not_count(tmp_path, training):
    """`keep` (the collapse guard's best checkpoint) is never pruned; keep_last still keeps as many newer ones."""
    for step in (10, 20, 30, 40):
        save(tmp_path, step, training, keep_last=2, keep={10})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000010", "step_00000030", "step_00000040"]
    save(tmp_path, 50, training, keep_last=1)  # no longer kept: pruned like any other
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000050"]


def test_find_latest_on_empty_run(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    assert find_latest_checkpoint(tmp_path) is None


def _truncate(path: Path) -> None:
    weights = path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _flip_byte(path: Path) -> None:
    file = path / "optimizer.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _drop_marker(path: Path) -> None:
    (path / "COMPLETE").unlink()


def _edit_state(path: Path) -> None:
    file = path / "state.json"
    file.write_text(file.read_text().replace('"data_position": 6', '"data_position": 7'))


def _remove_scheduler(path: Path) -> None:
    (path / "scheduler.pt").unlink()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "truncated"),
        (_flip_byte, "corrupted"),
        (_drop_marker, "COMPLETE"),
        (_edit_state, "state.json"),
        (_remove_scheduler, "missing"),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_with_warning(tmp_path, training, caplog, damage, reason):
    save(tmp_path, 1, training, keep_last=3)
    newest = save(tmp_path, 2, training, keep_last=3)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="gspo.checkpoint"):
        latest = find_latest_checkpoint(tmp_path)
    assert latest == checkpoint_path(tmp_path, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0]
    with pytest.raises(CheckpointError):
        load_checkpoint(newest, model=training[0], optimizer=training[1], scheduler=training[2])


def test_all_damaged_gives_none(tmp_path, training):
    _drop_marker(save(tmp_path, 1, training))
    assert find_latest_checkpoint(tmp_path) is None


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("pristine")
    model, optimizer, scheduler = make_training()
    train_step(model, optimizer, scheduler)
    return save(out, 1, (model, optimizer, scheduler))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file_pick=st.integers(min_value=0), position=st.floats(min_value=0, max_value=1, exclude_max=True))
def test_any_flipped_byte_is_detected(pristine_checkpoint, file_pick, position):
    """Property: flipping any one byte of any file of a checkpoint makes it fail verification."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "step_00000001"
        shutil.copytree(pristine_checkpoint, copy)
        verify_checkpoint(copy)
        files = sorted(p for p in copy.rglob("*") if p.is_file())
        file = files[file_pick % len(files)]
        data = bytearray(file.read_bytes())
        data[int(position * len(data))] ^= 0x01
        file.write_bytes(bytes(data))
        with pytest.raises(CheckpointError):
            verify_checkpoint(copy)


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, training, monkeypatch):
    model, optimizer, scheduler = training
    previous = save(tmp_path, 1, training)
    real_save = torch.save

    def save_then_fail(obj, file, *args, **kwargs):
        if Path(file).name == "scheduler.pt":
            Path(file).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", save_then_fail)
    train_step(model, optimizer, scheduler)
    with pytest.raises(CheckpointError, match="disk is full") as info:
        save(tmp_path, 2, training)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()

    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    assert find_latest_checkpoint(tmp_path) == previous
    fresh = make_training(seed=1)
    assert load_checkpoint(previous, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])["step"] == 1


@pytest.mark.parametrize("leftover_name", [".tmp-step_00000002-99999", ".trash-step_00000000-99999"],
                         ids=["half-written", "half-deleted"])
def test_leftover_tmp_dir_from_crash_is_removed_and_ignored(tmp_path, training, leftover_name):
    """A crash while writing a checkpoint leaves a `.tmp-` folder, one while deleting a pruned checkpoint a `.trash-`
    folder: never a checkpoint, removed by the next save."""
    save(tmp_path, 1, training)
    leftover = tmp_path / "checkpoints" / leftover_name
    (leftover / "model").mkdir(parents=True)
    assert find_latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    save(tmp_path, 3, training)
    assert not leftover.exists()


def test_resaving_same_step_replaces_it(tmp_path, training):
    model, optimizer, scheduler = training
    save(tmp_path, 1, training, keep_last=1)
    path = save(tmp_path, 4, training, state={"step": 4, "attempt": 1}, keep_last=1)
    train_step(model, optimizer, scheduler)
    again = save(tmp_path, 4, training, state={"step": 4, "attempt": 2}, keep_last=1)
    assert again == path
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]
    fresh = make_training(seed=1)
    assert load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2]) == {"step": 4, "attempt": 2}
    assert torch.equal(fresh[0].model.norm.weight, model.model.norm.weight)


def test_checkpoint_set_aside_by_crashed_resave_is_restored(tmp_path, training):
    """A crash between moving the old step_4 aside and renaming the new one in must not lose step_4."""
    path = save(tmp_path, 4, training, keep_last=1)
    aside = tmp_path / "checkpoints" / ".old-step_00000004-12345"
    path.rename(aside)
    assert find_latest_checkpoint(tmp_path) == path
    verify_checkpoint(path)


def test_failed_resave_keeps_the_old_copy(tmp_path, training, monkeypatch):
    path = save(tmp_path, 4, training, state={"step": 4, "attempt": 1})

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(ckpt, "fsync_tree", fail)
    with pytest.raises(CheckpointError, match="I/O error"):
        save(tmp_path, 4, training, state={"step": 4, "attempt": 2})
    assert json.loads((path / "state.json").read_text())["state"] == {"step": 4, "attempt": 1}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000004"]


def test_state_must_be_json(tmp_path, training):
    with pytest.raises(TypeError, match="JSON"):
        save(tmp_path, 1, training, state={"loss": float("nan")})
    with pytest.raises(TypeError, match="JSON"):
        save(tmp_path, 1, training, state={"t": torch.tensor(1.0)})
    assert not (tmp_path / "checkpoints").exists()  # rejected before anything was written


def test_scheduler_mismatch_is_an_error(tmp_path, training):
    model, optimizer, _ = training
    path = save_checkpoint(
        tmp_path, 1, model=model, tokenizer=None, optimizer=optimizer, scheduler=None, state={"step": 1}
    )
    assert not (path / "scheduler.pt").exists()
    fresh = make_training(seed=1)
    with pytest.raises(CheckpointError, match="no scheduler state"):
        load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=None) == {"step": 1}


def test_weights_of_another_model_are_rejected(tmp_path, training):
    path = save(tmp_path, 1, training)
    other = Qwen3ForCausalLM(Qwen3Config(**{**CONFIG, "num_hidden_layers": 2}))
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(CheckpointError, match="lack tensors"):
        load_checkpoint(path, model=other, optimizer=optimizer, scheduler=None)


def test_untied_model_round_trips(tmp_path):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**{**CONFIG, "tie_word_embeddings": False}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save_checkpoint(tmp_path, 0, model=model, tokenizer=None, optimizer=optimizer, scheduler=None, state={})
    torch.manual_seed(1)
    fresh = Qwen3ForCausalLM(Qwen3Config(**{**CONFIG, "tie_word_embeddings": False}))
    load_checkpoint(path, model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1), scheduler=None)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


class _Payload:
    """Unpickling this creates `marker`: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_in_optimizer_pt_is_refused_not_run(tmp_path, training):
    """An attacker who can write the checkpoint can also fix its manifest: weights_only=True is the real guard."""
    path = save(tmp_path, 1, training)
    marker = tmp_path / "payload-ran"
    torch.save({"state": {}, "param_groups": [], "evil": _Payload(marker)}, path / "optimizer.pt")
    document = json.loads((path / "state.json").read_text())  # re-sign the tampered file
    document["manifest"]["optimizer.pt"] = {"size": (path / "optimizer.pt").stat().st_size,
                                            "sha256": ckpt._sha256(path / "optimizer.pt")}
    (path / "state.json").write_text(json.dumps(document))
    (path / "COMPLETE").write_text(ckpt._sha256(path / "state.json"))
    verify_checkpoint(path)  # the tampering is invisible to the manifest

    fresh = make_training(seed=1)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt holds objects other than tensors.*refusing"):
        load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert not marker.exists()


def test_a_checkpoint_of_another_format_version_is_refused(tmp_path, training):
    """A state.json written by another layout version (re-signed, so intact) is not read as this one."""
    path = save(tmp_path, 1, training)
    document = json.loads((path / "state.json").read_text())
    document["format_version"] = ckpt.FORMAT_VERSION + 1
    (path / "state.json").write_text(json.dumps(document))
    (path / "COMPLETE").write_text(ckpt._sha256(path / "state.json"))
    with pytest.raises(CheckpointError, match="unsupported checkpoint format_version 2"):
        verify_checkpoint(path)
    assert find_latest_checkpoint(tmp_path) is None


def test_list_checkpoints_gives_the_steps_oldest_first(tmp_path):
    """Whatever order the folders were made (and the file system lists them) in; other entries are not steps."""
    root = tmp_path / "checkpoints"
    steps = [7, 120, 3, 45, 9, 1000, 0, 64, 12, 5]
    for step in steps:
        checkpoint_path(tmp_path, step).mkdir(parents=True)
    (root / "step_00000099").write_text("a file, not a checkpoint folder")
    (root / "notes").mkdir()
    assert ckpt.list_checkpoints(tmp_path) == sorted(steps)
    assert ckpt.list_checkpoints(tmp_path / "elsewhere") == []


def test_weights_with_tensors_the_model_lacks_are_rejected(tmp_path):
    """A checkpoint of a deeper model does not load into a shallower one (its extra layers would be dropped)."""
    torch.manual_seed(0)
    deeper = Qwen3ForCausalLM(Qwen3Config(**{**CONFIG, "num_hidden_layers": 2}))
    path = save_checkpoint(tmp_path, 1, model=deeper, tokenizer=None, optimizer=torch.optim.AdamW(deeper.parameters()),
                           scheduler=None, state={})
    model, optimizer, _ = make_training()
    with pytest.raises(CheckpointError, match=r"tensors the model lacks: \['model\.layers\.1\."):
        load_checkpoint(path, model=model, optimizer=optimizer, scheduler=None)


def test_a_checkpoint_with_scheduler_state_needs_a_scheduler_to_restore_it(tmp_path, training):
    """Loading it without one would resume at the wrong learning rate without a word."""
    path = save(tmp_path, 1, training)
    fresh = make_training(seed=1)
    with pytest.raises(CheckpointError, match="has scheduler state, but no scheduler was given"):
        load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=None)


def test_a_set_aside_copy_whose_replacement_is_in_place_is_removed_not_restored(tmp_path, training):
    """A re-save that crashed after renaming the new checkpoint in but before deleting the old copy: the new one is
    the checkpoint (listed, found, the old copy removed by the next save), and listing or finding does not fail."""
    first = save(tmp_path, 4, training, state={"step": 4, "attempt": 1})
    old_copy = tmp_path / "old-copy"
    shutil.copytree(first, old_copy)
    new = save(tmp_path, 4, training, state={"step": 4, "attempt": 2})
    aside = tmp_path / "checkpoints" / ".old-step_00000004-12345"
    old_copy.rename(aside)
    assert ckpt.list_checkpoints(tmp_path) == [4]
    assert find_latest_checkpoint(tmp_path) == new
    assert json.loads((new / "state.json").read_text())["state"]["attempt"] == 2
    save(tmp_path, 5, training)
    assert not aside.exists()


def test_a_resave_whose_final_rename_fails_puts_the_old_copy_back(tmp_path, training, monkeypatch):
    """Re-saving a step moves the old checkpoint aside before renaming the new one in: when that rename fails, the
    old one is back under its name at once (the error says earlier checkpoints were left untouched)."""
    path = save(tmp_path, 4, training, state={"step": 4, "attempt": 1})
    real_rename = ckpt.os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "I/O error")
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    with pytest.raises(CheckpointError, match="left untouched"):
        save(tmp_path, 4, training, state={"step": 4, "attempt": 2})
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000004"]
    assert json.loads((path / "state.json").read_text())["state"] == {"step": 4, "attempt": 1}
    verify_checkpoint(path)


@pytest.mark.parametrize("step", [-1, True, 2.0, "3"])
def test_a_step_that_is_not_a_non_negative_int_is_refused_before_writing(tmp_path, training, step):
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save(tmp_path, step, training, state={})
    assert not (tmp_path / "checkpoints").exists()

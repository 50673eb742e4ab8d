"""The run folder (`gspo.runfolder`): what counts as a started run, what --overwrite deletes, atomic writes and
published folders."""

from __future__ import annotations

import pytest

from conftest import DEMO, tiny_overrides
from gspo.config import load_config
from gspo.runfolder import CHECKPOINTS_DIRNAME, clear_run, publish_dir, run_started, write_atomic


def test_a_run_has_started_once_it_holds_what_a_run_computed(tmp_path):
    """A folder holding only files that do not count (a config.yaml, an empty metrics.jsonl or an empty checkpoints
    folder left by a start that failed) is not a started run, so the corrected command runs without --overwrite;
    metrics, a checkpoint, a cold-start model, a summary or a final model make it one."""
    out = tmp_path / "run"
    assert not run_started(out)  # not even there
    out.mkdir()
    (out / "config.yaml").write_text("trainer: {}\n")
    (out / "metrics.jsonl").write_text("")
    (out / CHECKPOINTS_DIRNAME).mkdir()
    assert not run_started(out)
    for name in ("cold_start", "summary.json", "final"):
        other = tmp_path / name.replace(".", "_")
        other.mkdir()
        if name.endswith(".json"):
            (other / name).write_text("{}")
        else:
            (other / name).mkdir()
        assert run_started(other), name
    (out / CHECKPOINTS_DIRNAME / "step_00000001").mkdir()
    assert run_started(out)
    (out / CHECKPOINTS_DIRNAME / "step_00000001").rmdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_started(out)


def test_clear_run_deletes_what_gspo_wrote_and_its_temporaries_and_nothing_else(tmp_path):
    """--overwrite deletes gspo's own files and its hidden temporaries (`.NAME.tmp`, `.NAME.old` left by a crash),
    and never anything else: the user's files stay, and a link named like a gspo folder is removed as a link, its
    target (the user's) kept whole."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl", ".metrics.jsonl.tmp", ".final.old", "notes.txt", ".hidden", "final.tmp"):
        (out / name).write_text("x")
    (out / ".best.old").mkdir()
    (out / ".best.old" / "model.safetensors").write_text("x")
    theirs = tmp_path / "their_checkpoints"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    (out / CHECKPOINTS_DIRNAME).symlink_to(theirs, target_is_directory=True)
    removed = clear_run(out)
    assert removed == sorted([".best.old", ".final.old", ".metrics.jsonl.tmp", CHECKPOINTS_DIRNAME, "metrics.jsonl"])
    assert sorted(p.name for p in out.iterdir()) == [".hidden", "final.tmp", "notes.txt"]
    assert (theirs / "keep.txt").read_text() == "mine"


def test_clear_run_leaves_nothing_of_a_run_with_tensorboard(tmp_path):
    """Everything a run writes (here with TensorBoard on, whose events would otherwise mix the old run's curves into
    the new one's) is deleted by --overwrite: the folder is left with the user's file only."""
    from gspo.trainer import train

    out = tmp_path / "run"
    train(load_config(DEMO, tiny_overrides(out, "trainer.steps=1", "cold_start=null", "trainer.eval_every=0",
                                           "data.eval_size=1", "log.tensorboard=true")))
    assert (out / "tb").is_dir()
    (out / "notes.txt").write_text("mine")
    clear_run(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_publish_dir_replaces_the_target_and_leaves_no_old_copy(tmp_path):
    """A finished folder appears under its name in one rename; an existing one (the previous final/ or best/) is
    replaced whole, not merged into or refused, and its copy moved aside is deleted afterwards."""
    target = tmp_path / "final"
    for content in ("first", "second"):
        tmp = tmp_path / "final.tmp"
        tmp.mkdir()
        (tmp / "model.txt").write_text(content)
        (tmp / content).write_text("")
        publish_dir(tmp, target)
        assert not tmp.exists()
    assert sorted(p.name for p in target.iterdir()) == ["model.txt", "second"]
    assert (target / "model.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .final.old


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    """write_atomic either replaces the file or leaves it as it was; a write that fails removes its `.NAME.tmp`."""
    path = tmp_path / "summary.json"
    write_atomic(path, "old")
    with pytest.raises(TypeError):
        write_atomic(path, 12345)  # not str or bytes: fails after the temporary file was opened
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_resume_accepts_the_settings_that_do_not_change_the_training_math(tmp_path):
    """What the module promises a resume may change (reward time limits and threads, the reward model's batch and
    device, checkpoint cadence, logging) is accepted and named; a setting of the math next to them is refused."""
    import yaml

    from gspo.config import ConfigError, config_to_dict
    from gspo.runfolder import check_resume_config

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(load_config(DEMO, tiny_overrides(tmp_path)))))
    changes = ["rewards.timeout_s=7", "rewards.workers=3", "rewards.reward_model.batch_size=3",
               "rewards.reward_model.device=cpu", "trainer.keep_checkpoints=7", "trainer.max_bad_steps=7",
               "trainer.checkpoint_every=7", "log.progress=true"]
    new = load_config(DEMO, tiny_overrides(tmp_path, *changes))
    assert sorted(check_resume_config(tmp_path, config_to_dict(new))) == sorted(c.split("=")[0] for c in changes)
    with pytest.raises(ConfigError, match=r"differs in optim\.lr"):
        check_resume_config(tmp_path, config_to_dict(load_config(DEMO, tiny_overrides(tmp_path, *changes,
                                                                                       "optim.lr=0.5"))))

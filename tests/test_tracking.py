"""Tests for gspo.tracking: strict JSONL metrics, resume truncation, TensorBoard, curves, optional trackers."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gspo.config import ConfigError
from gspo.runfolder import RUN_FILES
from gspo.tracking import MetricsLogger, Progress, check_trackers, plot_curves, read_metrics, truncate_metrics


def strict_loads(line: str) -> dict:
    """json.loads that refuses NaN / Infinity tokens, as strict JSON readers do."""

    def reject(token: str) -> None:
        raise ValueError(f"non-JSON token {token}")

    return json.loads(line, parse_constant=reject)


metric_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**53), 2**53))
metric_dicts = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: k != "step"), metric_values, max_size=6
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(metric_dicts, max_size=6))
def test_log_read_round_trip(tmp_path_factory, rows):
    """Property: every line is strict JSON, finite values come back exactly, non-finite ones as null."""
    out = tmp_path_factory.mktemp("run")
    with MetricsLogger(out, tensorboard=False) as logger:
        for step, row in enumerate(rows):
            logger.log(step, row)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [strict_loads(line) for line in lines] == read_metrics(out / "metrics.jsonl")
    expected = [
        {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in row.items()}}
        for step, row in enumerate(rows)
    ]
    assert read_metrics(out / "metrics.jsonl") == expected


def test_tensors_and_numpy_values_are_converted(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(
            1, {"loss": torch.tensor(0.5), "nan": torch.tensor(float("nan")), "np": np.float32(2.0), "flag": True}
        )
        with pytest.raises(ValueError, match="single number"):
            logger.log(2, {"vec": torch.ones(3)})
        with pytest.raises(TypeError, match="must be a number"):
            logger.log(2, {"text": "hi"})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(2, {"step": 1.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5, "nan": None, "np": 2.0, "flag": 1}]
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(3, {})


def test_read_metrics_tolerates_torn_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert read_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    path.write_text('{"step": 1, "a": 1.0}\n\x00\x00\x00\n')  # a crash can leave zero bytes at the end
    assert read_metrics(path) == [{"step": 1, "a": 1.0}]
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    last_logged=st.integers(min_value=0, max_value=30),
    resume_step=st.integers(min_value=0, max_value=30),
    torn=st.booleans(),
)
def test_resume_keeps_each_step_once(tmp_path_factory, last_logged, resume_step, torn):
    """Property: crash after logging steps 0..last_logged (maybe mid-line), resume from a checkpoint at resume_step,
    log again from there: every step appears exactly once and lines <= resume_step are the originals."""
    resume_step = min(resume_step, last_logged)
    out = tmp_path_factory.mktemp("run")
    with MetricsLogger(out, tensorboard=False) as logger:
        for step in range(last_logged + 1):
            logger.log(step, {"loss": float(step), "run": 1})
    if torn:
        with open(out / "metrics.jsonl", "a") as handle:
            handle.write('{"step": 99, "loss": 1.')
    with MetricsLogger(out, tensorboard=False, resume_step=resume_step) as logger:
        assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(resume_step + 1))
        for step in range(resume_step + 1, last_logged + 5):
            logger.log(step, {"loss": float(step), "run": 2})
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(last_logged + 5))
    assert [r["run"] for r in records] == [1] * (resume_step + 1) + [2] * (last_logged + 4 - resume_step)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        strict_loads(line)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_truncate_missing_file_is_fine(tmp_path):
    truncate_metrics(tmp_path / "metrics.jsonl", 3)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_fresh_logger_repairs_torn_tail_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.')
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(2, {"a": 2.0})
    assert [strict_loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "a": 1.0},
        {"step": 2, "a": 2.0},
    ]


def test_tensorboard_event_file_has_finite_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, run_config={"lr": 1e-6, "model": {"name": "tiny"}}) as logger:
        logger.log(1, {"loss": 0.5, "reward": float("nan")})
        logger.log(2, {"loss": 0.25, "reward": 1.0})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in accumulator.Scalars("reward")] == [(2, 1.0)]  # NaN skipped


def test_plot_curves_with_mixed_frequency_keys(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for step in range(1, 31):
            metrics = {"loss": 1.0 / step, "reward": float("nan") if step == 3 else step / 30}
            if step % 10 == 0:
                metrics["heldout_accuracy"] = step / 40
            logger.log(step, metrics)
    png = plot_curves(
        tmp_path / "metrics.jsonl",
        tmp_path / "plots" / "curves.png",
        keys=["loss", "reward", "heldout_accuracy", "never_logged"],
        title="tiny run",
    )
    assert png == tmp_path / "plots" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    with pytest.raises(ValueError, match="none of the keys"):
        plot_curves(tmp_path / "metrics.jsonl", tmp_path / "x.png", keys=["never_logged"])


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_tracker_is_a_clear_error(tmp_path, tracker):
    if importlib.util.find_spec(tracker) is not None:
        pytest.skip(f"{tracker} is installed")
    with pytest.raises(ImportError, match=rf"pip install 'gspo\[{tracker}\]'"):
        MetricsLogger(tmp_path, **{tracker: {}})
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before touching the run folder


class _Recorder:
    """Records calls made to a fake tracker module."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or self


def test_wandb_and_mlflow_receive_finite_metrics(tmp_path, monkeypatch):
    """With fake modules standing in for the real packages: settings, config and finite values are passed on."""
    fake_wandb, fake_mlflow = _Recorder(), _Recorder()
    for name, recorder in (("wandb", fake_wandb), ("mlflow", fake_mlflow)):
        module = types.ModuleType(name)
        module.__getattr__ = recorder.__getattr__  # module-level __getattr__ (PEP 562)
        module.__spec__ = importlib.util.spec_from_loader(name, loader=None)
        monkeypatch.setitem(sys.modules, name, module)
    config = {"lr": 1e-6, "model": {"name": "tiny"}}
    with MetricsLogger(
        tmp_path,
        tensorboard=False,
        wandb={"project": "p"},
        mlflow={"experiment_name": "e", "run_name": "r"},
        run_config=config,
    ) as logger:
        logger.log(5, {"loss": 0.5, "bad": float("inf")})
    wandb_calls = [(name, args, kwargs) for name, args, kwargs in fake_wandb.calls]
    assert wandb_calls == [
        ("init", (), {"project": "p", "config": config}),
        ("log", ({"loss": 0.5},), {"step": 5}),
        ("finish", (), {}),
    ]
    assert fake_mlflow.calls == [
        ("set_experiment", ("e",), {}),
        ("start_run", (), {"run_name": "r"}),
        ("log_params", ({"lr": "1e-06", "model.name": "tiny"},), {}),
        ("active_run", (), {}),  # its id, kept in trackers.json for a resume
        ("log_metrics", ({"loss": 0.5},), {"step": 5}),
        ("end_run", (), {}),
    ]


class _Tracker(types.ModuleType):
    """A stand-in for wandb / mlflow that records the settings each run starts with and gives runs ids."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.util.spec_from_loader(name, loader=None)
        self.started: list[dict] = []
        self._active: Any = None

    def _start(self, kwargs: dict) -> Any:
        self.started.append(kwargs)
        run_id = kwargs.get("id") or kwargs.get("run_id") or f"run{len(self.started)}"
        self._active = types.SimpleNamespace(id=run_id, info=types.SimpleNamespace(run_id=run_id),
                                             log=lambda *a, **k: None, finish=lambda: None)
        return self._active

    def init(self, **kwargs: Any) -> Any:  # wandb.init
        return self._start(kwargs)

    def start_run(self, **kwargs: Any) -> Any:  # mlflow.start_run
        return self._start(kwargs)

    def active_run(self) -> Any:
        return self._active

    def __getattr__(self, name: str):  # log_params, log_metrics, end_run, set_experiment, ...
        return lambda *args, **kwargs: None


def test_a_resume_continues_the_wandb_and_mlflow_runs_of_the_folder(tmp_path, monkeypatch):
    """The first start records the runs' ids in trackers.json; a resume passes them back (W&B: id + resume="allow";
    MLflow: run_id, its name kept), unless the settings name a run; a fresh start (or --overwrite, which deletes the
    file) starts new runs. Checked by hand against wandb 0.2x offline and mlflow's file store: one W&B run id and one
    MLflow run, whose loss history has both the first and the resumed steps."""
    wandb, mlflow = _Tracker("wandb"), _Tracker("mlflow")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    trackers = {"wandb": {"project": "p"}, "mlflow": {"experiment_name": "e", "run_name": "r"}}
    with MetricsLogger(tmp_path, tensorboard=False, **trackers) as logger:
        logger.log(1, {"loss": 1.0})
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": "run1", "mlflow": "run1"}
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=1, **trackers) as logger:
        logger.log(2, {"loss": 1.0})
    assert wandb.started[1] == {"project": "p", "id": "run1", "resume": "allow"}
    assert mlflow.started[1] == {"run_id": "run1"}
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2, wandb={"project": "p", "id": "mine"}):
        pass
    assert wandb.started[2] == {"project": "p", "id": "mine"}  # the user's run wins
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == "mine"
    with MetricsLogger(tmp_path, tensorboard=False, **trackers):  # a fresh run: new runs
        pass
    assert "id" not in wandb.started[3] and "run_id" not in mlflow.started[2]
    assert "trackers.json" in RUN_FILES


def _keyword_tracker(name: str, start: str, keywords: str) -> types.ModuleType:
    """A stand-in module whose `start` function takes only `keywords` (comma-separated), like wandb.init and
    mlflow.start_run: an unknown keyword is a TypeError when the run starts."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    exec(f"def {start}(*, {keywords}=None): pass", module.__dict__)
    return module


def test_tracker_settings_their_start_function_does_not_take_are_refused_before_any_compute(monkeypatch):
    """A typo in log.wandb / log.mlflow was a raw TypeError from wandb.init after the cold start."""
    monkeypatch.setitem(sys.modules, "wandb", _keyword_tracker("wandb", "init", "project, entity, name, mode"))
    monkeypatch.setitem(sys.modules, "mlflow", _keyword_tracker("mlflow", "start_run", "run_id, run_name, tags"))
    check_trackers(wandb={"project": "p", "mode": "offline"},
                   mlflow={"tracking_uri": "file:x", "experiment_name": "e", "run_name": "r"})
    with pytest.raises(ConfigError, match=r"log\.wandb\.projcet: unknown .*wandb\.init \(did you mean 'project'"):
        check_trackers(wandb={"projcet": "p"})
    with pytest.raises(ConfigError, match=r"log\.mlflow\.run_nmae: unknown setting.*mlflow\.start_run.*'run_name'"):
        check_trackers(mlflow={"experiment_name": "e", "run_nmae": "r"})
    monkeypatch.setitem(sys.modules, "wandb", _Tracker("wandb"))  # an init taking **kwargs takes anything
    check_trackers(wandb={"anything": 1})


def test_progress_is_tiny_and_quiet_when_disabled(capsys):
    with Progress(10, keys=["loss"], disable=True) as bar:
        assert bar.disabled
        bar.update(3, {"loss": torch.tensor(0.5), "other": 1.0})
    assert capsys.readouterr().err == ""


def test_progress_shows_step_and_chosen_metrics():
    stream = io.StringIO()
    with Progress(10, keys=["loss", "reward"], disable=False, file=stream) as bar:
        bar.update(4, {"loss": 0.123456, "reward": float("nan"), "ignored": 3.0})
    text = stream.getvalue()
    assert "4/10" in text and "loss=0.1235" in text and "reward=nan" in text and "ignored" not in text


def test_progress_is_off_when_not_a_terminal():
    stream = io.StringIO()
    with Progress(10, file=stream) as bar:
        assert bar.disabled
        bar.update(1, {"loss": 1.0})
    assert stream.getvalue() == ""


def test_metrics_logger_accepts_path_objects(tmp_path):
    with MetricsLogger(Path(tmp_path) / "nested" / "run", tensorboard=False) as logger:
        logger.log(0, {})
    assert read_metrics(tmp_path / "nested" / "run" / "metrics.jsonl") == [{"step": 0}]


def test_rollouts_are_dropped_after_the_resumed_or_rewound_step_like_metrics(tmp_path):
    """rollouts.jsonl follows metrics.jsonl: a resume from step k and a guard's rewind to step k keep the lines of
    steps <= k; records are strict JSON; the table reaches TensorBoard's text tab (markdown, pipes escaped)."""
    def log_steps(logger: MetricsLogger, steps: range, run: int) -> None:
        for step in steps:
            logger.log(step, {"loss": 1.0})
            logger.log_rollouts(step, [{"group": 0, "prompt": "1+1=", "completion": f"2|{run}\n", "reward": 1.0,
                                        "advantage": 0.5, "truncated": False}] * 2)

    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        log_steps(logger, range(1, 6), run=1)
        logger.rewind(3)
        assert [r["step"] for r in read_metrics(tmp_path / "rollouts.jsonl")] == [1, 1, 2, 2, 3, 3]
        log_steps(logger, range(4, 7), run=2)
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=4) as logger:
        log_steps(logger, range(5, 8), run=3)
    records = read_metrics(tmp_path / "rollouts.jsonl")
    assert [r["step"] for r in records] == [s for s in range(1, 8) for _ in range(2)]
    assert [r["completion"][2] for r in records] == list("11111122333333")
    for line in (tmp_path / "rollouts.jsonl").read_text().splitlines():
        strict_loads(line)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    texts = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("rollouts/text_summary")]
    assert "| group | prompt | completion | reward | solved | advantage | truncated |" in texts[0]
    assert "2\\|1⏎" in texts[0]


def test_an_unreadable_trackers_file_starts_new_runs_with_a_warning(tmp_path, monkeypatch, caplog):
    wandb = _Tracker("wandb")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    (tmp_path / "trackers.json").write_text("{not json")
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=0, wandb={"project": "p"}):
        pass
    assert wandb.started == [{"project": "p"}]
    assert any("trackers.json is unreadable" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": "run1"}  # rewritten with the new run


def test_a_resume_says_when_metrics_of_the_checkpoints_steps_are_missing(tmp_path, caplog):
    """metrics.jsonl deleted or cut before a resume: the run cannot log those steps again (they are before its
    checkpoint), so it says which are missing instead of leaving a silent gap in the file and the curves."""
    def run(resume_step: int | None, steps: range) -> None:
        with MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step) as logger:
            for step in steps:
                logger.log(step, {"loss": float(step)})

    run(None, range(1, 7))
    with caplog.at_level(logging.WARNING, logger="gspo.tracking"):
        run(4, range(5, 7))  # intact: nothing to say
        assert not caplog.records
        (tmp_path / "metrics.jsonl").unlink()
        run(4, range(5, 7))
        assert "lacks the records of 4 of the 4 steps before this resume (steps 1 to 4 at least: the file was " \
               "deleted)" in caplog.text
        caplog.clear()
        path = tmp_path / "metrics.jsonl"
        path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n')
        run(4, range(5, 7))
        assert "lacks the records of 2 of the 4 steps before this resume (steps 3 to 4 at least: the file was " \
               "edited or cut)" in caplog.text


def test_a_boolean_metric_is_written_as_the_number_it_counts(tmp_path):
    """A flag (e.g. truncated) is logged as 0 / 1, a JSON number: `true` in metrics.jsonl is not a number to a strict
    reader (pandas reads the column as objects, curves cannot plot it), though Python's True == 1 hides it."""
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"flag": True, "off": np.bool_(False), "n": 3})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    assert json.loads(line) == {"step": 1, "flag": 1, "off": 0, "n": 3}
    assert "true" not in line and "false" not in line
    assert all(type(v) is int for v in json.loads(line).values())


def test_a_resume_keeps_the_checkpoints_own_step_in_tensorboard(tmp_path):
    """A resume from the checkpoint of step 2 hides TensorBoard's events of the steps after it (logged again), not
    those of step 2 itself: each step is shown once, with the value the run kept in metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, resume_step=2) as logger:
        for step in range(3, 5):
            logger.log(step, {"loss": 10.0 * step})
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_a_resume_keeps_the_users_wandb_resume_mode_and_logs_no_mlflow_params_again(tmp_path, monkeypatch):
    """Continuing the folder's W&B run passes the user's own `resume` mode (e.g. "must") on, "allow" only when none is
    set; the continued MLflow run gets no params again: MLflow refuses a param logged twice with another value, and
    a resume may change some settings (trainer.steps)."""
    wandb, mlflow = _Tracker("wandb"), _Recorder()
    module = types.ModuleType("mlflow")
    module.__getattr__ = mlflow.__getattr__
    module.__spec__ = importlib.util.spec_from_loader("mlflow", loader=None)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", module)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"}, mlflow={},
                       run_config={"trainer": {"steps": 2}}) as logger:
        logger.log(1, {"loss": 1.0})
    assert [name for name, *_ in mlflow.calls].count("log_params") == 1
    mlflow.calls.clear()
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=1, wandb={"project": "p", "resume": "must"},
                       mlflow={}, run_config={"trainer": {"steps": 4}}) as logger:
        logger.log(2, {"loss": 1.0})
    assert wandb.started[1] == {"project": "p", "config": {"trainer": {"steps": 4}}, "id": "run1", "resume": "must"}
    assert "log_params" not in [name for name, *_ in mlflow.calls]


def test_progress_without_a_terminal_logs_every_n_steps_and_the_last_one(caplog, monkeypatch):
    """Redirected output: one INFO line every `every` steps and one at the last step, even off the cadence (a log
    that stops at 6/7 reads as a run that died before its end); the time left counts the steps still to run from
    the current step (a resumed run's speed is measured from its first step, not from 0)."""
    import gspo.tracking as tracking

    now = [100.0]  # 10 s a step
    monkeypatch.setattr(tracking, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    with caplog.at_level(logging.INFO, logger="gspo.tracking"), Progress(8, initial=2, every=3,
                                                                         file=io.StringIO()) as bar:
        assert bar.disabled
        for step in range(3, 9):
            now[0] = 100.0 + 10.0 * (step - 2)
            bar.update(step, {})
    lines = [r.getMessage() for r in caplog.records if r.name == "gspo.tracking"]
    assert [line.split(" · ")[0] for line in lines] == ["train 3/8 (38%)", "train 6/8 (75%)", "train 8/8 (100%)"]
    # step 3: 1 step in 10 s, 5 steps left; step 6: 4 steps in 40 s, 2 left
    assert lines[0].split(" · ")[1:] == ["10 s/step", "0m50s left"]
    assert lines[1].split(" · ")[1:] == ["10 s/step", "0m20s left"]


def test_a_progress_turned_off_logs_no_lines_either(caplog):
    """`disable=True` (log.progress: false) turns progress off: neither a bar nor the log lines that replace the bar
    when the output is not a terminal."""
    with caplog.at_level(logging.INFO, logger="gspo.tracking"), Progress(4, disable=True, every=1,
                                                                         file=io.StringIO()) as bar:
        for step in range(1, 5):
            bar.update(step, {"loss": 1.0})
    assert not [r for r in caplog.records if r.name == "gspo.tracking"]

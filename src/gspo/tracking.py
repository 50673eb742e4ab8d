"""Metrics sinks (JSONL, TensorBoard, optionally Weights & Biases / MLflow), training curves and a progress bar.

``OUT/metrics.jsonl`` is the run's source of truth: one strict-JSON object per logged step, flushed and fsynced as it
is written so that a crash loses at most the line being written. Non-finite values are stored as ``null`` (a ``NaN``
token is not JSON and breaks other readers). When a run resumes from the checkpoint of step k, lines of steps after k
(logged after that checkpoint, before the crash) are removed, so that every step appears exactly once.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from gspo.config import ConfigError, did_you_mean
from gspo.runfolder import write_atomic

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
ROLLOUTS_FILENAME = "rollouts.jsonl"
TRACKERS_FILENAME = "trackers.json"  # the W&B / MLflow run ids of the folder's run: a resume continues those runs
TENSORBOARD_DIRNAME = "tb"

Number = int | float


class MetricsLogger:
    """Writes each step's metrics to ``OUT/metrics.jsonl`` and to the enabled trackers.

    `wandb` / `mlflow`: None to leave them off, or a dict of settings to turn them on (asking for one that is not
    installed raises ImportError at once, not after the first training step):

    * wandb: keyword arguments of ``wandb.init`` (``project``, ``name``, ``id``, ``resume``, ...); `run_config` is
      passed as ``config`` unless the dict has one.
    * mlflow: ``tracking_uri`` and ``experiment_name`` (optional), the rest goes to ``mlflow.start_run`` (``run_id``,
      ``run_name``, ``tags``, ...); `run_config` is logged as flattened params on a fresh run.

    `resume_step`: the step of the checkpoint the run resumes from; lines of later steps are dropped from
    metrics.jsonl, rollouts.jsonl (`log_rollouts`) and TensorBoard's view, and the W&B / MLflow runs the folder's run
    started (their ids are kept in OUT/trackers.json) are continued rather than new ones started, unless the settings
    name a run (wandb ``id``, mlflow ``run_id``). W&B ignores steps below the last one it was sent, so after a crash
    the resumed steps it already has keep their first values (the same, since a resume recomputes them exactly).
    None starts a fresh run: existing lines are kept and appended to.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: dict[str, Any] | None = None,
        mlflow: dict[str, Any] | None = None,
        resume_step: int | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        wandb_module = _import_tracker("wandb") if wandb is not None else None
        mlflow_module = _import_tracker("mlflow") if mlflow is not None else None
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / METRICS_FILENAME
        self.rollouts_path = self.out_dir / ROLLOUTS_FILENAME
        if resume_step is None:
            for path in (self.metrics_path, self.rollouts_path):
                _drop_torn_tail(path)
        else:
            steps = truncate_metrics(self.metrics_path, resume_step)
            truncate_metrics(self.rollouts_path, resume_step)
        if resume_step:  # the checkpoint's steps should all be in metrics.jsonl: say when they are not
            lost = sorted(set(range(1, resume_step + 1)) - steps)
            if lost:
                logger.warning("%s lacks the records of %d of the %d steps before this resume (steps %d to %d at "
                               "least: the file was %s); the run goes on from step %d, and those steps stay missing "
                               "from it and from curves.png", self.metrics_path, len(lost), resume_step, lost[0],
                               lost[-1], "deleted" if not steps else "edited or cut", resume_step + 1)
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._closed = False
        self._tb: Any = None
        self._wandb_run: Any = None
        self._mlflow: Any = None
        ids = _read_tracker_ids(self.out_dir / TRACKERS_FILENAME) if resume_step is not None else {}
        try:
            if tensorboard:
                self._start_tensorboard(resume_step, run_config)
            if wandb_module is not None:
                kwargs = dict(wandb)
                if run_config is not None:
                    kwargs.setdefault("config", run_config)
                if ids.get("wandb") and "id" not in kwargs:  # continue the run this folder's run started
                    kwargs.update(id=ids["wandb"], resume=kwargs.get("resume") or "allow")
                self._wandb_run = wandb_module.init(**kwargs)
                run_id = getattr(self._wandb_run, "id", None)
                ids["wandb"] = run_id if isinstance(run_id, str) else None
            if mlflow_module is not None:
                settings = dict(mlflow)
                if ids.get("mlflow") and "run_id" not in settings:
                    settings["run_id"] = ids["mlflow"]
                    settings.pop("run_name", None)  # the continued run keeps its name
                self._start_mlflow(mlflow_module, settings, resume_step, run_config)
                ids["mlflow"] = _active_mlflow_run_id(mlflow_module)
            if wandb_module is not None or mlflow_module is not None:
                write_atomic(self.out_dir / TRACKERS_FILENAME, json.dumps(ids, indent=2))
        except BaseException:
            self.close()  # do not leak the file, writer or runs already opened
            raise

    def _start_tensorboard(self, resume_step: int | None, run_config: dict[str, Any] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1  # hide events of steps after the checkpoint
        self._tb = SummaryWriter(log_dir=str(self.out_dir / TENSORBOARD_DIRNAME), purge_step=purge)
        if run_config is not None and resume_step is None:
            self._tb.add_text("run_config", f"```\n{json.dumps(run_config, indent=2, default=str)}\n```")
        self._tb.flush()

    def _start_mlflow(
        self, mlflow: Any, settings: dict[str, Any], resume_step: int | None, run_config: dict[str, Any] | None
    ) -> None:
        if (uri := settings.pop("tracking_uri", None)) is not None:
            mlflow.set_tracking_uri(uri)
        if (experiment := settings.pop("experiment_name", None)) is not None:
            mlflow.set_experiment(experiment)
        mlflow.start_run(**settings)
        self._mlflow = mlflow
        if run_config is not None and resume_step is None:
            mlflow.log_params(_flatten(run_config))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (numbers, or one-element tensors) of `step`: one JSON line, plus each enabled tracker."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename that metric")
        values = {str(key): _to_number(key, value) for key, value in metrics.items()}
        self._file.write(json.dumps({"step": step, **values}, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._to_trackers(step, values)

    def log_trackers(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` of `step` in the enabled trackers only, not in metrics.jsonl (one line per RL step): the
        held-out evaluation before RL (step 0, in eval.jsonl), the start of the trackers' accuracy curves."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_trackers called after close()")
        self._to_trackers(step, {str(key): _to_number(key, value) for key, value in metrics.items()})

    def _to_trackers(self, step: int, values: Mapping[str, Number | None]) -> None:
        finite = {key: value for key, value in values.items() if value is not None}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(finite, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({key: float(value) for key, value in finite.items()}, step=step)

    def rewind(self, step: int) -> None:
        """Forget what was logged after `step` (the collapse guard rolled the run back to its checkpoint): metrics.jsonl
        and rollouts.jsonl keep the lines of steps <= `step` and TensorBoard hides later events. W&B and MLflow cannot
        forget: they keep the discarded steps, and the steps logged again after the rollback follow them."""
        self._file.close()
        truncate_metrics(self.metrics_path, step)
        truncate_metrics(self.rollouts_path, step)
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if self._tb is not None:
            self._tb.close()
            self._start_tensorboard(step, None)

    def log_rollouts(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Training completions of `step` (`rollout_records`): one strict-JSON line each in rollouts.jsonl (flushed
        and fsynced, dropped on resume like metrics.jsonl's later lines), and a table in TensorBoard's text tab."""
        if not records:
            return
        with open(self.rollouts_path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.log_text(step, "rollouts", format_rollouts(step, records))

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text record (e.g. sample completions) for the trackers that show text: TensorBoard, W&B."""
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({tag: text}, step=step)

    def close(self) -> None:
        """Flush and close every sink; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _read_tracker_ids(path: Path) -> dict[str, str | None]:
    """The tracker run ids a run folder's run recorded ({} when it recorded none, or the file is unreadable: then new
    runs are started, with a warning)."""
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s): the W&B / MLflow runs start afresh", path, exc)
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def _active_mlflow_run_id(mlflow: Any) -> str | None:
    """The id of MLflow's active run, None when it cannot be read."""
    run = mlflow.active_run() if callable(getattr(mlflow, "active_run", None)) else None
    run_id = getattr(getattr(run, "info", None), "run_id", None)
    return run_id if isinstance(run_id, str) else None


def markdown_table(title: str, records: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """`records` as a Markdown table of `columns` under `title` (TensorBoard's text tab renders it): numbers to 3
    significant digits, newlines as ⏎, pipes escaped."""
    def cell(value: Any) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "⏎")

    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(record.get(c, "")) for c in columns) + " |" for record in records]
    return "\n".join(lines)


def format_rollouts(step: int, records: Sequence[Mapping[str, Any]]) -> str:
    """A step's logged training completions (`MetricsLogger.log_rollouts`) as a Markdown table."""
    return markdown_table(f"training completions of step {step}", records,
                          ("group", "prompt", "completion", "reward", "solved", "advantage", "truncated"))


# mlflow settings that MetricsLogger uses itself (`_start_mlflow`); the others are mlflow.start_run's keywords
_MLFLOW_SETUP_KEYS = ("tracking_uri", "experiment_name")


def check_trackers(*, wandb: Any = None, mlflow: Any = None) -> None:
    """Called before any compute, so that what the trackers would refuse is not found after the model was built and
    trained: raise ImportError (naming the pip extra) for a tracker that is asked for (not None) and not installed,
    and ConfigError naming each setting that its start function (wandb.init, mlflow.start_run) does not take."""
    for name, settings, start in (("wandb", wandb, "init"), ("mlflow", mlflow, "start_run")):
        if settings is None:
            continue
        module = _import_tracker(name)
        keys = [k for k in settings if not (name == "mlflow" and k in _MLFLOW_SETUP_KEYS)]
        try:
            params = inspect.signature(getattr(module, start)).parameters
        except (TypeError, ValueError):  # no signature to read: the call itself will say
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        takes = [p for p, v in params.items() if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
        takes += list(_MLFLOW_SETUP_KEYS) if name == "mlflow" else []
        for key in keys:
            if key not in takes:
                raise ConfigError(f"log.{name}.{key}: unknown setting; log.{name} holds keyword arguments of "
                                  f"{name}.{start}{did_you_mean(key, takes)}")


def _import_tracker(name: str) -> Any:
    """Import an optional tracker, or say which pip extra provides it."""
    if importlib.util.find_spec(name) is None:
        raise ImportError(
            f"MetricsLogger({name}=...) needs the '{name}' package, which is not installed; "
            f"install it with: pip install 'gspo[{name}]'",
            name=name,
        )
    return importlib.import_module(name)


def _to_number(key: str, value: Any) -> Number | None:
    """A JSON-able number for `value`: tensors and numpy scalars via .item(), non-finite as None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a single number")
        value = value.item()
    elif hasattr(value, "item") and callable(value.item):  # numpy scalars and 0-d arrays
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None:
        return None
    raise TypeError(f"metric {key!r} must be a number or a one-element tensor, got {type(value).__name__}")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b": "value"} as MLflow params (flat strings)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = str(value)
    return flat


# ------------------------------------------------------------------------------------------------ reading, truncating


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(raw line, record) for each line of the JSONL file at `path`; a torn or unreadable last line is dropped."""
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").split("\n") if line.strip()]
    parsed = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as exc:
            if number == len(lines):
                logger.warning("dropping the torn last line of %s (a crash while writing it): %r", path, line[:80])
                break
            raise ValueError(f"{path}, line {number}, is not a metrics record: {exc}") from exc
        parsed.append((line, record))
    return parsed


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in file order; a torn last line (crash mid-write) is dropped."""
    return [record for _, record in _parse_lines(Path(path))]


def truncate_metrics(path: str | os.PathLike, last_step: int) -> set[int]:
    """Atomically rewrite the metrics file at `path` keeping only the records of steps <= `last_step`; returns the
    steps kept.

    Called when resuming from the checkpoint of `last_step`: what was logged after that checkpoint is logged again.
    A missing file is fine (nothing to keep).
    """
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # pid-suffixed, left by a crash in an earlier version
        stale.unlink(missing_ok=True)
    if not path.exists():
        return set()
    kept = [(line, record["step"]) for line, record in _parse_lines(path) if record["step"] <= last_step]
    write_atomic(path, "".join(line + "\n" for line, _ in kept))  # a crash leaves at most .NAME.tmp (replaced)
    return {step for _, step in kept}


def _drop_torn_tail(path: Path) -> None:
    """Cut an unterminated last line so that the next appended line starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        logger.warning("dropping the torn last line of %s (a crash while writing it)", path)
        with open(path, "r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)
            os.fsync(handle.fileno())


# ----------------------------------------------------------------------------------------------------------- curves


def plot_curves(
    metrics_path: str | os.PathLike,
    out_png: str | os.PathLike,
    *,
    keys: Sequence[str],
    title: str = "",
    extra: Sequence[Mapping[str, Any]] = (),
    overlay: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Plot each of `keys` against step from a metrics.jsonl file into one PNG (one subplot per key) and return it.
    `extra` records (e.g. held-out evaluations, including step 0 before training) are plotted with them; `overlay`
    draws further keys on a key's subplot, with a legend (e.g. each group's held-out accuracy on the overall one's).

    Keys logged only on some steps (held-out accuracy every N steps) are drawn as their points joined by lines;
    keys with no value in any record are left out. Renders with the Agg backend: no display, no global pyplot state.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [*read_metrics(metrics_path), *extra]

    def points(key: str) -> tuple[list[int], list[float]] | None:
        pairs = sorted((r["step"], r[key]) for r in records if r.get(key) is not None)
        return ([step for step, _ in pairs], [value for _, value in pairs]) if pairs else None

    series: dict[str, tuple[list[int], list[float]]] = {}
    for key in keys:
        if (found := points(key)) is not None:
            series[key] = found
        else:
            logger.info("plot_curves: %r has no values in %s; leaving it out", key, metrics_path)
    if not series:
        raise ValueError(f"none of the keys {list(keys)} has a value in {metrics_path}")

    figure = Figure(figsize=(8, 2.4 * len(series) + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, (steps, values)) in zip(axes, series.items(), strict=True):
        sparse = len(steps) <= 50
        ax.plot(steps, values, marker="o" if sparse else None, markersize=3, linewidth=1.2, label="all")
        drawn = [(name, found) for name in (overlay or {}).get(key, ()) if (found := points(name)) is not None]
        for name, (xs, ys) in drawn:
            ax.plot(xs, ys, marker="o" if sparse else None, markersize=2, linewidth=0.9, alpha=0.8,
                    label=name.removeprefix(f"{key}/"))
        if drawn:
            ax.legend(fontsize="small", ncols=min(4, len(drawn) + 1))
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        figure.suptitle(title)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, format="png", dpi=110)
    return out_png


# --------------------------------------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar at `step`/`total` with a few chosen metrics (`keys`) as postfix.

    `disable`: True turns it off, False forces it on, None (default) turns it off when its stream (`file`, stderr by
    default) is not a terminal, so that redirected logs are not filled with bar redraws; then a one-line summary
    (steps, s/step, time left, the `keys`) is logged (INFO) every `every` steps and at the last step instead
    (None: about 20 lines per run), so a log file or a job scheduler still shows progress.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        keys: Sequence[str] = (),
        desc: str = "train",
        disable: bool | None = None,
        file: TextIO | None = None,
        every: int | None = None,
    ) -> None:
        self.keys = tuple(keys)
        self._bar = tqdm(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, disable=disable, file=file
        )
        self.total, self.desc = total, desc
        # the bar turned itself off (no terminal): log lines instead
        self.every = (every or max(1, total // 20)) if disable is None and self._bar.disable else None
        self._start = (time.perf_counter(), initial)

    @property
    def disabled(self) -> bool:
        return bool(self._bar.disable)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move the bar to `step` (steps done so far) and show the chosen `keys` of `metrics`."""
        if self.every is not None and (step % self.every == 0 or step == self.total):
            logger.info("%s", self.line(step, metrics or {}))
        if self.disabled:
            return
        if metrics:
            shown = {key: metrics[key] for key in self.keys if key in metrics}
            postfix = {key: _short(value) for key, value in shown.items()}
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(step - self._bar.n)

    def line(self, step: int, metrics: Mapping[str, Any]) -> str:
        """`train 40/400 (10%) · 0.31 s/step · 1m52s left · reward_mean 0.53 · ...`: the bar as one log line."""
        t0, first = self._start
        done = step - first
        per_step = (time.perf_counter() - t0) / done if done > 0 else math.nan
        left = per_step * (self.total - step)
        parts = [f"{self.desc} {step}/{self.total} ({step / self.total:.0%})", f"{per_step:.3g} s/step",
                 f"{int(left // 60)}m{int(left % 60):02d}s left" if math.isfinite(left) else "? left"]
        parts += [f"{key} {_short(metrics[key])}" for key in self.keys if key in metrics]
        return " · ".join(parts)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _short(value: Any) -> str:
    """A compact postfix string: 4 significant digits for numbers, as-is for anything else."""
    try:
        number = _to_number("", value)
    except (TypeError, ValueError):
        return str(value)
    return "nan" if number is None else f"{number:.4g}"

"""Crash safety of a real training process: `python -m gspo train` is SIGKILLed five times at random moments —
before its first checkpoint, in the middle of steps, and in the middle of a checkpoint write — and resumed with
`--resume` after each kill. The finished run must equal an uninterrupted run of the same config bit for bit (every
tensor of final/), with every step exactly once in metrics.jsonl and the same eval.jsonl.

The kill moments are drawn from a seeded RNG whose seed is printed (pytest shows it on failure); set GSPO_CRASH_SEED
to replay one. For the mid-write kill the process is started through `PAUSING_BOOTSTRAP`, which wraps
gspo.checkpoint's file writes (the model folder and each torch.save'd file) so that every save pauses after each of
them, then runs the same `gspo train` command; the test kills the moment the temporary `.tmp-step_*` folder appears.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import DEMO, safetensors_of, tiny_overrides
from gspo.checkpoint import find_latest_checkpoint
from gspo.config import load_config
from gspo.tracking import read_metrics
from gspo.trainer import train

TESTS_DIR = Path(__file__).parent
STEPS = 8
# Checkpoint and evaluate after every step (so that a kill during a checkpoint write always leaves an evaluation
# newer than the last checkpoint, which the resume must drop); a reward that varies within groups (an importable
# path, so that the subprocess finds it too), so that every update really changes the weights; one thread in both
# processes, so that they compute alike; on the CPU even on a GPU machine, since the resumed run must equal the
# uninterrupted one bit for bit and CUDA training is not bitwise reproducible from run to run (see conftest.DEVICE).
EXTRA = [f"trainer.steps={STEPS}", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", "trainer.eval_every=1",
         "trainer.threads=1", "rewards.functions={addition: 1.0, conftest.varied_reward: 0.5}", "trainer.device=cpu"]
TIMING_KEYS = ("time_rollout", "time_update", "time_eval", "tokens_per_second")
PAUSE_S = 0.5  # per file of a checkpoint save, in the processes started with pause_checkpoints=True

# `python -c PAUSING_BOOTSTRAP SECONDS ARGS...` is `python -m gspo ARGS...` whose checkpoint saves sleep SECONDS after
# each file they write into the temporary folder: after the model folder, optimizer.pt, scheduler.pt and rng.pt. The
# wrappers are set on gspo.checkpoint's module (its `_save_model`, and its `torch` name: a stand-in whose `save`
# pauses), so nothing else in the process is slowed; the training code itself is unchanged.
PAUSING_BOOTSTRAP = """
import sys, time
import torch
import gspo.checkpoint as checkpoint
from gspo.cli import main

pause_s = float(sys.argv[1])


def pausing(write):
    def wrapper(*args, **kwargs):
        result = write(*args, **kwargs)
        time.sleep(pause_s)
        return result
    return wrapper


class PausingTorch:
    save = staticmethod(pausing(torch.save))

    def __getattr__(self, name):
        return getattr(torch, name)


checkpoint._save_model = pausing(checkpoint._save_model)
checkpoint.torch = PausingTorch()
raise SystemExit(main(sys.argv[2:]))
"""


def metric_lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(read_metrics(path)) if path.exists() else 0


def latest_step(out: Path) -> int:
    latest = find_latest_checkpoint(out)
    return 0 if latest is None else int(latest.name.removeprefix("step_"))


class Run:
    """One `python -m gspo train` process on the run folder, in its own session, output to files."""

    def __init__(self, out: Path, logs: Path, resume: bool, pause_checkpoints: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
        self.log = logs / f"run{len(list(logs.iterdir()))}.log"
        launcher = ["-c", PAUSING_BOOTSTRAP, str(PAUSE_S)] if pause_checkpoints else ["-m", "gspo"]
        command = [sys.executable, *launcher, "train", str(DEMO), *tiny_overrides(out, *EXTRA)]
        with open(self.log, "wb") as handle:
            self.proc = subprocess.Popen([*command, *(["--resume"] if resume else [])], stdout=handle, stderr=handle,
                                         env=env, start_new_session=True)

    def wait_for(self, condition, what: str, timeout: float = 90.0) -> None:
        """Poll `condition()` every few ms; fail if the process ends (or time runs out) first."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"the training process ended (exit {self.proc.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.005)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL, f"exit {self.proc.returncode} instead of SIGKILL"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process (same code, same single thread: same numbers as a subprocess)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    train(load_config(DEMO, tiny_overrides(out, *EXTRA)))
    return out


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
    seed = int(os.environ.get("GSPO_CRASH_SEED", random.SystemRandom().randrange(2**32)))
    print(f"crash test seed: GSPO_CRASH_SEED={seed}")
    rng = random.Random(seed)
    out, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    kills: list[str] = []

    # 1. before the first checkpoint: during model building / cold-start SFT / the step-0 evaluation / step 1 (the
    # pausing save keeps the first checkpoint unpublished for over a second, whatever the machine's speed)
    run = Run(out, logs, resume=False, pause_checkpoints=True)
    run.wait_for(lambda: (out / "config.yaml").exists(), "the run folder was created")
    time.sleep(rng.uniform(0.0, 0.3))
    run.kill()
    assert find_latest_checkpoint(out) is None, "the first kill came too late: a checkpoint exists already"
    kills.append("before the first checkpoint")

    # 2. a resume with no checkpoint starts over; killed in the middle of a step after a few steps
    run = Run(out, logs, resume=True)
    run.wait_for(lambda: metric_lines(out) >= 2, "two steps were logged")
    time.sleep(rng.uniform(0.0, 0.3))
    run.kill()
    assert "no checkpoint" in run.output() and "starting the run over" in run.output()
    kills.append(f"mid-run after {metric_lines(out)} logged steps")

    # 3. in the middle of writing a checkpoint: the temporary folder exists, the new checkpoint is not published
    before = latest_step(out)
    run = Run(out, logs, resume=True, pause_checkpoints=True)
    tmp_dirs = lambda: list((out / "checkpoints").glob(".tmp-step_*"))  # noqa: E731
    run.wait_for(lambda: bool(tmp_dirs()), "a checkpoint write began")
    time.sleep(rng.uniform(0.0, 0.4))  # within the first pause (0.5 s): the model is written, the optimizer not
    run.kill()
    assert tmp_dirs(), "the kill did not land inside the checkpoint write"
    assert latest_step(out) == before, "a half-written checkpoint was published"
    assert read_metrics(out / "eval.jsonl")[-1]["step"] == before + 1  # an evaluation newer than the checkpoint
    kills.append(f"during the write of checkpoint {tmp_dirs()[0].name}")

    # 4-5. two more kills at random moments after the resumed run made progress
    for _ in range(2):
        start = latest_step(out)
        run = Run(out, logs, resume=True)
        run.wait_for(lambda start=start: metric_lines(out) > start, "a step after the resumed checkpoint")
        time.sleep(rng.uniform(0.0, 0.5))
        run.kill()
        kills.append(f"at a random moment after step {start + 1} (resumed from {start})")
    assert len(kills) == 5

    # the last resume runs to the end
    run = Run(out, logs, resume=True)
    assert run.proc.wait(timeout=300) == 0, run.output()

    a, b = safetensors_of(reference / "final"), safetensors_of(out / "final")
    assert a.keys() == b.keys()
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, f"kills {kills}, seed {seed}: final weights differ from the uninterrupted run: {unequal[:5]}"

    got, want = read_metrics(out / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), f"kills {kills}, seed {seed}"
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING_KEYS}  # noqa: E731
    assert [strip(r) for r in got] == [strip(r) for r in want], f"kills {kills}, seed {seed}: metrics differ"
    assert read_metrics(out / "eval.jsonl") == read_metrics(reference / "eval.jsonl")

    # nothing a killed process was writing is left behind, and only the newest checkpoints are kept
    leftovers = [p.name for p in [*out.iterdir(), *(out / "checkpoints").iterdir()]
                 if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{STEPS - 1:08d}", f"step_{STEPS:08d}"]

"""Shared settings for the recipe tests (trainer, CLI): the demo config shrunk to a few seconds of CPU per run."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

# Nothing here downloads from the Hugging Face Hub (models are built from configs or saved locally): a name that is
# neither a preset nor a folder fails at once instead of after the hub client's retries (~45 s offline). Set before
# transformers is imported, which reads it once; the subprocesses of the CLI tests inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from gspo.cli import demo_config_path
from gspo.logprobs import completion_logprobs
from gspo.rewards import REWARDS
from gspo.trajectory import Trajectory

# The models here are tiny: one intra-op thread is fastest, and on a machine whose cores are busy (another training
# run) two OpenMP threads that wait on each other make a 5 ms forward take over a second. GSPO_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("GSPO_TEST_THREADS", "1")))

DEMO = demo_config_path()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the tests that train run (`trainer.device`, set by `tiny_overrides`): the GPU when torch sees one, so that
the suite on a GPU machine covers the CUDA path, else the CPU. Tests whose assertions need bit-for-bit reproducible
training (an interrupted run resumed equals an uninterrupted one) pin `trainer.device=cpu` instead: CUDA kernels that
accumulate with atomic float adds (e.g. the backward of SDPA's memory-efficient attention, which the fp32 models here
use) do not give bitwise-identical results from one run to the next, so a resumed run drifts by rounding."""

def slow_on_cpu(test):
    """Mark `test` slow on a machine without a GPU: for a test whose cost on the CPU is torch.compile building C++
    kernels (30-80 s each on 2 cores), in the slow suite there, in the fast suite on a GPU machine, whose fast suite
    is where the CUDA path runs."""
    return pytest.mark.slow(test) if DEVICE == "cpu" else test

CPU_COMPILE_ROUNDS_AS_EAGER = torch.__version__ >= "2.13"
"""Whether inductor's CPU code generator rounds to bf16 where eager autocast does (`gspo.models.COMPILE_OPTIONS`,
`emulate_precision_casts`): from torch 2.13. With 2.11 and 2.12 the option has no effect there, so compiled code
under bf16 autocast on the CPU keeps fused chains in float32 (README, Installing). The CUDA side of these tests (on
a GPU) expects the rounding at any supported release: not yet run there."""

# On top of configs/demo.yaml: 16 completions of ≤ 4 tokens per step, a 5-step cold start, no progress bars or TB.
TINY = [
    "trainer.steps=3",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "data.train_size=200",
    "data.eval_size=16",
    "trainer.eval_every=2",
    "cold_start.steps=5",
    "cold_start.batch_size=16",
    "optim.warmup_steps=4",  # below the 12 optimizer steps (the demo's 200 would never reach optim.lr: a warning)
    "log.progress=false",
    "log.tensorboard=false",
]


def varied_reward(prompt: str, completion: str, **row) -> float:
    """Fraction of digits in the completion: differs between the samples of a group even for an untrained model,
    so advantages (and updates) are non-zero, unlike the addition reward of a model that cannot add yet."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def flaky_reward(prompt: str, completion: str, **row) -> float:
    """`varied_reward`, but raising on about a third of the completions (by checksum: within groups, not whole
    groups), as a judge that times out now and then."""
    if zlib.crc32(completion.encode()) % 3 == 0:
        raise TimeoutError("judge did not answer")
    return varied_reward(prompt, completion)


def assert_left_out_of_groups(records: list[dict], flag: str, masked: bool, steps: int, groups: int) -> None:
    """`log.rollouts` records of a run where the completions flagged `flag` do not count (`masked`: they have no
    trained token and advantage 0, and the others of each group have the advantages of the group without them) or
    do (trained, in the group's statistics). Some must be flagged, and a group with a flagged completion and signal
    among the others must be among those compared."""
    from gspo.advantages import group_advantages

    flagged = [r for r in records if r[flag]]
    assert 0 < len(flagged) < len(records)
    if masked:
        assert all(r["trained_tokens"] == 0 and r["advantage"] == 0 for r in flagged)
    else:
        assert all(r["trained_tokens"] > 0 for r in flagged)
    checked = 0
    for step in range(1, steps + 1):
        for group in range(groups):
            mine = [r for r in records if r["step"] == step and r["group"] == group]
            members = [r for r in mine if not (masked and r[flag])]
            if len(members) >= 2:
                expected = group_advantages(torch.tensor([r["reward"] for r in members]), len(members))
                assert [r["advantage"] for r in members] == pytest.approx(expected.tolist(), abs=1e-5)
                checked += any(r[flag] for r in mine) and len({r["reward"] for r in members}) > 1
    assert checked


def assert_reward_metrics_counted(records: list[dict], metrics: list[dict], flag: str, masked: bool) -> None:
    """The step metrics `reward_mean`, `accuracy` and `zero_variance_groups` of a run whose `log.rollouts` recorded
    every completion are over the completions that count: without those flagged `flag` when `masked` (a failed
    judge's or environment's 0 is no score), with them otherwise. Some step must have a flagged completion."""
    assert any(r[flag] for r in records)
    for m in metrics:
        counted = [r for r in records if r["step"] == m["step"] and not (masked and r[flag])]
        assert m["reward_mean"] == pytest.approx(sum(r["reward"] for r in counted) / len(counted), abs=1e-6)
        assert m["accuracy"] == pytest.approx(sum(r["solved"] for r in counted) / len(counted), abs=1e-6)
        groups = {r["group"] for r in records if r["step"] == m["step"]}
        flat = [len({round(r["reward"], 6) for r in counted if r["group"] == g}) <= 1
                or sum(r["group"] == g for r in counted) < 2 for g in groups]
        assert m["zero_variance_groups"] == pytest.approx(sum(flat) / len(groups))


def constant_reward(prompt: str, completion: str, **row) -> float:
    """The same for every completion: no group carries a signal (dynamic sampling's error case)."""
    return 0.5


def boom_reward(prompt: str, completion: str, **row) -> float:
    raise RuntimeError("boom")


@pytest.fixture(scope="module")
def test_rewards():
    """Register `varied` and `boom` in the reward registry for the tests that name them in a config (for their module
    alone: the other modules see the registry as they expect, whatever the order they run in)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(REWARDS, "varied", varied_reward)
        mp.setitem(REWARDS, "boom", boom_reward)
        yield


@pytest.fixture(scope="session")
def device() -> str:
    """`trainer.device` for a test that trains: "cuda" when torch sees a GPU, else "cpu" (DEVICE)."""
    return DEVICE


def tiny_overrides(out: Path | str, *extra: str) -> list[str]:
    """TINY plus `trainer.device=DEVICE` and `trainer.out=out` plus `extra` (later overrides win)."""
    return [*TINY, f"trainer.device={DEVICE}", f"trainer.out={out}", *extra]


def record_objective(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[torch.Tensor, ...]]:
    """Wrap the registered objective `name` (for this test) so that every call records (logprobs, old_logprobs, mask);
    returns the list of records."""
    import dataclasses

    from gspo.objectives import OBJECTIVES

    calls = []
    inner = OBJECTIVES[name]

    def spy(logprobs, old_logprobs, advantages, mask, **kw):
        calls.append((logprobs.detach().clone(), old_logprobs.clone(), mask.bool().clone()))
        return inner.loss(logprobs, old_logprobs, advantages, mask, **kw)

    monkeypatch.setitem(OBJECTIVES, name, dataclasses.replace(inner, loss=spy))
    return calls


def ragged_trajectory(model, n: int = 8, seed: int = 0) -> Trajectory:
    """`n` rows of random tokens with prompts of 2-9 tokens (left-padded) and completions of 1-12 (right-padded); the
    engine's log-probabilities are the model's plus noise, so the mismatch metrics are not 0."""
    g = torch.Generator().manual_seed(seed)
    vocab, s, t = model.config.vocab_size, 9, 12
    p_len = torch.randint(2, s + 1, (n,), generator=g)
    c_len = torch.randint(1, t + 1, (n,), generator=g)
    prompt_mask = (torch.arange(s) >= s - p_len[:, None]).long()
    completion_mask = (torch.arange(t) < c_len[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (n, s), generator=g) * prompt_mask
    completion_ids = torch.randint(3, vocab, (n, t), generator=g) * completion_mask
    with torch.no_grad():
        lp, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    lp = (lp + 0.01 * torch.randn(lp.shape, generator=g)) * completion_mask
    return Trajectory(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, logprobs=lp, truncated=torch.zeros(n, dtype=torch.bool),
                      completions=[""] * n, prompt_index=torch.arange(n) // 4)


def sgd_learn(model, traj: Trajectory, advantages: torch.Tensor, minibatches: list[torch.Tensor], settings,
              lr: float = 0.5, **kwargs) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One `learn` call with plain SGD at a constant rate `lr` (the weights move by lr × the gradient, so a change
    shows the gradient 1:1); returns (each weight's change, on the CPU; the metrics). `kwargs` go to `learn`."""
    from gspo.learner import learn

    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = learn(model, optimizer, scheduler, traj, advantages, minibatches, settings, **kwargs)
    return {k: (v - start[k]).cpu() for k, v in model.state_dict().items()}, metrics


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in a saved model folder (final/, a checkpoint's model/)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors in {folder}"
    return tensors


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path` (returned)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


FLAGGED = '''
def flagged(prompt: str, completion: str, **row) -> float:
    """1 on the rows marked solved, whatever the model wrote."""
    return float(row["solved"])
'''
"""A reward module's source (write it to a file, name it file:flagged): its verdicts are the rows' own."""


def sampler_autocasts(monkeypatch: pytest.MonkeyPatch, *modules) -> list:
    """Every built-in sampler made from now on (gspo.rollout.HFSampler, and its name in each of `modules` that
    imported it) appends its `autocast` (None or the dtype it samples under) to the returned list."""
    import gspo.rollout as rollout

    made: list = []

    class Recorded(rollout.HFSampler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.autocast)

    for module in (rollout, *modules):
        monkeypatch.setattr(module, "HFSampler", Recorded)
    return made


class SimulatedCrash(Exception):
    """Raised by `crash_after`'s callback: a run stopped as a crash would, at a known step."""


def crash_after(step: int):
    """A `train` callback that stops the run right after `step` (counted from the start of the run) was logged and
    checkpointed as scheduled, as a crash would: no final model, no summary; `train(cfg, resume=True)` continues."""

    def callback(done: int, metrics: dict) -> None:
        if done >= step:
            raise SimulatedCrash(f"simulated crash after step {done}")

    return callback


def numpy_for_the_sandbox() -> None:
    """Skip unless the sandbox's program can import this environment's numpy: as root the program runs as an
    unprivileged uid, which cannot read a virtual environment inside a closed folder (a checkout under /root, or in a
    mktemp folder: 0700), and `package_dirs` refuses such a folder
    (`test_a_package_in_a_folder_closed_to_the_sandboxs_uid_is_refused` covers that refusal)."""
    from gspo.sandbox import package_dirs

    pytest.importorskip("numpy")
    try:
        package_dirs(("numpy",))
    except ValueError as e:
        if "cannot read" not in str(e):
            raise
        pytest.skip(f"the sandbox cannot read this environment's numpy: {e}")

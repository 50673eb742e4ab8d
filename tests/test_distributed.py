"""Multi-process training (torchrun, gloo on CPU): 2 processes train the same weights as 1 (DDP, and FSDP2 interrupted
and resumed), the pure pieces of `gspo.parallel` (sharding, one-process identities) behave as documented, and
`trainer.device` resolves by the one-GPU-per-process rule."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import DEMO, SimulatedCrash, crash_after, safetensors_of, tiny_overrides
from gspo.checkpoint import checkpoint_path, verify_checkpoint
from gspo.config import ConfigError, LoraConfig, load_config
from gspo.lora import apply_lora
from gspo.models import load_model
from gspo.optim import make_optimizer
from gspo.parallel import ProcessGroup, init_distributed, resolve_device
from gspo.parallel.state import load_state
from gspo.tracking import read_metrics
from gspo.trainer import train

TESTS = Path(__file__).parent
# Three steps, a checkpoint after each, a large constant learning rate (so the weights move well beyond float noise),
# a KL term (a reference model, sharded too under FSDP), and a reward that varies within groups even for an untrained
# model, named by import path so that the torchrun processes find it too.
RUN = ["trainer.steps=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=5", "optim.lr=3e-3",
       "optim.warmup_steps=0", "rewards.functions={conftest.varied_reward: 1.0}", "algorithm.kl_beta=0.05"]
# Rows of the tiny task are 8-11 tokens: two short rows share a micro-batch, a long one runs alone.
MICRO = "trainer.micro_batch_tokens=18"
REL_TOL = 1e-3  # per tensor: ‖W₂ − W₁‖ / ‖W₁‖ (Frobenius) after 3 steps; measured ≈ 2e-4
# The two processes run with trainer.device=auto: on one GPU each with two or more GPUs (NCCL), else on the CPU (gloo;
# on a one-GPU machine with a warning). The one-process reference trains on the same kind of device.
TWO_PROCESS_DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
FALLBACK_WARNING = "every process trains on the CPU (gloo)"
# The update metrics a step logs (the learner combines them over the processes as one process computes them), and how
# far apart the two runs' are: their weights differ by rounding (measured on the CPU: ≤ 2e-6 relative; before the
# metrics were combined by their counts and extrema, the gaps were 1e-2 to 2e-1, and 3e-5 for the entropy). CUDA's
# kernels round differently from one batch composition to the next: a looser bound there.
UPDATE_METRICS = ("ratio_max", "ratio_min", "ratio_mean", "clip_frac_tokens", "clip_frac_seqs", "approx_kl", "entropy",
                  "clip_frac_tokens_first_mb", "expert_volatility")
METRICS_REL_TOL = 1e-5 if TWO_PROCESS_DEVICE == "cpu" else 1e-3


def torchrun_command(tmp: Path, *args: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=2 ARGS`, its logs under `tmp` (by default torchrun leaves a
    torchelastic_* folder in the system's temporary folder at every launch)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--log-dir={tmp / 'torchrun-logs'}", *args]


def torchrun(tmp: Path, *args: str, fail: bool = False) -> str:
    """Run `torchrun --standalone --nproc_per_node=2 ARGS` (gloo, one thread per process); returns its stderr.
    Asserts that it succeeded (`fail`: that it failed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # a C++ crash prints the Python stacks
    cmd = torchrun_command(tmp, *args)
    done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) == fail, f"torchrun exit {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                           f"{done.stderr[-6000:]}"
    if torch.cuda.device_count() == 1:  # two processes, one GPU: trainer.device=auto falls back to the CPU, and says so
        assert FALLBACK_WARNING in done.stderr, done.stderr[-3000:]
    return done.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: the run in this process (world size 1), on the kind of device the two processes get, with one
    thread as each of theirs has (`torchrun`): left at whatever thread count earlier tests set, its rounding depended
    on the test order (approx_kl 1.3e-6 apart at step 3 after some orders, beyond METRICS_REL_TOL)."""
    out = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    train(load_config(DEMO, tiny_overrides(out, *RUN, f"trainer.device={TWO_PROCESS_DEVICE}", "trainer.threads=1")))
    torch.set_num_threads(threads)  # the tests after it keep theirs
    return out


def assert_same_run(one: Path, two: Path, final: str = "final") -> None:
    """Same final weights (to REL_TOL; `final`: the folder under each run holding them), and the same rollouts:
    identical rewards at every step."""
    a, b, start = safetensors_of(one / final), safetensors_of(two / final), safetensors_of(one / "cold_start")
    assert a.keys() == b.keys()
    rel = {k: float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) for k in a}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= REL_TOL, f"{worst}: relative difference {rel[worst]:.2e}"
    moved = max(float((a[k] - start[k]).abs().max()) for k in a if k in start)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert gap < 0.05 * moved, f"1-vs-2-process gap {gap:.2e} is not small against the updates ({moved:.2e})"
    print(f"{two.name}: max relative difference {rel[worst]:.2e} ({worst}), max abs {gap:.2e}, updates {moved:.2e}")
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in m2] == [1, 2, 3]  # rank 0 alone logs, once per step
    assert [r["reward_mean"] for r in m2] == [r["reward_mean"] for r in m1]
    for r1, r2 in zip(m1, m2, strict=True):
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-3, abs=1e-6)
        assert r2["kl_ref"] == pytest.approx(r1["kl_ref"], rel=1e-3, abs=1e-7)
        assert r2["grad_norm"] == pytest.approx(r1["grad_norm"], rel=1e-4)
    e1, e2 = read_metrics(one / "eval.jsonl"), read_metrics(two / "eval.jsonl")
    assert [e["step"] for e in e2] == [0, 2, 3]
    assert [e["heldout_accuracy"] for e in e2] == [e["heldout_accuracy"] for e in e1]
    for key in ("heldout_accuracy_ci95_low", "heldout_accuracy_change", "heldout_accuracy_change_ci95_high"):
        assert [e.get(key) for e in e2] == pytest.approx([e.get(key) for e in e1])  # from every process's rows
    assert (two / "summary.json").is_file()


def test_ddp_two_processes_match_one(one_process, tmp_path):
    """`torchrun --nproc_per_node=2 -m gspo train ...` (DDP) trains the weights of the one-process run, here with
    micro-batches of at most MICRO tokens (gradients accumulated without sync, then one all-reduce), and logs its update
    metrics: ratio_max is the largest ratio of either process's shares, clip_frac_tokens the clipped fraction of all
    their tokens, the entropy that of all the first minibatch's tokens (not means of per-process values)."""
    out = tmp_path / "ddp"
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO), *tiny_overrides(out, *RUN, "trainer.device=auto", MICRO))
    assert_same_run(one_process, out)
    m1, m2 = read_metrics(one_process / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    for r1, r2 in zip(m1, m2, strict=True):
        for key in UPDATE_METRICS:
            assert r2[key] == pytest.approx(r1[key], rel=METRICS_REL_TOL, abs=1e-6), f"step {r1['step']}: {key}"
    assert any(r["clip_frac_tokens"] > 0 for r in m1) and any(r["ratio_max"] > 1.01 for r in m1)  # not vacuous


def test_two_passes_per_batch_under_ddp_match_one_process(tmp_path):
    """algorithm.epochs=2: each pass splits the batch its own way, so a process's second-pass rows are mostly rows
    whose π_old another process computed; merged, the weights are still the one-process run's (measured: 5e-6
    relative). Dense: on the MoE preset 24 AdamW steps let a rounding-level difference flip a token's expert, and the
    gap grows to ~2e-3 on that expert (1e-4 with one pass). Evaluation samples 4 completions per row: each process
    draws its rows' samples as the one process does, so pass@k, maj@k and their intervals (from every process's rows)
    are the one-process run's, and so is the accuracy per group (data.eval_by, from every process's rows)."""
    one, two = tmp_path / "one", tmp_path / "ddp"
    passes = ["algorithm.epochs=2", "model.name=tiny-dense", "trainer.eval_samples=4", "data.eval_by=task"]
    train(load_config(DEMO, tiny_overrides(one, *RUN, *passes, f"trainer.device={TWO_PROCESS_DEVICE}")))
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO), *tiny_overrides(two, *RUN, *passes, "trainer.device=auto"))
    assert_same_run(one, two)
    e1, e2 = read_metrics(one / "eval.jsonl"), read_metrics(two / "eval.jsonl")
    keys = [f"heldout_pass@{k}{part}" for k in (1, 2, 4) for part in ("", "_ci95_low", "_ci95_high")]
    keys += [f"heldout_maj@{k}" for k in (1, 2, 4)]
    keys += [f"heldout_{key}/addition" for key in ("accuracy", "accuracy_ci95_low", "accuracy_ci95_high", "rows")]
    assert all(key in e for e in e1 + e2 for key in keys)
    assert [e[key] for e in e2 for key in keys] == pytest.approx([e[key] for e in e1 for key in keys])
    assert all(e["heldout_accuracy/addition"] == pytest.approx(e["heldout_accuracy"]) for e in e2)  # one group


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_async_rollouts_under_torchrun_match_the_one_process_run(one_process, tmp_path, parallel):
    """rollout.mode=async under torchrun: rank 0's worker process samples every batch and each process trains its
    share of it. With max_staleness 0 each batch is sampled by the policy of its step, with the step's prompts and
    seeds, as the sync run does: the same rewards, and the weights of the one-process run. (The mismatch correction
    is off: async turns it on by default, and the one-process run is sync.)"""
    out = tmp_path / "async"
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO),
             *tiny_overrides(out, *RUN, "trainer.device=auto", f"trainer.parallel={parallel}", "rollout.mode=async",
                             "rollout.max_staleness=0", "algorithm.mismatch=off"))
    assert_same_run(one_process, out)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["staleness_max"] for r in records] == [0, 0, 0] and records[-1]["rollout_dropped_stale"] == 0


def test_async_dynamic_sampling_without_signal_stops_every_process_with_the_error(tmp_path):
    """Under torchrun, rank 0's rollout workers find no informative group: every process raises the TrainingError
    (rank 0 broadcasts it instead of a batch), none waits for a batch until torchrun kills it."""
    stderr = torchrun(tmp_path, "-m", "gspo", "train", str(DEMO),
                      *tiny_overrides(tmp_path / "run", "trainer.device=auto", "rollout.mode=async",
                                      "rewards.functions={conftest.constant_reward: 1.0}",
                                      "rollout.dynamic_sampling=true", "rollout.dynamic_max_rounds=2"), fail=True)
    assert stderr.count("equal rewards for all its") == 2, stderr[-4000:]


def test_fsdp_two_processes_interrupted_and_resumed_match_one(one_process, tmp_path):
    """FSDP2 over 2 processes, crashed after step 2 and resumed from its sharded checkpoint (every process writes its
    own shards: no gather on rank 0), trains the weights of the uninterrupted one-process run; the sharded checkpoint
    also loads into one process, with the one-process run's weights. With micro-batches of at most MICRO tokens,
    whose count differs between the processes' shares (each forward is a collective: they run the largest count)."""
    out = tmp_path / "fsdp"
    torchrun(tmp_path, str(TESTS / "distributed_worker.py"), str(DEMO), "2",
             *tiny_overrides(out, *RUN, "trainer.parallel=fsdp", "trainer.device=auto", MICRO))
    assert_same_run(one_process, out)
    step3 = checkpoint_path(out, 3)
    assert verify_checkpoint(step3)["layout"] == "sharded" and not list(step3.rglob("*.safetensors"))
    model, _ = load_model(str(checkpoint_path(one_process, 3) / "model"))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = make_optimizer(model, lr=3e-3, total_steps=3)
    load_state(ProcessGroup(), step3, model, optimizer, scheduler)  # into one process
    for name, tensor in model.state_dict().items():  # the one-process run's step 3, to the tolerance of the runs
        rel = float((tensor - reference[name]).norm() / reference[name].norm().clamp(min=1e-12))
        assert rel <= REL_TOL, f"{name}: relative difference {rel:.2e}"
    assert any(not torch.equal(t, reference[k]) for k, t in model.state_dict().items())  # loaded, not the reference


@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_float16_under_torchrun_skips_overflows_together_and_trains(tmp_path, monkeypatch, parallel):
    """trainer.mixed_precision=float16 over 2 processes, from a loss scale past float16's range: the overflowed updates
    are skipped by every process and counted (not failures: no skipped_updates, no guard anomaly), every process keeps
    the same scale (`learn` compares them after every step and raises otherwise; under FSDP2 the processes hold
    other gradient shards and ShardedGradScaler all-reduces the check), and once the scale fits the run trains.
    (A process's share of the loss carries the factor W that makes the processes' mean gradient the whole batch's, so
    its gradients overflow at other scales than a one-process run's: the counts are not compared with one.)"""
    monkeypatch.setenv("GSPO_TEST_LOSS_SCALE", str(2.0**24))  # the worker processes' (tests/distributed_worker.py)
    out = tmp_path / parallel
    torchrun(tmp_path, str(TESTS / "distributed_worker.py"), str(DEMO), "0",
             *tiny_overrides(out, *RUN, "trainer.mixed_precision=float16", "trainer.eval_every=0", "cold_start=null",
                             f"trainer.parallel={parallel}", "trainer.device=auto"))
    records = read_metrics(out / "metrics.jsonl")
    assert records[0]["overflow_updates"] == 4 and records[0]["loss_scale"] == 2.0**20
    assert all(r["skipped_updates"] == 0 and r["guard_anomalies"] == 0 for r in records)
    assert records[-1]["overflow_updates"] < 4 and records[-1]["grad_norm"] > 0  # it trained once the scale fit
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overflow_updates"] == sum(r["overflow_updates"] for r in records)


@pytest.mark.slow  # ~60 s here: two processes compile the layers
def test_compiled_layers_under_fsdp_train_the_eager_one_process_run(tmp_path):
    """trainer.compile with FSDP2 (each sharded layer's forward compiled; FSDP's gathers stay hooks around it), with
    micro-batches of different counts per process: the weights and rewards of the eager one-process run of the dense
    model, to the runs' tolerance (compiled kernels round differently)."""
    dense = [*RUN, "model.name=tiny-dense", "trainer.eval_every=0"]
    one, two = tmp_path / "one", tmp_path / "fsdp"
    threads = torch.get_num_threads()
    train(load_config(DEMO, tiny_overrides(one, *dense, f"trainer.device={TWO_PROCESS_DEVICE}", "trainer.threads=1")))
    torch.set_num_threads(threads)
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO),
             *tiny_overrides(two, *dense, "trainer.parallel=fsdp", "trainer.device=auto", "trainer.compile=true",
                             MICRO))
    a, b = safetensors_of(one / "final"), safetensors_of(two / "final")
    rel = {k: float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) for k in a}
    assert max(rel.values()) <= REL_TOL, max(rel.items(), key=lambda kv: kv[1])
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [r["reward_mean"] for r in m2] == [r["reward_mean"] for r in m1]
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m1], rel=1e-3, abs=1e-6)


LORA = ["model.name=tiny-dense", "model.lora={r: 4, alpha: 8.0, merged_final: true}"]


def test_lora_under_fsdp_interrupted_and_resumed_matches_one_process(tmp_path):
    """LoRA on the FSDP-sharded model: the rollout engine gets the merged weights gathered whole (every process in
    lockstep), the KL reference is the sharded policy with its adapters off, the run crashes after step 2 and resumes
    from its sharded checkpoint, and the final adapter and merged model are written from the weights gathered on rank
    0; all match the uninterrupted one-process LoRA run (measured: 2e-7 relative on the merged weights). Checkpoints
    hold the adapters only, as one-process LoRA checkpoints do (1.4 MB here instead of 5.4 MB with the base)."""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    train(load_config(DEMO, tiny_overrides(one, *RUN, *LORA, f"trainer.device={TWO_PROCESS_DEVICE}")))
    torchrun(tmp_path, str(TESTS / "distributed_worker.py"), str(DEMO), "2",
             *tiny_overrides(two, *RUN, *LORA, "trainer.parallel=fsdp", "trainer.device=auto"))
    assert verify_checkpoint(checkpoint_path(two, 3))["layout"] == "sharded"
    from torch.distributed.checkpoint import FileSystemReader  # the checkpoints hold the adapters, not the base

    saved = FileSystemReader(checkpoint_path(two, 3) / "sharded").read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("model.")]
    assert weights and all(".lora_" in key for key in weights)
    # ... and load into one process
    model = apply_lora(load_model(str(two / "cold_start"))[0], LoraConfig(r=4, alpha=8.0))
    optimizer, scheduler = make_optimizer(model, lr=3e-3, total_steps=3)
    load_state(ProcessGroup(), checkpoint_path(two, 3), model, optimizer, scheduler)
    reference = safetensors_of(checkpoint_path(one, 3) / "model")  # the one-process run's adapters at step 3
    loaded = {name.replace(".default.", "."): p for name, p in model.named_parameters() if p.requires_grad}
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert float((loaded[name].detach() - tensor).norm() / tensor.norm().clamp(min=1e-12)) <= REL_TOL, name
    assert_same_run(one, two, final="final/merged")
    a, b = safetensors_of(one / "final"), safetensors_of(two / "final")  # the adapters
    assert a.keys() == b.keys() and all(".lora_" in k for k in a)
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)) <= REL_TOL, k


@pytest.mark.slow  # ~30 s here: a third run, and its second torchrun
def test_a_one_process_lora_checkpoint_resumes_on_two_fsdp_processes(tmp_path):
    """A run configured for FSDP started on one process (its checkpoints: peft's adapter files) continues on two FSDP
    processes to the weights of the uninterrupted one-process LoRA run."""
    one, three = tmp_path / "one", tmp_path / "one_then_two"
    train(load_config(DEMO, tiny_overrides(one, *RUN, *LORA, f"trainer.device={TWO_PROCESS_DEVICE}")))
    fsdp = [*LORA, "trainer.parallel=fsdp"]
    with pytest.raises(SimulatedCrash):
        train(load_config(DEMO, tiny_overrides(three, *RUN, *fsdp, f"trainer.device={TWO_PROCESS_DEVICE}")),
              callbacks=[crash_after(2)])
    assert verify_checkpoint(checkpoint_path(three, 2)).get("layout") != "sharded"
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO), *tiny_overrides(three, *RUN, *fsdp, "trainer.device=auto"),
             "--resume")
    assert_same_run(one, three, final="final/merged")


# ------------------------------------------------------------------------------------------------ trainer.device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` CUDA devices: `gpus(n)` (0: CUDA unavailable)."""
    def pretend(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return pretend


def test_one_gpu_per_process_or_the_cpu(gpus, caplog):
    gpus(0)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")
    gpus(2)
    assert resolve_device("auto", local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=0, local_world_size=2) == torch.device("cuda", 0)
    assert resolve_device("cpu", local_rank=1, local_world_size=2) == torch.device("cpu")
    gpus(1)  # two processes on a one-GPU machine: never two on one GPU
    with caplog.at_level(logging.WARNING, logger="gspo.parallel.group"):
        assert resolve_device("auto", local_rank=0, local_world_size=2) == torch.device("cpu")
    assert "2 processes on this machine (LOCAL_WORLD_SIZE) but only 1 visible CUDA device" in caplog.text
    assert FALLBACK_WARNING in caplog.text
    assert resolve_device("auto", local_rank=1, local_world_size=2) == torch.device("cpu")
    for rank in (0, 1):
        with pytest.raises(ConfigError, match=r"trainer\.device=cuda: 2 processes .* only 1 visible CUDA device"):
            resolve_device("cuda", local_rank=rank, local_world_size=2)


def test_init_distributed_reads_the_local_world_size(gpus, monkeypatch):
    """The number of processes on the machine comes from torchrun's LOCAL_WORLD_SIZE (WORLD_SIZE=1 here, so that no
    process group is started: only the device is resolved)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    gpus(1)
    assert init_distributed("ddp", "auto").device == torch.device("cpu")
    with pytest.raises(ConfigError, match="2 processes"):
        init_distributed("ddp", "cuda")


def test_several_processes_without_their_place_on_the_machine_are_refused(gpus, monkeypatch):
    """WORLD_SIZE > 1 without LOCAL_RANK / LOCAL_WORLD_SIZE (a launcher other than torchrun): every process would take
    GPU 0, or some NCCL and others gloo on machines with other GPU counts, and hang at the first collective. Refused
    before any process group is started."""
    gpus(2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=2 without LOCAL_RANK: .* torchrun"):
        init_distributed("ddp", "auto")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="without LOCAL_WORLD_SIZE"):
        init_distributed("ddp", "auto")
    assert not torch.distributed.is_initialized()


PRE_INITIALISED = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg
from gspo.config import ConfigError
from gspo.parallel.group import init_distributed
backend = {backend!r}
if backend == "gloo":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
else:  # a backend for CUDA tensors only, as NCCL is (NCCL itself cannot start on a machine without a GPU)
    dist.Backend.register_backend(backend, _create_fake_pg, extended_api=True, devices=["cuda"])
    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=2)
try:
    group = init_distributed("ddp", "cpu")
    print("ok", group.world_size, group.device)
except ConfigError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("backend", ["gloo", "cudaonly"])
def test_a_process_group_started_before_gspo_must_reduce_the_runs_tensors(backend):
    """A group the caller initialised (a launcher's) is used as it is: a gloo one for a CPU run; one whose backend
    takes CUDA tensors only, as NCCL's, is refused for a CPU run with what to do (its first collective failed deep in
    torch). In a child process: a process group belongs to its process."""
    done = subprocess.run([sys.executable, "-c", PRE_INITIALISED.format(backend=backend)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if backend == "gloo":
        assert done.stdout.strip() == "ok 1 cpu"
    else:
        assert "refused: the process group was initialised with the cudaonly backend, which cannot reduce cpu " \
               "tensors" in done.stdout and "'cpu:gloo,cuda:nccl'" in done.stdout


LIBRARY_GROUPS = """
import torch.distributed as dist
from gspo.parallel import on_shutdown, shutdown
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
own = dist.new_group([0])  # a library's group on the default one, which it destroys itself (vLLM's TP group)
seen = []

def teardown():  # as vLLM's: its own groups, then the default one
    seen.append(dist.is_initialized())
    dist.destroy_process_group(own)
    dist.destroy_process_group()

on_shutdown(teardown)
on_shutdown(teardown)
shutdown()
print(seen, dist.is_initialized())
"""


def test_shutdown_lets_a_library_destroy_its_own_groups_first():
    """vLLM's engine builds groups of its own on the default process group and destroys them at exit; destroyed under
    it by `shutdown`, its teardown printed a traceback after every successful `gspo train` on rollout.engine=vllm. A
    teardown registered with `on_shutdown` runs once, with the group still alive, and may destroy the default group
    itself. In a child process: a process group belongs to its process."""
    done = subprocess.run([sys.executable, "-c", LIBRARY_GROUPS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[True] False"


# ------------------------------------------------------------------------------------------------ pure pieces


@given(world=st.integers(1, 8), per=st.integers(1, 6))
def test_shards_partition_the_items_in_order(world, per):
    n = world * per
    shares = [ProcessGroup(rank=r, world_size=world).shard(n) for r in range(world)]
    assert [i for s in shares for i in range(n)[s]] == list(range(n))
    assert {s.stop - s.start for s in shares} == {per}


@given(world=st.integers(1, 8), n=st.integers(1, 40))
def test_uneven_evaluation_shards_partition_the_rows(world, n):
    shares = [ProcessGroup(rank=r, world_size=world)._uneven_shard(n) for r in range(world)]
    assert [i for s in shares for i in range(n)[s]] == list(range(n))
    assert max(s.stop - s.start for s in shares) - min(s.stop - s.start for s in shares) <= 1
    assert shares[0].stop > shares[0].start  # rank 0 always evaluates something


def test_sizes_that_do_not_split_into_whole_groups_are_refused():
    with pytest.raises(ValueError, match="prompts_per_step=3"):
        ProcessGroup(world_size=2).check_sizes(prompts_per_step=3, group_size=4, minibatches=1)
    with pytest.raises(ValueError, match="equal shares"):
        ProcessGroup(world_size=4).check_sizes(prompts_per_step=4, group_size=2, minibatches=4)  # minibatches of 2 rows
    ProcessGroup(world_size=2).check_sizes(prompts_per_step=4, group_size=4, minibatches=4)


def test_one_process_is_the_identity():
    d = ProcessGroup()
    idx = torch.randperm(12)
    assert torch.equal(d.share(idx), idx) and d.shard(5) == slice(0, 5)
    assert d.all_sum([2.0, 3.0]) == [2.0, 3.0] and d.all_finite(torch.tensor(1.0))
    assert not d.all_finite(torch.tensor(float("nan")))
    assert all(d.reduce_metrics({"a": 1.5}, op) == {"a": 1.5} for op in ("sum", "mean", "max", "min"))
    assert d.reduce_metrics_by_op({"max": {"a": 1.5}, "sum": {"a": 2.0}}) == {"max": {"a": 1.5}, "sum": {"a": 2.0}}
    with pytest.raises(ValueError, match="op must be"):
        d.reduce_metrics({"a": 1.5}, "median")
    t = torch.arange(6.0)
    assert d.merge_rows(t, [torch.tensor([0, 1])]) is t
    assert d.main_first(lambda: 7) == 7


REDUCE = '''
import math, torch.distributed as dist
from gspo.parallel import ProcessGroup

dist.init_process_group("gloo")
rank = dist.get_rank()
group = ProcessGroup(rank=rank, world_size=2)
mine = {"a": [1.0, 4.0][rank], "b": [-2.0, 0.5][rank], "nan_first": [math.nan, 1.0][rank],
        "nan_last": [1.0, math.nan][rank]}
want = {"sum": {"a": 5.0, "b": -1.5}, "mean": {"a": 2.5, "b": -0.75}, "max": {"a": 4.0, "b": 0.5},
        "min": {"a": 1.0, "b": -2.0}}
for op, values in want.items():
    got = group.reduce_metrics(mine, op)
    assert {k: got[k] for k in values} == values, (op, got)
    assert math.isnan(got["nan_first"]) and math.isnan(got["nan_last"]), (op, got)  # whichever rank has it
assert group.reduce_metrics({}, "max") == {}
# several ops at once (the learner's one reduction per step): each dict by its own op, the same key in several
got = group.reduce_metrics_by_op({"min": {"a": mine["a"], "nan_last": mine["nan_last"]}, "mean": {"b": mine["b"]},
                                  "max": {"a": mine["a"]}, "sum": {}})
assert list(got) == ["min", "mean", "max", "sum"] and got["sum"] == {}, got
assert got["min"]["a"] == 1.0 and math.isnan(got["min"]["nan_last"]), got
assert got["mean"] == {"b": -0.75} and got["max"] == {"a": 4.0}, got
assert group.reduce_metrics_by_op({"max": {"x": -math.inf}})["max"]["x"] == -math.inf  # no entries on any process
try:
    group.reduce_metrics({"a": 1.0} if rank else {"b": 1.0}, "sum")
except RuntimeError as e:
    assert "different metrics" in str(e)
else:
    raise AssertionError("different keys were reduced")
dist.destroy_process_group()
open(f"ok{rank}", "w").close()
'''


def test_metrics_reduced_over_two_processes(tmp_path):
    """`ProcessGroup.reduce_metrics` under torchrun (gloo): each key's sum, mean, max or min over the processes; NaN
    where either process has NaN (gloo's max and min keep or drop it by rank order); different keys are an error."""
    (tmp_path / "reduce.py").write_text(REDUCE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun_command(tmp_path, "reduce.py")
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "ok0").is_file() and (tmp_path / "ok1").is_file()  # every check ran on both processes


ROUTED = '''
def flagged(prompt: str, completion: str, **row) -> float:
    return float(row["solved"]) + 0.01 * len(completion)   # varies within a group: the policy trains

def tested(prompt: str, completion: str, **row) -> float:
    return float(row["tests"] == "pass")
'''


def test_routed_rewards_under_ddp_merge_each_functions_mean_over_the_rows_it_scored(tmp_path):
    """rewards.routes under torchrun: a process whose rows hold no `b` row still sends every key (a function's mean
    over no rows is 0 with 0 rows behind it), and the merged `reward/<name>` is the mean over the rows each function
    scored on every process, the one-process run's. Before, such a process sent fewer stats than the other and the
    sum over processes paired the wrong numbers (or waited forever)."""
    import json

    (tmp_path / "rw.py").write_text(ROUTED)
    rows = [{"prompt": f"{x}+1=", "answer": str(x + 1), "solution": str(x + 1), "data_source": "a", "solved": x % 2}
            if x % 8 else {"prompt": f"{x}+1=", "answer": str(x + 1), "solution": str(x + 1), "data_source": "b",
                           "tests": "pass" if x % 16 else "x"} for x in range(64)]  # 1 row in 8 is b
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rw = tmp_path / "rw.py"
    routed = [f"data.path={data}", "data.task=null", "data.eval_split=null", "trainer.steps=4",
              "rewards.route_by=data_source", "rewards.routes={a: [" + f"{rw}:flagged], b: [{rw}:tested]" + "}",
              f"rewards.functions={{{rw}:flagged: 1.0, {rw}:tested: 1.0}}",
              f"rewards.accuracy_reward=[{rw}:flagged, {rw}:tested]", "cold_start=null", "model.name=tiny-dense"]
    one, two = tmp_path / "one", tmp_path / "ddp"
    train(load_config(DEMO, tiny_overrides(one, *routed, f"trainer.device={TWO_PROCESS_DEVICE}")))
    torchrun(tmp_path, "-m", "gspo", "train", str(DEMO), *tiny_overrides(two, *routed, "trainer.device=auto"))
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    keys = [f"reward/{rw}:flagged", f"reward_rows/{rw}:flagged", f"reward_rows/{rw}:tested", "reward_mean"]
    assert [r[k] for r in m2 for k in keys] == pytest.approx([r[k] for r in m1 for k in keys])
    assert [(f"reward/{rw}:tested" in r) for r in m2] == [r[f"reward_rows/{rw}:tested"] > 0 for r in m1]
    assert any(r[f"reward_rows/{rw}:tested"] == 0 for r in m1)  # a step without b rows: no mean over nothing

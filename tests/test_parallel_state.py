"""gspo.parallel.state: FSDP checkpoints of sharded state (torch.distributed.checkpoint). Two processes (gloo, CPU)
save and reload them exactly, they load into one process and into DDP, no process writes the whole model, a one-process
checkpoint loads into FSDP, a failed save fails on every process, and corrupt shards are caught like any checkpoint."""

from __future__ import annotations

import datetime
import errno
import faulthandler
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gspo import checkpoint as ckpt
from gspo.checkpoint import CheckpointError, checkpoint_path, find_latest_checkpoint, verify_checkpoint
from gspo.learner import LearnSettings, learn
from gspo.logprobs import completion_logprobs
from gspo.models import build_preset
from gspo.objectives import OBJECTIVES
from gspo.optim import make_optimizer
from gspo.parallel import ProcessGroup, shutdown, wrap_policy
from gspo.parallel import state as parallel_state
from gspo.parallel.state import full_state, load_state, save_state
from gspo.rollout.weights import unwrap_model
from gspo.trajectory import Trajectory

WORLD = 2
STATE = {"step": 1, "data_position": 8}


def training(group: ProcessGroup, seed: int):
    """A tiny-dense preset wrapped for `group`, with the AdamW + LambdaLR of `make_optimizer` built on the wrapped
    model (the trainer's order). Different seeds give different weights."""
    model, tokenizer = build_preset("tiny-dense", seed=seed)
    model = wrap_policy(group, model)
    optimizer, scheduler = make_optimizer(model, lr=1e-2, total_steps=10, weight_decay=0.1, warmup_steps=2)
    return model, tokenizer, optimizer, scheduler


def train_step(group: ProcessGroup, model, optimizer, scheduler, seed: int) -> None:
    """One optimizer step on a batch that depends on `seed` and the process (the processes' gradients are averaged)."""
    ids = torch.randint(2, 40, (2, 12), generator=torch.Generator().manual_seed(1000 * seed + group.rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def gathered(model, optimizer) -> dict:
    """The full weights and optimizer state (keyed by parameter name) on every process, and the learning rates."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    model = unwrap_model(model)  # the HF model's names (an FSDP root is a LogprobForward around it)
    full = {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    return {"model": {k: v.detach().clone() for k, v in full["model"].items()},
            "optimizer": {name: {k: v.clone() for k, v in s.items()} for name, s in full["optimizer"]["state"].items()},
            "lrs": [g["lr"] for g in optimizer.param_groups]}


def assert_same(a: dict, b: dict) -> None:
    """Bit-identical weights, optimizer state and learning rates."""
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys() and a["optimizer"]
    for name, s in a["optimizer"].items():
        assert s.keys() == b["optimizer"][name].keys()
        for k in s:
            assert torch.equal(s[k], b["optimizer"][name][k]), (name, k)
    assert a["lrs"] == b["lrs"]


def _traced(rank: int, fn, *args) -> None:
    """Run `fn(rank, *args)` in a spawned process with faulthandler on (a crash in C++ prints every thread's Python
    stack), then tear the process group down as `gspo train` does (`shutdown`: without it, a gloo thread could abort
    the process at exit; CI saw that SIGABRT)."""
    faulthandler.enable(all_threads=True)
    fn(rank, *args)
    shutdown()


def spawn(fn, *args, nprocs: int) -> None:
    """Run `fn(rank, *args)` on `nprocs` processes (gloo; `fn` initialises the process group). The group is torn down
    after success only: on a failure the exception propagates with the group alive, so that multiprocessing records
    its traceback before the process exits."""
    mp.spawn(_traced, args=(fn, *args), nprocs=nprocs, join=True)


def worker(rank: int, tmp: str) -> None:
    """One of the two processes: every multi-process scenario, in one process group (starting one costs seconds)."""
    torch.set_num_threads(1)
    torch.manual_seed(100 + rank)  # each process its own random stream, each restored by a resume
    tmp_path = Path(tmp)
    out = tmp_path / "run"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=rank, world_size=WORLD)
    fsdp = ProcessGroup(rank=rank, world_size=WORLD, parallel="fsdp")
    # save after one step; the RNG draw after the save is what a resumed process must draw next
    model, tokenizer, optimizer, scheduler = training(fsdp, seed=0)
    train_step(fsdp, model, optimizer, scheduler, seed=1)
    save_state(fsdp, out, 1, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
               state=STATE, keep_last=3)
    saved = {**gathered(model, optimizer), "draw": torch.rand(4)}
    torch.save(saved, tmp_path / f"saved_rank{rank}.pt")

    # FSDP -> FSDP: a fresh model (other weights) and optimizer get exactly the saved state and RNG
    model2, _, optimizer2, scheduler2 = training(fsdp, seed=1)
    assert load_state(fsdp, checkpoint_path(out, 1), model2, optimizer2, scheduler2) == STATE
    assert torch.equal(torch.rand(4), saved["draw"])
    assert_same(gathered(model2, optimizer2), saved)
    assert scheduler2.state_dict() == scheduler.state_dict()
    # ... and the next step is the same step
    train_step(fsdp, model, optimizer, scheduler, seed=2)
    train_step(fsdp, model2, optimizer2, scheduler2, seed=2)
    stepped = gathered(model, optimizer)
    assert_same(gathered(model2, optimizer2), stepped)
    torch.save(stepped, tmp_path / f"stepped_rank{rank}.pt")
    save_state(fsdp, out, 2, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
               state={"step": 2}, keep_last=3)

    # a save that fails on one process only fails on both, and leaves the earlier checkpoints as they were
    real_save = torch.save

    def full_disk(obj, file, *args, **kwargs):
        if rank == 1 and parallel_state.RNG_DIRNAME in Path(str(file)).parts:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, file, *args, **kwargs)

    failing = pytest.raises(CheckpointError, match=r"^rank 1: could not write .* \(the disk is full")
    with mock.patch.object(torch, "save", full_disk), failing:
        save_state(fsdp, out, 3, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
                   state={"step": 3}, keep_last=3)
    fsdp.barrier()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]

    # the final model: one gathered HF directory on rank 0
    with full_state(fsdp, model) as final:
        assert (final is None) == (rank != 0)
        if final is not None:
            final.save_pretrained(tmp_path / "final")

    # a one-process checkpoint (written by the test, in the one-process layout) -> FSDP
    model3, _, optimizer3, scheduler3 = training(fsdp, seed=2)
    assert load_state(fsdp, tmp_path / "one" / "checkpoints" / "step_00000001", model3, optimizer3,
                      scheduler3) == STATE
    torch.save(gathered(model3, optimizer3), tmp_path / f"from_one_rank{rank}.pt")

    # the sharded checkpoint -> DDP (every process reads the whole state)
    ddp = ProcessGroup(rank=rank, world_size=WORLD, parallel="ddp")
    model4, _, optimizer4, scheduler4 = training(ddp, seed=3)
    assert load_state(ddp, checkpoint_path(out, 1), model4, optimizer4, scheduler4) == STATE
    assert_same(gathered(unwrap_model(model4), optimizer4), saved)
    # DDP saves the one-process layout (rank 0 alone writes it) and loads it back
    save_state(ddp, tmp_path / "ddp", 1, model=model4, optimizer=optimizer4, scheduler=scheduler4,
               tokenizer=tokenizer, state=STATE, keep_last=1)
    assert "layout" not in verify_checkpoint(checkpoint_path(tmp_path / "ddp", 1))
    model5, _, optimizer5, scheduler5 = training(ddp, seed=4)
    assert load_state(ddp, checkpoint_path(tmp_path / "ddp", 1), model5, optimizer5, scheduler5) == STATE
    assert_same(gathered(unwrap_model(model5), optimizer5), saved)

    fsdp_logprobs_match_one_process(fsdp)
    fsdp_micro_batches_match_one_process(fsdp)


def logprob_rows(rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s rows of a training forward: left-padded prompts, right-padded completions. Rank 1 has one
    150-token completion among 6-token ones: two length buckets, where rank 0 has one."""
    g = torch.Generator().manual_seed(50 + rank)
    width = 150 if rank == 1 else 6
    prompt_ids = torch.randint(3, 40, (3, 5), generator=g)
    completion_ids = torch.randint(3, 40, (3, width), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    prompt_mask[1, :2] = 0
    completion_mask[2, 3:] = 0
    completion_mask[1, 6:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def fsdp_logprobs_match_one_process(fsdp: ProcessGroup) -> None:
    """The FSDP root's training forward takes the chunked head and the length buckets inside it (the LM head module
    never runs: no N×T×V logits; every process runs as many backbone forwards as the one with the most buckets) and
    gives each process the one-process log-probs of its rows; the reduced gradient is the mean of the processes'
    one-process gradients."""
    model, _, _, _ = training(fsdp, seed=7)
    bare, _ = build_preset("tiny-dense", seed=7)
    calls, backbone_calls = [], []
    hook = unwrap_model(model).get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    counter = unwrap_model(model).model.register_forward_hook(lambda *_: backbone_calls.append(1))
    logprobs, _ = completion_logprobs(model, *logprob_rows(fsdp.rank), trim_padding=True)  # as the learner asks
    (logprobs * logprob_rows(fsdp.rank)[3]).sum().backward()
    hook.remove()
    counter.remove()
    assert not calls and len(backbone_calls) == 2  # rank 0: its one bucket and one padding forward
    torch.testing.assert_close(logprobs, completion_logprobs(bare, *logprob_rows(fsdp.rank))[0] * (
        logprob_rows(fsdp.rank)[3]), atol=1e-5, rtol=1e-5)
    for rank in range(WORLD):
        lp, _ = completion_logprobs(bare, *logprob_rows(rank))
        (lp * logprob_rows(rank)[3] / WORLD).sum().backward()
    want = dict(bare.named_parameters())
    for name, p in unwrap_model(model).named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        scale = float(want[name].grad.abs().max())
        torch.testing.assert_close(grad, want[name].grad, atol=1e-5 * scale + 1e-8, rtol=1e-4, msg=name)


def micro_trajectory() -> Trajectory:
    """4 rows: two of 5 + 4 tokens, two of 5 + 150 (the same on every process)."""
    g = torch.Generator().manual_seed(9)
    prompt_ids, completion_ids = torch.randint(3, 40, (4, 5), generator=g), torch.randint(3, 40, (4, 150), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[:2, 4:] = 0
    return Trajectory(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                      completion_mask=completion_mask, logprobs=torch.zeros(4, 150),
                      truncated=torch.zeros(4, dtype=torch.bool), completions=[""] * 4, prompt_index=torch.arange(4))


def fsdp_micro_batches_match_one_process(fsdp: ProcessGroup) -> None:
    """`learn` under FSDP2 with `micro_batch_tokens` = 40: rank 0's share (the two short rows) fits one micro-batch,
    rank 1's (the long rows) needs one per row, so rank 0 splits its share too (every forward is a collective: 2 update
    forwards on each process, whose log-probabilities are also this only minibatch's π_old), and the weights after the
    update are those of one process learning the whole minibatch in one forward."""
    spec = OBJECTIVES["gspo"]
    updated = {}
    for group, share, budget in ((fsdp, [2 * fsdp.rank, 2 * fsdp.rank + 1], 40), (ProcessGroup(), [0, 1, 2, 3], None)):
        model, _ = build_preset("tiny-dense", seed=7)
        model = wrap_policy(group, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        forwards = []
        counter = unwrap_model(model).model.register_forward_hook(lambda *_, f=forwards: f.append(1))
        settings = LearnSettings(objective=spec, eps_low=spec.eps_low, eps_high=spec.eps_high, max_new_tokens=150,
                                 micro_batch_tokens=budget)
        learn(model, optimizer, scheduler, micro_trajectory(), torch.tensor([1.0, -1.0, 0.5, -0.5]),
              [torch.tensor(share)], settings, group=group)
        counter.remove()
        if group.enabled:
            assert len(forwards) == 2, forwards
        updated[group.enabled] = {k: v.detach().clone() for k, v in gathered(model, optimizer)["model"].items()}
    start = dict(build_preset("tiny-dense", seed=7)[0].named_parameters())
    scale = max(float((updated[False][k] - start[k]).abs().max()) for k in start)
    assert scale > 1e-4
    for k, v in updated[True].items():
        gap = float((v - updated[False][k]).abs().max())
        assert gap <= 1e-5 * scale, f"{k}: {gap:.2e} against updates of {scale:.2e}"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Run `worker` on 2 processes, after writing a one-process checkpoint for it to load; returns the folder."""
    tmp = tmp_path_factory.mktemp("parallel_state")
    one = ProcessGroup()
    with torch.random.fork_rng():
        model, tokenizer, optimizer, scheduler = training(one, seed=4)
        train_step(one, model, optimizer, scheduler, seed=1)
        save_state(one, tmp / "one", 1, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer,
                   state=STATE, keep_last=1)
    torch.save(gathered(model, optimizer), tmp / "one.pt")
    spawn(worker, str(tmp), nprocs=WORLD)
    return tmp


def test_fsdp_round_trip_is_exact(two_processes):
    """Saved by 2 FSDP processes and loaded into fresh ones: the same full state, and the next step is the same
    (asserted in `worker`); the processes saved the same full state, which holds an optimizer step."""
    saved = [torch.load(two_processes / f"saved_rank{r}.pt") for r in range(WORLD)]
    assert_same(saved[0], saved[1])
    assert not torch.equal(saved[0]["draw"], saved[1]["draw"])  # each process restored its own (in `worker`)
    assert all(float(s["step"]) == 1 for s in saved[0]["optimizer"].values())
    document = verify_checkpoint(checkpoint_path(two_processes / "run", 1))
    assert document["layout"] == "sharded" and document["world_size"] == WORLD and document["state"] == STATE


def test_sharded_checkpoint_loads_into_one_process(two_processes):
    """No torchrun: the 2-process sharded checkpoint loads whole into a bare model with identical state, and the
    RNG states are rank 0's."""
    saved = torch.load(two_processes / "saved_rank0.pt")
    model, _, optimizer, scheduler = training(ProcessGroup(), seed=5)
    with torch.random.fork_rng():
        assert load_state(ProcessGroup(), checkpoint_path(two_processes / "run", 1), model, optimizer,
                          scheduler) == STATE
        assert torch.equal(torch.rand(4), saved["draw"])
    assert_same(gathered(model, optimizer), saved)
    assert scheduler.last_epoch == 1


def reshard_worker(rank: int, tmp: str, world: int) -> None:
    """One of `world` FSDP processes loading the 2-process checkpoint of step 1 (DCP reshards it)."""
    torch.set_num_threads(1)
    tmp_path = Path(tmp)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'rendezvous{world}'}", rank=rank,
                            world_size=world)
    fsdp = ProcessGroup(rank=rank, world_size=world, parallel="fsdp")
    model, _, optimizer, scheduler = training(fsdp, seed=6)
    with torch.random.fork_rng():
        assert load_state(fsdp, checkpoint_path(tmp_path / "run", 1), model, optimizer, scheduler) == STATE
        saved = torch.load(tmp_path / "saved_rank0.pt")
        assert torch.equal(torch.rand(4), saved["draw"])  # another number of processes: rank 0's RNG everywhere
    assert_same(gathered(model, optimizer), saved)


def test_sharded_checkpoint_loads_into_another_number_of_processes(two_processes):
    spawn(reshard_worker, str(two_processes), 3, nprocs=3)


def test_one_process_round_trip(two_processes, tmp_path):
    """One process (no torchrun) saves and loads the one-process layout, as `gspo.checkpoint` does."""
    folder = two_processes / "one" / "checkpoints" / "step_00000001"
    assert "layout" not in verify_checkpoint(folder) and (folder / "optimizer.pt").is_file()
    model, _, optimizer, scheduler = training(ProcessGroup(), seed=5)
    with torch.random.fork_rng():
        assert load_state(ProcessGroup(), folder, model, optimizer, scheduler) == STATE
    assert_same(gathered(model, optimizer), torch.load(two_processes / "one.pt"))
    with pytest.raises(ValueError, match="keep_last"):
        save_state(ProcessGroup(), tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, tokenizer=None,
                   state=STATE, keep_last=0)


def test_no_process_writes_the_whole_state(two_processes):
    """Each process's DCP file holds about half of the weights and optimizer state (no gather onto rank 0), and the
    checkpoint holds no full weight file."""
    folder = checkpoint_path(two_processes / "run", 1)
    saved = torch.load(two_processes / "saved_rank0.pt")
    total = sum(t.numel() * t.element_size() for t in saved["model"].values())
    total += sum(t.numel() * t.element_size() for s in saved["optimizer"].values() for t in s.values())
    shards = sorted((folder / "sharded").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"]
    for shard in shards:
        assert 0.4 * total < shard.stat().st_size < 0.6 * total, (shard.name, shard.stat().st_size, total)
    assert not list(folder.rglob("*.safetensors")) and not (folder / "optimizer.pt").exists()
    assert sorted(p.name for p in (folder / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    assert (folder / "model" / "config.json").is_file() and (folder / "model" / "tokenizer.json").is_file()


def test_one_process_checkpoint_loads_into_fsdp(two_processes):
    """A checkpoint of the one-process layout (optimizer state keyed by parameter index) loads into FSDP exactly."""
    assert_same(torch.load(two_processes / "from_one_rank0.pt"), torch.load(two_processes / "one.pt"))
    assert_same(torch.load(two_processes / "from_one_rank1.pt"), torch.load(two_processes / "one.pt"))


def test_final_model_is_a_plain_hugging_face_directory(two_processes):
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(two_processes / "final").state_dict()
    stepped = torch.load(two_processes / "stepped_rank0.pt")["model"]
    assert final.keys() == stepped.keys()
    assert all(torch.equal(final[k], stepped[k]) for k in final)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "metadata"])
def test_a_damaged_shard_is_rejected_and_the_previous_checkpoint_used(two_processes, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(two_processes / "run", run)
    assert find_latest_checkpoint(run) == checkpoint_path(run, 2)
    shard = checkpoint_path(run, 2) / "sharded" / ("__1_0.distcp" if damage != "metadata" else ".metadata")
    data = bytearray(shard.read_bytes())
    if damage == "delete":
        shard.unlink()
    elif damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"missing|truncated|corrupted"):
        verify_checkpoint(checkpoint_path(run, 2))
    model, _, optimizer, scheduler = training(ProcessGroup(), seed=5)
    with pytest.raises(CheckpointError):
        load_state(ProcessGroup(), checkpoint_path(run, 2), model, optimizer, scheduler)
    assert find_latest_checkpoint(run) == checkpoint_path(run, 1)


def test_an_unfinished_sharded_save_is_invisible(two_processes, tmp_path):
    """A save killed before its rename leaves a hidden temporary folder: ignored, then cleaned by the next save."""
    run = tmp_path / "run"
    shutil.copytree(two_processes / "run", run)
    unfinished = run / "checkpoints" / ".tmp-step_00000003-12345"
    shutil.copytree(checkpoint_path(run, 2), unfinished)
    (unfinished / ckpt.COMPLETE_FILENAME).unlink()
    assert find_latest_checkpoint(run) == checkpoint_path(run, 2)
    ckpt._clean_leftovers(run / "checkpoints")
    assert not unfinished.exists()


def main_first_worker(rank: int, tmp: str) -> None:
    """Rank 0's work outlasts the process group's timeout (2 s here; 60 minutes in a run) while rank 1 waits: a
    barrier of the process group itself raises on rank 1 after 2 s."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=2))
    group = ProcessGroup(rank=rank, world_size=2)

    def work() -> int:
        if rank == 0:
            time.sleep(5)
        return rank

    assert group.main_first(work) == rank
    dist.barrier()  # the process group itself is still usable


def test_the_others_wait_for_rank_0_longer_than_the_process_groups_timeout(tmp_path):
    """A cold start of hours on rank 0 (gspo.trainer: main_first) outlasted the process group's 60-minute timeout,
    and the waiting processes failed; they now wait at a barrier with MAIN_FIRST_TIMEOUT."""
    spawn(main_first_worker, str(tmp_path), nprocs=2)

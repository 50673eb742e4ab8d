"""GPU memory of the compiled decode loop's KV caches, given back between rollouts (`rollout.release_decode_cache`).

A compiled decode step on CUDA replays CUDA graphs that read and write its static KV caches at fixed addresses, so the
caches cannot simply be freed after a rollout and allocated again before the next: the new tensors would sit
elsewhere, every rollout would record the graphs again, and torch (2.11) stops using CUDA graphs for the step after
128 such re-recordings. torch_memory_saver (the library SGLang and verl free their KV caches with during training)
allocates tensors in virtual memory it can unmap: `pause` gives the physical memory back to the device and keeps the
addresses reserved, `resume` maps new memory at the same addresses, so the recorded graphs stay valid. The contents
are lost, which a KV cache does not mind: `HFSampler` resets it at the start of every generate call.

One tag for the process: every engine's caches are paused and resumed together. torch_memory_saver ends the process
when asked to pause memory that is already paused (or to resume memory that is not), so the state is kept here and
every call goes through `pause` and `resume`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator

import torch

__all__ = ["TAG", "check_release", "pause", "paused", "region", "resume"]

TAG = "gspo-decode-cache"
"""torch_memory_saver's tag of the caches' allocations."""

_lock = threading.Lock()
_state = {"paused": False, "allocated": False, "configured": False}


def check_release(decode: str, device: torch.device | str) -> None:
    """Raise ValueError when `rollout.release_decode_cache` cannot be honoured: a compiled decode loop on CUDA needs
    torch_memory_saver, which refuses the CUDA allocator's expandable segments (elsewhere the caches are freed and
    made again: no CUDA graph holds their addresses)."""
    if decode != "compiled" or torch.device(device).type != "cuda":
        return
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        raise ValueError("rollout.release_decode_cache: torch_memory_saver, which gives the compiled decode loop's KV "
                         "cache memory back, refuses to run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
                         "unset that, or set rollout.release_decode_cache=false")
    if importlib.util.find_spec("torch_memory_saver") is None:
        raise ValueError("rollout.release_decode_cache: the compiled decode loop's CUDA graphs replay its KV caches' "
                         "addresses, so their memory is given back with torch_memory_saver, which is not installed "
                         "(pip install torch_memory_saver); or set rollout.release_decode_cache=false")


def _saver():
    """The process's torch_memory_saver, in its torch-allocator mode (no LD_PRELOAD needed).

    The mode is set once, at this module's first use: the saver refuses it after its own first use, with an
    AssertionError while its settings are kept and an AttributeError once it has dropped them (which it does at its
    first region / pause: setting the mode at every call failed there, at a rollout's second cache call). A saver the
    caller used before, in a mode of its own, is taken as it is."""
    from torch_memory_saver import torch_memory_saver

    if not _state["configured"]:  # (pause / resume call this under _lock, which is not reentrant: not taken here)
        _state["configured"] = True
        with contextlib.suppress(AssertionError, AttributeError):
            torch_memory_saver.hook_mode = "torch"
    return torch_memory_saver


@contextlib.contextmanager
def region() -> Iterator[None]:
    """Allocations made inside (on CUDA) are the caches' memory, paused and resumed with `TAG`."""
    resume()  # a new allocation must not join paused ones: the tag's allocations are paused and resumed together
    with _lock:
        _state["allocated"] = True
    with _saver().region(tag=TAG):
        yield


def pause() -> None:
    """Give the caches' physical memory back to the device (their addresses stay reserved); nothing to do when it is
    already paused or none was allocated. Waits for the device first: a kernel still writing a cache must finish."""
    with _lock:
        if _state["paused"] or not _state["allocated"]:
            return
        torch.cuda.synchronize()
        _saver().pause(TAG)
        _state["paused"] = True


def resume() -> None:
    """Map memory at the caches' addresses again (contents undefined); nothing to do when they are not paused."""
    with _lock:
        if not _state["paused"]:
            return
        _saver().resume(TAG)
        _state["paused"] = False


def paused() -> bool:
    """Whether the caches' memory is given back now."""
    return _state["paused"]

"""Multi-process training on torch.distributed (`torchrun --nproc_per_node=N -m gspo train CONFIG ...`): the process
group and its collectives (`group`), wrapping the policy with DDP or FSDP2 (`wrap`), and the training state of a
wrapped policy (`state`). See `gspo.parallel.group` for what makes N processes train exactly like one."""

from gspo.parallel.group import ProcessGroup, init_distributed, on_shutdown, resolve_device, shutdown
from gspo.parallel.wrap import autocast, gradient_sync, whole, wrap_frozen, wrap_policy

__all__ = ["ProcessGroup", "autocast", "gradient_sync", "init_distributed", "on_shutdown", "resolve_device",
           "shutdown", "whole", "wrap_frozen", "wrap_policy"]

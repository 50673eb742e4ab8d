"""Run by tests/test_distributed.py under torchrun: `train` a config, optionally interrupted after a step and resumed
(`stop_after` 0: uninterrupted). Usage: torchrun ... tests/distributed_worker.py CONFIG STOP_AFTER [OVERRIDES...]"""

import sys

from gspo.config import load_config
from gspo.distributed import shutdown
from gspo.trainer import train

if __name__ == "__main__":
    config, stop_after, *overrides = sys.argv[1:]
    cfg = load_config(config, overrides)
    try:
        if int(stop_after):
            assert train(cfg, stop_after=int(stop_after)) == {"stopped_after": int(stop_after)}
            train(cfg, resume=True)
        else:
            train(cfg)
    finally:
        shutdown()

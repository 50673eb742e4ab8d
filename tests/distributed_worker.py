"""Run by tests/test_distributed.py under torchrun: `train` a config, optionally crashed after a step (a callback
raises) and resumed (`STOP_AFTER` 0: uninterrupted). Usage: torchrun ... tests/distributed_worker.py CONFIG STOP_AFTER
[OVERRIDES...]. With GSPO_TEST_LOSS_SCALE set, float16 runs start from that loss scale (optim.INITIAL_LOSS_SCALE)."""

import os
import sys

from conftest import SimulatedCrash, crash_after
from gspo import optim
from gspo.config import load_config
from gspo.parallel import shutdown
from gspo.trainer import train

if __name__ == "__main__":
    config, stop_after, *overrides = sys.argv[1:]
    if "GSPO_TEST_LOSS_SCALE" in os.environ:
        optim.INITIAL_LOSS_SCALE = float(os.environ["GSPO_TEST_LOSS_SCALE"])
    cfg = load_config(config, overrides)
    if int(stop_after):
        try:
            train(cfg, callbacks=[crash_after(int(stop_after))])
        except SimulatedCrash:
            pass
        else:
            raise AssertionError("the run was not stopped")
        train(cfg, resume=True)
    else:
        train(cfg)
    shutdown()  # after success only, as `gspo train` does

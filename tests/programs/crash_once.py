"""examples/resumable_train.py in which one worker crashes once, for torchrun to restart.

Environment: CRASH_RANK's worker raises at its CRASH_AT-th should_stop() call in the workers'
first start (TORCHELASTIC_RESTART_COUNT 0); torchrun (--max-restarts) then restarts every
worker, and the training resumes from its latest checkpoint. Arguments are the training's.
"""

import os
import runpy
import sys
from pathlib import Path

import slurmddp

TRAIN = str(Path(__file__).resolve().parents[2] / "examples" / "resumable_train.py")
CRASHES = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
           and os.environ.get("RANK") == os.environ.get("CRASH_RANK", "1"))  # fmt: skip
AT = int(os.environ.get("CRASH_AT", "50"))
real_should_stop = slurmddp.should_stop
calls = 0


def should_stop(*args, **kwargs):
    global calls
    calls += 1
    if CRASHES and calls == AT:
        raise RuntimeError(f"worker {os.environ['RANK']} crashes at call {AT}")
    return real_should_stop(*args, **kwargs)


slurmddp.should_stop = should_stop
sys.argv = [TRAIN, *sys.argv[1:]]
runpy.run_path(TRAIN, run_name="__main__")

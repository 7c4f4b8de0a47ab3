"""examples/resumable_train.py in which one worker crashes once, for torchrun to restart.

Environment: CRASH_RANK's worker raises at its CRASH_AT-th should_stop() call in the workers'
first start (TORCHELASTIC_RESTART_COUNT 0); torchrun (--max-restarts) then restarts every
worker, and the training resumes from its latest checkpoint. Arguments are the training's.
With CRASH_IN=sleep it raises in its CRASH_AT-th `time.sleep` (the training's --step-time, between
the backward pass and should_stop) instead: the other ranks are then in theirs, outside any
collective. With REPORT_TERM=1 each rank prints a line when SIGTERM reaches it (a handler
installed before slurmddp's, which chains it).
"""

import os
import runpy
import signal
import sys
import time
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


real_sleep = time.sleep
sleeps = 0


def sleep(seconds: float) -> None:
    global sleeps
    sleeps += 1
    if CRASHES and sleeps == AT:
        raise RuntimeError(f"worker {os.environ['RANK']} crashes in sleep {AT}")
    real_sleep(seconds)


if os.environ.get("CRASH_IN") == "sleep":
    time.sleep = sleep
else:
    slurmddp.should_stop = should_stop
if os.environ.get("REPORT_TERM") == "1":
    signal.signal(signal.SIGTERM, lambda *_: print(f"rank {os.environ['RANK']} got SIGTERM",
                                                   flush=True))  # fmt: skip
sys.argv = [TRAIN, *sys.argv[1:]]
runpy.run_path(TRAIN, run_name="__main__")

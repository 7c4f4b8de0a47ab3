"""A gloo job in which one rank fails, for tests/test_failures_cluster.py.

Environment: FAIL_MODE is raise, exit or kill (rank FAIL_RANK fails so at step 20 of the
training loop), sleep (rank FAIL_RANK never starts the process group), bus (rank FAIL_RANK's
node breaks for good: its name goes to BROKEN_FILE, and every rank on it dies of SIGBUS at step
20, as on a node with a memory error, in this run and any later one), or none; INIT is slurmddp
(`slurmddp.init`, the default) or torch (a plain `init_process_group`, as a torchrun script);
MEET_DIR and MEET_COUNT make rank 0 wait, with its group up, until MEET_COUNT jobs are up.
No collective timeout is given: torch's default (30 minutes) is what must not be waited out.
Each event is one line: ``EVENT {"event": ..., "rank": ..., "host": ..., "time": ...}``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])  # exported by python -m slurmddp.run
MODE = os.environ.get("FAIL_MODE", "none")
FAILING = MODE != "none" and int(os.environ.get("FAIL_RANK", "1")) == RANK
HOST = os.environ.get("SLURMD_NODENAME", "")
BROKEN = Path(os.environ.get("BROKEN_FILE", "/nonexistent"))
if MODE == "bus" and FAILING and not BROKEN.exists():
    BROKEN.write_text(HOST)


def event(name: str, **extra: object) -> None:
    record = {"event": name, "rank": RANK, "host": os.environ.get("SLURMD_NODENAME"),
              "time": time.time(), **extra}  # fmt: skip
    sys.stdout.write(f"EVENT {json.dumps(record)}\n")
    sys.stdout.flush()


event("arrived", port=int(os.environ["MASTER_PORT"]), job=os.environ.get("SLURM_JOB_ID"))
if FAILING and MODE == "sleep":
    time.sleep(600)
if os.environ.get("INIT", "slurmddp") == "torch":
    dist.init_process_group("gloo")
else:
    import slurmddp

    slurmddp.init("gloo")
event("joined")

meet = os.environ.get("MEET_DIR")
if meet and RANK == 0:
    Path(meet, os.environ["SLURM_JOB_ID"]).write_text(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + 120
    while len(list(Path(meet).iterdir())) < int(os.environ["MEET_COUNT"]):
        if time.monotonic() > deadline:
            sys.exit("the other jobs never came up")
        time.sleep(0.2)

t = torch.ones(1)
for step in range(40):
    dist.all_reduce(t)
    if MODE == "bus" and step == 20 and BROKEN.read_text() == HOST:
        event("failing", mode=MODE)
        os.kill(os.getpid(), signal.SIGBUS)
    if FAILING and step == 20:
        event("failing", mode=MODE)
        if MODE == "raise":
            raise RuntimeError("boom at step 20")
        if MODE == "exit":
            sys.exit(3)
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
event("done", sum=t.item())
dist.barrier()
dist.destroy_process_group()

"""A loop that snapshots every step, with faults injected where a user's node would meet them.

    python -m slurmddp.run tests/programs/snapshot_faults.py --checkpoint-dir DIR --steps N \
        [--fault RANK:KIND:STEP ...]

KIND: `pack` (the snapshot's copy fails on that rank), `stuck` (that rank's transfer thread is
held 3 s past $SLURMDDP_SNAPSHOT_TIMEOUT before its exchange), `hang` (held for good: the
process must still exit), `write` (the write of that rank's own file to its node's store fails:
a node's lead, whose whole state the node's other ranks keep their parts over). A store that
cannot be made is the test's doing ($SLURMDDP_SNAPSHOT_DIR per rank). The state, as under DDP:
w (64 KiB) alike on every rank, the sum of the steps trained, and `own` (64 bytes) the rank's
own, (rank + 1) times that count, so a resumed run's result is exact.
Prints RESULT {"rank", "start", "sum", "own"} and leaves the stores as a crash would (no
mark_done).
"""

import argparse
import json
import time

import torch
import torch.distributed as td

from slurmddp import Checkpointer
from slurmddp.checkpoint.snapshots import peers, snapshotter, store

p = argparse.ArgumentParser()
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--fault", action="append", default=[])
args = p.parse_args()

td.init_process_group("gloo")
rank = td.get_rank()
faults = {(kind, int(step)) for r, kind, step in (f.split(":") for f in args.fault)
          if int(r) == rank}
held = {"step": 0}

write = snapshotter.Snapshots._write


def _write(self, step, flat, size, copied):
    held["step"] = step
    if ("pack", step) in faults:
        def copied():
            raise RuntimeError(f"injected: the copy of step {step} failed")
    return write(self, step, flat, size, copied)


exchange = peers.exchange


def _exchange(group, sends, receives, timeout):
    if ("stuck", held["step"]) in faults:
        faults.discard(("stuck", held["step"]))
        time.sleep(timeout + 3)
    if ("hang", held["step"]) in faults:
        time.sleep(3600)
    return exchange(group, sends, receives, timeout)


put = store.NodeStore.put


def _put(self, shard, data, reuse=None):
    if ("write", shard.step) in faults and shard.rank == rank:
        raise OSError(f"injected: the write of step {shard.step} failed")
    return put(self, shard, data, reuse)


snapshotter.Snapshots._write = _write
peers.exchange = _exchange
store.NodeStore.put = _put

ckpt = Checkpointer(args.checkpoint_dir, snapshot_every=1, snapshot_budget=None)
loaded = ckpt.load_latest()
start = loaded.step if loaded is not None else 0
w = loaded.state["w"] if loaded is not None else torch.zeros(1 << 14)
own = loaded.state["own"] if loaded is not None else torch.zeros(16)
for step in range(start + 1, args.steps + 1):
    w += step
    own += (rank + 1) * step
    td.all_reduce(torch.zeros(1))  # the step's collective
    ckpt.snapshot(step, {"w": w, "own": own})
print("RESULT " + json.dumps({"rank": rank, "start": start, "sum": float(w[0]),
                              "own": float(own[0])}), flush=True)

"""How the ranks of a checkpoint agree: on ok/not ok, and on rank 0's outcome and name.

Without a process group the process is a world of one: it leads, and every agreement is its
own. Only tensors cross between ranks, never pickles. A rank may arrive long after the others
(rank 0 wrote or read a checkpoint): with ``after_work`` the others wait at the rendezvous store
first (`slurmddp.rank.coordination`), so that no collective timeout bounds a file system's pace.
"""

from __future__ import annotations

import enum

from slurmddp import dist
from slurmddp.rank import coordination

NAME_BYTES = 255  # NAME_MAX: the longest directory entry


def leads() -> bool:
    """Whether this process is rank 0 of the process group, or the only process.

    Not `dist.rank() == 0`: without a group that falls back to ``$RANK``, but a checkpoint
    without a group is a world of one, written by this process.
    """
    return dist.group() is None or dist.rank() == 0


def agree(ok: bool, *, after_work: bool = False) -> bool:
    """True when `ok` holds on every rank; also a barrier."""
    td = dist.group()
    if td is None:
        return ok
    import torch

    if after_work:
        coordination.wait_all()
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=dist.collective_device())
    td.all_reduce(flag, op=td.ReduceOp.MAX)
    return int(flag.item()) == 0


class Outcome(enum.IntEnum):
    """What rank 0 tells the other ranks along with a name."""

    FOUND = 0  # the name is the checkpoint (or temporary directory) to use
    NOTHING = 1  # no checkpoint yet: a fresh start
    FAILED = 2  # rank 0 failed and raises its error; the others raise that rank 0 did


def broadcast(outcome: Outcome, name: str = "") -> tuple[Outcome, str]:
    """Rank 0's `outcome` and `name` (a directory entry, at most NAME_BYTES bytes) on every rank,
    after rank 0 arrives (it may have worked long for them)."""
    td = dist.group()
    if td is None:
        return outcome, name
    import torch

    coordination.wait_all()
    buf = torch.zeros(1 + NAME_BYTES, dtype=torch.uint8)
    if td.get_rank() == 0:
        data = name.encode()  # one directory entry: at most NAME_MAX, 255 bytes
        buf[0] = int(outcome)
        if data:
            buf[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dist.collective_device())
    td.broadcast(buf, src=0)
    got = bytes(buf.cpu().tolist())
    return Outcome(got[0]), got[1:].rstrip(b"\0").decode()

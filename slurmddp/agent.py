"""``python -m slurmddp.agent [torchrun options] ...``: torchrun that passes the stop signal on.

srun delivers the stop signal (USR2) to every task of the step. Under the torchrun launcher the
task is torchrun's agent, for which USR2 is fatal; and its workers run in sessions of their own,
so a scheduler that signals by process group would never reach them. This agent catches the
signal and relays it to its direct children, the workers, which stop together at a step
boundary (slurmddp.preemption). Everything else is torchrun's (torch.distributed.run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence

from slurmddp.preemption import stop_signal


def children(pid: int, proc: str = "/proc") -> list[int]:
    """The pids whose parent is `pid`, read from /proc/<pid>/stat."""
    found = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone since listdir
        # Field 4 is the parent pid; field 2, the name in parentheses, may hold spaces.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _relay(signum: int, frame: object) -> None:
    for child in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # exited since
            os.kill(child, signum)


def main(argv: Sequence[str] | None = None) -> None:
    signal.signal(stop_signal(os.environ), _relay)
    from torch.distributed.run import main as torchrun

    torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

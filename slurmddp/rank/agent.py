"""``python -m slurmddp.agent [torchrun options] ...``: torchrun that passes the stop signal on.

srun delivers the stop signal (USR2) to every task of the step. Under the torchrun launcher the
task is torchrun's agent, for which USR2 is fatal; and its workers run in sessions of their own,
so a scheduler that signals by process group would never reach them. This agent catches the
signal and relays it to its direct children, the workers, which stop together at a step
boundary (slurmddp.preemption).

A ``--rdzv-endpoint`` given without a port gets one derived from the job and step ids, as
MASTER_PORT is (`env.derive_port`): a fixed port would let a second job whose first node
is shared join the first job's rendezvous. Everything else is torchrun's (torch.distributed.run).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence

from slurmddp.preemption import signals
from slurmddp.rank.env import derive_port


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


def with_rdzv_port(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """`argv` with a port added to a ``--rdzv-endpoint`` that has none (inside a Slurm job)."""
    args = list(argv)
    job, step = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", "0")
    if not job.isdigit():
        return args
    for i, arg in enumerate(args):
        if arg == "--":
            break
        for option in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg == option and i + 1 < len(args):
                index, value, prefix = i + 1, args[i + 1], ""
            elif arg.startswith(option + "="):
                index, value, prefix = i, arg.split("=", 1)[1], option + "="
            else:
                continue
            if value and ":" not in value.rsplit("]", 1)[-1]:
                port = derive_port(int(job), int(step) if step.isdigit() else 0)
                args[index] = f"{prefix}{value}:{port}"
            return args
    return args


def main(argv: Sequence[str] | None = None) -> None:
    # Workers are born with the stop signal blocked, so it cannot end one before its runner
    # takes it; the relay then reaches them as a pending signal at the latest.
    signals.route(signals.stop_signal(os.environ), _relay)
    from torch.distributed.run import main as torchrun

    torchrun(with_rdzv_port(sys.argv[1:] if argv is None else argv, os.environ))

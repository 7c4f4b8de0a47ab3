"""Local emulation of a Slurm job step: ``slurmddp submit --local`` without any Slurm.

submitit's LocalExecutor starts nodes x tasks processes, each running this module. Each one
gives itself the SLURM_* step variables that a real ``srun`` would give that task (block
distribution, one host name per emulated node), so the very same bootstrap code runs, then runs
the target through `slurmddp.run` in the same process, and leaves its exit status in a file so
that ``slurmddp status`` can tell how the job ended after the fact.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from slurmddp import protocol
from slurmddp.preemption import signals
from slurmddp.rank import hostlist
from slurmddp.rank.env import launcher_variables

LOCAL_HOST = "localhost"


def step_environment(
    global_rank: int, nodes: int, tasks_per_node: int, job_id: str, step_id: int = 0
) -> dict[str, str]:
    """The SLURM_* variables srun gives task `global_rank` of an even, block-distributed step."""
    world = nodes * tasks_per_node
    # Every emulated node is this machine, so every one is named localhost.
    nodelist = hostlist.compress([LOCAL_HOST] * nodes)
    per_node = f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)
    node = global_rank // tasks_per_node
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_STEP_ID": str(step_id),
        "SLURM_STEPID": str(step_id),
        "SLURM_PROCID": str(global_rank),
        "SLURM_LOCALID": str(global_rank % tasks_per_node),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURMD_NODENAME": LOCAL_HOST,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurmddp.emulation")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ntasks-per-node", type=int, required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--signal", default=protocol.DEFAULT_SIGNAL)
    p.add_argument("--max-requeues", type=int, default=protocol.DEFAULT_MAX_REQUEUES)
    p.add_argument("--signal-after", type=float, action="append", default=[], metavar="S",
                   help="send the stop signal S seconds into the run; once per run, in order")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("target", nargs=argparse.REMAINDER)
    opts = p.parse_args(argv)
    target = opts.target[1:] if opts.target[:1] == ["--"] else opts.target

    rank = int(os.environ["SUBMITIT_LOCAL_GLOBALID"])
    job_id = os.environ["SUBMITIT_LOCAL_JOB_ID"]
    # As the batch script does: leftovers of the submitting shell never decide a rank.
    for name in launcher_variables(os.environ):
        del os.environ[name]
    for pair in opts.env:
        key, _, value = pair.partition("=")
        os.environ[key] = value
    os.environ.update(step_environment(rank, opts.nodes, opts.ntasks_per_node, job_id))
    # What the batch script gives a Slurm run, with submitit's requeue in place of scontrol's:
    # requeue() counts the restarts in this file.
    counter = restart_counter_path(opts.folder, job_id)
    restart = int(counter.read_text()) if counter.exists() else 0
    os.environ.update({
        "SLURM_RESTART_COUNT": str(restart),
        protocol.SIGNAL_VAR: opts.signal,
        protocol.MAX_REQUEUES_VAR: str(opts.max_requeues),
        protocol.LOCAL_RESTART_FILE_VAR: str(counter),
    })  # fmt: skip
    if rank == 0:
        print(f"slurmddp: local job {job_id} (restart {restart})", file=sys.stderr, flush=True)
    if restart < len(opts.signal_after):
        _signal_later(opts.signal_after[restart], signals.stop_signal(os.environ))

    from slurmddp.batch import jobs
    from slurmddp.rank import runner as run

    status: int | str | None = 1
    try:
        status = run.main(target)
    except SystemExit as e:
        status = e.code
        raise
    finally:
        if isinstance(status, str):
            print(status, file=sys.stderr)  # what sys.exit("message") would have printed
        code = status if isinstance(status, int) else (0 if status is None else 1)
        jobs.local_exit_path(opts.folder, job_id, rank).write_text(f"{code}\n")
    return code


def restart_counter_path(folder: str, job_id: str) -> Path:
    """Where a local job counts its restarts (written by rank 0 when it asks for a requeue)."""
    return Path(folder) / f"{job_id}_restarts"


def _signal_later(seconds: float, sig: signal.Signals) -> None:
    # As srun does for Slurm's warning, every task gets the signal, each from its own timer.
    timer = threading.Timer(seconds, os.kill, (os.getpid(), sig))
    timer.daemon = True
    timer.start()

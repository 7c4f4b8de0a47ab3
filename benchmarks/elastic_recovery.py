"""A node lost: training again in place (elastic torchrun) against the requeue path.

    python -m benchmarks.elastic_recovery [--repeats 1]

A resumable DDP training (2 nodes x 2 workers, gloo, a checkpoint every 20 steps) runs under
``slurmddp submit --launcher torchrun``. Once it trains, every process of one of its nodes is
killed (as a node that dies takes them). Measured from that moment to the first training step
again (rank 0 says it resumed):

- ours: ``--spare-nodes 1 --max-restarts 3``: the other agents and the spare re-rendezvous and
  restart the workers from the checkpoint, in the same allocation;
- baseline: the requeue path at its fastest, the job requeued (``scontrol requeue``) the moment
  the node is lost, then waiting for its next run as any requeued job does (Slurm's own requeue
  of a job whose node failed comes only after SlurmdTimeout on top of this).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster import ROOT, cluster_env, job_processes
from benchmarks.preemption_turnaround import _wait
from benchmarks.table import Row, report


def one_loss(env: dict[str, str], work: Path, *, elastic: bool) -> float:
    """Seconds from a node's loss to the first training step again."""
    extra = ["--spare-nodes", "1", "--max-restarts", "3"] if elastic else []
    submitted = subprocess.run(
        [sys.executable, "-m", "slurmddp", "submit", "--json", "--partition", "debug",
         "--nodes", "2", "--ntasks-per-node", "2", "--launcher", "torchrun", *extra,
         "--output", str(work / "jobs"), "--env", "OMP_NUM_THREADS=1",
         str(ROOT / "examples" / "resumable_train.py"), "--steps", "100000", "--step-time",
         "0.05", "--log-every", "10", "--save-every", "20", "--checkpoint-dir", str(work / "ckpt")],
        env=env | {"XDG_STATE_HOME": str(work / "state")}, cwd=work, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    job = re.search(r'"job_id": "(\d+)"', submitted).group(1)  # type: ignore[union-attr]

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in (work / "jobs" / job).glob("*.log"))

    def show() -> str:
        return subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                              capture_output=True, text=True).stdout  # fmt: skip

    try:
        _wait(lambda: "step 40 " in logs(), 240, "training")
        nodes = subprocess.run(["scontrol", "show", "hostnames",
                                re.search(r" NodeList=(\S+)", show()).group(1)],  # type: ignore[union-attr]
                               env=env, capture_output=True, text=True).stdout.split()  # fmt: skip
        # A node with workers, not the first (its agent holds the c10d rendezvous).
        lost = next(n for n in nodes[1:]
                    if any("RANK" in env for env in job_processes(job, n).values()))
        for pid in job_processes(job, lost):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lost_at = time.time()
        if not elastic:
            subprocess.run(["scontrol", "requeue", job], env=env, check=True)
        _wait(lambda: "resumed from" in logs(), 300, "resumed run")
        return time.time() - lost_at
    finally:
        subprocess.run(["scancel", job], env=env)
        _wait(lambda: not re.search(r"JobState=(PENDING|RUNNING|COMPLETING|REQUEUED)", show()),
              60, "end of the job")  # fmt: skip


def run(repeats: int = 1) -> list[Row]:
    env = cluster_env()
    samples: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for elastic in (True, False):
            with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
                samples[elastic].append(one_loss(env, Path(work), elastic=elastic))
    return [Row("elastic", "node lost -> first training step again",
                statistics.median(samples[True]), statistics.median(samples[False]), "s",
                "requeued at once", "<= 60 s, ratio <= 0.5")]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_recovery")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    report(run(opts.repeats), opts.json)


if __name__ == "__main__":
    main()

"""Preemption turnaround on the local Slurm cluster, phase by phase.

    python -m benchmarks.preemption_turnaround [--repeats 3]

A resumable DDP training (2 nodes x 2 ranks, gloo) is submitted with `slurmddp submit`; once it
trains, its batch shell gets the stop signal (``scancel --batch --signal=USR2``, the delivery
Slurm uses for ``--signal=B:USR2``). Measured from that moment:

- checkpoint complete: the `latest` pointer's modification time (it moves last);
- requeued: Slurm counts the restart (polled every 20 ms);
- next run's first step: rank 0 of the next run says it resumed. Most of it is Slurm's: a
  requeued job may start only once its old credential expired (cred_expire, 5 s on the local
  cluster, 120 s by default); the rest is four ranks importing torch on this machine.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster import ROOT, cluster_env
from benchmarks.table import Row, report

POLL = 0.02


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(POLL)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def one_turnaround(env: dict[str, str], work: Path, nodes: int = 2,
                   per_node: int = 2) -> dict[str, float]:  # fmt: skip
    ckpt = work / "ckpt"
    submitted = subprocess.run(
        [sys.executable, "-m", "slurmddp", "submit", "--json", "--partition", "debug",
         "--nodes", str(nodes), "--ntasks-per-node", str(per_node), "--output", str(work / "jobs"),
         "--env", "OMP_NUM_THREADS=1", str(ROOT / "examples" / "resumable_train.py"),
         "--steps", "100000", "--step-time", "0.05", "--log-every", "10",
         "--checkpoint-dir", str(ckpt)],
        env=env | {"XDG_STATE_HOME": str(work / "state")}, cwd=work, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    job = re.search(r'"job_id": "(\d+)"', submitted).group(1)
    log = work / "jobs" / job / "rank-0.log"

    def text() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    def state() -> str:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                             capture_output=True, text=True).stdout  # fmt: skip
        found = re.search(r"JobState=(\w+)", out)
        return found.group(1) if found else "GONE"

    def restarts() -> int:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                             capture_output=True, text=True).stdout  # fmt: skip
        found = re.search(r"Restarts=(\d+)", out)
        return int(found.group(1)) if found else -1

    try:
        _wait(lambda: "step 20 " in text(), 180, "training")
        signalled = time.time()
        subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=env, check=True)
        pointer = ckpt / "latest"
        _wait(lambda: pointer.exists() and pointer.stat().st_mtime > signalled, 60,
              "checkpoint")  # fmt: skip
        checkpointed = pointer.stat().st_mtime
        _wait(lambda: restarts() >= 1, 60, "requeue")
        requeued = time.time()
        _wait(lambda: "resumed from" in text(), 180, "resumed run")
        resumed = time.time()
    finally:
        subprocess.run(["scancel", job], env=env)
        _wait(lambda: state() not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"), 60,
              "end of the job")  # fmt: skip
    return {
        "signal -> checkpoint complete": checkpointed - signalled,
        "checkpoint -> requeued": requeued - checkpointed,
        "requeued -> next run's first step": resumed - requeued,
        "signal -> next run's first step": resumed - signalled,
    }


def run(repeats: int = 1, nodes: int = 2, per_node: int = 2) -> list[Row]:
    """The phases' medians; `nodes` x `per_node` ranks (the benchmark's 2 x 2; the test's 1 x 1,
    the same phases for a quarter of the processes importing torch)."""
    env = cluster_env()
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
            for phase, seconds in one_turnaround(env, Path(work), nodes, per_node).items():
                samples.setdefault(phase, []).append(seconds)
    import statistics

    return [Row("preemption", phase, statistics.median(values), None, "s")
            for phase, values in samples.items()]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.preemption_turnaround")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    rows = run(opts.repeats)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

"""A node lost: training again in place (elastic torchrun) against the requeue path.

    python -m benchmarks.elastic_recovery [--repeats 1]

A resumable DDP training (2 nodes x 2 workers, gloo, a checkpoint every 20 steps) runs under
``slurmddp submit --launcher torchrun``. Once it trains, one of its nodes is lost, and the time
is measured from that moment to the first training step again (rank 0 says it resumed):

- **a node cut off**: its link down (``ip link set eth1 down`` in its network namespace), its
  slurmd and the job's processes alive, as with a cable or a switch port gone: nothing resets
  their connections. Ours, ``--spare-nodes 1 --max-restarts 3``: the other agents see its
  rendezvous beats stop, and with the spare restart the workers from the checkpoint, in the same
  allocation. Baseline, the same job without them (what a job had before): Slurm notices the
  node after SlurmdTimeout, requeues the job, which waits out the credential expiry and starts
  again. Then the link comes back and the job's processes left there are killed;
- **a node's processes lost** (SIGKILL; slurmd lives, as when a GPU fault ends them): ours as
  above; baseline, the requeue path at its fastest: the job requeued (``scontrol requeue``) the
  moment the node is lost, then waiting for its next run as any requeued job does.
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

from benchmarks.cluster import NODE_NETNS_VAR, ROOT, cluster_env, job_processes, link_cut, lose_node
from benchmarks.preemption_turnaround import _wait
from benchmarks.table import Row, report


def one_loss(env: dict[str, str], work: Path, *, elastic: bool, machine: bool,
             per_node: int = 2) -> float:  # fmt: skip
    """Seconds from a node's loss (the whole `machine` cut off, or the job's processes on it
    killed) to the first training step again."""
    extra = ["--spare-nodes", "1", "--max-restarts", "3"] if elastic else []
    submitted = subprocess.run(
        [sys.executable, "-m", "slurmddp", "submit", "--json", "--partition", "debug",
         "--nodes", "2", "--ntasks-per-node", str(per_node), "--launcher", "torchrun", *extra,
         "--output", str(work / "jobs"), "--env", "OMP_NUM_THREADS=1",
         str(ROOT / "examples" / "resumable_train.py"), "--steps", "100000", "--step-time",
         "0.05", "--log-every", "10", "--save-every", "20", "--checkpoint-dir", str(work / "ckpt")],
        env=env | {"XDG_STATE_HOME": str(work / "state")}, cwd=work, capture_output=True,
        text=True,
    )  # fmt: skip
    if submitted.returncode != 0:
        raise RuntimeError(f"slurmddp submit failed: {submitted.stderr.strip()}")
    job = re.search(r'"job_id": "(\d+)"', submitted.stdout).group(1)  # type: ignore[union-attr]

    def logs() -> str:
        return "".join(p.read_text(errors="replace") for p in (work / "jobs" / job).glob("*.log"))

    def show() -> str:
        return subprocess.run(["scontrol", "show", "job", "-o", job], env=env,
                              capture_output=True, text=True).stdout  # fmt: skip

    lost = ""
    try:
        _wait(lambda: "step 40 " in logs(), 240, "training")
        nodes = subprocess.run(["scontrol", "show", "hostnames",
                                re.search(r" NodeList=(\S+)", show()).group(1)],  # type: ignore[union-attr]
                               env=env, capture_output=True, text=True).stdout.split()  # fmt: skip
        # A node with workers, not the first (its agent holds the c10d rendezvous).
        lost = next(n for n in nodes[1:]
                    if any("RANK" in e for e in job_processes(job, n, env["SLURM_CONF"]).values()))
        with link_cut(lost, env[NODE_NETNS_VAR]) if machine else contextlib.nullcontext():
            if not machine:
                lose_node(job, lost, env["SLURM_CONF"])
            lost_at = time.time()
            if not elastic and not machine:
                subprocess.run(["scontrol", "requeue", job], env=env, check=True)
            _wait(lambda: "resumed from" in logs(), 400, "resumed run")
            return time.time() - lost_at
    finally:
        subprocess.run(["scancel", job], env=env)
        if machine and lost:  # the link back: the job's processes there go, its node serves again
            for pid in job_processes(job, lost, env["SLURM_CONF"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run([str(ROOT / "scripts" / "slurm-cluster"), "up"], env=env, check=True,
                           capture_output=True)  # fmt: skip
        _wait(lambda: not re.search(r"JobState=(PENDING|RUNNING|COMPLETING|REQUEUED)", show()),
              180, "end of the job")  # fmt: skip


def run(repeats: int = 1, machine: bool = True, per_node: int = 2) -> list[Row]:
    """The rows; without `machine`, only the node's processes lost (the machine's baseline waits
    for SlurmdTimeout); `per_node` workers a node (the benchmark's 2; the test's 1)."""
    env = cluster_env()
    samples: dict[tuple[bool, bool], list[float]] = {}
    for _ in range(repeats):
        for whole in (True, False) if machine else (False,):
            for elastic in (True, False):
                with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
                    samples.setdefault((whole, elastic), []).append(
                        one_loss(env, Path(work), elastic=elastic, machine=whole,
                                 per_node=per_node))  # fmt: skip
    median = {key: statistics.median(values) for key, values in samples.items()}
    rows = [Row("elastic", "node's processes lost -> training again", median[False, True],
                median[False, False], "s", "requeued at once")]  # fmt: skip
    if machine:
        rows.insert(0, Row("elastic", "node cut off -> first training step again",
                           median[True, True], median[True, False], "s", "Slurm requeues it",
                           "<= 60 s, ratio <= 0.5"))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.elastic_recovery")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    report(run(opts.repeats), opts.json)


if __name__ == "__main__":
    main()

"""The hang watchdog on the real cluster: 4 ranks on n1-n2 under `slurmddp submit`, one hangs.

Each case measures the time from the last progress (the last step any rank logged) to the job's
end in Slurm's record; the goal is the hang timeout + 15 s (printed, and bounded loosely here:
slurmctld records the end to the second, and this machine has two cores for four ranks).
"""

from __future__ import annotations

import datetime
import re

import pytest

from slurmddp.rank import hostlist
from slurmddp.watchdog.verdict import ranks_text
from tests.conftest import EVERY_SLURM, ROOT
from tests.preemption.test_preemption_cluster import Job

pytestmark = pytest.mark.cluster

HANG = str(ROOT / "tests" / "programs" / "hang.py")
TIMEOUT_S = 20


def hang_job(cluster, tmp_path, mode: str, rank: int, *args: str, requeues: int = 0,
             submit_args: tuple[str, ...] = ()) -> Job:
    """`args` go to the script; `submit_args` to slurmddp submit."""
    return Job(cluster, tmp_path, [
        *submit_args, "--nodes", "2", "--ntasks-per-node", "2", "--env", "OMP_NUM_THREADS=1",
        "--hang-timeout", str(TIMEOUT_S), "--max-requeues", str(requeues), HANG, mode, "--rank",
        str(rank), "--at", "8", "--steps", "400", "--step-time", "0.1", "--checkpoints",
        str(tmp_path / "ckpt"), *args,
    ])  # fmt: skip


def last_progress(job: Job) -> float:
    times = [float(t) for r in range(4) for t in re.findall(r"^step \d+ at (\S+)$", job.log(r),
                                                            re.MULTILINE)]  # fmt: skip
    assert times, job.log(0)
    return max(times)


@pytest.mark.parametrize("mode, rank, why", [
    # Slurm's end of a step with a stopped task may differ between versions: on both.
    pytest.param("stop", 2, "it did not answer: its process is stopped, or holds the interpreter "
                 "lock", marks=EVERY_SLURM),
    ("sleep", 3, "it is not waiting for another rank: it is in "),
    ("skip", 1, "while the others are at progress call"),
    ("startup", 2, "it is not waiting for another rank: it is in "),
])  # fmt: skip
def test_a_hung_rank_ends_the_job_named_with_its_node(slurm_cluster, tmp_path, mode, rank, why):
    job = hang_job(slurm_cluster, tmp_path, mode, rank)
    end = job.wait_end(timeout=240)
    batch = job.batch_log
    assert (end["JobState"], end["ExitCode"]) == ("FAILED", "124:0"), batch
    node = "n1" if rank < 2 else "n2"
    assert f"slurmddp: rank {rank} on {node} stopped progressing: " in batch and why in batch, batch
    others = ranks_text(r for r in range(4) if r != rank)
    assert f"slurmddp: ranks {others} merely wait for it" in batch, batch
    assert "the hang watchdog judged the run hung (above: which ranks); not requeued" in batch
    # A rank stuck on its own may be its node's fault; one out of step (skip) is the code's.
    blamed = f"{node} looks broken (rank {rank} on it stopped progressing (the hang watchdog's "
    assert (blamed in batch) == (mode != "skip"), batch
    if mode != "skip":
        assert "not requeued without it: the limit of 0 requeues (--max-requeues)" in batch
    hang = job.folder / job.id / "hang"
    assert (hang / "report.txt").read_text() in batch
    answered = sorted(int(p.stem.split("-")[1]) for p in hang.glob("rank-*.txt"))
    assert answered == ([0, 1, 3] if mode == "stop" else [0, 1, 2, 3]), answered
    assert "Thread 'MainThread'" in (hang / "rank-0.txt").read_text()
    if mode != "startup":
        ended = datetime.datetime.fromisoformat(end["EndTime"]).timestamp()
        took = ended - last_progress(job)
        print(f"{mode}: last progress to the job's end: {took:.1f} s (timeout {TIMEOUT_S} s)")
        assert took < TIMEOUT_S + 30, took


@EVERY_SLURM
def test_a_rank_stuck_on_its_node_gets_the_job_requeued_without_that_node(slurm_cluster,
                                                                          tmp_path):
    job = hang_job(slurm_cluster, tmp_path, "stop", 2, "--steps", "40", "--first-run-only",
                   requeues=1)  # fmt: skip
    end = job.wait_end(timeout=300)
    batch = job.batch_log
    assert end["JobState"] == "COMPLETED", batch
    assert ("hung at restart 0 because of node n2 (rank 2 on it stopped progressing (the hang "
            "watchdog's suspect)): requeued without it (1 of 1); the job now excludes n2") in batch
    second = re.findall(r"^slurmddp: job \d+ \(restart 1\) on (\S+)$", batch, re.M)
    assert second and "n2" not in hostlist.expand(second[0]), batch

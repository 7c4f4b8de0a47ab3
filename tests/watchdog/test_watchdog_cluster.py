"""The hang watchdog on the real cluster: ranks on n1-n2 under `slurmddp submit`, one hangs (4
ranks where the case needs a majority or a stopped rank's node-mate; 2 where it does not).

Each case measures the time from the last progress (the last step any rank logged) to the job's
end in Slurm's record: printed, and never under the hang timeout (how far over it is the load's
and Slurm's: no promise is made of it).
"""

from __future__ import annotations

import datetime
import re

import pytest

from slurmddp.rank import hostlist
from slurmddp.watchdog.verdict import ranks_text
from tests.conftest import ELSEWHERE_SLURM, EVERY_SLURM, ROOT
from tests.preemption.test_preemption_cluster import Job

pytestmark = pytest.mark.cluster

HANG = str(ROOT / "tests" / "programs" / "hang.py")
TIMEOUT_S = 20


def hang_job(cluster, tmp_path, mode: str, rank: int, *args: str, requeues: int = 0,
             submit_args: tuple[str, ...] = (), per_node: int = 2) -> Job:
    """`args` go to the script; `submit_args` to slurmddp submit."""
    return Job(cluster, tmp_path, [
        *submit_args, "--nodes", "2", "--ntasks-per-node", str(per_node), "--env",
        "OMP_NUM_THREADS=1",
        "--hang-timeout", str(TIMEOUT_S), "--max-requeues", str(requeues), HANG, mode, "--rank",
        str(rank), "--at", "8", "--steps", "400", "--step-time", "0.1", "--checkpoints",
        str(tmp_path / "ckpt"), *args,
    ])  # fmt: skip


def last_progress(job: Job, world: int) -> float:
    times = [float(t) for r in range(world) for t in re.findall(r"^step \d+ at (\S+)$", job.log(r),
                                                            re.MULTILINE)]  # fmt: skip
    assert times, job.log(0)
    return max(times)


# (mode, rank, why, ranks a node): two where the case needs them (a stopped task beside another on
# its node, as slurmstepd ends it; a rank out of step needs a majority in step, three of four),
# one elsewhere (a rank asleep, or stuck in its start-up, is named among two as among four).
@pytest.mark.parametrize("mode, rank, why, per_node", [
    # Slurm's end of a step with a stopped task may differ between versions: on all three.
    pytest.param("stop", 2, "it did not answer: its process is stopped, or holds the interpreter "
                 "lock", 2, marks=EVERY_SLURM),
    pytest.param("sleep", 1, "it is not waiting for another rank: it is in ", 1,
                 marks=ELSEWHERE_SLURM),
    ("skip", 1, "while the others are at progress call", 2),
    pytest.param("startup", 1, "it is not waiting for another rank: it is in ", 1,
                 marks=ELSEWHERE_SLURM),
])  # fmt: skip
def test_a_hung_rank_ends_the_job_named_with_its_node(slurm_cluster, tmp_path, mode, rank, why,
                                                      per_node):  # fmt: skip
    world = 2 * per_node
    job = hang_job(slurm_cluster, tmp_path, mode, rank, per_node=per_node)
    end = job.wait_end(timeout=240)
    batch = job.batch_log
    assert (end["JobState"], end["ExitCode"]) == ("FAILED", "124:0"), batch
    node = f"n{rank // per_node + 1}"
    assert f"slurmddp: rank {rank} on {node} stopped progressing: " in batch and why in batch, batch
    others = [r for r in range(world) if r != rank]
    waits = "s" if len(others) > 1 else ""
    assert (f"slurmddp: rank{waits} {ranks_text(others)} merely wait{'' if waits else 's'} for "
            "it") in batch, batch
    assert "the hang watchdog judged the run hung (above: which ranks); not requeued" in batch
    # A rank stuck on its own may be its node's fault; one out of step (skip) is the code's.
    blamed = f"{node} looks broken (rank {rank} on it stopped progressing (the hang watchdog's "
    assert (blamed in batch) == (mode != "skip"), batch
    if mode != "skip":
        assert "not requeued without it: the limit of 0 requeues (--max-requeues)" in batch
    hang = job.folder / job.id / "hang"
    assert (hang / "report.txt").read_text() in batch
    answered = sorted(int(p.stem.split("-")[1]) for p in hang.glob("rank-*.txt"))
    assert answered == [r for r in range(world) if mode != "stop" or r != rank], answered
    assert "Thread 'MainThread'" in (hang / "rank-0.txt").read_text()
    if mode != "startup":
        ended = datetime.datetime.fromisoformat(end["EndTime"]).timestamp()
        took = ended - last_progress(job, world)
        print(f"{mode}: last progress to the job's end: {took:.1f} s (timeout {TIMEOUT_S} s)")
        # Not before the timeout (EndTime is to the second). How soon after it is the machine's
        # load and Slurm's way of ending a step, not a promise: a loaded run took 82 s on 26.05.
        assert took > TIMEOUT_S - 2, took


@EVERY_SLURM
def test_a_rank_stuck_on_its_node_gets_the_job_requeued_without_that_node(slurm_cluster,
                                                                          tmp_path):
    # One rank a node: the node of the stopped rank is left out as with two (the stopped task
    # beside another on its node: the hung test's [stop], on every version).
    job = hang_job(slurm_cluster, tmp_path, "stop", 1, "--steps", "40", "--first-run-only",
                   requeues=1, per_node=1)  # fmt: skip
    end = job.wait_end(timeout=300)
    batch = job.batch_log
    assert end["JobState"] == "COMPLETED", batch
    assert ("hung at restart 0 because of node n2 (rank 1 on it stopped progressing (the hang "
            "watchdog's suspect)): requeued without it (1 of 1); the job now excludes n2") in batch
    second = re.findall(r"^slurmddp: job \d+ \(restart 1\) on (\S+)$", batch, re.M)
    assert second and "n2" not in hostlist.expand(second[0]), batch

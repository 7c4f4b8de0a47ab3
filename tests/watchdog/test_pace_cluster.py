"""A slow node on the real cluster: one node's ranks throttled by their cgroup's CPU quota (what
``cpu.max`` sets under cgroup v2, ``cpu.cfs_quota_us`` under v1) mid-training.

Every rank then takes the throttled rank's steps per second; the watchdog's pace
(`slurmddp.watchdog.pace`) names the node by how long its rank is busy a step against the median
rank, within a bounded number of its periods, in rank 0's log and the job's story; under
``--leave-slow-nodes`` the next requeue (a stop sent by hand here) leaves the node out.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.cluster import job_processes
from slurmddp.rank import hostlist
from slurmddp.watchdog import layout, pace
from tests.conftest import ELSEWHERE_SLURM
from tests.preemption.test_preemption_cluster import Job, train_args

pytestmark = pytest.mark.cluster

TIMEOUT_S = 20  # the hang timeout: the watchdog looks every 2 s
CPU_S = 0.02  # CPU seconds of work a step on each rank


@contextlib.contextmanager
def throttled(pids: list[int], share: float) -> Iterator[Path]:
    """`pids` (and what they start) limited to `share` of one CPU by a cgroup of their own for the
    block; back in the root cgroup after it."""
    name = f"slurmddp-slow-{pids[0]}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    root = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
    group = root / name
    group.mkdir()
    try:
        if v2:
            (root / "cgroup.subtree_control").write_text("+cpu")
            (group / "cpu.max").write_text(f"{int(share * 100_000)} 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(share * 100_000)))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (root / "cgroup.procs").write_text(pid)
        group.rmdir()


def step_of(job: Job) -> int:
    steps = re.findall(r"^step (\d+) ", job.log(), re.M)
    return int(steps[-1]) if steps else 0


@ELSEWHERE_SLURM
def test_a_throttled_node_is_named_and_left_out_at_the_next_requeue(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, [
        "--hang-timeout", str(TIMEOUT_S), "--leave-slow-nodes",
        *train_args(tmp_path / "ckpt", steps=600, step_time=0, per_node=1),
        "--cpu-time", str(CPU_S)])  # fmt: skip
    job.wait_for_log(r"step 40 ")
    nodes = hostlist.expand(job.fields()["NodeList"])
    slow = nodes[1]  # rank 1's: not the batch host
    pids = sorted(job_processes(job.id, slow, slurm_cluster.slurm_conf))
    assert pids, f"no process of job {job.id} on {slow}"
    with throttled(pids, 0.1):
        start, at = time.monotonic(), step_of(job)
        named = job.wait_for_log(rf"slurmddp: {slow} is slow: rank 1 on it is busy (\S+) times as "
                                 r"long a step as the median rank", timeout=90)  # fmt: skip
        waited, steps = time.monotonic() - start, step_of(job) - at
        print(f"{slow} throttled to a tenth of a CPU at step {at}: named after {waited:.0f} s, "
              f"{steps} steps, {named.group(1)} times the median rank")
        # The bound the pace promises: its window, its confirmation and a look, in periods.
        period = layout.period_s(TIMEOUT_S)
        assert waited <= (pace.WINDOW + pace.CONFIRM + 2) * period + 10, waited
        assert float(named.group(1)) >= pace.FACTOR
        slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job.id])  # a stop, by hand
        job.wait_requeued(1, timeout=180)
    end = job.wait_end(timeout=240)
    batch = job.batch_log
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", batch
    assert slow in hostlist.expand(end["ExcNodeList"]), end
    second = re.findall(r"^slurmddp: job \d+ \(restart 1\) on (\S+)$", batch, re.M)
    assert second and slow not in hostlist.expand(second[0]), batch
    assert re.search(rf"^slurmddp: {slow} is left out as the job is requeued "
                     r"\(--leave-slow-nodes\): it was slow \(its ranks busy", batch, re.M), batch
    told = [json.loads(line) for line in (job.folder / job.id / "events.jsonl").open()]
    named_events = [(e["run"], e["node"], e["ranks"]) for e in told if e["kind"] == "slow"]
    assert named_events == [(0, slow, [1])], named_events
    decisions = [(e["run"], e["cause"], e.get("left_behind", "").split(":")[0])
                 for e in told if e["kind"] == "decision"]  # fmt: skip
    assert decisions == [(0, "signal", slow), (1, "finished", "")], decisions
    # Run 1, on good nodes, names nothing: its ranks are busy alike.
    assert not re.search(r"is slow: ", job.log().split("resumed from", 1)[1]), job.log()

"""Snapshots under torchrun's elastic agents on the real local cluster (the node cut off on
26.05, the others on 24.11: slurmddp's and torch's logic, the same on every Slurm, spread over
the passes; docs/developers/testing.md). The nodes share this host's /dev/shm, so each node's
store is its own directory, and a node lost in a test loses it (benchmarks.cluster.lose_node
removes it).

- A node's processes killed, a spare in its place: the run (the example as a user runs it, within
  the default budget) resumes from the last snapshot or the one before, its shards fetched from
  the replicas, and ends bitwise.
- A node cut off (its link down, its processes and its store alive but out of reach; rank 0's
  where torchrun put it off the first node), the spare in its place, its rank's shard fetched
  from the replica on another node; then one rank killed: two recoveries from snapshots (the
  second with every shard on its own node), a bitwise end. A rank a node: a node's loss taking
  two ranks' shards is the first case's.
- A rank killed while it writes a snapshot: the one before is used (torchrun restarts the
  workers; the guide's loop with DataLoader workers that augment at random).
- A node whose snapshot store is full, or was made first by another user, keeps none and says
  so; the other keeps the replicas, and killed workers resume from them. (These a rank a node:
  the stores, not a node's ranks, are the claim.)
- Under srun, a copy that fails, a transfer thread held past the timeout and one that hangs at
  the exit never hold the job: it trains on and ends.

The framework integrations' snapshots on the cluster: tests/integrations/test_snapshots_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.cluster import job_processes, lose_node
from slurmddp.checkpoint.snapshots import store
from slurmddp.protocol import SNAPSHOT_DIR_VAR
from slurmddp.rank import hostlist
from tests.checkpoint.test_snapshots import LOOP, PROGRAM, run_world
from tests.conftest import ROOT, wait_until
from tests.preemption.test_preemption_cluster import Job
from tests.test_elastic_cluster import (
    SPARE_ONE,
    SPARE_ONE_2x1,
    assert_bitwise,
    cut_off,
    node_logs,
    wait_logged,
    workers_on,
)

pytestmark = pytest.mark.cluster

RESUMABLE = str(ROOT / "examples" / "resumable_train.py")
SNAPSHOTS = ["--snapshot-every", "1", "--save-every", "1000", "--log-every", "1"]
# Every step, whatever it costs: the tests that count the steps a loss costs.
EVERY_STEP = ["--snapshot-budget", "none"]


def last_step_before_recovery(job: Job) -> int:
    """The last step rank 0 logged before the first recovery: in the log of the node where the
    new rank 0 said it resumed, what comes before that; the others' logs whole."""
    texts = [t.split("resuming from the snapshot")[0] for t in node_logs(job).values()]
    return max(int(n) for t in texts for n in re.findall(r"\] step (\d+) loss", t))


def resumed_at(logs: str) -> list[int]:
    """The steps each recovery of rank 0 resumed at, from snapshots, in order."""
    return [int(n) for n in re.findall(r"resuming from the snapshot of step (\d+)", logs)]


def stores(tmp_path: Path) -> dict[str, int]:
    """{node: bytes in its snapshot store} of the job's run 0."""
    base = store.root({SNAPSHOT_DIR_VAR: str(tmp_path / "shm")})
    return {d.name: sum(f.stat().st_size for f in d.iterdir())
            for d in base.glob("*.0.*/*") if d.is_dir()}  # fmt: skip


def spare_job(cluster, tmp_path: Path, *budget: str, per_node: int = 2) -> Job:
    """examples/resumable_train.py, 2 nodes x `per_node` workers and a spare,
    `snapshot_every=1`."""
    return Job(cluster, tmp_path, [
        *(SPARE_ONE if per_node == 2 else SPARE_ONE_2x1),
        "--env", f"{SNAPSHOT_DIR_VAR}={tmp_path / 'shm'}", RESUMABLE,
        "--steps", "300", "--step-time", "0.1", *SNAPSHOTS, *budget,
        "--checkpoint-dir", str(tmp_path / "ckpt"),
    ])  # fmt: skip


# On 24.11 (docs/developers/testing.md: what it checks is slurmddp's and torch's, the same on
# every Slurm; the passes share the work).
@pytest.mark.slurm("24.11")
def test_a_lost_node_costs_at_most_the_snapshot_interval_within_the_default_budget(
        slurm_cluster, tmp_path, reference_digest):  # fmt: skip
    # The example as a user runs it: snapshot_every=1 within the default budget (2%), which at
    # steps of 0.1 s spaces them 1 or 2 steps apart; rank 0 logs the spacing in use each step.
    job = spare_job(slurm_cluster, tmp_path)
    wait_logged(job, "] step 60 ", 180)
    nodes = hostlist.expand(job.fields()["NodeList"])
    lost = next(node for node in nodes[1:] if workers_on(job, node))
    held = stores(tmp_path)
    # Its agent and two workers; its store goes too.
    assert len(lose_node(job.id, lost, job.cluster.slurm_conf)) >= 3
    killed = time.time()
    wait_logged(job, "resuming from the snapshot", 120)
    back = time.time() - killed
    logs = "".join(node_logs(job).values())
    before = last_step_before_recovery(job)
    (at,) = resumed_at(logs)
    fetch = re.search(r"shards fetched from peers \((.*?)\) in ([\d.]+) s", logs)
    # The spacing follows the snapshots' measured cost: the one that counts is any in force
    # since the snapshot resumed from, not only the lost step's (a loaded run, 2026-12-02: every
    # 11 at the snapshot of step 54, every 8 by step 65, where the node was lost).
    spacing = max(int(n) for step, n in re.findall(r"\] step (\d+) loss \S+ snapshots every (\d+)",
                                                   logs) if at <= int(step) <= before)  # fmt: skip
    print(f"node lost at step {before} -> resumed from the snapshot of step {at} in {back:.1f} s "
          f"(fetching {fetch and fetch.group(1)}: {fetch and fetch.group(2)} s); stores {held}; "
          f"snapshots every {spacing} steps")
    assert before - at <= spacing, (before, at, spacing)  # the work lost
    assert "2 of 4 shards fetched from peers" in logs, logs  # the spare's two ranks
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert_bitwise(logs, reference_digest)
    assert not stores(tmp_path), stores(tmp_path)  # mark_done removed them from every node


# On 26.05, beside the elastic node cut off without a spare (docs/developers/testing.md).
@pytest.mark.slurm("26.05")
def test_a_node_cut_off_then_a_rank_killed_two_recoveries_from_snapshots(
        slurm_cluster, tmp_path, reference_digest_2x1):  # fmt: skip
    # First a node's link goes down (its slurmd, agent, worker and snapshot store alive, out of
    # reach), rank 0's when torchrun put it off the first node (whose agent holds the c10d
    # rendezvous), and the spare takes its place, fetching the cut node's shard from its replica;
    # then, training again, one rank is killed (an OOM kill, a GPU fault) and torchrun restarts
    # the workers where they are.
    job = spare_job(slurm_cluster, tmp_path, *EVERY_STEP, per_node=1)
    wait_logged(job, "] step 50 ", 180)
    nodes = hostlist.expand(job.fields()["NodeList"])
    first = next((n for n in nodes[1:] if 0 in workers_on(job, n)), None) or next(
        n for n in nodes[1:] if workers_on(job, n))  # fmt: skip
    with cut_off(job, first):
        cut = time.time()
        wait_logged(job, "resuming from the snapshot", 120)
        back = time.time() - cut
        before = last_step_before_recovery(job)
        wait_logged(job, "] step 150 ", 120)
        rank = next(pid for node in nodes if node != first
                    for pid, env in job_processes(job.id, node, job.cluster.slurm_conf).items()
                    if env.get("RANK") == "1" and "TORCHELASTIC_RUN_ID" in env)  # fmt: skip
        os.kill(rank, signal.SIGKILL)
        wait_until(lambda: len(resumed_at("".join(node_logs(job).values()))) == 2, 120,
                   lambda: f"a second recovery: {node_logs(job)}")  # fmt: skip
        end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    first_at, second_at = resumed_at(logs)
    print(f"{first}'s link cut at step {before} -> resumed from the snapshot of step {first_at} in "
          f"{back:.1f} s; then rank 1 killed -> from step {second_at}")
    # A snapshot every step: at most the one being taken is lost, and the one before it.
    assert before - first_at <= 2 and first_at < 150 <= second_at, (before, first_at, second_at)
    # Rank 0 says it once a recovery: the spare's shard from a replica, then each rank's its own.
    assert sorted(re.findall(r"(\d) of 2 shards fetched from peers", logs)) == ["0", "1"], logs
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert_bitwise(logs, reference_digest_2x1, ranks=2)


# -- the guide's loop with DataLoader workers, as torchrun's workers -----------------------------


@pytest.fixture(scope="module")
def loop_digest(tmp_path_factory) -> str:
    """The guide's data loop at 2 ranks, one a node, uninterrupted (local processes: the same
    bits)."""
    results, _ = run_world(tmp_path_factory.mktemp("loop"), ["n1", "n2"])
    (digest,) = {r["digest"] for r in results}
    return digest


def loop_job(cluster, tmp_path: Path, *args: str, hold: bool = False) -> Job:
    return Job(cluster, tmp_path, [
        "--nodes", "2", "--ntasks-per-node", "1", "--launcher", "torchrun", "--max-restarts", "1",
        "--sbatch-arg=--nodelist=n[1-2]", *(["--sbatch-arg=--hold"] if hold else []),
        "--env", "OMP_NUM_THREADS=1", "--env", f"{SNAPSHOT_DIR_VAR}={tmp_path / 'shm'}",
        PROGRAM, *LOOP, "--snapshot-every", "1", "--snapshot-budget", "none", "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        *args,
    ])  # fmt: skip


def loop_results(job: Job) -> list[dict]:
    logs = "".join(node_logs(job).values())
    return [json.loads(line.split("RESULT ", 1)[1]) for line in logs.splitlines()
            if "RESULT " in line]  # fmt: skip


# On 24.11 (docs/developers/testing.md: what it checks is slurmddp's and torch's, the same on
# every Slurm; the passes share the work).
@pytest.mark.slurm("24.11")
def test_a_rank_killed_writing_a_snapshot_leaves_the_one_before(slurm_cluster, tmp_path,
                                                                loop_digest):  # fmt: skip
    job = loop_job(slurm_cluster, tmp_path, "--die-in-snapshot", "10")
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert "resuming from the snapshot of step 9 " in logs, logs
    results = loop_results(job)
    assert len(results) == 2 and {r["start"] for r in results} == {9}, results
    assert {r["digest"] for r in results} == {loop_digest}


# On 24.11 (docs/developers/testing.md: what it checks is slurmddp's and torch's, the same on
# every Slurm; the passes share the work).
@pytest.mark.slurm("24.11")
@pytest.mark.parametrize("how", ["full", "another user's"])
def test_a_node_whose_store_is_full_or_not_its_own_keeps_none_and_the_other_node_serves(
        slurm_cluster, tmp_path, loop_digest, how):  # fmt: skip
    job = loop_job(slurm_cluster, tmp_path, "--crash-at", "10", hold=True)
    root = slurm_cluster.state_dir / "rootfs"
    n2 = store.node_directory({SNAPSHOT_DIR_VAR: str(tmp_path / "shm"), "SLURM_JOB_ID": job.id,
                               "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n2"},
                              tmp_path / "ckpt")  # fmt: skip
    n2.mkdir(mode=0o700, parents=True)
    seen = root / str(n2).lstrip("/") if root.is_dir() else n2
    if how == "full":
        # n2's store: a 1 MiB tmpfs, filled (in the node's view: the 24.11 nodes run in a root).
        # Private, as the store requires of its directories: refused, it would keep none too.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", seen],
                       check=True)  # fmt: skip
        subprocess.run(["sh", "-c", f"head -c 2M /dev/zero 2>/dev/null >{seen}/fill"],
                       check=False)  # fmt: skip
        said = "free of 1.0 MiB"
    else:
        # Made first by another user (/dev/shm is everyone's), with a shard planted in it: never
        # written to, never read.
        planted = n2 / "step-0000000999.rank-00001.of-00002.inc-00000001.crc-00000000.snap"
        planted.write_bytes(b"")
        os.chown(planted, 65534, 65534)
        os.chown(n2, 65534, 65534)
        said = "(owner uid 65534, not 0)"
    try:
        slurm_cluster.run(["scontrol", "release", job.id], check=True)
        end = job.wait_end(timeout=300)
    finally:
        if how == "full":
            subprocess.run(["umount", seen], check=False)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert "slurmddp: node n2 keeps no snapshot: " in logs and said in logs, logs
    # n2's rank fetched its shard from n1's replica.
    assert re.search(r"resuming from the snapshot of step (9|10) .*; 1 of 2 shards fetched", logs)
    results = loop_results(job)
    assert len(results) == 2 and {r["digest"] for r in results} == {loop_digest}, results


FAULTS = str(ROOT / "tests" / "programs" / "snapshot_faults.py")


@pytest.mark.slurm("24.11")
def test_a_failed_copy_a_stuck_transfer_and_a_hang_at_exit_never_hold_the_job(slurm_cluster,
                                                                             tmp_path):  # fmt: skip
    # Under srun, a rank a node: rank 0's copy fails at step 3; rank 1's transfer thread is held
    # past the timeout at step 5 (every rank gives that snapshot up and rebuilds the transfers'
    # group) and hangs for good in the last one. The job trains on and ends, as it would have.
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--ntasks-per-node", "1", "--sbatch-arg=--nodelist=n[1-2]",
        "--env", "OMP_NUM_THREADS=1", "--env", f"{SNAPSHOT_DIR_VAR}={tmp_path / 'shm'}",
        "--env", "SLURMDDP_SNAPSHOT_TIMEOUT=1", FAULTS, "--checkpoint-dir",
        str(tmp_path / "ckpt"), "--steps", "8", "--fault", "0:pack:3", "--fault", "1:stuck:5",
        "--fault", "1:hang:8",
    ])  # fmt: skip
    end = job.wait_end(timeout=300)
    logs = job.log(0) + job.log(1)
    assert end["JobState"] == "COMPLETED", job.batch_log + logs
    assert {(r["start"], r["sum"]) for r in job.results()} == {(0, 36.0)}, logs
    assert "a snapshot failed on node n1 (injected: the copy of step 3 failed)" in logs, logs
    assert "a snapshot was still being taken on node n2 at exit" in logs, logs

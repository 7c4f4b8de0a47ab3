"""Elastic training inside one allocation: torchrun's agents on the real local cluster.

- A worker fails once (rank 1 raises at step 50; a checkpoint every 20 steps): torchrun
  (--max-restarts 1) restarts the workers, they resume from step 40, the end is bitwise an
  uninterrupted run's.
- The etcd-v2 rendezvous: the agents meet through the cluster's etcd (scripts/slurm-cluster starts
  it, v2 API on), which then holds the job's rendezvous.
- A node lost (every process of it killed), with a spare (--nodes 2 --spare-nodes 1): the spare
  takes its place in the same world size, no requeue, training again within 60 s, bitwise end.
- A node lost without a spare (--nodes 2-3 on 3): the world shrinks to 4 ranks and resumes at the
  checkpoint's global sample: every sample once an epoch across the change.
- Below the minimum (2 of 3 nodes lost, --nodes 2-3): the last agent gives up after the join
  timeout, the job is requeued and resumes from its checkpoint.
- A node's slurmd killed: Slurm marks the node DOWN; the --no-kill job is neither killed nor
  requeued and ends bitwise.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from benchmarks.cluster import job_processes
from slurmddp.rank import hostlist
from tests.conftest import CLUSTER_SCRIPT, ROOT, tagged_json, wait_until
from tests.preemption.test_preemption_cluster import Job

pytestmark = [pytest.mark.cluster, pytest.mark.elastic]

CRASH_ONCE = str(ROOT / "tests" / "programs" / "crash_once.py")


def test_workers_restarted_by_torchrun_resume_from_the_latest_checkpoint(
        slurm_cluster, tmp_path, reference_digest):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--ntasks-per-node", "2", "--launcher", "torchrun", "--max-restarts",
        "1", "--env", "OMP_NUM_THREADS=1", "--env", "CRASH_RANK=1", "--env", "CRASH_AT=50",
        CRASH_ONCE, "--steps", "300", "--save-every", "20", "--checkpoint-dir",
        str(tmp_path / "ckpt"), "--log-every", "10",
    ])  # fmt: skip
    end = job.wait_end(timeout=300)
    logs = "".join(p.read_text(errors="replace") for p in (job.folder / job.id).glob("node-*.log"))
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert "worker 1 crashes at call 50" in logs, logs
    assert "resumed from " in logs and "at step 40 " in logs, logs
    results = [line for line in logs.splitlines() if "RESULT " in line]
    assert len(results) == 4 and all(reference_digest in line for line in results), results


def test_the_agents_meet_through_etcd_with_the_etcd_v2_backend(slurm_cluster, tmp_path,
                                                              reference_digest):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--ntasks-per-node", "2", "--launcher", "torchrun", "--rdzv-backend",
        "etcd-v2", "--rdzv-endpoint", slurm_cluster.etcd, "--env", "OMP_NUM_THREADS=1",
        str(ROOT / "examples" / "resumable_train.py"), "--steps", "300", "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ])  # fmt: skip
    end = job.wait_end(timeout=300)
    logs = "".join(p.read_text(errors="replace") for p in (job.folder / job.id).glob("node-*.log"))
    assert end["JobState"] == "COMPLETED", job.batch_log + logs
    results = [line for line in logs.splitlines() if "RESULT " in line]
    assert len(results) == 4 and all(reference_digest in line for line in results), results
    # The rendezvous of the job's run 0 is etcd's (torchrun's key: /torch/elastic/rendezvous/ID).
    url = f"http://{slurm_cluster.etcd}/v2/keys/torch/elastic/rendezvous?recursive=true"
    with urllib.request.urlopen(url, timeout=10) as answer:
        keys = json.dumps(json.load(answer))
    assert f"/torch/elastic/rendezvous/{job.id}.0" in keys, keys


# -- a node lost in place ----------------------------------------------------------------------


def node_logs(job: Job) -> dict[int, str]:
    """{node index in the step: its torchrun's log} (node-%n.log)."""
    return {int(p.stem.split("-")[1]): p.read_text(errors="replace")
            for p in (job.folder / job.id).glob("node-*.log")}  # fmt: skip


def workers_on(job: Job, node: str) -> list[int]:
    """The ranks of the workers torchrun runs on `node` (none on a spare)."""
    # (Rank 0's hang watchdog monitor has its environment too: one rank, not two.)
    return sorted({int(env["RANK"]) for env in job_processes(job.id, node).values()
                   if "RANK" in env and "TORCHELASTIC_RUN_ID" in env})  # fmt: skip


def kill_node(job: Job, node: str) -> int:
    """SIGKILL every process of the job on `node` (its torchrun agent and workers), as a node
    that dies takes them; the count killed."""
    killed = 0
    for pid in job_processes(job.id, node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


def test_a_lost_node_is_replaced_by_the_spare_in_place_and_the_run_ends_bitwise(
        slurm_cluster, tmp_path, reference_digest):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--spare-nodes", "1", "--ntasks-per-node", "2", "--launcher", "torchrun",
        "--max-restarts", "3", "--env", "OMP_NUM_THREADS=1",
        str(ROOT / "examples" / "resumable_train.py"), "--steps", "300", "--save-every", "20",
        "--step-time", "0.1", "--log-every", "10", "--checkpoint-dir", str(tmp_path / "ckpt"),
    ])  # fmt: skip
    wait_until(lambda: "step 60 " in "".join(node_logs(job).values()), 180,
               lambda: f"step 60 of job {job.id}:\n{job.batch_log}")  # fmt: skip
    nodes = hostlist.expand(job.fields()["NodeList"])
    working = {node: workers_on(job, node) for node in nodes}
    assert sorted(len(ranks) for ranks in working.values()) == [0, 2, 2], working  # one spare
    # Not the first node: its agent holds the c10d rendezvous (etcd-v2 has no such node).
    lost = next(node for node in nodes[1:] if working[node])
    assert kill_node(job, lost) >= 3  # its agent and two workers
    killed = time.time()
    wait_until(lambda: "resumed from " in "".join(node_logs(job).values()), 120,
               lambda: f"a resumed run of job {job.id}:\n{node_logs(job)}")  # fmt: skip
    back = time.time() - killed
    print(f"node lost -> training resumed in place: {back:.1f} s")
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    results = [line for line in logs.splitlines() if "RESULT " in line]
    assert len(results) == 4 and all(reference_digest in line for line in results), results
    assert "the other nodes went on without the one lost (elastic)" in job.batch_log
    assert back < 60, back


SAMPLES = str(ROOT / "tests" / "programs" / "elastic_samples.py")


def test_without_a_spare_the_world_shrinks_and_resumes_at_the_same_global_sample(
        slurm_cluster, tmp_path):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2-3", "--ntasks-per-node", "2", "--launcher", "torchrun", "--max-restarts",
        "3", "--sbatch-arg=--nodelist=n[1-3]", "--env", "OMP_NUM_THREADS=1", SAMPLES,
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "60",
    ])  # fmt: skip
    wait_until(lambda: '"step": 25,' in "".join(node_logs(job).values()), 180,
               lambda: f"step 25 of job {job.id}:\n{job.batch_log}")  # fmt: skip
    nodes = hostlist.expand(job.fields()["NodeList"])
    assert len(nodes) == 3 and all(workers_on(job, node) for node in nodes), nodes
    assert kill_node(job, nodes[-1]) >= 3
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    resumed = re.search(r"resumed at step (\d+) \(epoch \d+, sample \d+\) with (\d+) ranks", logs)
    assert resumed and resumed[2] == "4", logs
    at = int(resumed[1])
    records = [r for r in tagged_json(logs, "SAMPLES ")
               if (r["restart"] == 0 and r["step"] <= at) or (r["restart"] > 0 and r["step"] > at)]
    assert {r["world"] for r in records if r["step"] > at} == {4}
    steps = collections.Counter(r["step"] for r in records)
    assert sorted(steps) == list(range(1, 61))
    assert all(n == (6 if step <= at else 4) for step, n in steps.items()), steps
    # The trajectory takes every sample once an epoch, across the change of world size.
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for r in records:
        by_epoch[r["epoch"]].extend(r["ids"])
    last = max(by_epoch)
    for epoch, ids in by_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} repeats a sample"
        if epoch < last:
            assert sorted(ids) == list(range(480)), f"epoch {epoch} skips a sample"


def test_below_the_minimum_the_job_is_requeued_and_resumes_from_its_checkpoint(
        slurm_cluster, tmp_path):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2-3", "--ntasks-per-node", "1", "--launcher", "torchrun", "--max-restarts",
        "3", "--sbatch-arg=--nodelist=n[1-3]", "--env", "OMP_NUM_THREADS=1", "--env",
        "SLURMDDP_STARTUP_TIMEOUT=20", SAMPLES,
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "40",
    ])  # fmt: skip
    wait_until(lambda: '"step": 15,' in "".join(node_logs(job).values()), 180,
               lambda: f"step 15 of job {job.id}:\n{job.batch_log}")  # fmt: skip
    nodes = hostlist.expand(job.fields()["NodeList"])
    assert len(nodes) == 3, nodes
    for node in nodes[1:]:  # one node left: below the minimum of 2
        assert kill_node(job, node) >= 2
    job.wait_requeued(1, timeout=120)
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED", job.batch_log + logs
    assert "fewer nodes than the minimum joined torchrun's rendezvous within 20 s" in job.batch_log
    assert ("stopped (nodes lost: fewer than the minimum rejoined torchrun's rendezvous) at "
            "restart 0: requeued (1 of 3)") in job.batch_log, job.batch_log
    assert re.search(r"resumed at step [1-9]0 ", logs), logs


def test_a_node_whose_slurmd_dies_costs_no_requeue(slurm_cluster, tmp_path, reference_digest):
    # Slurm marks the node DOWN after SlurmdTimeout (60 s here); the job is --no-kill, so it is
    # neither killed nor requeued, and its training ends as if nothing happened.
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--spare-nodes", "1", "--ntasks-per-node", "2", "--launcher", "torchrun",
        "--max-restarts", "3", "--env", "OMP_NUM_THREADS=1",
        str(ROOT / "examples" / "resumable_train.py"), "--steps", "300", "--save-every", "20",
        "--step-time", "0.3", "--log-every", "10", "--checkpoint-dir", str(tmp_path / "ckpt"),
    ])  # fmt: skip
    wait_until(lambda: "step 20 " in "".join(node_logs(job).values()), 180,
               lambda: f"step 20 of job {job.id}:\n{job.batch_log}")  # fmt: skip
    nodes = hostlist.expand(job.fields()["NodeList"])
    lost = next(node for node in nodes[1:] if workers_on(job, node))
    pid = int((slurm_cluster.state_dir / "run" / f"slurmd-{lost}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    try:
        wait_until(lambda: slurm_cluster.run(["sinfo", "-h", "-n", lost, "-o", "%T"])
                   .stdout.strip().startswith("down"), 150, f"{lost} to go down")  # fmt: skip
        end = job.wait_end(timeout=300)
    finally:
        up = subprocess.run([str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
    logs = "".join(node_logs(job).values())
    print(f"{lost}'s slurmd killed; re-rendezvous seen: {'resumed from' in logs}")
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    results = [line for line in logs.splitlines() if "RESULT " in line]
    assert len(results) == 4 and all(reference_digest in line for line in results), results

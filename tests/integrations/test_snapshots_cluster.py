"""The framework integrations' snapshots on the real local cluster: each framework's example, a
node's processes killed, a spare in its place, resumed from the snapshots, bitwise (the 26.05
pass; the snapshots' own cluster tests, tests/checkpoint/test_snapshots_cluster.py, run on 24.11
and 26.05: what these add is in the frameworks' processes, not in Slurm)."""

from __future__ import annotations

import re

import pytest

from benchmarks.cluster import lose_node
from slurmddp.protocol import SNAPSHOT_DIR_VAR
from slurmddp.rank import hostlist
from tests.checkpoint.test_snapshots_cluster import resumed_at
from tests.conftest import ROOT
from tests.preemption.test_preemption_cluster import Job
from tests.test_elastic_cluster import node_logs, wait_logged, workers_on

pytestmark = pytest.mark.cluster

# The framework integrations as users train: each one's example (Lightning's Trainer through
# fit(..., snapshot_every=1), an Accelerate loop through Preemptible(..., snapshot_every=1), the
# Hugging Face Trainer through train(..., snapshot_every=1); the default budget), dropout,
# torch's DataLoader with 2 workers adding noise. Its script, where it saves, its own options.
FRAMEWORKS = {
    "lightning": [str(ROOT / "examples" / "lightning_train.py"), "--checkpoint-dir",
                  "--dropout", "0.2", "--plain"],
    "accelerate": [str(ROOT / "examples" / "accelerate_train.py"), "--checkpoint-dir"],
    "transformers": [str(ROOT / "examples" / "hf_trainer.py"), "--output-dir"],
}


# Two nodes of one worker and a spare node, torchrun restarting the workers up to 3 times. One
# worker a node: what a lost node's snapshots need is another node holding its replica (its rank's
# shard fetched from a peer); the resumed DDP at more than two ranks (primed, or the sums differ)
# is the frameworks' unit tests' (three ranks, a rank killed, torchrun restarting them all), the
# store's several ranks a node tests/checkpoint/test_snapshots_cluster.py's. (2 nodes x 2 ranks
# before: 12 rank starts a framework, 6 now.)
SPARE_ONE = ["--nodes", "2", "--spare-nodes", "1", "--ntasks-per-node", "1", "--launcher",
             "torchrun", "--max-restarts", "3", "--env", "OMP_NUM_THREADS=1"]  # fmt: skip


# On 26.05 (docs/developers/testing.md): what they add is in the frameworks' processes.
@pytest.mark.slurm("26.05")
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_frameworks_loop_with_a_node_lost_resumes_from_snapshots_bitwise(slurm_cluster,
                                                                          tmp_path, framework):
    # 2 nodes x 1 rank and a spare under torchrun; a node's processes (torchrun, its worker and
    # the worker's 2 DataLoader workers) killed at step 60 or so. Nothing durable is written before.
    script, out, *own = FRAMEWORKS[framework]
    common = [*SPARE_ONE, "--env", f"{SNAPSHOT_DIR_VAR}={tmp_path / 'shm'}", script,
              "--steps", "120", "--log-every", "1", "--augment", "--workers", "2",
              *own]  # fmt: skip
    reference = Job(slurm_cluster, tmp_path, [*common, out, str(tmp_path / "ref")])
    end = reference.wait_end(timeout=300)
    assert end["JobState"] == "COMPLETED", reference.batch_log
    digests = set(re.findall(r'RESULT .*"digest": "(\w+)"', "".join(node_logs(reference).values())))
    assert len(digests) == 1, node_logs(reference)
    job = Job(slurm_cluster, tmp_path, [*common, "--step-time", "0.1", "--snapshot-every", "1",
                                        out, str(tmp_path / "ckpt")])  # fmt: skip
    wait_logged(job, "] step 60 ", 180)
    nodes = hostlist.expand(job.fields()["NodeList"])
    lost = next(node for node in nodes[1:] if workers_on(job, node))
    assert len(lose_node(job.id, lost, job.cluster.slurm_conf)) >= 2
    wait_logged(job, "resuming from the snapshot", 120)
    logs = "".join(node_logs(job).values())
    before = max(int(n) for t in node_logs(job).values()
                 for n in re.findall(r"\] step (\d+) $", t.split("resuming from")[0], re.M))
    # From a snapshot of this run, not from the start (nothing durable was written). How many
    # steps that loses is the budget's to decide (17 in one CI run, where the Accelerate loop's
    # snapshots took 29 ms against steps of 187 ms); the bound on it, the interval in force, is
    # tests/checkpoint/test_snapshots_cluster.py's, whose example prints its interval.
    (at,) = resumed_at(logs)
    assert 0 < at <= before, (at, before)
    assert "1 of 2 shards fetched from peers" in logs, logs
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    # Both ranks ended with the uninterrupted run's parameters (finite ones: a diverged run's
    # digest of NaNs would equal every other's).
    digest, results = digests.pop(), [line for line in logs.splitlines() if "RESULT " in line]
    assert len(results) == 2 and all(digest in line and '"finite": false' not in line
                                     for line in results), results  # fmt: skip

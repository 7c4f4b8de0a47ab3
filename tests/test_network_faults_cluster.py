"""A node's link cut mid-training, its processes alive, on the real cluster (each node a host of
its own, scripts/slurm-cluster): `ip link set eth1 down` in the node's namespace. The node cut
is the batch host: rank 0, the rendezvous, the batch shell and srun; another node's cut differs
only in what is left there (a rank whose failure once the link is back is not the next run's:
tests/supervisor/test_supervise.py), and took as long when tried (100 s; 96 s with that machine
killed instead, 104 s for the batch host's: Slurm's SlurmdTimeout either way).

Slurm notices after SlurmdTimeout (60 s here), marks the node DOWN and requeues the job, which
resumes from its checkpoint on other nodes, bitwise; the next run says which node Slurm lost.
The link then comes back while that run trains: the cut node returns to service, and what the
first run left there ends without touching the next one. Cut on the batch host (rank 0, the
rendezvous, the batch shell and srun), the supervisor fences its own run first
(`slurmddp.supervisor.fence`): without that, srun cancelled "step 0" of the job once its link
was back, the next run's step of the same id, and the recovered job failed.

Under torchrun with a spare node, another node cut off is replaced in place by the spare (the
agents' rendezvous goes on without it), and its return, its worker failing on the connection it
lost, changes nothing. Cut off for good, with no spare or under snapshots:
tests/test_elastic_cluster.py and tests/checkpoint/test_snapshots_cluster.py.

Each cluster's nodes have network namespaces of their own, so a cut is its cluster's alone: the
full run gives these tests (marked `faults`) a cluster of their own, beside the three versions'.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from benchmarks.cluster import job_processes
from slurmddp.preemption import slurm
from slurmddp.rank import hostlist
from slurmddp.supervisor import fence
from tests.conftest import EVERY_SLURM, ROOT, tagged_json, wait_until
from tests.preemption.test_preemption_cluster import Job, train_args

pytestmark = pytest.mark.cluster


def node_state(cluster, node: str) -> str:
    return cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.split()[0]


@EVERY_SLURM
def test_the_fence_finds_the_controller_and_its_route_on_every_version(slurm_cluster):
    config = slurm_cluster.run(["scontrol", "show", "config"]).stdout
    where = fence.controller(config)
    assert where is not None and where.slurmd_timeout_s == 60, config
    assert fence.addresses(where) == (slurm_cluster.host_addr,), where
    inside = slurm_cluster.run([*slurm_cluster.on_node("n2"), "python3", "-c",
                                "import socket; s = socket.socket(socket.AF_INET, "
                                f"socket.SOCK_DGRAM); s.connect(('{slurm_cluster.host_addr}', 9)); "
                                "print(s.getsockname()[0])"])  # fmt: skip
    # n2's route to it: its eth1
    assert inside.stdout.strip() == slurm_cluster.address("n2"), inside.stderr
    states = slurm.show_nodes("n[1-2]")  # what the next run reads of a lost node
    assert sorted(states) == ["n1", "n2"] and all(re.fullmatch(r"[A-Z_+]+", s)
                                                  for s in states.values()), states  # fmt: skip


# The fence and the next run's words are slurmddp's; what Slurm does to a node that stops
# answering is the dead slurmd's test's. `faults`: the full run gives these a cluster of their own
# (22.05's Slurm, a network of its own) and a chain beside the others, as they mostly wait on
# Slurm's SlurmdTimeout (docs/developers/testing.md). Under torchrun with a
# spare, the batch host also holds the agents' c10d rendezvous: the other agents wait on it,
# silent, with no bound, and Slurm keeps the --no-kill job without its script; another node's
# agent, whose watcher found the rendezvous silent, requeues it once Slurm marks the host lost
# (slurmddp.launch.stranded).
TORCHRUN_SPARE = ["--launcher", "torchrun", "--spare-nodes", "1", "--max-restarts", "3"]


@pytest.mark.faults
@pytest.mark.parametrize("launcher", [[], TORCHRUN_SPARE], ids=["srun", "torchrun-spare"])
def test_a_batch_host_cut_off_mid_training_is_fenced_named_and_the_job_resumes_bitwise(
        slurm_cluster, tmp_path, reference_digest_2x1, launcher):  # fmt: skip
    from tests.test_elastic_cluster import node_logs

    # Run 1's steps take longer (half a minute for the 240 left), so that the link comes back
    # while it trains.
    job = Job(slurm_cluster, tmp_path, [
        *launcher, *train_args(tmp_path / "ckpt", steps=300, step_time=0.1, per_node=1),
        "--save-every", "20", "--requeued-step-time", "0.15"])  # fmt: skip

    def log() -> str:  # rank 0's, tagged "[0/2] " by torchrun
        return "".join(node_logs(job).values()) if launcher else job.log()

    def logged(pattern: str, timeout: float) -> None:
        wait_until(lambda: re.search(pattern, log()), timeout,
                   lambda: f"{pattern!r} in job {job.id}:\n{job.batch_log}\n{log()}")  # fmt: skip

    logged(r"step 60 ", 180)
    nodes = hostlist.expand(job.fields()["NodeList"])
    lost = nodes[0]
    with slurm_cluster.link_cut(lost):
        start = time.time()
        job.wait_requeued(1, timeout=150)
        logged(r"resumed from \S+ at step \d+[^\n]*\n(\[\d+/\d+\] )?step \d+ ", 120)
        back = time.time() - start
        # Still cut, until the fence (half again SlurmdTimeout) has ended run 0's step on it.
        wait_until(lambda: "(fenced)" in job.batch_log, 90, lambda: f"the fence:\n{job.batch_log}")
    assert "step 300 " not in log(), "run 1 ended before the link came back: the test proves less"
    print(f"{lost}'s link cut -> training again on the other nodes: {back:.1f} s")
    # The link back while run 1 trains. Run 0's processes there end (their peers are gone), and
    # its step daemon reports the end of run 0's step 0, which Slurm 24.11 took for run 1's step 0
    # and cancelled it (under torchrun, requeued by an agent), but for the empty step run 1 ran
    # first (slurmddp.supervisor.supervise). Slurm
    # takes a DOWN node back once its slurmd registers again (ReturnToService=2): a batch host's
    # does so at once, telling of its batch script; another node's only when slurmctld asks, which
    # can take minutes. An operator's RESUME, as after any repair: it answers.
    wait_until(lambda: not job_processes(job.id, lost, slurm_cluster.slurm_conf), 120,
               lambda: f"run 0's processes on {lost} to end")  # fmt: skip
    slurm_cluster.run(["scontrol", "update", f"NodeName={lost}", "State=RESUME"])
    wait_until(lambda: node_state(slurm_cluster, lost) in ("idle", "mixed", "allocated"), 60,
               lambda: f"{lost} back in service: {node_state(slurm_cluster, lost)}")  # fmt: skip
    end = job.wait_end()
    batch = job.batch_log
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", batch
    second = re.findall(r"^slurmddp: job \d+ \(restart 1\) on (\S+)$", batch, re.M)
    assert second and lost not in hostlist.expand(second[0]), batch
    by = r"the agent on n\d" if launcher else "Slurm"
    assert re.search(rf"^slurmddp: run 1 on {re.escape(hostlist.compress(nodes))} ended without a "
                     rf"decision: Slurm lost {lost} \(not responding: the machine, its slurmd or "
                     rf"its link\); requeued by {by}$", batch, re.M), batch
    assert re.search(rf"^slurmddp: {lost} has had no route to slurmctld \(\S+\) for (9\d|1\d\d) s, "
                     r"over its SlurmdTimeout \(60 s\): .* \(fenced\)$", batch, re.M), batch
    assert "Terminating StepId" not in batch, batch  # no srun of run 0 ended run 1's step
    assert f"slurmddp: {lost} may report the end of run 1's step once back" in batch, batch
    told = [json.loads(line) for line in (job.folder / job.id / "events.jsonl").open()]
    decisions = [(e["run"], e["cause"]) for e in told if e["kind"] == "decision"]
    assert decisions == [(0, f"node lost: {lost}"), (1, "finished")], decisions
    if launcher:
        assert re.search(rf"agent \(host n\d\): the batch host {lost} is lost \(\S+\), and with "
                         r"it torchrun's rendezvous; .*: requeued", log()), log()
    results = tagged_json(log(), "RESULT ") if launcher else job.results()
    assert len(results) == 2 and {x["digest"] for x in results} == {reference_digest_2x1}, results
    assert {x["restart"] for x in results} == {1}


# torchrun's agents with a spare: a node cut off (not the first: its agent holds the c10d
# rendezvous) for less than SlurmdTimeout, so that Slurm never notices and the cut node's agent
# and worker, alive all along, come back to a rendezvous that went on without them.
@pytest.mark.faults
def test_a_node_cut_off_under_a_spare_is_replaced_in_place_and_its_return_changes_nothing(
        slurm_cluster, tmp_path, reference_digest_2x1):  # fmt: skip
    from tests.test_elastic_cluster import (  # its helpers; its module's marks stay there
        SPARE_ONE_2x1,
        assert_bitwise,
        node_logs,
        wait_logged,
        workers_on,
    )

    job = Job(slurm_cluster, tmp_path, [
        *SPARE_ONE_2x1, str(ROOT / "examples" / "resumable_train.py"), "--steps", "300",
        "--save-every", "20", "--step-time", "0.3", "--log-every", "10",
        "--checkpoint-dir", str(tmp_path / "ckpt")])  # fmt: skip
    wait_logged(job, "step 60 ", 180)
    nodes = hostlist.expand(job.fields()["NodeList"])
    lost = next(node for node in nodes[1:] if workers_on(job, node))
    with slurm_cluster.link_cut(lost):
        start = time.time()
        wait_logged(job, "resumed from ", 120)
        back = time.time() - start
        print(f"{lost}'s link cut -> training again in place, on the spare: {back:.1f} s")
        time.sleep(max(0.0, 40 - (time.time() - start)))  # under SlurmdTimeout (60 s)
    steps_at_return = len(re.findall(r"step \d+ ", "".join(node_logs(job).values())))
    end = job.wait_end(timeout=300)
    logs = "".join(node_logs(job).values())
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", job.batch_log + logs
    assert_bitwise(logs, reference_digest_2x1, ranks=2)
    # The cut node's return did not restart the workers again: one resume, the cut's.
    assert logs.count("resumed from ") == 1, logs
    assert len(re.findall(r"step \d+ ", logs)) > steps_at_return

"""Failures on the real local cluster (issue 7): what breaks, how fast the job ends, what it says.

| case                   | done to the job                        | expected                       |
|------------------------|----------------------------------------|--------------------------------|
| rank raises, exits 3,  | rank 1 of 2x1 ranks, at step 20        | all stop, FAILED within 30 s;  |
| or is KILLed           |                                        | rank, node, error in the log   |
| a rank crashes between | rank 1 of a checkpointing training     | FAILED naming rank 1: no stop  |
| steps, under Slurm's   | raises; srun sends the others SIGTERM  | agreed, no checkpoint, no      |
| default signalling     | while they work outside a collective   | requeue                        |
| a rank never starts    | rank 1 sleeps before init (slurmddp.   | the others fail after 15 s:    |
|                        | init, or torch's), start-up timeout 15 | 1 of 2 joined, the timeout     |
| MASTER_PORT taken      | a socket holds it on the first node    | fails at once, names the port  |
| two jobs on one node   | both groups up at once on n4 (srun,    | different ports, both complete |
|                        | and torchrun's rendezvous)             |                                |
| slurmd killed          | kill -9 of n2's slurmd under two jobs  | requeued or NODE_FAIL as each  |
|                        | that checkpoint                        | asks; latest checkpoint loads  |
| slurmctld down         | submit and status, then it comes back  | one line, non-zero, nothing    |
|                        |                                        | queued; then submit works      |
| a broken node          | every rank on rank 2's node dies of    | requeued without that node, it |
|                        | SIGBUS, in every run                   | completes; status says so      |
| its preflight fails    | python dies of SIGBUS on the second    | requeued without it before any |
|                        | node (--preflight)                     | training; it completes         |

The jobs of one row run at once. Times are the issue's behaviour bounds, not benchmarks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmddp.rank import hostlist
from tests.batch.transport.test_submit_cluster import slurmddp, submitted
from tests.conftest import (
    CLUSTER_SCRIPT,
    ELSEWHERE_SLURM,
    EVERY_SLURM,
    ROOT,
    SLURM_VERSION,
    launcher_free_env,
    tagged_json,
    wait_until,
)

pytestmark = pytest.mark.cluster

PROGRAM = str(ROOT / "tests" / "programs" / "failing_rank.py")
CRASH_ONCE = str(ROOT / "tests" / "programs" / "crash_once.py")
TRAIN = str(ROOT / "examples" / "resumable_train.py")
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
BOUND_S = 30  # "the job ends within 30 s"


# -- helpers ---------------------------------------------------------------------------------


def submit(cluster, tmp_path: Path, *argv: str) -> dict:
    r = slurmddp(cluster, "submit", "--json", *argv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    return submitted(r)


def accounting(cluster, job_id: str) -> dict[str, str]:
    """sacct's line for the job's latest run: State, ExitCode, End (epoch seconds or "")."""
    out = cluster.run(["sacct", "-X", "-n", "-P", "-o", "State,ExitCode,End", "-j", job_id])
    lines = out.stdout.strip().splitlines()
    if not lines:
        return {}
    state, code, end = lines[-1].split("|")
    when = "" if end in ("", "Unknown") else str(datetime.datetime.fromisoformat(end).timestamp())
    return {"State": state.split()[0], "ExitCode": code, "End": when}


def finished(cluster, job_id: str, timeout: float = 180) -> dict[str, str]:
    return wait_until(lambda: (a := accounting(cluster, job_id)).get("State") in FINAL and a,
                    timeout, f"job {job_id} to end")  # fmt: skip


def ended_at(job: dict, end: dict[str, str]) -> float:
    """When the job ended: sacct's End has whole seconds; the batch shell's last line is finer."""
    batch = Path(job["job_dir"]) / f"{job['job_id']}.batch.log"
    return max(float(end["End"]), batch.stat().st_mtime)


def logs(job: dict) -> tuple[str, dict[int, str]]:
    """(the batch log, {rank: its log})."""
    folder = Path(job["job_dir"])
    ranks = {int(p.stem.split("-")[1]): p.read_text(errors="replace")
             for p in (folder / job["job_id"]).glob("rank-*.log")}  # fmt: skip
    return (folder / f"{job['job_id']}.batch.log").read_text(errors="replace"), ranks


def events(rank_logs: dict[int, str], name: str) -> list[dict]:
    return [e for text in rank_logs.values() for e in tagged_json(text, "EVENT ")
            if e["event"] == name]  # fmt: skip


# -- a rank fails mid-training -----------------------------------------------------------------

# case: (FAIL_MODE, what the batch log must say, given the failing rank's host)
RANK_FAILURES = {
    "raise": ("raise", "the first failure a rank reported: rank 1 (host {host}) failed: "
                       "RuntimeError: boom at step 20"),
    "exit": ("exit", "the first failure a rank reported: rank 1 (host {host}) exited with "
                     "status 3"),
    "sigkill": ("kill", "the first to end, as srun saw it: task 1 on {host} (Killed)"),
}  # fmt: skip
# How srun ends the other ranks (26.05: SIGCONT, TERM, then KILL) and its own words for a task's
# death are Slurm's: the SIGKILL case on every version. A raise and an exit status differ in what
# slurmddp reports (its own logic, the same on every Slurm): on 22.05. Two ranks a node are not the
# claim here (srun ends a node's other task as any other; the crash test below, 2 x 2 on every
# version, has a survivor beside the crashed rank): one rank a node.
CASE_SLURM = {"sigkill": [EVERY_SLURM]}


@pytest.fixture(scope="module")
def failure_jobs(slurm_cluster, tmp_path_factory, request) -> dict[str, dict]:
    """The cases of RANK_FAILURES this session runs, submitted at once (2 nodes x 1 rank each)."""
    tmp = tmp_path_factory.mktemp("rank-failures")
    test = "test_a_failing_rank_ends_the_job_within_30_s_and_is_named"
    cases = {item.callspec.params["case"] for item in request.session.items
             if getattr(item, "originalname", None) == test}  # fmt: skip
    return {case: submit(slurm_cluster, tmp, "--nodes", "2", "--ntasks-per-node", "1",
                         "--job-name", f"fail-{case}", "--env", f"FAIL_MODE={mode}",
                         "--env", "FAIL_RANK=1", PROGRAM)
            for case, (mode, _) in RANK_FAILURES.items() if case in cases}  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, marks=CASE_SLURM.get(c, []))
                                  for c in RANK_FAILURES])  # fmt: skip
def test_a_failing_rank_ends_the_job_within_30_s_and_is_named(slurm_cluster, failure_jobs, case):
    job = failure_jobs[case]
    end = finished(slurm_cluster, job["job_id"])
    batch, ranks = logs(job)
    assert end["State"] == "FAILED" and end["ExitCode"] != "0:0", (end, batch)
    (failing,) = events(ranks, "failing")
    took = ended_at(job, end) - failing["time"]
    print(f"{case}: job {job['job_id']} ended {took:.1f} s after rank 1 failed")
    assert took < BOUND_S, batch
    assert not events(ranks, "done"), "a rank went on after the failure"
    assert RANK_FAILURES[case][1].format(host=failing["host"]) in batch, batch
    if case == "raise":  # the rank's own log: the line, then the traceback
        assert "slurmddp: rank 1 (host" in ranks[1] and "Traceback" in ranks[1], ranks[1]


@EVERY_SLURM
def test_a_crash_under_slurms_default_signalling_is_a_failure_not_an_agreed_stop(
    slurm_cluster, tmp_path
):
    # srun --kill-on-bad-exit sends the surviving ranks SIGTERM, then SIGKILL after KillWait (seen
    # on 22.05, 24.11 and 26.05 alike; 26.05's changelog says the same of a task's PMI abort), and
    # under Slurm's default signalling a TERM is how preemption announces itself: the survivors,
    # in the 2 s of work of their step (outside any collective) when rank 1 raises in its own,
    # must not agree on a stop, save, or get the job requeued.
    with slurm_cluster.variant("default-signal"):
        job = submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", "2",
                     "--env", "CRASH_RANK=1", "--env", "CRASH_AT=3", "--env", "CRASH_IN=sleep",
                     "--env", "REPORT_TERM=1",
                     "--env", "OMP_NUM_THREADS=1", CRASH_ONCE, "--steps", "20", "--step-time",
                     "2", "--save-every", "1000", "--checkpoint-dir", str(tmp_path / "ckpt"))
        end = finished(slurm_cluster, job["job_id"])
    batch, ranks = logs(job)
    fields = job_fields(slurm_cluster, job["job_id"])
    assert (end["State"], fields.get("Restarts")) == ("FAILED", "0"), (end, fields, batch)
    assert "rank 1 (host" in batch and "RuntimeError: worker 1 crashes in sleep 3" in batch, batch
    assert "stopped" not in batch and "requeued" not in batch, batch
    assert not list((tmp_path / "ckpt").glob("step-*")), "a survivor saved a checkpoint"
    termed = sorted(r for r, text in ranks.items() if f"rank {r} got SIGTERM" in text)
    print(f"Slurm {slurm_cluster.version}: SIGTERM reached ranks {termed}")
    assert termed, ranks  # the case this test is for happened


# -- a rank never reaches the rendezvous ---------------------------------------------------------

STARTUP_TIMEOUT_S = 15
STARTUP = {"slurmddp.init": "slurmddp", "init_process_group": "torch"}


@pytest.fixture(scope="module")
def startup_jobs(slurm_cluster, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("startup")
    return {case: submit(slurm_cluster, tmp, "--nodes", "2", "--ntasks-per-node", "1",
                         "--job-name", f"startup-{init}", "--env", "FAIL_MODE=sleep",
                         "--env", "FAIL_RANK=1", "--env", f"INIT={init}", "--env",
                         f"SLURMDDP_STARTUP_TIMEOUT={STARTUP_TIMEOUT_S}", PROGRAM)
            for case, init in STARTUP.items()}  # fmt: skip


@pytest.mark.parametrize("case", STARTUP)
def test_a_rank_that_never_joins_fails_the_others_after_the_startup_timeout(
    slurm_cluster, startup_jobs, case
):
    job = startup_jobs[case]
    end = finished(slurm_cluster, job["job_id"])
    batch, ranks = logs(job)
    assert end["State"] == "FAILED", (end, batch)
    # Each rank counts from its own arrival: the first to arrive gives up first.
    arrived = min(e["time"] for e in events(ranks, "arrived"))
    waited = ended_at(job, end) - arrived
    print(f"{case}: job {job['job_id']} ended {waited:.1f} s after the first rank arrived")
    # It waited its timeout, not the default's 300 s: the upper margin is for the machine's load.
    assert STARTUP_TIMEOUT_S - 1 <= waited < STARTUP_TIMEOUT_S + 120, batch
    assert "failed: StartupError: only 1 of 2 ranks joined the rendezvous at " in batch, batch
    assert f" within {STARTUP_TIMEOUT_S} s (SLURMDDP_STARTUP_TIMEOUT); " in batch, batch
    # Rank 0 alone asks the store who is missing (from every rank it would be N² requests).
    assert "; missing: rank 1. " in ranks[0], ranks[0]


# -- the master port -----------------------------------------------------------------------------


# Binds the port given (0: any), says which, and holds it until its stdin closes.
SQUAT = ("import socket, sys; s = socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); "
         "s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()")


@contextlib.contextmanager
def squatting(cluster) -> Iterator[int]:
    """One port held on every node (each a host of its own), by a process outside any job."""
    held: list[subprocess.Popen] = []
    try:
        port = 0
        for node in ("n1", "n2", "n3", "n4"):
            held.append(subprocess.Popen([*cluster.on_node(node), sys.executable, "-c", SQUAT,
                                          str(port)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True))  # fmt: skip
            port = int(held[-1].stdout.readline())  # type: ignore[union-attr]
        yield port
    finally:
        for p in held:
            p.communicate(timeout=30)


def test_a_taken_master_port_fails_at_once_naming_the_port(slurm_cluster, tmp_path):
    with squatting(slurm_cluster) as port:
        job = submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", "1",
                     "--env", f"MASTER_PORT={port}", PROGRAM)  # fmt: skip
        end = finished(slurm_cluster, job["job_id"])
    batch, ranks = logs(job)
    assert end["State"] == "FAILED", (end, batch)
    took = ended_at(job, end) - max(e["time"] for e in events(ranks, "arrived"))
    print(f"port taken: job {job['job_id']} ended {took:.1f} s after the ranks arrived")
    assert took < BOUND_S, batch
    host = next(e["host"] for e in events(ranks, "arrived") if e["rank"] == 0)
    assert (f"rank 0 (host {host}) failed: StartupError: rank 0 cannot open the rendezvous: "
            f"port {port} (MASTER_PORT) on {host} is already in use") in batch, batch  # fmt: skip


def test_two_jobs_sharing_a_node_get_different_ports(slurm_cluster, tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir()
    jobs = [submit(slurm_cluster, tmp_path, "--nodes", "1", "--ntasks-per-node", "2",
                   "--sbatch-arg=--nodelist=n4", "--env", f"MEET_DIR={meet}",
                   "--env", "MEET_COUNT=2", PROGRAM) for _ in range(2)]  # fmt: skip
    for job in jobs:
        end = finished(slurm_cluster, job["job_id"])
        assert end["State"] == "COMPLETED", (end, logs(job)[0])
    ports = {j["job_id"]: events(logs(j)[1], "arrived")[0]["port"] for j in jobs}
    assert len(set(ports.values())) == 2, ports
    # Both process groups were up at once on n4: each rank 0 waited for the other job's.
    assert sorted(p.name for p in meet.iterdir()) == sorted(ports), ports


def test_two_torchrun_jobs_sharing_their_first_node_rendezvous_apart(slurm_cluster, tmp_path):
    # torchrun's rendezvous port was fixed: the second job's agent joined the first job's store
    # and failed when that job ended. It is now derived from the job, as MASTER_PORT is.
    meet = tmp_path / "meet"
    meet.mkdir()
    jobs = [submit(slurm_cluster, tmp_path, "--launcher", "torchrun", "--nodes", "1",
                   "--ntasks-per-node", "2", "--sbatch-arg=--nodelist=n4", "--env",
                   f"MEET_DIR={meet}", "--env", "MEET_COUNT=2", PROGRAM)
            for _ in range(2)]  # fmt: skip
    ports = {}
    for job in jobs:
        end = finished(slurm_cluster, job["job_id"])
        node_log = (Path(job["job_dir"]) / job["job_id"] / "node-0.log").read_text()
        assert end["State"] == "COMPLETED", (end, node_log)
        ports[job["job_id"]] = {e["port"] for e in tagged_json(node_log, "EVENT ")
                                if e["event"] == "arrived"}  # fmt: skip
    assert all(len(p) == 1 for p in ports.values()) and len(set.union(*ports.values())) == 2
    assert sorted(p.name for p in meet.iterdir()) == sorted(ports)  # both up at once on n4


# -- a slurmd dies -------------------------------------------------------------------------------


def slurmd_pid(cluster, node: str) -> int:
    return int((cluster.state_dir / "run" / f"slurmd-{node}.pid").read_text().strip())


def node_state(cluster, node: str) -> str:
    return cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.split()[0]


def job_fields(cluster, job_id: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(x.split("=", 1) for x in out.split() if "=" in x)


def latest_checkpoint(directory: Path) -> int | None:
    """The step `load_latest` loads from `directory`, in a fresh process (a world of one): another
    run than the job's, so it asks for the job's checkpoints by their path."""
    code = ("import sys, slurmddp; c = slurmddp.Checkpointer(sys.argv[1], resume_from=sys.argv[1])"
            ".load_latest(); print(c.step if c else -1)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True,
                       text=True, timeout=120, env=launcher_free_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    step = int(r.stdout.split()[-1])
    return None if step < 0 else step


def submit_without_requeue(cluster, tmp_path: Path, argv: list[str]) -> str:
    """A job whose spec says requeue=False (#SBATCH --no-requeue), through the Python API: the
    command line always asks for --requeue (--max-requeues caps only the stop protocol's)."""
    code = ("import sys; from slurmddp import build_spec, submit; "
            "a = sys.argv[1:]; i = a.index('--'); "
            "print(submit(build_spec(a[i + 1:], nodes=a[0], ntasks_per_node=int(a[1]), "
            "sbatch_args=a[2:i], requeue=False)).job_id)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60,
                       env=cluster.env(XDG_STATE_HOME=str(tmp_path / "state")))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[-1]


@ELSEWHERE_SLURM
def test_a_dead_slurmd_requeues_or_ends_each_job_as_asked_and_the_checkpoint_survives(
    slurm_cluster, tmp_path
):
    ckpt = {"requeue": tmp_path / "ckpt-requeue", "no-requeue": tmp_path / "ckpt-no-requeue"}
    train = [TRAIN, "--steps", "5000", "--step-time", "0.05", "--save-every", "20",
             "--checkpoint-dir"]  # fmt: skip
    # Both on n1 (the batch host) and n2, one rank each: n2's slurmd dies under both.
    jobs = {
        "requeue": submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", "1",
                          "--sbatch-arg=--nodelist=n1,n2", *train, str(ckpt["requeue"]))["job_id"],
        "no-requeue": submit_without_requeue(slurm_cluster, tmp_path, [
            "2", "1", "--nodelist=n1,n2", "--", *train, str(ckpt["no-requeue"])]),
    }  # fmt: skip
    wait_until(lambda: all((d / "latest").exists() for d in ckpt.values()), 120,
             "a first checkpoint of both jobs")  # fmt: skip
    os.kill(slurmd_pid(slurm_cluster, "n2"), 9)
    killed = time.time()
    try:
        # Slurm notices after SlurmdTimeout (60 s): n2 goes DOWN, both jobs fail with it, and
        # the one that may be requeued is, at the same moment.
        requeued = wait_until(
            lambda: (f := job_fields(slurm_cluster, jobs["requeue"])).get("Restarts") == "1"
            and f.get("JobState") == "PENDING" and f, 150, "the requeue")  # fmt: skip
        print(f"slurmd killed: the job requeued {time.time() - killed:.0f} s later")
        ended = wait_until(lambda: (f := job_fields(slurm_cluster, jobs["no-requeue"]))
                         .get("JobState") not in ("RUNNING", "COMPLETING") and f, 30,
                         "the other job to end")  # fmt: skip
        assert (ended["JobState"], ended["Restarts"]) == ("NODE_FAIL", "0"), ended
        assert requeued["Requeue"] == "1" and ended["Requeue"] == "0"
        slurm_cluster.run(["scancel", jobs["requeue"]])  # resuming is the preemption tests' part
        for directory in ckpt.values():
            step = latest_checkpoint(directory)
            assert step is not None and step >= 20, directory
    finally:
        up = subprocess.run([str(CLUSTER_SCRIPT), "up"], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
    assert node_state(slurm_cluster, "n2") in ("idle", "mixed", "allocated"), "n2 not back"


# -- slurmctld is down ---------------------------------------------------------------------------


@ELSEWHERE_SLURM
def test_with_slurmctld_down_submit_and_status_say_so_in_one_line(slurm_cluster, tmp_path):
    job = submit(slurm_cluster, tmp_path, "--env", "FAIL_MODE=none", PROGRAM)
    assert finished(slurm_cluster, job["job_id"])["State"] == "COMPLETED"
    jobs_before = (tmp_path / "state" / "slurmddp" / "jobs.jsonl").read_text()
    control = [str(CLUSTER_SCRIPT), "stop-controller"]
    assert subprocess.run(control, capture_output=True, timeout=120).returncode == 0
    try:
        sub = slurmddp(slurm_cluster, "submit", PROGRAM, cwd=tmp_path)
        status = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path)
    finally:
        control[-1] = "start-controller"
        started = subprocess.run(control, capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
    for r in (sub, status):
        assert r.returncode == 1, r.stdout + r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert "cannot reach the Slurm controller (slurmctld): " in r.stderr, r.stderr
        assert "check `scontrol ping` and try again" in r.stderr, r.stderr
    assert "nothing was submitted" in sub.stderr
    assert (tmp_path / "state" / "slurmddp" / "jobs.jsonl").read_text() == jobs_before
    assert f"{job['job_id']}  COMPLETED" in status.stdout  # accounting's answer, marked stale
    again = submit(slurm_cluster, tmp_path, "--env", "FAIL_MODE=none", PROGRAM)
    assert finished(slurm_cluster, again["job_id"])["State"] == "COMPLETED"


# -- a broken node is left behind ----------------------------------------------------------------


def runs(batch: str) -> list[list[str]]:
    """The nodes of each run, from the batch shell's first line of each."""
    return [hostlist.expand(nodes) for nodes in re.findall(r"^slurmddp: job \d+ \(restart \d+\) "
                                                            r"on (\S+)$", batch, re.M)]


def left_behind(cluster, job: dict, node: str, batch: str, cwd: Path) -> None:
    """The requeued run did not land on `node`, and `slurmddp status` says why."""
    assert [node in nodes for nodes in runs(batch)] == [True, False], batch
    r = slurmddp(cluster, "status", job["job_id"], cwd=cwd)
    assert f"left behind {node}: " in r.stdout, r.stdout + r.stderr


@EVERY_SLURM
def test_a_rank_on_a_broken_node_gets_the_job_requeued_without_it(slurm_cluster, tmp_path):
    # What a version may change (the requeue, ExcNodeList) does not depend on the ranks a node
    # holds: one rank a node on 24.11 and 26.05; on 22.05 two, both dying of the node's fault.
    per_node = 2 if SLURM_VERSION == "22.05" else 1
    broken = tmp_path / "broken"
    job = submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", str(per_node),
                 "--job-name", "broken-node", "--env", "FAIL_MODE=bus", "--env",
                 f"FAIL_RANK={per_node}", "--env", f"BROKEN_FILE={broken}", PROGRAM)  # fmt: skip
    end = finished(slurm_cluster, job["job_id"], timeout=240)
    batch, ranks = logs(job)
    node = broken.read_text()
    assert end["State"] == "COMPLETED", batch
    assert f"on {node} (Bus error)" in batch, batch  # srun's first failure, as the summary says
    assert (f"failed at restart 0 because of node {node} (task" in batch
            and f"requeued without it (1 of 3); the job now excludes {node}" in batch), batch
    left_behind(slurm_cluster, job, node, batch, tmp_path)
    assert len(events(ranks, "done")) == 2 * per_node  # the second run, every rank


PYTHON_BREAKING_ON_A_NODE = """#!/bin/bash
# A python that dies of SIGBUS on one node, as a broken node's would: the second node of the first
# run (named in $BROKEN_FILE), in that run and every later one. The batch shell's own python (the
# decision) stays whole: only ranks (python -m slurmddp.run) break.
if [[ " $* " == *" slurmddp.run "* ]]; then
    if [[ ! -e $BROKEN_FILE && $SLURM_NODEID == 1 ]]; then
        printf %s "$SLURMD_NODENAME" >"$BROKEN_FILE"
    fi
    if [[ -e $BROKEN_FILE && $(<"$BROKEN_FILE") == "$SLURMD_NODENAME" ]]; then kill -BUS $$; fi
fi
exec {python} "$@"
"""


def test_the_preflight_names_a_master_no_other_node_reaches_in_seconds(slurm_cluster, tmp_path):
    # n1-mgmt names n1's first interface, which no other node reaches; the start-up timeout,
    # raised far above the bound, cannot be what ends it.
    t0 = time.time()
    job = submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", "1", "--preflight",
                 "--env", "SLURMDDP_MASTER_HOST_FORMAT={host}-mgmt", "--env",
                 "SLURMDDP_STARTUP_TIMEOUT=900", PROGRAM)  # fmt: skip
    end = finished(slurm_cluster, job["job_id"])
    batch, ranks = logs(job)
    assert end["State"] == "FAILED", batch
    assert ("slurmddp: the first failure a rank reported: rank 1 (host n2) failed: StartupError: "
            f"rank 1 (n2) cannot reach MASTER_ADDR n1-mgmt ({slurm_cluster.address('n1-mgmt')}): "
            "no route to it.") in batch
    assert "the preflight failed" in batch and not ranks, batch  # no training step started
    assert ended_at(job, end) - t0 < 120, batch  # seconds: not the 900 s start-up timeout


def test_a_node_that_fails_the_preflight_is_left_behind_before_any_training(slurm_cluster,
                                                                            tmp_path):
    broken, wrapper = tmp_path / "broken", tmp_path / "python"
    wrapper.write_text(PYTHON_BREAKING_ON_A_NODE.format(python=sys.executable))
    wrapper.chmod(0o755)
    job = submit(slurm_cluster, tmp_path, "--nodes", "2", "--ntasks-per-node", "1", "--job-name",
                 "preflight", "--preflight", "--python", str(wrapper), "--env",
                 f"BROKEN_FILE={broken}", PROGRAM)  # fmt: skip
    end = finished(slurm_cluster, job["job_id"], timeout=240)
    batch, ranks = logs(job)
    node = broken.read_text()
    assert end["State"] == "COMPLETED", batch
    assert ("the preflight failed with status" in batch and f"on {node} (Bus error)" in batch
            and f"failed its preflight at restart 0 because of node {node}" in batch), batch
    assert batch.count("slurmddp: preflight passed") == 1, batch  # the second run's
    left_behind(slurm_cluster, job, node, batch, tmp_path)
    # No training in the first run: each rank arrived once, in the second.
    assert len(events(ranks, "arrived")) == len(events(ranks, "done")) == 2, ranks

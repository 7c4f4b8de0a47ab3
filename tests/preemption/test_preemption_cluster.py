"""Preemption, time limits and requeue on the real local cluster, checked bit for bit.

Jobs run on `debug`; exclusive jobs on `urgent` (a higher PriorityTier) preempt them. How Slurm
signals that depends on its configuration: the tests switch the cluster to each variant centres
run (`Cluster.variant`, docs/slurm-behaviour.md) and back. A requeued job may start again only
once its old credential expires (cred_expire on this cluster). Moving its StartTime to now does
not help: slurmctld starts it and kills it at once ("Job credential revoked"), FAILED.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from slurmddp.preemption import decision
from tests.batch.transport.test_submit_cluster import slurmddp, submitted
from tests.conftest import ELSEWHERE_SLURM, EVERY_SLURM, ROOT, tagged_json, wait_until

pytestmark = pytest.mark.cluster

TRAIN = str(ROOT / "examples" / "resumable_train.py")
LATE = str(ROOT / "tests" / "programs" / "late_signal.py")
# The preemptor: a job on the higher-tier partition that needs every node.
URGENT = ["sbatch", "-p", "urgent", "--exclusive", "-N4", "-o", "/dev/null", "--wrap", "sleep 2"]


def job_fields(cluster, job_id: str) -> dict[str, str]:
    """scontrol's view of the job (kept MinJobAge=60 s after the end), {} once forgotten."""
    r = cluster.run(["scontrol", "show", "job", "-o", job_id])
    return decision.job_fields(r.stdout) if r.returncode == 0 else {}


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class Job:
    """A job submitted with `slurmddp submit --json`, watched through its logs and scontrol."""

    def __init__(self, cluster, tmp_path: Path, argv: list[str]) -> None:
        self.cluster = cluster
        r = slurmddp(cluster, "submit", "--json", "--partition", "debug", *argv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        info = submitted(r)
        self.id = info["job_id"]
        self.folder = Path(info["job_dir"])

    def log(self, rank: int = 0) -> str:
        ranks = self.folder / self.id / "ranks.log"  # under mpirun: every rank, tagged
        return read(ranks if ranks.exists() else self.folder / self.id / f"rank-{rank}.log")

    @property
    def batch_log(self) -> str:
        return read(self.folder / f"{self.id}.batch.log")

    def fields(self) -> dict[str, str]:
        return job_fields(self.cluster, self.id)

    def wait_for_log(self, pattern: str, timeout: float = 120) -> re.Match:
        return wait_until(lambda: re.search(pattern, self.log()), timeout,
                          lambda: f"{pattern!r} in rank 0's log of {self.id}:\n{self.log()}")

    def preempt(self) -> None:
        """Start an exclusive job on urgent over all four nodes; wait until ours was requeued."""
        restarts = int(self.fields()["Restarts"])
        r = self.cluster.run([URGENT[0], "--parsable", *URGENT[1:]])
        assert r.returncode == 0, r.stderr
        self.wait_requeued(restarts + 1)

    def wait_requeued(self, restarts: int, timeout: float = 120) -> None:
        wait_until(lambda: int(self.fields().get("Restarts", -1)) >= restarts, timeout,
                   lambda: f"restart {restarts} of job {self.id}:\n{self.batch_log}")

    def wait_end(self, timeout: float = 300) -> dict[str, str]:
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        return wait_until(lambda: (f := self.fields()).get("JobState") in final and f, timeout,
                          lambda: f"the end of job {self.id}:\n{self.batch_log}")

    def results(self) -> list[dict]:
        if (self.folder / self.id / "ranks.log").exists():
            return tagged_json(self.log(), "RESULT ")
        return [x for rank in range(4) for x in tagged_json(self.log(rank), "RESULT ")]


def train_args(ckpt: Path, steps: int, step_time: float, per_node: int = 2) -> list[str]:
    """examples/resumable_train.py on 2 nodes x `per_node` ranks: 2 where a claim needs two ranks
    on a node (the reference_digest fixture's shape), 1 elsewhere (reference_digest_2x1's)."""
    return [
        "--nodes", "2", "--ntasks-per-node", str(per_node), "--env", "OMP_NUM_THREADS=1", TRAIN,
        "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--step-time", str(step_time),
        "--log-every", "10",
    ]  # fmt: skip


# Every configuration variant of the local cluster (scripts/slurm-cluster variant), and the line
# the batch log gives for each of the two stops there.
VARIANTS = {
    "standard": r"job \d+ stopped \(preempted, USR2\) at restart {r} after its checkpoint: "
                r"requeued \({n} of 3\)",
    "default-signal": r"stopped \(preempted, TERM\) at restart {r} after its checkpoint: "
                      r"requeued \({n} of 3\)",
    "cancel": r"stopped \(preempted, USR2\) at restart {r} after its checkpoint: requeued",
    "cancel-default-signal": r"stopped \(preempted, TERM\) at restart {r} after its checkpoint: "
                             r"requeued",
    "grace0": r"job \d+ was requeued by Slurm itself \(TERM after restart {r}\)",
    "grace0-cancel": r"stopped \(preempted, TERM\) at restart {r} after its checkpoint: "
                     r"requeued \({n} of 3\)",
}  # fmt: skip


# Free text that reads like the fields the batch shell decides on, in the job's name and comment
# (and so, from Slurm 25.11, in the SubmitLine `scontrol show job` adds): they must not count.
DECOYS = "Requeue=0 Restarts=9 JobState=COMPLETED"


# Our cluster's signalling is preempted twice on every version (scripts/test): a resumed run is
# preempted again as the first was. Slurm's default signalling, on every version too, once: how
# its TERM reaches each task of a node is the first stop's, and a resumed run's second stop goes
# the way [standard]'s does (the batch shell's count, the resume from the second checkpoint).
# The other variants change how the first stop comes (who signals, whether Slurm cancels or
# requeues): preempted once, on 26.05,
# which the passes' shares of the work put them on (22.05 ran them before: slurmddp's logic, the
# same on both). Not on 24.11: there a job preempted under PreemptMode=CANCEL, requeued by its
# batch shell and run to the end (exit 0) ends PREEMPTED, not COMPLETED (seen 2026-12-06, sacct
# and scontrol alike; docs/behaviour/versions.md).
TWICE = ("standard",)
EVERY = ("standard", "default-signal")
ONCE_ON = pytest.mark.slurm("26.05")
# Two ranks a node where the claim is how the signal reaches each task of a node: Slurm's TERM to
# every task (default-signal, on every version). The user signal's way (the batch shell, then
# srun, to every task of a node) has its two-a-node witness on every version in the time-limit
# test (the same B:USR2 to the batch shell), and under mpirun in the mpirun test; the other
# variants differ in who signals and who requeues, not in a node's tasks: one rank a node.
TWO_A_NODE = ("default-signal",)
# DataLoader worker processes through a preemption, each start method under each signal once
# (test_signals.py runs all combinations locally): Slurm signals every process of the step, the
# USR2 srun passes on (cancel) or Slurm's TERM (cancel-default-signal); workers that died of it
# would fail every rank. The same ways as standard's and default-signal's, on 26.05 as those are.
WORKERS = {"cancel": "spawn", "cancel-default-signal": "forkserver"}


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=[EVERY_SLURM if v in EVERY else ONCE_ON]) for v in VARIANTS])  # fmt: skip
def test_preempted_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path, variant, request):
    times = 2 if variant in TWICE else 1
    per_node = 2 if variant in TWO_A_NODE else 1
    reference_digest = request.getfixturevalue(
        "reference_digest" if per_node == 2 else "reference_digest_2x1")
    workers = ["--workers", "1", "--worker-start", WORKERS[variant]] if variant in WORKERS else []
    with slurm_cluster.variant(variant):
        job = Job(slurm_cluster, tmp_path, ["--job-name", f"resumable {DECOYS}", "--sbatch-arg",
                                            f"--comment=c {DECOYS}",
                                            *train_args(tmp_path / "ckpt", steps=300,
                                                        step_time=0.03, per_node=per_node),
                                            *workers])  # fmt: skip
        job.wait_for_log(r"step 60 ")
        job.preempt()
        if times == 2:
            job.wait_for_log(r"resumed from \S+ at step \d+")
            job.wait_for_log(r"step 1[2-9]0 |step 2\d0 ")
            job.preempt()
        end = job.wait_end()

    log = job.log()
    print(f"{variant}: uninterrupted: {reference_digest}\npreempted x{times}:  "
          f"{ {x['digest'] for x in job.results()} }")  # fmt: skip
    assert end["JobState"] == "COMPLETED", job.batch_log
    if int(end["Restarts"]) == times + 1 and slurm_cluster.version == "24.11":
        # Slurm 24.11 may requeue once more a preempted job the batch shell requeued
        # (docs/behaviour/versions.md): that run finds the work done and ends before its step.
        assert job.batch_log.endswith("finished its work in an earlier run: not run again\n"), (
            job.batch_log)
    else:
        assert int(end["Restarts"]) == times, job.batch_log
    stops = [int(s) for s in re.findall(r"stopped at step (\d+)", log)]
    resumes = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert len(stops) == times and resumes == stops, log  # each run went on where the last stopped
    assert all(0 < s < 300 for s in stops)
    results = job.results()
    assert sorted(x["rank"] for x in results) == list(range(2 * per_node))
    assert {x["digest"] for x in results} == {reference_digest}
    assert {x["restart"] for x in results} == {times}
    if workers:  # no rank lost a DataLoader worker to the signal
        for rank in range(2 * per_node):
            assert "DataLoader worker" not in job.log(rank), job.log(rank)
    batch = job.batch_log
    for restart in range(times):
        assert re.search(VARIANTS[variant].format(r=restart, n=restart + 1), batch), batch
    assert f"(restart {times})" in batch and "never called slurmddp.should_stop()" not in batch


@EVERY_SLURM
def test_time_limit_checkpoints_requeues_and_completes(slurm_cluster, tmp_path,
                                                       reference_digest):  # fmt: skip
    # slurmctld sends the warning at its first time-limit sweep (every 30 s) from 30 s before the
    # lead (send_job_warn_signal, 22.05 to 26.05): with two minutes and a lead of 60 s, 30 to 60 s
    # into a run, and the ranks stop by themselves at 60 s. The first run's steps take a second
    # each, so it cannot finish its 300 whatever the machine's load; the resumed run's take no
    # extra time, and it ends before its own warning (had a loaded machine slowed it past that,
    # it would be requeued again: the test's claims hold either way).
    args = train_args(tmp_path / "ckpt", steps=300, step_time=0)
    job = Job(slurm_cluster, tmp_path, ["--time", "2", "--signal-lead", "60", "--max-requeues",
              "4", *args, "--fresh-step-time", "1"])  # fmt: skip
    job.wait_requeued(1, timeout=150)
    end = job.wait_end(timeout=420)
    assert end["JobState"] == "COMPLETED", job.batch_log
    assert "stopped (time limit, USR2) at restart 0" in job.batch_log
    assert {x["digest"] for x in job.results()} == {reference_digest}


def test_requeues_stop_at_the_limit_with_a_clear_message(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, ["--max-requeues", "1",
              *train_args(tmp_path / "ckpt", steps=1000, step_time=0.05, per_node=1)])  # fmt: skip
    job.wait_for_log(r"step 30 ")
    job.preempt()
    job.wait_for_log(r"resumed from[^\n]*\nstep \d+ ")
    restarts = int(job.fields()["Restarts"])
    slurm_cluster.run(URGENT)
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], int(end["Restarts"])) == ("FAILED", "75:0", restarts)
    assert ("at restart 1 after its checkpoint: not requeued, the limit of 1 requeues "
            "(--max-requeues) is reached; submit again to resume") in job.batch_log
    assert len(re.findall(r"stopped at step", job.log())) == 2  # the checkpoint was still taken


def test_a_finished_job_is_not_requeued_by_a_late_signal(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path, ["--nodes", "2", "--ntasks-per-node", "1", LATE,
                                        "--linger", "6"])  # fmt: skip
    job.wait_for_log("(?m)^DONE")  # after whatever torch logs first
    # Preempted while it finishes: the ranks ignore the signal, Slurm requeues the job anyway,
    # and the next run finds the done marker and ends at once.
    restarts = int(job.fields()["Restarts"])
    slurm_cluster.run(URGENT)
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED", job.batch_log
    assert "stopped (" not in job.batch_log and job.log().count("DONE") == 1
    if int(end["Restarts"]) > restarts:
        assert "finished its work in an earlier run: not run again" in job.batch_log


def test_scancel_cancels_and_is_never_requeued(slurm_cluster, tmp_path):
    # TERM stops the ranks like the stop signal does, but must not undo the user's cancel.
    job = Job(slurm_cluster, tmp_path, train_args(tmp_path / "ckpt", steps=100000, step_time=0.05,
                                                  per_node=1))  # fmt: skip
    job.wait_for_log(r"step 20 ")
    slurm_cluster.run(["scancel", job.id])
    end = job.wait_end()
    time.sleep(3)  # a requeue, had it happened, would show by now
    assert end["JobState"] == "CANCELLED", job.batch_log
    assert job.fields().get("Restarts", "0") == "0", job.batch_log
    assert "requeued (" not in job.batch_log


@pytest.mark.parametrize(("variant", "stop", "says"), [
    ("standard", ["scancel", "--signal=USR2"], "stopped (signal, USR2)"),  # every task, no shell
    ("default-signal", URGENT, "stopped (preempted, TERM)"),  # Slurm's TERM to every task
])  # fmt: skip
def test_without_our_batch_script_rank_0_requeues_the_job(slurm_cluster, tmp_path, python,
                                                          variant, stop, says,
                                                          reference_digest_2x1):  # fmt: skip
    # A batch script of the user's own: plain srun, no trap; rank 0 asks scontrol and decides.
    # (One rank a node: the ranks a node holds change nothing here.)
    script = tmp_path / "own.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -p debug -N2 --ntasks-per-node=1 --requeue\n"
        f"#SBATCH -o {tmp_path}/%j.out --open-mode=append\n"
        f"srun {python} -m slurmddp.run {TRAIN} --steps 300 --step-time 0.05 --log-every 10 "
        f"--checkpoint-dir {tmp_path}/ckpt\n"
    )
    with slurm_cluster.variant(variant):
        r = slurm_cluster.run(["sbatch", "--parsable", str(script)], cwd=tmp_path,
                              env=slurm_cluster.env(OMP_NUM_THREADS="1"))  # fmt: skip
        job_id = r.stdout.strip()
        out = tmp_path / f"{job_id}.out"
        wait_until(lambda: "step 30 " in read(out), 120, lambda: f"training:\n{read(out)}")
        slurm_cluster.run(stop + ([job_id] if stop[0] == "scancel" else []))
        wait_until(lambda: job_fields(slurm_cluster, job_id).get("JobState") == "COMPLETED", 300,
                   lambda: f"the end of job {job_id}:\n{read(out)}")  # fmt: skip
    text = read(out)
    assert f"job {job_id} {says} at restart 0 after its checkpoint: requeued (1 of 3)" in text, text
    assert re.search(r"resumed from \S+ at step \d+", text)
    assert job_fields(slurm_cluster, job_id)["Restarts"] == "1"
    assert {x["digest"] for x in tagged_json(text, "RESULT ")} == {reference_digest_2x1}


# Where the ranks learn the end: rank 0's scontrol on 22.05, SLURM_JOB_END_TIME from 23.02 on (24.11
# as 26.05, whose pass this is also in); Slurm's limit itself is the signalled test's, on all three.
@pytest.mark.slurm("22.05", "26.05")
def test_under_a_time_limit_without_a_signal_the_ranks_stop_in_time_by_themselves(
        slurm_cluster, tmp_path, python, reference_digest_2x1):  # fmt: skip
    # A site's batch script without --signal: nothing warns of the limit. The ranks know the end
    # (SLURM_JOB_END_TIME from Slurm 23.02, else rank 0's one scontrol) and stop 30 s before it.
    # The first run cannot finish (a second a step), the resumed one can (no extra time a step;
    # on a machine loaded past that, a third run would: the claims below hold either way). One
    # rank a node: no signal comes, so none fans out to a node's tasks.
    script = tmp_path / "own.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -p debug -N2 --ntasks-per-node=1 --requeue --time=1\n"
        f"#SBATCH -o {tmp_path}/%j.out --open-mode=append\n"
        "export SLURMDDP_SIGNAL_LEAD=30\n"
        f"srun {python} -m slurmddp.run {TRAIN} --steps 300 --fresh-step-time 1 --log-every 10 "
        f"--checkpoint-dir {tmp_path}/ckpt\n"
    )
    r = slurm_cluster.run(["sbatch", "--parsable", str(script)], cwd=tmp_path,
                          env=slurm_cluster.env(OMP_NUM_THREADS="1"))  # fmt: skip
    job_id = r.stdout.strip()
    out = tmp_path / f"{job_id}.out"
    wait_until(lambda: job_fields(slurm_cluster, job_id).get("JobState") == "COMPLETED", 400,
               lambda: f"the end of job {job_id}:\n{read(out)}")  # fmt: skip
    text = read(out)
    assert "and no stop signal came: every rank stops at this step boundary" in text, text
    assert f"job {job_id} stopped (time limit, USR2) at restart 0 after its checkpoint: " \
           "requeued (1 of 3)" in text, text  # fmt: skip
    assert "TIME LIMIT" not in text, text  # never cut off by Slurm
    assert {x["digest"] for x in tagged_json(text, "RESULT ")} == {reference_digest_2x1}


@pytest.mark.mpi
def test_under_mpirun_the_stop_signal_reaches_every_rank(slurm_cluster, tmp_path,
                                                         reference_digest):  # fmt: skip
    from tests.batch.transport.test_submit_cluster import MPIRUN_AS_ROOT

    job = Job(slurm_cluster, tmp_path, ["--launcher", "mpirun", *MPIRUN_AS_ROOT,
              *train_args(tmp_path / "ckpt", steps=300, step_time=0.05)])  # fmt: skip
    job.wait_for_log(r"step 40 ")
    # What Slurm does at the time limit's warning: USR2 to the batch shell, which passes it on to
    # mpirun, which passes it on to every rank.
    slurm_cluster.run(["scancel", "--batch", "--signal=USR2", job.id])
    job.wait_requeued(1)
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED", job.batch_log
    assert "stopped (signal, USR2) at restart 0 after its checkpoint: requeued" in job.batch_log
    assert {x["digest"] for x in job.results()} == {reference_digest}


# -- what users bring: DataLoader workers, scripts that never ask, signals at any moment --------


# DataLoader workers surviving a preemption ([standard-spawn], [default-signal-forkserver]) are
# proven by test_preempted_resumes_and_ends_bitwise_identical[cancel] and [cancel-default-signal]:
# the same two ways of signalling (USR2 passed on by srun, Slurm's TERM), a worker a rank (WORKERS).


@ELSEWHERE_SLURM
def test_a_stop_signal_during_the_setup_lines_requeues_before_the_step(
        slurm_cluster, tmp_path, reference_digest_2x1):  # fmt: skip
    job = Job(slurm_cluster, tmp_path, ["--setup", "sleep 6",
              *train_args(tmp_path / "ckpt", steps=300, step_time=0, per_node=1)])  # fmt: skip
    wait_until(lambda: "(restart 0)" in job.batch_log, 120, lambda: job.batch_log)
    slurm_cluster.run(["scancel", "-b", "--signal=USR2", job.id])  # the time limit's warning
    job.wait_requeued(1)
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED", job.batch_log
    assert "USR2 came before the step started: not starting it" in job.batch_log
    assert "stopped (signal, USR2, before the step started) at restart 0: requeued" in \
        job.batch_log
    assert {x["digest"] for x in job.results()} == {reference_digest_2x1}


def test_a_stop_signal_while_the_ranks_start_is_taken_at_their_first_step(
        slurm_cluster, tmp_path, python, reference_digest_2x1):  # fmt: skip
    # A python that takes 5 s to start, as a container or a cold file system can: the signal
    # arrives before any rank has its handlers.
    slow = tmp_path / "slow python"
    slow.write_text(f"#!/bin/bash\nsleep 5\nexec {python} \"$@\"\n")
    slow.chmod(0o755)
    job = Job(slurm_cluster, tmp_path, ["--python", str(slow),
              *train_args(tmp_path / "ckpt", steps=300, step_time=0, per_node=1)])  # fmt: skip
    wait_until(lambda: (job.folder / job.id / "rank-1.log").exists(), 120, lambda: job.batch_log)
    slurm_cluster.run(["scancel", "-b", "--signal=USR2", job.id])
    job.wait_requeued(1)
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED", job.batch_log
    assert re.search(r"stopped at step [12] ", job.log()), job.log()  # at the first agreement
    assert "User defined signal" not in job.batch_log
    assert {x["digest"] for x in job.results()} == {reference_digest_2x1}


OWN = str(ROOT / "tests" / "programs" / "own_checkpoints.py")


@pytest.fixture(scope="session")
def own_reference(slurm_cluster, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("own")
    job = Job(slurm_cluster, tmp, ["--nodes", "2", "--ntasks-per-node", "1", OWN, "--dir",
                                   str(tmp), "--step-time", "0"])  # fmt: skip
    assert job.wait_end()["JobState"] == "COMPLETED", job.batch_log
    return {x["digest"] for x in job.results()}.pop()


@pytest.mark.parametrize(("variant", "how"), [("default-signal", "--exit-0-on-term"),
                                              ("default-signal", "killed-by-term")])  # fmt: skip
def test_a_script_that_never_asks_is_requeued_and_resumes_from_its_own_checkpoint(
        slurm_cluster, tmp_path, variant, how, own_reference):  # fmt: skip
    # Lightning exits 0 on SIGTERM; most scripts die of it. Neither finished its work.
    args = ["--nodes", "2", "--ntasks-per-node", "1", OWN, "--dir", str(tmp_path)]
    with slurm_cluster.variant(variant):
        job = Job(slurm_cluster, tmp_path, args + ([how] if how.startswith("--") else []))
        job.wait_for_log(r"step 100")
        job.preempt()
        end = job.wait_end()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", job.batch_log
    results = job.results()
    assert {x["digest"] for x in results} == {own_reference}
    assert {x["start"] for x in results} != {0}  # resumed from its own checkpoint
    assert job.batch_log.count("never called slurmddp.should_stop()") == 1, job.batch_log
    assert "finished its work in an earlier run" not in job.batch_log


# -- scancel and the hard time limit --------------------------------------------------------------


def test_scancel_cuts_a_save_longer_than_killwait_and_keeps_the_last_checkpoint(
        slurm_cluster, tmp_path):  # fmt: skip
    # KillWait is 5 s here (Slurm's default: 30 s): srun answers scancel's TERM by ending the
    # step with SIGKILL that long after. A checkpoint that takes longer never lands.
    job = Job(slurm_cluster, tmp_path, [*train_args(tmp_path / "ckpt", steps=100000,
              step_time=0.05, per_node=1), "--save-every", "20", "--slow-save", "8"])  # fmt: skip
    job.wait_for_log(r"step 40 ")
    sent = time.monotonic()
    slurm_cluster.run(["scancel", job.id])
    end = job.wait_end()
    took = time.monotonic() - sent
    print(f"scancel to the job's end: {took:.1f} s")
    assert end["JobState"] == "CANCELLED" and end.get("Restarts", "0") == "0"
    assert "TERM received" in job.log() and "stopped at step" not in job.log(), job.log()
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    assert latest.startswith("step-") and int(latest[5:]) % 20 == 0  # the last periodic one


def test_scancel_b_usr2_stops_with_all_the_time_the_save_needs(slurm_cluster, tmp_path):
    # What docs/behaviour/preemption.md tells users to do instead: the stop signal to the batch
    # shell. With Requeue=0 the job then ends, for good, after its checkpoint.
    job = Job(slurm_cluster, tmp_path, [*train_args(tmp_path / "ckpt", steps=100000,
              step_time=0.05, per_node=1), "--slow-save", "8"])  # fmt: skip
    job.wait_for_log(r"step 40 ")
    slurm_cluster.run(["scontrol", "update", f"JobId={job.id}", "Requeue=0"])
    slurm_cluster.run(["scancel", "-b", "--signal=USR2", job.id])
    end = job.wait_end()
    assert (end["JobState"], end["ExitCode"], end["Restarts"]) == ("FAILED", "75:0", "0")
    stop = int(re.search(r"stopped at step (\d+)", job.log()).group(1))
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{stop:08d}"
    assert "the job is marked not to be requeued (Requeue=0)" in job.batch_log

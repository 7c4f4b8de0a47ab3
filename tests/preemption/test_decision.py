"""The requeue policy as a table: facts of a run's end in, what happens to the job out."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from slurmddp.errors import UserError
from slurmddp.preemption.decision import (
    Facts,
    cause,
    decide,
    facts_from,
    job_fields,
    requeue_target,
    seconds,
    seconds_left,
)
from tests.conftest import launcher_free_env

PREEMPTED = {"JobState": "RUNNING", "PreemptTime": "2026-11-22T11:00:00", "TimeLimit": "UNLIMITED",
             "RunTime": "00:05:00"}  # fmt: skip
RUNNING = {"JobState": "RUNNING", "PreemptTime": "None", "TimeLimit": "UNLIMITED",
           "RunTime": "00:05:00"}  # fmt: skip
NEAR_LIMIT = RUNNING | {"TimeLimit": "00:10:00", "RunTime": "00:08:30"}  # 90 s left, lead 120
AT_LIMIT = RUNNING | {"TimeLimit": "00:10:00", "RunTime": "00:10:00"}
CANCELLED = RUNNING | {"JobState": "CANCELLED"}
# GraceTime=0: Slurm requeues at once, and shows no PreemptTime while the shell still runs.
REQUEUED_BY_SLURM = RUNNING | {"JobState": "COMPLETING", "Restarts": "1"}
SCANCELLED = RUNNING | {"JobState": "COMPLETING", "Restarts": "0"}
TIMED_OUT = RUNNING | {"JobState": "COMPLETING", "Reason": "TimeLimit", "TimeLimit": "00:01:00",
                       "RunTime": "00:01:27"}  # fmt: skip
CANCEL_MODE = PREEMPTED | {"JobState": "PREEMPTED"}
# A 2-node job in a 4-node partition, and what srun and a rank say of a failure.
ON_TWO = RUNNING | {"NumNodes": "2", "ExcNodeList": "(null)", "Requeue": "1"}
FOUR = {"PartitionName": "debug", "TotalNodes": "4"}
BUS = "srun: error: n2: task 1: Bus error"
KILLED = "srun: error: n2: task 1: Killed"
ECC = ("slurmddp: rank 1 (host n2) failed: RuntimeError: CUDA error: uncorrectable ECC error "
       "encountered")  # fmt: skip
RAISED = "slurmddp: rank 1 (host n2) failed: RuntimeError: boom"


def facts(**kw) -> Facts:
    return Facts(**({"step_status": 0, "target": "41"} | kw))


CASES = [
    # (id, facts, action, status, a phrase of the message)
    ("done", facts(done=True, job=PREEMPTED), "done", 0, None),
    ("done-then-failed", facts(done=True, step_status=1), "fail", 1, None),
    ("elastic-below-the-minimum", facts(step_status=75, elastic=True, seen=KILLED, job=RUNNING,
                                        nodes_lost="slurmddp: agent (host n1): fewer nodes than "
                                        "the minimum joined torchrun's rendezvous within 300 s"),
     "requeue", 0, "stopped (nodes lost: fewer than the minimum rejoined torchrun's rendezvous) "
     "at restart 0: requeued (1 of 3)"),
    ("done-elastic-a-node-lost", facts(done=True, step_status=137, elastic=True, seen=KILLED),
     "done", 0, "the work is done: the other nodes finished it (elastic"),
    ("preempted-usr2", facts(asked="USR2", job=PREEMPTED), "requeue", 0,
     "job 41 stopped (preempted, USR2) at restart 0 after its checkpoint: requeued (1 of 3)"),
    ("preempted-term-default-signalling", facts(asked="TERM", job=PREEMPTED), "requeue", 0,
     "stopped (preempted, TERM)"),
    ("preempted-cancel-mode", facts(asked="TERM", job=CANCEL_MODE), "requeue", 0, "preempted"),
    ("preempted-lightning-exit-0", facts(job=PREEMPTED, received=()), "requeue", 0,
     "the step ended with status 0 before the ranks agreed to stop"),
    ("preempted-killed-by-term", facts(step_status=143, job=PREEMPTED), "requeue", 0,
     "status 143"),
    ("preempted-in-setup", facts(step_status=None, job=PREEMPTED, received=("TERM",)), "requeue",
     0, "preempted before the step started"),
    ("grace0-requeued-by-slurm", facts(asked="TERM", job=REQUEUED_BY_SLURM), "stop", 0,
     "job 41 was requeued by Slurm itself (TERM after restart 0)"),
    ("preempted-at-the-cap", facts(asked="USR2", job=PREEMPTED, restart=3), "final", 75,
     "not requeued, the limit of 3 requeues (--max-requeues) is reached"),
    ("time-limit-warning", facts(asked="USR2", job=NEAR_LIMIT), "requeue", 0,
     "stopped (time limit, USR2) at restart 0"),
    ("usr2-by-hand", facts(asked="USR2", job=RUNNING), "requeue", 0, "stopped (signal, USR2)"),
    ("usr1-by-hand", facts(asked="USR1", stop_signal="USR1", job=RUNNING), "requeue", 0,
     "(signal, USR1)"),
    ("scancel", facts(asked="TERM", job=SCANCELLED, received=("TERM",)), "stop", 75,
     "stopped (TERM, cancelled) at restart 0 after its checkpoint: not requeued"),
    ("cancelled", facts(asked="TERM", job=CANCELLED), "stop", 75, "(TERM, cancelled)"),
    ("hard-time-limit", facts(asked="TERM", job=TIMED_OUT), "stop", 75, "time limit reached"),
    ("no-time-left", facts(asked="TERM", job=AT_LIMIT), "stop", 75, "time limit reached"),
    ("term-by-hand", facts(asked="TERM", job=RUNNING), "stop", 75, "sent by hand"),
    ("stop-in-setup", facts(step_status=None, received=("USR2",), job=RUNNING), "requeue", 0,
     "before the step started"),
    ("cancel-in-setup", facts(step_status=None, received=("TERM",), job=CANCELLED), "stop", 75,
     "before the step started: not requeued"),
    ("finished", facts(), "finished", 0, None),
    ("finished-after-a-signal", facts(received=("USR2",)), "done", 0, None),
    ("failed", facts(step_status=3), "fail", 3, None),
    ("failed-after-a-signal", facts(step_status=1, received=("USR2",)), "fail", 1,
     "the step ended with status 1 after USR2; no rank asked for a requeue"),
    ("requeue-0", facts(asked="USR2", job=RUNNING | {"Requeue": "0"}), "stop", 75,
     "the job is marked not to be requeued (Requeue=0)"),
    ("requeue-0-preempted", facts(asked="TERM", job=PREEMPTED | {"Requeue": "0"}), "stop", 75,
     "stopped (TERM) at restart 0: the job is marked not to be requeued"),
    ("hung", facts(step_status=124, hung=True, job=RUNNING), "fail", 124,
     "job 41 ended at restart 0: the hang watchdog judged the run hung (above: which ranks); "
     "not requeued"),
    ("hung-after-done", facts(step_status=0, hung=True, done=True), "done", 0, None),
    # A failure laid on a node: requeued without it while the job fits and may be requeued.
    ("bus-error", facts(step_status=135, seen=BUS, job=ON_TWO, partition=FOUR), "requeue", 0,
     "job 41 failed at restart 0 because of node n2 (task 1 on it ended by a signal (Bus "
     "error)): requeued without it (1 of 3); the job now excludes n2"),
    ("bus-error-summary", facts(step_status=135, seen=BUS, job=ON_TWO, partition=FOUR), "requeue",
     0, "the step failed with status 135; the first to end, as srun saw it: task 1 on n2 (Bus "
     "error)"),
    # The peer of the node's rank saw its connection reset and exited first: srun saw that first.
    ("bus-error-after-a-peers-exit", facts(
        step_status=135, seen="srun: error: n1: task 0: Exited with exit code 1", signalled=BUS,
        reported="slurmddp: rank 0 (host n1) failed: RuntimeError: [../gloo/transport/tcp/"
        "pair.cc:537] Read error [10.77.0.2]:10917: Connection reset by peer", job=ON_TWO,
        partition=FOUR),
     "requeue", 0, "then task 1 on n2 was ended by a signal (Bus error) and could not report: the "
     "failures before it followed from losing it"),
    # srun aborted the step for n2 (its step daemon lost, its slurmd back): every task killed by
    # srun, n1's first; elastic or not, requeued without n2.
    ("aborted", facts(step_status=137, seen="srun: error: n1: task 0: Killed", aborted="n2",
                      elastic=True, job=ON_TWO, partition=FOUR),
     "requeue", 0, "job 41 failed at restart 0 because of node n2 (srun lost the step's daemon "
     "there and aborted the step): requeued without it (1 of 3); the job now excludes n2"),
    ("aborted-srun-launcher", facts(step_status=137, seen="srun: error: n1: task 0: Killed",
                                    aborted="n2", job=ON_TWO, partition=FOUR),
     "requeue", 0, "because of node n2 (srun lost the step's daemon there"),
    # The work was done before the abort (the other nodes finished it): nothing to requeue.
    ("aborted-after-the-work", facts(step_status=137, aborted="n2", elastic=True, done=True,
                                     job=ON_TWO, partition=FOUR), "done", 0, None),
    ("bus-error-again", facts(step_status=135, seen=BUS, restart=1, partition=FOUR,
                              job=ON_TWO | {"ExcNodeList": "n1"}),
     "requeue", 0, "the job now excludes n[1-2]"),
    ("bus-error-no-room", facts(step_status=135, seen=BUS, restart=2, partition=FOUR,
                                job=ON_TWO | {"ExcNodeList": "n[1,3]"}),
     "fail", 135, "n2 looks broken (task 1 on it ended by a signal (Bus error)), but the job "
     "is not requeued without it: the job needs 2 of partition debug's 4 nodes and would then "
     "exclude 3"),
    ("bus-error-no-partition", facts(step_status=135, seen=BUS, job=ON_TWO), "fail", 135,
     "Slurm's record does not say how many nodes the partition has"),
    ("bus-error-at-the-cap", facts(step_status=135, seen=BUS, restart=3, job=ON_TWO,
                                   partition=FOUR), "fail", 135, "the limit of 3 requeues"),
    ("bus-error-no-requeue", facts(step_status=135, seen=BUS, job=ON_TWO | {"Requeue": "0"},
                                   partition=FOUR), "fail", 135, "marked not to be requeued"),
    ("ecc-error", facts(step_status=1, reported=ECC, job=ON_TWO, partition=FOUR), "requeue", 0,
     "because of node n2 (rank 1 on it failed: RuntimeError: CUDA error: uncorrectable ECC"),
    ("killed-is-not-the-node", facts(step_status=137, seen=KILLED, job=ON_TWO, partition=FOUR),
     "fail", 137, "task 1 on n2 was ended by a signal and could not report"),
    ("raised-is-not-the-node", facts(step_status=1, seen=KILLED, reported=RAISED, job=ON_TWO,
                                     partition=FOUR),
     "fail", 1, "the first failure a rank reported: rank 1 (host n2) failed: RuntimeError: boom"),
    ("hung-on-one-node", facts(step_status=124, hung=True, suspects=((3, "n2"),), job=ON_TWO,
                               partition=FOUR),
     "requeue", 0, "hung at restart 0 because of node n2 (rank 3 on it stopped progressing"),
    ("hung-on-two-nodes", facts(step_status=124, hung=True, suspects=((1, "n1"), (3, "n2")),
                                job=ON_TWO, partition=FOUR), "fail", 124, "not requeued"),
    ("preflight-crash", facts(step_status=None, preflight_status=135, seen=BUS, job=ON_TWO,
                              partition=FOUR),
     "requeue", 0, "failed its preflight at restart 0 because of node n2"),
    ("preflight-node-check", facts(step_status=None, preflight_status=1, job=ON_TWO,
                                   partition=FOUR, reported="slurmddp: rank 1 (host n2) failed: "
                                   "NodeCheckError: GPU 0 computed a wrong matrix product"),
     "requeue", 0, "because of node n2 (rank 1 on it failed: NodeCheckError: GPU 0"),
    ("preflight-collectives", facts(step_status=None, preflight_status=1, job=ON_TWO,
                                    partition=FOUR, seen="srun: error: n1: task 0: Exited with "
                                    "exit code 1", reported="slurmddp: rank 0 (host n1) exited "
                                    "with status 1"),
     "fail", 1, "the preflight failed with status 1"),
    ("preflight-then-stop-signal", facts(step_status=None, preflight_status=143, seen=BUS,
                                         received=("USR2",), job=ON_TWO, partition=FOUR),
     "requeue", 0, "before the step started"),
    ("no-scontrol-answer", facts(asked="USR2", job={}), "requeue", 0, "(signal, USR2)"),
    # After a `requeue` verdict whose scontrol requeue failed, with the job as Slurm shows it then.
    ("requeue-refused", facts(asked="USR2", requeue_error="", job=RUNNING), "stop", 75,
     "scontrol requeue 41 failed: the job ends here; submit again to resume"),
    ("requeue-refused-saying-why", facts(requeue_error="denied", job=RUNNING), "stop", 75,
     "scontrol requeue 41 failed: denied: the job ends here"),
    ("requeue-answer-lost", facts(asked="USR2", requeue_error="", job=RUNNING | {"Restarts": "1"}),
     "stop", 0, None),
]


@pytest.mark.parametrize(("facts_", "action", "status", "says"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_what_happens_to_the_job(facts_, action, status, says):
    d = decide(facts_)
    assert (d.action, d.status) == (action, status), d
    if says is not None:
        assert any(says in line for line in d.lines), d.lines
    # Only a requeue without a node names the nodes to exclude.
    assert bool(d.exclude) == (d.action == "requeue" and "because of node" in " ".join(d.lines))


SLOW = (("n2", "its ranks busy 4.0 times as long a step as the median rank"),)


def test_a_requeue_leaves_a_slow_node_out_only_when_asked():
    preempted = facts(asked="USR2", job=ON_TWO | {"PreemptTime": PREEMPTED["PreemptTime"]},
                      partition=FOUR, slow=SLOW)  # fmt: skip
    assert decide(preempted).exclude == ""  # named, but --leave-slow-nodes is off
    d = decide(dataclasses.replace(preempted, leave_slow=True))
    assert (d.action, d.exclude) == ("requeue", "n2")
    assert d.left_behind == "n2: slow, its ranks busy 4.0 times as long a step as the median rank"
    assert d.lines[-1] == ("n2 is left out as the job is requeued (--leave-slow-nodes): it was "
                           "slow (its ranks busy 4.0 times as long a step as the median rank); "
                           "the job now excludes n2")  # fmt: skip
    assert cause(preempted, d) == "preempted"  # still why the run ended
    # No room without it: requeued as before, saying why the node stays.
    crowded = dataclasses.replace(preempted, leave_slow=True,
                                  job=preempted.job | {"ExcNodeList": "n[3-4]"})
    d = decide(crowded)
    assert (d.action, d.exclude) == ("requeue", "")
    assert d.lines[-1].startswith("n2 was slow (its ranks busy 4.0 times as long a step as the "
                                  "median rank), but the job is not requeued without it: the job "
                                  "needs 2")  # fmt: skip
    # Not a requeue: nothing to leave out; a requeue that leaves a broken node out keeps to it.
    assert decide(dataclasses.replace(preempted, leave_slow=True, asked=None, job=ON_TWO,
                                      step_status=0)).action == "finished"  # fmt: skip
    broken = facts(step_status=135, seen=BUS, job=ON_TWO, partition=FOUR, leave_slow=True,
                   slow=(("n3", "slow"),))  # fmt: skip
    assert decide(broken).exclude == "n2"


def test_the_option_reaches_the_decision_from_the_jobs_environment():
    assert facts_from({"SLURMDDP_LEAVE_SLOW_NODES": "1"}, step_status=0).leave_slow
    assert not facts_from({"SLURMDDP_LEAVE_SLOW_NODES": "0"}, step_status=0).leave_slow
    assert not facts_from({}, step_status=0).leave_slow


def test_a_script_that_never_asked_is_told_once():
    d = decide(facts(protocol_used=False, step_status=143, job=PREEMPTED))
    assert d.action == "requeue"
    unused = [line for line in d.lines if "never called slurmddp.should_stop()" in line]
    assert len(unused) == 1 and "the preemption reached it" in unused[0]
    d = decide(facts(protocol_used=False, received=("USR2",)))
    assert any("USR2 reached it" in line for line in d.lines)
    assert decide(facts(protocol_used=False)).lines == ()  # nothing came: nothing to say


@pytest.mark.parametrize(("text", "value"), [("00:01:30", 90), ("1:00", 60), ("2-03:04:05", 183845),
                                             ("UNLIMITED", None), ("", None)])  # fmt: skip
def test_slurm_durations(text, value):
    assert seconds(text) == value


def test_time_left_comes_from_slurm_alone():
    assert seconds_left(NEAR_LIMIT) == 90
    assert seconds_left(RUNNING) is None


@pytest.mark.parametrize(
    ("environ", "target"),
    [({"SLURM_JOB_ID": "41"}, "41"),
     ({"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}, "40_3"),
     ({}, "")],
)  # fmt: skip
def test_an_array_task_is_requeued_by_its_array_id(environ, target):
    assert requeue_target(environ) == target
    assert facts_from(environ, step_status=0).target == target


def test_the_budget_comes_from_the_environment_and_a_bad_one_is_a_user_error():
    f = facts_from({"SLURM_RESTART_COUNT": "2", "SLURMDDP_MAX_REQUEUES": "5",
                    "SLURMDDP_SIGNAL": "USR1", "SLURMDDP_SIGNAL_LEAD": "300"},
                   step_status=0)  # fmt: skip
    assert (f.restart, f.allowed, f.stop_signal, f.lead_s) == (2, 5, "USR1", 300)
    default = facts_from({}, step_status=0)
    assert (default.allowed, default.lead_s, default.stop_signal) == (3, 120, "USR2")
    with pytest.raises(UserError, match="SLURMDDP_MAX_REQUEUES='x' is not a count"):
        facts_from({"SLURMDDP_MAX_REQUEUES": "x"}, step_status=0)
    with pytest.raises(UserError, match="SLURMDDP_SIGNAL='NOPE' is not a signal name"):
        facts_from({"SLURMDDP_SIGNAL": "NOPE"}, step_status=0)


SHOW_JOB = ("JobId=41 JobName=train UserId=root(0) Priority=1 JobState=RUNNING Reason=None "
            "Requeue=1 Restarts=1 RunTime=00:08:30 TimeLimit=00:10:00 PreemptTime=None "
            "Command=/tmp/a b/job.sh WorkDir=/tmp\n")  # fmt: skip


def test_scontrol_show_job_fields():
    fields = job_fields(SHOW_JOB)
    assert fields["JobState"] == "RUNNING" and fields["Restarts"] == "1"
    assert fields["PreemptTime"] == "None" and fields["Command"] == "/tmp/a"


# Free text that looks like fields: in the job's name, its comment and (Slurm 25.11 on) the
# sbatch command line, as `scontrol show job -o` prints them on 26.05 (their places in the line).
DECOYS = "Requeue=0 Restarts=9 JobState=COMPLETED PreemptTime=2026-01-01T00:00:00"
SHOW_JOB_2605 = (
    f"JobId=41 JobName=x {DECOYS} UserId=root(0) GroupId=root(0) Priority=1 JobState=RUNNING "
    "Reason=None Requeue=1 Restarts=1 RunTime=00:08:30 TimeLimit=00:10:00 PreemptTime=None "
    f"Command=/tmp/job.sh SubmitLine=/usr/bin/sbatch --comment={DECOYS} /tmp/job.sh "
    f"WorkDir=/tmp Comment=c {DECOYS} StdErr= StdIn=/dev/null StdOut=/tmp/41.log\n")


def test_free_text_that_looks_like_fields_is_not_taken_for_them():
    fields = job_fields(SHOW_JOB_2605)
    assert (fields["Requeue"], fields["Restarts"], fields["JobState"], fields["PreemptTime"]) == (
        "1", "1", "RUNNING", "None")
    assert fields["UserId"] == "root(0)" and fields["SubmitLine"] == "/usr/bin/sbatch"


def test_the_batch_shell_command_prints_its_action_and_messages():
    env = launcher_free_env(SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1",
                            SLURMDDP_MAX_REQUEUES="5", SLURMDDP_SIGNAL_LEAD="120")  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "slurmddp.preemption.decision", "--step-status", "0",
                        "--asked", "USR2"], input=SHOW_JOB, env=env, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "requeue 0 41 -\n"
    assert r.stderr == ("slurmddp: job 41 stopped (time limit, USR2) at restart 1 after its "
                        "checkpoint: requeued (2 of 5)\n")  # fmt: skip


def decision_command(*args: str, show: str = SHOW_JOB, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmddp.preemption.decision", *args],
                          input=show, env=launcher_free_env(**env), capture_output=True,
                          text=True)  # fmt: skip


def test_after_a_failed_requeue_the_batch_shell_is_told_whether_it_went_through():
    # SHOW_JOB shows Restarts=1: at restart 0, the requeue went through although scontrol failed.
    r = decision_command("--requeue-failed", SLURM_JOB_ID="41", SLURM_RESTART_COUNT="0")
    assert (r.returncode, r.stdout, r.stderr) == (0, "stop 0 41 -\n", "")
    r = decision_command("--requeue-failed", SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1")
    assert (r.returncode, r.stdout) == (0, "stop 75 41 -\n")
    assert r.stderr == ("slurmddp: scontrol requeue 41 failed: the job ends here; submit again to "
                        "resume\n")  # fmt: skip


SHOW_PARTITION = ("PartitionName=debug AllowGroups=ALL Default=YES State=UP TotalCPUs=16 "
                  "TotalNodes=4 PreemptMode=REQUEUE\n")  # fmt: skip


def test_the_batch_shell_is_told_which_nodes_to_exclude_and_why():
    show = SHOW_JOB.replace("Requeue=1", "Requeue=1 NumNodes=2 ExcNodeList=(null)") + SHOW_PARTITION
    r = decision_command("--step-status", "135", "--srun-error", BUS, show=show,
                         SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "requeue 0 41 n2 n2: task 1 on it ended by a signal (Bus error)\n"
    assert "job 41 failed at restart 1 because of node n2" in r.stderr
    # The partition's line does not stand in for the job's fields (State=UP is not JobState).
    r = decision_command("--step-status", "135", "--srun-error", BUS, show=SHOW_PARTITION,
                         SLURM_JOB_ID="41")  # fmt: skip
    assert r.stdout == "fail 135 41 -\n", r.stderr
    # The hang watchdog's suspects come as RANK:NODE.
    r = decision_command("--step-status", "124", "--hung", "--suspect", "3:n2", show=show,
                         SLURM_JOB_ID="41", SLURM_RESTART_COUNT="1")  # fmt: skip
    assert r.stdout.startswith("requeue 0 41 n2 n2: rank 3 on it stopped progressing"), r.stderr


def test_a_bad_budget_is_one_line_and_status_2():
    r = decision_command("--step-status", "0", SLURM_RESTART_COUNT="one")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("slurmddp: SLURM_RESTART_COUNT='one' or SLURMDDP_MAX_REQUEUES='3' is not a "
                        "count\n")  # fmt: skip

"""The job registry, local job states and --follow, without a scheduler."""

from __future__ import annotations

import io
import itertools
import json
import os
import pwd
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from slurmddp.batch import jobs
from slurmddp.batch.jobs import following, status


def record(tmp_path, **kw) -> jobs.JobRecord:
    fields = dict(job_id="77", folder=str(tmp_path), name="t", engine="local", tasks=2,
                  submitted=0.0, log_pattern=jobs.LOCAL_LOG_PATTERN)  # fmt: skip
    return jobs.JobRecord(**(fields | kw))


def test_registry_round_trip_and_torn_lines(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    jobs.remember(record(tmp_path, job_id="1"), env)
    with jobs.registry_path(env).open("a") as f:
        f.write('{"job_id": "half')  # a crash mid-write must not hide the others
        f.write("\n")
    jobs.remember(record(tmp_path, job_id="2", name="second"), env)
    assert [r.job_id for r in jobs.recorded(env)] == ["1", "2"]
    assert jobs.find("2", env).name == "second"
    assert jobs.find("3", env) is None


def test_registry_directories_are_never_world_writable(tmp_path):
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    old = os.umask(0)  # even where the user's umask would allow it
    try:
        jobs.remember(record(tmp_path), env)
    finally:
        os.umask(old)
    for directory in (tmp_path / "state", jobs.registry_path(env).parent):
        assert directory.stat().st_mode & 0o777 == 0o775


def test_local_state_reads_the_batch_scripts_exit_file(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    r = record(tmp_path, job_id=done)
    assert jobs.local_state(r) == "CANCELLED"  # dead, and its batch script did not say how
    jobs.local_exit_path(tmp_path, done).write_text("0\n")
    assert jobs.local_state(r) == "COMPLETED"
    jobs.local_exit_path(tmp_path, done).write_text("3\n")
    assert jobs.local_state(r) == "FAILED"
    assert jobs.exit_code(r) == 3
    assert jobs.local_state(record(tmp_path, job_id=str(os.getpid()))) == "RUNNING"


class FakeClock:
    """Time for `follow` and `wait_until_final`: a sleep passes at once and is noted."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    time = monotonic

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr("slurmddp.batch.jobs.following.time", fake)
    monkeypatch.setattr("slurmddp.batch.jobs.status.time", fake)
    return fake


def test_follow_prints_state_changes_and_the_log_until_the_end(tmp_path, clock):
    r = record(tmp_path)
    log = r.log(0)
    states = iter(["PENDING", "RUNNING", "RUNNING", "COMPLETED"])

    def state() -> str:
        s = next(states)
        if s == "RUNNING":
            with log.open("a") as f:
                f.write("step\n")
        return s

    out = io.StringIO()
    assert jobs.follow(r, state, out) == "COMPLETED"
    assert out.getvalue() == (
        "[slurmddp] job 77: PENDING\n[slurmddp] job 77: RUNNING\nstep\nstep\n"
        "[slurmddp] job 77: COMPLETED\n"
    )


def test_follow_prints_the_logs_last_lines_before_the_final_state(tmp_path, clock):
    r = record(tmp_path)
    log = r.log(0)
    log.write_text("step 1\n")

    def state() -> str:
        # The job writes its last lines as it ends: they are on disk when it is COMPLETED.
        with log.open("a") as f:
            f.write("step 2\nparameters identical on all ranks: True\n")
        return "COMPLETED"

    out = io.StringIO()
    assert jobs.follow(r, state, out) == "COMPLETED"
    assert out.getvalue() == (
        "step 1\nstep 2\nparameters identical on all ranks: True\n[slurmddp] job 77: COMPLETED\n"
    )


def test_follow_waits_for_lines_that_land_just_after_the_state_changed(tmp_path):
    r = record(tmp_path)
    log = r.log(0)
    log.write_text("")
    # A node's file system can show the last lines a moment after sacct shows the end.
    late = threading.Timer(0.05, lambda: log.write_text("last line\n"))
    late.start()
    out = io.StringIO()
    try:
        assert jobs.follow(r, lambda: "FAILED", out, settle_s=0.3) == "FAILED"
    finally:
        late.join()
    assert out.getvalue() == "last line\n[slurmddp] job 77: FAILED\n"


def test_an_event_never_cuts_a_line_the_job_is_writing(tmp_path, clock):
    r = record(tmp_path, engine="slurm")
    log = r.log(0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line 555\nline 55")  # the job is in the middle of its next line
    write_events(r, {"kind": "run", "nodes": "n1"})
    script = iter(["6\nline 557\nno newline at the end", ""])

    def state() -> str:
        text = next(script, None)
        if text is None:
            return "COMPLETED"
        with log.open("a") as f:
            f.write(text)
        return "RUNNING"

    out = io.StringIO()
    assert jobs.follow(r, state, out, settle_s=0) == "COMPLETED"
    assert out.getvalue().replace("[slurmddp] job 77: ", "").splitlines()[:6] == [
        "line 555", "run 1 started on n1", "RUNNING", "line 556", "line 557",
        "no newline at the end"]  # fmt: skip


def test_follow_of_an_array_shows_its_tasks_counts(tmp_path, clock):
    r = record(tmp_path, engine="slurm")
    states = iter(["PENDING 3", "RUNNING 2, PENDING 1", "RUNNING 2, PENDING 1", "COMPLETED 3"])
    out = io.StringIO()
    assert jobs.follow(r, lambda: next(states), out) == "COMPLETED"
    assert out.getvalue() == ("[slurmddp] job 77: PENDING 3\n[slurmddp] job 77: RUNNING 2, "
                              "PENDING 1\n[slurmddp] job 77: COMPLETED 3\n")  # fmt: skip
    failed = iter(["RUNNING 1, COMPLETED 1", "FAILED 1, COMPLETED 1"])
    assert jobs.follow(r, lambda: next(failed), io.StringIO()) == (
        "FAILED 1, COMPLETED 1"
    )


def write_events(r: jobs.JobRecord, *told: dict) -> None:
    r.events_path.parent.mkdir(parents=True, exist_ok=True)
    with r.events_path.open("a") as f:
        for e in told:
            f.write(json.dumps({"t": 1000.0, "run": 0, **e}) + "\n")


def test_follow_interleaves_the_jobs_events_with_the_log_and_ends_with_its_summary(
        tmp_path, clock):  # fmt: skip
    r = record(tmp_path, engine="slurm")
    log = r.log(0)
    log.parent.mkdir(parents=True, exist_ok=True)
    script = iter([  # what the job adds to its rank 0's log and its events by each ask
        ("", [{"kind": "run", "nodes": "n[1-2]"}, {"kind": "training"}]),
        ("step 1\nstopped at step 5\n", [
            {"kind": "stop", "signal": "USR2", "step": 5, "calls": 5},
            {"kind": "decision", "action": "requeue", "requeue": 1, "allowed": 3,
             "cause": "preempted"}]),
        ("", [{"kind": "run", "run": 1, "nodes": "n[2-3]"},
              {"kind": "resumed", "run": 1, "step": 5, "source": "/c/step-5"}]),
        ("done\n", [{"kind": "done", "run": 1, "step": 8, "calls": 3},
                    {"kind": "decision", "run": 1, "action": "done", "cause": "finished"}]),
    ])  # fmt: skip
    states = []

    def state() -> str:  # each ask, the job gets a little further
        lines, told = next(script, ("", []))
        with log.open("a") as f:
            f.write(lines)
        write_events(r, *told)
        states.append("COMPLETED" if len(states) >= 5 else "RUNNING")
        return states[-1]

    out = io.StringIO()
    assert jobs.follow(r, state, out) == "COMPLETED"
    said = out.getvalue().replace("[slurmddp] job 77: ", "")
    assert said.splitlines() == [
        "RUNNING", "run 1 started on n[1-2]", "step 1", "stopped at step 5",
        "stop requested (USR2 received): every rank stops after step 5",
        "requeued (1 of 3): preempted", "run 2 started on n[2-3]",
        "resumed at step 5 from /c/step-5", "done", "the work is done (step 8)",
        "run 2 ended: finished (exit status None)",
        "2 runs, 1 requeue, 8 steps, 0 s from start to end",
        "steps lost: none; time lost: none",
        "goodput: unknown (no step rate: no run counted two steps apart in time)",
        "COMPLETED"]  # fmt: skip


def test_a_follow_backs_off_for_an_hour_then_reports_the_end_within_a_second(tmp_path, clock):
    # While the job's events flow, Slurm is asked at most every FOLLOWED_POLL_S; once the last
    # run's decision is in them, every FIRST_POLL_S until Slurm says the end (2 s later here).
    r = record(tmp_path, engine="slurm")
    write_events(r, {"kind": "run"}, {"kind": "training"})
    asked: list[float] = []
    ended_at: list[float] = []

    def state() -> str:
        asked.append(clock.now)
        if clock.now - 1000 > 3600 and not ended_at:
            write_events(r, {"kind": "decision", "action": "finished", "cause": "finished"})
            ended_at.append(clock.now)
        return "COMPLETED" if ended_at and clock.now - ended_at[0] >= 2 else "RUNNING"

    assert jobs.follow(r, state, io.StringIO(), settle_s=0) == "COMPLETED"
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert len([a for a in asked if a - 1000 <= 3600]) <= 3600 / following.FOLLOWED_POLL_S + 10
    assert max(gaps) <= following.FOLLOWED_POLL_S + status.TICK_S
    after = [b - a for a, b in itertools.pairwise(asked) if a >= ended_at[0]]
    assert after and max(after) <= status.FIRST_POLL_S + status.TICK_S
    assert asked[-1] - ended_at[0] <= 2 + status.FIRST_POLL_S + status.TICK_S


def test_a_records_wait_asks_often_once_its_events_say_the_end(tmp_path, clock):
    r = record(tmp_path, engine="slurm")
    write_events(r, {"kind": "run"})
    asked: list[float] = []

    def state() -> str:
        asked.append(clock.now)
        if len(asked) == 12:
            write_events(r, {"kind": "decision", "action": "fail", "cause": "crash"})
        return "FAILED" if len(asked) == 16 else "RUNNING"

    assert status.wait_until_final(state, None, "job 77", r.ending()) == "FAILED"
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert max(gaps[:10]) == status.MAX_POLL_S  # backed off
    assert max(gaps[11:]) <= status.FIRST_POLL_S + status.TICK_S  # then fast, to the end


# ---- Slurm's clients, faked: each executable appends its argv to calls.log ----------------


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """fake_slurm(name=bash body, ...) puts those executables first on PATH; returns the calls
    log (one line per call: the name and its arguments)."""
    monkeypatch.setattr(status, "_said_controller", False)  # a fresh process: nothing said yet
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def install(**bodies: str) -> Path:
        for name, body in bodies.items():
            path = bin_dir / name
            path.write_text(f'#!/bin/bash\necho "{name} $*" >>{calls}\n{body}\n')
            path.chmod(0o755)
        return calls

    return install


# What sacct -X -n -P prints for an array 100 of five tasks (one done, two running, two waiting
# in the array, two at a time) and a plain job 200 cancelled by root.
SACCT_ARRAY = """#!/bin/bash
cat <<'OUT'
100_0|101|COMPLETED
100_1|102|RUNNING
100_2|103|RUNNING
100_[3-4%2]|100|PENDING
200|200|CANCELLED by 0
OUT
"""


def test_an_array_is_one_job_with_its_tasks_counted_from_one_sacct_call(tmp_path, fake_slurm):
    calls = fake_slurm(sacct=SACCT_ARRAY)
    records = [record(tmp_path, job_id=j, engine="slurm") for j in ("100", "200")]
    found = jobs.job_states(records)
    assert found["100"].state == "PENDING 2, RUNNING 2, COMPLETED 1"
    assert found["200"] == jobs.JobState("CANCELLED")
    assert [(t.task, t.job_id, t.state) for t in found["100"].tasks] == [
        ("100_0", "101", "COMPLETED"), ("100_1", "102", "RUNNING"), ("100_2", "103", "RUNNING"),
        ("100_3", "", "PENDING"), ("100_4", "", "PENDING"),
    ]  # fmt: skip
    assert calls.read_text().splitlines() == ["sacct -X -n -P -o JobID,JobIDRaw,State -j 100,200"]
    assert jobs.states(records[:1]) == {"100": "PENDING 2, RUNNING 2, COMPLETED 1"}


def test_counted_states_are_final_only_when_every_task_is(tmp_path):
    assert jobs.aggregate(["RUNNING", "COMPLETED", "RUNNING", "PENDING"]) == (
        "RUNNING 2, COMPLETED 1, PENDING 1"
    )
    assert not jobs.is_final("RUNNING 2, COMPLETED 1, PENDING 1")
    assert jobs.is_final("COMPLETED 3, FAILED 1") and jobs.is_final("TIMEOUT")
    assert not jobs.is_final("PENDING")


NO_ACCOUNTING = 'echo "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1'
# The controller's view: array 300 (task 0 done, 1 running, 2 waiting), job 400 running, 401
# failed a moment ago; 500 ended longer ago than MinJobAge and is forgotten.
SQUEUE = """cat <<'OUT'
300_2|300|PENDING
300_1|302|RUNNING
400|400|RUNNING
OUT"""
SCONTROL = """lines=(
"JobId=301 JobName=a name with spaces ArrayJobId=300 ArrayTaskId=0 JobState=COMPLETED ExitCode=0:0"
"JobId=302 JobName=sweep ArrayJobId=300 ArrayTaskId=1 JobState=RUNNING ExitCode=0:0"
"JobId=300 JobName=sweep ArrayJobId=300 ArrayTaskId=2 JobState=PENDING ExitCode=0:0"
"JobId=400 JobName=train JobState=RUNNING Reason=None ExitCode=0:0"
"JobId=401 JobName=train JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0")
for line in "${lines[@]}"; do
    if [[ $# -lt 4 || $line == "JobId=$4 "* ]]; then echo "$line"; fi
done"""


def test_without_accounting_states_come_from_one_squeue_and_one_scontrol_call(
    tmp_path, fake_slurm, capsys
):
    calls = fake_slurm(sacct=NO_ACCOUNTING, squeue=SQUEUE, scontrol=SCONTROL)
    records = [record(tmp_path, job_id=j, engine="slurm") for j in ("300", "400", "401", "500")]
    want = {"300": "COMPLETED 1, PENDING 1, RUNNING 1", "400": "RUNNING", "401": "FAILED",
            "500": "UNKNOWN"}  # fmt: skip
    assert jobs.states(records) == want
    assert [(t.task, t.job_id) for t in jobs.job_states(records)["300"].tasks] == [
        ("300_0", "301"),
        ("300_1", "302"),
        ("300_2", ""),
    ]
    user = pwd.getpwuid(os.getuid()).pw_name
    # sacct once: once it failed, later calls (a follow's polls) ask the controller only.
    assert calls.read_text().splitlines() == [
        "sacct -X -n -P -o JobID,JobIDRaw,State -j 300,400,401,500",
        f"squeue -h -r -u {user} -o %i|%A|%T", "scontrol show job -o",
        f"squeue -h -r -u {user} -o %i|%A|%T", "scontrol show job -o",
    ]  # fmt: skip
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1, said  # said once
    assert "Slurm accounting storage is disabled" in said[0]
    assert "states come from the controller" in said[0] and "MinJobAge" in said[0]
    assert jobs.from_controller()
    assert jobs.exit_code(records[2]) == 3  # from scontrol, sacct having nothing


def test_without_a_controller_either_every_state_is_unknown(tmp_path, fake_slurm):
    down = 'echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1'
    fake_slurm(sacct=NO_ACCOUNTING, squeue=down, scontrol=down)
    assert jobs.states([record(tmp_path, job_id="9", engine="slurm")]) == {"9": "UNKNOWN"}


def test_the_expansion_of_waiting_array_tasks():
    assert status._expand("7_[1-3,5%2]") == ["7_1", "7_2", "7_3", "7_5"]
    assert status._expand("7_4") == ["7_4"] and status._expand("7") == ["7"]
    assert status._expand("7_[odd]") == ["7_[odd]"]


def test_ctrl_c_during_follow_says_what_happens_to_the_job(tmp_path, capsys):
    def interrupted() -> str:
        raise KeyboardInterrupt

    slurm = record(tmp_path, engine="slurm")
    with pytest.raises(KeyboardInterrupt):
        jobs.follow(slurm, interrupted, io.StringIO())
    assert capsys.readouterr().err == (
        "slurmddp: stopped following job 77; the job goes on (queued): slurmddp status 77, "
        "slurmddp logs 77 -f; slurmddp cancel 77 ends it\n"
    )
    # A --local job in the terminal's process group got the Ctrl-C too: here, it ended.
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        jobs.follow(record(tmp_path, job_id=done), interrupted, io.StringIO())
    assert capsys.readouterr().err == (
        f"slurmddp: stopped following job {done}, which ended with it (CANCELLED)\n"
    )


def test_array_tasks_accounting_does_not_list_yet_count_as_waiting(tmp_path, fake_slurm):
    # Early in an array's life sacct may list only its first task: a follow ended on it
    # ("COMPLETED 1") while two tasks had not started.
    fake_slurm(sacct="echo '100_0|100|COMPLETED'")
    array = record(tmp_path, job_id="100", engine="slurm", array="0-2")
    state = jobs.states([array])["100"]
    assert state == "PENDING 2, COMPLETED 1" and not jobs.is_final(state)
    assert jobs.states([record(tmp_path, job_id="100", engine="slurm")]) == {"100": "COMPLETED 1"}


def test_the_array_index_list_is_read_from_sbatchs_arguments():
    assert jobs.array_indices(["--array=0-15%4"]) == "0-15%4"
    assert jobs.array_indices(["--exclusive", "-a", "1,3"]) == "1,3"
    assert jobs.array_indices(["-a2-4"]) == "2-4"
    assert jobs.array_indices(["--qos=low"]) == ""
    assert jobs.array_tasks("7", "1,4-8:2%2") == ["7_1", "7_4", "7_6", "7_8"]
    assert jobs.array_tasks("7", "") == [] and jobs.array_tasks("7", "x-3") == []

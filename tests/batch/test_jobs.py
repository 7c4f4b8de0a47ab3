"""The job registry, local job states and --follow, without a scheduler."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from slurmddp.batch import jobs


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


def test_local_state_reads_the_ranks_exit_files(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    r = record(tmp_path, job_id=done)
    assert jobs.local_state(r) == "CANCELLED"  # dead, and no rank said how it ended
    for rank, code in enumerate((0, 0)):
        jobs.local_exit_path(tmp_path, done, rank).write_text(f"{code}\n")
    assert jobs.local_state(r) == "COMPLETED"
    jobs.local_exit_path(tmp_path, done, 1).write_text("3\n")
    assert jobs.local_state(r) == "FAILED"
    assert jobs.exit_code(r) == 3
    assert jobs.local_state(record(tmp_path, job_id=str(os.getpid()))) == "RUNNING"


def test_follow_prints_state_changes_and_the_log_until_the_end(tmp_path):
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
    assert jobs.follow(r, state, out, poll_s=0.01, max_poll_s=0.01) == "COMPLETED"
    assert out.getvalue() == (
        "[slurmddp] job 77: PENDING\n[slurmddp] job 77: RUNNING\nstep\nstep\n"
        "[slurmddp] job 77: COMPLETED\n"
    )

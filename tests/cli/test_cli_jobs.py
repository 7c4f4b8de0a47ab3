"""`slurmddp status|logs` as a user types them, against faked Slurm clients: arrays, a cluster
without accounting, and Ctrl-C (exit status 130, no traceback)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurmddp.batch import jobs
from tests.conftest import launcher_free_env, wait_until

PING_OK = 'if [[ $1 == ping ]]; then echo "Slurmctld(primary) at localhost is UP"; exit 0; fi'


def fakes(tmp_path: Path, **bodies: str) -> dict[str, str]:
    """The environment of a slurmddp whose Slurm clients are `bodies` (bash); each call is
    appended to tmp_path/calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in bodies.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >>{tmp_path}/calls.log\n{body}\n')
        path.chmod(0o755)
    return launcher_free_env(XDG_STATE_HOME=str(tmp_path / "state"),
                             XDG_CONFIG_HOME=str(tmp_path / "config"),
                             PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip


def register(tmp_path: Path, job_id: str, name: str = "sweep") -> jobs.JobRecord:
    r = jobs.JobRecord(job_id=job_id, folder=str(tmp_path / "out"), name=name, engine="slurm",
                       tasks=1, submitted=0.0)  # fmt: skip
    jobs.remember(r, {"XDG_STATE_HOME": str(tmp_path / "state")})
    return r


def slurmddp(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmddp", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


SACCT_ARRAY = """cat <<'OUT'
100_0|101|COMPLETED
100_1|102|RUNNING
100_2|103|RUNNING
100_[3]|100|PENDING
200|200|FAILED
OUT"""


def test_status_shows_an_array_as_one_line_and_its_tasks_with_verbose(tmp_path):
    env = fakes(tmp_path, sacct=SACCT_ARRAY, scontrol=PING_OK)
    register(tmp_path, "100")
    register(tmp_path, "200", name="plain")
    r = slurmddp("status", env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = str(tmp_path / "out")
    # Nothing of their story yet (no events): a dash in its columns.
    assert r.stdout.splitlines() == [
        "       JOB  STATE                             RUNS REQ   ELAPSED    STEP    CKPT  NAME"
        "                 DIRECTORY",
        "       100  RUNNING 2, COMPLETED 1, PENDING 1    -   0         -       -       -  sweep"
        f"                {out}",
        "       200  FAILED                               -   0         -       -       -  plain"
        f"                {out}",
    ]  # fmt: skip
    verbose = slurmddp("status", "-v", "100", env=env, cwd=tmp_path).stdout.splitlines()
    pad = " " * 36
    assert verbose[2:] == [
        f"     100_0  COMPLETED                         {pad}job 101              {out}/101",
        f"     100_1  RUNNING                           {pad}job 102              {out}/102",
        f"     100_2  RUNNING                           {pad}job 103              {out}/103",
        f"     100_3  PENDING                           {pad}-                    (not started)",
    ]
    # One sacct call for both jobs, and one ping of the controller.
    assert (tmp_path / "calls.log").read_text().splitlines()[:2] == [
        "sacct -X -n -P -o JobID,JobIDRaw,State -j 100,200",
        "scontrol ping",
    ]


def test_status_without_accounting_says_once_where_states_come_from(tmp_path):
    env = fakes(
        tmp_path,
        sacct='echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1',
        squeue="echo '7|7|RUNNING'",
        scontrol=PING_OK + "\necho 'JobId=7 JobName=x JobState=RUNNING ExitCode=0:0'",
    )
    for job_id in ("7", "8"):
        register(tmp_path, job_id)
    r = slurmddp("status", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [line.split()[:2] for line in r.stdout.splitlines()[1:]] == [
        ["7", "RUNNING"],
        ["8", "UNKNOWN"],
    ]
    assert r.stderr.count("\n") == 1 and "states come from the controller" in r.stderr, r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["sacct", "squeue", "scontrol", "scontrol"]  # + ping


@pytest.mark.parametrize("argv", [["status", "--help"], ["status"], ["logs", "--help"]])
def test_status_and_logs_never_import_torch(argv, tmp_path):
    code = (
        "import sys\nfrom slurmddp.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env=launcher_free_env(XDG_STATE_HOME=str(tmp_path)))  # fmt: skip
    assert "TORCH False" in r.stderr, r.stderr


# ---- Ctrl-C ------------------------------------------------------------------------------


def interrupted(argv: list[str], env: dict[str, str], cwd: Path, ready) -> tuple[int, str, str]:
    """Start ``slurmddp ARGV``, send it SIGINT once `ready()` (as Ctrl-C would), and return its
    exit status, stdout and stderr."""
    out, err = cwd / "stdout", cwd / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "slurmddp", *argv], env=env, cwd=cwd,
                                stdout=o, stderr=e, text=True)  # fmt: skip
        try:
            wait_until(lambda: ready(out.read_text()), 60, f"slurmddp {argv} to get going")
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    return rc, out.read_text(), err.read_text()


def test_ctrl_c_during_status_exits_130_without_a_traceback(tmp_path):
    env = fakes(tmp_path, sacct="exec sleep 60")  # accounting slow to answer
    register(tmp_path, "5")
    calls = tmp_path / "calls.log"
    rc, out, err = interrupted(["status"], env, tmp_path, lambda _: calls.exists())
    assert rc == 130, err
    assert err == "" and out == ""


def test_ctrl_c_during_logs_follow_leaves_the_job_running_and_says_so(tmp_path):
    env = fakes(tmp_path, sacct="echo '5|5|RUNNING'")
    r = register(tmp_path, "5")
    r.log(0).parent.mkdir(parents=True)
    r.log(0).write_text("step 1\n")
    rc, out, err = interrupted(["logs", "-f", "5"], env, tmp_path, lambda out: "step 1" in out)
    assert rc == 130, err
    assert out == "[slurmddp] job 5: RUNNING\nstep 1\n"
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "stopped following job 5; the job goes on (RUNNING): slurmddp status 5" in err


def test_ctrl_c_during_submit_follow_leaves_the_job_running_and_says_so(tmp_path):
    env = fakes(tmp_path, sbatch='echo "Submitted batch job 4242"',
                sacct="echo '4242|4242|PENDING'")  # fmt: skip
    (tmp_path / "train.py").write_text("print('hi')\n")
    rc, out, err = interrupted(["submit", "--follow", "--json", "train.py"], env, tmp_path,
                               lambda out: "PENDING" in out)  # fmt: skip
    assert rc == 130, err
    assert json.loads(out.splitlines()[0])["job_id"] == "4242"
    assert out.splitlines()[1:] == ["[slurmddp] job 4242: PENDING"]
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "stopped following job 4242; the job goes on (PENDING): slurmddp status" in err
    assert not (tmp_path / "calls.log").read_text().count("scancel")


# ---- cancel and the commands' errors (issue 44) ----------------------------------------------


def test_cancel_of_an_ended_job_says_so_and_cancels_only_the_others(tmp_path):
    env = fakes(tmp_path, sacct="echo '5|5|COMPLETED'; echo '6|6|RUNNING'", scancel="exit 0")
    register(tmp_path, "5")
    register(tmp_path, "6")
    r = slurmddp("cancel", "5", "6", env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [
        "cancelled 6",
        "job 5 had already ended (COMPLETED): nothing to cancel",
    ]
    assert "scancel 6" in (tmp_path / "calls.log").read_text().splitlines()
    alone = slurmddp("cancel", "5", env=env, cwd=tmp_path)
    assert alone.stdout == "job 5 had already ended (COMPLETED): nothing to cancel\n"
    assert (tmp_path / "calls.log").read_text().count("scancel") == 1  # none for an ended job


def test_cancel_of_an_ended_local_job_says_so(tmp_path):
    # No process has this id (above Linux's pid_max): the job's controller has ended.
    r = jobs.JobRecord(job_id="999999999", folder=str(tmp_path / "out"), name="x", engine="local",
                       tasks=1, submitted=0.0)  # fmt: skip
    jobs.remember(r, {"XDG_STATE_HOME": str(tmp_path / "state")})
    (tmp_path / "out").mkdir()
    jobs.local_exit_path(r.folder, r.job_id).write_text("0\n")
    out = slurmddp("cancel", r.job_id, env=fakes(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "job 999999999 had already ended (COMPLETED): nothing to cancel\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--bogus"],
        ["status", "-x", "5"],
        ["logs", "5", "--bogus"],
        ["cancel", "5", "--all"],
        ["profiles", "--bogus"],
        ["doctor", "--bogus"],
    ],
)
def test_a_commands_errors_are_prefixed_with_the_command(argv, tmp_path):
    r = slurmddp(*argv, env=fakes(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"slurmddp {argv[0]}: error: unrecognized arguments: "), r.stderr
    assert r.stderr.endswith(f"(see slurmddp {argv[0]} --help)\n"), r.stderr


def test_status_abbreviates_no_option(tmp_path):
    r = slurmddp("status", "--verb", env=fakes(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "unrecognized arguments: --verb" in r.stderr, r.stderr

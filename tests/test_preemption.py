"""The stop protocol in real processes: should_stop, mark_done and every requeue route."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurmddp.preemption import api as preemption
from tests.conftest import launcher_free_env


@pytest.mark.parametrize(
    ("environ", "route"),
    [
        ({"SLURMDDP_REQUEUE_FILE": "/j/requeue", "SLURM_JOB_ID": "7"}, "batch"),
        ({"SLURMDDP_LOCAL_RESTART_FILE": "/j/7_restarts"}, "local"),
        ({"SLURM_JOB_ID": "7"}, "scontrol"),
        ({}, "none"),
    ],
    ids=["our-batch-script", "local-emulation", "plain-srun-in-a-job", "no-scheduler"],
)
def test_requeue_route(environ, route):
    assert preemption.requeue_route(environ) == route


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=launcher_free_env(**env), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_mark_done_ends_the_stop_protocol(tmp_path):
    done = tmp_path / "done"
    r = run_python("""
        import os, signal, slurmddp
        slurmddp.mark_done()
        os.kill(os.getpid(), signal.SIGUSR2)
        print(slurmddp.should_stop())
        slurmddp.requeue()
        """, SLURMDDP_DONE_FILE=str(done),
        SLURMDDP_REQUEUE_FILE=str(tmp_path / "requeue"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "the job is marked done: not requeued" in r.stderr
    assert done.exists() and not (tmp_path / "requeue").exists()


REQUEUE = """
    import os, signal, time, slurmddp
    slurmddp.should_stop()
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.1)
    assert slurmddp.should_stop()
    slurmddp.requeue()
"""


def test_under_the_batch_script_rank_0_leaves_the_reason_and_every_rank_exits_0(tmp_path):
    requeue = tmp_path / "requeue"
    for rank in ("1", "0"):
        r = run_python(REQUEUE, RANK=rank, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue))
        assert r.returncode == 0, r.stderr
        assert requeue.exists() == (rank == "0")
    assert requeue.read_text() == "USR2\n"


def test_local_emulation_counts_the_restart_and_asks_submitit_to_requeue(tmp_path):
    counter = tmp_path / "5_restarts"
    r = run_python(REQUEUE, SLURMDDP_LOCAL_RESTART_FILE=str(counter), SLURM_RESTART_COUNT="1",
                   SLURM_JOB_ID="5")  # fmt: skip
    assert r.returncode == preemption.LOCAL_REQUEUE_STATUS, r.stderr
    assert counter.read_text() == "2\n"
    assert "job 5 stopped (signal, USR2) at restart 1 after its checkpoint: requeued (2 of 3)" \
        in r.stderr


def test_at_the_requeue_limit_the_job_ends_non_zero_with_the_reason(tmp_path):
    counter = tmp_path / "5_restarts"
    r = run_python(REQUEUE, SLURMDDP_LOCAL_RESTART_FILE=str(counter), SLURM_RESTART_COUNT="2",
                   SLURMDDP_MAX_REQUEUES="2")  # fmt: skip
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "not requeued, the limit of 2 requeues (--max-requeues) is reached" in r.stderr
    assert not counter.exists()


def test_outside_slurm_nothing_requeues_and_the_status_says_so():
    r = run_python(REQUEUE)
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "outside a Slurm job: nothing requeues it" in r.stderr


def fake_scontrol(tmp_path: Path, status: int = 0, preempted: bool = False) -> dict[str, str]:
    """A stand-in scontrol that records its arguments and shows a running job (the real one is
    used on the cluster)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    stamp = "2026-11-22T11:00:00" if preempted else "None"
    show = f"JobId=41 JobState=RUNNING PreemptTime={stamp} TimeLimit=UNLIMITED RunTime=00:01:00"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
                    f'if [ "$1" = show ]; then echo "{show}"; exit 0; fi\n'
                    f'echo refused >&2\nexit {status}\n')  # fmt: skip
    tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_without_the_batch_script_rank_0_runs_scontrol_requeue_for_the_array_task(tmp_path):
    env = fake_scontrol(tmp_path)
    array = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    r = run_python(REQUEUE, RANK="1", **array, **env)
    assert r.returncode == 0 and not (tmp_path / "calls").exists()
    r = run_python(REQUEUE, RANK="0", **array, **env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text() == "show job -o 41\nrequeue 40_3\n"
    assert "job 40_3 stopped (signal, USR2) at restart 0 after its checkpoint: requeued (1 of 3)" \
        in r.stderr


@pytest.mark.parametrize("preempted", [True, False])
def test_without_the_batch_script_term_requeues_only_a_preempted_job(tmp_path, preempted):
    # Slurm's default preemption signalling sends TERM, as scancel does: Slurm's record of the
    # job tells them apart.
    env = fake_scontrol(tmp_path, preempted=preempted)
    code = REQUEUE.replace("SIGUSR2", "SIGTERM")
    r = run_python(code, RANK="0", SLURM_JOB_ID="41", **env)
    calls = (tmp_path / "calls").read_text()
    if preempted:
        assert r.returncode == 0 and calls.endswith("requeue 41\n"), r.stderr
        assert "stopped (preempted, TERM)" in r.stderr
    else:
        assert r.returncode == preemption.NOT_REQUEUED_STATUS and "requeue 41" not in calls
        assert "stopped (TERM, sent by hand)" in r.stderr and "not requeued" in r.stderr


def test_a_failing_scontrol_requeue_ends_the_job_non_zero(tmp_path):
    r = run_python(REQUEUE, SLURM_JOB_ID="41", **fake_scontrol(tmp_path, status=1))
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "scontrol requeue 41 failed: refused" in r.stderr


def test_requeue_waits_for_an_asynchronous_save_in_flight(tmp_path):
    requeue = tmp_path / "requeue"
    r = run_python(f"""
        import os, signal, time, torch, slurmddp
        from slurmddp.preemption import api as preemption
        preemption.install()
        ckpt = slurmddp.Checkpointer({str(tmp_path / "ckpt")!r}, async_save=True)
        ckpt.save(7, {{"w": torch.rand(64 << 20)}})  # 256 MiB: still being written on return
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)  # taken by the signal thread, then by the main thread's handler
        assert slurmddp.should_stop()
        slurmddp.requeue()
        """, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue))  # fmt: skip
    assert r.returncode == 0, r.stderr
    latest = tmp_path / "ckpt" / "latest"
    assert latest.read_text().strip() == "step-00000007"
    # The reason is left for the batch shell only once the checkpoint is published.
    assert requeue.stat().st_mtime_ns >= latest.stat().st_mtime_ns

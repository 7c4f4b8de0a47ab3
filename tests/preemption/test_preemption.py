"""The stop protocol in real processes: should_stop, mark_done and every requeue route."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurmddp.preemption import api as preemption
from slurmddp.preemption import signals
from tests.conftest import launcher_free_env


@pytest.mark.parametrize(
    ("environ", "route"),
    [
        ({"SLURMDDP_REQUEUE_FILE": "/j/requeue", "SLURM_JOB_ID": "7"}, "batch"),
        ({"SLURM_JOB_ID": "7"}, "scontrol"),
        ({}, "none"),
    ],
    ids=["our-batch-script", "plain-srun-in-a-job", "no-scheduler"],
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
        import os, signal, time, slurmddp
        slurmddp.mark_done()
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.1)  # delivered through another thread: a moment later, under load
        print(slurmddp.should_stop())
        slurmddp.requeue()
        """, SLURMDDP_DONE_FILE=str(done),
        SLURMDDP_REQUEUE_FILE=str(tmp_path / "requeue"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "the job is marked done: not requeued" in r.stderr
    assert done.exists() and not (tmp_path / "requeue").exists()


@pytest.fixture
def environ(monkeypatch):
    """Sets this process's environment for one test: launcher and slurmddp variables cleared."""
    clean = launcher_free_env()
    for name in list(os.environ):
        if name not in clean or name.startswith("SLURMDDP_"):
            monkeypatch.delenv(name)

    def set_(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_


def agreed_to_stop(bits: int = signals.STOP) -> preemption.State:
    """A fresh protocol state, as after the ranks agreed on `bits`: no handler is installed, so
    this process's signals stay as they are (the process's own state is untouched too)."""
    state = preemption.State()
    state.asked = True  # the first call would install the handlers
    state.receiver.seen = bits  # what the handler does
    assert state.should_stop() and state is not preemption.state()
    return state


def requeue(state: preemption.State) -> int | str | None:
    with pytest.raises(SystemExit) as e:
        state.requeue()
    return e.value.code


def test_a_fresh_state_is_independent_of_the_process_one(environ, capsys):
    state = agreed_to_stop()
    assert state.agreed == signals.STOP and preemption.state().agreed == 0
    state.done = True
    assert not state.should_stop()  # done wins
    assert "USR2 received: every rank stops at this step boundary" in capsys.readouterr().err


def test_under_the_batch_script_rank_0_leaves_the_reason_and_every_rank_exits_0(tmp_path,
                                                                                 environ):
    requeue_file = tmp_path / "requeue"
    for rank in ("1", "0"):
        environ(RANK=rank, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue_file))
        assert requeue(agreed_to_stop()) == 0
        assert requeue_file.exists() == (rank == "0")
    assert requeue_file.read_text() == "USR2\n"


def test_outside_slurm_nothing_requeues_and_the_status_says_so(environ, capsys):
    assert requeue(agreed_to_stop()) == preemption.NOT_REQUEUED_STATUS
    assert "outside a Slurm job: nothing requeues it" in capsys.readouterr().err


def fake_scontrol(tmp_path: Path, status: int = 0, preempted: bool = False,
                  restarts_after: int = 0) -> dict[str, str]:  # fmt: skip
    """A stand-in scontrol that records its arguments and shows a running job (the real one is
    used on the cluster); after a requeue it shows `restarts_after`, whatever it answered."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    stamp = "2026-11-22T11:00:00" if preempted else "None"
    show = f"JobId=41 JobState=RUNNING PreemptTime={stamp} TimeLimit=UNLIMITED RunTime=00:01:00"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
                    f'restarts=0\n'
                    f'if [ -e {tmp_path}/requeued ]; then restarts={restarts_after}; fi\n'
                    f'if [ "$1" = show ]; then echo "{show} Restarts=$restarts"; exit 0; fi\n'
                    f': > {tmp_path}/requeued\n'
                    f'echo refused >&2\nexit {status}\n')  # fmt: skip
    tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_at_the_requeue_limit_the_job_ends_non_zero_and_slurm_is_told(tmp_path, environ,
                                                                      capsys):  # fmt: skip
    environ(SLURM_JOB_ID="41", SLURM_RESTART_COUNT="2", SLURMDDP_MAX_REQUEUES="2",
            **fake_scontrol(tmp_path))  # fmt: skip
    assert requeue(agreed_to_stop()) == preemption.NOT_REQUEUED_STATUS
    assert "not requeued, the limit of 2 requeues (--max-requeues) is reached" in \
        capsys.readouterr().err
    # A preempted job is requeued by Slurm itself unless it is told not to be.
    assert (tmp_path / "calls").read_text() == "show job -o 41\nupdate JobId=41 Requeue=0\n"


def test_without_the_batch_script_rank_0_runs_scontrol_requeue_for_the_array_task(tmp_path,
                                                                                   environ,
                                                                                   capsys):
    array = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    environ(RANK="1", **array, **fake_scontrol(tmp_path))
    assert requeue(agreed_to_stop()) == 0 and not (tmp_path / "calls").exists()
    environ(RANK="0")
    assert requeue(agreed_to_stop()) == 0
    assert (tmp_path / "calls").read_text() == "show job -o 41\nrequeue 40_3\n"
    assert "job 40_3 stopped (signal, USR2) at restart 0 after its checkpoint: requeued (1 of 3)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("preempted", [True, False])
def test_without_the_batch_script_term_requeues_only_a_preempted_job(tmp_path, environ, capsys,
                                                                     preempted):  # fmt: skip
    # Slurm's default preemption signalling sends TERM, as scancel does: Slurm's record of the
    # job tells them apart.
    environ(RANK="0", SLURM_JOB_ID="41", **fake_scontrol(tmp_path, preempted=preempted))
    status = requeue(agreed_to_stop(signals.TERM))
    calls, err = (tmp_path / "calls").read_text(), capsys.readouterr().err
    if preempted:
        assert status == 0 and calls.endswith("requeue 41\n"), err
        assert "stopped (preempted, TERM)" in err
    else:
        assert status == preemption.NOT_REQUEUED_STATUS and "requeue 41" not in calls
        assert "stopped (TERM, sent by hand)" in err and "not requeued" in err


def test_a_failing_scontrol_requeue_ends_the_job_non_zero(tmp_path, environ, capsys):
    environ(SLURM_JOB_ID="41", **fake_scontrol(tmp_path, status=1))
    assert requeue(agreed_to_stop()) == preemption.NOT_REQUEUED_STATUS
    assert "scontrol requeue 41 failed: refused" in capsys.readouterr().err


def test_a_requeue_whose_answer_was_lost_is_not_a_failure(tmp_path, environ, capsys):
    # The requeue's own TERM can end scontrol before it answers: Slurm's count says it went
    # through.
    environ(SLURM_JOB_ID="41", **fake_scontrol(tmp_path, status=143, restarts_after=1))
    assert requeue(agreed_to_stop()) == 0
    err = capsys.readouterr().err
    assert "requeued (1 of 3)" in err and "failed" not in err


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
        """, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue),
        # The job's end known: should_stop asks no scontrol about a job 7 of a live cluster.
        SLURM_JOB_END_TIME=str(int(time.time()) + 3600))  # fmt: skip
    assert r.returncode == 0, r.stderr
    latest = tmp_path / "ckpt" / "latest"
    assert latest.read_text().strip() == "step-00000007"
    # The reason is left for the batch shell only once the checkpoint is published.
    assert requeue.stat().st_mtime_ns >= latest.stat().st_mtime_ns

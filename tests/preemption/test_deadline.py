"""preemption.deadline: the ranks know the job's end and stop by themselves when no signal comes."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

import pytest

from slurmddp.checkpoint import Checkpointer
from slurmddp.preemption import api as preemption
from slurmddp.preemption import deadline
from tests.conftest import launcher_free_env


def test_the_stop_comes_the_lead_before_the_end_or_earlier_for_a_slow_save():
    assert deadline.stop_at(1000.0, 120) == 880.0
    assert deadline.stop_at(1000.0, 120, save_s=10) == 880.0
    assert deadline.stop_at(1000.0, 120, save_s=100) == 850.0  # 1.5 x 100 s
    assert deadline.slow_save(100, 120) is None
    said = deadline.slow_save(100.4, 60)
    assert said is not None and "took 100 s to save, longer than the stop signal's lead of 60 s" \
        in said and "--signal-lead 151 or more" in said  # fmt: skip


@pytest.mark.parametrize(("environ", "end"), [
    ({"SLURM_JOB_END_TIME": "1790000000"}, 1790000000.0),
    ({"SLURM_JOB_END_TIME": "0"}, None),  # Slurm's "no limit"
    ({"SLURM_JOB_END_TIME": "soon"}, None),
    ({}, None),
])  # fmt: skip
def test_the_end_from_slurms_variable(environ, end):
    assert deadline.job_end(environ) == end


def test_the_end_from_scontrol_is_read_in_local_time():
    when = datetime.datetime(2026, 11, 23, 7, 30, 0)
    shown = f"JobId=41 JobState=RUNNING TimeLimit=00:10:00 EndTime={when:%Y-%m-%dT%H:%M:%S} X=1"
    assert deadline.end_from_scontrol(shown) == when.timestamp()
    assert deadline.end_from_scontrol("JobId=41 EndTime=Unknown") is None
    # Without scontrol's answer (no job, not asked) nothing is guessed.
    assert deadline.job_end({"SLURM_JOB_ID": "41"}) is None


def fresh(end: float | None, lead: int = 60) -> preemption.State:
    state = preemption.State()
    state.asked = True  # no handlers installed in this process
    state.end = end
    state.stop_at = None if end is None else deadline.stop_at(end, lead)
    return state


def test_without_a_signal_the_ranks_stop_at_the_deadline(capsys):
    assert not fresh(time.time() + 120).should_stop()
    assert not fresh(None).should_stop()
    late = fresh(time.time() + 50)
    assert late.should_stop() and late.self_stopped
    assert "and no stop signal came: every rank stops at this step boundary" in (
        capsys.readouterr().err)


def test_a_slow_save_moves_the_stop_earlier(monkeypatch):
    monkeypatch.setenv("SLURMDDP_SIGNAL_LEAD", "60")
    state = fresh(time.time() + 100)
    assert not state.should_stop()
    state.note_save(70.0)  # 1.5 x 70 s > 100 s left
    assert state.should_stop()


def test_the_save_time_is_kept_with_the_checkpoints_and_warned_of_at_start_up(tmp_path, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("SLURMDDP_SIGNAL_LEAD", "1")
    monkeypatch.setattr(preemption, "_state", preemption.State())
    ckpt = Checkpointer(tmp_path)
    ckpt.save(3, {"x": 1})
    kept = json.loads((tmp_path / "save-time.json").read_text())
    assert kept["step"] == 3 and 0 <= kept["seconds"] < 60
    assert preemption.state().save_s is not None
    (tmp_path / "save-time.json").write_text(json.dumps({"step": 3, "seconds": 30.0}))
    capsys.readouterr()
    Checkpointer(tmp_path)  # the next run's start-up
    assert "the last checkpoint took 30 s to save, longer than the stop signal's lead of 1 s" in (
        capsys.readouterr().err)
    assert preemption.state().save_s == 30.0


def test_a_script_under_a_time_limit_without_a_signal_stops_by_itself(tmp_path):
    # The real first call: the end from SLURM_JOB_END_TIME, 50 s away, the lead 60 s.
    code = "import slurmddp; print(slurmddp.should_stop())"
    env = launcher_free_env(SLURM_JOB_END_TIME=str(int(time.time()) + 50),
                            SLURMDDP_SIGNAL_LEAD="60")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "True\n"), r.stderr
    env["SLURM_JOB_END_TIME"] = str(int(time.time()) + 500)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert (r.returncode, r.stdout) == (0, "False\n"), r.stderr

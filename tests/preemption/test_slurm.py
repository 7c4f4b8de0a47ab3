"""A verdict carried out with Slurm's clients (stand-ins here; the clusters run the real ones)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from slurmddp.preemption import slurm
from slurmddp.preemption.decision import Decision, Facts
from slurmddp.protocol import ACTIONS, EXCLUDED_FILE_VAR

SCONTROL = """#!/bin/sh
echo "$*" >> "$CALLS"
case $1 in
    show) echo "JobId=7 JobState=${STATE:-RUNNING} Restarts=${RESTARTS:-0}" ;;
    requeue) exit "${REQUEUE_STATUS:-0}" ;;
    update) exit "${UPDATE_STATUS:-0}" ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    (tmp_path / "scontrol").write_text(SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    return lambda: (tmp_path / "calls").read_text().splitlines() if (
        tmp_path / "calls").exists() else []


FACTS = Facts(step_status=0, asked="USR2", target="7_2")


@pytest.mark.parametrize("action", ACTIONS)
def test_every_action_asks_slurm_only_what_it_needs(action, scontrol, tmp_path):
    verdict = Decision(action, 75 if action == "final" else 0, exclude="n[2,4]" if action ==
                       "requeue" else "", left_behind="n2: broken")  # fmt: skip
    said: list[str] = []
    environ = {EXCLUDED_FILE_VAR: str(tmp_path / "excluded")}
    assert slurm.carry_out(verdict, FACTS, "7", environ, said.append) == verdict
    assert scontrol() == {"final": ["update JobId=7 Requeue=0"],
                          "requeue": ["requeue 7_2", "update JobId=7_2 ExcNodeList=n[2,4]"],
                          }.get(action, [])  # fmt: skip
    assert (tmp_path / "excluded").exists() == (action == "requeue") and not said


def test_a_refused_exclusion_is_said_and_the_requeue_stands(scontrol, monkeypatch, tmp_path):
    monkeypatch.setenv("UPDATE_STATUS", "1")
    verdict = Decision("requeue", 0, exclude="n2", left_behind="n2: broken")
    said: list[str] = []
    environ = {EXCLUDED_FILE_VAR: str(tmp_path / "excluded")}
    assert slurm.carry_out(verdict, FACTS, "7", environ, said.append) == verdict
    assert said == ["Slurm refused to exclude n2; the requeued job may land there again"]
    assert not (tmp_path / "excluded").exists()


@pytest.mark.parametrize(("restarts", "status"), [("0", 75), ("1", 0)])
def test_a_failed_requeue_looks_again_at_slurms_record(scontrol, monkeypatch, restarts, status):
    # The requeue's own TERM can end scontrol after the requeue went through: the count says.
    monkeypatch.setenv("REQUEUE_STATUS", "143")
    monkeypatch.setenv("RESTARTS", restarts)
    said: list[str] = []
    after = slurm.carry_out(Decision("requeue", 0), FACTS, "7", {}, said.append)
    assert after.status == status and scontrol() == ["requeue 7_2", "show job -o 7"]
    assert bool(said) == (status != 0)


def test_without_scontrol_nothing_is_carried_out_and_the_job_stops(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    said: list[str] = []
    after = slurm.carry_out(Decision("requeue", 0), dataclasses.replace(FACTS, target="7"), "7",
                            {}, said.append)  # fmt: skip
    assert after.action == "stop" and after.status == 75 and "scontrol requeue 7 failed" in said[0]

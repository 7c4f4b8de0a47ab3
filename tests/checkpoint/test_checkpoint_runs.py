"""Whose checkpoints `load_latest` resumes (issue 44 B): this run's (a job and its requeues), never
another job's unless asked (`resume_from`, or $SLURMDDP_RUN_ID), and one line on every resume."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from slurmddp.checkpoint import Checkpointer, CheckpointError
from slurmddp.protocol import RUN_ID_VAR

RUN_VARS = (RUN_ID_VAR, "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
            "SLURM_CLUSTER_NAME", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT")  # fmt: skip


@pytest.fixture
def job(monkeypatch):
    """Make this process a rank of Slurm job `job_id` (None: of no job), `restart` requeues on."""

    def become(job_id: str | None, restart: int = 0, **extra: str) -> None:
        for name in RUN_VARS:
            monkeypatch.delenv(name, raising=False)
        if job_id is not None:
            monkeypatch.setenv("SLURM_JOB_ID", job_id)
            if restart:
                monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        for name, value in extra.items():
            monkeypatch.setenv(name, value)

    return become


def save(directory: Path, *steps: int, lr: float = 0.1) -> None:
    ckpt = Checkpointer(directory, keep=5)
    for step in steps:
        ckpt.save(step, {"step": step, "lr": lr, "w": torch.full((2,), float(step))})
    ckpt.wait()


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def test_a_new_job_does_not_resume_another_jobs_checkpoint_and_says_so(tmp_path, job, capsys):
    ckpt_dir = tmp_path / "checkpoints"
    job("27974")
    save(ckpt_dir, 40)
    capsys.readouterr()
    job("27980")  # the second submission, from the same directory
    assert Checkpointer(ckpt_dir).load_latest() is None
    err = capsys.readouterr().err
    assert err == (f"slurmddp: not resuming {step_dir(ckpt_dir, 40)} (step 40): it was saved by "
                   "run 27974, and this is run 27980; starting from scratch. To resume it, pass "
                   "Checkpointer(resume_from='27974') (a new run from its state), or set "
                   f"{RUN_ID_VAR}=27974 (that run, continued)\n")  # fmt: skip


def test_a_requeued_job_resumes_its_own_checkpoint_naming_step_run_path(tmp_path, job, capsys):
    job("27974")
    save(tmp_path, 40)
    capsys.readouterr()
    job("27974", restart=1)  # the requeue: the same job id
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded.step == 40 and loaded.run_id == "27974"
    assert capsys.readouterr().err == (
        f"slurmddp: resuming from step 40 of run 27974: {step_dir(tmp_path, 40)}\n")


def test_in_a_shared_directory_the_newest_of_this_jobs_own_wins(tmp_path, job, capsys):
    job("2")
    save(tmp_path, 2, 3)
    job("1")
    save(tmp_path, 5)  # another job's, newer, and `latest` names it
    job("2", restart=1)
    loaded = Checkpointer(tmp_path).load_latest()
    assert loaded.step == 3 and loaded.state["step"] == 3 and loaded.run_id == "2"
    assert capsys.readouterr().err.endswith(
        f"slurmddp: resuming from step 3 of run 2: {step_dir(tmp_path, 3)}\n")


def test_a_damaged_own_checkpoint_falls_back_past_another_runs(tmp_path, job, capsys):
    job("2")
    save(tmp_path, 2, 3)
    job("1")
    save(tmp_path, 4)
    os.truncate(step_dir(tmp_path, 3) / "state.pt", 10)
    job("2")
    assert Checkpointer(tmp_path).load_latest().step == 2
    err = capsys.readouterr().err
    assert (f"checkpoint {step_dir(tmp_path, 3)} is truncated" in err
            and f"falling back to {step_dir(tmp_path, 2)}" in err)  # fmt: skip
    job("3")  # none of its own, one of them damaged: a fresh start, not an error
    assert Checkpointer(tmp_path).load_latest() is None


def test_resume_from_a_run_id_then_the_new_runs_own_checkpoints(tmp_path, job, capsys):
    job("27974")
    save(tmp_path, 40, lr=0.1)
    job("27980")
    loaded = Checkpointer(tmp_path, resume_from="27974").load_latest()
    assert loaded.step == 40 and loaded.run_id == "27974"
    assert capsys.readouterr().err == (
        f"slurmddp: resuming from step 40 of run 27974: {step_dir(tmp_path, 40)}\n")
    save(tmp_path, 10, lr=0.01)  # the new run's own, older by step
    job("27980", restart=1)  # its requeue resumes its own progress, not the other's state again
    loaded = Checkpointer(tmp_path, resume_from="27974").load_latest()
    assert (loaded.step, loaded.state["lr"], loaded.run_id) == (10, 0.01, "27980")


def test_resume_from_a_path_takes_its_newest_or_the_one_named(tmp_path, job, capsys):
    first = tmp_path / "first"
    job("11")
    save(first, 1, 2)
    job("12")
    ckpt = Checkpointer(tmp_path / "second", resume_from=first)
    assert ckpt.load_latest().step == 2
    assert Checkpointer(tmp_path / "second", resume_from=str(step_dir(first, 1))
                        ).load_latest().step == 1  # fmt: skip
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"slurmddp: resuming from step 2 of run 11: {step_dir(first, 2)}",
                     f"slurmddp: resuming from step 1 of run 11: {step_dir(first, 1)}"]  # fmt: skip


@pytest.mark.parametrize(("asked", "says"), [
    ("{tmp}/nowhere", "cannot resume from {tmp}/nowhere: it does not exist; give resume_from a "
                      "checkpoint directory or one of its step-*"),
    ("{tmp}/empty", "cannot resume from {tmp}/empty: it holds no checkpoint; give resume_from a "
                    "checkpoint directory or one of its step-*"),
    ("99", "cannot resume from run 99: {tmp}/ckpt holds no checkpoint of it; give resume_from "
           "the run id a manifest records, or a path (./99 for one here)"),
])  # fmt: skip
def test_resume_from_what_is_not_there_is_one_line_and_writes_nothing(tmp_path, job, asked,
                                                                       says):  # fmt: skip
    (tmp_path / "empty").mkdir()
    job("5")
    save(tmp_path / "ckpt", 3)
    before = sorted(os.listdir(tmp_path / "ckpt"))
    job("6")
    ckpt = Checkpointer(tmp_path / "ckpt", resume_from=asked.format(tmp=tmp_path))
    with pytest.raises(CheckpointError) as info:
        ckpt.load_latest()
    assert str(info.value) == says.format(tmp=tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_resume_from_must_be_a_run_or_a_path(tmp_path, bad):
    with pytest.raises(ValueError, match="resume_from must be a run id or a path"):
        Checkpointer(tmp_path, resume_from=bad)


def test_a_checkpoint_recording_no_run_is_resumed_only_without_one(tmp_path, job, capsys):
    job(None)  # python train.py, or mpirun outside Slurm: nothing names the run
    save(tmp_path, 7)
    assert json.loads((step_dir(tmp_path, 7) / "manifest.json").read_text())["run_id"] is None
    capsys.readouterr()
    assert Checkpointer(tmp_path).load_latest().step == 7  # run again the same way: resumed
    assert capsys.readouterr().err == (
        f"slurmddp: resuming from step 7 (saved without a run id): {step_dir(tmp_path, 7)}\n")
    job("300")  # a Slurm job does not take it over unasked
    assert Checkpointer(tmp_path).load_latest() is None
    assert capsys.readouterr().err == (
        f"slurmddp: not resuming {step_dir(tmp_path, 7)} (step 7): it was saved without a run "
        f"id, and this is run 300; starting from scratch. To resume it, pass "
        f"Checkpointer(resume_from='{step_dir(tmp_path, 7)}')\n")
    assert Checkpointer(tmp_path, resume_from=str(step_dir(tmp_path, 7))).load_latest().step == 7
    job("301")
    save(tmp_path / "job", 1)
    job(None)  # nor does a process without a run id take over a job's
    assert Checkpointer(tmp_path / "job").load_latest() is None


def test_each_array_task_is_a_run_of_its_own(tmp_path, job):
    job("1001", SLURM_ARRAY_JOB_ID="1000", SLURM_ARRAY_TASK_ID="1")
    save(tmp_path, 4)
    job("1002", SLURM_ARRAY_JOB_ID="1000", SLURM_ARRAY_TASK_ID="2")
    assert Checkpointer(tmp_path).load_latest() is None
    job("1001", 1, SLURM_ARRAY_JOB_ID="1000", SLURM_ARRAY_TASK_ID="1")  # task 1, requeued
    assert Checkpointer(tmp_path).load_latest().run_id == "1000_1"


def test_a_named_run_chains_jobs(tmp_path, job):
    job("50", **{RUN_ID_VAR: "pretrain"})
    save(tmp_path, 8)
    job("51", **{RUN_ID_VAR: "pretrain"})  # the user's name for the run, set again
    assert Checkpointer(tmp_path).load_latest().step == 8


def test_a_snapshot_is_compared_with_this_runs_durable_step(tmp_path, job, monkeypatch, capsys):
    monkeypatch.setenv("SLURMDDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    job("70")
    save(tmp_path / "ckpt", 100)  # another job's durable checkpoint, of a later step
    job("71")
    ckpt = Checkpointer(tmp_path / "ckpt", snapshot_every=1, snapshot_budget=None)
    for step in (1, 2, 3):
        ckpt.snapshot(step, {"step": step, "w": torch.full((2,), float(step))})
    ckpt.wait()
    capsys.readouterr()
    loaded = Checkpointer(tmp_path / "ckpt", snapshot_every=1).load_latest()
    assert loaded is not None and loaded.step == 3 and loaded.state["step"] == 3
    assert f"slurmddp: resuming from step 3 of run 71: {tmp_path / 'shm'}" in \
        capsys.readouterr().err  # fmt: skip


# -- the kept-back program: the README's loop submitted twice from one directory ----------------


@pytest.mark.ranks
def test_two_submissions_from_one_directory_do_not_share_training(tmp_path):
    from tests.batch.local.test_emulation import job_lines
    from tests.cli.test_cli_submit import slurmddp
    from tests.conftest import PROGRAMS, tagged_json

    shutil.copy(PROGRAMS / "readme_lr.py", tmp_path / "train.py")

    def submit(*argv: str) -> tuple[str, str, dict]:
        r = slurmddp("submit", "--local", "--follow", "--json", "--output", "jobs",
                     "--env", "OMP_NUM_THREADS=1", *argv, cwd=tmp_path, state=tmp_path / "state",
                     timeout=240)  # fmt: skip
        lines = "\n".join(job_lines(tmp_path / "jobs", r))
        assert r.returncode == 0, r.stdout + r.stderr + lines
        job = json.loads(r.stdout.splitlines()[0])["job_id"]
        return job, lines, tagged_json(lines, "RESULT ")[-1]

    # The first job is stopped after step 3, saves, is requeued and resumes: its own, as before.
    first, lines, one = submit("train.py", "--lr", "0.1", "--stop-at", "3")
    saved = tmp_path / "checkpoints" / "step-00000003"
    run = json.loads((saved / "manifest.json").read_text())["run_id"]
    assert first in run
    assert f"slurmddp: resuming from step 3 of run {run}: {saved}" in lines
    assert one["start"] == 3 and one["lr"] == 0.1

    # The second, with another learning rate: a run of its own, from scratch, saying why.
    _, lines, two = submit("train.py", "--lr", "0.01")
    assert f"slurmddp: not resuming {saved} (step 3): it was saved by run {run}" in lines
    assert "resuming from" not in lines.replace("not resuming", "")
    assert (two["start"], two["lr"]) == (0, 0.01) and two["digest"] != one["digest"]
    # Its code snapshot left the checkpoints out.
    snapped = [p.relative_to(tmp_path / "jobs" / "snapshots").as_posix()
               for p in (tmp_path / "jobs" / "snapshots").rglob("*")]  # fmt: skip
    assert not [p for p in snapped if "checkpoints" in p], snapped

    # Asked by the first run's id: this job is that run, continued from its checkpoint.
    _, lines, three = submit("--env", f"{RUN_ID_VAR}={run}", "train.py", "--lr", "0.1")
    assert f"slurmddp: resuming from step 3 of run {run}: {saved}" in lines
    assert three["start"] == 3 and three["digest"] == one["digest"]

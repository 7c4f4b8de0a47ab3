"""slurmddp.batch.functions.executor and .call: functions as jobs, run for real on this machine
(--local: submitit's LocalExecutor, every rank a process, gloo between them). The cluster's proofs
are in test_executor_cluster.py."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
from submitit.helpers import DelayedSubmission

import slurmddp
from slurmddp.batch.functions import call, executor
from tests.batch import functions
from tests.conftest import ROOT, handed_plan


@pytest.fixture
def local(tmp_path, monkeypatch):
    """An Executor for local jobs of 2 emulated nodes, its registry in tmp_path."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return slurmddp.Executor(tmp_path / "jobs", local=True, nodes=2)


def test_a_local_submission_leaves_this_process_environment_as_it_was(local, monkeypatch):
    # submitit's local controller takes the stop signal from its environment: given it at its
    # start only, never left in the submitting process's.
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    before = dict(os.environ)
    job = local.submit(functions.times, 6, 7)
    assert dict(os.environ) == before
    assert job.result(timeout=120) == (42, 0, "")


def test_every_rank_runs_the_function_and_rank_0s_value_comes_back(local):
    job = local.submit(functions.all_reduce, 10.0)
    assert job.result(timeout=120) == {"rank": 0, "world": 2, "host": job.result()["host"],
                                       "sum": 21.0, "local_rank": 0}  # fmt: skip
    assert [r["rank"] for r in job.results()] == [0, 1]
    assert job.state == "COMPLETED" and job.done() and job.exception() is None
    # An ordinary slurmddp job: the registry knows it.
    assert slurmddp.batch.jobs.find(job.job_id).name == "all_reduce"


def test_the_top_level_submit_takes_a_function_and_the_options(local, tmp_path):
    job = slurmddp.submit(functions.times, 6, folder=tmp_path / "jobs", local=True, nodes=1)
    assert job.result(timeout=120) == (6, 0, "")


def test_a_failure_names_the_first_rank_its_exception_and_traceback(local):
    job = local.submit(functions.fail_on, 1)
    with pytest.raises(slurmddp.JobFailedError) as caught:
        job.result(timeout=120)
    e = caught.value
    assert str(e).startswith(f"job {job.job_id}: rank 1 of 2 (on ")
    assert str(e).endswith("failed first: ValueError: rank 1 broke")
    assert e.rank == 1 and isinstance(e.error, ValueError)
    assert 'functions/__init__.py", line' in e.traceback and "rank 1 broke" in e.traceback
    assert isinstance(e.__cause__, executor.RemoteTraceback)  # printed above the one line
    assert job.state == "FAILED"


def test_a_value_that_cannot_be_pickled_is_a_failure_that_says_so(local):
    with pytest.raises(slurmddp.JobFailedError, match=r"rank \d of 2 .* returned a generator, "
                       r"which cannot be pickled"):  # fmt: skip
        job = local.submit(functions.unpicklable)
        job.result(timeout=120)
    assert job.state == "FAILED"


def test_an_exception_that_cannot_be_rebuilt_here_still_says_what_it_was(local):
    with pytest.raises(slurmddp.JobFailedError, match=r"Unloadable: 1\+2") as caught:
        local.submit(functions.raise_unloadable).result(timeout=120)
    assert caught.value.error is None and "raise Unloadable(1, 2)" in caught.value.traceback


@pytest.mark.ranks
def test_a_checkpointable_is_checkpointed_on_every_rank_at_the_agreed_stop(local, tmp_path):
    """The local rehearsal of a preemption (the stop signal 4 s into the first run); the cluster
    test does it with Slurm's own. The uninterrupted run it is compared with bit for bit is
    computed in this process (functions.uninterrupted_digest): a job of 2 more ranks proved no
    more (that every rank runs and rank 0's value comes back: the first test above)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    stopped = slurmddp.Executor(tmp_path / "jobs", local=True, nodes=2, signal_after=[4])
    job = stopped.submit(functions.Trainer(60, 0.1, str(marks)))
    out = job.result(timeout=180)
    assert out["steps"] == 60 and out["digest"] == functions.uninterrupted_digest(60, 2)  # bits
    assert out["runs"][0] == 0 and 0 < out["runs"][1] < 60, out  # resumed where it stopped
    made = sorted(p.name for p in marks.iterdir())
    assert len(made) == 2 and [m.split("-")[:4] for m in made] == [
        ["rank", "0", "restart", "0"], ["rank", "1", "restart", "0"]]  # fmt: skip
    assert {m.split("-")[-1] for m in made} == {str(out["runs"][1])}  # the same agreed step


@pytest.mark.ranks
def test_a_plain_function_stopped_by_the_protocol_is_called_again(local, tmp_path):
    job = slurmddp.Executor(tmp_path / "jobs", local=True, nodes=1, signal_after=[3]).submit(
        functions.Trainer(40, 0.1, str(tmp_path)).__call__)  # a bound method: no checkpoint
    out = job.result(timeout=180)
    assert out["steps"] == 40 and out["runs"] == [0], out  # started over: nothing was kept


def test_map_array_runs_a_job_per_item_and_counts_their_states(local):
    array = local.map_array(functions.times, [1, 2, 3], [10, 20, 30])
    assert len(array) == 3 and array.results(timeout=180) == [(10, 0, ""), (40, 0, ""),
                                                              (90, 0, "")]  # fmt: skip
    assert array.state == "COMPLETED 3" and array.done()


def test_unknown_options_and_bad_values_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"unknown job option 'lr'.*functools.partial"):
        slurmddp.Executor(tmp_path / "jobs", lr=0.1)
    with pytest.raises(slurmddp.batch.spec.jobspec.SpecError, match="nodes"):
        slurmddp.Executor(tmp_path / "jobs", nodes="0")
    with pytest.raises(TypeError, match="is not callable"):
        slurmddp.Executor(tmp_path / "jobs").submit(42)
    assert not (tmp_path / "jobs").exists()


def test_a_refused_submission_leaves_no_calls_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: no' >&2; exit 1\n")
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin")
    ex = slurmddp.Executor(tmp_path / "jobs", nodes=2)
    with pytest.raises(slurmddp.errors.SubmissionError, match="sbatch refused the job"):
        ex.submit(functions.times, 1)
    with pytest.raises(slurmddp.errors.SubmissionError):
        ex.map_array(functions.times, [1, 2])
    assert not (tmp_path / "jobs").exists()


def test_map_array_sends_one_slurm_array(tmp_path, monkeypatch):
    kept = tmp_path / "submitted.sh"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(
        f'#!/bin/sh\ncp "$1" {kept}\necho "Submitted batch job 4242"\n')
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    array = slurmddp.Executor(tmp_path / "jobs", nodes=2).map_array(
        functions.times, range(5), parallelism=2)  # fmt: skip
    script = kept.read_text()
    assert "#SBATCH --array=0-4%2" in script
    target = handed_plan(script).target
    assert target[target.index("--task") + 1] == "array"
    assert [j.job_id for j in array] == [f"4242_{i}" for i in range(5)]
    assert slurmddp.batch.jobs.find("4242").array == "0-4%2"
    with pytest.raises(slurmddp.batch.spec.jobspec.SpecError, match="map_array makes the array"):
        slurmddp.Executor(tmp_path / "jobs", sbatch_args=["--array=1-2"]).map_array(
            functions.times, [1])  # fmt: skip


def _main_function() -> None: ...


_main_function.__module__ = "__main__"


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (functions.times, ROOT),  # tests.batch.functions: the package's parent
        (functools.partial(functions.times, 2), ROOT),
        (functions.Trainer(1, 0, ""), ROOT),  # a callable object: its class's module
        (functions.Trainer(1, 0, "").checkpoint, ROOT),
        (pytest.raises, None),  # installed
        (os.getcwd, None),  # built in
    ],
)
def test_code_home_is_where_the_users_module_is_imported_from(fn, expected):
    assert executor.code_home(fn) == expected


def test_code_home_of_an_interactive_main_is_the_working_directory(monkeypatch, tmp_path):
    main = type(sys)("__main__")  # a notebook's or REPL's: no __file__
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.chdir(tmp_path)
    assert executor.code_home(_main_function) == tmp_path


def test_checkpoint_of_follows_submitits_rule():
    class Plain:
        def __call__(self) -> None: ...

    class Own(Plain):
        def __submitit_checkpoint__(self, *a):
            return DelayedSubmission(self, "own", *a)

        def checkpoint(self, *a):  # __submitit_checkpoint__ wins
            raise AssertionError

    class Wrong(Plain):
        def checkpoint(self):
            return "not a submission"

    assert call.checkpoint_of(DelayedSubmission(Plain())) is None
    assert call.checkpoint_of(DelayedSubmission(Own(), 1)).args == ("own", 1)
    with pytest.raises(TypeError, match="returned a str, not a DelayedSubmission"):
        call.checkpoint_of(DelayedSubmission(Wrong()))


def test_submitits_parameter_names_are_taken_as_ours(tmp_path):
    ex = slurmddp.Executor(tmp_path / "jobs", timeout_min=90, mem_gb=16, tasks_per_node=4,
                           slurm_partition="gpu", name="sweep", slurm_array_parallelism=3,
                           slurm_additional_parameters={"mail_type": "END"})  # fmt: skip
    spec = ex._spec(functions.times, tmp_path, "0", None)
    assert (spec.time_minutes, spec.mem, spec.ntasks_per_node, spec.partition, spec.job_name) == (
        90, "16G", 4, "gpu", "sweep")  # fmt: skip
    assert spec.sbatch_args == ("--mail-type=END",) and ex.array_parallelism == 3

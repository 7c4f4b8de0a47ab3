"""rank.identity.run_id: one id for a job and every requeue of it, from each launcher's names."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slurmddp
from slurmddp.protocol import RUN_ID_VAR
from slurmddp.rank.identity import run_id
from tests.conftest import launcher_free_env
from tests.fake_env import srun_env


def batch_env(job: str = "41", restarts: int = 0, **extra: str) -> dict[str, str]:
    """The batch shell's variables that bear on the run id, as Slurm sets them."""
    return {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_CLUSTER_NAME": "linux",
            "SLURM_RESTART_COUNT": str(restarts)} | extra  # fmt: skip


ARRAY_TASK = {"SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "4f1c-77", "RANK": "1", "WORLD_SIZE": "2"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_MCA_orte_hnp_uri": "2921262592.0;tcp://10.0.0.1:40311"}  # fmt: skip


@pytest.mark.parametrize(("environ", "expected"), [
    (batch_env(), "linux-41"),
    (batch_env(job="41", **ARRAY_TASK), "linux-40_3"),  # the task's own job id is 41
    (batch_env(SLURM_CLUSTER_NAME=""), "41"),  # no cluster name (submitit's local runs)
    ({"SLURM_JOBID": "41"}, "41"),  # the old name alone
    (batch_env(SLURM_CLUSTER_NAME="hpc.site/a"), "hpc-site-a-41"),
    (batch_env(SLURM_ARRAY_JOB_ID="40"), "linux-41"),  # half an array: the job
    (batch_env(**{RUN_ID_VAR: "pretrain-7b"}), "pretrain-7b"),  # the user's wins
    (batch_env(**{RUN_ID_VAR: " exp 1/lr=0.1 "}), "exp-1-lr-0-1"),  # sanitised
    (batch_env(**{RUN_ID_VAR: "//"}), "linux-41"),  # nothing safe in it: unset
    (batch_env(**{RUN_ID_VAR: ""}), "linux-41"),
    (batch_env() | TORCHRUN, "linux-41"),  # torchrun inside a job: the job's
    (TORCHRUN, "4f1c-77"),
    (TORCHRUN | {"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's default names no run
    (TORCHRUN | {"TORCHELASTIC_RUN_ID": "job:5"}, "job-5"),
    (TORCHRUN | {RUN_ID_VAR: "mine"}, "mine"),
    (OMPI, None),  # mpirun outside Slurm: nothing outlives the launch
    (OMPI | {RUN_ID_VAR: "mine"}, "mine"),
    ({}, None),
])  # fmt: skip
def test_run_id_from_each_launcher(environ, expected):
    assert run_id(environ) == expected


def test_every_run_of_a_requeued_job_and_every_rank_of_it_gets_the_same_id():
    shells = [batch_env(restarts=r, **ARRAY_TASK) for r in (0, 1, 5)]
    # srun passes the batch shell's variables on to its tasks, with the step's own on top.
    steps = [shell | srun_env(rank, [2, 2], job=41) for shell in shells for rank in range(4)]
    assert {run_id(env) for env in shells + steps} == {"linux-40_3"}
    assert run_id(batch_env(job="42", **ARRAY_TASK | {"SLURM_ARRAY_TASK_ID": "4"})) == "linux-40_4"
    assert run_id(batch_env(job="41") | {"SLURM_CLUSTER_NAME": "other"}) == "other-41"


@given(st.dictionaries(st.sampled_from([RUN_ID_VAR, "SLURM_JOB_ID", "SLURM_CLUSTER_NAME",
                                        "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
                                        "TORCHELASTIC_RUN_ID"]), st.text()))  # fmt: skip
def test_a_run_id_is_always_safe_for_trackers(environ):
    found = run_id(environ)
    assert found is None or re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?", found)


def test_slurmddp_run_id_reads_this_process_and_imports_no_torch():
    code = "import slurmddp, sys; print(slurmddp.run_id(), 'torch' in sys.modules)"
    for env, expected in ((batch_env(**ARRAY_TASK), "linux-40_3 False"), ({}, "None False")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=launcher_free_env(**env) | {RUN_ID_VAR: ""}, timeout=60)  # fmt: skip
        assert (r.returncode, r.stdout.strip()) == (0, expected), r.stderr


def test_slurmddp_run_id_is_this_modules(monkeypatch):
    monkeypatch.setenv(RUN_ID_VAR, "chained")
    assert slurmddp.run_id is run_id and slurmddp.run_id() == "chained"

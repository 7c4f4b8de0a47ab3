"""`slurmddp submit` on the real local Slurm cluster: the job runs, is tracked, logs per rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, tagged_json

pytestmark = pytest.mark.cluster

TRAIN = str(ROOT / "examples" / "ddp_train.py")


def slurmddp(cluster, *args: str, cwd: Path, timeout: float = 240):
    env = cluster.env(XDG_STATE_HOME=str(cwd / "state"), XDG_CONFIG_HOME=str(cwd / "config"))
    return subprocess.run([sys.executable, "-m", "slurmddp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def submitted(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.startswith("{"), r.stdout + r.stderr
    return json.loads(r.stdout.splitlines()[0])


def rank_results(job: dict, pattern: str = "rank-{}.log", count: int = 4) -> list[dict]:
    folder = Path(job["job_dir"]) / job["job_id"]
    return [x for i in range(count) for x in tagged_json((folder / pattern.format(i)).read_text(),
                                                        "RESULT ")]  # fmt: skip


def test_submit_follow_runs_to_completion_with_a_log_per_rank(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--nodes", "2",
                 "--ntasks-per-node", "2", TRAIN, "--steps", "6", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    # RUNNING may fall between two polls (sacct can learn of the start late); the end may not.
    states = [x.rsplit(": ", 1)[1] for x in r.stdout.splitlines() if x.startswith("[slurmddp]")]
    assert states[-1] == "COMPLETED", r.stdout
    assert set(states) <= {"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}, states
    assert "parameters identical on all ranks: True" in r.stdout  # rank 0's log, streamed
    results = rank_results(job)
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    assert len({x["digest"] for x in results}) == 1

    status = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path)
    assert f"{job['job_id']}  COMPLETED" in status.stdout, status.stdout

    # The same training run with --local, no Slurm at all, reaches the same parameters.
    local = slurmddp(slurm_cluster, "submit", "--local", "--follow", "--json", "--nodes", "2",
                     "--ntasks-per-node", "2", TRAIN, "--steps", "6", cwd=tmp_path)  # fmt: skip
    assert local.returncode == 0, local.stdout + local.stderr
    job_local = submitted(local)
    logs = Path(job_local["job_dir"]).glob(f"{job_local['job_id']}_*_log.out")
    local_digests = {x["digest"] for p in logs for x in tagged_json(p.read_text(), "RESULT ")}
    assert local_digests == {results[0]["digest"]}


@pytest.mark.parametrize("where", ["cluster", "local"])
def test_launcher_variables_left_in_the_submitting_shell_never_decide_a_rank(slurm_cluster,
                                                                            tmp_path, where):
    # sbatch (and submitit's local executor) pass the submitting shell's environment on.
    env = slurm_cluster.env(XDG_STATE_HOME=str(tmp_path / "state"), RANK="0", WORLD_SIZE="4",
                            MASTER_ADDR="localhost", TORCHELASTIC_RUN_ID="left-over")
    r = subprocess.run([sys.executable, "-m", "slurmddp", "submit", "--follow", "--json",
                        *(["--local"] if where == "local" else []), "--nodes", "2",
                        "--ntasks-per-node", "2", TRAIN, "--steps", "6"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    if where == "cluster":
        ranks = [x["rank"] for x in rank_results(job)]
    else:
        logs = Path(job["job_dir"]).glob(f"{job['job_id']}_*_log.out")
        ranks = [x["rank"] for p in logs for x in tagged_json(p.read_text(), "RESULT ")]
    assert sorted(ranks) == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_submitted_backend_is_the_default_of_init(slurm_cluster, tmp_path, backend):
    script = tmp_path / "which.py"
    script.write_text("import slurmddp, torch.distributed as td\nslurmddp.init()\n"
                      "print('BACKEND', td.get_backend(), flush=True)\n")  # fmt: skip
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--nodes", "1",
                 "--ntasks-per-node", "2", "--backend", backend, str(script), cwd=tmp_path)
    job = submitted(r)
    log = (Path(job["job_dir"]) / job["job_id"] / "rank-0.log").read_text()
    if backend == "gloo":
        assert r.returncode == 0 and "BACKEND gloo" in log, r.stdout + log
    else:  # this torch has no MPI backend: init() tried the one submitted, and says so
        assert "this torch build has no MPI backend" in log, log


def test_submit_with_torchrun_launcher(slurm_cluster, tmp_path):
    argv = [
        "--follow",
        "--json",
        "--launcher",
        "torchrun",
        "--nodes",
        "2",
        "--ntasks-per-node",
        "2",
    ]
    r = slurmddp(slurm_cluster, "submit", *argv, TRAIN, "--steps", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    results = rank_results(job, "node-{}.log", count=2)
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    assert len({x["digest"] for x in results}) == 1


def test_submit_a_node_range_takes_what_is_free(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--nodes", "1-4", TRAIN,
                 "--steps", "3", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    nodes = slurm_cluster.run(["sacct", "-X", "-n", "-P", "-o", "NNodes", "-j", job["job_id"]])
    assert 1 <= int(nodes.stdout.split()[0]) <= 4


def test_template_script_submitted_with_plain_sbatch(slurm_cluster, tmp_path):
    t = slurmddp(slurm_cluster, "template", "-o", "job.sh", "--nodes", "2", "--ntasks-per-node",
                 "1", TRAIN, "--steps", "3", cwd=tmp_path)  # fmt: skip
    assert t.returncode == 0, t.stderr
    (tmp_path / "slurmddp-jobs").mkdir()  # the batch log's directory must exist for sbatch
    r = slurm_cluster.run(["sbatch", "--wait", "--parsable", "job.sh"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.strip().split(";")[0]
    state = slurm_cluster.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id])
    assert state.stdout.split() == ["COMPLETED"]
    results = rank_results({"job_dir": str(tmp_path / "slurmddp-jobs"), "job_id": job_id},
                           count=2)  # fmt: skip
    assert sorted(x["rank"] for x in results) == [0, 1]


def test_bad_input_queues_nothing(slurm_cluster, tmp_path):
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    for args in (["--nodes", "9-2", TRAIN], ["--time", "soon", TRAIN], ["--env", "=x", TRAIN]):
        r = slurmddp(slurm_cluster, "submit", *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before


def test_sbatch_refusal_is_one_line(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--partition", "nosuch", TRAIN, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("slurmddp submit: error: sbatch refused the job: ")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "Invalid partition name" in r.stderr
    assert not (tmp_path / "slurmddp-jobs").exists(), "a refused job leaves nothing behind"


def test_cancel_and_logs_of_a_running_job(slurm_cluster, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(300)\n")
    job = submitted(slurmddp(slurm_cluster, "submit", "--json", str(script), cwd=tmp_path))
    log = Path(job["job_dir"]) / job["job_id"] / "rank-0.log"
    for _ in range(120):
        if log.exists() and "started" in log.read_text():
            break
        time.sleep(0.5)
    logs = slurmddp(slurm_cluster, "logs", job["job_id"], cwd=tmp_path)
    assert logs.stdout == "started\n"
    cancel = slurmddp(slurm_cluster, "cancel", job["job_id"], cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stderr
    for _ in range(60):
        status = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path).stdout
        if "CANCELLED" in status:
            break
        time.sleep(1)
    assert "CANCELLED" in status
    unknown = slurmddp(slurm_cluster, "logs", "999999", cwd=tmp_path)
    assert unknown.returncode == 2 and "was not submitted with slurmddp" in unknown.stderr


# mpirun refuses root unless told, four ranks oversubscribe this machine's two cores, and the
# local cluster's nodes share one host (see test_run_cluster.MPIRUN_ON_NODES): TCP between them.
MPIRUN_AS_ROOT = ["--env", "OMPI_ALLOW_RUN_AS_ROOT=1", "--env", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
                  "--env", "OMPI_MCA_rmaps_base_oversubscribe=1",
                  "--env", "OMPI_MCA_btl=self,tcp"]  # fmt: skip


@pytest.mark.mpi
def test_submit_with_mpirun_launcher(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--launcher", "mpirun",
                 "--nodes", "2", "--ntasks-per-node", "2", *MPIRUN_AS_ROOT, TRAIN, "--steps", "4",
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    assert job["logs"].endswith(f"/{job['job_id']}/ranks.log")
    results = tagged_json(Path(job["logs"]).read_text(), "RESULT ")
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    assert len({x["digest"] for x in results}) == 1
    logs = slurmddp(slurm_cluster, "logs", job["job_id"], "--rank", "0", cwd=tmp_path)
    assert "[0/4]" in logs.stdout


@pytest.mark.mpi
def test_submit_with_srun_mpi_plugin(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--mpi", "pmix", "--nodes", "2",
                 "--ntasks-per-node", "2", TRAIN, "--steps", "4", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    results = rank_results(submitted(r))
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    assert len({x["digest"] for x in results}) == 1

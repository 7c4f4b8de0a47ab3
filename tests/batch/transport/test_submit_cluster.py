"""`slurmddp submit` on the real local Slurm cluster: the job runs, is tracked, logs per rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import EVERY_SLURM, ROOT, tagged_json, wait_until

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


@EVERY_SLURM
@pytest.mark.smoke  # scripts/check
def test_submit_follow_runs_to_completion_with_a_log_per_rank(slurm_cluster, tmp_path):
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--nodes", "2",
                 "--ntasks-per-node", "2", TRAIN, "--steps", "6", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    # RUNNING may fall between two polls (sacct can learn of the start late); the end may not.
    states = follow_states(r.stdout, job["job_id"])
    assert states[-1] == "COMPLETED", r.stdout
    assert set(states) <= {"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}, states
    assert "parameters identical on all ranks: True" in r.stdout  # rank 0's log, streamed
    results = rank_results(job)
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    assert len({x["digest"] for x in results}) == 1

    status = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path)
    assert f"{job['job_id']}  COMPLETED" in status.stdout, status.stdout
    # [the same training run with --local reaches the same parameters] is proven by
    # test_launcher_variables_left_in_the_submitting_shell_never_decide_a_rank, which runs this
    # job on the cluster and with --local (no Slurm: the same on every version) and compares them.


def test_launcher_variables_left_in_the_submitting_shell_never_decide_a_rank(slurm_cluster,
                                                                            tmp_path):
    # sbatch (and submitit's local executor) pass the submitting shell's environment on. The
    # job on the cluster, then with --local (no Slurm at all), which reaches the same parameters.
    env = slurm_cluster.env(XDG_STATE_HOME=str(tmp_path / "state"), RANK="0", WORLD_SIZE="4",
                            MASTER_ADDR="localhost", TORCHELASTIC_RUN_ID="left-over")
    digests = {}
    for where in ("cluster", "local"):
        r = subprocess.run([sys.executable, "-m", "slurmddp", "submit", "--follow", "--json",
                            *(["--local"] if where == "local" else []), "--nodes", "2",
                            "--ntasks-per-node", "2", TRAIN, "--steps", "6"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
        assert r.returncode == 0, where + r.stdout + r.stderr
        job = submitted(r)
        if where == "cluster":
            results = rank_results(job)
        else:
            logs = (Path(job["job_dir"]) / job["job_id"]).glob("rank-*.log")
            results = [x for p in logs for x in tagged_json(p.read_text(), "RESULT ")]
        assert sorted(x["rank"] for x in results) == [0, 1, 2, 3], where
        digests[where] = {x["digest"] for x in results}
    assert len(digests["cluster"]) == 1 and digests["local"] == digests["cluster"], digests


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_submitted_backend_is_the_default_of_init(slurm_cluster, tmp_path, backend):
    script = tmp_path / "which.py"
    script.write_text("import slurmddp, torch.distributed as td\nslurmddp.init()\n"
                      "print('BACKEND', td.get_backend(), flush=True)\n")  # fmt: skip
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--nodes", "1",
                 "--ntasks-per-node", "2", "--backend", backend, str(script), cwd=tmp_path)
    job = submitted(r)
    logs = [(Path(job["job_dir"]) / job["job_id"] / f"rank-{i}.log").read_text() for i in (0, 1)]
    if backend == "gloo":
        assert r.returncode == 0 and all("BACKEND gloo" in log for log in logs), r.stdout + logs[0]
    else:  # this torch has no MPI backend: init() tried the one submitted, and says so. The
        # first rank to say it ends the step (--kill-on-bad-exit): the other may be cut short.
        assert any("this torch build has no MPI backend" in log for log in logs), logs


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


@EVERY_SLURM
def test_gpus_by_gres_beside_gpus_per_node_are_refused_before_sbatch_would(slurm_cluster,
                                                                          tmp_path):  # fmt: skip
    # Newer Slurm refuses the pair in sbatch itself (seen here on 26.05: "fatal:
    # --gpus-per-node and --gres=gpu are mutually exclusive"); slurmddp says so on every version.
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    r = slurmddp(slurm_cluster, "submit", "--gpus-per-node", "1", "--ntasks-per-node", "1",
                 "--backend", "gloo", "--sbatch-arg=--gres=gpu:1", TRAIN, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "asks for GPUs beside gpus_per_node=1" in r.stderr
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before
    if slurm_cluster.version == "26.05":
        direct = slurm_cluster.run(["sbatch", "--gres=gpu:1", "--gpus-per-node=1", "--wrap",
                                    "true"])  # fmt: skip
        assert direct.returncode != 0 and "mutually exclusive" in direct.stderr, direct.stderr


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


# ---- status and --follow: arrays, the log's tail, a cluster without accounting ---------------

ARRAY_TASK = "import os, time\nprint('task', os.environ['SLURM_ARRAY_TASK_ID'], flush=True)\n" \
             "time.sleep(2)\n"  # fmt: skip


def follow_states(stdout: str, job_id: str) -> list[str]:
    """The states a follow printed (its other lines of its own are the job's story)."""
    said = [x.split(": ", 1)[1] for x in stdout.splitlines()
            if x.startswith(f"[slurmddp] job {job_id}: ")]  # fmt: skip
    return [s for s in said if re.fullmatch(r"[A-Z_]+( \d+)?(, [A-Z_]+ \d+)*", s)]


def log_lines(stdout: str) -> list[str]:
    """What a follow printed of the job's log: every line not its own."""
    return [x for x in stdout.splitlines() if not x.startswith("[slurmddp] ")]


def test_an_array_job_is_followed_and_shown_with_its_tasks_counted(slurm_cluster, tmp_path):
    script = tmp_path / "task.py"
    script.write_text(ARRAY_TASK)
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", "--sbatch-arg=--array=0-2",
                 str(script), cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    states = follow_states(r.stdout, job["job_id"])
    assert states[-1] == "COMPLETED 3", r.stdout
    status = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path)
    assert f"{job['job_id']}  COMPLETED 3 " in status.stdout, status.stdout
    verbose = slurmddp(slurm_cluster, "status", "-v", job["job_id"], cwd=tmp_path).stdout
    tasks = [line.split() for line in verbose.splitlines()[2:]]
    assert [t[0] for t in tasks] == [f"{job['job_id']}_{i}" for i in range(3)], verbose
    for i, (_, state, _, own, logs) in enumerate(tasks):
        assert state == "COMPLETED" and logs == str(Path(job["job_dir"]) / own), verbose
        assert f"task {i}\n" in (Path(logs) / "rank-0.log").read_text()


def test_an_array_is_counted_while_its_tasks_run(slurm_cluster, tmp_path):
    script = tmp_path / "task.py"
    script.write_text(ARRAY_TASK.replace("sleep(2)", "sleep(30)"))
    # Two at a time: one task waits in the array while two run.
    job = submitted(slurmddp(slurm_cluster, "submit", "--json", "--sbatch-arg=--array=0-2%2",
                             str(script), cwd=tmp_path))  # fmt: skip
    try:
        seen = []
        for _ in range(60):
            out = slurmddp(slurm_cluster, "status", job["job_id"], cwd=tmp_path).stdout
            seen.append(out.splitlines()[1].split(job["job_id"], 1)[1].split(" slurm ")[0].strip())
            if seen[-1].startswith("RUNNING 2, PENDING 1"):
                break
            time.sleep(1)
        assert seen[-1].startswith("RUNNING 2, PENDING 1"), seen
    finally:
        slurmddp(slurm_cluster, "cancel", job["job_id"], cwd=tmp_path)


def test_follow_prints_the_logs_last_lines_before_the_final_state(slurm_cluster, tmp_path):
    script = tmp_path / "chatty.py"
    # Many lines written in the job's last moment: they land as the job ends.
    script.write_text(
        "for i in range(3000):\n    print('line', i)\nprint('LAST LINE', flush=True)\n"
    )
    r = slurmddp(slurm_cluster, "submit", "--follow", "--json", str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted(r)
    lines = r.stdout.splitlines()
    assert lines[-1] == f"[slurmddp] job {job['job_id']}: COMPLETED", lines[-5:]
    # Every line of the log is there, its last one last, before the final state.
    assert log_lines(r.stdout)[-1] == "LAST LINE"
    assert [x for x in lines if x.startswith("line ")] == [f"line {i}" for i in range(3000)]


NO_ACCOUNTING = (
    "#!/bin/bash\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"
)


def test_without_accounting_status_and_follow_ask_the_controller(slurm_cluster, tmp_path):
    # sacct as it answers on a cluster without slurmdbd; squeue and scontrol are the real ones.
    # Not a cluster variant without accounting: while it lasted, it would take sacct from every
    # other test on the shared cluster, and the jobs run meanwhile would stay out of accounting.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(NO_ACCOUNTING)
    (bin_dir / "sacct").chmod(0o755)
    env = slurm_cluster.env(XDG_STATE_HOME=str(tmp_path / "state"),
                            PATH=f"{bin_dir}:{slurm_cluster.env()['PATH']}")  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slurmddp", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)  # fmt: skip

    script = tmp_path / "task.py"
    script.write_text(ARRAY_TASK)
    plain = run("submit", "--follow", "--json", str(script.with_name("plain.py")))
    assert plain.returncode == 2  # no such script: nothing was submitted
    script.with_name("plain.py").write_text("print('plain', flush=True)\n")
    plain = run("submit", "--follow", "--json", str(script.with_name("plain.py")))
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert log_lines(plain.stdout)[-1] == "plain"
    ended = f"[slurmddp] job {submitted(plain)['job_id']}: COMPLETED"
    assert plain.stdout.splitlines()[-1] == ended
    said = [x for x in plain.stderr.splitlines() if "states come from the controller" in x]
    assert len(said) == 1 and "accounting storage is disabled" in said[0], plain.stderr

    array = run("submit", "--follow", "--json", "--sbatch-arg=--array=0-1", str(script))
    assert array.returncode == 0, array.stdout + array.stderr
    assert follow_states(array.stdout, submitted(array)["job_id"])[-1] == "COMPLETED 2"

    failing = script.with_name("failing.py")
    failing.write_text("raise SystemExit(3)\n")
    failed = run("submit", "--follow", "--json", str(failing))
    assert failed.returncode == 3, failed.stdout + failed.stderr  # the exit code from scontrol
    assert follow_states(failed.stdout, submitted(failed)["job_id"])[-1] == "FAILED"

    status = run("status", "-v")
    assert status.returncode == 0, status.stderr
    rows = {line.split()[0]: line for line in status.stdout.splitlines()[1:]}
    assert " COMPLETED " in rows[submitted(plain)["job_id"]], status.stdout
    assert " COMPLETED 2 " in rows[submitted(array)["job_id"]], status.stdout
    assert " FAILED " in rows[submitted(failed)["job_id"]], status.stdout
    assert {f"{submitted(array)['job_id']}_{i}" for i in (0, 1)} <= rows.keys(), status.stdout
    assert status.stderr.count("states come from the controller") == 1


# Prints what it runs (its own version, its sibling module's, where it is) on every run; the
# first run waits for the test to edit the code, then asks for a requeue.
SNAPSHOT_PROGRAM = """\
import json, os, sys, time
import helper
import slurmddp

go, restart = sys.argv[1], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
seen = {{"restart": restart, "script": {version!r}, "helper": helper.V, "file": __file__,
        "cwd": os.getcwd()}}
print("RESULT", json.dumps(seen), flush=True)
if restart == 0:
    deadline = time.time() + 120
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.2)
    slurmddp.requeue()
slurmddp.mark_done()
"""


def write_code(project: Path, version: str) -> None:
    (project / "train.py").write_text(SNAPSHOT_PROGRAM.format(version=version))
    (project / "helper.py").write_text(f"V = {version!r}\n")


@pytest.mark.parametrize("snapshotted", [True, False], ids=["snapshot", "no-snapshot"])
def test_a_pending_and_a_requeued_job_run_the_code_as_submitted(slurm_cluster, tmp_path,
                                                                snapshotted):
    write_code(tmp_path, "submitted")
    go = tmp_path / "go"
    r = slurmddp(slurm_cluster, "submit", "--json", "--sbatch-arg=--hold",
                 *([] if snapshotted else ["--no-snapshot"]), "train.py", str(go),
                 cwd=tmp_path)  # fmt: skip
    job = submitted(r)
    log = Path(job["job_dir"]) / job["job_id"] / "rank-0.log"
    state = slurm_cluster.run(["squeue", "-h", "-o", "%T", "-j", job["job_id"]]).stdout.strip()
    assert state == "PENDING" and not log.exists(), state
    write_code(tmp_path, "edited while pending")  # the script and the module it imports
    released = slurm_cluster.run(["scontrol", "release", job["job_id"]])
    assert released.returncode == 0, released.stderr

    def results() -> list[dict]:
        return tagged_json(log.read_text(), "RESULT ") if log.exists() else []

    wait_until(lambda: len(results()) >= 1, 180, lambda: f"the first run's line in {log}")
    write_code(tmp_path, "edited before the requeue")
    go.touch()
    wait_until(lambda: len(results()) >= 2, 300, lambda: f"the requeued run's line in {log}")
    first, second = results()[:2]
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["cwd"] == second["cwd"] == str(tmp_path)  # the user's working directory
    if snapshotted:
        for run in (first, second):
            assert run["script"] == run["helper"] == "submitted", run
            assert run["file"].startswith(f"{job['job_dir']}/snapshots/"), run
        assert first["file"] == second["file"]
    else:  # the control: each run runs the files as they are then
        assert first["script"] == first["helper"] == "edited while pending", first
        assert second["script"] == second["helper"] == "edited before the requeue", second

"""Local emulation gives every process the variables a real srun step would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from slurmddp.batch.local.emulation import (
    job_record,
    output_path,
    slurm_duration,
    srun_error,
    step_environment,
)
from slurmddp.preemption import decision, nodes
from slurmddp.rank.env import resolve
from tests.cli.test_cli_submit import slurmddp
from tests.conftest import ROOT, launcher_free_env, tagged_json


@pytest.mark.parametrize(("nodes", "tasks"), [(1, 1), (1, 3), (2, 2), (4, 2)])
def test_every_emulated_rank_resolves_to_its_place(nodes, tasks):
    world = nodes * tasks
    places = [resolve(step_environment(r, nodes, tasks, "4321")) for r in range(world)]
    assert [p.rank for p in places] == list(range(world))
    assert [p.node_rank for p in places] == [r // tasks for r in range(world)]
    assert [p.local_rank for p in places] == [r % tasks for r in range(world)]
    assert {(p.world_size, p.local_world_size, p.num_nodes, p.launcher) for p in places} == {
        (world, tasks, nodes, "slurm")
    }
    assert len({(p.master_addr, p.master_port) for p in places}) == 1


# What a real step's task has (sbatch's job variables, srun's step and task ones), by job shape:
# checked against Slurm 22.05 (`srun env` in `sbatch -N2 --ntasks-per-node=2 -c3 -J name`).
@pytest.mark.parametrize(("nodes", "tasks", "cpus", "gpus", "rank", "expected"), [
    (1, 2, None, 0, 1, {"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
                        "SLURM_JOB_CPUS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2",
                        "SLURM_GTIDS": "0,1", "SLURM_NPROCS": "2"}),
    (2, 2, 3, 0, 3, {"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
                     "SLURM_CPUS_PER_TASK": "3", "SLURM_JOB_CPUS_PER_NODE": "6(x2)",
                     "SLURM_CPUS_ON_NODE": "6", "SLURM_GTIDS": "2,3", "SLURM_NODEID": "1"}),
    (2, 4, None, 4, 0, {"SLURM_GPUS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "4",
                        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS": "8"}),
])  # fmt: skip
def test_every_emulated_task_has_the_variables_of_a_real_step(nodes, tasks, cpus, gpus, rank,
                                                               expected):  # fmt: skip
    env = step_environment(rank, nodes, tasks, "77", job_name="train", cpus_per_task=cpus,
                           gpus_per_node=gpus, submit_dir="/home/u/p", submit_host="login1")
    assert {k: env.get(k) for k in expected} == expected
    assert {k: env[k] for k in ("SLURM_JOB_NAME", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST",
                                "SLURM_JOB_PARTITION", "SLURM_JOB_ID")} == {
        "SLURM_JOB_NAME": "train", "SLURM_SUBMIT_DIR": "/home/u/p",
        "SLURM_SUBMIT_HOST": "login1", "SLURM_JOB_PARTITION": "local", "SLURM_JOB_ID": "77"}
    # Slurm sets these only when the job asked for them.
    assert ("SLURM_CPUS_PER_TASK" in env) == (cpus is not None)
    assert ("SLURM_GPUS_PER_NODE" in env) == bool(gpus)


@pytest.mark.parametrize(("pattern", "expected"), [
    ("/o/%j/rank-%t.log", "/o/9/rank-3.log"),
    ("/o/%j/node-%n.log", "/o/9/node-1.log"),
    ("/o/100%%/%x-%s.log", "/o/100%/job-1.log"),
])  # fmt: skip
def test_the_stand_in_srun_expands_output_patterns_as_srun(pattern, expected):
    assert output_path(pattern, "9", 1, 3, 1, "job") == expected


def test_the_stand_in_srun_words_a_bad_end_as_srun_for_the_decision():
    assert srun_error(2, 3) == "srun: error: localhost: task 2: Exited with exit code 3"
    assert srun_error(0, -9) == "srun: error: localhost: task 0: Killed"
    assert nodes.Failure(1, srun_error(1, -7), None).blame() is not None  # SIGBUS: the node


def test_the_stand_in_scontrol_tells_the_decision_the_time_left():
    env = {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_NUM_NODES": "2"}
    job = {"started": 1000.0, "time_limit_s": 3600, "requeue": True}
    fields = decision.job_fields(job_record(job, env, now=1000.0 + 3545))
    assert decision.seconds_left(fields) == 55
    assert (fields["Restarts"], fields["Requeue"], fields["NumNodes"]) == ("2", "1", "2")
    unlimited = decision.job_fields(job_record({**job, "time_limit_s": None}, env, now=1000.0))
    assert decision.seconds_left(unlimited) is None
    assert decision.job_fields(job_record({**job, "no_requeue": True}, env, 0))["Requeue"] == "0"
    assert slurm_duration(2 * 86400 + 3661) == "2-01:01:01"


@pytest.mark.ranks
def test_lightning_runs_under_local_as_under_srun(tmp_path):
    # Lightning's SLURMEnvironment refuses a step without SLURM_NTASKS_PER_NODE (and reads
    # SLURM_JOB_NAME to tell a batch job from an interactive shell).
    pytest.importorskip("lightning")
    r = slurmddp("submit", "--local", "--follow", "--json", "--nodes", "1",
                 "--ntasks-per-node", "2", "--output", "jobs",
                 str(ROOT / "examples" / "lightning_train.py"), "--steps", "4",
                 "--checkpoint-dir", str(tmp_path / "ckpt"),
                 cwd=tmp_path, state=tmp_path / "state", timeout=300)  # fmt: skip
    lines = "\n".join(job_lines(tmp_path / "jobs", r))
    assert r.returncode == 0, r.stdout + r.stderr + lines
    assert "COMPLETED" in r.stdout
    results = tagged_json(lines, "RESULT ")
    assert sorted(x["rank"] for x in results) == [0, 1]
    assert {x["steps"] for x in results} == {4} and len({x["digest"] for x in results}) == 1


# ---- the preemption scenario of preemption/test_preemption_cluster.py, without Slurm ----

TRAIN = str(ROOT / "examples" / "resumable_train.py")


def local_train(tmp_path, name: str, *options: str, tasks: int = 2, steps: int = 200,
                step_time: float = 0.0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`slurmddp submit --local --follow` of the resumable example on one emulated node of
    `tasks` ranks; (result, the lines of its batch log and its ranks' logs).

    One node: every emulated node is this machine, and the stand-in srun starts a node's tasks as
    another's (their variables: the tests above), so 2 DDP ranks prove the resume as 2 nodes x 2
    did, for half the rank processes (each imports torch). The cluster tests run 2 x 2."""
    r = slurmddp("submit", "--local", "--follow", "--json", "--nodes", "1",
                 "--ntasks-per-node", str(tasks), "--output", name, *options, TRAIN,
                 "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt" / name),
                 "--step-time", str(step_time), "--log-every", "1000",
                 cwd=tmp_path, state=tmp_path / "state", timeout=300)  # fmt: skip
    return r, job_lines(tmp_path / name, r)


def job_lines(folder, r: subprocess.CompletedProcess) -> list[str]:
    """The lines of the batch log and the ranks' logs of the job `r` submitted (--json)."""
    job = json.loads(r.stdout.splitlines()[0])["job_id"]
    logs = [folder / f"{job}.batch.log", *sorted((folder / job).glob("rank-*.log"))]
    return [line for p in logs if p.exists() for line in p.read_text().splitlines()]


# [test_local_emulation_is_preempted_twice_and_ends_bitwise_identical] is proven by
# tests/test_examples.py::test_ddp_sampler_eval_is_preempted_under_local_emulation_and_resumes:
# the same emulated job (2 ranks, --local-signal-after 4,4) preempted twice, requeued 1 then 2 of
# 3, each run resumed at the step the one before stopped, the end bitwise the uninterrupted run's.


@pytest.mark.ranks
def test_resume_at_another_world_size_continues_at_the_same_global_sample(tmp_path):
    # 2 ranks, stopped once with no requeue allowed: the checkpoint is taken, the job ends 75.
    # Two jobs, one run: named, so that the second resumes the first (slurmddp.run_id).
    r, lines = local_train(tmp_path, "w", "--max-requeues", "0", "--local-signal-after", "4",
                           "--env", "SLURMDDP_RUN_ID=w", step_time=0.03)  # fmt: skip
    assert r.returncode == 75, r.stdout + r.stderr
    text = "\n".join(lines)
    assert "the limit of 0 requeues (--max-requeues) is reached" in text
    epoch, sample = re.search(r"stopped at step \d+ \(epoch (\d+), sample (\d+)\)", text).groups()
    # The same checkpoint directory, now 1 rank; with one thread, not a lone rank's default of
    # the node's CPUs (slurmddp.rank.placement), whose idle threads spin, costing CPU, each step.
    r, lines = local_train(tmp_path, "w", "--env", "OMP_NUM_THREADS=1", "--env",
                           "SLURMDDP_RUN_ID=w", tasks=1)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = re.search(r"resumed from \S+ at step \d+ \(epoch (\d+), sample (\d+)\)",
                        "\n".join(lines))  # fmt: skip
    assert resumed and resumed.groups() == (epoch, sample)
    assert {x["world_size"] for x in tagged_json("\n".join(lines), "RESULT ")} == {1}


# ---- the batch script's own behaviour, without Slurm: each row of docs/behaviour/local.md ----

PROGRAMS = ROOT / "tests" / "programs"


def local_job(tmp_path, *argv: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess,
                                                                     str, str]:  # fmt: skip
    """`slurmddp submit --local --follow --json` into tmp_path/jobs; (result, job id, the text
    of its batch log and ranks' logs)."""
    r = slurmddp("submit", "--local", "--follow", "--json", "--output", "jobs", *argv,
                 cwd=tmp_path, state=tmp_path / "state", timeout=timeout)  # fmt: skip
    assert r.stdout.startswith("{"), r.stdout + r.stderr
    return r, json.loads(r.stdout.splitlines()[0])["job_id"], "\n".join(
        job_lines(tmp_path / "jobs", r))


@pytest.mark.ranks
def test_local_hang_is_judged_by_the_watchdog_and_names_the_rank(tmp_path):
    # The case: a rank asleep in the loop, --hang-timeout 15 (it was never judged).
    r, job, text = local_job(tmp_path, "--nodes", "1", "--ntasks-per-node", "2",
                             "--hang-timeout", "15", str(PROGRAMS / "hang.py"), "sleep",
                             "--rank", "1", "--at", "5", "--checkpoints",
                             str(tmp_path / "ckpt"))  # fmt: skip
    assert r.returncode == 124, r.stdout + r.stderr + text  # the hang watchdog's status
    assert "rank 1 on localhost stopped progressing" in text
    assert "the hang watchdog judged the run hung (above: which ranks); not requeued" in text
    assert "rank 1 on localhost" in (tmp_path / "jobs" / job / "hang" / "report.txt").read_text()
    assert "FAILED" in r.stdout


@pytest.mark.ranks
def test_local_failure_summary_names_the_rank_that_failed_first(tmp_path):
    r, _, text = local_job(tmp_path, "--nodes", "1", "--ntasks-per-node", "2",
                           "--env", "FAIL_MODE=raise", "--env", "FAIL_RANK=1",
                           str(PROGRAMS / "failing_rank.py"))  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr + text
    assert "srun: error: localhost: task 1: Exited with exit code 1" in text
    assert "the first failure a rank reported: rank 1 (host localhost) failed: RuntimeError" in text


@pytest.mark.ranks
def test_local_time_limit_warning_is_the_time_limit_to_the_decision(tmp_path):
    # --time 1 and a 50 s lead: the warning comes about 10 s in, and the decision, reading the
    # stand-in scontrol's TimeLimit and RunTime, calls it the time limit; no requeue is allowed.
    # One rank: the decision's words do not depend on how many; one thread, as in
    # test_resume_at_another_world_size_continues_at_the_same_global_sample.
    r, _, text = local_job(tmp_path, "--nodes", "1", "--ntasks-per-node", "1", "--env",
                           "OMP_NUM_THREADS=1", "--time", "1", "--signal-lead", "50",
                           "--max-requeues", "0", TRAIN, "--steps", "100000", "--checkpoint-dir",
                           str(tmp_path / "ckpt"), "--step-time", "0.05", "--log-every",
                           "1000")  # fmt: skip
    assert r.returncode == 75, r.stdout + r.stderr + text
    assert ("stopped (time limit, USR2) at restart 0 after its checkpoint: not requeued, the "
            "limit of 0 requeues (--max-requeues) is reached") in text


@pytest.mark.ranks
def test_local_torchrun_with_preflight_runs_the_same_steps(tmp_path):
    # 2 nodes: two agents meet, the first node's hosting the store, though every node is
    # localhost (slurmddp.launch.agent.hosts_store); one worker each: how many is torchrun's part.
    r, job, text = local_job(tmp_path, "--launcher", "torchrun", "--preflight", "--nodes", "2",
                             "--ntasks-per-node", "1", str(ROOT / "examples" / "ddp_train.py"),
                             "--steps", "5")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr + text
    assert "slurmddp: preflight passed" in text
    assert "trained 5 steps on 2 ranks" in (tmp_path / "jobs" / job / "node-0.log").read_text()


PROBE = """\
import json, os, slurmddp
names = ["SLURM_JOB_NAME", "SLURM_CPUS_PER_TASK", "SLURM_JOB_PARTITION", "SLURM_NTASKS_PER_NODE",
         "SLURM_SUBMIT_DIR", "FROM_ENV", "FROM_SETUP", "SLURMDDP_HANG_TIMEOUT", "RANK"]
print("PROBE " + json.dumps({n: os.environ.get(n) for n in names}), flush=True)
slurmddp.mark_done()
"""


def test_local_options_reach_the_job_as_on_slurm(tmp_path):
    # Where the job queues and what it is charged to mean nothing here: taken, so that a
    # profile's partition does not stop --local; the job is in the one local partition.
    (tmp_path / "probe.py").write_text(PROBE)
    r, job, text = local_job(
        tmp_path, "--nodes", "2", "--ntasks-per-node", "1", "--job-name", "probe-job",
        "--cpus-per-task", "2", "--partition", "gpu", "--account", "a", "--qos", "q",
        "--constraint", "c", "--mem", "1G", "--env", "FROM_ENV=1", "--hang-timeout", "99",
        "--setup", "export FROM_SETUP=yes", "probe.py")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr + text
    probes = sorted(tagged_json(text, "PROBE "), key=lambda p: p["RANK"])
    assert probes == [{"SLURM_JOB_NAME": "probe-job", "SLURM_CPUS_PER_TASK": "2",
                       "SLURM_JOB_PARTITION": "local", "SLURM_NTASKS_PER_NODE": "1",
                       "SLURM_SUBMIT_DIR": str(tmp_path), "FROM_ENV": "1", "FROM_SETUP": "yes",
                       "SLURMDDP_HANG_TIMEOUT": "99", "RANK": str(r)} for r in (0, 1)]  # fmt: skip
    assert (tmp_path / "jobs" / job / "done").exists()  # the done marker, as the script leaves it


def test_local_runs_the_users_own_template(tmp_path):
    (tmp_path / "mine.j2").write_text(
        "#!/bin/bash\n#SBATCH --job-name={{ job_name | directive }}\n"
        "echo \"mine: $SLURM_JOB_NAME on $SLURM_JOB_NUM_NODES nodes\"\n")
    (tmp_path / "t.py").write_text("")
    r, job, text = local_job(tmp_path, "--template", "mine.j2", "--nodes", "2", "t.py")
    assert r.returncode == 0, r.stdout + r.stderr + text
    assert "mine: t on 2 nodes" in (tmp_path / "jobs" / f"{job}.batch.log").read_text()


# A template of the user's that hands each run to the supervisor by hand, as
# docs/concepts/supervisor.md says it may: the job's environment, then `exec` (the batch shell's
# signals then reach the supervisor itself).
HANDING_OVER = """#!/bin/bash
{% for option, value in directives %}
#SBATCH {{ option }}{% if value is not none %}={{ value | directive }}{% endif %}

{% endfor %}
echo "mine: $SLURM_JOB_NAME"
{% for name, value in protocol_env %}
export {{ name }}={{ value | sh }}
{% endfor %}
job_dir={{ output_dir | sh }}/"$SLURM_JOB_ID"
{% for name, file in state_files %}
export {{ name }}="$job_dir"/{{ file | sh }}
{% endfor %}
exec {{ decision_python | sh }} -m {{ p.SUPERVISOR_MODULE }} --plan {{ plan | sh }}
"""


@pytest.mark.ranks
def test_local_runs_a_users_template_that_hands_over_to_the_supervisor(tmp_path):
    (tmp_path / "mine.j2").write_text(HANDING_OVER)
    (tmp_path / "t.py").write_text("import os\nprint('rank', os.environ['RANK'], 'ran')\n")
    r, job, text = local_job(tmp_path, "--template", "mine.j2", "--ntasks-per-node", "2", "t.py")
    assert r.returncode == 0 and "COMPLETED" in r.stdout, r.stdout + r.stderr + text
    assert "rank 0 ran" in text and "rank 1 ran" in text, text
    assert "mine: t" in (tmp_path / "jobs" / f"{job}.batch.log").read_text()
    assert (tmp_path / "jobs" / job / "done").exists()  # marked done as the shipped script does


@pytest.mark.parametrize(("argv", "said"), [
    (["--launcher", "mpirun"], "--local: --launcher mpirun cannot run locally"),
    (["--mpi", "pmix"], "--local: --mpi pmix is srun's MPI plugin"),
    (["--srun-arg=--container-image=x"], "--local: --srun-arg --container-image=x cannot be"),
    (["--sbatch-arg=--exclusive"], "--local: --sbatch-arg --exclusive means nothing"),
])  # fmt: skip
def test_local_refuses_what_only_a_cluster_has_in_one_line(tmp_path, argv, said):
    r = slurmddp("submit", "--local", *argv, TRAIN, cwd=tmp_path, state=tmp_path / "state")
    assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "slurmddp-jobs").exists(), "nothing is started"
    assert not (tmp_path / "state" / "slurmddp").exists()


def test_local_cancel_ends_every_process_of_the_job(tmp_path):
    (tmp_path / "slow.py").write_text("import time\nprint('started', flush=True)\n"
                                      "time.sleep(300)\n")  # fmt: skip
    state = tmp_path / "state"
    # Not through pipes: the job's processes hold the submitting process's output open.
    env = launcher_free_env(XDG_STATE_HOME=str(state), XDG_CONFIG_HOME=str(state / "config"))
    with (tmp_path / "out").open("w") as out:
        subprocess.run([sys.executable, "-m", "slurmddp", "submit", "--local", "--json", "--output",
                        "jobs", "--nodes", "2", "slow.py"], cwd=tmp_path, env=env, stdout=out,
                       stderr=out, timeout=120, check=True)  # fmt: skip
    job = json.loads((tmp_path / "out").read_text().splitlines()[0])["job_id"]
    log = tmp_path / "jobs" / job / "rank-1.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and "started" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurmddp("cancel", job, cwd=tmp_path, state=state).returncode == 0
    deadline = time.monotonic() + 30
    while "CANCELLED" not in (status := slurmddp("status", job, cwd=tmp_path, state=state)).stdout:
        assert time.monotonic() < deadline, status.stdout
        time.sleep(1)
    ranks = subprocess.run(["pgrep", "-f", str(tmp_path / "jobs")], capture_output=True, text=True)
    assert ranks.stdout == "", "a rank outlived its job"

"""Each launcher's layout and step command line, from a plan and the run's variables (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from slurmddp.supervisor.launchers import LAUNCHERS, Run, launcher, preflight
from slurmddp.supervisor.plan import Plan

PLAN = Plan(launcher="srun", python="/venv/bin/python", target=("train.py", "--lr", "0.1"),
            log_root="/runs/100%%", rank_prefix=("sh", "-c", "trap '' USR2; exec \"$@\"", "r"))
RUN = Run.of({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2", "SLURM_JOB_NUM_NODES": "3",
              "SLURM_NTASKS": "12", "SLURM_JOB_NODELIST": "gpu[007-009]"})  # fmt: skip
RANK = ("sh", "-c", "trap '' USR2; exec \"$@\"", "r", "/venv/bin/python")


def test_a_run_is_read_from_slurms_variables_without_asking_slurm():
    assert Run(job_id="42", restart=2, num_nodes=3, ntasks=12, first_node="gpu007") == RUN
    assert Run.of({}) == Run(job_id="", restart=0, num_nodes=1, ntasks=1, first_node="")
    assert Run.of({"SLURM_JOB_NODELIST": "bad[", "SLURM_RESTART_COUNT": "x"}).first_node == ""


@pytest.mark.parametrize(
    ("changes", "argv"),
    [
        ({}, ("srun", "--kill-on-bad-exit=1", "--open-mode=append",
              "--output=/runs/100%%/%j/rank-%t.log", *RANK, "-m", "slurmddp.run", "train.py",
              "--lr", "0.1")),
        ({"cpus_per_task": 4, "mpi": "pmix", "srun_args": ("--label",)},
         ("srun", "--kill-on-bad-exit=1", "--open-mode=append",
          "--output=/runs/100%%/%j/rank-%t.log", "--cpus-per-task=4", "--mpi=pmix", "--label",
          *RANK, "-m", "slurmddp.run", "train.py", "--lr", "0.1")),
        ({"launcher": "torchrun", "nodes": 3, "nproc_per_node": 4, "cpus_per_task": 8},
         ("srun", "--kill-on-bad-exit=1", "--open-mode=append",
          "--output=/runs/100%%/%j/node-%n.log", "--ntasks-per-node=1", "--cpus-per-task=8",
          *RANK, "-m", "slurmddp.agent", "--nnodes=3", "--nproc-per-node=4",
          "--rdzv-backend=c10d", "--rdzv-endpoint=gpu007", "--rdzv-id=42.2", "--max-restarts=0",
          "-m", "slurmddp.run", "--tag-output", "train.py", "--lr", "0.1")),
        # Elastic with a spare: MIN up to what the allocation got, less the spare; no node's end
        # ends the step.
        ({"launcher": "torchrun", "elastic": True, "nodes_min": 1, "spare_nodes": 1,
          "rdzv_port": 29500, "max_restarts": 2},
         ("srun", "--kill-on-bad-exit=0", "--no-kill", "--open-mode=append",
          "--output=/runs/100%%/%j/node-%n.log", "--ntasks-per-node=1", *RANK, "-m",
          "slurmddp.agent", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
          "--rdzv-endpoint=gpu007:29500", "--rdzv-id=42.2", "--max-restarts=2", "-m",
          "slurmddp.run", "--tag-output", "train.py", "--lr", "0.1")),
        ({"launcher": "torchrun", "rdzv_backend": "etcd-v2", "rdzv_endpoint": "etcd:2379"},
         ("srun", "--kill-on-bad-exit=1", "--open-mode=append",
          "--output=/runs/100%%/%j/node-%n.log", "--ntasks-per-node=1", *RANK, "-m",
          "slurmddp.agent", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=etcd-v2",
          "--rdzv-endpoint=etcd:2379", "--rdzv-id=42.2", "--max-restarts=0", "-m",
          "slurmddp.run", "--tag-output", "train.py", "--lr", "0.1")),
        ({"launcher": "mpirun"},
         ("mpirun", "-np", "12", *RANK, "-m", "slurmddp.run", "--tag-output", "train.py", "--lr",
          "0.1")),
    ],
)  # fmt: skip
def test_each_launcher_builds_its_step(changes, argv):
    plan = dataclasses.replace(PLAN, **changes)
    step = launcher(plan.launcher).step(plan, RUN)
    assert step.argv == argv
    # mpirun's ranks share one log, appended to; srun writes its own (--output), and its messages
    # go to the batch log, where the supervisor reads which task failed first.
    assert step.output == ("/runs/100%/42/ranks.log" if plan.launcher == "mpirun" else None)


def test_torchrun_without_a_node_to_meet_on_says_so():
    plan = dataclasses.replace(PLAN, launcher="torchrun")
    with pytest.raises(ValueError, match="cannot name the first node"):
        launcher("torchrun").step(plan, dataclasses.replace(RUN, first_node=""))


def test_the_preflight_is_one_task_per_node_without_the_watchdog():
    plan = dataclasses.replace(PLAN, cpus_per_task=2, srun_args=("--mpi=pmix",))
    assert preflight(plan, RUN).argv == (
        "srun", "--kill-on-bad-exit=1", "--open-mode=append",
        "--output=/runs/100%%/%j/preflight.log", "--ntasks=3", "--ntasks-per-node=1",
        "--export=ALL,SLURMDDP_HANG_TIMEOUT=0", "--cpus-per-task=2", "--mpi=pmix", *RANK, "-m",
        "slurmddp.run", "-m", "slurmddp.launch.preflight")  # fmt: skip


def test_the_layout_and_logs_of_each_launcher():
    layout = {name: (kind.tasks_per_node(4), kind.cpus_per_task(4, 3), kind.rank_log,
                     kind.local_problem is None, kind.through_srun, kind.mpi_plugin, kind.agents)
              for name, kind in LAUNCHERS.items()}  # fmt: skip
    assert layout == {"srun": (4, 3, "rank-%t.log", True, True, True, False),
                      "torchrun": (1, 12, "node-%n.log", True, True, False, True),
                      "mpirun": (4, 3, "ranks.log", False, False, False, False)}  # fmt: skip
    for kind in LAUNCHERS.values():
        assert kind.log_pattern.format(folder="F", job_id="J", rank=0).startswith("F/J/")


def test_a_plan_survives_its_json_and_refuses_another():
    plan = dataclasses.replace(PLAN, target=("it's $(x)", "a\nb", "日本"), elastic=True)
    text = plan.to_json()
    assert "\n" not in text and Plan.from_json(text) == plan
    assert '"elastic":true' in text and "nodes_min" not in text  # defaults left out
    with pytest.raises(ValueError, match="unknown"):
        Plan.from_json('{"launcher": "srun", "gpus": 8}')
    with pytest.raises(ValueError, match="JSON object"):
        Plan.from_json("[]")

"""Environments as launchers set them, for unit tests that need no launcher."""

from __future__ import annotations


def srun_env(
    rank: int,
    tasks_per_node: list[int],
    *,
    nodes: list[str] | None = None,
    job: int = 4242,
    step: int = 0,
    spec: str | None = None,
) -> dict[str, str]:
    """The SLURM_* variables `srun` gives task `rank` of a step with block distribution."""
    nodes = nodes or [f"n{i + 1}" for i in range(len(tasks_per_node))]
    node, local = block_position(rank, tasks_per_node)
    nodelist = ",".join(nodes)
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_JOBID": str(job),
        "SLURM_STEP_ID": str(step),
        "SLURM_STEPID": str(step),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_TASKS": str(sum(tasks_per_node)),
        "SLURM_NTASKS": str(sum(tasks_per_node)),
        "SLURM_STEP_NUM_NODES": str(len(tasks_per_node)),
        "SLURM_NNODES": str(len(tasks_per_node)),
        "SLURM_JOB_NUM_NODES": str(len(tasks_per_node)),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": spec or ",".join(map(str, tasks_per_node)),
        "SLURM_TASKS_PER_NODE": spec or ",".join(map(str, tasks_per_node)),
        "SLURMD_NODENAME": nodes[node],
    }


def block_position(rank: int, tasks_per_node: list[int]) -> tuple[int, int]:
    start = 0
    for node, count in enumerate(tasks_per_node):
        if rank < start + count:
            return node, rank - start
        start += count
    raise AssertionError("rank outside the step")

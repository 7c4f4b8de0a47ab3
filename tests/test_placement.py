"""The backend/device decision, for GPU layouts this machine does not have."""

from __future__ import annotations

import pytest

from slurmddp.placement import Placement, PlacementError, choose, cpu_threads


def pick(requested="auto", *, local_rank=0, local_world=1, gpus=0, visible=None, nccl=True,
         mpi=False) -> Placement:  # fmt: skip
    return choose(
        requested,
        local_rank=local_rank,
        local_world_size=local_world,
        cuda_device_count=gpus,
        cuda_visible_devices=visible,
        nccl_available=nccl,
        mpi_available=mpi,
    )


@pytest.mark.parametrize(
    ("kwargs", "backend", "device"),
    [
        ({}, "gloo", "cpu"),
        ({"requested": "gloo", "gpus": 8, "local_rank": 3}, "gloo", "cuda:3"),
        ({"gpus": 8, "local_rank": 5, "local_world": 8}, "nccl", "cuda:5"),
        ({"requested": "nccl", "gpus": 4, "local_rank": 0, "local_world": 4}, "nccl", "cuda:0"),
        # Slurm bound one GPU per task (--gpus-per-task=1): each task sees only its own.
        ({"gpus": 1, "visible": "3", "local_rank": 3, "local_world": 4}, "nccl", "cuda:0"),
        ({"gpus": 1, "local_rank": 0, "local_world": 1}, "nccl", "cuda:0"),
        ({"gpus": 2, "nccl": False}, "gloo", "cuda:0"),
        ({"requested": "mpi", "mpi": True}, "mpi", "cpu"),
    ],
)
def test_choices(kwargs, backend, device):
    p = pick(**kwargs)
    assert (p.backend, p.device) == (backend, device)
    assert p.reason


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requested": "nccl"}, "backend nccl needs a CUDA GPU"),
        ({"requested": "mpi"}, "this torch build has no MPI backend"),
        ({"requested": "tcp"}, "unknown backend 'tcp'"),
        ({"gpus": 2, "local_rank": 2, "local_world": 3}, "local rank 2 has no GPU: only 2 visible"),
        ({"gpus": 1, "local_world": 2}, "share one GPU"),
        ({"requested": "nccl", "gpus": 2, "nccl": False}, "no NCCL"),
    ],
)
def test_impossible_requests_say_what_to_do(kwargs, message):
    with pytest.raises(PlacementError) as info:
        pick(**kwargs)
    assert message in str(info.value)


def test_cuda_index():
    assert pick(gpus=4, local_rank=2, local_world=4).cuda_index == 2
    assert pick().cuda_index is None


@pytest.mark.parametrize(
    ("environ", "usable", "all_cpus", "local", "expected"),
    [
        ({"OMP_NUM_THREADS": "3"}, 8, 8, 2, None),  # the user said
        ({"SLURM_CPUS_PER_TASK": "6"}, 64, 64, 8, (6, "SLURM_CPUS_PER_TASK")),
        ({}, 4, 64, 8, (4, "the CPUs this task is bound to")),  # task/affinity, cgroups
        ({}, 64, 64, 8, (8, "64 CPUs shared by 8 ranks on the node")),
        ({}, 2, 2, 4, (1, "2 CPUs shared by 4 ranks on the node")),  # never 0
        ({"SLURM_CPUS_PER_TASK": "x"}, 8, 8, 1, (8, "8 CPUs shared by 1 ranks on the node")),
    ],
    ids=["user", "cpus-per-task", "bound", "shared", "oversubscribed", "garbage"],
)  # fmt: skip
def test_cpu_threads_follow_what_the_rank_was_given(environ, usable, all_cpus, local, expected):
    assert cpu_threads(environ, usable, all_cpus, local) == expected

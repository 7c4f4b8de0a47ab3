"""The backend/device decision, for GPU layouts this machine does not have."""

from __future__ import annotations

import pytest

from slurmddp.rank.placement import (
    Placement,
    PlacementError,
    choose,
    cpu_threads,
    cpus_near_gpu,
    parse_cpulist,
)


def pick(requested="auto", *, local_rank=0, local_world=1, gpus=0, visible=None, nccl=True,
         mpi=False, **environ: str) -> Placement:  # fmt: skip
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    return choose(
        requested,
        local_rank=local_rank,
        local_world_size=local_world,
        cuda_device_count=gpus,
        environ=environ,
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
        ({"requested": "nccl", "gpus": 2, "nccl": False}, "no NCCL"),
    ],
)
def test_impossible_requests_say_what_to_do(kwargs, message):
    with pytest.raises(PlacementError) as info:
        pick(**kwargs)
    assert message in str(info.value)


# What each task of a node sees under Slurm's GPU bindings (torch's device count, the variables
# Slurm sets), and the GPU each local rank must take: its own, and no other rank's.
@pytest.mark.parametrize(
    ("layout", "tasks"),
    [
        # --gpu-bind=closest, 8 tasks on 2 sockets of 4 GPUs: a task sees its socket's GPUs.
        ("closest", [(r, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3" if r < 4 else "4,5,6,7"},
                      r % 4) for r in range(8)]),
        # --gpus-per-task=2, 4 tasks: each sees only its own two and takes the first.
        ("gpus-per-task", [(r, 2, {"CUDA_VISIBLE_DEVICES": f"{2 * r},{2 * r + 1}",
                                   "SLURM_GPUS_PER_TASK": "2"}, 0) for r in range(4)]),
        # --gpus-per-task=2 --gpu-bind=none: every task sees all 8, its own are 2r and 2r+1.
        ("gpus-per-task, unbound", [(r, 8, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
                                            "SLURM_GPUS_PER_TASK": "2"}, 2 * r)
                                    for r in range(4)]),
        # ConstrainDevices=yes with one GPU per task: every task sees "0", each a different GPU.
        ("cgroup", [(r, 1, {"CUDA_VISIBLE_DEVICES": "0"}, 0) for r in range(4)]),
        ("cgroup, nothing exported", [(r, 1, {}, 0) for r in range(4)]),
        # AMD: Slurm's rsmi autodetection binds through ROCR_VISIBLE_DEVICES.
        ("rocm, per task", [(r, 1, {"ROCR_VISIBLE_DEVICES": str(r)}, 0) for r in range(4)]),
        ("rocm, node", [(r, 4, {"ROCR_VISIBLE_DEVICES": "0,1,2,3"}, r) for r in range(4)]),
        # gres.conf Flags=env_uuid (Slurm 25.11): GPUs named by UUID, 2 tasks sharing a socket's.
        ("env_uuid", [(r, 2, {"CUDA_VISIBLE_DEVICES": "GPU-8f2a,GPU-91c4"}, r) for r in range(2)]),
        # MIG: instances are named by UUID; each task bound to its own sees one device.
        ("mig", [(r, 1, {"CUDA_VISIBLE_DEVICES": f"MIG-5c3e-{r}"}, 0) for r in range(2)]),
        # One GPU shared by two tasks: both take it; the rendezvous refuses it under NCCL.
        ("shared", [(r, 1, {"CUDA_VISIBLE_DEVICES": "0"}, 0) for r in range(2)]),
    ],
)
def test_each_local_rank_takes_its_own_gpu(layout, tasks):
    for local_rank, count, environ, index in tasks:
        p = pick(local_rank=local_rank, local_world=len(tasks), gpus=count, **environ)
        assert (p.backend, p.device) == ("nccl", f"cuda:{index}"), (layout, local_rank, p)
        for name, value in environ.items():
            if name.endswith("VISIBLE_DEVICES"):
                assert f"{name}={value}" in p.reason


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


def test_kernel_cpu_lists():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    with pytest.raises(ValueError):
        parse_cpulist("0-3,x")


@pytest.mark.parametrize(
    ("gpu", "mine", "expected"),
    [
        (range(16), range(32), set(range(16))),  # unbound on two sockets: to its GPU's socket
        (range(16, 32), range(32), set(range(16, 32))),
        (range(32), range(32), None),  # one NUMA node: nothing to gain
        (range(16), range(4, 8), None),  # bound by Slurm or the user: theirs
        (range(16, 32), range(8), None),
    ],
)
def test_a_rank_nothing_bound_moves_to_the_cpus_of_its_gpu(gpu, mine, expected):
    got = cpus_near_gpu(frozenset(gpu), frozenset(mine), 32)
    assert got == (frozenset(expected) if expected is not None else None)

"""Which backend, device and CPU threads a rank uses: pure decisions, unit-tested without a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from slurmddp.errors import PlacementError

BACKENDS = ("auto", "nccl", "gloo", "mpi")



@dataclasses.dataclass(frozen=True)
class Placement:
    backend: str  # nccl, gloo or mpi
    device: str  # "cpu" or "cuda:N"
    reason: str

    @property
    def cuda_index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda") else None


# Where a launcher lists the GPUs a task may use: NVIDIA's, then AMD's (Slurm's rsmi
# autodetection sets ROCR_VISIBLE_DEVICES; a ROCm torch still answers through torch.cuda).
VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
GPUS_PER_TASK_VAR = "SLURM_GPUS_PER_TASK"


def choose(
    requested: str,
    *,
    local_rank: int,
    local_world_size: int,
    cuda_device_count: int,
    environ: Mapping[str, str],
    nccl_available: bool,
    mpi_available: bool,
) -> Placement:
    """Pick the process-group backend and this rank's device.

    `cuda_device_count` is what torch sees, `environ` says how the launcher bound GPUs to the
    task (`gpu_index`). `auto` means nccl on a GPU, gloo on CPU. Two ranks that end up on one
    GPU are found at the rendezvous, by the GPU's UUID (`slurmddp.launch.startup`).
    """
    if requested not in BACKENDS:
        raise PlacementError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    if cuda_device_count <= 0:
        device, reason = "cpu", "no CUDA device visible"
    else:
        index, reason = gpu_index(local_rank, cuda_device_count, environ)
        device = f"cuda:{index}"

    if requested == "mpi":
        if not mpi_available:
            raise PlacementError(
                "this torch build has no MPI backend (torch.distributed.is_mpi_available() is "
                "False): use --backend gloo or nccl, which work in an MPI-launched job"
            )
        return Placement("mpi", device, reason)
    if requested == "gloo":
        return Placement("gloo", device, reason)
    wants_nccl = requested == "nccl" or device != "cpu"
    if not wants_nccl:
        return Placement("gloo", device, reason + "; auto: gloo on CPU")
    if device == "cpu":
        raise PlacementError("backend nccl needs a CUDA GPU and none is visible: use gloo")
    if not nccl_available:
        if requested == "nccl":
            raise PlacementError("this torch build has no NCCL: use gloo")
        return Placement("gloo", device, reason + "; auto: gloo (torch has no NCCL)")
    why = "; auto: nccl on GPU" if requested == "auto" else ""
    return Placement("nccl", device, reason + why)


def gpu_index(local_rank: int, count: int, environ: Mapping[str, str]) -> tuple[int, str]:
    """Which of the `count` GPUs this task sees is its own, and why.

    - ``--gpus-per-task=N`` (Slurm binds each task to its N GPUs): the first of them.
    - at least one GPU per rank of the node visible: the local rank's.
    - fewer (``--gpu-bind=closest``: the tasks of a socket share its GPUs; cgroup-constrained
      devices, where every task sees ``0``): the local rank's place among them, modulo.
    """
    named = next(((v, environ[v]) for v in VISIBLE_VARS if environ.get(v, "").strip()), None)
    bound = f" ({named[0]}={named[1]})" if named else ""
    per_task = _positive(environ.get(GPUS_PER_TASK_VAR))
    if per_task is not None and count >= per_task:
        first = local_rank * per_task if count >= (local_rank + 1) * per_task else 0
        return first, (f"the first of this task's {per_task} GPUs ({GPUS_PER_TASK_VAR}="
                       f"{per_task}){bound}")  # fmt: skip
    if count == 1:
        return 0, f"the one GPU this task sees{bound}"
    if local_rank < count:
        return local_rank, f"GPU of local rank {local_rank} of {count} visible{bound}"
    return local_rank % count, (f"local rank {local_rank} modulo the {count} GPUs this task "
                                f"sees{bound}")  # fmt: skip


def _positive(text: str | None) -> int | None:
    try:
        value = int(text or "")
    except ValueError:
        return None
    return value if value > 0 else None


THREADS_VAR = "OMP_NUM_THREADS"


def cpu_threads(environ: Mapping[str, str], usable_cpus: int, all_cpus: int,
                local_world_size: int) -> tuple[int, str] | None:  # fmt: skip
    """How many intra-op threads a rank should run, and why; None when the user said.

    torchrun sets OMP_NUM_THREADS for its workers; under srun nothing does, and every rank then
    starts a thread per core of the node, so the ranks of a node fight over the same cores (a
    2x2 DDP job ran 1.8 times slower). First match: OMP_NUM_THREADS as set; the CPUs Slurm gave the
    task (SLURM_CPUS_PER_TASK); the CPUs it is bound to, when that is fewer than the node's; the
    node's CPUs shared by its ranks.
    """
    if environ.get(THREADS_VAR, "").strip():
        return None
    per_task = environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isascii() and per_task.isdigit() and int(per_task) > 0:
        return int(per_task), "SLURM_CPUS_PER_TASK"
    if 0 < usable_cpus < all_cpus:
        return usable_cpus, "the CPUs this task is bound to"
    share = max(1, usable_cpus // max(1, local_world_size))
    return share, f"{usable_cpus} CPUs shared by {local_world_size} ranks on the node"


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a kernel CPU list ("0-15,32-47"); ValueError if it is not one."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def cpus_near_gpu(gpu_cpus: frozenset[int], mine: frozenset[int],
                  node_cpus: int) -> frozenset[int] | None:  # fmt: skip
    """The CPUs a rank should run on to be near its GPU, or None to leave it where it is.

    Only a task that nothing bound (it may run on every CPU of the node) moves: to the CPUs of
    its GPU's NUMA node as the kernel reports them, when those are fewer. A binding by Slurm
    (``--cpu-bind``, task/affinity) or by the user (numactl, taskset) is theirs to keep.
    """
    if len(mine) < node_cpus:
        return None
    near = gpu_cpus & mine
    return near if near and near != mine else None


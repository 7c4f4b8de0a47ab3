"""Which backend, device and CPU threads a rank uses: pure decisions, unit-tested without a GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from slurmddp.errors import UserError

BACKENDS = ("auto", "nccl", "gloo", "mpi")


class PlacementError(UserError, ValueError):
    """The requested backend cannot run here; the message says what to use instead."""


@dataclasses.dataclass(frozen=True)
class Placement:
    backend: str  # nccl, gloo or mpi
    device: str  # "cpu" or "cuda:N"
    reason: str

    @property
    def cuda_index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda") else None


def choose(
    requested: str,
    *,
    local_rank: int,
    local_world_size: int,
    cuda_device_count: int,
    cuda_visible_devices: str | None,
    nccl_available: bool,
    mpi_available: bool,
) -> Placement:
    """Pick the process-group backend and this rank's device.

    The device is the GPU of the local rank, or the only visible GPU when Slurm (or the user)
    bound one per task through CUDA_VISIBLE_DEVICES. `auto` means nccl on a GPU, gloo on CPU.
    """
    if requested not in BACKENDS:
        raise PlacementError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    device, reason = _device(local_rank, local_world_size, cuda_device_count, cuda_visible_devices)

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
    if cuda_device_count == 1 and local_world_size > 1 and not _single(cuda_visible_devices):
        raise PlacementError(
            f"{local_world_size} ranks on this node share one GPU and NCCL needs one GPU per "
            "rank: request a GPU per task (--gpus-per-node) or use gloo"
        )
    why = "; auto: nccl on GPU" if requested == "auto" else ""
    return Placement("nccl", device, reason + why)


def _device(
    local_rank: int, local_world_size: int, count: int, visible: str | None
) -> tuple[str, str]:
    if count <= 0:
        return "cpu", "no CUDA device visible"
    if count == 1:
        if _single(visible):
            return "cuda:0", f"the one GPU bound to this task (CUDA_VISIBLE_DEVICES={visible})"
        return "cuda:0", "the only GPU"
    if local_rank >= count:
        raise PlacementError(
            f"local rank {local_rank} has no GPU: only {count} visible "
            f"(CUDA_VISIBLE_DEVICES={visible!r}); start at most {count} tasks per node"
        )
    return f"cuda:{local_rank}", f"GPU of local rank {local_rank} of {count} visible"


def _single(visible: str | None) -> bool:
    return visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1


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

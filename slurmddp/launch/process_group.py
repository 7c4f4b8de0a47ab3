"""`slurmddp.init`: bootstrap, pick the device, initialise torch.distributed once."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from slurmddp.dist import group as current_group
from slurmddp.launch import startup
from slurmddp.preemption import api as preemption
from slurmddp.protocol import BACKEND_VAR as BACKEND_VAR
from slurmddp.rank import placement
from slurmddp.rank.bootstrap import bootstrap
from slurmddp.rank.env import DistEnv

_placement: placement.Placement | None = None



def init(
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    *,
    master_host_format: str | None = None,
    startup_timeout: float | None = None,
) -> DistEnv:
    """Resolve this rank, export torchrun's variables, set the device and join the process group.

    Also installs the stop-signal handlers of `slurmddp.should_stop` and the DataLoader seeding
    of `slurmddp.training.loader`.

    `backend` is auto (nccl on GPU, gloo on CPU), nccl, gloo or mpi; by default the one the job
    was submitted with (``slurmddp submit --backend``, exported as $SLURMDDP_BACKEND), else auto.
    `timeout` (seconds or a timedelta) bounds every collective, and start-up when shorter; None
    keeps torch's default (30 minutes on gloo, 10 on nccl). `startup_timeout` (seconds, default
    $SLURMDDP_STARTUP_TIMEOUT or 300) bounds the wait for every rank to join; its failure is a
    `slurmddp.launch.startup.StartupError` naming the missing ranks. Calling `init` again returns
    the same `DistEnv` without touching the existing group.
    """
    import torch
    import torch.distributed as td

    if startup_timeout is not None and not 0 < startup_timeout < float("inf"):
        raise ValueError(f"startup_timeout must be a number of seconds above 0, not "
                         f"{startup_timeout!r}")  # fmt: skip
    dist = bootstrap(master_host_format=master_host_format)
    preemption.install()
    # Before any DataLoader iterates, in a fresh run as in a resumed one (the seeding must match).
    from slurmddp.training import loader as exact_data

    exact_data.install()
    if current_group() is not None:
        return dist

    chosen = placement.choose(
        _submitted_backend() if backend is None else backend,
        local_rank=dist.local_rank,
        local_world_size=dist.local_world_size,
        cuda_device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        environ=os.environ,
        nccl_available=td.is_nccl_available(),
        mpi_available=td.is_mpi_available(),
    )
    global _placement
    _placement = chosen
    if chosen.cuda_index is not None:
        torch.cuda.set_device(chosen.cuda_index)
        _run_near(torch, chosen.cuda_index)
    _start(torch, td, chosen, dist, timeout, startup_timeout)
    return dist


def _submitted_backend() -> str:
    """The backend the job was submitted with ($SLURMDDP_BACKEND), else auto."""
    backend = os.environ.get(BACKEND_VAR) or "auto"
    if backend not in placement.BACKENDS:
        raise placement.PlacementError(
            f"{BACKEND_VAR}={backend!r} is not a backend: use one of "
            f"{', '.join(placement.BACKENDS)} (slurmddp submit --backend)"
        )
    return backend


def _start(torch: Any, td: Any, chosen: placement.Placement, dist: DistEnv,
           timeout: float | datetime.timedelta | None,
           startup_timeout: float | None) -> None:  # fmt: skip
    """init_process_group for `chosen`, through the bounded rendezvous (`startup.register`)."""
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = (
            timeout
            if isinstance(timeout, datetime.timedelta)
            else datetime.timedelta(seconds=timeout)
        )
    if chosen.backend == "nccl":
        # Binding the device eagerly lets NCCL build its communicator at init, not first use.
        kwargs["device_id"] = torch.device(chosen.device)
    if chosen.backend == "mpi":
        td.init_process_group("mpi", **kwargs)  # MPI knows rank and size itself
        return
    gpu = _uuid(torch, chosen.cuda_index) if chosen.backend == "nccl" else None
    with startup.limited(startup_timeout, gpu=gpu, backend=chosen.backend):
        td.init_process_group(
            chosen.backend,
            init_method=startup.register(),
            rank=dist.rank,
            world_size=dist.world_size,
            **kwargs,
        )


def _uuid(torch: Any, index: int | None) -> str | None:
    """The GPU's UUID as nvidia-smi -L writes it (a MIG instance's own under MIG)."""
    if index is None:
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else f"GPU-{uuid}"


def gpu_cpulist(torch: Any, index: int, sysfs: Path = Path("/sys")) -> Path:
    """Where the kernel lists the CPUs near GPU `index` (its PCI device's local_cpulist)."""
    props = torch.cuda.get_device_properties(index)
    address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
               f"{props.pci_device_id:02x}.0")  # fmt: skip
    return sysfs / "bus" / "pci" / "devices" / address / "local_cpulist"


def _run_near(torch: Any, index: int) -> None:
    """Move this process (and the threads it starts from now on) to the CPUs near its GPU,
    where nothing bound it (`placement.cpus_near_gpu`)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        near = placement.parse_cpulist(gpu_cpulist(torch, index).read_text())
    except (AttributeError, OSError, ValueError):  # no PCI address in torch, no sysfs
        return
    cpus = placement.cpus_near_gpu(near, frozenset(os.sched_getaffinity(0)), os.cpu_count() or 0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def device() -> str:
    """This rank's device as chosen by `init` ("cpu" or "cuda:N"); "cpu" before `init`."""
    return _placement.device if _placement is not None else "cpu"

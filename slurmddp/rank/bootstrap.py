"""The one side effect of start-up: resolve this process's place once and export it (with the
CPU threads it should run, `slurmddp.rank.placement.cpu_threads`, and the run's id,
`slurmddp.rank.identity.run_id`).

Both `python -m slurmddp.run` and `slurmddp.init()` go through `bootstrap`, so a script started by
the runner that also calls `init()` resolves once and sees the same answer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

from slurmddp.errors import first_time, warn
from slurmddp.protocol import MASTER_HOST_FORMAT_VAR as MASTER_HOST_FORMAT_VAR
from slurmddp.protocol import RUN_ID_VAR, STORE_SERVER_VAR
from slurmddp.rank.env import DistEnv, NodesUnknown, hostfile_head, resolve
from slurmddp.rank.identity import run_id
from slurmddp.rank.placement import THREADS_VAR, cpu_threads

_current: DistEnv | None = None


def bootstrap(
    environ: MutableMapping[str, str] | None = None, *, master_host_format: str | None = None
) -> DistEnv:
    """Resolve this process's `DistEnv` (first call only) and export torchrun's variables,
    $SLURMDDP_STORE_SERVER, and $SLURMDDP_RUN_ID when there is a run id
    (`slurmddp.rank.identity.run_id`).

    `master_host_format` (default: $SLURMDDP_MASTER_HOST_FORMAT, else ``{host}``) maps rank 0's
    host name to the address other ranks dial. Raises `EnvError` on contradictions.
    """
    global _current
    if _current is not None:
        return _current
    env = os.environ if environ is None else environ
    fmt = master_host_format or env.get(MASTER_HOST_FORMAT_VAR) or "{host}"
    head = hostfile_head(env)  # a file read only under --distribution=arbitrary
    try:
        dist = resolve(env, master_host_format=fmt, hostfile_head=head)
    except NodesUnknown as e:
        # mpirun on several nodes: the ranks tell each other where they run.
        from slurmddp.rank.mpi import survey

        found = survey(e.world_size, pick_port="MASTER_PORT" not in env)
        if found is None:
            dist = resolve(env, master_host_format=fmt, mpi_nodes="block", hostfile_head=head)
        else:
            told, port = found
            if port is not None:
                env["MASTER_PORT"] = str(port)
            dist = resolve(env, master_host_format=fmt, mpi_nodes=told, hostfile_head=head)
    env.update(dist.torchrun_env())
    env[STORE_SERVER_VAR] = "1" if dist.serves_store else "0"
    if (run := run_id(env)) is not None:
        env[RUN_ID_VAR] = run  # sanitised, and the same for the script's own children
    _set_threads(env, dist)
    say_restart_hazard(env)
    _current = dist
    return dist


def _set_threads(env: MutableMapping[str, str], dist: DistEnv) -> None:
    """Export OMP_NUM_THREADS unless the user set it (`slurmddp.rank.placement.cpu_threads`)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    threads = cpu_threads(env, usable or (os.cpu_count() or 1), os.cpu_count() or 1,
                          dist.local_world_size)  # fmt: skip
    if threads is None:
        return
    env[THREADS_VAR] = str(threads[0])
    if "torch" in sys.modules:  # already loaded: OpenMP read the variable then
        sys.modules["torch"].set_num_threads(threads[0])


def current() -> DistEnv | None:
    """The `DistEnv` this process bootstrapped with, or None before `bootstrap`."""
    return _current


def restart_hazard(environ: Mapping[str, str]) -> str | None:
    """Why torchrun's own restarts of this worker would fail, or None. Its agent shares one store
    with the workers across restarts, under the same keys (torch 2.8 to 2.13 at least;
    pytorch/pytorch#167288): a restarted worker reads a dead one's address and the process
    group never forms. slurmddp.agent, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, give each
    round a store of its own (the workers then see TORCHELASTIC_USE_AGENT_STORE=False)."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() \
            or int(restarts) == 0:  # fmt: skip
        return None
    return (f"torchrun --max-restarts {restarts} will not restart this training: its agent keeps "
            "one store for the workers across restarts, and the restarted ones would read the "
            "dead ones' addresses and fail to form the process group (pytorch/pytorch#167288). "
            "Start it with python -m slurmddp.agent in place of torchrun (the same options), "
            "or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun")  # fmt: skip


def say_restart_hazard(environ: Mapping[str, str] = os.environ) -> None:
    """Rank 0 warns once per process of a `restart_hazard`."""
    if environ.get("RANK", "0") != "0" or not first_time("bootstrap.restart_hazard"):
        return
    if (said := restart_hazard(environ)) is not None:
        warn(said)

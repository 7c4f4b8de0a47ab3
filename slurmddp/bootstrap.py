"""The one side effect of start-up: resolve this process's place once and export it.

Both `python -m slurmddp.run` and `slurmddp.init()` go through `bootstrap`, so a script started by
the runner that also calls `init()` resolves once and sees the same answer.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from slurmddp.env import DistEnv, MasterUnknown, resolve

MASTER_HOST_FORMAT_VAR = "SLURMDDP_MASTER_HOST_FORMAT"

_current: DistEnv | None = None


def bootstrap(
    environ: MutableMapping[str, str] | None = None, *, master_host_format: str | None = None
) -> DistEnv:
    """Resolve this process's `DistEnv` (first call only) and export torchrun's variables.

    `master_host_format` (default: $SLURMDDP_MASTER_HOST_FORMAT, else ``{host}``) maps rank 0's
    host name to the address other ranks dial. Raises `slurmddp.env.EnvError` on contradictions.
    """
    global _current
    if _current is not None:
        return _current
    env = os.environ if environ is None else environ
    fmt = master_host_format or env.get(MASTER_HOST_FORMAT_VAR) or "{host}"
    try:
        dist = resolve(env, master_host_format=fmt)
    except MasterUnknown:
        # mpirun across hosts outside Slurm: only rank 0 knows where it runs.
        from slurmddp.mpi import share_master

        addr, port = share_master(fmt, pick_port="MASTER_PORT" not in env)
        env["MASTER_ADDR"] = addr
        if port is not None:
            env["MASTER_PORT"] = str(port)
        dist = resolve(env, master_host_format=fmt)
    env.update(dist.torchrun_env())
    _current = dist
    return dist


def current() -> DistEnv | None:
    """The `DistEnv` this process bootstrapped with, or None before `bootstrap`."""
    return _current

"""What only MPI itself can tell: rank 0's address, for an MPI job across nodes outside Slurm.

Under ``mpirun`` on several hosts without a Slurm allocation no variable names rank 0's host, so
rank 0 says it: one broadcast over mpi4py (the ``mpi`` extra), once, at start-up.
"""

from __future__ import annotations

import socket

from slurmddp.env import EnvError


def share_master(host_format: str, *, pick_port: bool) -> tuple[str, int | None]:
    """Rank 0's address (its host name through `host_format`), the same on every rank.

    With `pick_port`, rank 0 also picks a free port for all (else None). A collective over
    MPI_COMM_WORLD.
    """
    try:
        from mpi4py import MPI
    except ImportError:
        raise EnvError(
            "MASTER_ADDR is not set and this MPI job spans several nodes outside Slurm: install "
            "mpi4py (pip install 'slurmddp[mpi]') so that rank 0 can share its address, or set "
            "MASTER_ADDR (and MASTER_PORT) for every rank"
        ) from None
    comm = MPI.COMM_WORLD
    chosen = None
    if comm.Get_rank() == 0:
        try:
            chosen = (host_format.format(host=socket.gethostname()),
                      _free_port() if pick_port else None)
        except (KeyError, IndexError, ValueError) as e:
            chosen = EnvError(f"master host format {host_format!r} is invalid: {e}")
    chosen = comm.bcast(chosen, root=0)  # pickled, between this job's own ranks only
    if isinstance(chosen, EnvError):
        raise chosen
    return chosen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

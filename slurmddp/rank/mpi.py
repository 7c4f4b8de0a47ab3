"""What only MPI itself can tell: which node each rank is on, and rank 0's address.

Under ``mpirun`` on several nodes no variable gives a rank's node (mpirun may map round-robin,
``--map-by node``, or put uneven counts on the hosts), and outside Slurm none names rank 0's
host. The ranks tell each other: one allgather over mpi4py (the ``mpi`` extra), once, at
start-up.
"""

from __future__ import annotations

import os
import socket
import sys

from slurmddp.rank.env import MpiNodes


def survey(world_size: int, *, pick_port: bool) -> tuple[MpiNodes, int | None] | None:
    """This rank's node among the job's, rank 0's host name and (with `pick_port`) a free port
    on it; None without mpi4py, or where MPI's world is not the `world_size` ranks the launcher's
    variables describe. A collective over MPI_COMM_WORLD."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != world_size:
        return None
    rank = comm.Get_rank()
    # A node is what Slurm calls one (several slurmd may share a host; its node list, which
    # srun's master comes from, names them so), else the host.
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    port = _free_port() if pick_port and rank == 0 else None
    everyone = comm.allgather((node, port))  # this job's ranks only
    nodes = list(dict.fromkeys(n for n, _ in everyone))  # in the order of their lowest rank
    told = MpiNodes(node_rank=nodes.index(node), num_nodes=len(nodes),
                    ranks_here=sum(n == node for n, _ in everyone),
                    master_host=everyone[0][0])  # fmt: skip
    return told, everyone[0][1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def abort(status: int) -> None:
    """End every rank of the job where this process started MPI (`survey`), with `status`: a
    failed rank's MPI_Finalize at exit would wait for the others, which wait at the rendezvous
    for it, until a timeout (seen under mpirun). Nothing where MPI was not started."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(status)

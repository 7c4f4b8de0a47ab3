"""Run slurmddp.run as if mpirun had spread its ranks over two hosts.

    mpirun -np N python mpi_two_hosts.py slot|node|uneven SCRIPT [ARGS...]

mpirun on this one machine says every rank shares a host; this sets what it would say on two hosts
(each rank's local rank and count, and its node's name as SLURMD_NODENAME, which is what slurmddp
calls a node: "localhost" and "127.0.0.1", two names that both reach this machine): `slot` fills
the first host with two ranks, then the second; `node` deals ranks round-robin (--map-by node);
`uneven` is -np 3 over hosts of 2 and 1 slots. The rest is real: MPI, mpi4py, gloo.
"""

import os
import sys

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
mapping = sys.argv.pop(1)
node, local, local_size = {
    "slot": (rank // 2, rank % 2, 2),
    "node": (rank % 2, rank // 2, size // 2),
    "uneven": (0, rank, 2) if rank < 2 else (1, 0, 1),
}[mapping]
os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = str(local_size)
os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = str(local)
os.environ["SLURMD_NODENAME"] = ("localhost", "127.0.0.1")[node]

from slurmddp.launch import runner as run  # noqa: E402

run.exit_process(run.main(sys.argv[1:]))

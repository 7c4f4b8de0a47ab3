"""Run slurmddp.run as if mpirun had spread its ranks over two hosts, two ranks on each.

mpirun on this one machine says every rank shares a host; a multi-host mpirun outside Slurm is
the case where no variable names rank 0's host. The rest is real: MPI, mpi4py, gloo.
"""

import os
import sys

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2"
os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = str(rank % 2)

from slurmddp import run  # noqa: E402

run.exit_process(run.main(sys.argv[1:]))

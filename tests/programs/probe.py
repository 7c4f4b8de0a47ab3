"""Print what this rank sees as one JSON line, after a gloo all_reduce across the job.

Written for torchrun (env://), as a user's script would be.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_PROCID",
         "OMPI_COMM_WORLD_RANK", "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_JOB_ID",
         "SLURMDDP_STORE_SERVER")  # fmt: skip

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
line = "PROBE " + json.dumps({
    "env": {k: os.environ.get(k) for k in NAMES},
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "all_reduce": t.item(),
    "host": socket.gethostname(),
    "argv": sys.argv[1:],
    "name": __name__,
})  # fmt: skip
# One write per line: ranks sharing a pipe (torchrun's workers) must not interleave.
sys.stdout.write(line + "\n")
sys.stdout.flush()
dist.barrier()  # leave together (see examples/ddp_train.py)
dist.destroy_process_group()

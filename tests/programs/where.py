"""Print where this rank runs and what it sees, as one JSON line, after a gloo all_reduce.

For ranks in a container: which Python and slurmddp (the image's or the host's), and the
variables an image's %environment may set too (whose value must be the job's).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import slurmddp

NAMES = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NODEID", "SLURMD_NODENAME",
         "SLURMDDP_HANG_TIMEOUT", "SLURMDDP_SIGNAL", "SLURMDDP_IMAGE", "SDDP_VALUE")  # fmt: skip

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
line = "WHERE " + json.dumps({
    "env": {k: os.environ.get(k) for k in NAMES},
    "rank": dist.get_rank(),
    "all_reduce": t.item(),
    "executable": sys.executable,
    "slurmddp": slurmddp.__file__,
    "torch": torch.__file__,
})  # fmt: skip
sys.stdout.write(line + "\n")
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()

"""Initialise a gloo group with env:// and all_reduce once; print the wall clock when done.

Used by the time-to-first-collective benchmark under every launcher, unchanged.
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
one = torch.ones(1)
dist.all_reduce(one)
# One write call: ranks sharing a pipe (torchrun's workers) must not split each other's lines.
os.write(1, f"FIRST_COLLECTIVE {time.time():.6f} {dist.get_rank()} {int(one.item())}\n".encode())
dist.destroy_process_group()
os._exit(0)  # gloo's teardown at interpreter exit can abort a finished rank

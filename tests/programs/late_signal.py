"""Finishes its work, marks itself done, then lingers: a signal arriving now must not requeue it."""

import argparse
import time

import torch.distributed as dist

import slurmddp

p = argparse.ArgumentParser()
p.add_argument("--linger", type=float, default=5)
args = p.parse_args()

slurmddp.init("gloo", timeout=60)
for _ in range(5):
    assert not slurmddp.should_stop()
slurmddp.mark_done()
if dist.get_rank() == 0:
    print("DONE", flush=True)
time.sleep(args.linger)  # final evaluation, upload... the late signal lands here
dist.barrier()
dist.destroy_process_group()

"""A small DDP training loop that prints its steps per second (rank 0), for the overhead benchmark.

With --check it calls slurmddp.should_stop() at every step, as a preemptible loop does.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--check", action="store_true")
args = p.parse_args()
if args.check:
    import slurmddp

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
    torch.nn.Linear(256, 1)))  # fmt: skip
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randn(64, 1)


def step() -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


for _ in range(20):  # warm-up: bucket rebuild, allocator
    step()
dist.barrier()
start = time.perf_counter()
for _ in range(args.steps):
    step()
    if args.check and slurmddp.should_stop():
        break
dist.barrier()
if dist.get_rank() == 0:
    print(f"STEPS_PER_S {args.steps / (time.perf_counter() - start)}", flush=True)
dist.destroy_process_group()
# gloo's teardown at interpreter exit can abort a finished rank ("terminate called without an
# active exception"): leave as slurmddp.run does.
os._exit(0)

"""The training benchmark's DDP loop (benchmarks/programs/steps.py) with a Checkpointer's snapshots
every N steps, for the snapshot benchmark; prints rank 0's steps per second.

    --snapshot-every 0   the baseline: the same loop, the same Checkpointer, no snapshot
    --width W            the hidden layers' width: 256 is the training benchmark's model (0.5 MiB
                         of parameters), 8192 x --layers 4 about 1 GiB
    --device cuda        the model and its data on the rank's GPU (NCCL), else the CPU (gloo)
    --report-store       after the last snapshot, each rank prints STORE <node> <bytes>: what
                         its node's store holds
    --no-share           each rank keeps its whole state, as before a node's ranks kept one copy
                         of what they hold alike (the memory rows' baseline)
"""

import argparse
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import slurmddp
from slurmddp.training import train_state

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--snapshot-every", type=int, default=0)
p.add_argument("--width", type=int, default=256)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--keep", type=int, default=2, help="snapshot_keep")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--checkpoint-dir", required=True,
               help="the Checkpointer's directory (nothing durable is saved there)")
p.add_argument("--budget", default="default",
               help="snapshot_budget: a fraction, none, or default (the Checkpointer's)")
p.add_argument("--report-store", action="store_true")
p.add_argument("--no-share", action="store_true")
args = p.parse_args()
if args.no_share:
    from slurmddp.checkpoint.snapshots import snapshotter

    snapshotter.SHARE = False

dist = slurmddp.init("gloo" if args.device == "cpu" else "nccl")
device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
torch.manual_seed(0)
layers = [torch.nn.Linear(256, args.width), torch.nn.ReLU()]
for _ in range(args.layers - 1):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
model = DistributedDataParallel(torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1)).to(
    device))  # fmt: skip
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256, device=device), torch.randn(64, 1, device=device)


def synchronized() -> None:  # a clock read after the GPU's queued work has run
    ckpt.wait()
    if device is not None:
        torch.cuda.synchronize()
    torch.distributed.barrier()

budget = {} if args.budget == "default" else {
    "snapshot_budget": None if args.budget == "none" else float(args.budget)}
ckpt = slurmddp.Checkpointer(args.checkpoint_dir,
                             snapshot_every=args.snapshot_every, snapshot_keep=args.keep,
                             **budget)  # fmt: skip


def state() -> dict:
    return train_state.capture(model=model, optimizer=opt, step=step)


def one_step() -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


for step in range(1, 1 + args.warmup):  # warm-up: buckets, allocator, the first snapshots
    one_step()
    ckpt.snapshot(step, state)
synchronized()
start = time.perf_counter()
for step in range(1 + args.warmup, 1 + args.warmup + args.steps):
    one_step()
    ckpt.snapshot(step, state)
synchronized()
if dist.rank == 0:
    print(f"STEPS_PER_S {args.steps / (time.perf_counter() - start)}", flush=True)
    print(f"INTERVAL {ckpt.snapshot_interval}", flush=True)
if args.report_store:
    from slurmddp.checkpoint.snapshots import store

    here = store.node_directory(os.environ, args.checkpoint_dir)
    held = sum(p.stat().st_size for p in here.glob("*.snap"))
    print(f"STORE {store.node_name(os.environ)} {held}", flush=True)
    torch.distributed.barrier()  # every node measured before mark_done removes the stores
slurmddp.mark_done()
torch.distributed.destroy_process_group()
os._exit(0)

"""A training that logs every sample it takes, for the elastic tests (any world size).

    elastic_samples.py --checkpoint-dir DIR [--steps N] [--samples S] [--batch-size B]

Each step each rank trains on a batch of sample ids (a ResumableDistributedSampler over S ids)
and prints ``SAMPLES {"restart": torchrun's restart count, "step", "epoch", "world", "ids"}``;
every 10 steps a checkpoint keeps (step, epoch, position). A resumed run starts at the
checkpoint's global sample, whatever its world size.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import slurmddp

p = argparse.ArgumentParser()
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--samples", type=int, default=480)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--step-time", type=float, default=0.2)
args = p.parse_args()

slurmddp.init("gloo", timeout=60)
world = dist.get_world_size()
dataset = TensorDataset(torch.arange(args.samples))
sampler = slurmddp.ResumableDistributedSampler(dataset, shuffle=True, seed=3)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2)
step, epoch, position = 0, 0, 0
loaded = ckpt.load_latest()
if loaded is not None:
    step, epoch, position = (int(loaded.state[k]) for k in ("step", "epoch", "position"))
    if dist.get_rank() == 0:
        print(f"resumed at step {step} (epoch {epoch}, sample {position}) with {world} ranks",
              flush=True)  # fmt: skip
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
total = torch.zeros(1)
while step < args.steps:
    sampler.set_epoch(epoch, start=position)
    for (ids,) in loader:
        dist.all_reduce(total)  # a lost peer fails every rank here
        step += 1
        position += len(ids) * world
        record = {"restart": restart, "step": step, "epoch": epoch, "world": world,
                  "ids": ids.tolist()}  # fmt: skip
        sys.stdout.write(f"SAMPLES {json.dumps(record)}\n")
        sys.stdout.flush()
        time.sleep(args.step_time)
        if step % 10 == 0:
            ckpt.save(step, {"step": step, "epoch": epoch, "position": position})
        if step == args.steps:
            break
    else:
        epoch, position = epoch + 1, 0
slurmddp.mark_done()
dist.barrier()
dist.destroy_process_group()

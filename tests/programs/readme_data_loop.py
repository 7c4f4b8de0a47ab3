"""The loop of docs/guide/preemption.md as a user fills it in: a model with dropout, a map-style
dataset whose `__getitem__` augments at random with torch, numpy and `random`, and an ordinary
DataLoader.

    python -m slurmddp.run tests/programs/readme_data_loop.py --checkpoint-dir DIR \
        [--stop-at 4,12] [--sampler resumable|distributed|random] [--workers 2] \
        [--start-method spawn] [--persistent] [--prefetch 4] [--snapshot-every 1] [--crash-at 9]

Stops by itself (saves, requeues: exit 75 outside Slurm) at the first --stop-at step past its
start, as a preemption would there. With --snapshot-every, the guide's snapshots; --crash-at N
kills every rank (SIGKILL, no exit handler) right after step N's snapshot call, as a lost
machine ends its processes (in torchrun's first run of the workers only).
Prints RESULT {"rank", "digest", "start", "steps", "resumed"}.
"""

import argparse
import hashlib
import json
import os
import random
import signal
import sys

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import slurmddp
from slurmddp.training import train_state


class Noisy(Dataset):
    """48 samples of 8 features; each fetch adds noise from torch, numpy and random."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(48, 8, generator=g)
        self.y = torch.randn(48, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(8)
        x = x * float(np.random.uniform(0.9, 1.1)) + random.gauss(0, 0.01)
        return x, self.y[i]


def die_in_snapshot(step: int) -> None:
    """Rank 1 is SIGKILLed in its snapshot of `step`, before its file is whole (in the first
    run of a torchrun job only)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    from slurmddp.checkpoint.snapshots.store import NodeStore

    put = NodeStore.put

    def dying(store, shard, data, reuse=None):
        if os.environ["RANK"] == "1" and (shard.step, shard.rank) == (step, 1):
            os.kill(os.getpid(), signal.SIGKILL)
        put(store, shard, data, reuse)

    NodeStore.put = dying


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--stop-at", default="")
    p.add_argument("--sampler", default="distributed",
                   choices=["resumable", "distributed", "random"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--start-method")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--prefetch", type=int)
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--snapshot-budget", default="default",
                   help="a fraction, none (every --snapshot-every steps), or the default")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--save-every", type=int, default=0, help="durable checkpoints every N steps")
    p.add_argument("--die-in-snapshot", type=int,
                   help="rank 1 is killed in this step's snapshot, before its file is whole")
    args = p.parse_args()
    if args.die_in_snapshot:
        die_in_snapshot(args.die_in_snapshot)

    dist = slurmddp.init("gloo")
    torch.manual_seed(0)
    # Without workers the samples draw from this process's generators, as in torch: the test
    # compares with an uninterrupted run in other processes, so all three are seeded (python's
    # and numpy's start from the OS's entropy otherwise). The resume itself needs no seed.
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    dataset = Noisy()
    if args.sampler == "resumable":
        sampler = slurmddp.ResumableDistributedSampler(dataset, shuffle=True)
    elif args.sampler == "distributed":
        sampler = DistributedSampler(dataset, shuffle=True)
    else:
        sampler = None  # shuffle=True: a RandomSampler, every rank the whole dataset
    extra = {}
    if args.workers:
        extra = {"multiprocessing_context": args.start_method,
                 "persistent_workers": args.persistent}
        if args.prefetch:
            extra["prefetch_factor"] = args.prefetch
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, shuffle=sampler is None,
                        num_workers=args.workers, **extra)
    stops = [int(s) for s in args.stop_at.split(",") if s]
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # torchrun's restarts

    # ---- the guide's loop, with the loader ----
    budget = {} if args.snapshot_budget == "default" else {
        "snapshot_budget": None if args.snapshot_budget == "none" else float(args.snapshot_budget)}
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=3, snapshot_every=args.snapshot_every,
                                 **budget)
    loaded = ckpt.load_latest()
    step, first_epoch = 0, 0
    if loaded:
        counters = train_state.restore(loaded.state, model=ddp, optimizer=opt, loader=loader)
        step, first_epoch = counters["step"], counters["epoch"]
    start = step
    epoch = first_epoch

    def state():  # what a checkpoint or snapshot holds, when one is due
        return train_state.capture(model=ddp, optimizer=opt, loader=loader, step=step,
                                   epoch=epoch)

    for epoch in range(first_epoch, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            ckpt.snapshot(step, state)
            if step == args.crash_at and start < step and first_run:
                os.kill(os.getpid(), signal.SIGKILL)
            if any(start < s == step for s in stops) or slurmddp.should_stop():
                ckpt.save(step, state())
                slurmddp.requeue()
            if args.save_every and step % args.save_every == 0:
                ckpt.save(step, state())
    slurmddp.mark_done()
    # ---- to here ----

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    result = {"rank": dist.rank, "digest": digest, "finite": bool(flat.isfinite().all()),
              "start": start, "steps": step,
              "resumed": str(loaded.path) if loaded else None}
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: ranks may share a pipe
    sys.stdout.flush()


# Spawned DataLoader workers import this file again: only the main process trains.
if __name__ == "__main__":
    main()

"""A deterministic DDP training that survives preemption and time limits, bit for bit.

    slurmddp submit --nodes 2 --ntasks-per-node 2 examples/resumable_train.py \\
        --steps 300 --checkpoint-dir ckpt

Every step ends at a boundary where `slurmddp.should_stop()` asks all ranks at once whether any
got the stop signal; if so they checkpoint together and `slurmddp.requeue()` hands the job back to
Slurm. The next run loads the latest checkpoint (model, optimizer, scheduler, RNG states, epoch
and position in it) and goes on, so the final parameters equal an uninterrupted run's exactly.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import slurmddp
from slurmddp.training import train_state


def busy(seconds: float) -> None:
    """`seconds` of this thread's CPU time, hashing."""
    start, block = time.thread_time(), bytes(1 << 16)
    while time.thread_time() - start < seconds:
        hashlib.sha256(block).digest()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--save-every", type=int, default=100, help="also checkpoint every N steps")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="keep a snapshot every N steps in the nodes' memory (0: none)")
    p.add_argument("--snapshot-budget", help="the most of the training's time snapshots may "
                   "take, as a fraction (default: the Checkpointer's); none: every "
                   "--snapshot-every steps whatever they cost")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--fresh-step-time", type=float,
                   help="seconds of extra work per step until the first resume (default: "
                        "--step-time): a first run that cannot finish, resumed runs that can")
    p.add_argument("--requeued-step-time", type=float,
                   help="seconds of extra work per step in a requeued run (SLURM_RESTART_COUNT "
                        "over 0; default: as before)")
    p.add_argument("--cpu-time", type=float, default=0.0,
                   help="CPU seconds of work per step on the rank's own CPU (a throttled node "
                        "takes longer for it)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--slow-save", type=float, default=0.0,
                   help="seconds a stop's checkpoint takes more, as on a slow file system")
    p.add_argument("--worker-start", choices=["fork", "spawn", "forkserver"],
                   help="how the DataLoader starts its workers (default: Python's)")
    args = p.parse_args()

    slurmddp.init("gloo", timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # dropout masks differ by rank: every rank's RNG is checkpointed
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    ddp = DistributedDataParallel(model)  # starts from rank 0's parameters
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.9)
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(1000, 16, generator=data)
    dataset = TensorDataset(x, x @ torch.linspace(-1, 1, 16).unsqueeze(1))
    sampler = slurmddp.ResumableDistributedSampler(dataset, shuffle=True, seed=7)
    # Built as usual: slurmddp.init() seeds every DataLoader from (seed, epoch, sample), so
    # making an iterator draws nothing from the training's generator (docs/guide/preemption.md,
    # "Exact resume with a DataLoader").
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers,
                        multiprocessing_context=args.worker_start if args.workers else None,
                        persistent_workers=args.workers > 0)  # fmt: skip
    # With snapshots, a lost node or a killed worker costs the steps since the last one.
    budget = {} if args.snapshot_budget is None else {
        "snapshot_budget": None if args.snapshot_budget == "none" else float(args.snapshot_budget)}
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2, snapshot_every=args.snapshot_every,
                                 **budget)

    step, epoch, position = 0, 0, 0
    loaded = ckpt.load_latest()
    if loaded is not None:
        # Given the DDP model, restore also primes its gradient buckets as the uninterrupted run
        # had them: the resumed run then reduces gradients bit for bit alike.
        at = train_state.restore(loaded.state, model=ddp, optimizer=optimizer, scheduler=scheduler)
        step, epoch, position = at["step"], at["epoch"], at["position"]
        if rank == 0:
            print(f"resumed from {loaded.path} at step {step} (epoch {epoch}, sample {position})",
                  flush=True)  # fmt: skip

    fresh = args.step_time if args.fresh_step_time is None else args.fresh_step_time
    step_time = args.step_time if loaded is not None else fresh
    if args.requeued_step_time is not None and int(os.environ.get("SLURM_RESTART_COUNT") or 0):
        step_time = args.requeued_step_time

    def state() -> dict:
        return train_state.capture(model=ddp, optimizer=optimizer, scheduler=scheduler,
                                   step=step, epoch=epoch, position=position)  # fmt: skip

    while step < args.steps:
        sampler.set_epoch(epoch, start=position)
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            position += len(inputs) * world
            time.sleep(step_time)
            busy(args.cpu_time)
            ckpt.snapshot(step, state)  # every snapshot_every steps; nothing without
            if rank == 0 and step % args.log_every == 0:
                spacing = ckpt.snapshot_interval  # 0 without snapshots
                print(f"step {step} loss {loss.item():.5f}"
                      + (f" snapshots every {spacing}" if spacing else ""), flush=True)
            if step == args.steps:
                break
            if slurmddp.should_stop():
                time.sleep(args.slow_save)
                ckpt.save(step, state())
                if rank == 0:
                    print(f"stopped at step {step} (epoch {epoch}, sample {position})", flush=True)
                slurmddp.requeue()
            if step % args.save_every == 0:
                ckpt.save(step, state())
        else:
            epoch, position = epoch + 1, 0
    slurmddp.mark_done()

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()
    result = {"rank": rank, "world_size": world, "steps": step, "digest": digest,
              "finite": bool(flat.isfinite().all()),
              "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}  # fmt: skip
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: ranks may share a pipe
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

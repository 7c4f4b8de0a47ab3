"""DDP with a distributed sampler, evaluation and logging on rank 0, preemption-safe checkpoints.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/ddp_sampler_eval.py --epochs 5
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/ddp_sampler_eval.py --epochs 5
    slurmddp submit --local --follow --nodes 2 --ntasks-per-node 1 \\
        --local-signal-after 20steps examples/ddp_sampler_eval.py --step-time 0.02  # stopped once

The skeleton to copy:

- `sampler.set_epoch(epoch)` at the top of every epoch: without it every epoch shuffles alike.
  ResumableDistributedSampler is torch's DistributedSampler (same arguments, same order) that can
  also start mid-epoch, so a preempted run goes on at the first sample it had not seen.
- Evaluation on rank 0 only, through `ddp.module`: the other ranks wait for it in the next
  collective (the checkpoint save).
- Prints from rank 0 only, or every line appears once per rank.
- `slurmddp.should_stop()` after every step (cheap: the ranks talk only once a signal came). When
  the job gets its stop signal, every rank gets True at the same step, they checkpoint together
  and `slurmddp.requeue()` hands the job back to Slurm; the next run resumes from there.

`examples/resumable_train.py` is the same protocol as a step-based loop with dropout, a
scheduler and a resume at another world size; it is what the bitwise preemption tests train.
Rank 0 ends with one line ``RESULT {...}`` (JSON): validation loss and a parameter digest.
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import slurmddp
from slurmddp.training import train_state


def digest(flat: torch.Tensor) -> str:
    """The parameters' bits, hashed (no numpy: the example needs only torch)."""
    return hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()[:16]


def make_data(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    y = torch.sin(x @ torch.linspace(-1, 1, 16)).unsqueeze(1)
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--checkpoint-dir", default="checkpoints/ddp_sampler_eval")
    p.add_argument("--step-time", type=float, default=0.0, help="pretend each step is slower")
    args = p.parse_args()

    env = slurmddp.init()  # gloo on CPU, nccl on the rank's GPU; installs the stop handlers
    rank, world = env.rank, env.world_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model.to(device))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    train_set, val_set = make_data(args.samples, seed=1), make_data(512, seed=2)
    sampler = slurmddp.ResumableDistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2)

    step, start_epoch, seen = 0, 0, 0  # seen: samples all ranks consumed in this epoch
    loaded = ckpt.load_latest()  # None on a fresh start
    if loaded is not None:
        # Also puts the sampler back at its epoch and position, and every rank's RNG state.
        at = train_state.restore(loaded.state, model=ddp, optimizer=optimizer, sampler=sampler)
        step, start_epoch, seen = at["step"], at["epoch"], at["position"]
        log(f"resumed from {loaded.path.name}: epoch {start_epoch}, sample {seen}")

    def state(epoch: int) -> dict:
        return train_state.capture(model=ddp, optimizer=optimizer, sampler=sampler, step=step,
                                   epoch=epoch, position=seen)  # fmt: skip

    loss, val_loss = torch.tensor(float("nan")), float("nan")
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # after a resume, keeps the restored position in this epoch
        ddp.train()
        trained = False  # resumed at the very end of an epoch, this run trains none of it
        for x, y in loader:
            trained = True
            loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            step += 1
            seen += len(x) * world
            time.sleep(args.step_time)
            if slurmddp.should_stop():  # the same answer on every rank
                ckpt.save(step, state(epoch))
                log(f"stopped at step {step} (epoch {epoch}, sample {seen})")
                slurmddp.requeue()  # ends this process; the job comes back and resumes
        seen = 0

        if rank == 0:
            # The wrapped module, not `ddp`: DDP's forward may talk to the other ranks.
            model.eval()
            with torch.no_grad():
                x, y = val_set.tensors
                val_loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()
            model.train()
            train = f"train loss {loss.item():.4f}, " if trained else ""
            log(f"epoch {epoch}: {train}validation loss {val_loss:.4f}")
        ckpt.save(step, state(epoch + 1))  # the end of an epoch is a checkpoint too
    slurmddp.mark_done()  # a late stop signal can no longer requeue a finished job

    if rank == 0:
        flat = torch.cat([q.detach().cpu().flatten() for q in model.parameters()])
        result = {"world_size": world, "epochs": args.epochs, "steps": step,
                  "val_loss": round(val_loss, 6),
                  "finite": bool(flat.isfinite().all()),
                  "digest": digest(flat),
                  "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}  # fmt: skip
        print(f"RESULT {json.dumps(result)}", flush=True)
    dist.barrier()  # leave together: a rank that tears down early can abort a slower one
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

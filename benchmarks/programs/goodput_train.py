"""The goodput benchmark's training (benchmarks/goodput.py): one loop, each tool's way around it.

    --style slurmddp   slurmddp.init(); a Checkpointer saved every --save-every steps and at the
                       agreed stop; should_stop(), requeue(), mark_done() (--snapshot-every N:
                       snapshots in the nodes' memory too)
    --style plain      torch.distributed from torchrun's variables; torch.save of the newest state
                       every --save-every steps (rank 0), loaded at the start: what a user writes
                       for `torchrun --max-restarts` under `sbatch --requeue`

Each step is a DDP step of a small model and --step-time seconds of sleep (the work a GPU would
do). Rank 0 prints ``STEP n <time>`` every --log-every steps and ``DONE n`` at the end. Also
imported by goodput_submitit.py (submitit's Checkpointable) for its model and loop.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def model_and_optimizer() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))  # fmt: skip
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def loop(model: DistributedDataParallel, opt: torch.optim.Optimizer, start: int, steps: int,
         step_time: float, log_every: int, after: Callable[[int], None]) -> int:  # fmt: skip
    """Train from step `start` to `steps`, calling `after(step)` after each; the last step."""
    g = torch.Generator().manual_seed(start)
    rank = dist.get_rank()
    step = start
    while step < steps:
        x = torch.randn(32, 64, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(step_time)
        step += 1
        if rank == 0 and step % log_every == 0:
            print(f"STEP {step} {time.time():.3f}", flush=True)
        after(step)
    return step


def save_plain(path: Path, model: DistributedDataParallel, opt: torch.optim.Optimizer,
               step: int) -> None:  # fmt: skip
    """torch.save of the state, written beside and renamed (what a careful user writes)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def load_plain(path: Path, model: DistributedDataParallel, opt: torch.optim.Optimizer) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])


def plain(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    model, opt = model_and_optimizer()
    path = Path(args.checkpoint_dir) / "latest.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = load_plain(path, model, opt)

    def after(step: int) -> None:
        if step % args.save_every == 0 and dist.get_rank() == 0:
            save_plain(path, model, opt, step)

    end = loop(model, opt, start, args.steps, args.step_time, args.log_every, after)
    if dist.get_rank() == 0:
        print(f"DONE {end}", flush=True)


def with_slurmddp(args: argparse.Namespace) -> None:
    import slurmddp

    slurmddp.init("gloo")
    model, opt = model_and_optimizer()
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2, snapshot_every=args.snapshot_every)

    def state() -> dict:
        return {"model": model.module.state_dict(), "opt": opt.state_dict()}

    loaded = ckpt.load_latest()
    start = 0
    if loaded is not None:
        model.module.load_state_dict(loaded.state["model"])
        opt.load_state_dict(loaded.state["opt"])
        start = loaded.step

    def after(step: int) -> None:
        ckpt.snapshot(step, state)
        if slurmddp.should_stop():
            ckpt.save(step, state())
            slurmddp.requeue()
        if step % args.save_every == 0:
            ckpt.save(step, state())

    end = loop(model, opt, start, args.steps, args.step_time, args.log_every, after)
    slurmddp.mark_done()
    if dist.get_rank() == 0:
        print(f"DONE {end}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--style", choices=("slurmddp", "plain"), required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", required=True)
    opts = p.parse_args()
    (with_slurmddp if opts.style == "slurmddp" else plain)(opts)

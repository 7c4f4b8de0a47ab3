"""A training loop in which one rank hangs, for the hang watchdog's tests.

    hang.py MODE --rank R --at STEP [--steps N] [--step-time S]

MODE: none (no rank hangs), stop (rank R stops its own process, as SIGSTOP does), sleep (rank R
sleeps inside the loop), skip (rank R skips one all_reduce: the ranks fall out of step and dead
lock at the next checkpoint's wait), startup (rank R sleeps after the rendezvous, before its
first collective; every rank called slurmddp.heartbeat() first), silent (no rank hangs, and the
script never calls should_stop() or heartbeat(): the watchdog must never judge it). Each step is
one all_reduce and one should_stop(); every 10 steps a checkpoint is saved. --first-run-only:
the rank hangs only in the job's first run (a requeued run goes through).
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import slurmddp

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["none", "stop", "sleep", "skip", "startup", "silent"])
p.add_argument("--rank", type=int, default=1)
p.add_argument("--at", type=int, default=5)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--step-time", type=float, default=0.2)
p.add_argument("--checkpoints", required=True)
p.add_argument("--first-run-only", action="store_true")
args = p.parse_args()
if args.first_run_only and os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    args.mode = "none"

dist.init_process_group("gloo")
rank = dist.get_rank()
me = rank == args.rank
silent = args.mode == "silent"
if not silent:
    slurmddp.heartbeat()
if args.mode == "startup" and me:
    print(f"rank {rank} stuck in start-up", flush=True)
    time.sleep(10**6)
ckpt = slurmddp.Checkpointer(args.checkpoints)
t = torch.zeros(4)
for step in range(args.steps):
    if step == args.at and me:
        print(f"rank {rank} hangs at step {step} ({args.mode})", flush=True)
        if args.mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif args.mode == "sleep":
            time.sleep(10**6)
    if not (args.mode == "skip" and me and step == args.at):
        dist.all_reduce(t)
    time.sleep(args.step_time)
    print(f"step {step} at {time.time():.3f}", flush=True)
    if not silent and slurmddp.should_stop():
        sys.exit(0)
    if step % 10 == 9:
        ckpt.save(step + 1, {"t": t})
if not silent:
    slurmddp.mark_done()
print(f"rank {rank} finished", flush=True)
dist.destroy_process_group()

"""A torchrun-style training that knows nothing of slurmddp: its own checkpoints, its own
reaction to SIGTERM. What users bring unchanged (an HF Trainer or Lightning script, say).

    python -m slurmddp.run own_checkpoints.py --steps 400 --dir DIR [--exit-0-on-term]

Saves (rank 0, atomically) every --save-every steps and resumes from the last save. With
--exit-0-on-term it does what Lightning does on SIGTERM: stops at the next step and exits 0;
without it SIGTERM ends it. Prints RESULT {"rank", "steps", "start", "digest"} when done.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=400)
p.add_argument("--dir", required=True)
p.add_argument("--save-every", type=int, default=20)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--exit-0-on-term", action="store_true")
args = p.parse_args()

terminated = False
if args.exit_0_on_term:
    def on_term(signum, frame):
        global terminated
        terminated = True

    signal.signal(signal.SIGTERM, on_term)

dist.init_process_group("gloo")
rank = dist.get_rank()
weights = torch.zeros(8)
path = os.path.join(args.dir, "own.pt")
start = 0
if os.path.exists(path):
    saved = torch.load(path, weights_only=True)
    weights, start = saved["weights"], int(saved["step"])
for step in range(start, args.steps):
    grad = torch.full((8,), float(step % 7) + rank)
    dist.all_reduce(grad)
    weights -= 0.001 * grad
    time.sleep(args.step_time)
    if (step + 1) % args.save_every == 0 and rank == 0:
        tmp = f"{path}.tmp"
        torch.save({"weights": weights, "step": step + 1}, tmp)
        os.replace(tmp, path)
    if terminated:  # Lightning: SIGTERM → stop, exit 0
        print(f"terminated at step {step + 1}", flush=True)
        sys.exit(0)
    if rank == 0 and (step + 1) % 50 == 0:
        print(f"step {step + 1}", flush=True)
digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
result = {"rank": rank, "steps": args.steps, "start": start, "digest": digest,
          "finite": bool(weights.isfinite().all())}
sys.stdout.write(f"RESULT {json.dumps(result)}\n")
sys.stdout.flush()
dist.barrier()

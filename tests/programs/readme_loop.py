"""The loop of docs/guide/preemption.md, as written there (no prime_ddp), at any world size.

    python -m slurmddp.run tests/programs/readme_loop.py --checkpoint-dir DIR [--stop-at N]

Prints RESULT {"rank", "digest", "start"}; with --stop-at N rank 1 sends itself the stop signal
after step N, as Slurm would before a preemption; --no-prime is the control, without
restore's priming of DDP.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import slurmddp
from slurmddp.training import train_state

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--stop-at", type=int)
p.add_argument("--no-prime", action="store_true", help="the control: restore without priming")
args = p.parse_args()
if args.no_prime:
    train_state.prime_on_next_forward = lambda ddp: None

dist = slurmddp.init("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                            torch.nn.Tanh(), torch.nn.Linear(256, 1))
ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)  # several buckets: their order matters
opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
data = torch.Generator().manual_seed(dist.rank)
epoch, seen = 0, 0


def train_one_step(step: int) -> None:
    g = torch.Generator().manual_seed(1000 * dist.rank + step)
    x = torch.randn(16, 32, generator=g)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


# ---- the guide's loop, from here ----
ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=3)
loaded = ckpt.load_latest()
start = 0
if loaded:
    start = train_state.restore(loaded.state, model=ddp, optimizer=opt, scheduler=sched)["step"]
for step in range(start, args.steps):
    train_one_step(step)
    if args.stop_at == step + 1 and dist.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
    if slurmddp.should_stop():
        ckpt.save(step + 1, train_state.capture(model=ddp, optimizer=opt, scheduler=sched,
                                                step=step + 1, epoch=epoch, position=seen))
        slurmddp.requeue()
slurmddp.mark_done()
# ---- to here ----

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
result = {"rank": dist.rank, "digest": digest, "finite": bool(flat.isfinite().all()),
          "start": start}
sys.stdout.write(f"RESULT {json.dumps(result)}\n")  # one write: ranks may share a pipe
sys.stdout.flush()

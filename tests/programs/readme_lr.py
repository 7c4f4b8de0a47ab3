"""The README's loop with a learning rate, as issue 44 submitted it twice from one directory.

    slurmddp submit --local readme_lr.py --lr 0.1 [--stop-at N]

Checkpointer("checkpoints") beside the script, as the README has it; with --stop-at N the rank
sends itself the stop signal after step N of a run that started before it (Slurm's, before a
preemption), so the job saves, is requeued and resumes. Prints RESULT {"start", "lr", "digest"}.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

import torch

import slurmddp
from slurmddp.training import train_state

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--stop-at", type=int)
args = p.parse_args()

slurmddp.init("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)

ckpt = slurmddp.Checkpointer("checkpoints", keep=3)
loaded = ckpt.load_latest()  # None on a fresh start
step = 0
if loaded:
    step = train_state.restore(loaded.state, model=model, optimizer=opt)["step"]
start = step
for step in range(start, args.steps):
    loss = model(torch.full((2, 4), float(step))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.stop_at == step + 1 and start < args.stop_at:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
    if slurmddp.should_stop():
        ckpt.save(step + 1, train_state.capture(model=model, optimizer=opt, step=step + 1))
        slurmddp.requeue()
slurmddp.mark_done()

flat = torch.cat([q.detach().flatten() for q in model.parameters()])
result = {"start": start, "lr": opt.param_groups[0]["lr"],
          "digest": hashlib.sha256(repr(flat.tolist()).encode()).hexdigest()}
sys.stdout.write(f"RESULT {json.dumps(result)}\n")
sys.stdout.flush()

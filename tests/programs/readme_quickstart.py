"""The README's quick-start loop, run as the README shows it: its Python block is read from
README.md and run with what a user's train.py defines around it (a model with dropout, a dataset
that augments at random in two DataLoader workers, a DistributedSampler, `train_one_step`).

    python -m slurmddp.run tests/programs/readme_quickstart.py --checkpoint-dir DIR [--stop-at 4,12]

The checkpoints go to DIR/checkpoints, as the README's relative path puts them. With --stop-at,
rank 1 sends itself the stop signal in the first of those steps past the run's start, as Slurm
would before a preemption. Prints RESULT {"rank", "digest"} when the loop ends.
"""

import argparse
import hashlib
import json
import os
import re
import signal
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import slurmddp

sys.path.insert(0, str(Path(__file__).parent))
from readme_data_loop import Noisy

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start() -> str:
    """The Python block of the README's quick start."""
    section = README.read_text(encoding="utf-8").split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--stop-at", default="")
    args = p.parse_args()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    os.chdir(args.checkpoint_dir)
    stops = [int(s) for s in args.stop_at.split(",") if s]

    # ---- what the user's train.py has before the loop ----
    slurmddp.init()  # before the model, as a train.py has it; the README's second call is harmless
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loader = DataLoader(Noisy(), batch_size=4, sampler=DistributedSampler(Noisy(), shuffle=True),
                        num_workers=2)
    epochs = 3
    start = None

    def train_one_step(batch) -> None:
        global start
        step = globals()["step"]  # the loop's counter, before this step
        start = step if start is None else start
        if torch.distributed.get_rank() == 1 and any(start < s == step + 1 for s in stops):
            os.kill(os.getpid(), signal.SIGUSR2)
        x, y = batch
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    exec(compile(quick_start(), str(README), "exec"), globals())

    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    result = {"rank": torch.distributed.get_rank(), "digest": digest,
              "finite": bool(flat.isfinite().all())}
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    sys.stdout.flush()

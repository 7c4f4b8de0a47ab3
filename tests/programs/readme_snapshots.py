"""The README's quick-start loop with snapshots, on torch alone (no numpy in the user's code): the
README's Python block, read from README.md, with `snapshot_every=1` given to its Checkpointer and
`ckpt.snapshot(step, state)` after every step, as docs/concepts/snapshots.md shows it.

    python -m slurmddp.run tests/programs/readme_snapshots.py --checkpoint-dir DIR [--stop-at N]

The checkpoints go to DIR/checkpoints. With --stop-at N, rank 1 sends itself the stop signal in
step N (when the run started before it), as Slurm would before a preemption: the loop saves and
exits 75 outside Slurm. Prints RESULT {"rank", "digest", "finite", "start"} when the loop ends
("start": the step it resumed from).
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import slurmddp
from slurmddp.training import train_state

README = Path(__file__).resolve().parents[2] / "README.md"
CHECKPOINTER = 'slurmddp.Checkpointer("checkpoints", keep=3)'
STEPPED = re.compile(r"^( +)step \+= 1\n", re.M)


def quick_start() -> str:
    """The README's quick-start block, its Checkpointer taking a snapshot after every step."""
    section = README.read_text(encoding="utf-8").split("## Quick start", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S)[1]
    assert CHECKPOINTER in block, f"the README's Checkpointer is no longer {CHECKPOINTER}"
    assert len(STEPPED.findall(block)) == 1, "the README's loop no longer counts `step += 1`"
    block = block.replace(CHECKPOINTER, CHECKPOINTER[:-1] + ", snapshot_every=1)")
    return STEPPED.sub(r"\g<0>\1ckpt.snapshot(step, state)\n", block)


def state() -> dict:
    """The state a snapshot keeps: the README's save's, read from the loop's variables."""
    g = globals()
    return train_state.capture(model=g["ddp"], optimizer=g["opt"], loader=g["loader"],
                               step=g["step"], epoch=g["epoch"])  # fmt: skip


class Noisy(Dataset):
    """64 samples of 8 features, each fetch with noise from torch's generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--stop-at", type=int)
    args = p.parse_args()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    os.chdir(args.checkpoint_dir)

    # ---- what the user's train.py has before the loop ----
    slurmddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))  # fmt: skip
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    sampler = DistributedSampler(Noisy(), shuffle=True)
    loader = DataLoader(Noisy(), batch_size=4, sampler=sampler)
    epochs = 3
    start = None

    def train_one_step(batch) -> None:
        global start
        step = globals()["step"]  # the loop's counter, before this step
        start = step if start is None else start
        if torch.distributed.get_rank() == 1 and args.stop_at and start < args.stop_at == step + 1:
            os.kill(os.getpid(), signal.SIGUSR2)
        x, y = batch
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    exec(compile(quick_start(), str(README), "exec"), globals())

    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    digest = hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()
    result = {"rank": torch.distributed.get_rank(), "digest": digest,
              "finite": bool(flat.isfinite().all()), "start": start}  # fmt: skip
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    sys.stdout.flush()

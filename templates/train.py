"""A complete train.py for slurmddp: the README's loop, with a model, data and a loader around it.

Get it with ``slurmddp quickstart`` (it writes this file as train.py), then:

    slurmddp submit --local --follow --nodes 2 --ntasks-per-node 2 \\
        --local-signal-after 40steps,80steps train.py                # here, stopped twice
    slurmddp submit --nodes 2 --gpus-per-node 4 --time 1:00:00 train.py   # on Slurm

Each stop saves a checkpoint and requeues the job; the next run resumes it bit for bit: the
dropout, the random augmentation in the DataLoader's workers and the sampler's shuffle included.
Prints ``RESULT {"digest": ...}`` at the end: the same digest with or without stops.
"""

import argparse
import hashlib
import json
import time

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import slurmddp
from slurmddp.training import train_state


class Points(Dataset):
    """Points of y = x . w plus noise; each read jitters x at random (an augmentation)."""

    def __init__(self, n: int = 1024) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8)[:, None] + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(8), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep each step")
    args = p.parse_args()

    dist = slurmddp.init()  # this rank's place, its device, the process group (the loop's call
    #                         below returns the same)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 1)).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    data = Points()
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=2)
    epochs = args.epochs

    def train_one_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = (t.to(device) for t in batch)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)

    # ---- the README's loop, as it is there ----
    slurmddp.init()                                 # this rank's place; the process group
    ckpt = slurmddp.Checkpointer("checkpoints", keep=3)
    loaded = ckpt.load_latest()                     # None on a fresh start; this job's own
    step, first_epoch = 0, 0
    if loaded:
        counters = train_state.restore(loaded.state, model=ddp, optimizer=opt, loader=loader)
        step, first_epoch = counters["step"], counters["epoch"]
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)                    # another shuffle each epoch
        for batch in loader:                        # resumed: from the batch after the stop
            train_one_step(batch)
            step += 1
            if slurmddp.should_stop():              # a signal came: every rank stops here
                ckpt.save(step, train_state.capture(model=ddp, optimizer=opt, loader=loader,
                                                    step=step, epoch=epoch))
                slurmddp.requeue()                  # ends the process; the job comes back
    slurmddp.mark_done()                            # finished: nothing requeues it now
    # ---- end of the README's loop ----

    if dist.rank == 0:
        flat = torch.cat([q.detach().flatten() for q in model.parameters()]).cpu()
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(f"RESULT {json.dumps({'steps': step, 'digest': digest})}", flush=True)


if __name__ == "__main__":
    main()

"""An Accelerate training loop that survives preemption, bit for bit.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/accelerate_train.py \\
        --steps 120 --checkpoint-dir ckpt

`slurmddp.integrations.accelerate.Preemptible` adds three calls to a plain Accelerate loop:
`resume()` before it (loads the newest ``step-N`` with `load_state`), `step(n)` after each step
(on an agreed stop: `save_state`, then requeue), `done()` after it. The data position follows from
the step: the epoch's sampler is seeded by the epoch, and the batches the restored step already
saw are skipped. With ``--snapshot-every N`` the state `save_state` would save is also kept in
the nodes' memory every N steps (within 2% of the training's time), and a rank killed resumes from
the newest snapshot instead of the last ``step-N``. Every rank prints ``RESULT {...}`` with a
digest of its final parameters.
"""

import argparse
import hashlib
import json
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from slurmddp.integrations.accelerate import Preemptible


class Noisy(TensorDataset):
    """Random augmentation: noise on every sample as it is fetched."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x), y


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--augment", action="store_true", help="random noise on every sample")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="keep a snapshot in the nodes' memory every N steps (0: none)")
    p.add_argument("--snapshot-budget", type=lambda v: None if v == "none" else float(v),
                   default=0.02, help="the fraction of the training's time snapshots may take "
                   "(spaced wider if they would take more); none: every N steps whatever they cost")
    opts = p.parse_args()

    set_seed(0)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = (Noisy if opts.augment else TensorDataset)(x, x.sum(dim=1, keepdim=True))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=opts.workers,
                        generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    pre = Preemptible(accelerator, opts.checkpoint_dir, snapshot_every=opts.snapshot_every,
                      snapshot_budget=opts.snapshot_budget)
    step = pre.resume()
    per_epoch = len(loader)
    while step < opts.steps:
        epoch, seen = divmod(step, per_epoch)
        loader.set_epoch(epoch)  # the epoch's order, whatever run it is in
        batches = accelerator.skip_first_batches(loader, seen) if seen else loader
        for xb, yb in batches:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            time.sleep(opts.step_time)
            if accelerator.is_main_process and step % opts.log_every == 0:
                print(f"step {step} ", flush=True)
            pre.step(step)
            if step == opts.steps:
                break
    pre.done()

    flat = torch.cat([q.detach().cpu().flatten() for q in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    result = {"rank": accelerator.process_index, "steps": step, "digest": digest,
              "finite": bool(flat.isfinite().all())}
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

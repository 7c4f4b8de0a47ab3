"""A PyTorch Lightning training that survives preemption, bit for bit.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/lightning_train.py \\
        --steps 120 --checkpoint-dir ckpt

`slurmddp.integrations.lightning.fit(trainer, model, loader, dirpath=...)` replaces
``trainer.fit(model, loader)``: on a stop the Trainer saves ``step-N.ckpt`` and the job is
requeued; the next run resumes from it. With ``--snapshot-every N`` the Trainer's state is also
kept in the nodes' memory every N steps, so a rank killed or a node lost costs the steps since.
The loader is torchdata's `StatefulDataLoader` (``--plain``: torch's DataLoader), whose position
is kept in the checkpoint, so the resumed epoch goes on at the next batch. Lightning picks its
cluster environment itself (under srun: its SLURMEnvironment). Every rank prints ``RESULT {...}``
with a digest of its parameters.
"""

import argparse
import hashlib
import json
import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from slurmddp.integrations.lightning import fit


class Regression(L.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
        if dropout:
            layers.insert(2, torch.nn.Dropout(dropout))
        self.net = torch.nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Pace(L.Callback):
    """Extra seconds per step (so a test can preempt mid-training) and a line every N steps."""

    def __init__(self, step_time: float, log_every: int) -> None:
        self.step_time, self.log_every = step_time, log_every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.step_time)
        if trainer.is_global_zero and trainer.global_step % self.log_every == 0:
            print(f"step {trainer.global_step} ", flush=True)


class Noisy(TensorDataset):
    """Random augmentation: noise on every sample as it is fetched."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn_like(x), y


def make_loader(workers: int = 0, plain: bool = False, augment: bool = False):
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    data = (Noisy if augment else TensorDataset)(x, x.sum(dim=1, keepdim=True))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # A plain DataLoader resumes at its batch too: slurmddp saves its position (and seeds its
    # augmentation by sample), where Lightning alone would start its epoch again.
    kind = DataLoader if plain else StatefulDataLoader
    return kind(data, batch_size=8, sampler=sampler, num_workers=workers)


class Data(L.LightningDataModule):
    def train_dataloader(self) -> StatefulDataLoader:
        return make_loader()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--datamodule", action="store_true", help="the data from a LightningDataModule")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--dropout", type=float, default=0.0, help="a Dropout layer of this rate")
    p.add_argument("--plain", action="store_true", help="torch's DataLoader, not torchdata's")
    p.add_argument("--augment", action="store_true", help="random noise on every sample")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="keep the Trainer's state in the nodes' memory every N steps")
    opts = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp" if world > 1 else "auto", max_steps=opts.steps,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        use_distributed_sampler=False,  # ours, in the stateful loader
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Pace(opts.step_time, opts.log_every)],
    )  # fmt: skip
    model = Regression(opts.dropout)
    if opts.datamodule:
        fit(trainer, model, datamodule=Data(), dirpath=opts.checkpoint_dir,
            snapshot_every=opts.snapshot_every)
    else:
        fit(trainer, model, make_loader(opts.workers, opts.plain, opts.augment),
            dirpath=opts.checkpoint_dir, snapshot_every=opts.snapshot_every)

    flat = torch.cat([q.detach().cpu().flatten() for q in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    result = {"rank": trainer.global_rank, "steps": trainer.global_step, "digest": digest,
              "finite": bool(flat.isfinite().all())}
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The goodput benchmark's Lightning peer: SLURMEnvironment's auto-requeue, as Lightning has it.

    srun python goodput_lightning.py --checkpoint-dir DIR [--steps N --step-time S --save-every K]

under an sbatch script with ``--signal=SIGUSR1@LEAD --requeue``: on the signal Lightning saves
its HPC checkpoint and requeues the job itself (``scontrol requeue``), and the next run restores
it; a ModelCheckpoint every --save-every steps is what a crash or a lost node resumes from. The
model and the step are goodput_train.py's. Rank 0 prints ``STEP n <time>`` and ``DONE n``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment


class Steps(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(64, generator=g)


class Model(L.LightningModule):
    def __init__(self, step_time: float, log_every: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))  # fmt: skip
        self.step_time, self.log_every = step_time, log_every

    def training_step(self, batch, index):
        loss = self.net(batch).pow(2).mean()
        time.sleep(self.step_time)
        step = self.global_step + 1
        if self.global_rank == 0 and step % self.log_every == 0:
            print(f"STEP {step} {time.time():.3f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--checkpoint-dir", required=True)
    args = p.parse_args()
    root = Path(args.checkpoint_dir)
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=args.save_every, save_last=True,
                            save_top_k=0)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=args.nodes, strategy="ddp",
                        max_steps=args.steps, default_root_dir=root, callbacks=[every],
                        plugins=[SLURMEnvironment(auto_requeue=True)], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    # The newest of Lightning's HPC checkpoint (written at the signal) and the periodic one.
    saved = sorted([*root.glob("hpc_ckpt_*.ckpt"), *root.glob("last*.ckpt")],
                   key=lambda path: path.stat().st_mtime)  # fmt: skip
    trainer.fit(Model(args.step_time, args.log_every),
                torch.utils.data.DataLoader(Steps(), batch_size=32),
                ckpt_path=str(saved[-1]) if saved else None)  # fmt: skip
    if trainer.global_rank == 0:
        print(f"DONE {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()

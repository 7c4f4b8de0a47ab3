"""A PyTorch Lightning or Hugging Face Accelerate script under `python -m slurmddp.run`.

    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/lightning_or_accelerate.py
    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/lightning_or_accelerate.py
    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/lightning_or_accelerate.py \\
        --library accelerate

Both libraries read the variables torchrun exports, which `slurmddp.run` exports under any
launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (Accelerate, on GPU and on
CPU alike), and with them LOCAL_WORLD_SIZE and GROUP_RANK / GROUP_WORLD_SIZE (Lightning, told so
by `TorchElasticEnvironment`; left to itself under srun it would parse SLURM_* on its own, with
its own port rule, and refuse `srun -n N` without `--ntasks-per-node`). Neither needs slurmddp in
the script; `slurmddp.should_stop()` and `Checkpointer` can still be added as in the other
examples. Lightning expects the same number of ranks on every node (devices x num_nodes).

`--library auto` (the default) takes Lightning when installed, else Accelerate; without either it
says so and exits 0. Every rank prints one line ``RESULT {...}`` (JSON): its place as the
library sees it and the variables it read.
"""

import argparse
import importlib.util
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def dataset() -> TensorDataset:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def with_lightning(steps: int) -> dict:
    try:
        import lightning as L
        from lightning.pytorch.plugins.environments import TorchElasticEnvironment
    except ImportError:  # the package's older name
        import pytorch_lightning as L
        from pytorch_lightning.plugins.environments import TorchElasticEnvironment

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(
        accelerator="auto", strategy="ddp", max_steps=steps,
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),  # ranks on this node
        num_nodes=int(os.environ["GROUP_WORLD_SIZE"]),
        plugins=[TorchElasticEnvironment()],  # read RANK, WORLD_SIZE... rather than SLURM_*
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(), DataLoader(dataset(), batch_size=16))  # Lightning adds the sampler
    return {"library": "lightning", "rank": trainer.global_rank, "world_size": trainer.world_size,
            "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "steps": trainer.global_step}  # fmt: skip


def with_accelerate(steps: int) -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # gloo on CPU, nccl on GPU
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(dataset(), batch_size=16)  # prepare() shards it across the ranks
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    done = 0
    while done < steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            done += 1
            if done == steps:
                break
    accelerator.wait_for_everyone()
    return {"library": "accelerate", "rank": accelerator.process_index,
            "world_size": accelerator.num_processes,
            "local_rank": accelerator.local_process_index, "steps": done}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--library", choices=("auto", "lightning", "accelerate"), default="auto")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    def installed(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    library = args.library
    if library == "auto":
        have_lightning = installed("lightning") or installed("pytorch_lightning")
        library = "lightning" if have_lightning else "accelerate" if installed("accelerate") else ""
    if not library:
        print("neither Lightning nor Accelerate is installed: nothing to show "
              "(pip install lightning, or pip install accelerate)", flush=True)  # fmt: skip
        return 0
    seen = {name: os.environ.get(name) for name in VARIABLES}  # before the library touches them
    result = (with_lightning if library == "lightning" else with_accelerate)(args.steps)
    sys.stdout.write(f"RESULT {json.dumps(result | {'environment': seen})}\n")  # one write
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

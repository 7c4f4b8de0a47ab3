"""A torchrun script as the PyTorch DDP tutorial writes it, run unchanged under Slurm.

    torchrun --nproc-per-node=2 examples/torchrun_tutorial.py 3 1
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/torchrun_tutorial.py 3 1
    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/torchrun_tutorial.py 3 1

(arguments: total epochs, snapshot every N epochs.) It follows the tutorial's
multigpu_torchrun.py: the rank comes from the variables torchrun exports (LOCAL_RANK, RANK),
`init_process_group` gets nothing but a backend (env:// reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT), a DistributedSampler gets `set_epoch` each epoch, rank 0 saves a snapshot that a
restarted run resumes from. It does not import slurmddp: under srun, `python -m slurmddp.run`
works the same variables out from SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST... and
exports them before the script starts. The tutorial's GPU code runs on CPU with gloo here.

Added for the demonstration: every rank reports the torchrun variables it saw, and rank 0 ends
with one line ``RESULT {...}`` (JSON) holding them all, with the process group's own view.
"""

import argparse
import hashlib
import json
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cuda", self.local_rank) if torch.cuda.is_available() else "cpu"
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")  # fmt: skip
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    g = torch.Generator().manual_seed(0)
    train_set = TensorDataset(torch.rand(2048, 20, generator=g), torch.rand(2048, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      sampler=DistributedSampler(dataset))  # fmt: skip


def report(trainer: Trainer, epochs: int) -> None:
    """Not in the tutorial: what each rank saw, collected and printed by rank 0."""
    import torch.distributed as dist

    seen = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    seen |= {"dist_rank": dist.get_rank(), "dist_world_size": dist.get_world_size()}
    params = torch.cat([p.detach().cpu().flatten() for p in trainer.model.parameters()])
    seen["digest"] = hashlib.sha256(bytes(params.view(torch.uint8).tolist())).hexdigest()[:16]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if trainer.global_rank == 0:
        print(f"RESULT {json.dumps({'ranks': everyone, 'epochs': epochs})}", flush=True)
    dist.barrier()


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    report(trainer, total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")  # fmt: skip
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path)

"""What a training loop needs to resume bitwise: `train_state` captures and restores model,
optimizer, scheduler, grad scaler, DataLoader position, counters and random generators; `sampler`
is torch's DistributedSampler that starts mid-epoch at any world size; `loader` makes every
DataLoader resume at its epoch and batch with the same order and augmentation, started by
`slurmddp.init()` (nothing changes on import)."""

__all__ = ["loader", "sampler", "train_state"]  # submodules: `from slurmddp.training import ...`

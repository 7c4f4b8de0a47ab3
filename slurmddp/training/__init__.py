"""What a training loop needs to resume bitwise: `train_state` captures and restores model,
optimizer, scheduler, grad scaler, DataLoader position, counters and random generators; `sampler`
is torch's DistributedSampler that starts mid-epoch at any world size; `loader` makes every
DataLoader's shuffling and augmentation a function of (seed, epoch, sample), installed on import."""

from slurmddp.training import loader as _loader

_loader.install()

__all__ = ["loader", "sampler", "train_state"]  # submodules: `from slurmddp.training import ...`

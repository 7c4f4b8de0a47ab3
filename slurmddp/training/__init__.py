"""What a training loop needs to resume bitwise: `train_state` captures and restores model,
optimizer, scheduler, grad scaler, counters and random generators; `sampler` is torch's
DistributedSampler that starts mid-epoch at any world size."""

__all__ = ["sampler", "train_state"]  # submodules: `from slurmddp.training import train_state`

"""Checkpoints that survive preemption: atomic publish, verified load with fallback, async save.

Layout of a checkpoint directory::

    step-00000100/state.pt        replicated mode: rank 0's state, written by torch.save
    step-00000100/manifest.json   written last: format, step, mode, size and crc32 of each file
    step-00000200/...             sharded mode: torch.distributed.checkpoint files + manifest.json
    latest                        one line, "step-00000200": the newest published checkpoint

A checkpoint is written under a hidden temporary name and renamed into place only when every
file and the manifest are on disk; `latest` moves only after that rename, by an atomic replace.
So `latest` names a complete checkpoint at every instant, whenever the writer is killed. One
writer per directory: a second job saving into the same directory is not supported.

Loading uses ``torch.load(weights_only=True)``, and the sharded metadata goes through a restricted
unpickler, so a checkpoint file can carry tensors and plain containers but never code.

The manifest's checksum is there to catch torn, truncated and corrupted files (a crash, a failing
disk, a bad copy), not an adversary, who could rewrite the manifest as well; and loading never
unpickles code anyway. So it is CRC-32 (zlib's: ~2 GiB/s on one core, without the GIL), taken from
the bytes as they are written, rather than sha256 (~1.1 GiB/s), which bounded the speed of a save.
Manifests of format 1 carry sha256 and still load.

Saves are replicated (rank 0 writes) or sharded (every rank writes its part), each synchronous or
asynchronous (`save` returns once the state is copied; the write is settled later), four modes
with one atomic publish, one manifest and one fallback.

The package, by concern:

- `checkpointer`: `Checkpointer`, the object a training loop uses;
- `modes`: how `save` writes: plain, asynchronous, sharded, asynchronous sharded;
- `layout`: the directory, publishing, pruning and the `latest` pointer;
- `manifest`: the manifest and the verification of a checkpoint against it;
- `loading`: the choice of the newest valid checkpoint, the same on every rank, and its load;
- `state`: what a checkpoint may hold, the check before a save, the CPU snapshot, torch.load;
- `writers`: the streaming torch.save writer and the fsync overlapping the checksum (`crc32`);
- `dcp`: torch.distributed.checkpoint with the restricted metadata unpickler;
- `ranks`: how ranks agree; `inflight`: the asynchronous saves under way; `background`: threads;
- `snapshots`: every few steps, each rank's state in the memory of its node and the next one, and
  the recovery from them after a lost node or a restarted worker (`snapshot_every`).
"""

from __future__ import annotations

from slurmddp.checkpoint.checkpointer import Checkpointer
from slurmddp.checkpoint.inflight import wait_for_saves
from slurmddp.checkpoint.loading import Checkpoint
from slurmddp.checkpoint.state import check_state as _check_state  # noqa: F401  # tests import it
from slurmddp.errors import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "Checkpointer", "wait_for_saves"]

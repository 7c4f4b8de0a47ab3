"""Hugging Face Accelerate under the stop protocol: `Preemptible`.

    pre = Preemptible(accelerator, "checkpoints")
    start = pre.resume()                  # the newest saved step (its state loaded), or 0
    for step in range(start, steps):
        train_one_step()
        pre.step(step + 1)                # on an agreed stop: save_state, then requeue
    pre.done()

A stop becomes Accelerate's own `save_state` (model, optimizer, scheduler, RNG states of every
process, registered objects) into ``step-N``: written under a hidden name and renamed once every
process has written its part, so a step directory is always complete. The next run's `resume`
loads the newest one with `load_state`. Where the data is consumed in order, skip what the
restored step already saw (`accelerator.skip_first_batches`): see examples/accelerate_train.py.

``Preemptible(accelerator, dir, snapshot_every=N)`` (with ``snapshot_keep`` and
``snapshot_budget``, as the Checkpointer takes them) also keeps, every N steps, what `save_state`
saves (the prepared models, optimizers, schedulers, scaler, registered objects, the step counter
and every process's random generators) in the memory of the rank's node and of the next node
(`slurmddp.checkpoint.snapshots`): a rank killed, or a node lost and replaced by a spare, then
costs the steps since the last snapshot.
`resume` first has the ranks agree on the newest complete snapshot newer than the newest
``step-N`` and loads it; none: ``step-N``, as without snapshots. No snapshot is taken in the
middle of gradient accumulation (``accelerator.sync_gradients`` false: the accumulated gradients
are in no checkpoint). Refused at construction: FSDP, DeepSpeed and Megatron-LM, whose states
are sharded, and ``use_stateful_dataloader``, whose loaders' position a snapshot does not keep
(yet): the stop's `save_state` works with both.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from pathlib import Path
from typing import Any

from slurmddp import files
from slurmddp.checkpoint import snapshots
from slurmddp.preemption import api
from slurmddp.training import loader as exact_data
from slurmddp.training import train_state

__all__ = ["Preemptible"]

_STEP = re.compile(r"step-(\d+)")
# Accelerate's distributed types whose processes each hold a part of the model's state.
_SHARDED = {"FSDP", "DEEPSPEED", "MEGATRON_LM"}


class Preemptible:
    """The stop protocol for one `accelerate.Accelerator` and a checkpoint directory; with
    `snapshot_every`, snapshots too (the module's docstring)."""

    def __init__(self, accelerator: Any, directory: str | os.PathLike[str], *,
                 snapshot_every: int = 0, snapshot_keep: int = 2,
                 snapshot_budget: float | None = 0.02) -> None:  # fmt: skip
        snapshots.Snapshots.check_options(snapshot_every, snapshot_keep, snapshot_budget)
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if snapshot_every and kind in _SHARDED:
            raise snapshots.Snapshots.refuse_sharded(kind)
        config = getattr(accelerator, "dataloader_config", None)
        if snapshot_every and getattr(config, "use_stateful_dataloader", False):
            raise ValueError("snapshots do not keep a stateful loader's position: leave "
                             "snapshot_every at 0 with use_stateful_dataloader (the stop's "
                             "save_state keeps it)")  # fmt: skip
        self.accelerator = accelerator
        self.directory = Path(directory)
        self.snapshots = snapshots.Snapshots(snapshot_every, snapshot_keep, snapshot_budget,
                                             self.directory) \
            if snapshot_every else None  # fmt: skip
        # Now, not at the first `should_stop`: the loaders start their workers before it, and
        # those need the shield (preemption.workers) from their first fork.
        api.install()
        # Before any loader iterates, in the first run as in a resumed one: the seeds must match.
        exact_data.install()
        exact_data.follow_accelerate_epochs()  # a resumed epoch's loader is rebuilt

    def resume(self) -> int:
        """Load the newest complete snapshot newer than the newest complete ``step-N``, else
        that ``step-N`` (every process the same); its step, or 0."""
        steps = sorted(int(m[1]) for p in self._entries() if (m := _STEP.fullmatch(p.name)))
        durable = steps[-1] if steps else None
        found = self.snapshots.recover(durable, "cpu") if self.snapshots is not None else None
        if found is not None:
            self._load(found.state)
            step = found.step
        elif durable is not None:
            self.accelerator.load_state(str(self.directory / f"step-{durable:08d}"))
            step = durable
        else:
            return 0
        # DDP lays its buckets out anew after a process's first backward: with more than two
        # ranks the resumed run's first sums would differ in their last bits (train_state).
        for ddp in _wrappers(getattr(self.accelerator, "_models", [])):
            train_state.prime_on_next_forward(ddp)
        return step

    def step(self, step: int) -> None:
        """Call after every step, on every process: on an agreed stop, save `step` and requeue;
        otherwise offer `step`'s snapshot, if they are on."""
        if api.should_stop():
            self.save(step)
            api.requeue()
            return
        if self.snapshots is not None and self.accelerator.sync_gradients:
            self.snapshots.offer(step, self._state)

    def save(self, step: int) -> Path:
        """`accelerator.save_state` as ``step-N``, published only once complete."""
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".tmp-step-{step:08d}"
        if self.accelerator.is_main_process:
            files.make_dirs(self.directory, durable=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        self.accelerator.wait_for_everyone()  # every process's part is written
        if self.accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            files.fsync_dir(self.directory)
        self.accelerator.wait_for_everyone()
        return final

    def done(self) -> None:
        """The work is finished: nothing requeues the job any more."""
        api.mark_done()

    def _entries(self) -> list[Path]:
        return list(self.directory.iterdir()) if self.directory.is_dir() else []

    def _state(self) -> dict[str, Any]:
        """What `save_state` saves, as one mapping of tensors and plain values."""
        acc = self.accelerator
        return {
            "models": [train_state.unwrap(m).state_dict() for m in acc._models],
            "optimizers": [o.state_dict() for o in acc._optimizers],
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else {},
            "objects": [o.state_dict() for o in acc._custom_objects],
            "step": acc.step,
            "rng": train_state.capture_rng(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        """A snapshot's `_state` back into the accelerator's objects, as `load_state` would."""
        acc = self.accelerator
        for name, targets in (("models", [train_state.unwrap(m) for m in acc._models]),
                              ("optimizers", acc._optimizers), ("schedulers", acc._schedulers),
                              ("objects", acc._custom_objects)):  # fmt: skip
            for target, saved in zip(targets, state[name], strict=True):
                target.load_state_dict(saved)
        if acc.scaler is not None and state["scaler"]:
            acc.scaler.load_state_dict(state["scaler"])
        acc.step = state["step"]
        train_state.restore_rng(state["rng"])


def _wrappers(models: list[Any]) -> list[Any]:
    """The DistributedDataParallel objects around `models`: Accelerate keeps the models it
    prepared unwrapped, and their wrappers only in what `prepare` returned to the caller (one
    walk of the interpreter's objects, once per resume)."""
    from torch.nn.parallel import DistributedDataParallel

    if not models:
        return []
    ids = {id(m) for m in models}
    return [o for o in gc.get_objects()
            if isinstance(o, DistributedDataParallel) and id(o.module) in ids]  # fmt: skip

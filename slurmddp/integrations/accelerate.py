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
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from pathlib import Path
from typing import Any

from slurmddp import files
from slurmddp.preemption import api
from slurmddp.training import loader as exact_data
from slurmddp.training import train_state

# Before any loader iterates, in the first run as in a resumed one: the seeding must match.
exact_data.install()
exact_data.follow_accelerate_epochs()  # a resumed epoch's loader is rebuilt

__all__ = ["Preemptible"]

_STEP = re.compile(r"step-(\d+)")


class Preemptible:
    """The stop protocol for one `accelerate.Accelerator` and a checkpoint directory."""

    def __init__(self, accelerator: Any, directory: str | os.PathLike[str]) -> None:
        self.accelerator = accelerator
        self.directory = Path(directory)

    def resume(self) -> int:
        """Load the newest complete ``step-N`` (every process the same); its N, or 0."""
        steps = sorted(int(m[1]) for p in self._entries() if (m := _STEP.fullmatch(p.name)))
        if not steps:
            return 0
        self.accelerator.load_state(str(self.directory / f"step-{steps[-1]:08d}"))
        # DDP lays its buckets out anew after a process's first backward: with more than two
        # ranks the resumed run's first sums would differ in their last bits (train_state).
        for ddp in _wrappers(getattr(self.accelerator, "_models", [])):
            train_state.prime_on_next_forward(ddp)
        return steps[-1]

    def step(self, step: int) -> None:
        """Call after every step, on every process: on an agreed stop, save `step` and requeue."""
        if not api.should_stop():
            return
        self.save(step)
        api.requeue()

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

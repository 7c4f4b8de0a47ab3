"""The Hugging Face Trainer under the stop protocol: ``slurmddp.integrations.transformers.train``.

    from slurmddp.integrations.transformers import train
    train(Trainer(model, args, train_dataset=data))   # instead of trainer.train()

The agreed stop becomes the Trainer's own checkpoint (``checkpoint-N`` in ``args.output_dir``,
with its optimizer, scheduler, RNG and data position), then `slurmddp.requeue`; every run starts
with ``resume_from_checkpoint`` set to the newest checkpoint there, and the run that finishes calls
`slurmddp.mark_done`.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from slurmddp.preemption import api
from slurmddp.training import loader as exact_data

# Before any loader iterates, in the first run as in a resumed one: the seeding must match.
exact_data.install()

__all__ = ["StopProtocol", "train"]


class StopProtocol(TrainerCallback):
    """Asks `slurmddp.should_stop` after every optimizer step (on every rank, as it must be);
    on a stop, has the Trainer save a checkpoint and end its loop."""

    def __init__(self) -> None:
        self.stopped_at: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if api.should_stop():
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control


def train(trainer: Trainer, **kwargs: Any) -> Any:
    """`trainer.train` resumed from the newest checkpoint of ``args.output_dir``; on an agreed
    stop, saved and requeued (does not return); at the end, the work marked done."""
    callback = next((c for c in trainer.callback_handler.callbacks
                     if isinstance(c, StopProtocol)), None)  # fmt: skip
    if callback is None:
        callback = StopProtocol()
        trainer.add_callback(callback)
    output = trainer.args.output_dir
    last = get_last_checkpoint(output) if output and os.path.isdir(output) else None
    kwargs.setdefault("resume_from_checkpoint", last)
    result = trainer.train(**kwargs)
    if callback.stopped_at is not None:
        api.requeue()
    api.mark_done()
    return result

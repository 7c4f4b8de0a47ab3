"""The Hugging Face Trainer under the stop protocol: ``slurmddp.integrations.transformers.train``.

    from slurmddp.integrations.transformers import train
    train(Trainer(model, args, train_dataset=data))   # instead of trainer.train()

The agreed stop becomes the Trainer's own checkpoint (``checkpoint-N`` in ``args.output_dir``,
with its optimizer, scheduler, RNG and data position), then `slurmddp.requeue`; every run starts
with ``resume_from_checkpoint`` set to the newest checkpoint there, and the run that finishes calls
`slurmddp.mark_done`.

``train(trainer, snapshot_every=N)`` (with ``snapshot_keep`` and ``snapshot_budget``, as the
Checkpointer takes them) also keeps, after every N optimizer steps, what that checkpoint holds
(the model's and optimizer's state, the scheduler's and the scaler's, the Trainer's state, every
process's random generators) in the memory of the rank's node and of the next node
(`slurmddp.checkpoint.snapshots`): a rank killed, or a node lost and replaced by a spare, then
costs the steps since the last snapshot. At the start of `train` the ranks agree on the newest
complete snapshot newer than the newest ``checkpoint-N``; each rank writes it out as the
Trainer's checkpoint files in a directory of its node (beside the snapshots), which the Trainer
resumes from as from ``checkpoint-N``, and which is removed when `train` returns. FSDP and
DeepSpeed, whose states are sharded, refuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import WEIGHTS_NAME

from slurmddp.checkpoint import snapshots
from slurmddp.checkpoint.snapshots import store
from slurmddp.preemption import api
from slurmddp.training import loader as exact_data
from slurmddp.training import train_state

__all__ = ["StopProtocol", "train"]


class StopProtocol(TrainerCallback):
    """Asks `slurmddp.should_stop` after every optimizer step (on every rank, as it must be);
    on a stop, has the Trainer save a checkpoint and end its loop; otherwise, with
    `snapshot_every`, offers the step's snapshot (the module's docstring)."""

    def __init__(self, *, snapshot_every: int = 0, snapshot_keep: int = 2,
                 snapshot_budget: float | None = 0.02) -> None:  # fmt: skip
        snapshots.Snapshots.check_options(snapshot_every, snapshot_keep, snapshot_budget)
        self.stopped_at: int | None = None
        self.snapshots = snapshots.Snapshots(snapshot_every, snapshot_keep, snapshot_budget) \
            if snapshot_every else None  # fmt: skip
        self.trainer: Trainer | None = None  # set by `train`: the one whose state is snapshot
        # Now, not at the first `should_stop`: the loaders start their workers before it, and
        # those need the shield (preemption.workers) from their first fork.
        api.install()
        # Before any loader iterates, in the first run as in a resumed one: the seeds must match.
        exact_data.install()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if api.should_stop():
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        elif self.snapshots is not None and (trainer := self.trainer) is not None:
            self.snapshots.offer(state.global_step, lambda: _state(trainer))
        return control


def train(trainer: Trainer, *, snapshot_every: int = 0, snapshot_keep: int = 2,
          snapshot_budget: float | None = 0.02, **kwargs: Any) -> Any:  # fmt: skip
    """`trainer.train` resumed from the newest checkpoint of ``args.output_dir`` (or a newer
    snapshot, with `snapshot_every`: the module's docstring); on an agreed stop, saved and
    requeued (does not return); at the end, the work marked done."""
    given = next((c for c in trainer.callback_handler.callbacks
                  if isinstance(c, StopProtocol)), None)  # fmt: skip
    callback = given or StopProtocol(snapshot_every=snapshot_every, snapshot_keep=snapshot_keep,
                                     snapshot_budget=snapshot_budget)  # fmt: skip
    if callback.snapshots is not None and (trainer.is_fsdp_enabled
                                           or trainer.is_deepspeed_enabled):  # fmt: skip
        raise snapshots.Snapshots.refuse_sharded("FSDP or DeepSpeed")
    if given is None:
        trainer.add_callback(callback)
    callback.trainer = trainer
    output = trainer.args.output_dir
    if callback.snapshots is not None and callback.snapshots.scope is None:
        callback.snapshots.scope = output  # the snapshots stand beside its checkpoints
    last = get_last_checkpoint(output) if output and os.path.isdir(output) else None
    with contextlib.ExitStack() as written:
        if callback.snapshots is not None and "resume_from_checkpoint" not in kwargs:
            match = re.search(r"-(\d+)$", last or "")
            found = callback.snapshots.recover(int(match[1]) if match else None, "cpu")
            if found is not None:
                here = written.enter_context(tempfile.TemporaryDirectory(
                    prefix="slurmddp-resume-", dir=_node_local()))  # fmt: skip
                last = _write_out(trainer, found.step, found.state, here)
        kwargs.setdefault("resume_from_checkpoint", last)
        result = trainer.train(**kwargs)
    if callback.stopped_at is not None:
        api.requeue()
    api.mark_done()
    return result


def _state(trainer: Trainer) -> dict[str, Any]:
    """What the Trainer's checkpoint holds, as one mapping of tensors and plain values."""
    scaler = getattr(trainer.accelerator, "scaler", None)
    scheduler = trainer.lr_scheduler
    assert trainer.optimizer is not None  # made before the first step
    return {
        "model": train_state.unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "trainer_state": json.dumps(dataclasses.asdict(trainer.state), sort_keys=True),
        "rng": train_state.capture_rng(),
    }


def _write_out(trainer: Trainer, step: int, state: dict[str, Any], parent: str) -> str:
    """A snapshot as the files of the Trainer's ``checkpoint-N`` in `parent`; its path. The
    random generators go through the Trainer's own writer, set to the snapshot's first."""
    path = os.path.join(parent, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    os.makedirs(path)
    torch.save(state["model"], os.path.join(path, WEIGHTS_NAME))
    torch.save(state["optimizer"], os.path.join(path, OPTIMIZER_NAME))
    if state["scheduler"] is not None:
        torch.save(state["scheduler"], os.path.join(path, SCHEDULER_NAME))
    if state["scaler"]:  # a disabled scaler's is empty, and refuses to load that
        torch.save(state["scaler"], os.path.join(path, SCALER_NAME))
    with open(os.path.join(path, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(state["trainer_state"])
    train_state.restore_rng(state["rng"])
    trainer._save_rng_state(path)
    return path


def _node_local() -> str:
    """Beside this node's snapshots: its memory, unless configured otherwise."""
    return str(store.private_root(os.environ))

"""PyTorch Lightning under the stop protocol: ``slurmddp.integrations.lightning.fit``.

    from slurmddp.integrations.lightning import fit
    fit(trainer, model, train_loader, dirpath="checkpoints")   # instead of trainer.fit(...)

On an agreed stop (asked after every training batch, on every rank) the Trainer saves its own
checkpoint, ``step-N.ckpt`` in `dirpath` (written under a hidden name, renamed once complete),
ends its loop, and the job is requeued; every run passes the newest one as ``ckpt_path``; the run
that finishes calls `slurmddp.mark_done`. Lightning resumes mid-epoch only with a
stateful data loader (``torchdata.stateful_dataloader.StatefulDataLoader``), whose position it
keeps in the checkpoint; a plain DataLoader starts its epoch again. The samplers of the loaders
given to fit (or made by ``train_dataloader()``) are put back in the checkpoint's epoch before
Lightning starts the resumed epoch, which it would otherwise draw in epoch 0's order (Lightning's
issue #21938); a stop at an epoch's last batch is put off to the next batch, as Lightning
resumed from there counts that epoch twice.

Lightning keeps no random generator state in its checkpoint: the callback does (every rank's,
put back just before the first training batch of the resumed run), with the position of every
plain DataLoader it trains on (`slurmddp.training.loader`: the resumed epoch goes on at the next
batch, with the same augmentation, also for a loader Lightning rebuilt with its own sampler). So
a model with dropout and a loader with workers and random augmentation resume bitwise.

``snapshot_every=N`` (with ``snapshot_keep`` and ``snapshot_budget``, as the Checkpointer takes
them) also keeps the Trainer's checkpoint, as the stop would save it, every N optimizer steps in
the memory of the rank's node and of the next node (`slurmddp.checkpoint.snapshots`): a rank
killed, or a node lost and replaced by a spare, then costs the steps since the last snapshot,
not the run. At the start of fit (once Lightning has joined the process group) the ranks take the
newest complete snapshot newer than the newest ``step-N.ckpt`` and Lightning restores from it
as from that file. No snapshot is taken at an epoch's last batch (see the stop, below) nor in the
middle of gradient accumulation (the accumulated gradients are in no checkpoint); FSDP, DeepSpeed
and model-parallel strategies, whose states are sharded, are refused as fit starts.

Lightning's own SLURM auto-requeue (its SIGUSR1 handler) is left out, and said so, when the stop
signal is USR1: slurmddp's handler is installed first, and Lightning adds its own only where none
is. Lightning's SIGTERM handler (which would end fit at the batch's end, before the ranks agree
and checkpoint) is replaced by the stop protocol's as training starts.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset

from slurmddp import files
from slurmddp.checkpoint import snapshots
from slurmddp.errors import warn
from slurmddp.preemption import api
from slurmddp.training import loader as exact_data
from slurmddp.training import train_state

__all__ = ["StopProtocol", "fit"]

_STEP = re.compile(r"step-(\d+)\.ckpt")
_KEY = "slurmddp"  # the callback's entry in Lightning's checkpoint
# Lightning's strategies whose ranks each hold a part of the model's state.
_SHARDED = {"FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"}


class StopProtocol(Callback):
    """Asks `slurmddp.should_stop` after every training batch; on a stop, saves and ends fit.

    `loaders`: the training data loaders given to fit, whose samplers are put back in the
    checkpoint's epoch as it is loaded (`on_load_checkpoint`); None: those the datamodule's (or
    the model's) ``train_dataloader()`` makes. `snapshot_every`, `snapshot_keep`,
    `snapshot_budget`: the Trainer's checkpoint kept in the nodes' memory every N optimizer steps
    (the module's docstring); 0: none.
    """

    def __init__(self, dirpath: str | os.PathLike[str], loaders: Any = None, *,
                 snapshot_every: int = 0, snapshot_keep: int = 2,
                 snapshot_budget: float | None = 0.02) -> None:  # fmt: skip
        snapshots.Snapshots.check_options(snapshot_every, snapshot_keep, snapshot_budget)
        self.dirpath = Path(dirpath)
        self.loaders = loaders
        self.stopped_at: int | None = None
        self.deferred = False  # the stop was put off by a batch (see on_train_batch_end)
        self.rng: Any = None  # the generators to put back before the resumed run's first batch
        self.resumed = False  # this fit restored a checkpoint (or a snapshot)
        self.prime: DistributedDataParallel | None = None  # DDP, to prime at the first batch
        self.snapshots = snapshots.Snapshots(snapshot_every, snapshot_keep, snapshot_budget,
                                             self.dirpath) \
            if snapshot_every else None  # fmt: skip
        self._stepped = -1  # the global step after the last training batch
        # Now, not at the first `should_stop`: the loaders start their workers before it, and
        # those need the shield (preemption.workers) from their first fork.
        api.install()
        # Before any loader iterates, in the first run as in a resumed one: the seeds must match.
        exact_data.install()

    def latest(self) -> str | None:
        """The newest complete ``step-N.ckpt`` in `dirpath`, or None."""
        found = [(int(m[1]), p) for p in self._entries() if (m := _STEP.fullmatch(p.name))]
        return str(max(found)[1]) if found else None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        # Every rank saves (trainer.save_checkpoint on each, in on_train_batch_end); rank 0's
        # dict is written: what differs by rank is gathered, a collective on every rank.
        # A stateful loader (torchdata's) is left to Lightning, which saves and restores it by its
        # own protocol; an IterableDataset's position is its own.
        states = [exact_data.state(d) for d in _loaders(trainer.train_dataloader)
                  if exact_data.tracked(d) and not isinstance(d.dataset, IterableDataset)]
        checkpoint[_KEY] = {
            "rng": train_state.per_rank(train_state.capture_rng()),
            # A dict: per_rank of one process is its value, and a list would read as per rank.
            "loaders": train_state.per_rank({"states": states}),
        }

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        self.resumed = True
        saved = checkpoint.get(_KEY)
        if saved is not None:
            self.rng = train_state.own(saved["rng"])
            # The loaders Lightning iterates may not exist yet (it rebuilds a user's loader
            # around its own sampler): each takes its state as it makes its first iterator.
            exact_data.expect(train_state.own(saved["loaders"])["states"])
        # Lightning (2.5.3 and later, its issue #21938) creates the resumed epoch's iterator
        # before it sets the samplers' epoch: a DistributedSampler would then replay epoch 0's
        # order for the rest of the resumed epoch, and the run would not be the one it resumes.
        # This runs before that iterator exists: the loaders given to fit are set now, those a
        # train_dataloader() makes as it makes them.
        try:
            epoch = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]
        except (KeyError, TypeError):
            return
        if self.loaders is not None:
            _set_epoch(self.loaders, epoch)
            return
        source = getattr(trainer, "datamodule", None) or pl_module
        make = getattr(source, "train_dataloader", None)
        if callable(make):

            def train_dataloader() -> Any:
                loaders = make()
                _set_epoch(loaders, epoch)
                return loaders

            source.train_dataloader = train_dataloader  # this instance, for this fit

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        # Lightning has joined the process group and not yet loaded its checkpoint: the ranks
        # agree on a newer snapshot here, and Lightning restores from it instead.
        if self.snapshots is None or stage != "fit":
            return
        sharded = next((c.__name__ for c in type(trainer.strategy).__mro__
                        if c.__name__ in _SHARDED), None)  # fmt: skip
        if sharded is not None:
            raise snapshots.Snapshots.refuse_sharded(sharded)
        durable = self.latest()
        match = _STEP.fullmatch(Path(durable).name) if durable else None
        found = self.snapshots.recover(int(match[1]) if match else None, "cpu")
        if found is None:
            return
        connector = trainer._checkpoint_connector
        load = connector.resume_start

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            connector.resume_start = load  # type: ignore[method-assign]
            connector._ckpt_path = str(found.path)
            connector._loaded_checkpoint = found.state

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        # Lightning installed its handlers as fit began: on TERM it would end fit at the batch's
        # end (SIGTERMException), before the ranks agree and checkpoint.
        api.state().receiver.take_back()
        # DDP exists now. Resumed, its first backward would reduce with DDP's initial bucket
        # layout where the uninterrupted run used the rebuilt one: with more than two ranks the
        # sums differ in their last bits (train_state's docstring). Primed at the first batch.
        # Not under manual optimization: its training_step steps the optimizers itself.
        if (self.resumed and pl_module.automatic_optimization
                and isinstance(trainer.strategy.model, DistributedDataParallel)):  # fmt: skip
            self.prime = trainer.strategy.model

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:  # fmt: skip
        if self.rng is not None:  # where the uninterrupted run stood after the saved batch
            train_state.restore_rng(self.rng)
            self.rng = None
        if self.prime is not None:
            # Through the strategy, as Lightning's loop runs the step (its forward redirection
            # into training_step); the RNG states are put back after it.
            ddp, self.prime = self.prime, None
            train_state.prime_ddp_through(
                ddp, lambda: trainer.strategy.training_step(batch, batch_idx))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self.stopped_at is not None:
            return
        if not api.should_stop():
            self._snapshot(trainer)
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and not self.deferred:
            # Resumed from an epoch's last batch, Lightning counts that epoch twice (the next
            # run's epoch numbers, so its samplers' order, are one ahead): stop after the next
            # batch instead, inside the next epoch (should_stop stays True). Once only: with one
            # batch an epoch, every batch is the last.
            self.deferred = True
            return
        step = trainer.global_step
        final = self.dirpath / f"step-{step:08d}.ckpt"
        tmp = self.dirpath / f".tmp-step-{step:08d}.ckpt"
        if trainer.is_global_zero:
            files.make_dirs(self.dirpath, durable=True)
        trainer.save_checkpoint(tmp)  # every rank: its part of a sharded strategy, if any
        trainer.strategy.barrier("slurmddp-stop-checkpoint")
        if trainer.is_global_zero:
            os.replace(tmp, final)
            files.fsync_dir(self.dirpath)
        trainer.strategy.barrier("slurmddp-stop-published")
        self.stopped_at = step
        trainer.should_stop = True

    def _snapshot(self, trainer: Trainer) -> None:
        step, before = trainer.global_step, self._stepped
        self._stepped = step
        # No optimizer step in this batch (gradients accumulating): nothing to snapshot. Resumed
        # from an epoch's last batch, Lightning would count that epoch twice (the stop is put off
        # past it for the same reason): its snapshot is not taken either.
        if (self.snapshots is None or step == before
                or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch):  # fmt: skip
            return
        connector = trainer._checkpoint_connector
        self.snapshots.offer(step, lambda: connector.dump_checkpoint(weights_only=False))

    def _entries(self) -> list[Path]:
        return list(self.dirpath.iterdir()) if self.dirpath.is_dir() else []


def fit(trainer: Trainer, model: Any, *args: Any, dirpath: str | os.PathLike[str],
        snapshot_every: int = 0, snapshot_keep: int = 2, snapshot_budget: float | None = 0.02,
        **kwargs: Any) -> None:  # fmt: skip
    """`trainer.fit` resumed from the newest stop checkpoint in `dirpath` (or a newer snapshot,
    with `snapshot_every`: the module's docstring); on an agreed stop, saved and requeued (does
    not return); at the end, the work marked done."""
    taken = api.install()  # before Lightning looks for a handler of the stop signal
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if (signal.SIGUSR1 in taken and isinstance(environment, SLURMEnvironment)
            and environment.auto_requeue and trainer.is_global_zero):  # fmt: skip
        warn("the stop signal is USR1, which Lightning's SLURM auto-requeue also takes: "
             "slurmddp's stop protocol handles it (checkpoint, then requeue), Lightning's "
             "handler is not installed")
    # Trainer sets its callbacks list in __init__ without declaring the attribute.
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    callback = next((c for c in callbacks if isinstance(c, StopProtocol)), None)
    if callback is None:
        callback = StopProtocol(dirpath, snapshot_every=snapshot_every,
                                snapshot_keep=snapshot_keep, snapshot_budget=snapshot_budget)
        callbacks.append(callback)
    if callback.loaders is None:
        callback.loaders = kwargs.get("train_dataloaders", args[0] if args else None)
    kwargs.setdefault("ckpt_path", callback.latest())
    trainer.fit(model, *args, **kwargs)
    if callback.stopped_at is not None:
        api.requeue()
    api.mark_done()


def _set_epoch(loaders: Any, epoch: int) -> None:
    for sampler in _samplers(loaders):
        sampler.set_epoch(epoch)


def _loaders(loaders: Any) -> list[Any]:
    """`loaders` (a loader, or a list, tuple or dict of them) as a list."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _samplers(loaders: Any) -> list[Any]:
    """The samplers with a set_epoch among `loaders`, each once."""
    found: dict[int, Any] = {}
    for loader in _loaders(loaders):
        batch_sampler = getattr(loader, "batch_sampler", None)
        for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):
                found[id(sampler)] = sampler
    return list(found.values())

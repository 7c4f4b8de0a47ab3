"""`Checkpointer`: the one object a training loop uses to save and resume."""

from __future__ import annotations

import contextlib
import operator
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slurmddp import dist
from slurmddp.checkpoint import inflight, layout, loading, manifest, modes, ranks, snapshots
from slurmddp.checkpoint.loading import Checkpoint, Runs
from slurmddp.checkpoint.state import check_state, check_step
from slurmddp.errors import CheckpointError, warn
from slurmddp.protocol import RUN_ID_VAR
from slurmddp.rank.identity import run_id
from slurmddp.story import events


class Checkpointer:
    """Save and load training state under `directory`, keeping the newest `keep` checkpoints.

    Replicated mode (default): every rank calls `save` with the same state, rank 0 alone writes
    it, and every rank returns once the checkpoint is complete and `latest` names it. Sharded mode
    (``sharded=True``): every rank saves its own part through torch.distributed.checkpoint (DCP)
    and `load_latest(into=...)` loads each rank's part in place; leaves may be tensors, DTensors
    and plain values (DCP stores those pickled; they are loaded with weights_only=True). Without
    an initialised process group the process is a world of one.

    ``async_save=True``, in either mode: `save` checks the state, copies its tensors to CPU memory
    of its own (so training may change the model as soon as it returns) and returns; the copy is
    written and published in the background (replicated: by rank 0, with no collective; sharded:
    by every rank through DCP's async_save, then rank 0 publishes). The ranks learn whether it
    succeeded, and its error is raised (once, on every rank), at the start of the next `save`, or
    in `wait()` / `wait_for_saves()` / `load_latest()`; those are then collective: with a process
    group every rank must call them, as every rank calls `save`. Until then `latest` names the
    previous checkpoint; a crash loses only the one being written. A sharded save in flight
    needs the process group (DCP's thread exchanges its plan and results): `wait()` before
    ``destroy_process_group()``. At exit, saves in flight are finished before the process ends.

    GPU tensors of a replicated state are copied out through pinned CPU buffers that the
    Checkpointer keeps for its next saves (as much pinned memory as the GPU tensors of the state).

    Old checkpoints are removed in a background thread once the new one is published; the next
    save waits for that before it writes, and `wait()` waits for it too.

    ``verify=True`` checks the size and checksum of every file against the manifest before
    loading.

    ``snapshot_every=N`` (replicated mode): `snapshot(step, state)`, called every step, keeps
    every N-th step's state in the memory of this rank's node and of the next node
    (`slurmddp.checkpoint.snapshots`), the `snapshot_keep` newest; `load_latest` then resumes
    from the newest complete snapshot when it is newer than the durable checkpoint. A lost node
    or a restarted worker costs the steps since the last snapshot. They are spaced wider (by
    multiples of N, the same on every rank) when they would take more than `snapshot_budget` of
    the training's time (default 2%; None: every N-th step whatever it costs);
    `snapshot_interval` says the spacing in use.

    `load_latest` resumes only this run's checkpoints (`slurmddp.run_id`: a Slurm job and its
    requeues, an array task, a torchrun launch's --rdzv-id; a manifest records its run, or that
    it had none): a new job in the same directory starts from scratch, saying which checkpoint
    it passed over. ``resume_from`` asks for another's state when this run has none of its own:
    a run id (that run's newest checkpoint in `directory`), or a path (a checkpoint directory's
    newest checkpoint, of any run, or one step-* checkpoint). Setting $SLURMDDP_RUN_ID to another
    run's id instead makes this job that run, continued.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        *,
        sharded: bool = False,
        async_save: bool = False,
        verify: bool = True,
        snapshot_every: int = 0,
        snapshot_keep: int = 2,
        snapshot_budget: float | None = 0.02,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, not {keep!r}")
        snapshots.Snapshots.check_options(snapshot_every, snapshot_keep, snapshot_budget)
        if sharded and snapshot_every:
            raise ValueError("snapshots keep replicated states only: use snapshot_every with "
                             "sharded=False, or durable sharded checkpoints alone")  # fmt: skip
        if resume_from is not None and (not isinstance(resume_from, str | os.PathLike)
                                        or not os.fspath(resume_from).strip()):  # fmt: skip
            raise ValueError(f"resume_from must be a run id or a path, not {resume_from!r}")
        self.directory = Path(directory).expanduser().absolute()
        self.resume_from = resume_from
        self.keep = keep
        self.sharded = sharded
        self.async_save = async_save
        self.verify = verify
        self._mode = modes.choose(layout.Directory(self.directory, keep), sharded=sharded,
                                  async_save=async_save)  # fmt: skip
        self._started: tuple[int, float] | None = None  # the save in flight: step, start
        self._snapshots = snapshots.Snapshots(snapshot_every, snapshot_keep, snapshot_budget,
                                               self.directory) \
            if snapshot_every else None  # fmt: skip
        # At start-up: the stop protocol's deadline leaves room for a save as long as the last.
        saved = layout.read_save_time(self.directory)
        if saved is not None:
            _preemption().note_save(saved, warn_slow=True)
        # Never a requeue announced before the checkpoint is on disk.
        _preemption().on_leave(inflight.wait_for_saves, requeue_only=True)

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Write `state` as checkpoint `step` and point `latest` at it; collective.

        Raises CheckpointError on every rank, before anything is written, for a negative step, a
        state that is not a mapping or one holding objects ``torch.load(weights_only=True)``
        would refuse; and when the write fails (the previous checkpoint then stays the latest).
        In async mode it first waits for the previous save and re-raises its error.
        """
        self._mode.settle()
        refusal = check_step(step)
        if refusal is None:
            step = operator.index(step)
            refusal = check_state(state, sharded=self.sharded)
        if not ranks.agree(refusal is None):
            raise CheckpointError(
                refusal or f"checkpoint step {step} was refused on another rank: see its error"
            )
        self._started = (step, time.monotonic())
        self._mode.save(step, state if isinstance(state, dict) else dict(state))
        if not self.async_save:
            self._saved()

    @property
    def snapshot_interval(self) -> int:
        """The steps between snapshots now: `snapshot_every`, or a multiple of it that keeps them
        within `snapshot_budget`; 0 without snapshots."""
        return self._snapshots.interval if self._snapshots is not None else 0

    def snapshot(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
                 ) -> None:  # fmt: skip
        """Keep `state` as step `step`'s snapshot when one is due (`snapshot_interval` steps
        after the last, at a multiple of `snapshot_every`); collective, call it after every step.
        `state` may be a function returning it (called only then); `train_state.capture` inside
        it keeps this rank's own random state without the gather a durable save needs. Without
        snapshot_every, nothing."""
        if self._snapshots is not None:
            self._snapshots.offer(operator.index(step), state)

    def wait(self) -> None:
        """Block until this Checkpointer's async save in flight (if any) is published, and old
        checkpoints it replaced are removed.

        Re-raises that save's error. With a process group and a save pending it is collective:
        each rank finishes its part of the write, then all ranks agree on the outcome.
        """
        self._mode.wait()
        self._saved()
        if self._snapshots is not None:
            self._snapshots.settle()

    def _saved(self) -> None:
        """The save in flight is published: keep how long it took, beside the checkpoints."""
        if self._started is None:
            return
        (step, started), self._started = self._started, None
        seconds = time.monotonic() - started
        _preemption().note_save(seconds)
        if ranks.leads():
            layout.write_save_time(self.directory, step, round(seconds, 3))
            path = self.directory / layout.step_name(step)
            events.emit("checkpoint", step=step, seconds=round(seconds, 3), path=str(path),
                        bytes=_size(path))  # fmt: skip

    @property
    def latest_step(self) -> int | None:
        """The step that `latest` names on disk now; None without a pointer or checkpoint."""
        name = layout.read_pointer(self.directory)
        if name is None or not (self.directory / name).is_dir():
            return None
        return layout.step_of(name)

    def load_latest(self, into: dict | None = None, map_location: Any = "cpu") -> Checkpoint | None:
        """Load this run's checkpoint `latest` names, falling back to older ones (then to
        `resume_from`'s); None on a fresh start. Rank 0 prints one line: the step, the run and the
        path it resumes from, or the newest checkpoint of another run it passed over.

        A checkpoint that is missing, truncated or corrupt is reported in one line on stderr and
        the next newest (by step) is tried. Raises CheckpointError when checkpoints exist but
        none is valid, or when a file holds anything but tensors and plain containers.
        With a process group it is collective (every rank calls it, as every rank calls `save`):
        an async save in flight is settled first, rank 0 chooses the checkpoint and every rank
        loads that one, so no rank resumes from another step than the others.
        Replicated: `into`, if given, is updated with the loaded state and returned as the
        state. Sharded: `into` is required (this rank's state dict, e.g. from get_state_dict)
        and is loaded in place.
        """
        if dist.group() is None:
            self._mode.join_local()  # our own async save is on disk before we look; its error stays
        else:
            self._mode.settle()
        run = run_id()
        own = Runs(accept=(run,))
        if self._snapshots is not None:  # this job's own, in its nodes' memory
            durable = loading.newest_step(self.directory, own) if ranks.leads() else None
            found = self._snapshots.recover(durable, map_location)
            if found is not None:
                _resuming(found, run)
                return found
        loaded = self._load(self.directory, own, into, map_location)
        if loaded is None and self.resume_from is not None:
            loaded = self._load_asked(into, map_location)
        if loaded is not None:
            _resuming(loaded, loaded.run_id)
        elif own.passed is not None:
            path, other, step = own.passed
            ask = f"resume_from={other!r}" if other else f"resume_from='{path}'"
            chain = f" (a new run from its state), or set {RUN_ID_VAR}={other} (that run, " \
                    "continued)" if other else ""  # fmt: skip
            warn(f"not resuming {path} (step {step}): it was saved "
                 f"{f'by run {other}' if other else 'without a run id'}, and this is "
                 f"{f'run {run}' if run else 'no run'}; starting from scratch. To resume it, "
                 f"pass Checkpointer({ask}){chain}")  # fmt: skip
        return loaded

    def _load(self, directory: Path, runs: Runs, into: dict | None,
              map_location: Any) -> Checkpoint | None:  # fmt: skip
        if self.sharded:
            return loading.load_sharded(directory, verify=self.verify, into=into, runs=runs)
        return loading.load_replicated(directory, verify=self.verify, into=into,
                                       map_location=map_location, runs=runs)  # fmt: skip

    def _load_asked(self, into: dict | None, map_location: Any) -> Checkpoint:
        """`resume_from`'s checkpoint; CheckpointError (on every rank) when it has none."""
        asked = self.resume_from
        assert asked is not None
        text = os.fspath(asked).strip()
        if _names_a_path(asked):
            path = Path(text).expanduser().absolute()
            if (path / manifest.MANIFEST).is_file():  # one checkpoint
                loaded = self._load(path.parent, Runs(only=path.name), into, map_location)
            else:
                loaded = self._load(path, Runs(), into, map_location)
            why = "it holds no checkpoint" if path.exists() else "it does not exist"
            where = f"{path}: {why}; give resume_from a checkpoint directory or one of its step-*"
        else:
            loaded = self._load(self.directory, Runs(accept=(text,)), into, map_location)
            where = (f"run {text}: {self.directory} holds no checkpoint of it; give resume_from "
                     f"the run id a manifest records, or a path (./{text} for one here)")
        if loaded is None:
            raise CheckpointError(f"cannot resume from {where}")
        return loaded


def _names_a_path(asked: str | os.PathLike[str]) -> bool:
    """Whether `resume_from` names a path (else a run id, which has no / and is no file here)."""
    text = os.fspath(asked).strip()
    return not isinstance(asked, str) or "/" in text or text.startswith(("~", ".")) \
        or os.path.lexists(text)  # fmt: skip


def _resuming(loaded: Checkpoint, run: str | None) -> None:
    """Rank 0's one line saying what is resumed: the step, the run that saved it, the path; and
    the event, for the job's story."""
    _preemption().resumed_at = loaded.step
    if ranks.leads():
        warn(f"resuming from step {loaded.step} "
             f"{f'of run {run}' if run else '(saved without a run id)'}: {loaded.path}")
        events.emit("resumed", step=loaded.step, source=str(loaded.path))


def _size(path: Path) -> int:
    """The bytes of the files under `path` (a checkpoint's step directory)."""
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(directory, name)).st_size
    return total


def _preemption():  # the stop protocol's state, imported late: it is not needed to checkpoint
    from slurmddp.preemption.api import state

    return state()

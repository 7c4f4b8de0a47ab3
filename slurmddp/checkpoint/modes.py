"""How `Checkpointer.save` writes a checked state: one save mode per Checkpointer, chosen once.

=============  ==============================  =======================  ========================
mode           who writes                      files                    `save` returns
=============  ==============================  =======================  ========================
Plain          rank 0: torch.save              state.pt                 once published
AsyncPlain     rank 0, in a thread             state.pt                 once the state is copied
Sharded        every rank: DCP                 .metadata, __R_0.distcp  once published
AsyncSharded   every rank: DCP's async_save    .metadata, __R_0.distcp  once the state is copied
=============  ==============================  =======================  ========================

Every mode writes into a hidden temporary directory; rank 0 adds the manifest and publishes it
(`layout.Directory`), so a crash at any point leaves the previous checkpoint the latest. An
asynchronous mode's outcome is agreed by all ranks when it is settled: at the next `save`, in
`wait()`, `wait_for_saves()` and `load_latest()`; its error is raised there, once, on every rank.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, ClassVar

from slurmddp import dist
from slurmddp import files as fs
from slurmddp.checkpoint import dcp as safe_dcp
from slurmddp.checkpoint import inflight, manifest, ranks, writers
from slurmddp.checkpoint.background import Background
from slurmddp.checkpoint.layout import Directory
from slurmddp.checkpoint.state import Staging, snapshot
from slurmddp.errors import CheckpointError


class SaveMode(abc.ABC):
    """Writes checkpoints of one mode into `directory`; every method is collective."""

    kind: ClassVar[str]  # what the manifest records: "replicated" or "sharded"

    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    @abc.abstractmethod
    def save(self, step: int, state: dict) -> None:
        """Save the checked `state` as checkpoint `step` (or start to, asynchronously)."""

    def settle(self) -> None:
        """Wait for a save in flight and raise its error on every rank; nothing when none is."""
        return None

    def join_local(self) -> BaseException | None:
        """Wait for this process's part of a save in flight, without a collective; its error."""
        return None

    def wait(self) -> None:
        """`settle`, and wait until the checkpoints the last publish replaced are removed."""
        self.settle()
        self.directory.join_cleanup()

    def raise_unless_agreed(self, error: BaseException | None, step: int) -> None:
        """Raise `error`, or that rank 0 failed, unless every rank succeeded."""
        if not ranks.agree(error is None, after_work=True):
            if error is not None:
                raise error
            raise CheckpointError(f"rank 0 could not save checkpoint step {step} in "
                                  f"{self.directory.path}: see its error")  # fmt: skip


def choose(directory: Directory, *, sharded: bool, async_save: bool) -> SaveMode:
    """The save mode for these options."""
    modes: dict[tuple[bool, bool], type[SaveMode]] = {
        (False, False): Plain, (False, True): AsyncPlain,
        (True, False): Sharded, (True, True): AsyncSharded,
    }  # fmt: skip
    return modes[sharded, async_save](directory)


# -- replicated: rank 0 writes state.pt ---------------------------------------------------------


class Plain(SaveMode):
    """Rank 0 writes the state; every rank returns once it is published."""

    kind = "replicated"

    def __init__(self, directory: Directory) -> None:
        super().__init__(directory)
        self._staging = Staging()  # pinned CPU memory for GPU tensors, kept between saves

    def save(self, step: int, state: dict) -> None:
        error = None
        if ranks.leads():
            try:
                write_replicated(self.directory, step, snapshot(state, self._staging, cpu=False))
            except BaseException as e:  # the other ranks must hear of it, not hang
                error = e
        self.raise_unless_agreed(error, step)


def write_replicated(directory: Directory, step: int, state: dict) -> None:
    """Rank 0: write `state` into a temporary directory, then publish it."""
    tmp = directory.make_tmp(step)
    try:
        files = {manifest.STATE_FILE: writers.write_state(tmp / manifest.STATE_FILE, state)}
        manifest.write(tmp, step, "replicated", files)
        fs.fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError | RuntimeError):  # torch.save reports failed writes so
            raise directory.save_error(step, e) from e
        raise
    directory.publish(tmp, step)


@dataclasses.dataclass(frozen=True)
class _Pending:
    step: int
    work: Background[None] | None  # this rank's part, if it has one
    order: int  # its number in `inflight`


class _Async(SaveMode):
    """A save that goes on after `save` returns; settled (agreed by all ranks) later."""

    def __init__(self, directory: Directory) -> None:
        super().__init__(directory)
        self._pending: _Pending | None = None

    @abc.abstractmethod
    def start(self, step: int, state: dict) -> Background[None] | None:
        """Copy `state` and start writing it; this rank's background part, if it has one."""

    def save(self, step: int, state: dict) -> None:
        work = self.start(step, state)
        self._pending = _Pending(step, work, inflight.register(self))

    def join_local(self) -> BaseException | None:
        pending = self._pending
        return pending.work.wait() if pending is not None and pending.work is not None else None

    def settle(self) -> None:
        pending = self._pending
        if pending is None:
            return
        error = self.join_local()
        self._pending = None
        inflight.unregister(pending.order)
        self.raise_unless_agreed(error, pending.step)


class AsyncPlain(_Async):
    """Rank 0 copies the state to CPU memory of its own, then writes and publishes it in a
    thread, with no collective in that thread."""

    kind = "replicated"

    def __init__(self, directory: Directory) -> None:
        super().__init__(directory)
        self._staging = Staging()

    def start(self, step: int, state: dict) -> Background[None] | None:
        if not ranks.leads():
            return None
        copy = snapshot(state, self._staging)  # before returning: training goes on
        return Background(write_replicated, self.directory, step, copy,
                          name=f"slurmddp-checkpoint-{step}", daemon=False)  # fmt: skip


# -- sharded: every rank writes its part through torch.distributed.checkpoint -------------------


def begin_sharded(directory: Directory, step: int) -> Path:
    """Rank 0 makes the temporary directory; its path on every rank. Collective."""
    error, name = None, ""
    if ranks.leads():
        try:
            name = directory.make_tmp(step).name
        except CheckpointError as e:
            error = e
    outcome, name = ranks.broadcast(ranks.Outcome.FAILED if error else ranks.Outcome.FOUND, name)
    if outcome is not ranks.Outcome.FOUND:
        raise error or CheckpointError(f"rank 0 could not save checkpoint step {step} in "
                                       f"{directory.path}: see its error")  # fmt: skip
    return directory.path / name


def finish_sharded(directory: Directory, tmp: Path, step: int) -> None:
    """Rank 0, once every rank wrote its part: manifest, then publish."""
    try:
        files = {}
        for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
            if not entry.is_file(follow_symlinks=False):
                raise OSError(errno.EISDIR, "unexpected entry in the checkpoint", entry.path)
            # Files written by torch.distributed.checkpoint follow only the umask.
            mode = entry.stat(follow_symlinks=False).st_mode & 0o7777
            if mode & 0o002:
                os.chmod(entry.path, mode & ~0o002)
            files[entry.name] = writers.fsync_and_hash(Path(entry.path))
        manifest.write(tmp, step, "sharded", files)
        fs.fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise directory.save_error(step, e) from e
        raise
    directory.publish(tmp, step)


def _writer(tmp: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(tmp, sync_files=True)


def _dcp_errors() -> tuple[type[BaseException], ...]:
    # DCP's CheckpointException (the failures of all ranks) derives from BaseException.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class Sharded(SaveMode):
    """Every rank writes its part through DCP; rank 0 publishes once all have."""

    kind = "sharded"

    def save(self, step: int, state: dict) -> None:
        import torch.distributed.checkpoint as dcp

        tmp = begin_sharded(self.directory, step)
        error: BaseException | None = None
        try:
            with safe_dcp.quiet_single_process():
                dcp.save(state, storage_writer=_writer(tmp))
        except _dcp_errors() as e:
            error = self.directory.save_error(step, safe_dcp.cause(e))
        if not ranks.agree(error is None, after_work=True):
            if ranks.leads():
                shutil.rmtree(tmp, ignore_errors=True)
            raise error or CheckpointError(
                f"another rank could not write its part of checkpoint step {step} in "
                f"{self.directory.path}: see its error"
            )
        if ranks.leads():
            try:
                finish_sharded(self.directory, tmp, step)
            except BaseException as e:  # the other ranks must hear of it, not hang
                error = e
        self.raise_unless_agreed(error, step)


class AsyncSharded(_Async):
    """DCP's async_save: every rank copies its part to CPU memory before `save` returns, and
    writes it in DCP's thread; rank 0 then adds the manifest and publishes, in a thread too.

    DCP's threads exchange plans and results in collectives, on a gloo group of this
    Checkpointer's own, so that they never interleave with the training's collectives (and DCP's
    async path needs a CPU backend).
    """

    kind = "sharded"

    def __init__(self, directory: Directory) -> None:
        super().__init__(directory)
        self._group: Any = None

    def start(self, step: int, state: dict) -> Background[None] | None:
        import torch.distributed.checkpoint as dcp

        tmp = begin_sharded(self.directory, step)
        error: BaseException | None = None
        future: Any = None
        try:
            future = dcp.async_save(state, storage_writer=_writer(tmp),
                                    process_group=self._process_group(),
                                    **safe_dcp.no_dist_kwargs(dist.group() is None))  # fmt: skip
        except _dcp_errors() as e:
            error = self.directory.save_error(step, safe_dcp.cause(e))
        if not ranks.agree(error is None):
            # The copy failed on some rank: the others' DCP threads wait for it in vain (until
            # the group's timeout); nothing is published.
            if ranks.leads():
                shutil.rmtree(tmp, ignore_errors=True)
            raise error or CheckpointError(
                f"another rank could not copy its part of checkpoint step {step} for "
                f"{self.directory.path}: see its error"
            )
        return Background(self._finish, future, tmp, step, name=f"slurmddp-checkpoint-{step}",
                          daemon=False)  # fmt: skip

    def _finish(self, future: Any, tmp: Path, step: int) -> None:
        try:
            future.result()
        except _dcp_errors() as e:
            if ranks.leads():
                shutil.rmtree(tmp, ignore_errors=True)
            raise self.directory.save_error(step, safe_dcp.cause(e)) from e
        if ranks.leads():
            finish_sharded(self.directory, tmp, step)

    def _process_group(self) -> Any:
        td = dist.group()
        if td is None:
            # DCP warns from its own thread, where no catch_warnings reaches; a world of one is
            # what was asked for.
            warnings.filterwarnings("ignore", message=safe_dcp.SINGLE_PROCESS_WARNING)
            return None
        if self._group is None:
            self._group = td.new_group(backend="gloo")  # collective: every rank is here
        return self._group

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
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import functools
import hashlib
import io
import json
import operator
import os
import pickle
import re
import secrets
import shutil
import sys
import threading
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from slurmddp.errors import CheckpointError
from slurmddp.rank import coordination

FORMAT = 2
# The checksum of each file that a manifest of each format records.
_CHECKSUMS = {1: "sha256", 2: "crc32"}
MANIFEST = "manifest.json"
POINTER = "latest"
STATE_FILE = "state.pt"

_STEP_DIR = re.compile(r"step-(\d{8,})")
_PREV_DIR = re.compile(r"\.prev-step-(\d{8,})-[0-9a-f]+")
# Hidden names a crashed writer can leave behind; all are removed once a newer save is published.
_STALE_PREFIXES = (".tmp-", ".prev-", ".trash-", ".latest.tmp-")
_CHUNK = 8 << 20
# While saving, the crc32 of a buffer is taken in _CRC_THREADS threads, in parts of at least
# _PARALLEL_CRC bytes (a smaller one costs less than a thread), while os.write copies it: crc32 runs
# at ~2 GiB/s per core, half the speed of the copy. Two threads measured ~15% faster than one on 2
# cores, three slower. The disk is sent what is written every _FLUSH_EVERY bytes.
_CRC_THREADS = 2
_PARALLEL_CRC = 1 << 20
_FLUSH_EVERY = 128 << 20
# Created entries never get the world-write bit, whatever the umask; the kernel applies the
# umask on top, so a stricter user setting is kept.
_DIR_MODE = 0o775
_FILE_MODE = 0o664

_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)



@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its step, its state and the directory it came from."""

    step: int
    state: dict
    path: Path


class Checkpointer:
    """Save and load training state under `directory`, keeping the newest `keep` checkpoints.

    Replicated mode (default): every rank calls `save` with the same state, rank 0 alone writes
    it, and every rank returns once the checkpoint is complete and `latest` names it. Sharded mode
    (``sharded=True``): every rank saves its own part through torch.distributed.checkpoint (DCP)
    and `load_latest(into=...)` loads each rank's part in place; leaves may be tensors, DTensors
    and plain values (DCP stores those pickled; they are loaded with weights_only=True). Without
    an initialised process group the process is a world of one.

    ``async_save=True`` (replicated only): `save` checks the state, copies its tensors to CPU
    memory of its own (so training may change the model as soon as it returns) and returns; rank 0
    then writes and publishes the copy in a background thread, with no collective in that thread.
    The ranks learn whether it succeeded, and its error is raised (once, on every rank), at the
    start of the next `save`, or in `wait()` / `wait_for_saves()`; those are then collective: with
    a process group every rank must call them, as every rank calls `save`. Until then `latest`
    names the previous checkpoint; a crash loses only the one being written.

    GPU tensors are copied out through pinned CPU buffers that the Checkpointer keeps for its
    next saves (as much pinned memory as the GPU tensors of the state).

    Old checkpoints are removed in a background thread once the new one is published; the next
    save waits for that before it writes, and `wait()` waits for it too.

    ``verify=True`` checks the size and checksum of every file against the manifest before
    loading.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        *,
        sharded: bool = False,
        async_save: bool = False,
        verify: bool = True,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, not {keep!r}")
        if sharded and async_save:
            raise CheckpointError(
                "asynchronous sharded checkpoints are not supported: pass sharded=True or "
                "async_save=True, not both"
            )
        self.directory = Path(directory).expanduser().absolute()
        self.keep = keep
        self.sharded = sharded
        self.async_save = async_save
        self.verify = verify
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending: int | None = None  # step of an async save not yet agreed by all ranks
        self._order = 0  # its place in _in_flight
        self._cleanup: threading.Thread | None = None  # removing old checkpoints
        self._staging = _Staging()  # pinned CPU memory for GPU tensors, kept between saves

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Write `state` as checkpoint `step` and point `latest` at it; collective.

        Raises CheckpointError on every rank, before anything is written, for a negative step, a
        state that is not a mapping or one holding objects ``torch.load(weights_only=True)``
        would refuse; and when the write fails (the previous checkpoint then stays the latest).
        In async mode it first waits for the previous save and re-raises its error.
        """
        self._settle()
        refusal = _check_step(step)
        if refusal is None:
            step = operator.index(step)
            refusal = _check_state(state, sharded=self.sharded)
        if not _agree(refusal is None):
            raise CheckpointError(
                refusal or f"checkpoint step {step} was refused on another rank: see its error"
            )
        if not isinstance(state, dict):
            state = dict(state)
        if self.sharded:
            self._save_sharded(step, state)
        elif self.async_save:
            self._start_async(step, state)
        else:
            error = None
            if _rank() == 0:
                try:
                    self._write_replicated(step, _snapshot(state, self._staging, cpu=False))
                except BaseException as e:  # the other ranks must hear of it, not hang
                    error = e
            self._raise_unless_agreed(error, step)

    def wait(self) -> None:
        """Block until this Checkpointer's async save in flight (if any) is published, and old
        checkpoints it replaced are removed.

        Re-raises that save's error. With a process group and a save pending it is collective:
        rank 0 joins its writer thread, then all ranks agree on the outcome.
        """
        self._settle()
        self._join_cleanup()

    @property
    def latest_step(self) -> int | None:
        """The step that `latest` names on disk now; None without a pointer or checkpoint."""
        name = _read_pointer(self.directory)
        if name is None or not (self.directory / name).is_dir():
            return None
        return _step_of(name)

    def _raise_unless_agreed(self, error: BaseException | None, step: int) -> None:
        if not _agree(error is None, after_work=True):
            if error is not None:
                raise error
            raise CheckpointError(
                f"rank 0 could not save checkpoint step {step} in {self.directory}: see its error"
            )

    def _start_async(self, step: int, state: dict) -> None:
        if _rank() == 0:
            snapshot = _snapshot(state, self._staging)  # before returning: training goes on
            self._thread = threading.Thread(target=self._write_in_background,
                                            args=(step, snapshot),
                                            name=f"slurmddp-checkpoint-{step}")  # fmt: skip
            self._thread.start()
        self._pending = step
        self._order = next(_counter)
        _in_flight[self._order] = self

    def _write_in_background(self, step: int, state: dict) -> None:
        try:
            self._write_replicated(step, state)
        except BaseException as e:  # kept for the thread that settles this save
            self._error = e

    def _join_local(self) -> BaseException | None:
        """Wait for this process's writer thread; no collective."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        return self._error

    def _settle(self) -> None:
        if self._pending is None:
            return
        step = self._pending
        error = self._join_local()
        self._pending, self._error = None, None
        _in_flight.pop(self._order, None)
        self._raise_unless_agreed(error, step)

    def _write_replicated(self, step: int, state: dict) -> None:
        """Rank 0: write `state` into a temporary directory, then publish it."""
        tmp = self._make_tmp(step)
        try:
            files = {STATE_FILE: _write_state(tmp / STATE_FILE, state)}
            _write_manifest(tmp, step, "replicated", files)
            _fsync_dir(tmp)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError | RuntimeError):  # torch.save reports failed writes so
                raise self._save_error(step, e) from e
            raise
        self._publish(tmp, step)

    def _make_tmp(self, step: int) -> Path:
        self._join_cleanup()
        try:
            _makedirs(self.directory)
            tmp = self.directory / f".tmp-step-{step}-{secrets.token_hex(8)}"
            os.mkdir(tmp, _DIR_MODE)
        except OSError as e:
            raise self._save_error(step, e) from e
        return tmp

    def _publish(self, tmp: Path, step: int) -> None:
        try:
            name, doomed = _publish(self.directory, tmp, step)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._save_error(step, e) from e
        doomed += _prune(self.directory, self.keep, name, step)
        if doomed:
            # Freeing a large checkpoint takes a while (~0.5 s per GiB on ext4): the caller need
            # not wait for it. The next save waits, before it writes, so the space is back.
            self._cleanup = threading.Thread(target=_remove_all, args=(doomed,), daemon=True,
                                             name="slurmddp-checkpoint-cleanup")  # fmt: skip
            self._cleanup.start()

    def _join_cleanup(self) -> None:
        if self._cleanup is not None:
            self._cleanup.join()
            self._cleanup = None

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        return CheckpointError(
            f"cannot save checkpoint step {step} in {self.directory}: {_one_line(e)}; the previous "
            "checkpoint stays the latest: check free space, quota and permissions there"
        )

    def _save_sharded(self, step: int, state: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        error: BaseException | None = None
        name = ""
        if _rank() == 0:
            try:
                name = self._make_tmp(step).name
            except CheckpointError as e:
                error = e
        name = _broadcast_text(name)
        if not name:
            self._raise_unless_agreed(error, step)
            raise CheckpointError(f"rank 0 could not start checkpoint step {step}")  # unreachable
        tmp = self.directory / name
        try:
            with _quiet_single_process():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        except (Exception, CheckpointException) as e:
            error = self._save_error(step, _dcp_cause(e))
        if not _agree(error is None, after_work=True):
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            raise CheckpointError(
                f"another rank could not write its part of checkpoint step {step} in "
                f"{self.directory}: see its error"
            )
        if _rank() == 0:
            try:
                self._finish_sharded(tmp, step)
            except BaseException as e:  # the other ranks must hear of it, not hang
                error = e
        self._raise_unless_agreed(error, step)

    def _finish_sharded(self, tmp: Path, step: int) -> None:
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
                files[entry.name] = _fsync_and_hash(Path(entry.path))
            _write_manifest(tmp, step, "sharded", files)
            _fsync_dir(tmp)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise self._save_error(step, e) from e
            raise
        self._publish(tmp, step)

    # -- loading -----------------------------------------------------------------------------

    def load_latest(self, into: dict | None = None, map_location: Any = "cpu") -> Checkpoint | None:
        """Load the checkpoint `latest` names, falling back to older ones; None on a fresh start.

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
        if _group() is None:
            self._join_local()  # our own async save is on disk before we look; its error stays
        else:
            self._settle()
        if self.sharded:
            return self._load_sharded(into)

        def load(path: Path, manifest: dict | None) -> tuple[Checkpoint | None, str | None]:
            # Hashing and loading read the same file: side by side they take the time of one.
            # A file that does not hash is rejected, whatever its load did.
            checker = None
            if self.verify and manifest is not None:
                checker = _Background(_hash_problem, path, manifest)
            try:
                state, problem = _load_state(path / STATE_FILE, map_location)
            except CheckpointError:  # holds more than tensors: unless it is not our file at all
                if checker is None or checker.result() is None:
                    raise
                state, problem = None, None
            if checker is not None and (mismatch := checker.result()) is not None:
                return None, mismatch
            if state is None:
                return None, problem
            if into is not None:
                into.update(state)
                state = into
            return Checkpoint(step=_manifest_step(path, manifest), state=state, path=path), None

        if _group() is None:
            return self._first_valid(load, report=True, hashes=False)
        chosen, error = None, None
        if _rank() == 0:
            try:
                chosen = self._first_valid(load, report=True, hashes=False)
            except CheckpointError as e:
                error = e
        name = _broadcast_text("!" if error else chosen.path.name if chosen else "")
        if name == "!":
            raise error or CheckpointError(
                f"rank 0 found no valid checkpoint in {self.directory}: see its error"
            )
        if _rank() != 0 and name:
            path = self.directory / name
            manifest, problem = _verify(path, self.verify, sharded=False, hashes=False)
            if problem is None:
                chosen, problem = load(path, manifest)
            error = CheckpointError(f"cannot load checkpoint {path}, which rank 0 loaded: "
                                    f"{problem}") if problem else None  # fmt: skip
        if not _agree(error is None):
            raise error or CheckpointError(
                f"another rank could not load checkpoint {name} in {self.directory}: see its "
                "error"
            )
        return chosen

    def _first_valid(self, load: Callable[[Path, dict | None], tuple[Any, str | None]], *,
                     report: bool, hashes: bool = True) -> Any:  # fmt: skip
        """`load` applied to the newest checkpoint that verifies and loads; None if there is none.

        Tries the pointer's checkpoint, then every step-* by step, newest first, printing why
        each one was skipped; raises CheckpointError when some exist but none is usable.
        """
        directory = self.directory
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint directory {directory}: "
                                  f"{e.strerror or _one_line(e)}; give Checkpointer a directory "
                                  "this job may read (it is created by the first save)"
                                  ) from e  # fmt: skip
        steps = sorted((n for n in names if _STEP_DIR.fullmatch(n)), key=_step_of, reverse=True)
        queue: list[tuple[Path, str | None]] = []  # (path, what is already known to be wrong)
        pointer = directory / POINTER
        if POINTER in names:
            target = _read_pointer(directory)
            if target is None:
                queue.append((pointer, "unreadable (it does not name a checkpoint)"))
            elif not (directory / target).is_dir():
                queue.append((directory / target, f"missing (named by {pointer})"))
            else:
                queue.append((directory / target, None))
                steps = [n for n in steps if n != target]
        elif steps:
            queue.append((pointer, "missing"))
        queue += [(directory / n, None) for n in steps]
        for i, (path, problem) in enumerate(queue):
            if problem is None:
                manifest, problem = _verify(path, self.verify, sharded=self.sharded,
                                            hashes=hashes)  # fmt: skip
                if problem is None:
                    result, problem = load(path, manifest)
                    if problem is None:
                        return result
            if i + 1 < len(queue):
                if report:
                    what = "checkpoint pointer" if path == pointer else "checkpoint"
                    print(f"slurmddp: {what} {path} is {problem}; falling back to "
                          f"{queue[i + 1][0]}", file=sys.stderr, flush=True)  # fmt: skip
            else:
                raise CheckpointError(
                    f"no valid checkpoint in {directory}: {path} is {problem}"
                    + (f", and the {i} newer one(s) are unusable too" if i else "")
                    + "; repair or remove them to start from scratch"
                )
        return None

    def _load_sharded(self, into: dict | None) -> Checkpoint | None:
        if into is None:
            raise CheckpointError(
                f"sharded checkpoints in {self.directory} load in place: pass into=<this rank's "
                "state dict> to load_latest"
            )
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        def check(path: Path, manifest: dict | None) -> tuple[str | None, str | None]:
            # Refuses crafted metadata here, before any rank unpickles it.
            problem = _dcp_metadata_problem(path)
            return (None, problem) if problem else (path.name, None)

        chosen, error = "", None
        if _rank() == 0:
            try:
                chosen = self._first_valid(check, report=True) or ""
            except CheckpointError as e:
                chosen, error = "!", e
        chosen = _broadcast_text(chosen)
        if chosen == "!":
            raise error or CheckpointError(
                f"rank 0 found no valid checkpoint in {self.directory}: see its error"
            )
        if not chosen:
            return None
        path = self.directory / chosen
        manifest, _ = _verify(path, False, sharded=True)
        try:
            with _quiet_single_process():
                dcp.load(into, storage_reader=_reader_class()(path), planner=_planner_class()())
        except (Exception, CheckpointException) as e:
            cause = _dcp_cause(e)
            if isinstance(cause, pickle.UnpicklingError):
                raise _not_plain(path) from None
            raise CheckpointError(f"cannot load sharded checkpoint {path}: {_one_line(cause)}; "
                                  "does `into` match the saved state?") from e  # fmt: skip
        return Checkpoint(step=_manifest_step(path, manifest), state=into, path=path)


def wait_for_saves() -> None:
    """Wait for every async save in flight in this process and re-raise the first error.

    Collective like `Checkpointer.wait` (every rank calls it, e.g. before a requeue).
    """
    first: BaseException | None = None
    for _, ckpt in sorted(_in_flight.items()):
        try:
            ckpt.wait()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


# -- async saves in flight, in start order: every rank settles them in the same order ----------

_in_flight: dict[int, Checkpointer] = {}  # strong references: a pending save is never forgotten
_counter = iter(range(1 << 62))


@atexit.register
def _finish_writes_at_exit() -> None:
    # `slurmddp.run` ends the process with os._exit after atexit: a checkpoint being written in
    # the background must reach the disk first. Local join only; collectives may be gone by now.
    for ckpt in list(_in_flight.values()):
        error = ckpt._join_local()
        if error is not None:
            print(f"slurmddp: {_one_line(error)}", file=sys.stderr, flush=True)


# -- state checks and copies ---------------------------------------------------------------------


def _check_step(step: Any) -> str | None:
    if isinstance(step, bool):
        return f"checkpoint step must be an integer >= 0, not {step!r}"
    try:
        value = operator.index(step)
    except TypeError:
        return f"checkpoint step must be an integer >= 0, not {step!r}"
    return None if value >= 0 else f"checkpoint step must be an integer >= 0, not {value}"


def _check_state(state: Any, *, sharded: bool) -> str | None:
    """Why ``torch.load(weights_only=True)`` would refuse `state`, or None; walks it once."""
    if not isinstance(state, Mapping):
        return (f"checkpoint state must be a mapping (a dict of tensors and plain values), not "
                f"{_type_name(state)}")  # fmt: skip
    leaves = _TENSOR_TYPES
    if sharded:
        from torch.distributed.tensor import DTensor

        leaves = (*_TENSOR_TYPES, DTensor)
    stack: list[tuple[str, Any]] = [("state", state)]
    seen: set[int] = set()
    while stack:
        where, value = stack.pop()
        kind = type(value)
        if kind in _PLAIN_TYPES or kind in leaves or kind in (torch.Size, torch.dtype,
                                                              torch.device):  # fmt: skip
            continue
        if id(value) in seen:
            continue
        if isinstance(value, Mapping) and (value is state or kind in (dict, OrderedDict)):
            seen.add(id(value))
            for key, item in value.items():
                stack.append((f"a key of {where}", key))
                stack.append((f"{where}[{key!r}]", item))
        elif kind in (list, tuple, set):
            seen.add(id(value))
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        else:
            return _refused(where, value)
    return None


def _refused(where: str, value: Any) -> str:
    return (f"{where} has type {_type_name(value)}, which torch.load(weights_only=True) refuses: "
            "keep only tensors, plain values and lists/tuples/dicts of them in a checkpoint "
            "(e.g. save .state_dict(), convert arrays to tensors)")  # fmt: skip


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")  # fmt: skip


def _snapshot(value: Any, staging: _Staging, *, cpu: bool = True) -> Any:
    """A copy of `value` whose tensors live in CPU memory that nothing else references.

    GPU tensors go through `staging`'s pinned buffers; with ``cpu=False`` CPU tensors are kept
    as they are (a synchronous save writes them before anything can change them).
    """
    memo: dict[int, Any] = {}
    copy = _copy(value, staging, memo, cpu)
    staging.wait()
    return copy


def _copy(value: Any, staging: _Staging, memo: dict[int, Any], cpu: bool) -> Any:
    if isinstance(value, torch.Tensor):
        copy = memo.get(id(value))
        if copy is None:  # a tensor reachable twice (tied weights) stays one tensor
            if value.device.type == "cpu":
                copy = value.detach().clone() if cpu else value
            else:
                copy = staging.copy(value.detach())
            memo[id(value)] = copy
        return copy
    kind = type(value)
    if kind in (dict, OrderedDict) or isinstance(value, Mapping):
        items = ((k, _copy(v, staging, memo, cpu)) for k, v in value.items())
        return OrderedDict(items) if kind is OrderedDict else dict(items)
    if kind is list:
        return [_copy(v, staging, memo, cpu) for v in value]
    if kind is tuple:
        return tuple(_copy(v, staging, memo, cpu) for v in value)
    if kind is set:
        return set(value)  # elements are hashable plain values
    return value  # immutable: plain values, torch.Size, dtype, device


class _Staging:
    """Pinned CPU buffers that GPU tensors are copied into for a save, reused from save to save.

    A copy into pinned memory runs at the bus's speed and without blocking; a fresh pageable
    tensor each time costs its allocation and page faults (measured on an H100: a 1 GiB state
    took 0.72 s). The buffers are reused in the order the tensors come, so a state of the same
    layout as the last one allocates nothing; the previous save has been written (`save`
    settles it first) before they are overwritten.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._streams: list[Any] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._next < len(self._buffers) and _same_layout(self._buffers[self._next], tensor):
            buffer = self._buffers[self._next]
        else:
            buffer = _pinned_like(tensor)
            if self._next < len(self._buffers):
                self._buffers[self._next] = buffer
            else:
                self._buffers.append(buffer)
        self._next += 1
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        if tensor.device.type == "cuda":
            self._streams.append(torch.cuda.current_stream(tensor.device))
        return buffer

    def wait(self) -> None:
        """Until every copy is in its buffer; then the next save starts from the first buffer."""
        for stream in {id(s): s for s in self._streams}.values():
            stream.synchronize()
        self._streams.clear()
        del self._buffers[self._next:]  # a smaller state: free what it no longer needs
        self._next = 0


def _same_layout(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    return buffer.shape == tensor.shape and buffer.dtype == tensor.dtype


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # no pinnable memory here (no driver, a memlock limit): pageable
        return torch.empty(tensor.shape, dtype=tensor.dtype)


# -- writing ------------------------------------------------------------------------------------


def _write_state(path: Path, state: dict) -> dict:
    """torch.save `state` to `path` and fsync it; returns its size and crc32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    appender = _Appender(fd)
    try:
        with _no_zip_crc32():
            torch.save(state, appender)
        return appender.finish()
    except BaseException as e:
        with contextlib.suppress(OSError):
            appender.join()  # the file stays open until its background fdatasync is over
        if appender.error is not None and e is not appender.error:
            # torch.save turns our OSError into "unexpected pos ..."; the OS error says more.
            raise appender.error from None
        raise
    finally:
        os.close(fd)


class _Appender:
    """The file object torch.save writes to: appends with os.write, takes the crc32 of the bytes
    as they go out, and gets the disk started on them before the end.

    A large buffer is checksummed in parts, in other threads, while os.write copies it (all of
    them release the GIL); `write` waits for the parts, as torch.save may free the buffer once it
    returns, and combines their CRCs. Every _FLUSH_EVERY bytes a background fdatasync (when none
    is running) sends what is written so far to the disk while serialization goes on, so the
    final fsync has only the tail left. torch.save only ever appends (no seek), so the bytes
    written are the file.
    """

    _PIECE = 64 << 20

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._crc = 0
        self._size = 0
        self._unflushed = 0
        self._flusher: _Background | None = None
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        total = len(view)
        count = min(_CRC_THREADS, total // _PARALLEL_CRC)
        size = -(-total // count) if count else total
        parts = [view[i : i + size] for i in range(0, total, size)] if count else []
        workers = [_Background(zlib.crc32, part) for part in parts]
        if not workers:
            self._crc = zlib.crc32(view, self._crc)
        try:
            self._append(view)
        except OSError as e:
            self.error = e
            raise
        finally:
            crcs = [worker.result() for worker in workers]
        for part, crc in zip(parts, crcs, strict=True):
            self._crc = _crc32_combine(self._crc, crc, len(part))
        return total

    def _append(self, view: memoryview) -> None:
        while view:
            n = os.write(self._fd, view[: self._PIECE])
            view = view[n:]
            self._size += n
            self._unflushed += n
        if self._unflushed >= _FLUSH_EVERY and not self._flushing():
            self._unflushed = 0
            self._flusher = _Background(os.fdatasync, self._fd)

    def flush(self) -> None:
        pass

    def _flushing(self) -> bool:
        """Whether the background fdatasync still runs; raises what it raised."""
        if self._flusher is None:
            return False
        if not self._flusher.done():
            return True
        flusher, self._flusher = self._flusher, None
        flusher.result()  # an error is reported once per open file: this is our only chance
        return False

    def finish(self) -> dict:
        """fsync the file once the writes are done; {"size", "crc32"} of everything written."""
        self.join()
        os.fsync(self._fd)
        return {"size": self._size, "crc32": f"{self._crc:08x}"}

    def join(self) -> None:
        """Wait for the background fdatasync, if any (before the file is closed)."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.result()


_CRC_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected as zlib computes it


def _multmodp(a: int, b: int) -> int:
    """a * b modulo _CRC_POLY, polynomials over GF(2) in reflected order; a is never 0."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _powers_of_x() -> list[int]:
    """x^(2^k) modulo _CRC_POLY for k = 0..31."""
    table = [1 << 30]
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _powers_of_x()


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc1 of A, crc2 of B and the length of B: zlib's crc32_combine
    (crc32.c), which Python's zlib module does not offer. crc1 is shifted by x^(8 * len2)."""
    p, k = 1 << 31, 3  # p = x^0; k = 3: the bits of len2 count bytes, 2^3 bits each
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


class _Crc32:
    """zlib.crc32 behind hashlib's update/hexdigest."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


class _Background:
    """fn(*args) in a thread; `result()` waits and returns it (or raises what it raised)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn(*args)
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=run, name="slurmddp-checkpoint-io", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _while_syncing(fd: int, work: Callable[[], Any]) -> Any:
    """`work()` while fsync(fd) runs in another thread (the disk flush and the CPU overlap)."""
    failure: list[OSError] = []

    def flush() -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            failure.append(e)

    syncer = threading.Thread(target=flush, name="slurmddp-fsync")
    syncer.start()
    try:
        result = work()
    finally:
        syncer.join()
    if failure:
        raise failure[0]
    return result


def _fsync_and_hash(path: Path) -> dict:
    """fsync an existing file while checksumming it; {"size", "crc32"}."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size, digest = _while_syncing(fd, lambda: _hash_file(path, "crc32"))
    finally:
        os.close(fd)
    return {"size": size, "crc32": digest}


_crc32_lock = threading.Lock()


@contextlib.contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """torch.save without the CRC32 of every zip record: the manifest's crc32 covers the file,
    and torch's CRC is slower than zlib's (~0.6 s per GiB). torch.load does not need it.

    The switch is process-wide while it lasts (a torch.save in another thread at that moment
    skips the CRC too, which only zip tools would notice); the lock keeps our own saves from
    restoring each other's value out of order.
    """
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: always computes it
        yield
        return
    with _crc32_lock:
        before = config.save.compute_crc32
        config.save.compute_crc32 = False
        try:
            yield
        finally:
            config.save.compute_crc32 = before


def _hash_file(path: Path, algorithm: str) -> tuple[int, str]:
    """The size and checksum (`algorithm`: "crc32" or "sha256") of the file at `path`."""
    digest = _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _write_manifest(directory: Path, step: int, mode: str, files: dict) -> None:
    text = json.dumps({"format": FORMAT, "step": step, "mode": mode, "files": files}, indent=1)
    _write_small(directory / MANIFEST, text.encode())


def _write_small(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems cannot sync dirs
            raise
    finally:
        os.close(fd)


def _makedirs(directory: Path) -> None:
    """mkdir -p with our mode for every level created, each made durable in its parent."""
    missing = []
    path = directory
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # created meanwhile
            os.mkdir(path, _DIR_MODE)
        _fsync_dir(path.parent)


def _write_pointer(directory: Path, name: str) -> None:
    tmp = directory / f".latest.tmp-{secrets.token_hex(8)}"
    _write_small(tmp, f"{name}\n".encode())
    os.replace(tmp, directory / POINTER)
    _fsync_dir(directory)


def _publish(directory: Path, tmp: Path, step: int) -> tuple[str, list[Path]]:
    """Rename the finished `tmp` to step-<step> and point `latest` at it.

    Returns the new name and the hidden directories left to remove.

    Saving a step that already exists (again after a resume) keeps `latest` on a complete copy
    throughout: the old files are hard-linked (copied where links fail) into a hidden directory,
    `latest` names that, the old directory moves aside, the new one takes its name, and `latest`
    comes back to it.
    """
    final = directory / f"step-{step:08d}"
    aside: list[Path] = []
    if os.path.lexists(final):
        if _read_pointer(directory) == final.name:
            prev = directory / f".prev-{final.name}-{secrets.token_hex(8)}"
            _link_copy(final, prev)
            _write_pointer(directory, prev.name)
            aside.append(prev)
        trash = directory / f".trash-{final.name}-{secrets.token_hex(8)}"
        os.rename(final, trash)
        aside.append(trash)
    os.rename(tmp, final)
    _fsync_dir(directory)
    _write_pointer(directory, final.name)
    return final.name, aside


def _link_copy(source: Path, target: Path) -> None:
    os.mkdir(target, _DIR_MODE)
    for entry in os.scandir(source):
        try:
            os.link(entry.path, target / entry.name)
        except OSError:  # no hard links on this filesystem
            shutil.copy(entry.path, target / entry.name)  # with its mode, as a link would
            fd = os.open(target / entry.name, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(target)
    _fsync_dir(target.parent)


def _prune(directory: Path, keep: int, current: str, step: int) -> list[Path]:
    """After `current` (of `step`) is published: older checkpoints beyond `keep`, and what crashed
    writers left, to remove. Steps above `step` (a save that crashed before its pointer moved, or
    a run abandoned after a fallback) are left alone: saving that step again replaces them.

    Checkpoints to drop are renamed to hidden names here, so that an interrupted removal never
    leaves a half checkpoint behind; the caller removes the returned paths.
    """
    try:
        names = os.listdir(directory)
    except OSError as e:
        _warn(f"could not list {directory} to remove old checkpoints: {_one_line(e)}")
        return []
    older = sorted((n for n in names if _STEP_DIR.fullmatch(n) and _step_of(n) <= step
                    and n != current), key=_step_of, reverse=True)  # fmt: skip
    doomed = [directory / n for n in names if n.startswith(_STALE_PREFIXES) and n != current]
    for name in older[keep - 1 :]:
        trash = directory / f".trash-{name}-{secrets.token_hex(8)}"
        try:
            os.rename(directory / name, trash)
        except OSError as e:
            _warn(f"could not remove old checkpoint {directory / name}: {_one_line(e)}")
        else:
            doomed.append(trash)
    return doomed


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            _warn(f"could not remove old checkpoint {path}: {_one_line(e)}")


# -- reading ------------------------------------------------------------------------------------


def _read_pointer(directory: Path) -> str | None:
    """The checkpoint name in `latest`, or None if it is absent or not a plain name."""
    try:
        name = (directory / POINTER).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    if not name or "/" in name or name in (".", "..") or "\n" in name or "\0" in name:
        return None
    return name


def _step_of(name: str) -> int | None:
    match = _STEP_DIR.fullmatch(name) or _PREV_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _manifest_step(path: Path, manifest: dict | None) -> int:
    if manifest is not None and isinstance(manifest.get("step"), int):
        return manifest["step"]
    step = _step_of(path.name)
    if step is None:
        raise CheckpointError(f"cannot tell the step of checkpoint {path}: its manifest.json is "
                              "unreadable; rename it step-<step>")  # fmt: skip
    return step


def _verify(path: Path, verify: bool, *, sharded: bool,
            hashes: bool = True) -> tuple[dict | None, str | None]:  # fmt: skip
    """(manifest, None) when `path` is a complete checkpoint, else (manifest or None, problem).

    Checks the manifest, then the size of every file, then (with `hashes`) their checksums.
    Without `verify` only the manifest is read (when present).
    """
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, ("incomplete (it has no manifest.json)" if verify else None)
    except OSError as e:
        return None, f"unreadable ({_one_line(e)})"
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in files
        ):
            raise ValueError("bad file list")
    except (ValueError, KeyError, TypeError):
        return None, "corrupt (its manifest.json does not parse)"
    mode = manifest.get("mode", "replicated")
    if mode != ("sharded" if sharded else "replicated"):
        raise CheckpointError(
            f"checkpoint {path} is {mode} but this Checkpointer loads "
            f"{'sharded' if sharded else 'replicated'} ones: construct it with "
            f"sharded={mode == 'sharded'}"
        )
    if not isinstance(manifest.get("format"), int) or manifest["format"] not in _CHECKSUMS:
        return manifest, f"in an unknown format (version {manifest.get('format')!r})"
    needed = ".metadata" if sharded else STATE_FILE
    if needed not in files:
        return manifest, f"corrupt (its manifest.json lists no {needed})"
    if not verify:
        return manifest, None
    for name, expected in files.items():
        want = expected.get("size") if isinstance(expected, dict) else None
        try:
            size = os.stat(path / name).st_size
        except FileNotFoundError:
            return manifest, f"incomplete ({name} is missing)"
        except OSError as e:
            return manifest, f"unreadable ({_one_line(e)})"
        if size != want:
            what = "truncated" if isinstance(want, int) and size < want else "corrupt"
            return manifest, f"{what} ({name} has {size} bytes, its manifest says {want})"
    return manifest, (_hash_problem(path, manifest) if hashes else None)


def _hash_problem(path: Path, manifest: dict) -> str | None:
    """Which file of `path` does not checksum as its manifest says, or None."""
    algorithm = _CHECKSUMS[manifest["format"]]
    for name, expected in manifest["files"].items():
        try:
            size, digest = _hash_file(path / name, algorithm)
        except OSError as e:
            return f"unreadable ({_one_line(e)})"
        if size != expected.get("size"):
            return f"changing ({name} has {size} bytes now, its manifest says {expected['size']})"
        if digest != expected.get(algorithm):
            return f"corrupt (the {algorithm} of {name} does not match its manifest)"
    return None


def _load_state(path: Path, map_location: Any) -> tuple[dict | None, str | None]:
    """(state, None) by torch.load with weights_only, or (None, why it cannot be read)."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise _not_plain(path) from None
    except Exception as e:  # damaged data fails in many ways (IndexError, KeyError...)
        return None, f"unreadable by torch.load ({_one_line(e)})"
    if not isinstance(state, dict):
        return None, f"not a state dict (it holds a {_type_name(state)})"
    return state, None


def _not_plain(path: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} holds something other than tensors and plain containers; "
        "refusing to load it (torch.load weights_only=True): remove it unless you trust and "
        "convert it"
    )


# -- torch.distributed.checkpoint without unrestricted unpickling ------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_EXTRA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}  # fmt: skip


class _Forbidden(pickle.UnpicklingError):
    """A pickle names a global that a checkpoint has no business naming."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's `.metadata` (its dataclasses, dtypes, torch.Size, paths) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _EXTRA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name,
                          None)  # fmt: skip
            # Only classes defined there: dataclasses and enums, whose construction runs no code
            # chosen by the file.
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise _Forbidden(f"global {module}.{name} is not allowed in DCP metadata")


def _dcp_metadata_problem(path: Path) -> str | None:
    """What is wrong with `path`/.metadata, or None; raises CheckpointError if it is crafted."""
    try:
        with open(path / ".metadata", "rb") as f:
            _MetadataUnpickler(f).load()
    except _Forbidden:
        raise _not_plain(path / ".metadata") from None
    except Exception as e:  # unpickling damaged data can fail in many ways
        return f"damaged (its .metadata does not load: {_one_line(e)})"
    return None


@functools.cache  # built on first use: DCP is a heavy import
def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self._get_metadata_path(kwargs.get("rank")))
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


@functools.cache
def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        # The default planner loads non-tensor items with weights_only=False; the same bytes
        # reach it only after a weights_only=True load has accepted them.
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            data = value.getvalue()
            torch.load(io.BytesIO(data), weights_only=True)
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_cause(e: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's CheckpointException, else `e`; the OS
    error behind it where there is one."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        e = first[0] if isinstance(first, tuple) else first
    # torch.save inside DCP turns a failed write into "unexpected pos ..."; the OSError it hit
    # (No space left on device...) is that error's context.
    seen: BaseException | None = e
    for _ in range(16):  # a chain may loop
        if seen is None or isinstance(seen, OSError):
            break
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, OSError) else e


# -- collectives --------------------------------------------------------------------------------


def _group() -> Any:
    import torch.distributed as td

    return td if td.is_available() and td.is_initialized() else None


def _rank() -> int:
    td = _group()
    return td.get_rank() if td is not None else 0


def _collective_device(td: Any) -> torch.device:
    backend = str(td.get_backend())
    # NCCL takes CUDA tensors only; gloo and MPI take CPU ones ("cpu:gloo,cuda:nccl" too).
    if "nccl" in backend and not any(b in backend for b in ("gloo", "mpi")):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(ok: bool, *, after_work: bool = False) -> bool:
    """True when `ok` holds on every rank; also a barrier. Local without a process group.

    `after_work`: some rank may arrive much later (rank 0 wrote the checkpoint): the others wait
    for it at the rendezvous store first, so that no collective timeout bounds a write.
    """
    td = _group()
    if td is None:
        return ok
    if after_work:
        coordination.wait_all()
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=_collective_device(td))
    td.all_reduce(flag, op=td.ReduceOp.MAX)
    return int(flag.item()) == 0


def _broadcast_text(text: str, size: int = 256) -> str:
    """Rank 0's `text` (a short name) on every rank, as a tensor: no pickles in collectives.

    Rank 0 may have worked long for it (reading, hashing): the others wait at the store first.
    """
    td = _group()
    if td is None:
        return text
    coordination.wait_all()
    data = text.encode()[:size] if td.get_rank() == 0 else b""
    buf = torch.zeros(size, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(_collective_device(td))
    td.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


# -- messages -----------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())


def _warn(message: str) -> None:
    print(f"slurmddp: {message}", file=sys.stderr, flush=True)


__all__ = ["Checkpoint", "CheckpointError", "Checkpointer", "wait_for_saves"]

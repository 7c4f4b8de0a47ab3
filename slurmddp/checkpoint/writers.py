"""Writing checkpoint files fast and durably: torch.save streamed to the file with its crc32
taken on the way and the disk flush overlapping the serialization; fsync overlapping the checksum
of files others wrote (torch.distributed.checkpoint's)."""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slurmddp import files as fs
from slurmddp.checkpoint import crc32
from slurmddp.checkpoint.background import Background
from slurmddp.checkpoint.manifest import hash_file

# While saving, the crc32 of a buffer is taken in CRC_THREADS threads, in parts of at least
# PARALLEL_CRC bytes (a smaller one costs less than a thread), while os.write copies it: crc32 runs
# at ~2 GiB/s per core, half the speed of the copy. Two threads measured ~15% faster than one on 2
# cores, three slower. The disk is sent what is written every FLUSH_EVERY bytes.
CRC_THREADS = 2
PARALLEL_CRC = 1 << 20
FLUSH_EVERY = 128 << 20


def write_state(path: Path, state: dict) -> dict:
    """torch.save `state` to a new file `path` and fsync it; returns its {"size", "crc32"}."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, fs.FILE_MODE)
    appender = _Appender(fd)
    try:
        with _no_zip_crc32():
            torch.save(state, appender)  # type: ignore[arg-type]  # a file object by duck typing
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
    returns, and combines their CRCs. Every FLUSH_EVERY bytes a background fdatasync (when none
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
        self._flusher: Background[None] | None = None
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        total = len(view)
        count = min(CRC_THREADS, total // PARALLEL_CRC)
        size = -(-total // count) if count else total
        parts = [view[i : i + size] for i in range(0, total, size)] if count else []
        workers = [Background(zlib.crc32, part) for part in parts]
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
            self._crc = crc32.combine(self._crc, crc, len(part))
        return total

    def _append(self, view: memoryview) -> None:
        while view:
            n = os.write(self._fd, view[: self._PIECE])
            view = view[n:]
            self._size += n
            self._unflushed += n
        if self._unflushed >= FLUSH_EVERY and not self._flushing():
            self._unflushed = 0
            self._flusher = Background(os.fdatasync, self._fd)

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


def fsync_and_hash(path: Path) -> dict:
    """fsync an existing file while checksumming it (the disk flush and the CPU overlap);
    {"size", "crc32"}."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        syncer = Background(os.fsync, fd, name="slurmddp-fsync")
        try:
            size, digest = hash_file(path, "crc32")
        finally:
            failure = syncer.wait()  # the file stays open until its fsync is over
        if failure is not None:
            raise failure
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

"""A node's snapshot store: one directory in the node's memory (or on its own disk) holding the
snapshot files of its ranks and the replicas it keeps for another node.

A file is named after what it holds, ``step-0000000120.rank-00003.of-00004.crc-1a2b3c4d.snap``,
so that listing the directory is the inventory; it is written under a hidden name and renamed
into place, so a listed file is whole. The directory is keyed by the job, its run (a requeue
starts a new one: the snapshots of the run before stay behind with its nodes) and the node's
Slurm name: on a cluster whose nodes share one host, as the local one, each node has its own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from slurmddp import files as fs
from slurmddp.protocol import SNAPSHOT_DIR_VAR

DEFAULT_ROOT = "/dev/shm"
_NAME = re.compile(r"step-(\d{10})\.rank-(\d{5})\.of-(\d{5})\.crc-([0-9a-f]{8})\.snap")
# Room a store never takes from its file system: /dev/shm also carries NCCL's intra-node buffers
# and DataLoader workers' batches. The smaller of 1 GiB and a tenth of the file system.
RESERVE_BYTES = 1 << 30
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


@dataclass(frozen=True, order=True)
class Shard:
    """One rank's state at one step: which, of how many ranks, its crc32 and size in bytes."""

    step: int
    rank: int
    world: int
    crc: int
    size: int = 0

    @property
    def name(self) -> str:
        return (f"step-{self.step:010d}.rank-{self.rank:05d}.of-{self.world:05d}."
                f"crc-{self.crc:08x}.snap")  # fmt: skip


def parse(name: str, size: int = 0) -> Shard | None:
    """The shard a file name describes, or None for any other file."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    step, rank, world, crc = m.groups()
    return Shard(int(step), int(rank), int(world), int(crc, 16), size)


def node_name(environ: Mapping[str, str]) -> str:
    """This node's name as Slurm knows it (slurmd's), else the host's."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def run_key(environ: Mapping[str, str]) -> tuple[str, str]:
    """(the job, its run): Slurm's job id and restart count, else torchrun's run id."""
    job = environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or "nojob"
    return _safe(job), _safe(environ.get("SLURM_RESTART_COUNT") or "0")


def _safe(word: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", word)[:64] or "_"


def root(environ: Mapping[str, str]) -> Path:
    """Where this user's stores live on the node: $SLURMDDP_SNAPSHOT_DIR, else /dev/shm."""
    base = Path(environ.get(SNAPSHOT_DIR_VAR) or DEFAULT_ROOT)
    return base / f"slurmddp-snapshots-{os.getuid()}"


def node_directory(environ: Mapping[str, str]) -> Path:
    """This node's store of this job's run."""
    job, run = run_key(environ)
    return root(environ) / f"{job}.{run}" / node_name(environ)


class NodeStore:
    """The snapshot files of one node, in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made = False

    @classmethod
    def of_this_node(cls, environ: Mapping[str, str] | None = None) -> NodeStore:
        """This node's store of this run; the stores earlier runs of the job left on this node
        are removed (their snapshots are older than the checkpoint a requeue resumes from)."""
        environ = os.environ if environ is None else environ
        directory = node_directory(environ)
        job, run = run_key(environ)
        with contextlib.suppress(OSError):
            for old in directory.parent.parent.glob(f"{job}.*"):
                if old.name != f"{job}.{run}":
                    shutil.rmtree(old, ignore_errors=True)
        return cls(directory)

    def shards(self) -> list[Shard]:
        """Every whole snapshot file here."""
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory) as entries:
            for entry in entries:
                shard = parse(entry.name)
                if shard is not None:
                    with contextlib.suppress(OSError):
                        found.append(replace(shard, size=entry.stat().st_size))
        return sorted(found)

    def path(self, shard: Shard) -> Path:
        return self.directory / shard.name

    def room_for(self, size: int) -> tuple[bool, int, int]:
        """(whether `size` more bytes leave the reserve free, free bytes, total bytes)."""
        self._make()
        usage = shutil.disk_usage(self.directory)
        reserve = min(RESERVE_BYTES, usage.total // 10)
        return usage.free - size >= reserve, usage.free, usage.total

    @property
    def root(self) -> Path:
        """The directory of every store of this user (/dev/shm/slurmddp-snapshots-UID)."""
        return self.directory.parent.parent

    def put(self, shard: Shard, data: memoryview | bytes | bytearray,
            reuse: Shard | None = None) -> None:  # fmt: skip
        """Write `data` as `shard`, whole or not at all; raises OSError (ENOSPC...). `reuse`: an
        old shard whose file is written over instead (in memory, a new file's pages are
        allocated and zeroed first, which takes most of a write's time); it is gone either way."""
        with self._writing(shard, reuse) as fd:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]

    @contextlib.contextmanager
    def receiving(self, shard: Shard, reuse: Shard | None = None) -> Iterator[memoryview]:
        """`put`, for bytes that arrive: a writable view of `shard`'s file, mapped, so that a
        peer's bytes are received into it without a buffer of their size and a copy; published
        when the block ends, removed if it raises. Release every export of the view first."""
        with self._writing(shard, reuse) as fd:
            if not shard.size:  # mmap refuses a length of 0
                yield memoryview(bytearray())
                return
            # Allocated first, so that a full file system is an OSError here and not a SIGBUS
            # when a received byte lands; populated, so that the pages are mapped at once, not
            # faulted in one by one as they arrive.
            os.posix_fallocate(fd, 0, shard.size)
            mapped = mmap.mmap(fd, shard.size, flags=mmap.MAP_SHARED | _POPULATE)
            view = memoryview(mapped)
            try:
                yield view
            finally:
                # A failed receive's traceback may still hold a tensor over the view: then the
                # mapping is closed when that goes, and the error stays the receive's.
                with contextlib.suppress(BufferError):
                    view.release()
                    mapped.close()

    @contextlib.contextmanager
    def _writing(self, shard: Shard, reuse: Shard | None) -> Iterator[int]:
        """A descriptor of a hidden file of `shard.size` bytes (`reuse`'s, renamed, when it is
        there), renamed to `shard`'s name when the block ends, removed if it raises."""
        self._make()
        tmp = self.directory / f".{shard.name}.tmp-{secrets.token_hex(4)}"
        try:
            fd = self._open_over(reuse, tmp) if reuse is not None else -1
            if fd < 0:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             fs.FILE_MODE)  # fmt: skip
            try:
                os.ftruncate(fd, shard.size)
                yield fd
            finally:
                os.close(fd)
            os.replace(tmp, self.path(shard))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _open_over(self, old: Shard, tmp: Path) -> int:
        """`old`'s file renamed to `tmp` (hidden: no longer a whole snapshot) and opened for
        writing; -1 when it is not there."""
        try:
            os.rename(self.path(old), tmp)
        except FileNotFoundError:
            return -1
        return os.open(tmp, os.O_RDWR | os.O_CLOEXEC)

    def _make(self) -> None:
        if not self._made:
            fs.make_dirs(self.directory)
            self._made = True

    def read(self, shard: Shard) -> bytes:
        return self.path(shard).read_bytes()

    def prune(self, written: list[Shard], keep_steps: int) -> list[Shard]:
        """Remove the files in `written` but those of its `keep_steps` newest steps; those left.
        (A rank prunes what it wrote, its own and the replicas it keeps, without a listing.)"""
        newest = sorted({s.step for s in written}, reverse=True)[:keep_steps]
        for shard in written:
            if shard.step not in newest:
                with contextlib.suppress(FileNotFoundError):
                    self.path(shard).unlink()
        return [s for s in written if s.step in newest]

    def remove(self, ranks: Iterable[int]) -> None:
        """Remove the files of `ranks` (and the directory, once empty): the run is over here."""
        mine = set(ranks)
        for shard in self.shards():
            if shard.rank in mine:
                with contextlib.suppress(FileNotFoundError):
                    self.path(shard).unlink()
        for directory in (self.directory, self.directory.parent):
            with contextlib.suppress(OSError):
                directory.rmdir()

    def drop_partial(self) -> None:
        """Remove the hidden files of writes that were cut short (a killed rank's)."""
        with contextlib.suppress(FileNotFoundError):
            for path in self.directory.glob(".*.tmp-*"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

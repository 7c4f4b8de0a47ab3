"""A node's snapshot store: one directory in the node's memory (or on its own disk) holding the
snapshot files of its ranks and the replicas it keeps for another node.

A file is named after what it holds,
``step-0000000120.rank-00003.of-00004.inc-1a2b3c4d.crc-1a2b3c4d.snap``, so that listing the
directory is the inventory; it is written under a hidden name and renamed into place, so a listed
file is whole. ``inc`` is the incarnation: a token drawn once by the set of processes that took
it, so that shards of two runs at one step never make one set. A part (`flat.make_part`: only
the bytes in which a rank's state differs from its node's lead's) says which rank's full shard of
the same step, world and incarnation it completes: ``...inc-1a2b3c4d.base-00002.crc-...snap``;
its crc is that of the whole state it rebuilds.

Layout, all of it this user's alone (directories 0700, files 0600, whatever the umask)::

    /dev/shm/slurmddp-snapshots-UID/        the root: this user's stores on the node
        .lock                               flock'd by every registration and sweep
        <job>.<restart>.<step>-<scope>/<node>/  a store (`run_key`, `node_name`)
            step-...snap                    shards
            .owner-<ns>-<pid>-<start>-...   one per process that uses the store (`Owner`)

A root, run or node directory found there already is used only when it is a real directory of
this user that no one else may write to, and is then made 0700 (`StoreRefused` otherwise). A
store goes when its run ends (`NodeStore.remove`), when a later restart of its job starts on the
node, or at the next `NodeStore.of_this_node` once every process recorded as its owner is gone;
a Slurm epilog can remove a job's stores too (docs/concepts/snapshots.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from slurmddp import files as fs
from slurmddp.protocol import SNAPSHOT_DIR_VAR

DEFAULT_ROOT = "/dev/shm"
ROOT_PREFIX = "slurmddp-snapshots-"  # and the user's uid
_NAME = re.compile(r"step-(\d{10})\.rank-(\d{5})\.of-(\d{5})\.inc-([0-9a-f]{8})"
                   r"(?:\.base-(\d{5}))?\.crc-([0-9a-f]{8})\.snap")  # fmt: skip
# A run directory: <job>.<restart>.<step>, or <job>.<run> as stores were keyed before. Nothing
# else in the root is a store: the Hugging Face integration's slurmddp-resume-* directories have
# no dot.
_RUN = re.compile(r"[^.]+\.[^.]+(\.[^.]+)?")
# Room a store never takes from its file system: /dev/shm also carries NCCL's intra-node buffers
# and DataLoader workers' batches. The smaller of 1 GiB and a tenth of the file system (or of the
# memory cgroup's limit: the training's own memory grows, and at the limit the job is killed).
RESERVE_BYTES = 1 << 30
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
DIR_MODE = 0o700
FILE_MODE = 0o600
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_MOUNT = Path("/sys/fs/cgroup")
MOUNTS = Path("/proc/self/mounts")
# File systems whose pages are memory, counted against the memory cgroup of whoever wrote them.
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})


class StoreRefused(OSError):
    """A directory of the store is not this user's private one: snapshots are not kept there."""


@dataclass(frozen=True, order=True)
class Shard:
    """One rank's state at one step: which, of how many ranks, taken by which incarnation of the
    processes (a 32-bit token), the crc32 of the state and the file's size in bytes; `base`: the
    rank whose full shard of the same step, world and incarnation this one's file completes (a
    part), or its own rank (-1 when made) for a full shard."""

    step: int
    rank: int
    world: int
    inc: int
    crc: int
    size: int = 0
    base: int = -1

    def __post_init__(self) -> None:
        if self.base < 0:  # one spelling of a full shard, so that equal shards compare equal
            object.__setattr__(self, "base", self.rank)

    @property
    def part(self) -> bool:
        """Whether the file holds only what differs from `base`'s (`flat.make_part`)."""
        return self.base != self.rank

    @property
    def name(self) -> str:
        base = f"base-{self.base:05d}." if self.part else ""
        return (f"step-{self.step:010d}.rank-{self.rank:05d}.of-{self.world:05d}."
                f"inc-{self.inc:08x}.{base}crc-{self.crc:08x}.snap")  # fmt: skip


def parse(name: str, size: int = 0) -> Shard | None:
    """The shard a file name describes, or None for any other file (one named as before
    incarnations included)."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    step, rank, world, inc, base, crc = m.groups()
    if base is not None and int(base) == int(rank):  # not a name this module writes
        return None
    return Shard(int(step), int(rank), int(world), int(inc, 16), int(crc, 16), size,
                 int(base) if base is not None else -1)  # fmt: skip


def node_name(environ: Mapping[str, str]) -> str:
    """This node's name as Slurm knows it (slurmd's), else the host's."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def run_key(environ: Mapping[str, str], scope: str | os.PathLike[str] | None = None
            ) -> tuple[str, str, str]:  # fmt: skip
    """(job, restart, step): what a store is kept for, the same on every rank of the node and
    across the worker restarts of one run (torchrun's), different for any other run. `scope`:
    the directory the snapshots' durable checkpoints go to (`scope_tag`), so that two
    Checkpointers of one run never share a store, and a lone run started again in the same
    directory finds its predecessor's, as it finds its checkpoints.

    - A Slurm job: its id, SLURM_RESTART_COUNT (a requeue starts a new run) and SLURM_STEP_ID
      (two steps of one allocation may run at once; "batch" without one: the batch script, or
      mpirun's ranks on its node).
    - torchrun outside Slurm: its run id (``--rdzv-id``), "0", "torchrun".
    - Otherwise (torchrun's default run id ``none``, mpirun, a lone process): "local", "0" and
      the scope; without one, the pid and start time of the process that outlives the workers
      of the run: the parent (torchrun's agent, mpirun's daemon) where there are several ranks,
      this process alone.

    With a scope, the step part ends in ``-<scope_tag(scope)>``.
    """
    tag = "" if scope is None else f"-{scope_tag(scope)}"
    job = environ.get("SLURM_JOB_ID")
    if job:
        step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "batch"
        return _part(job), _part(environ.get("SLURM_RESTART_COUNT") or "0"), _part(step) + tag
    run = environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return _part(run), "0", "torchrun" + tag
    if tag:
        return "local", "0", tag[1:]
    several = run is not None or environ.get("WORLD_SIZE", "1") != "1"
    pid = os.getppid() if several else os.getpid()
    return "local", "0", f"{pid}-{_start_time(pid) or 0}"


def scope_tag(scope: str | os.PathLike[str]) -> str:
    """12 hex digits naming the directory `scope` (absolute, as every rank gives it)."""
    return hashlib.sha256(os.path.abspath(os.fspath(scope)).encode()).hexdigest()[:12]


def _part(word: str) -> str:
    # No dot: a run directory's name splits into its three parts.
    return re.sub(r"[^A-Za-z0-9_-]", "_", word)[:64] or "_"


def root(environ: Mapping[str, str]) -> Path:
    """Where this user's stores live on the node: $SLURMDDP_SNAPSHOT_DIR, else /dev/shm."""
    base = Path(environ.get(SNAPSHOT_DIR_VAR) or DEFAULT_ROOT)
    return base / f"{ROOT_PREFIX}{os.getuid()}"


def node_directory(environ: Mapping[str, str],
                   scope: str | os.PathLike[str] | None = None) -> Path:  # fmt: skip
    """This node's store of this job's run (for the checkpoints of `scope`: `run_key`)."""
    return root(environ) / ".".join(run_key(environ, scope)) / node_name(environ)


def private_root(environ: Mapping[str, str]) -> Path:
    """`root`, made (0700) or checked as this user's private directory; StoreRefused if not."""
    path = root(environ)
    fs.make_dirs(path.parent)
    _private_dir(path)
    return path


def _private_dir(path: Path) -> None:
    """Make directory `path` (its parent exists) 0700, or accept it when it is already a real
    directory of this user's that no one else may write to (tightened to 0700: an earlier
    version made them 0755, and nothing in them is loaded unless its name and owner are right);
    StoreRefused otherwise."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    st = os.lstat(path)
    wrong = []
    if stat.S_ISLNK(st.st_mode):
        wrong.append("a symbolic link")
    elif not stat.S_ISDIR(st.st_mode):
        wrong.append("not a directory")
    if st.st_uid != os.getuid():
        wrong.append(f"owner uid {st.st_uid}, not {os.getuid()}")
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
        wrong.append(f"mode {stat.S_IMODE(st.st_mode):04o}, writable by others")
    if wrong:
        raise StoreRefused(f"{path} is not a private directory of this user ({', '.join(wrong)}): "
                           "no snapshot is kept there; set $SLURMDDP_SNAPSHOT_DIR to a private "
                           "node-local directory")  # fmt: skip
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)  # the umask took the owner's bits, or others could read


def _start_time(pid: int) -> int | None:
    """Process `pid`'s start time (/proc/PID/stat field 22, ticks since boot); None when it is
    gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces and ')'
        return None if fields[0] == b"Z" else int(fields[19])  # fields 3.. after the name
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> str:
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


class Owner(NamedTuple):
    """A process that uses a store, and its parent (torchrun's agent outlives the workers that
    crash, and the store must outlive them too), as recorded in the store: an empty hidden file
    named after them, in its pid namespace."""

    ns: str
    pid: int
    start: int
    ppid: int
    pstart: int

    @classmethod
    def me(cls) -> Owner:
        ppid = os.getppid()
        # No parent recorded under init (a container's first process, an orphan): init lives on.
        pstart = (_start_time(ppid) or 0) if ppid > 1 else 0
        return cls(_pid_namespace(), os.getpid(), _start_time(os.getpid()) or 0,
                   ppid if pstart else 0, pstart)  # fmt: skip

    @property
    def name(self) -> str:
        return f".owner-{self.ns}-{self.pid}-{self.start}-{self.ppid}-{self.pstart}"

    @classmethod
    def parse(cls, name: str) -> Owner | None:
        m = re.fullmatch(r"\.owner-(\d+)-(\d+)-(\d+)-(\d+)-(\d+)", name)
        if m is None:
            return None
        ns, *numbers = m.groups()
        return cls(ns, *(int(n) for n in numbers))

    def alive(self, ns: str, parent: bool = True) -> bool:
        """Whether the process (or, with `parent`, its parent) still runs, as seen from pid
        namespace `ns`; one recorded in another namespace cannot be told: taken as alive."""
        if self.ns != ns:
            return True
        return _start_time(self.pid) == self.start or (
            parent and self.ppid > 0 and _start_time(self.ppid) == self.pstart)  # fmt: skip


def _owners(directory: Path) -> list[tuple[Path, Owner]]:
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            owner = Owner.parse(entry.name)
            if owner is not None:
                found.append((Path(entry.path), owner))
    return found


def _directories(path: Path) -> list[Path]:
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        return [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    return []


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """This user's stores on the node, to themselves: registrations and sweeps take turns, so
    that a sweep never removes a store between its making and its owner's record."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE)  # fmt: skip
    try:
        os.fchmod(fd, FILE_MODE)  # a umask that took the owner's bits would lock the next one out
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


class Room(NamedTuple):
    """Whether a write fits (`ok`), and the free and total bytes of `where`, what bounds it: the
    store's file system, or the memory cgroup its pages count against."""

    ok: bool
    free: int
    total: int
    where: str


def memory_backed(directory: Path, mounts: Path = MOUNTS) -> bool:
    """Whether `directory`'s file system keeps its files in memory (tmpfs); True when the mounts
    cannot be read."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return True
    path = os.path.realpath(directory)
    best, kind = "", "tmpfs"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # \040: space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind in _MEMORY_FS


def memory_limit(proc_cgroup: Path = PROC_CGROUP,
                 mount: Path = CGROUP_MOUNT) -> tuple[int, int, Path] | None:  # fmt: skip
    """(free, limit, cgroup directory) of the tightest memory.max on this process's cgroup (v2)
    and its ancestors (Slurm limits the job's and the step's, not the task's); None without one.
    Free is memory.max less memory.current."""
    try:
        line = next(ln for ln in proc_cgroup.read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    directory = mount / line[3:].lstrip("/")
    best: tuple[int, int, Path] | None = None
    while True:
        try:
            limit = (directory / "memory.max").read_text().strip()
            current = int((directory / "memory.current").read_text())
            if limit != "max" and (best is None or int(limit) - current < best[0]):
                best = (int(limit) - current, int(limit), directory)
        except (OSError, ValueError):
            pass
        if directory == mount or directory.parent == directory:
            return best
        directory = directory.parent


class NodeStore:
    """The snapshot files of one node, in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made = False
        self._owner: Owner | None = None  # this process's record, once registered

    @classmethod
    def of_this_node(cls, environ: Mapping[str, str] | None = None,
                     scope: str | os.PathLike[str] | None = None) -> NodeStore:  # fmt: skip
        """This node's store of this run, made private and this process recorded as one of its
        owners. Under the root's lock: the stores of the job's earlier restarts are removed
        (their snapshots are older than the checkpoint a requeue resumes from; another step of
        the same restart may be running), and so are this user's stores whose owners are all
        gone. StoreRefused when a directory of it is not this user's private one. `scope`: as
        `run_key` takes it."""
        environ = os.environ if environ is None else environ
        directory = node_directory(environ, scope)
        run = directory.parent
        home = private_root(environ)
        job, restart, _ = run_key(environ)
        earlier = re.compile(rf"{re.escape(job)}\.(\d+)(\.[^.]+)?")
        store = cls(directory)
        with _locked(home):
            for path in _directories(home):
                m = earlier.fullmatch(path.name)
                if m and restart.isdigit() and int(m[1]) < int(restart):
                    shutil.rmtree(path, ignore_errors=True)
            _sweep(home, keep=run.name)
            _private_dir(run)
            _private_dir(directory)
            store._made = True
            store._register()
        return store

    def _register(self) -> None:
        """Record this process as an owner, under the lock; the records of owners gone with
        their parents (a crashed worker's, its agent ended too) go."""
        ns = _pid_namespace()
        for path, owner in _owners(self.directory):
            if not owner.alive(ns):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        me = Owner.me()
        os.close(os.open(self.directory / me.name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC, FILE_MODE))  # fmt: skip
        self._owner = me

    def shards(self) -> list[Shard]:
        """Every whole snapshot file here: regular files of this user's, validly named."""
        found = []
        uid = os.getuid()
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory) as entries:
            for entry in entries:
                shard = parse(entry.name)
                if shard is None:
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                        found.append(replace(shard, size=st.st_size))
        return sorted(found)

    def path(self, shard: Shard) -> Path:
        return self.directory / shard.name

    def room_for(self, size: int, cgroup: tuple[Path, Path] = (PROC_CGROUP, CGROUP_MOUNT),
                 mounts: Path = MOUNTS) -> Room:  # fmt: skip
        """Whether `size` more bytes leave the reserve free on the store's file system and, when
        that keeps its files in memory, within the memory cgroup's limit: a tmpfs file's pages
        count against the cgroup of the process that wrote them. The tighter of the two."""
        self._make()
        usage = shutil.disk_usage(self.directory)
        room = Room(True, usage.free, usage.total, str(self.directory))
        spare = usage.free - min(RESERVE_BYTES, usage.total // 10)
        limit = memory_limit(*cgroup) if memory_backed(self.directory, mounts) else None
        if limit is not None:
            free, total, where = limit
            if free - min(RESERVE_BYTES, total // 10) < spare:
                room = Room(True, max(free, 0), total, f"the memory cgroup {where}")
                spare = free - min(RESERVE_BYTES, total // 10)
        return room._replace(ok=spare >= size)

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
            with _viewed(mmap.mmap(fd, shard.size, flags=mmap.MAP_SHARED | _POPULATE)) as view:
                yield view

    @contextlib.contextmanager
    def _writing(self, shard: Shard, reuse: Shard | None) -> Iterator[int]:
        """A descriptor of a hidden file of `shard.size` bytes (`reuse`'s, renamed, when it is
        there), renamed to `shard`'s name when the block ends, removed if it raises."""
        self._make()
        tmp = self.directory / f".{shard.name}.tmp-{secrets.token_hex(4)}"
        try:
            fd = self._open_over(reuse, tmp) if reuse is not None else -1
            if fd < 0:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
                os.fchmod(fd, FILE_MODE)  # the umask took the owner's bits
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
        return os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _make(self) -> None:
        """Make the store's directory private; in a root of stores, the root and the run's too:
        a root another user made could have the run directory swapped for a link."""
        if self._made:
            return
        run = self.directory.parent
        levels = [self.directory]
        if run.parent.name.startswith(ROOT_PREFIX):
            levels = [run.parent, run, self.directory]
        fs.make_dirs(levels[0].parent)
        for level in levels:
            _private_dir(level)
        self._made = True

    @contextlib.contextmanager
    def mapped(self, shard: Shard) -> Iterator[memoryview]:
        """`shard`'s file, mapped copy-on-write: read in place, without a copy of its size (it is
        in memory already), writable as torch.frombuffer wants, never written back. OSError
        when it is gone, or not `shard.size` bytes long. Release every export of the view
        first."""
        fd = os.open(self.path(shard), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size != shard.size or not size:  # mmap refuses a length of 0
                raise OSError(f"{self.path(shard)} holds {size} bytes, not {shard.size}")
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        with _viewed(mapped) as view:
            yield view

    def prune(self, ranks: Iterable[int], keep: int, inc: int) -> list[Shard]:
        """Keep the files of `ranks` of their `keep` newest steps, one a step (incarnation `inc`'s
        where there are several, else the newest incarnation's); remove the rest of theirs, those
        a restarted worker's predecessor left too. The shards of `ranks` kept.

        Parts and their bases follow one rule: a part is a rank's shard of a step like any
        other, and its base is the shard of the same snapshot of a lower rank of its node, which
        that snapshot needs anyway (a world resumes with the ranks below any it keeps). A base
        pruned under a kept part is of a step its own rank has `keep` newer ones of: a snapshot
        that lacks that rank, whole or not."""
        mine = set(ranks)
        best: dict[tuple[int, int], Shard] = {}
        held = [s for s in self.shards() if s.rank in mine]
        for shard in sorted(held, key=lambda s: (s.inc == inc, s.inc, s)):  # the preferred last
            best[shard.rank, shard.step] = shard
        kept = []
        for rank in mine:
            steps = sorted((step for r, step in best if r == rank), reverse=True)[:keep]
            kept += [best[rank, step] for step in steps]
        for shard in set(held) - set(kept):
            with contextlib.suppress(FileNotFoundError):
                self.path(shard).unlink()
        return sorted(kept)

    def remove(self, ranks: Iterable[int]) -> None:
        """The run is over here: remove the files of `ranks`, this process's owner record and
        those of owners gone (crashed workers), and the directory once empty."""
        mine = set(ranks)
        for shard in self.shards():
            if shard.rank in mine:
                with contextlib.suppress(FileNotFoundError):
                    self.path(shard).unlink()
        if self._owner is None:
            _remove_empty(self.directory)
            return
        with _locked(self.root):
            ns = _pid_namespace()
            for path, owner in _owners(self.directory):
                if owner == self._owner or not owner.alive(ns, parent=False):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            self._owner = None
            _remove_empty(self.directory)

    def drop_partial(self) -> None:
        """Remove the hidden files of writes that were cut short (a killed rank's)."""
        with contextlib.suppress(FileNotFoundError):
            for path in self.directory.glob(".*.tmp-*"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


@contextlib.contextmanager
def _viewed(mapped: mmap.mmap) -> Iterator[memoryview]:
    """A view of `mapped`; after the block, released and the mapping closed. A failed receive's
    or load's traceback may still hold a tensor over the view: then the mapping closes when that
    goes, and the error stays the receive's or the load's."""
    view = memoryview(mapped)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):
            view.release()
            mapped.close()


def _remove_empty(directory: Path) -> None:
    for path in (directory, directory.parent):
        with contextlib.suppress(OSError):
            path.rmdir()


def _sweep(root: Path, keep: str) -> None:
    """Remove this user's stores in `root` whose recorded owners are all gone, and those with no
    record (a crash between a store's making and its record, or kept as before records), but
    run directory `keep`'s: this run's other nodes, where nodes share a host. Under the lock."""
    ns = _pid_namespace()
    for run in _directories(root):
        if run.name == keep or not _RUN.fullmatch(run.name):
            continue
        for node in _directories(run):
            if not any(owner.alive(ns) for _, owner in _owners(node)):
                shutil.rmtree(node, ignore_errors=True)
        with contextlib.suppress(OSError):
            run.rmdir()

"""The code a job runs: a snapshot of it taken by ``slurmddp submit``, before the job is queued.

Without one, a pending or requeued job runs whatever the files are when it starts: an edit made
after submitting changes a run half-way through the job, and breaks a bitwise resume. So `take`
copies the code to ``<output dir>/snapshots/<digest>/`` and the batch script runs the script's copy
there; the job's working directory stays the user's (data, checkpoints and outputs are found where
they were), and the runner imports ``-m`` targets from the copy first (`protocol.CODE_DIR_VAR`).

What is copied, the *root*: the git work tree that holds the script (for ``-m``: the working
directory), its tracked files as they are in the work tree and its untracked files that .gitignore
does not exclude; outside git, the script's directory (``-m``: the working directory), all of it.
Never copied: the job output directory, directories tagged as caches (CACHEDIR.TAG, as every
``snapshots`` directory is), virtual environments, checkpoint directories (a `Checkpointer`'s: its
``latest`` pointer names a checkpoint beside it that has a manifest), ``__pycache__``. Symbolic
links stay links: one to something copied points at its copy, any other where it did (absolute),
so nothing outside the tree, or left out of it, is copied.
Files keep their execute bits and are made read-only: a snapshot is shared by every job of the
same code (it is named by its content), so it must not change.

The snapshot appears whole or not at all (written under a temporary name, then renamed) and is
never world-writable; it is bounded (`JobSpec.snapshot_max_mib`, `snapshot_max_files`): a larger
one is refused with one line naming its largest entries and saying what to do, before
anything is queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

from slurmddp import files
from slurmddp.batch.spec.jobspec import JobSpec
from slurmddp.errors import SnapshotError, warn
from slurmddp.protocol import CHECKPOINT_MANIFEST, CHECKPOINT_POINTER

SNAPSHOTS = "snapshots"  # <output dir>/snapshots/<digest>/
DIGEST_CHARS = 16  # of the sha256: enough to never meet two snapshots of different code
# https://bford.info/cachedir/: backup tools (and our own snapshots) skip such directories.
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = (
    f"{CACHEDIR_SIGNATURE}\n# slurmddp's code snapshots: each a copy of a job's code, kept for its "
    "requeues; remove one when no job of it is pending or running.\n"
)
_SKIPPED_DIRS = frozenset({"__pycache__", ".git"})
_MIB = 1024 * 1024
_NAMED = 3  # the largest entries a refusal over the bounds names
_CHUNK = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file or symbolic link of a snapshot, by its path relative to the root."""

    rel: str
    executable: bool = False
    link: str | None = None  # a link's target as the snapshot writes it


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a snapshot of `root` holds; `base` is the directory whose copy goes first on
    sys.path (the script's, or the working directory for ``-m``)."""

    root: Path
    base: Path
    script: str | None  # relative to the root; None for -m
    entries: tuple[Entry, ...]
    size: int  # bytes of the regular files


@dataclasses.dataclass(frozen=True)
class Taken:
    """A snapshot written for a job: the spec that runs it, and what to remove if the job is
    never submitted (deepest first; empty when an identical snapshot was reused)."""

    spec: JobSpec
    created: tuple[Path, ...]

    def discard(self) -> None:
        """Remove what `take` created (the job was not submitted)."""
        for path in self.created:
            with contextlib.suppress(OSError):
                if path.name == SNAPSHOTS:  # ours only if nothing else has come to live there
                    (path / CACHEDIR_TAG).unlink()
                    path.rmdir()
                else:
                    shutil.rmtree(path)


# --- what to copy -------------------------------------------------------------------------------


def plan(spec: JobSpec, cwd: str | os.PathLike[str] | None = None,
         code_from: str | os.PathLike[str] | None = None) -> Plan | None:
    """The snapshot `spec` asks for (None: a ``-m`` module not under the working directory, so
    installed, with nothing here to copy). `code_from`: the directory the code is imported from when
    the target is not the code (a Python function's job: `slurmddp.batch.functions.executor`).
    Raises `SnapshotError` when it is over the bounds."""
    # Real paths throughout, as git names its work tree, so that one is always inside the other.
    here = Path(os.path.realpath(cwd or os.getcwd()))
    if code_from is not None:
        base, script = Path(os.path.realpath(code_from)), None
    elif spec.target[0] == "-m":
        top = spec.target[1].split(".")[0]
        if not ((here / top).is_dir() or (here / f"{top}.py").is_file()):
            return None
        base, script = here, None
    else:
        given = Path(os.path.abspath(os.path.join(here, spec.target[0])))
        base = Path(os.path.realpath(given.parent))
        script = base / given.name
    top_level = _git_top_level(base)
    root = top_level or base
    entries: dict[str, Entry] = {}
    size = 0
    tops: dict[str, list[int]] = {}  # each top-level entry ("dir/" or file): [files, bytes]
    for rel, st in _candidates(root, top_level is not None, Path(spec.output_dir)):
        entry = _entry(root, rel, st)
        if entry is None:
            continue
        entries[rel] = entry
        size += st.st_size if entry.link is None else 0
        first, sep, _ = rel.partition("/")
        counted = tops.setdefault(first + sep, [0, 0])
        counted[0] += 1
        counted[1] += st.st_size if entry.link is None else 0
        _check_bounds(spec, root, top_level is not None, len(entries), size, tops)
    _point_links_at_what_is_copied(root, entries)
    script_rel = None
    if script is not None:  # even when ignored or untracked: the job cannot run without it
        script_rel = script.relative_to(root).as_posix()
        if script_rel not in entries:
            try:
                st = os.lstat(script)
            except OSError as e:
                raise SnapshotError(f"cannot snapshot the script {str(script)!r}: {e.strerror}; "
                                    "give the path of a Python file") from None  # fmt: skip
            entry = _entry(root, script_rel, st)
            if entry is not None:
                entries[script_rel] = entry
                size += st.st_size
    return Plan(root, base, script_rel, tuple(entries[k] for k in sorted(entries)), size)


def _point_links_at_what_is_copied(root: Path, entries: dict[str, Entry]) -> None:
    """A link into the tree, at something left out (ignored data, say): made to point where it
    did, as a link out of the tree is, rather than at nothing in the snapshot."""
    copied = {""}
    for rel in entries:
        parts = rel.split("/")
        copied.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for rel, entry in entries.items():
        if entry.link is not None and not os.path.isabs(entry.link):
            inside = os.path.normpath(os.path.join(os.path.dirname(rel), entry.link))
            if ("" if inside == "." else inside) not in copied:
                entries[rel] = Entry(rel, link=os.path.join(root, inside))


def _git_top_level(directory: Path) -> Path | None:
    """The work tree of the git checkout holding `directory`, if git knows one."""
    try:
        r = subprocess.run(["git", "-C", str(directory), "rev-parse", "--show-toplevel"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    top = r.stdout.strip()
    return Path(os.path.realpath(top)) if r.returncode == 0 and top else None


def _candidates(root: Path, git: bool, output_dir: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every file or link that may go in, listed as it is found."""
    excluded = {os.path.realpath(output_dir)}
    tagged: dict[str, bool] = {}

    def skipped(rel_dir: str) -> bool:
        # Whether a directory of the tree (relative, "" for the root) is one never copied.
        if rel_dir in tagged:
            return tagged[rel_dir]
        parent, _, name = rel_dir.rpartition("/")
        full = root / rel_dir
        value = bool(rel_dir) and (
            skipped(parent)
            or name in _SKIPPED_DIRS
            or os.path.realpath(full) in excluded
            or _is_cache(full)
            or _is_environment(full)
            or _holds_checkpoints(full)
        )
        tagged[rel_dir] = value
        return value

    if git:
        # Tracked files as the work tree has them, and untracked ones .gitignore lets through.
        argv = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                "--exclude-standard"]  # fmt: skip
        listed = subprocess.run(argv, capture_output=True, timeout=600)
        if listed.returncode != 0:
            why = listed.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise SnapshotError(f"git cannot list the files of {str(root)!r} to snapshot them "
                                f"({why[0]}): fix that, or submit with --no-snapshot")  # fmt: skip
        seen = set()
        for raw in listed.stdout.split(b"\0"):
            rel = os.fsdecode(raw)
            if not rel or rel in seen or skipped(rel.rpartition("/")[0]):
                continue
            seen.add(rel)
            try:
                yield rel, os.lstat(root / rel)
            except FileNotFoundError:  # tracked, deleted in the work tree: not in the code now
                continue
        return
    for directory, dirnames, filenames in os.walk(root, onerror=_unreadable):
        rel_dir = Path(os.path.relpath(directory, root)).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        for name in sorted(dirnames):
            rel = f"{rel_dir}/{name}".lstrip("/")
            if os.path.islink(os.path.join(directory, name)):
                dirnames.remove(name)  # not followed: the link itself is copied
                yield rel, os.lstat(os.path.join(directory, name))
            elif skipped(rel):
                dirnames.remove(name)
        dirnames.sort()
        for name in sorted(filenames):
            yield f"{rel_dir}/{name}".lstrip("/"), os.lstat(os.path.join(directory, name))


def _unreadable(e: OSError) -> None:
    raise SnapshotError(f"cannot read {e.filename!r} to snapshot the code ({e.strerror}): make it "
                        "readable, or submit with --no-snapshot")  # fmt: skip


def _is_environment(directory: Path) -> bool:
    # A virtual environment or a conda one: installed packages, not the project's code (and
    # often in the project's directory, ignored or not).
    return (directory / "pyvenv.cfg").is_file() or (directory / "conda-meta").is_dir()


def _holds_checkpoints(directory: Path) -> bool:
    # A Checkpointer's directory (slurmddp.checkpoint.layout): training state, often large, that
    # a job's code must not carry into the next job.
    try:
        with open(directory / CHECKPOINT_POINTER, "rb") as f:
            name = os.fsdecode(f.read(256).strip())
    except OSError:
        return False
    return bool(name) and "/" not in name and name not in (".", "..") \
        and (directory / name / CHECKPOINT_MANIFEST).is_file()  # fmt: skip


def _is_cache(directory: Path) -> bool:
    try:
        with open(directory / CACHEDIR_TAG, "rb") as f:
            return f.read(len(CACHEDIR_SIGNATURE)) == CACHEDIR_SIGNATURE.encode()
    except OSError:
        return False


def _entry(root: Path, rel: str, st: os.stat_result) -> Entry | None:
    """How `rel` goes in: a regular file, or a link made to point as it should from the
    snapshot; None for what is neither (a directory such as a git submodule, a socket)."""
    if stat.S_ISREG(st.st_mode):
        return Entry(rel, executable=bool(st.st_mode & stat.S_IXUSR))
    if not stat.S_ISLNK(st.st_mode):
        return None
    real_root = os.path.realpath(root)
    target = os.path.realpath(root / rel)
    if target == real_root or target.startswith(real_root + os.sep):
        # Into the tree: relative, so that it points into the snapshot.
        inside = os.path.relpath(target, real_root)
        return Entry(rel, link=os.path.relpath(inside, os.path.dirname(rel) or "."))
    return Entry(rel, link=target)  # out of the tree: not followed, it points where it did


def _check_bounds(spec: JobSpec, root: Path, git: bool, count: int, size: int,
                  tops: dict[str, list[int]]) -> None:  # fmt: skip
    """Refuse a snapshot over its bounds, naming its largest top-level entries (`tops`: each
    one's files and bytes, as far as listed)."""
    if count > spec.snapshot_max_files:
        over, option = f"hold more than {spec.snapshot_max_files} files", "--snapshot-max-files"
        largest = sorted(tops.items(), key=lambda kv: (-kv[1][0], kv[0]))[:_NAMED]
        named = ", ".join(f"{name} {files} file{'s' * (files > 1)}"
                          for name, (files, _) in largest)  # fmt: skip
    elif size > spec.snapshot_max_mib * _MIB:
        over, option = f"be larger than {spec.snapshot_max_mib} MiB", "--snapshot-max-mib"
        largest = sorted(tops.items(), key=lambda kv: (-kv[1][1], kv[0]))[:_NAMED]
        named = ", ".join(f"{name} {_size(size)}" for name, (_, size) in largest)
    else:
        return
    keep_out = ("list what is not code in its .gitignore" if git else
                "move what is not code (data, environments) out of it")  # fmt: skip
    raise SnapshotError(f"the snapshot of the code in {str(root)!r} would {over} (the largest: "
                        f"{named}): {keep_out}, raise {option}, or submit with --no-snapshot"
                        )  # fmt: skip


def _size(n: int) -> str:
    return f"{n / _MIB:.1f} MiB" if n >= _MIB else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


# --- its name and its copy ----------------------------------------------------------------------


def _mode(entry: Entry) -> int:
    # Read-only: the snapshot is shared by every job of the same code (see the module docstring).
    return 0o555 if entry.executable else 0o444


def _digest_entry(h: hashlib._Hash, entry: Entry, content: bytes | None) -> None:
    name = os.fsencode(entry.rel)
    if entry.link is not None:
        h.update(b"L" + name + b"\0" + os.fsencode(entry.link) + b"\0")
    else:
        assert content is not None
        h.update(b"F" + name + b"\0" + (b"x" if entry.executable else b"-") + content)


def preview(spec: JobSpec, cwd: str | os.PathLike[str] | None = None) -> JobSpec:
    """`spec` as `take` would make it, writing nothing (``--dry-run``): the same digest, so the
    same path, as long as the code does not change in between."""
    p = plan(spec, cwd)
    if p is None:
        return spec
    h = hashlib.sha256()
    for entry in p.entries:
        _digest_entry(h, entry, None if entry.link else _file_digest(p.root / entry.rel))
    return _running(spec, p, Path(spec.output_dir) / SNAPSHOTS / h.hexdigest()[:DIGEST_CHARS])


def take(spec: JobSpec, cwd: str | os.PathLike[str] | None = None,
         code_from: str | os.PathLike[str] | None = None) -> Taken:
    """Snapshot the code of `spec` (or of `code_from`: see `plan`) into its output directory (which
    must exist); the spec that runs the snapshot. Raises `SnapshotError` (over the bounds,
    unreadable: nothing is left)."""
    p = plan(spec, cwd, code_from)
    if p is None:
        warn(f"-m {spec.target[1]} is not under the working directory, so no snapshot of it "
             "is taken: each run imports it as it is then")  # fmt: skip
        return Taken(spec, ())
    snapshots = Path(spec.output_dir) / SNAPSHOTS
    created = files.make_dirs(snapshots)
    if created or not (snapshots / CACHEDIR_TAG).exists():
        with contextlib.suppress(FileExistsError):  # another submission wrote it meanwhile
            files.write_new(snapshots / CACHEDIR_TAG, _TAG_TEXT.encode())
    tmp = snapshots / f".tmp-{secrets.token_hex(8)}"
    os.mkdir(tmp, files.DIR_MODE)
    try:
        digest = _copy(p, tmp)
        final = snapshots / digest
        try:
            os.rename(tmp, final)
            created.insert(0, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp)  # the same code was snapshotted before: that copy is used
        files.fsync_dir(snapshots)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        Taken(spec, tuple(created)).discard()
        raise
    return Taken(_running(spec, p, final), tuple(created))


def _copy(p: Plan, dest: Path) -> str:
    """Copy the planned entries under `dest`; the digest of what was written (so that a file
    changing during the copy cannot give a snapshot a name its content does not have)."""
    h = hashlib.sha256()
    made = {dest}
    mask = files.umask()  # a stricter umask is the user's to keep, as for every file we write
    for entry in p.entries:
        target = dest / entry.rel
        if target.parent not in made:
            files.make_dirs(target.parent)
            made.update(target.parents)
        if entry.link is not None:
            os.symlink(entry.link, target)
            _digest_entry(h, entry, None)
            continue
        content = hashlib.sha256()
        try:
            with open(p.root / entry.rel, "rb") as src, open(target, "xb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    content.update(chunk)
        except OSError as e:
            raise SnapshotError(
                f"cannot copy {str(p.root / entry.rel)!r} into the code snapshot "
                f"({e.strerror}): fix that, or submit with --no-snapshot"
            ) from None
        os.chmod(target, _mode(entry) & ~mask)
        _digest_entry(h, entry, content.digest())
    # Written files are durable once the job runs (which is later, on other nodes): the rename
    # alone makes the snapshot appear whole; syncing every file would cost a round trip each on
    # the shared file systems output directories live on.
    return h.hexdigest()[:DIGEST_CHARS]


def _file_digest(path: Path) -> bytes:
    content = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                content.update(chunk)
    except OSError as e:
        raise SnapshotError(
            f"cannot read {str(path)!r} to snapshot the code ({e.strerror}): make "
            "it readable, or submit with --no-snapshot"
        ) from None
    return content.digest()


def _running(spec: JobSpec, p: Plan, snapshot: Path) -> JobSpec:
    """`spec` running from `snapshot`: the script's copy as target, the base's copy as code_dir."""
    target = spec.target
    if p.script is not None:
        target = (str(snapshot / p.script), *target[1:])
    code_dir = os.path.normpath(snapshot / p.base.relative_to(p.root))
    return dataclasses.replace(spec, target=target, code_dir=code_dir)

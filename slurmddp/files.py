"""Files that other processes and later runs rely on: never world-writable, durable, atomic.

Created entries never get the world-write bit, whatever the umask (the kernel applies the umask
on top, so a stricter user setting is kept). A file that must survive a crash is written to a
hidden neighbour, fsynced, renamed over its name, and the rename made durable in its directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

DIR_MODE = 0o775
FILE_MODE = 0o664


def umask() -> int:
    """This process's umask (read without changing it for long)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems cannot sync dirs
            raise
    finally:
        os.close(fd)


def make_dirs(directory: Path, *, durable: bool = False) -> list[Path]:
    """mkdir -p with `DIR_MODE` for every level created; the levels created, deepest first.

    `durable`: each level created is fsynced in its parent. Raises OSError as os.mkdir does.
    """
    missing = []
    path = directory
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # created meanwhile
            os.mkdir(path, DIR_MODE)
        if durable:
            fsync_dir(path.parent)
    return missing


def write_new(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) with `data`, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` so that a reader sees the old content or the new, never part."""
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    try:
        write_new(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)

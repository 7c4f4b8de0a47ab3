"""The checkpoint directory: step-N directories, the `latest` pointer, publishing and pruning.

Only the writer (rank 0, or the one process) changes it; every change keeps `latest` naming a
complete checkpoint, whenever the writer is killed (see the package docstring).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from slurmddp import files as fs
from slurmddp.checkpoint.background import Background
from slurmddp.errors import CheckpointError, one_line, warn
from slurmddp.protocol import CHECKPOINT_POINTER

POINTER = CHECKPOINT_POINTER
# How long the last save took, from its start to its publication (the stop protocol's deadline).
SAVE_TIME = "save-time.json"
_STEP_DIR = re.compile(r"step-(\d{8,})")
_PREV_DIR = re.compile(r"\.prev-step-(\d{8,})-[0-9a-f]+")
# Hidden names a crashed writer can leave behind; all are removed once a newer save is published.
_STALE_PREFIXES = (".tmp-", ".prev-", ".trash-", f".{POINTER}.tmp-", f".{SAVE_TIME}.tmp-")


def step_name(step: int) -> str:
    """The directory name of checkpoint `step`."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint directory's name says, or None for any other name."""
    match = _STEP_DIR.fullmatch(name) or _PREV_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def _step_key(name: str) -> int:
    return step_of(name) or 0


def read_pointer(directory: Path) -> str | None:
    """The checkpoint name in `latest`, or None if it is absent or not a plain name."""
    try:
        name = (directory / POINTER).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    if not name or "/" in name or name in (".", "..") or "\n" in name or "\0" in name:
        return None
    return name


def read_save_time(directory: Path) -> float | None:
    """The seconds the last save took, as kept beside the checkpoints; None if unknown."""
    try:
        seconds = json.loads((directory / SAVE_TIME).read_text())["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(seconds) if isinstance(seconds, int | float) and seconds >= 0 else None


def write_save_time(directory: Path, step: int, seconds: float) -> None:
    fs.write_atomically(directory / SAVE_TIME, json.dumps({"step": step, "seconds": seconds}))


def write_pointer(directory: Path, name: str) -> None:
    """Point `latest` at `name`, atomically and durably."""
    fs.write_atomically(directory / POINTER, f"{name}\n")


def load_order(directory: Path, names: list[str]) -> list[tuple[Path, str | None]]:
    """The checkpoints of `directory` (whose entries are `names`) to try, in order, each with
    what is already known to be wrong with it: the one `latest` names, then every step-* by step,
    newest first. A damaged pointer comes first, with its problem, so that it is reported."""
    steps = sorted((n for n in names if _STEP_DIR.fullmatch(n)), key=_step_key, reverse=True)
    order: list[tuple[Path, str | None]] = []
    pointer = directory / POINTER
    if POINTER in names:
        target = read_pointer(directory)
        if target is None:
            order.append((pointer, "unreadable (it does not name a checkpoint)"))
        elif not (directory / target).is_dir():
            order.append((directory / target, f"missing (named by {pointer})"))
        else:
            order.append((directory / target, None))
            steps = [n for n in steps if n != target]
    elif steps:
        order.append((pointer, "missing"))
    return order + [(directory / n, None) for n in steps]


class Directory:
    """A checkpoint directory as its writer changes it, keeping the newest `keep` checkpoints.

    Old checkpoints are removed in a background thread once the new one is published (freeing a
    large one takes ~0.5 s per GiB on ext4, which the caller need not wait for); the next
    `make_tmp` waits for that, so the space is back before anything is written.
    """

    def __init__(self, path: Path, keep: int) -> None:
        self.path = path
        self.keep = keep
        self._cleanup: Background[None] | None = None

    def make_tmp(self, step: int) -> Path:
        """A new hidden directory to write checkpoint `step` into (parents created)."""
        self.join_cleanup()
        try:
            fs.make_dirs(self.path, durable=True)
            tmp = self.path / f".tmp-step-{step}-{secrets.token_hex(8)}"
            os.mkdir(tmp, fs.DIR_MODE)
        except OSError as e:
            raise self.save_error(step, e) from e
        return tmp

    def publish(self, tmp: Path, step: int) -> None:
        """Make the complete `tmp` checkpoint `step`, the latest; then prune."""
        try:
            name, doomed = publish(self.path, tmp, step)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self.save_error(step, e) from e
        doomed += prune(self.path, self.keep, name, step)
        if doomed:
            self._cleanup = Background(remove_all, doomed, name="slurmddp-checkpoint-cleanup")

    def join_cleanup(self) -> None:
        """Wait until the checkpoints the last publish replaced are removed."""
        if self._cleanup is not None:
            self._cleanup.wait()
            self._cleanup = None

    def save_error(self, step: int, e: BaseException) -> CheckpointError:
        """The one-line error of a save of `step` that failed with `e`."""
        return CheckpointError(
            f"cannot save checkpoint step {step} in {self.path}: {one_line(e)}; the previous "
            "checkpoint stays the latest: check free space, quota and permissions there"
        )


def publish(directory: Path, tmp: Path, step: int) -> tuple[str, list[Path]]:
    """Rename the finished `tmp` to step-<step> and point `latest` at it.

    Returns the new name and the hidden directories left to remove.

    Saving a step that already exists (again after a resume) keeps `latest` on a complete copy
    throughout: the old files are hard-linked (copied where links fail) into a hidden directory,
    `latest` names that, the old directory moves aside, the new one takes its name, and `latest`
    comes back to it.
    """
    final = directory / step_name(step)
    aside: list[Path] = []
    if os.path.lexists(final):
        if read_pointer(directory) == final.name:
            prev = directory / f".prev-{final.name}-{secrets.token_hex(8)}"
            _link_copy(final, prev)
            write_pointer(directory, prev.name)
            aside.append(prev)
        trash = directory / f".trash-{final.name}-{secrets.token_hex(8)}"
        os.rename(final, trash)
        aside.append(trash)
    os.rename(tmp, final)
    fs.fsync_dir(directory)
    write_pointer(directory, final.name)
    return final.name, aside


def _link_copy(source: Path, target: Path) -> None:
    os.mkdir(target, fs.DIR_MODE)
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
    fs.fsync_dir(target)
    fs.fsync_dir(target.parent)


def prune(directory: Path, keep: int, current: str, step: int) -> list[Path]:
    """After `current` (of `step`) is published: older checkpoints beyond `keep`, and what crashed
    writers left, to remove. Steps above `step` (a save that crashed before its pointer moved, or
    a run abandoned after a fallback) are left alone: saving that step again replaces them.

    Checkpoints to drop are renamed to hidden names here, so that an interrupted removal never
    leaves a half checkpoint behind; the caller removes the returned paths.
    """
    try:
        names = os.listdir(directory)
    except OSError as e:
        warn(f"could not list {directory} to remove old checkpoints: {one_line(e)}")
        return []
    older = sorted((n for n in names if _STEP_DIR.fullmatch(n) and _step_key(n) <= step
                    and n != current), key=_step_key, reverse=True)  # fmt: skip
    doomed = [directory / n for n in names if n.startswith(_STALE_PREFIXES) and n != current]
    for name in older[keep - 1 :]:
        trash = directory / f".trash-{name}-{secrets.token_hex(8)}"
        try:
            os.rename(directory / name, trash)
        except OSError as e:
            warn(f"could not remove old checkpoint {directory / name}: {one_line(e)}")
        else:
            doomed.append(trash)
    return doomed


def remove_all(paths: list[Path]) -> None:
    """Remove each of `paths` (directories with their content), warning about failures."""
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            warn(f"could not remove old checkpoint {path}: {one_line(e)}")

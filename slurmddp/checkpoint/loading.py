"""Finding and loading the newest valid checkpoint, falling back past damaged ones.

With a process group, rank 0 chooses (verifying, and for replicated checkpoints loading) and
tells the others its outcome and the name; every rank then loads that one, so no rank resumes
from another step than the others. Errors travel as an outcome code, never as a text.

A load takes the checkpoints of the runs it is given (`Runs`: the Checkpointer gives this run's
id, so that a new job never continues another's training unasked) and passes over the others.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from slurmddp import dist
from slurmddp.checkpoint import dcp as safe_dcp
from slurmddp.checkpoint import layout, manifest, ranks
from slurmddp.checkpoint import state as states
from slurmddp.checkpoint.background import Background
from slurmddp.checkpoint.manifest import Manifest, run_id_of
from slurmddp.checkpoint.ranks import Outcome
from slurmddp.errors import CheckpointError, one_line, warn

T = TypeVar("T")
# Try a verified checkpoint: (what it gives, None), or (None, why it is unusable).
Attempt = Callable[[Path, Manifest | None], tuple[T | None, str | None]]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its step, its state, the directory it came from and the id of the
    run that saved it (None when its manifest records none: `slurmddp.run_id`)."""

    step: int
    state: dict
    path: Path
    run_id: str | None = None


@dataclasses.dataclass
class Runs:
    """Whose checkpoints a load takes: those whose manifest records one of `accept` (None among
    them: a manifest recording no run), or any when `accept` is None; `only`: that checkpoint's
    name alone. After the load, `passed` is the newest checkpoint of another run it passed over
    (path, run, step), on the rank that chose (rank 0)."""

    accept: tuple[str | None, ...] | None = None
    only: str | None = None
    passed: tuple[Path, str | None, int] | None = None

    def takes(self, path: Path, found: Manifest | None) -> bool:
        """Whether the checkpoint at `path` (its manifest `found`) is one to load; notes it when
        not. A manifest that does not parse says no run: judged by what is wrong with it."""
        if self.accept is None or found is None or run_id_of(found) in self.accept:
            return True
        if self.passed is None:
            step = found.get("step")
            self.passed = (path, run_id_of(found),
                           step if isinstance(step, int) else layout.step_of(path.name) or 0)
        return False


def first_valid(directory: Path, attempt: Attempt[T], *, verify: bool, sharded: bool,
                hashes: bool = True, runs: Runs | None = None) -> T | None:  # fmt: skip
    """What `attempt` gives for the newest checkpoint of `runs` (default: any) that verifies and
    that it accepts; None when there is no such checkpoint at all.

    Tries them in `layout.load_order`, printing why each one was skipped (those of other runs in
    silence: `Runs.passed`); raises CheckpointError when some exist but none is usable.
    """
    runs = runs or Runs()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint directory {directory}: "
                              f"{e.strerror or one_line(e)}; give Checkpointer a directory "
                              "this job may read (it is created by the first save)"
                              ) from e  # fmt: skip
    if runs.only is not None:
        order: list[tuple[Path, str | None]] = [(directory / runs.only, None)]
    else:
        order = layout.load_order(directory, names)
    failed: list[tuple[Path, str]] = []  # the unusable ones, in order
    checked = False  # whether one of them was a checkpoint read, not a pointer's problem
    for path, problem in order:
        found = None
        if problem is None:
            found, problem = manifest.verify(path, verify, sharded=sharded, hashes=hashes)
            if not runs.takes(path, found):
                continue
            checked = True
        if failed:  # said only now, when the next one to try is known
            _fell_back(*failed[-1], path)
        if problem is None:
            result, problem = attempt(path, found)
            if problem is None:
                return result
        failed.append((path, problem))
    if failed and (checked or runs.passed is None):
        path, problem = failed[-1]
        newer = len(failed) - 1
        raise CheckpointError(
            f"no valid checkpoint in {directory}: {path} is {problem}"
            + (f", and the {newer} newer one(s) are unusable too" if newer else "")
            + "; repair or remove them to start from scratch"
        )
    if failed:  # only the pointer was wrong, and the checkpoints are other runs'
        warn(f"{_what(failed[-1][0])} {failed[-1][0]} is {failed[-1][1]}")
    return None


def _fell_back(path: Path, problem: str, to: Path) -> None:
    warn(f"{_what(path)} {path} is {problem}; falling back to {to}")


def _what(path: Path) -> str:
    return "checkpoint pointer" if path.name == layout.POINTER else "checkpoint"


def newest_step(directory: Path, runs: Runs) -> int | None:
    """The step of the newest checkpoint of `runs` in `directory` by its manifest, unverified
    (what a snapshot must be newer than); None without one."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    for path, problem in layout.load_order(directory, names):
        if problem is None:
            found, _ = manifest.verify(path, False, sharded=False)
            if found is not None and runs.takes(path, found):
                return manifest.step_of(path, found)
    return None


def load_replicated(directory: Path, *, verify: bool, into: dict | None, map_location: Any,
                    runs: Runs | None = None) -> Checkpoint | None:  # fmt: skip
    """The newest valid replicated checkpoint (of `runs`: `first_valid`), the same on every
    rank; None on a fresh start."""

    def attempt(path: Path, found: Manifest | None) -> tuple[Checkpoint | None, str | None]:
        # Hashing and loading read the same file: side by side they take the time of one.
        # A file that does not hash is rejected, whatever its load did.
        checker = None
        if verify and found is not None:
            checker = Background(manifest.hash_problem, path, found)
        try:
            state, problem = states.load_state(path / manifest.STATE_FILE, map_location)
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
        return Checkpoint(step=manifest.step_of(path, found), state=state, path=path,
                          run_id=manifest.run_id_of(found)), None  # fmt: skip

    if dist.group() is None:
        return first_valid(directory, attempt, verify=verify, sharded=False, hashes=False,
                           runs=runs)  # fmt: skip
    chosen, error = _choose(directory, attempt, verify=verify, sharded=False, hashes=False,
                            runs=runs)  # fmt: skip
    outcome, name = ranks.broadcast(*_told(chosen.path if chosen else None, error))
    if outcome is Outcome.FAILED:
        raise error or CheckpointError(_rank_0_found_none(directory))
    if not ranks.leads() and outcome is Outcome.FOUND:
        path = directory / name
        found, problem = manifest.verify(path, verify, sharded=False, hashes=False)
        if problem is None:
            chosen, problem = attempt(path, found)
        if problem:
            error = CheckpointError(f"cannot load checkpoint {path}, which rank 0 loaded: "
                                    f"{problem}")  # fmt: skip
    if not ranks.agree(error is None):
        raise error or CheckpointError(f"another rank could not load checkpoint {name} in "
                                       f"{directory}: see its error")  # fmt: skip
    return chosen


def load_sharded(directory: Path, *, verify: bool, into: dict | None,
                 runs: Runs | None = None) -> Checkpoint | None:  # fmt: skip
    """The newest valid sharded checkpoint (of `runs`: `first_valid`), loaded into `into` in
    place on every rank; None on a fresh start."""
    if into is None:
        raise CheckpointError(f"sharded checkpoints in {directory} load in place: pass "
                              "into=<this rank's state dict> to load_latest")  # fmt: skip
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def attempt(path: Path, found: Manifest | None) -> tuple[Path | None, str | None]:
        # Refuses crafted metadata here, before any rank unpickles it.
        problem = safe_dcp.metadata_problem(path)
        return (None, problem) if problem else (path, None)

    chosen, error = _choose(directory, attempt, verify=verify, sharded=True, runs=runs)
    outcome, name = ranks.broadcast(*_told(chosen, error))
    if outcome is Outcome.FAILED:
        raise error or CheckpointError(_rank_0_found_none(directory))
    if outcome is Outcome.NOTHING:
        return None
    path = directory / name
    found, _ = manifest.verify(path, False, sharded=True)
    try:
        with safe_dcp.quiet_single_process():
            dcp.load(into, storage_reader=safe_dcp.reader_class()(path),
                     planner=safe_dcp.planner_class()())  # fmt: skip
    except (Exception, CheckpointException) as e:
        cause = safe_dcp.cause(e)
        if isinstance(cause, pickle.UnpicklingError):
            raise states.not_plain(path) from None
        raise CheckpointError(f"cannot load sharded checkpoint {path}: {one_line(cause)}; "
                              "does `into` match the saved state?") from e  # fmt: skip
    return Checkpoint(step=manifest.step_of(path, found), state=into, path=path,
                      run_id=manifest.run_id_of(found))  # fmt: skip


def _choose(directory: Path, attempt: Attempt[T], **options: Any,
            ) -> tuple[T | None, CheckpointError | None]:  # fmt: skip
    """Rank 0: `first_valid`, or its error; the other ranks: nothing."""
    if not ranks.leads():
        return None, None
    try:
        return first_valid(directory, attempt, **options), None
    except CheckpointError as e:
        return None, e


def _told(chosen: Path | None, error: CheckpointError | None) -> tuple[Outcome, str]:
    """What rank 0 tells the others about its choice."""
    if error is not None:
        return Outcome.FAILED, ""
    return (Outcome.FOUND, chosen.name) if chosen is not None else (Outcome.NOTHING, "")


def _rank_0_found_none(directory: Path) -> str:
    return f"rank 0 found no valid checkpoint in {directory}: see its error"

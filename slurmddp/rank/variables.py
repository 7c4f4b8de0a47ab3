"""Typed reads of a launcher's environment variables, and the task layout they give.

Shared by `slurmddp.rank.env` (which resolves a rank from them) and
`slurmddp.rank.slurm_step` (a Slurm step's share of that): every value travels with the
variable, or the rule, it came from.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Literal

from slurmddp.errors import EnvError

Launcher = Literal["torchrun", "env", "mpi", "slurm", "single"]
"""Which launcher's variables decided a rank (`DistEnv.launcher`)."""

# Plain ASCII digits only: int() would also take "1_000" or full-width digits.
_INTEGER = re.compile(r"-?[0-9]+")


class Vars:
    """Typed, source-recording reads of an environment mapping."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._env = environ

    def has(self, *names: str) -> bool:
        """Whether any of `names` is set (to anything, even "")."""
        return any(n in self._env for n in names)

    def first(self, *names: str) -> tuple[str, str] | None:
        """(value, name) of the first of `names` that is set, else None."""
        for n in names:
            if n in self._env:
                return self._env[n], n
        return None

    def integer(self, *names: str, minimum: int = 0) -> tuple[int, str] | None:
        """(value, name) of the first of `names` that is set, a whole number >= `minimum`."""
        found = self.first(*names)
        if found is None:
            return None
        raw, name = found
        if not _INTEGER.fullmatch(raw.strip()):
            raise EnvError(f"{name}={raw!r} is not an integer: give a whole number, or unset it")
        value = int(raw)
        if value < minimum:
            raise EnvError(f"{name}={raw!r} must be at least {minimum}")
        return value, name

    def step_id(self) -> tuple[int, str] | None:
        """(id, name) of the step, from SLURM_STEP_ID or the older SLURM_STEPID, unsigned: Slurm
        26.05 prints its special steps as negative numbers (the interactive step as -6), earlier
        versions as 32-bit unsigned ones (4294967290)."""
        found = self.integer("SLURM_STEP_ID", "SLURM_STEPID", minimum=-(2**31))
        return None if found is None else (found[0] % 2**32, found[1])

    def pair(self, rank: str, size: str) -> tuple[tuple[int, str], tuple[int, str]] | None:
        """Rank and size, both or neither: half a pair is an error, never a guess."""
        if rank not in self._env and size not in self._env:
            return None
        if rank not in self._env or size not in self._env:
            have, miss = (rank, size) if rank in self._env else (size, rank)
            raise EnvError(f"{have} is set but {miss} is not: set both or neither")
        r = self.integer(rank)
        s = self.integer(size, minimum=1)
        assert r is not None and s is not None
        return r, s


@dataclasses.dataclass
class Layout:
    """Placement fields as they are being resolved, with their sources."""

    launcher: Launcher
    rank: tuple[int, str]
    world_size: tuple[int, str]
    local_rank: tuple[int, str]
    local_world_size: tuple[int, str]
    node_rank: tuple[int, str]
    num_nodes: tuple[int, str]
    nodes: tuple[list[str], str] | None = None  # the hosts of this step, first one is rank 0's
    unplaced: str | None = None  # why rank 0's host is unknown, when `nodes` is None
    # Whether this task serves the rendezvous store, where that is not rank 0 (the first host of
    # `nodes` need not be rank 0's when a topology plugin laid the tasks out); None: rank 0 does.
    serves_store: tuple[bool, str] | None = None

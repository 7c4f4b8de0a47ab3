"""Coordination between ranks outside the process group: the rendezvous store, kept at hand.

Collectives are the wrong tool for two things the stop protocol and checkpoints need:

- a wait as long as a checkpoint write, with no collective timeout to trip (NCCL aborts a job
  whose collective waits past its timeout, 10 minutes by default);
- news that must reach every rank while their main threads are busy training (a stop signal):
  a collective would have to be entered at the same step on every rank.

The ``env://`` rendezvous (and torchrun's agent store) is a TCPStore every rank already reaches.
`slurmddp.launch.startup` records it here when the process group starts; callers take their own
connection to it (`connect`), since a blocking wait holds a connection for its whole length and
torch's own connection must stay free for torch. Keys live under `namespace()`, which differs for
every run of a job and every torchrun restart, so nothing from an earlier run is ever read.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Mapping
from typing import Any

# Long enough for any checkpoint write; a lost rank 0 ends the wait at once (its store goes).
FOREVER = datetime.timedelta(days=30)

_lock = threading.Lock()
_store: Any = None
_rank = 0
_world_size = 1
_generation = 0
_main: Any = None  # the main thread's connection
_arrivals = 0  # wait_all calls so far: the same sequence on every rank


def record(store: Any, rank: int, world_size: int) -> None:
    """Remember the rendezvous store of the process group this process just started."""
    global _store, _rank, _world_size, _generation
    with _lock:
        _store, _rank, _world_size = store, rank, world_size
        _generation += 1


def available() -> bool:
    """Whether a rendezvous store is known and still belongs to the live process group."""
    if _store is None:
        return False
    import torch.distributed as td

    return td.is_available() and td.is_initialized() and td.get_world_size() == _world_size


def attempt(environ: Mapping[str, str]) -> str:
    """Which start of the workers this is, the same on every rank: the job's restart, and under
    torchrun its rendezvous round. The round is not torchrun's restart count, which a spare that
    joins later does not share: with a store of its own per round (slurmddp.agent's default),
    the port rank 0 serves it on; with the agents' shared store, the restart count."""
    job = environ.get("SLURM_RESTART_COUNT", "0") or "0"
    if "TORCHELASTIC_RUN_ID" not in environ:
        return job
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return f"{job}.p{environ.get('MASTER_PORT', '0')}"
    return f"{job}.{environ.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"


def namespace() -> str:
    """The key prefix of this run: its attempt and the process group's generation."""
    return f"slurmddp/{attempt(os.environ)}/{_generation}"


def connect(timeout: datetime.timedelta = FOREVER) -> Any:
    """A new connection to the rendezvous store, for one thread's own use; None without one."""
    with _lock:
        store = _store
    if store is None:
        return None
    connection = store.clone()
    connection.set_timeout(timeout)
    return connection


def main_connection() -> Any:
    """The main thread's own connection (made once per process group); None without a store."""
    global _main
    if _main is None or _main[0] != _generation:
        connection = connect()
        _main = (_generation, connection)
    return _main[1]


def wait_all() -> bool:
    """Block until every rank has called this (as often), bounded by no collective timeout.

    For the ranks that wait while one rank writes a checkpoint, however long that takes; a
    collective right after it then finds everyone there. Main thread only. False (at once)
    without a store: the caller's collective waits instead.
    """
    global _arrivals
    if not available():
        return False
    store = main_connection()
    _arrivals += 1
    key = f"{namespace()}/all/{_arrivals}"
    if store.add(f"{key}/count", 1) == _world_size:
        store.set(key, "1")
    store.wait([key])
    return True


def rank() -> int:
    return _rank


def world_size() -> int:
    return _world_size

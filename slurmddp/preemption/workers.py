"""How a rank starts its DataLoader workers: shielded from Slurm's SIGTERM, and alive for sure.

- **Shielded.** DataLoader workers (torch's, and torchdata's StatefulDataLoader's) are
  `_worker_loop` processes: torch makes them die of any SIGTERM that their parent did not send.
  They are started with SIGTERM blocked (fork, spawn and forkserver alike) and a thread in each
  ends the worker on its DataLoader's SIGTERM only (the rank's, as torch does), so Slurm's
  SIGTERM to the whole step leaves them serving the rank until it stops at its agreed step.
  Other children get Slurm's SIGTERM as they would without slurmddp: blocking it in all of them
  would make `Pool.terminate()` and `Popen.terminate()` hang.
- **Alive for sure.** A worker forked from a rank can, rarely, never get past the fork: its child
  waits forever inside `os.fork()`, before any of its own code runs, for the interpreter's
  thread-state lock, which another thread of the rank held at that instant: CPython's gh-112275,
  fixed in 3.12 and in the 3.8-3.11 releases of September 2024 (3.10.15, 3.11.10). With Python
  3.10.13 and torch 2.8 on a loaded machine: about one run in a hundred of a resumed loop with
  persistent workers, and once in some 11,000 worker forks of the README's loop. The DataLoader
  waits for that worker forever, since it is alive, and the other ranks wait in their next
  collective. So a forked worker tells its rank it runs, first thing; one that has not within
  `BIRTH_S` seconds is killed and forked again, with a warning. Spawned and forkserver workers are
  not forked from the rank.

`shield()` installs both, once, in the rank (`Receiver.install`): the patch `WORKER_START` of
multiprocessing's ``BaseProcess.start`` (`slurmddp.patches`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import select
import signal
import threading
from collections.abc import Callable
from typing import Any

from slurmddp import patches
from slurmddp.errors import warn

__all__ = ["BIRTH_S", "WORKER_START", "shield"]

# A forked worker reaches its target within milliseconds; one silent this long is stuck.
BIRTH_S = 10.0
_FORKS = 3  # forks tried before the last is left as it is

# Private names of torch and torchdata: a DataLoader worker is known only by the function its
# process runs (no public marker exists): torch's, and torchdata's StatefulDataLoader's (Lightning
# users' loader), a copy of it. If one is renamed, its workers are simply not shielded (Slurm's
# TERM ends them, as without slurmddp); tests/test_dependencies.py fails first and names it.
_WORKER_LOOPS = {
    ("torch.utils.data._utils.worker", "_worker_loop"),
    ("torchdata.stateful_dataloader.worker", "_worker_loop"),
}


def _starting(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def start(self: multiprocessing.process.BaseProcess) -> None:
        _shielded_start(self, original)

    return start


WORKER_START = patches.Patch(
    "multiprocessing.process:BaseProcess.start",
    why="DataLoader workers start with SIGTERM blocked (Slurm's TERM to the step must not end "
    "them before the rank's agreed stop) and a forked one stuck in its fork is forked again; "
    "other children start as before",
    by="the stop protocol's install (slurmddp.init, slurmddp.run, the integrations)",
    make=_starting,
)


def shield() -> None:
    """Start DataLoader workers from now on as this module says; other children as before."""
    patches.apply(WORKER_START)


def _is_dataloader_worker(target: Any) -> bool:
    return (getattr(target, "__module__", None), getattr(target, "__name__", None)) in _WORKER_LOOPS


def _block_term() -> Any:
    return signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


class _Shielded:
    """A DataLoader worker's target, run with SIGTERM taken from its DataLoader only.

    Picklable: spawn and forkserver workers unpickle it before their arguments. `alive` is a
    forked worker's pipe to the rank (read end, write end), inherited through the fork.
    """

    def __init__(self, target: Callable[..., Any], alive: tuple[int, int] | None = None) -> None:
        self.target = target
        self.owner = os.getpid()  # the rank, whose DataLoader may terminate the worker
        self.alive = alive

    def __setstate__(self, state: dict) -> None:
        _block_term()  # before anything the unpickling imports can start a thread
        self.__dict__.update(state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.alive is not None:
            read, write = self.alive
            os.close(read)
            os.write(write, b"!")
            os.close(write)
        _block_term()
        threading.Thread(target=_end_on_owners_term, args=(self.owner,),
                         name="slurmddp-worker-term", daemon=True).start()  # fmt: skip
        return self.target(*args, **kwargs)


def _end_on_owners_term(owner: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == owner:
            os._exit(0)  # as torch's worker handler does when its DataLoader ends it


def _unblock_term() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class _TermUnblocked:
    """Unpickled in a forkserver child: gives its main thread SIGTERM back (see below)."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _unblock_term, ()


def _start_method(process: multiprocessing.process.BaseProcess) -> str:
    # A context's Process names its method; multiprocessing.Process (torch's default) uses the
    # default context's: the one set, or the platform's first.
    return (getattr(process, "_start_method", None)
            or multiprocessing.get_start_method(allow_none=True)
            or multiprocessing.get_all_start_methods()[0])  # fmt: skip


def _shielded_start(self: multiprocessing.process.BaseProcess,
                    original: Callable[[Any], None]) -> None:
    """`Process.start` for a rank: DataLoader workers shielded, every other child as it was.

    A child is born with its creator's signal mask, and threads a library starts in the child at
    fork time (OpenBLAS does) keep it. So DataLoader workers are started with SIGTERM blocked.
    The forkserver is started with SIGTERM blocked too, so its DataLoader workers are born that
    way; its other children unblock it in their main thread as they unpickle, and so take
    SIGTERM as they would without slurmddp.
    """
    target: Any = getattr(self, "_target", None)
    method = _start_method(self)
    if method == "forkserver":
        from multiprocessing import forkserver as server

        old = _block_term()
        try:
            server.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if not _is_dataloader_worker(target):
        if method == "forkserver":
            self._slurmddp_term = _TermUnblocked()  # type: ignore[attr-defined]
        return original(self)
    old = _block_term()
    try:
        if method == "fork":
            return _fork_alive(self, target, original)
        self._target = _Shielded(target)  # type: ignore[attr-defined]
        return original(self)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _fork_alive(process: Any, target: Callable[..., Any], start: Callable[[Any], None]) -> None:
    """Fork the worker until its child says it runs (or has ended: torch reports that)."""
    args, kwargs = process._args, process._kwargs  # start() deletes them
    for fork in range(1, _FORKS + 1):
        read, write = os.pipe()
        try:
            process._target = _Shielded(target, (read, write))
            process._args, process._kwargs = args, kwargs
            try:
                start(process)
            finally:
                os.close(write)
            said = select.poll()  # not select(): a rank's descriptors may pass FD_SETSIZE
            said.register(read, select.POLLIN)
            if said.poll(BIRTH_S * 1000):  # a byte, or the end of a child that died
                return
        finally:
            os.close(read)
        if fork == _FORKS:
            warn(f"a DataLoader worker (pid {process.pid}) was stuck in its fork {_FORKS} times "
                 "in a row; it is left as it is")  # fmt: skip
            return
        warn(f"a DataLoader worker (pid {process.pid}) was stuck in its fork for {BIRTH_S:g} s; "
             "it was killed and forked again")  # fmt: skip
        process.kill()
        process.join()
        process._popen = None  # so that it can start again

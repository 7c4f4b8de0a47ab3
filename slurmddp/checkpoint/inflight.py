"""Asynchronous saves in flight in this process, in start order: every rank settles them in the
same order, and none is forgotten (strong references) or cut short by the interpreter's exit."""

from __future__ import annotations

import atexit
import itertools
from typing import Protocol

from slurmddp.errors import one_line, warn


class InFlight(Protocol):
    """A save mode with an asynchronous save under way."""

    def wait(self) -> None:
        """Settle the save (collective with a process group); raise its error."""

    def join_local(self) -> BaseException | None:
        """Wait for this process's part of the save, without a collective; its error."""


_in_flight: dict[int, InFlight] = {}
_counter = itertools.count()


def register(save: InFlight) -> int:
    """Record `save` as in flight; the number to `unregister` it with."""
    order = next(_counter)
    if order == 0:  # at the first save, not on import: importing slurmddp changes nothing
        atexit.register(_finish_writes_at_exit)
    _in_flight[order] = save
    return order


def unregister(order: int) -> None:
    """Forget the save `register` numbered `order` (settled)."""
    _in_flight.pop(order, None)


def wait_for_saves() -> None:
    """Wait for every async save in flight in this process and re-raise the first error.

    Collective like `Checkpointer.wait` (every rank calls it, e.g. before a requeue).
    """
    first: BaseException | None = None
    for _, save in sorted(_in_flight.items()):
        try:
            save.wait()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def _finish_writes_at_exit() -> None:
    # `slurmddp.run` ends the process with os._exit after atexit: a checkpoint being written in
    # the background must reach the disk first. Local join only; collectives may be gone by now.
    for save in list(_in_flight.values()):
        error = save.join_local()
        if error is not None:
            warn(one_line(error))

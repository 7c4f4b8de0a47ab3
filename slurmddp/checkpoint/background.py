"""The one way a checkpoint works beside its caller: a function in a thread, joined later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


class Background(Generic[T]):
    """fn(*args) in a thread; `wait()` joins it and returns what it raised, `result()` its value.

    `daemon=False` for work the interpreter must finish before it exits (a checkpoint write).
    """

    def __init__(self, fn: Callable[..., T], *args: Any, name: str = "slurmddp-checkpoint-io",
                 daemon: bool = True) -> None:  # fmt: skip
        self._value: T | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn(*args)
            except BaseException as e:  # kept for whoever joins the thread
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=daemon)
        self._thread.start()

    def done(self) -> bool:
        """Whether fn has returned or raised."""
        return not self._thread.is_alive()

    def wait(self) -> BaseException | None:
        """Join the thread; the exception fn raised, or None."""
        self._thread.join()
        return self._error

    def result(self) -> T:
        """Join the thread; fn's value, or raise what it raised."""
        error = self.wait()
        if error is not None:
            raise error
        return cast(T, self._value)  # set when fn returned

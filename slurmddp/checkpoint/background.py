"""The one way a checkpoint works beside its caller: a function in a thread, joined later."""

from __future__ import annotations

import queue
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


class Worker:
    """One thread that runs the function given to `submit`, for as long as the process lives:
    no thread start (and its handover of the interpreter lock) per call. One call at a time:
    `wait()` for it before the next `submit`. Daemon: the process does not wait for it."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple]] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def idle(self) -> bool:
        return self._idle.is_set()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if not self._idle.is_set():
            raise RuntimeError("Worker.submit while a call runs: wait() first")
        self._idle.clear()
        self._jobs.put((fn, args))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the call in flight (at most `timeout` seconds); whether it is done."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            fn, args = self._jobs.get()
            try:
                fn(*args)  # its own errors are its own to report
            finally:
                self._idle.set()

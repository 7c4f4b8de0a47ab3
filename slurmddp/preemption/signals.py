"""How a rank takes the stop signal and SIGTERM, without harming its children or other scripts.

Slurm signals every process of a step: srun forwards a signal to the whole process tree of each
task, and Slurm's own SIGTERM (scancel, preemption, the time limit) reaches every process too. So:

- **The stop signal** ($SLURMDDP_SIGNAL, USR2 by default) only sets a flag that
  `slurmddp.should_stop` reads. It is *blocked* in the rank's threads, and so in every child the
  rank starts afterwards (a signal mask survives fork and exec): DataLoader workers, compile
  workers and subprocesses never die of it. One daemon thread keeps it unblocked, so the kernel
  delivers it there and Python runs the handler in the main thread as usual. A stop signal
  that arrives before the handler exists is not lost either: the batch script starts each rank
  with it ignored (an ignored signal stays ignored across exec) and leaves the reason in
  $SLURMDDP_STOP_FILE before passing the signal on; `install` reads that file once.
- **SIGTERM** sets the flag only once the script has asked `should_stop()` (`take_term`). Until
  then it keeps the effect it has without slurmddp: the default (the process ends) or the
  script's own handler. A handler installed later (Lightning's) replaces ours, and one installed
  earlier is chained after ours.

DataLoader workers are started apart from all this: `slurmddp.preemption.workers`.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from slurmddp.errors import SignalError
from slurmddp.preemption import workers
from slurmddp.protocol import DEFAULT_SIGNAL, SIGNAL_VAR, STOP_FILE_VAR

__all__ = [
    "DEFAULT_SIGNAL", "SIGNAL_VAR", "STOP", "STOP_FILE_VAR", "TERM", "Receiver", "bits_name",
    "ignoring", "route", "stop_signal",
]  # fmt: skip

# Bits of what a process saw: the stop signal, SIGTERM.
STOP, TERM = 1, 2


def stop_signal(environ: Mapping[str, str]) -> signal.Signals:
    """The signal that announces preemption or the time limit: ``$SLURMDDP_SIGNAL`` or USR2."""
    name = environ.get(SIGNAL_VAR) or DEFAULT_SIGNAL
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        raise SignalError(
            f"{SIGNAL_VAR}={name!r} is not a signal name: use e.g. {DEFAULT_SIGNAL}"
        ) from None


def ignoring(name: str) -> tuple[str, ...]:
    """A command prefix that starts a process with the stop signal `name` ignored.

    An ignored signal stays ignored across exec, so a rank started through it cannot be ended by
    the stop signal before its runner takes it (the signal is then read from the stop file).
    """
    return ("sh", "-c", f'trap "" {name}; exec "$@"', "slurmddp-rank")


def bits_name(bits: int, stop: signal.Signals | None) -> str | None:
    """"USR2" (the stop signal wins), "TERM", or None."""
    if bits & STOP:
        return (stop or signal.SIGUSR2).name[3:]
    return "TERM" if bits & TERM else None


class Receiver:
    """A process's view of the stop signal and SIGTERM.

    The process's own is held by `slurmddp.preemption.api.state()`; installing a second one
    would take the signals over from the first.
    """

    def __init__(self) -> None:
        self.seen = 0  # written by the handlers only
        self.stop: signal.Signals | None = None
        self._term_taken = False
        self._previous_term: Callable[[int, Any], Any] | None = None
        self._term_before: Any = signal.SIG_DFL  # SIGTERM's handler before ours, for children

    # -- the stop signal ---------------------------------------------------------------------

    def install(self, environ: Mapping[str, str] | None = None) -> signal.Signals | None:
        """Take the stop signal from now on (idempotent); None outside the main thread.

        Python delivers signals only in the main thread, so only it can install handlers.
        """
        if self.stop is not None:
            return self.stop
        if threading.current_thread() is not threading.main_thread():
            return None
        env = os.environ if environ is None else environ
        sig = stop_signal(env)
        route(sig, self._on_stop)
        self.stop = sig
        path = env.get(STOP_FILE_VAR)
        if path and os.path.exists(path):
            # The batch shell got the stop signal before this process could take it.
            self.seen |= STOP
        workers.shield()
        return sig

    def _on_stop(self, signum: int, frame: Any) -> None:
        self.seen |= STOP  # nothing else here: no I/O, no collectives

    # -- SIGTERM -----------------------------------------------------------------------------

    def take_term(self) -> None:
        """From now on SIGTERM sets the flag too (the script uses the stop protocol).

        A handler the script installed before is called after ours; an ignored SIGTERM stays
        ignored. A no-op outside the main thread.
        """
        if self._term_taken or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current == signal.SIG_IGN:
            return
        self._previous_term = current if callable(current) else None
        self._take_term_handler()

    def take_back(self) -> None:
        """Take the stop signal and SIGTERM back from a framework that replaced the handlers
        (Lightning, as its fit starts), without chaining the framework's: its TERM handler ends
        training at the batch's end, before the ranks agree and checkpoint. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self.stop is not None and signal.getsignal(self.stop) != self._on_stop:
            signal.signal(self.stop, self._on_stop)
        if signal.getsignal(signal.SIGTERM) != self._on_term:
            if not self._term_taken:
                self._previous_term = None
            self._take_term_handler()

    def _take_term_handler(self) -> None:
        if not self._term_taken:
            before = signal.getsignal(signal.SIGTERM)
            self._term_before = signal.SIG_DFL if before is None else before
            os.register_at_fork(after_in_child=self._give_term_back)
        signal.signal(signal.SIGTERM, self._on_term)
        self._term_taken = True

    def _give_term_back(self) -> None:
        """In a child forked from here (a multiprocessing Pool's or Process's, the default start
        method on Linux before Python 3.14), SIGTERM is handled as before we took it: the stop
        protocol is the rank's, and Pool.terminate() and Process.terminate() must still end the
        child, as they do without slurmddp."""
        if self._term_taken and signal.getsignal(signal.SIGTERM) == self._on_term:
            signal.signal(signal.SIGTERM, self._term_before)
        self._term_taken = False

    def _on_term(self, signum: int, frame: Any) -> None:
        self.seen |= TERM
        if self._previous_term is not None:
            self._previous_term(signum, frame)

    @property
    def term_taken(self) -> bool:
        return self._term_taken

    def name(self, bits: int | None = None) -> str | None:
        return bits_name(self.seen if bits is None else bits, self.stop)


def route(sig: signal.Signals, handler: Callable[[int, Any], Any]) -> None:
    """Run `handler` on `sig` in the main thread, with `sig` blocked in every thread and child
    created from here on but one daemon thread, where the kernel then delivers it."""
    signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    threading.Thread(target=_unblocked, args=(sig,), name="slurmddp-signals", daemon=True).start()


def _unblocked(sig: signal.Signals) -> None:
    """The one thread where the stop signal is delivered; it only waits."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    threading.Event().wait()

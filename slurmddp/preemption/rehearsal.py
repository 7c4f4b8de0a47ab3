"""The local emulation's rehearsed stop (``slurmddp submit --local --local-signal-after``),
counted from training's first step, not from the process's start: on a loaded machine the
start-up alone can take longer than the time asked for.

Global rank 0 arms it at its first ``should_stop()`` (`arm`): "S" sends the stop signal S seconds
later, "Nsteps" at the N-th call. It is sent to the emulated batch job's process
(``$SLURMDDP_LOCAL_BATCH_PID``), which hands it to the batch script as Slurm's ``--signal=B:``
does: the supervisor, then srun's stand-in, then every rank; the path a real stop takes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path

from slurmddp.preemption.signals import stop_signal
from slurmddp.protocol import LOCAL_BATCH_PID_VAR, LOCAL_REHEARSAL_VAR, LOCAL_STATE_VAR


def parse(text: str) -> tuple[str, float] | None:
    """("seconds", S) for "S" or "Ss", ("steps", N) for "Nsteps"; None when it is neither."""
    text = text.strip()
    unit = "steps" if text.endswith("steps") else "seconds"
    number = text.removesuffix("steps") if unit == "steps" else text.removesuffix("s")
    try:
        value = float(number)
    except ValueError:
        return None
    if not 0 <= value < float("inf") or (unit == "steps" and value != int(value)):
        return None
    return unit, value


class Rehearsal:
    """One run's rehearsed stop, armed at the first step; sent once a run of the job (a worker
    torchrun restarts within the run does not send it again: `sent` marks it in the run's
    state directory)."""

    def __init__(self, unit: str, value: float, pid: int, sig: signal.Signals,
                 sent: Path | None = None) -> None:  # fmt: skip
        self.unit, self.value, self.pid, self.sig, self.marker = unit, value, pid, sig, sent
        self.sent = False
        if unit == "seconds":
            timer = threading.Timer(value, self.fire)
            timer.daemon = True
            timer.start()

    def step(self, calls: int) -> None:
        """`calls` steps made (the first is 1)."""
        if self.unit == "steps" and not self.sent and calls >= self.value:
            self.fire()

    def fire(self) -> None:
        if self.sent:
            return
        self.sent = True
        if self.marker is not None:
            try:
                self.marker.touch(exist_ok=False)
            except FileExistsError:
                return  # an earlier worker of this run sent it
            except OSError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, self.sig)


def arm(environ: Mapping[str, str]) -> Rehearsal | None:
    """This run's rehearsal, started; None outside a local job that asked for one."""
    asked = parse(environ.get(LOCAL_REHEARSAL_VAR, ""))
    pid = environ.get(LOCAL_BATCH_PID_VAR, "")
    if asked is None or not pid.isdigit():
        return None
    state = environ.get(LOCAL_STATE_VAR)
    sent = Path(state) / "rehearsed" if state else None
    if sent is not None and sent.exists():
        return None
    rehearsal = Rehearsal(*asked, int(pid), stop_signal(environ), sent)
    rehearsal.step(1)  # "1steps" and "0steps": at the first step
    return rehearsal

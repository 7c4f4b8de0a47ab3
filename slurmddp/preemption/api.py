"""The stop protocol: signal, agreed stop at a step boundary, checkpoint, requeue.

    slurmddp.init()                      # or run under `python -m slurmddp.run`: handlers installed
    for step in range(start, steps):
        train_step()
        if slurmddp.should_stop():       # same answer on every rank
            ckpt.save(step + 1, state)
            slurmddp.requeue()           # ends the process; the job comes back and resumes
    slurmddp.mark_done()                 # the work is done: nothing requeues it any more

The stop signal and SIGTERM only set a flag (`slurmddp.preemption.signals`): a handler that wrote a
checkpoint or joined a collective could deadlock, since it runs between two bytecodes of whatever
the rank was doing. `should_stop` turns the flags of all ranks into one answer at the same call
on every rank (`slurmddp.preemption.agreement`).

Whether the job comes back is decided once the ranks have left (`decision`), from what
Slurm records about the job (was it preempted?), not from which signal came. Who carries it out
(`requeue_route`): the supervisor of a ``slurmddp submit`` job when it asked for it
(``$SLURMDDP_REQUEUE_FILE``: rank 0 leaves the reason there and the supervisor decides, so ranks
need no Slurm tools, e.g. in a container; ``--local`` runs the same batch script); otherwise
rank 0 itself, with ``scontrol``, inside any Slurm job (`slurmddp.preemption.slurm` carries the
verdict out for both).

What the protocol knows in a process (the signals taken, the agreement, whether the script asked
and what the ranks agreed) is one `State`; the functions here act on the process's own,
`state()`. A test can make a fresh `State` and call its methods in the same process.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from slurmddp import dist, files
from slurmddp.errors import warn
from slurmddp.preemption import deadline, decision, rehearsal, signals, slurm
from slurmddp.preemption.agreement import Agreement
from slurmddp.preemption.signals import stop_signal
from slurmddp.protocol import (
    ASKED_FILE_VAR,
    DONE_FILE_VAR,
    LOCAL_REQUEUE_STATUS,
    NOT_REQUEUED_STATUS,
    REQUEUE_FILE_VAR,
)
from slurmddp.rank import bootstrap
from slurmddp.story import events
from slurmddp.watchdog import progress

__all__ = [
    "LOCAL_REQUEUE_STATUS", "NOT_REQUEUED_STATUS", "State", "install", "mark_done", "received",
    "requeue", "requeue_route", "should_stop", "state", "stop_signal",
]  # fmt: skip


class State:
    """Everything the stop protocol knows in one process (see the module's docstring)."""

    def __init__(self) -> None:
        self.receiver = signals.Receiver()  # the stop signal and SIGTERM as this process took them
        self.agreement = Agreement()  # how the ranks settle on one stop call
        self.asked = False  # should_stop() was called: the script uses the protocol
        self.agreed = 0  # the bits all ranks agreed on; sticky
        self.done = False  # mark_done() was called
        # The job's end, and when this rank stops by itself if no signal comes (`deadline`).
        self.end: float | None = None
        self.stop_at: float | None = None
        self.save_s: float | None = None  # the last measured save's duration
        self.calls = 0  # should_stop() calls: the steps of this run
        self.resumed_at = 0  # the step this run resumed at (the checkpointer says)
        self.rehearsal: rehearsal.Rehearsal | None = None  # --local-signal-after, on rank 0
        self.self_stopped = False
        # What must finish before this rank leaves (`on_leave`): callback -> at requeue only.
        self.leaving: dict[Callable[[], None], bool] = {}

    def on_leave(self, callback: Callable[[], None], *, requeue_only: bool = False) -> None:
        """Have `callback` run once this rank leaves: at `requeue` (those `requeue_only` first),
        and at `mark_done` unless `requeue_only`. Checkpoints register their saves in flight (a
        requeue is announced only once the checkpoint is on disk), snapshots their memory; the
        stop protocol imports neither."""
        self.leaving.setdefault(callback, requeue_only)

    def _leave(self, requeue: bool) -> None:
        for only in (True, False):
            for callback in [c for c, r in self.leaving.items() if r is only]:
                if requeue or not only:
                    callback()

    def install(self, environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
        """`install`, for this state."""
        sig = self.receiver.install(environ)
        if sig is None:
            return ()
        return (sig, signal.SIGTERM) if self.receiver.term_taken else (sig,)

    def received(self) -> signal.Signals | None:
        """`received`, for this state."""
        name = self.receiver.name()
        return None if name is None else signal.Signals[f"SIG{name}"]

    def should_stop(self, every: int | None = None, group: object = None) -> bool:
        """`should_stop`, for this state."""
        progress.heartbeat()
        self.calls += 1
        if not self.asked:
            self._first_call()
        elif self.rehearsal is not None:
            self.rehearsal.step(self.calls)
        if self.done:
            return False
        if self.agreed:
            return True
        if self.stop_at is not None and not self.receiver.seen and time.time() >= self.stop_at:
            self.receiver.seen |= signals.STOP  # as if the signal had come: it is late, or lost
            self.self_stopped = True
        bits = self.agreement(self.receiver.seen, every, group)
        if bits:
            self.agreed = bits
            if dist.rank() == 0:
                events.emit("stop", signal=self.receiver.name(bits), self=self.self_stopped,
                            step=self.resumed_at + self.calls, calls=self.calls)  # fmt: skip
            if dist.rank() == 0 and self.self_stopped and self.end is not None:
                warn(f"the job ends in {self.end - time.time():.0f} s and no stop signal came: "
                     "every rank stops at this step boundary")  # fmt: skip
            elif dist.rank() == 0:
                warn(f"{self.receiver.name(bits)} received: every rank stops at this step "
                     "boundary")  # fmt: skip
        return bool(bits)

    def note_save(self, seconds: float, *, warn_slow: bool = False) -> None:
        """A save took `seconds`: the self-stop leaves room for the next (`deadline.stop_at`);
        `warn_slow`: rank 0 warns when it would not fit in the stop signal's lead."""
        self.save_s = seconds
        lead = deadline.lead_s(os.environ)
        if warn_slow and dist.rank() == 0 and (said := deadline.slow_save(seconds, lead)):
            warn(said)
        if self.end is not None:
            self.stop_at = deadline.stop_at(self.end, lead, self.save_s)

    def _first_call(self) -> None:
        self.install()
        self.receiver.take_term()
        self.asked = True
        bootstrap.say_restart_hazard()  # a framework's script under torchrun has no bootstrap
        self.end = deadline.job_end(ask=dist.rank() == 0)
        if self.end is not None:
            self.stop_at = deadline.stop_at(self.end, deadline.lead_s(os.environ), self.save_s)
        path = os.environ.get(ASKED_FILE_VAR)
        if dist.rank() == 0:
            if path:
                _touch(path)  # the supervisor's evidence that the script uses the protocol
            events.emit("training", step=self.resumed_at + 1)
            self.rehearsal = rehearsal.arm(os.environ)

    def mark_done(self) -> None:
        """`mark_done`, for this state."""
        self.done = True
        progress.finish()
        self._leave(requeue=False)
        self.install()  # a late signal must not end the process either
        self.agreement.close()
        path = os.environ.get(DONE_FILE_VAR)
        if dist.rank() == 0:
            if path:
                _touch(path)
            events.emit("done", step=self.resumed_at + self.calls, calls=self.calls)

    def requeue(self) -> NoReturn:
        """`requeue`, for this state."""
        self._leave(requeue=True)
        self.agreement.close()
        if self.done:
            warn("the job is marked done: not requeued")
            raise SystemExit(0)
        # Agreed: this rank may not have got a signal itself.
        reason = self.receiver.name(self.agreed or self.receiver.seen) or "request"
        route = requeue_route(os.environ)
        rank = dist.rank()
        if route == "batch":
            if rank == 0:
                files.write_atomically(Path(os.environ[REQUEUE_FILE_VAR]), f"{reason}\n")
            raise SystemExit(0)  # the supervisor decides, after every rank has left
        if route == "none":
            warn(f"stopped by {reason} outside a Slurm job: nothing requeues it; run it again to "
                 "resume from the checkpoint")  # fmt: skip
            raise SystemExit(NOT_REQUEUED_STATUS)
        if rank == 0:
            _requeue_with_scontrol(reason)
        raise SystemExit(0)


_state = State()


def state() -> State:
    """This process's stop protocol state."""
    return _state


def install(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """Let the stop signal set the stop flag instead of ending the process (idempotent).

    SIGTERM joins it at the first `should_stop()`: until the script asks, SIGTERM keeps its usual
    effect. A no-op outside the main thread. Returns the signals handled.
    """
    return _state.install(environ)


def received() -> signal.Signals | None:
    """What this process got (its own flag, not the agreed answer): the stop signal, TERM, None."""
    return _state.received()


def should_stop(every: int | None = None, group: object = None) -> bool:
    """Whether every rank should stop at this step boundary; the same answer on all ranks.

    Call it at the same points on every rank. It costs almost nothing: while no signal comes the
    ranks do not communicate (through the rendezvous store; see `agreement`), and a
    signal makes every rank stop within about two steps of it. With `every` = N (or a `group`),
    exactly each N-th call is an all_reduce instead. True once means True from then on; False
    after `mark_done`.
    """
    return _state.should_stop(every, group)


def mark_done() -> None:
    """Record that the job finished its work: no later signal stops or requeues it.

    Rank 0 also leaves the batch script's done marker, so that a job Slurm requeues anyway
    (preempted while exiting) does not run again. Only this marker says the work is done: a step
    that merely exits 0 after a preemption (as Lightning does on SIGTERM) is requeued.
    """
    _state.mark_done()


def requeue() -> NoReturn:
    """End this process so that the job is requeued if it should be; call it on every rank.

    Waits for any asynchronous checkpoint still being written first. Raises SystemExit: status 0
    when the job's supervisor decides (``slurmddp submit``, ``--local`` too), or when rank 0
    requeued the job; 75 when the job is not requeued (the message says why).
    """
    _state.requeue()


def _requeue_with_scontrol(reason: str) -> NoReturn:
    """Rank 0 in a user's own batch script: decide from Slurm's record, carry the verdict out."""
    if shutil.which("scontrol") is None:
        warn("cannot requeue: scontrol is not on PATH here; submit with `slurmddp submit`, whose "
             "batch script requeues from outside the ranks")  # fmt: skip
        raise SystemExit(NOT_REQUEUED_STATUS)
    job = os.environ["SLURM_JOB_ID"]
    facts = decision.facts_from(os.environ, step_status=0, asked=reason, job=slurm.show_job(job))
    verdict = decision.decide(facts)
    _say_all(verdict.lines)
    raise SystemExit(slurm.carry_out(verdict, facts, job, os.environ, warn).status)


def requeue_route(environ: Mapping[str, str]) -> str:
    """Who requeues this job: "batch", "local", "scontrol", or "none" (not a Slurm job)."""
    if environ.get(REQUEUE_FILE_VAR):
        return "batch"
    if environ.get("SLURM_JOB_ID"):
        return "scontrol"
    return "none"


def _say_all(lines: tuple[str, ...]) -> None:
    for line in lines:
        warn(line)


def _touch(path: str) -> None:
    try:
        Path(path).touch(mode=files.FILE_MODE)
    except OSError as e:  # a marker must not fail the training
        warn(f"cannot write {path}: {e.strerror}")

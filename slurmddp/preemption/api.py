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
(`requeue_route`): the batch shell of ``slurmddp submit`` when it asked for it
(``$SLURMDDP_REQUEUE_FILE``: rank 0 leaves the reason there and the shell decides, so ranks need
no Slurm tools, e.g. in a container); the local emulation by submitit's requeue exit status;
otherwise rank 0 itself, with ``scontrol``, inside any Slurm job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from slurmddp.preemption import decision, signals
from slurmddp.preemption.agreement import agreement
from slurmddp.preemption.decision import NOT_REQUEUED_STATUS
from slurmddp.preemption.signals import stop_signal

__all__ = [
    "LOCAL_REQUEUE_STATUS", "NOT_REQUEUED_STATUS", "install", "mark_done", "received", "requeue",
    "requeue_route", "should_stop", "stop_signal",
]  # fmt: skip

REQUEUE_FILE_VAR = "SLURMDDP_REQUEUE_FILE"
DONE_FILE_VAR = "SLURMDDP_DONE_FILE"
ASKED_FILE_VAR = "SLURMDDP_ASKED_FILE"
LOCAL_RESTART_FILE_VAR = "SLURMDDP_LOCAL_RESTART_FILE"

# submitit's LocalExecutor starts the tasks again when one exits with this status.
LOCAL_REQUEUE_STATUS = 144


class _State:
    asked = False  # should_stop() was called: the script uses the protocol
    agreed = 0  # the bits all ranks agreed on; sticky
    done = False


_state = _State()


def install(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """Let the stop signal set the stop flag instead of ending the process (idempotent).

    SIGTERM joins it at the first `should_stop()`: until the script asks, SIGTERM keeps its usual
    effect. A no-op outside the main thread. Returns the signals handled.
    """
    sig = signals.receiver.install(environ)
    if sig is None:
        return ()
    return (sig, signal.SIGTERM) if signals.receiver.term_taken else (sig,)


def received() -> signal.Signals | None:
    """What this process got (its own flag, not the agreed answer): the stop signal, TERM, None."""
    name = signals.receiver.name()
    return None if name is None else signal.Signals[f"SIG{name}"]


def should_stop(every: int | None = None, group: object = None) -> bool:
    """Whether every rank should stop at this step boundary; the same answer on all ranks.

    Call it at the same points on every rank. It costs almost nothing: while no signal comes the
    ranks do not communicate (through the rendezvous store; see `agreement`), and a
    signal makes every rank stop within about two steps of it. With `every` = N (or a `group`),
    exactly each N-th call is an all_reduce instead. True once means True from then on; False
    after `mark_done`.
    """
    if not _state.asked:
        _first_call()
    if _state.done:
        return False
    if _state.agreed:
        return True
    bits = agreement(signals.receiver.seen, every, group)
    if bits:
        _state.agreed = bits
        if _rank() == 0:
            print(f"slurmddp: {signals.receiver.name(bits)} received: every rank stops at this "
                  "step boundary", file=sys.stderr, flush=True)  # fmt: skip
    return bool(bits)


def _first_call() -> None:
    install()
    signals.receiver.take_term()
    _state.asked = True
    path = os.environ.get(ASKED_FILE_VAR)
    if path and _rank() == 0:
        _touch(path)  # the batch shell's evidence that the script uses the protocol


def mark_done() -> None:
    """Record that the job finished its work: no later signal stops or requeues it.

    Rank 0 also leaves the batch script's done marker, so that a job Slurm requeues anyway
    (preempted while exiting) does not run again. Only this marker says the work is done: a step
    that merely exits 0 after a preemption (as Lightning does on SIGTERM) is requeued.
    """
    _state.done = True
    install()  # a late signal must not end the process either
    agreement.close()
    path = os.environ.get(DONE_FILE_VAR)
    if path and _rank() == 0:
        _touch(path)


def requeue() -> NoReturn:
    """End this process so that the job is requeued if it should be; call it on every rank.

    Waits for any asynchronous checkpoint still being written first. Raises SystemExit: status 0
    when the batch script decides, or when rank 0 requeued the job; submitit's requeue status
    under local emulation; 75 when the job is not requeued (the message says why).
    """
    if "slurmddp.checkpoint" in sys.modules:
        from slurmddp.checkpoint import wait_for_saves

        wait_for_saves()  # never announce a requeue before the checkpoint is on disk
    agreement.close()
    if _state.done:
        _say("the job is marked done: not requeued")
        raise SystemExit(0)
    # Agreed: this rank may not have got a signal itself.
    reason = signals.receiver.name(_state.agreed or signals.receiver.seen) or "request"
    route = requeue_route(os.environ)
    rank = _rank()
    if route == "batch":
        if rank == 0:
            _write_atomically(Path(os.environ[REQUEUE_FILE_VAR]), f"{reason}\n")
        raise SystemExit(0)  # the batch shell decides, after every rank has left
    if route == "none":
        _say(f"stopped by {reason} outside a Slurm job: nothing requeues it; run it again to "
             "resume from the checkpoint")  # fmt: skip
        raise SystemExit(NOT_REQUEUED_STATUS)
    if route == "local":
        verdict = decision.decide(decision.facts_from(os.environ, step_status=0, asked=reason))
        if verdict.action != "requeue":
            if rank == 0:
                _say_all(verdict.lines)
            raise SystemExit(verdict.status)
        if rank == 0:
            restarts = decision.requeue_budget(os.environ)[0]
            _write_atomically(Path(os.environ[LOCAL_RESTART_FILE_VAR]), f"{restarts + 1}\n")
            _say_all(verdict.lines)
        raise SystemExit(LOCAL_REQUEUE_STATUS)
    if rank == 0:
        _requeue_with_scontrol(reason)
    raise SystemExit(0)


def _requeue_with_scontrol(reason: str) -> None:
    """Rank 0 in a user's own batch script: decide from Slurm's record, requeue or stop."""
    if shutil.which("scontrol") is None:
        _say("cannot requeue: scontrol is not on PATH here; submit with `slurmddp submit`, whose "
             "batch script requeues from outside the ranks")  # fmt: skip
        raise SystemExit(NOT_REQUEUED_STATUS)
    job = os.environ["SLURM_JOB_ID"]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    facts = decision.facts_from(os.environ, step_status=0, asked=reason,
                                job=decision.job_fields(shown.stdout))  # fmt: skip
    verdict = decision.decide(facts)
    if verdict.action not in ("requeue", "final"):
        _say_all(verdict.lines)
        raise SystemExit(verdict.status)
    if verdict.action == "final":
        _say_all(verdict.lines)
        # A preempted job is requeued by Slurm itself unless it is told not to be.
        subprocess.run(["scontrol", "update", f"JobId={job}", "Requeue=0"], capture_output=True)
        raise SystemExit(verdict.status)
    done = subprocess.run(["scontrol", "requeue", facts.target], capture_output=True, text=True)
    if done.returncode != 0:
        _say(f"scontrol requeue {facts.target} failed: {done.stderr.strip() or done.returncode}")
        raise SystemExit(NOT_REQUEUED_STATUS)
    _say_all(verdict.lines)


def requeue_route(environ: Mapping[str, str]) -> str:
    """Who requeues this job: "batch", "local", "scontrol", or "none" (not a Slurm job)."""
    if environ.get(REQUEUE_FILE_VAR):
        return "batch"
    if environ.get(LOCAL_RESTART_FILE_VAR):
        return "local"
    if environ.get("SLURM_JOB_ID"):
        return "scontrol"
    return "none"


def _rank() -> int:
    if "torch.distributed" in sys.modules:
        import torch.distributed as td

        if td.is_available() and td.is_initialized():
            return td.get_rank()
    return int(os.environ.get("RANK", "0"))


def _say(message: str) -> None:
    print(f"slurmddp: {message}", file=sys.stderr, flush=True)


def _say_all(lines: tuple[str, ...]) -> None:
    for line in lines:
        _say(line)


def _touch(path: str) -> None:
    try:
        Path(path).touch()
    except OSError as e:  # a marker must not fail the training
        _say(f"cannot write {path}: {e.strerror}")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

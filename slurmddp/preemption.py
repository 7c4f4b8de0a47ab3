"""The stop protocol: signal, agreed stop at a step boundary, checkpoint, requeue.

    slurmddp.init()                      # or run under `python -m slurmddp.run`: handlers installed
    for step in range(start, steps):
        train_step()
        if slurmddp.should_stop():       # same answer on every rank
            ckpt.save(step + 1, state)
            slurmddp.requeue()           # ends the process; the job comes back and resumes
    slurmddp.mark_done()                 # a late signal can no longer requeue the job

The stop signal (``$SLURMDDP_SIGNAL``, USR2 unless the batch script says otherwise) and SIGTERM
only set a flag: a handler that wrote a checkpoint or joined a collective could deadlock, since
it runs between two bytecodes of whatever the rank was doing. `should_stop` turns the flags of
all ranks into one answer with a single all_reduce.

Who requeues (`requeue_route`): the batch shell of ``slurmddp submit`` when it asked for it
(``$SLURMDDP_REQUEUE_FILE``: rank 0 leaves the reason there, the shell runs ``scontrol requeue``,
so ranks need no Slurm tools, e.g. in a container); the local emulation by submitit's requeue exit
status; otherwise rank 0 runs ``scontrol requeue`` itself, inside any Slurm job.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

SIGNAL_VAR = "SLURMDDP_SIGNAL"
REQUEUE_FILE_VAR = "SLURMDDP_REQUEUE_FILE"
DONE_FILE_VAR = "SLURMDDP_DONE_FILE"
MAX_REQUEUES_VAR = "SLURMDDP_MAX_REQUEUES"
LOCAL_RESTART_FILE_VAR = "SLURMDDP_LOCAL_RESTART_FILE"
DEFAULT_SIGNAL = "USR2"
DEFAULT_MAX_REQUEUES = 3

# submitit's LocalExecutor starts the tasks again when one exits with this status.
LOCAL_REQUEUE_STATUS = 144
# Stopped for good without finishing (no requeue left, or nothing can requeue): EX_TEMPFAIL,
# "try again later", which is what resubmitting from the checkpoint does.
NOT_REQUEUED_STATUS = 75

# Bits of what a rank saw and what all ranks agreed on. TERM stops the ranks like the stop signal
# does (the job is ending: scancel, the hard time limit), but only the stop signal requeues: a
# cancelled job must stay cancelled.
_STOP, _TERM = 1, 2
_seen = 0  # written only by the handler
_agreed = 0  # sticky once all ranks agreed to stop
_stop_signal: signal.Signals | None = None
_done = False
_calls = 0
_flag = None  # the all_reduce buffer, allocated once per process


def stop_signal(environ: Mapping[str, str]) -> signal.Signals:
    """The signal that announces preemption or the time limit: ``$SLURMDDP_SIGNAL`` or USR2."""
    name = environ.get(SIGNAL_VAR) or DEFAULT_SIGNAL
    try:
        return signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except KeyError:
        raise ValueError(f"{SIGNAL_VAR}={name!r} is not a signal name: use e.g. USR2") from None


def _on_signal(signum: int, frame: object) -> None:
    global _seen
    _seen |= _STOP if signum == _stop_signal else _TERM  # nothing else: no I/O, no collectives


def install(environ: Mapping[str, str] | None = None) -> tuple[signal.Signals, ...]:
    """Make the stop signal and SIGTERM set the stop flag instead of ending the process.

    Idempotent; a no-op outside the main thread (Python delivers signals only there).
    Returns the signals handled.
    """
    global _stop_signal
    if _stop_signal is None and threading.current_thread() is threading.main_thread():
        sig = stop_signal(os.environ if environ is None else environ)
        for s in {sig, signal.SIGTERM}:
            signal.signal(s, _on_signal)
        _stop_signal = sig
    return () if _stop_signal is None else tuple(sorted({_stop_signal, signal.SIGTERM}))


def received() -> signal.Signals | None:
    """What this process got (its own flag, not the agreed answer): the stop signal, TERM, None."""
    return _name_of(_seen)


def _name_of(bits: int) -> signal.Signals | None:
    if bits & _STOP:
        return _stop_signal
    return signal.SIGTERM if bits & _TERM else None


def flag_device(backend: str, cuda_index: int | None) -> str:
    """Where the agreement tensor must live: NCCL reduces only CUDA tensors, gloo and MPI CPU."""
    if backend == "nccl":
        if cuda_index is None:
            raise RuntimeError("an NCCL group needs a current CUDA device: call slurmddp.init()")
        return f"cuda:{cuda_index}"
    return "cpu"


def should_stop(every: int | None = None, group: object = None) -> bool:
    """Whether every rank should stop at this step boundary; the same answer on all ranks.

    Call it at the same points on every rank (it is a collective when a process group exists).
    By default the ranks communicate about once per `AGREE_EVERY_S` seconds of calls: each
    agreement also settles, from the slowest rank's pace, how many calls pass before the next,
    so a check at every step costs almost nothing and a signal is acted on within about a
    second. With `every` = N, exactly each N-th call communicates. Calls that do not communicate
    return the last answer. True once means True from then on. False after `mark_done`.
    """
    global _agreed, _calls
    install()
    if _done:
        return False
    if _agreed:
        return True
    _calls += 1
    if every is not None and every > 1 and _calls % every:
        return False
    if every is None and _calls < _pace.next_call:
        return False
    local = _seen
    agreed = _agree(local, group, every is None) if "torch.distributed" in sys.modules else local
    if agreed:
        _agreed = agreed
        if _rank() == 0:
            print(f"slurmddp: {_name_of(agreed).name} received: every rank stops at this "
                  "step boundary", file=sys.stderr, flush=True)  # fmt: skip
    return bool(agreed)


AGREE_EVERY_S = 1.0
MAX_CALLS_BETWEEN = 10_000


def calls_between(previous: int, seconds_per_call: float, target_s: float = AGREE_EVERY_S) -> int:
    """How many calls this rank proposes until the next agreement, at its measured pace.

    At most double the previous gap, so that a fast first stretch (or a slow step that is
    about to come) cannot push the next agreement far away at once.
    """
    if seconds_per_call <= 0:
        return min(2 * previous, MAX_CALLS_BETWEEN)
    return max(1, min(int(target_s / seconds_per_call), 2 * previous, MAX_CALLS_BETWEEN))


@dataclasses.dataclass
class _Pace:
    """When the adaptive agreement next communicates (a call count, the same on every rank)."""

    next_call: int = 0
    gap: int = 1
    since_call: int = 0
    since_time: float = 0.0

    def propose(self, calls: int) -> int:
        now = time.monotonic()
        gap = 1 if self.since_call == 0 else calls_between(
            self.gap, (now - self.since_time) / (calls - self.since_call))  # fmt: skip
        self.since_call, self.since_time = calls, now
        return gap

    def settle(self, calls: int, gap: int) -> None:
        self.gap, self.next_call = gap, calls + gap


_pace = _Pace()


def _agree(local: int, group: object, paced: bool) -> int:
    """The bits any rank saw, by one all_reduce (MAX) of three integers.

    The third settles the paced gap: MAX of the negated proposals is the smallest, so every rank
    waits for the same call, paced by the slowest.
    """
    import torch
    import torch.distributed as td

    if not (td.is_available() and td.is_initialized()) or td.get_world_size(group) == 1:
        return local
    global _flag
    backend = td.get_backend(group)
    cuda = torch.cuda.current_device() if backend == "nccl" else None
    device = flag_device(backend, cuda)
    if _flag is None or str(_flag.device) != device:
        _flag = torch.zeros(3, dtype=torch.int32, device=device)
    proposal = _pace.propose(_calls) if paced else 1
    # One copy from a host tensor: element-wise writes to a CUDA tensor would be three copies.
    _flag.copy_(torch.tensor([local & _STOP, local & _TERM, -proposal], dtype=torch.int32))
    td.all_reduce(_flag, op=td.ReduceOp.MAX, group=group)  # MAX per bit: NCCL has no bitwise OR
    stop, term, gap = _flag.tolist()
    if paced:
        _pace.settle(_calls, -gap)
    return stop | term


def _rank() -> int:
    if "torch.distributed" in sys.modules:
        import torch.distributed as td

        if td.is_available() and td.is_initialized():
            return td.get_rank()
    return int(os.environ.get("RANK", "0"))


def requeue_route(environ: Mapping[str, str]) -> str:
    """Who requeues this job: "batch", "local", "scontrol", or "none" (not a Slurm job)."""
    if environ.get(REQUEUE_FILE_VAR):
        return "batch"
    if environ.get(LOCAL_RESTART_FILE_VAR):
        return "local"
    if environ.get("SLURM_JOB_ID"):
        return "scontrol"
    return "none"


def requeue_target(environ: Mapping[str, str]) -> str:
    """The id `scontrol requeue` takes: ``<array job>_<task>`` for an array task, else the job."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ["SLURM_JOB_ID"]


def requeue_budget(environ: Mapping[str, str]) -> tuple[int, int]:
    """(restarts so far, requeues allowed), from SLURM_RESTART_COUNT and $SLURMDDP_MAX_REQUEUES."""
    restarts = environ.get("SLURM_RESTART_COUNT") or "0"
    allowed = environ.get(MAX_REQUEUES_VAR) or str(DEFAULT_MAX_REQUEUES)
    if not (restarts.isascii() and restarts.isdigit() and allowed.isascii() and allowed.isdigit()):
        raise ValueError(
            f"SLURM_RESTART_COUNT={restarts!r} or {MAX_REQUEUES_VAR}={allowed!r} is not a count"
        )
    return int(restarts), int(allowed)


def mark_done() -> None:
    """Record that the job finished its work: no later signal stops or requeues it.

    Rank 0 also leaves the batch script's done marker, so that a job Slurm requeues anyway
    (preempted while exiting) does not run again.
    """
    global _done
    _done = True
    install()  # a late signal must not end the process either
    path = os.environ.get(DONE_FILE_VAR)
    if path and _rank() == 0:
        Path(path).touch()


def requeue() -> NoReturn:
    """End this process so that the job is requeued; call it on every rank after the checkpoint.

    Waits for any asynchronous checkpoint still being written first. Raises SystemExit: status 0
    when the batch script requeues, submitit's requeue status under local emulation, and
    75 when no requeue is left or nothing can requeue the job (the message says which).
    """
    if "slurmddp.checkpoint" in sys.modules:
        from slurmddp.checkpoint import wait_for_saves

        wait_for_saves()  # never announce a requeue before the checkpoint is on disk
    if _done:
        _say("the job is marked done: not requeued")
        raise SystemExit(0)
    why = _name_of(_agreed or _seen)  # agreed: this rank may not have got one itself
    if why == signal.SIGTERM:
        _say("stopped by TERM after the checkpoint: the job is being cancelled or its time is "
             f"up, so it is not requeued (only {_stop_signal.name[3:]} requeues)")  # fmt: skip
        raise SystemExit(NOT_REQUEUED_STATUS)
    reason = why.name[3:] if why is not None else "request"
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
    restarts, allowed = requeue_budget(os.environ)
    if restarts >= allowed:
        _say(
            f"stopped by {reason} at restart {restarts}: not requeued, the limit of {allowed} "
            "requeues is reached (--max-requeues); submit again to resume from the checkpoint"
        )
        raise SystemExit(NOT_REQUEUED_STATUS)
    if route == "local":
        if rank == 0:
            _write_atomically(Path(os.environ[LOCAL_RESTART_FILE_VAR]), f"{restarts + 1}\n")
            _say(f"stopped by {reason} at restart {restarts}: requeued "
                 f"({restarts + 1} of {allowed})")  # fmt: skip
        raise SystemExit(LOCAL_REQUEUE_STATUS)
    if rank == 0:
        _scontrol_requeue(requeue_target(os.environ), reason, restarts, allowed)
    raise SystemExit(0)


def _scontrol_requeue(target: str, reason: str, restarts: int, allowed: int) -> None:
    if shutil.which("scontrol") is None:
        _say("cannot requeue: scontrol is not on PATH here; submit with `slurmddp submit`, whose "
             "batch script requeues from outside the ranks")  # fmt: skip
        raise SystemExit(NOT_REQUEUED_STATUS)
    done = subprocess.run(["scontrol", "requeue", target], capture_output=True, text=True)
    if done.returncode != 0:
        _say(f"scontrol requeue {target} failed: {done.stderr.strip() or done.returncode}")
        raise SystemExit(NOT_REQUEUED_STATUS)
    _say(f"stopped by {reason} at restart {restarts}: job {target} requeued "
         f"({restarts + 1} of {allowed})")  # fmt: skip


def _say(message: str) -> None:
    print(f"slurmddp: {message}", file=sys.stderr, flush=True)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

"""A Python function run as a job: what every rank does with it.

`slurmddp.batch.functions.executor` pickles the call (a submitit ``DelayedSubmission``: function,
args, kwargs) into the job's *call directory*, and each rank runs

    python -m slurmddp.run -m slurmddp.batch.functions.call CALL_DIR --task I   (or --task array)

so the rank's place and the process group's environment are set up by the runner as for any
script. Each rank calls the function and leaves its outcome (value, or exception and traceback)
in ``task-<I>/run-<R>/rank-<rank>.pkl``, R counting the job's requeues, so that a requeued run
never mixes with an earlier one's files. The submitter reads rank 0's value (``job.result()``).

The stop protocol: the function calls `slurmddp.should_stop()` at its step boundaries and
returns once it says True. Then every rank calls the function's ``checkpoint(*args, **kwargs)``
(submitit's `Checkpointable`, or ``__submitit_checkpoint__``) and rank 0 keeps the
``DelayedSubmission`` it returns as ``task-<I>/next.pkl``: the next run calls that instead (the
call as pickled before, again, when there is no such method or it returns None). Then the job
is requeued. A
function that returns without a stop marks the job done (`slurmddp.mark_done`).

The call directory's files are written by the submitter and by the job's own ranks, in the
user's output directory: unpickling them is running the user's own code, as submitit does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
from submitit.helpers import DelayedSubmission

from slurmddp import dist, files
from slurmddp.preemption import api, decision
from slurmddp.protocol import CODE_DIR_VAR

CALL = "call.pkl"  # what the first run calls
NEXT = "next.pkl"  # what checkpoint() gave at the last agreed stop: later runs call it instead
ARRAY = "array"  # --task array: the index is the Slurm array task's


def task_dir(root: Path, task: int) -> Path:
    """Where task `task` of a call directory keeps its call and its runs' outcomes."""
    return root / f"task-{task}"


def run_dir(task: Path, restart: int) -> Path:
    """The outcomes of a task's run after `restart` requeues."""
    return task / f"run-{restart}"


def rank_file(run: Path, rank: int) -> Path:
    return run / f"rank-{rank}.pkl"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a rank's call ended. The value (or exception) is pickled apart, in `payload`: one that
    cannot be unpickled where the job was submitted still leaves the rest readable."""

    rank: int
    world_size: int
    host: str
    ended: float  # time.time(): the first rank to fail is the likely cause of the others
    ok: bool
    payload: bytes  # cloudpickle of the value, or of the exception; b"" when it could not be
    error_text: str = ""  # "ValueError: boom"
    traceback: str = ""

    def load(self) -> Any:
        """The value, or the exception (None when it could not be pickled)."""
        return pickle.loads(self.payload) if self.payload else None


def write_call(path: Path, call: DelayedSubmission, sys_path: str | None) -> None:
    """Pickle `call` to `path` (atomically), with the directory its function imports from."""
    files.write_atomically(path, pickle.dumps({"sys_path": sys_path,
                                               "call": cloudpickle.dumps(call)}))  # fmt: skip


def read_call(path: Path) -> tuple[DelayedSubmission, str | None]:
    """The call pickled at `path`, and its import directory. That directory goes on sys.path
    first, unless the job runs a code snapshot (the runner put the copy of it there already)."""
    saved = pickle.loads(path.read_bytes())
    head = saved["sys_path"]
    if head and not os.environ.get(CODE_DIR_VAR) and head not in sys.path:
        sys.path.insert(0, head)
    call = pickle.loads(saved["call"])
    if not isinstance(call, DelayedSubmission):
        raise TypeError(f"{path} holds a {type(call).__name__}, not a call")
    return call, head


def read_outcome(path: Path) -> Outcome:
    out = pickle.loads(path.read_bytes())
    if not isinstance(out, Outcome):
        raise TypeError(f"{path} holds a {type(out).__name__}, not a rank's outcome")
    return out


def checkpoint_of(call: DelayedSubmission) -> DelayedSubmission | None:
    """What the function's checkpoint method (submitit's rule for finding it) returns."""
    method = getattr(call.function, "__submitit_checkpoint__", None)
    if method is None:
        method = getattr(call.function, "checkpoint", None)
    if method is None:
        return None
    nxt = method(*call.args, **call.kwargs)
    if nxt is not None and not isinstance(nxt, DelayedSubmission):
        raise TypeError(f"checkpoint() returned a {type(nxt).__name__}, not a DelayedSubmission")
    return nxt


def _outcome(rank: int, value: Any = None, error: BaseException | None = None) -> Outcome:
    """A rank's outcome; raises TypeError when its value cannot be pickled."""
    try:
        payload = cloudpickle.dumps(value if error is None else error)
    except Exception as e:
        if error is None:  # the call worked, but its value cannot reach the submitter
            raise TypeError(f"the function returned a {type(value).__name__}, which cannot be "
                            f"pickled: {e}") from e  # fmt: skip
        payload = b""  # the exception's text and traceback still say what happened
    text = "" if error is None else "".join(traceback.format_exception_only(type(error), error))
    return Outcome(
        rank=rank,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        # Slurm's name of the node (as squeue and the batch log say it), else the host's.
        host=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        ended=time.time(),
        ok=error is None,
        payload=payload,
        error_text=text.strip(),
        traceback="" if error is None else "".join(traceback.format_exception(error)),
    )


def run(root: Path, task: int) -> None:
    """Call task `task` of the call directory `root` on this rank (see the module's docstring)."""
    here = task_dir(root, task)
    restart = decision.requeue_budget(os.environ)[0]
    rank = dist.rank()  # the launcher's: the function may start and end a process group
    out = rank_file(run_dir(here, restart), rank)
    # Made at the start: the newest run directory is the last run that started, even one whose
    # ranks were all killed before they could say anything.
    files.make_dirs(out.parent)
    try:
        call, sys_path = read_call(here / NEXT if (here / NEXT).exists() else here / CALL)
        value = call.function(*call.args, **call.kwargs)
        state = api.state()
        if state.agreed and not state.done:
            nxt = checkpoint_of(call)  # on every rank: each may hold part of the state
            if rank == 0 and nxt is not None:  # else the call as it was pickled, again
                write_call(here / NEXT, nxt, sys_path)
            api.requeue()
        outcome = _outcome(rank, value)
    except SystemExit:
        raise  # slurmddp.requeue(), or sys.exit() in the function: the process ends as asked
    except BaseException as e:
        files.write_atomically(out, pickle.dumps(_outcome(rank, error=e)))
        raise  # the runner says it (and the batch log names the first rank that failed)
    files.write_atomically(out, pickle.dumps(outcome))
    api.mark_done()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m slurmddp.batch.functions.call")
    p.add_argument("root", type=Path, help="the call directory")
    p.add_argument("--task", default="0", help=f"the task's index, or {ARRAY!r}")
    opts = p.parse_args(argv)
    task = os.environ.get("SLURM_ARRAY_TASK_ID", "") if opts.task == ARRAY else opts.task
    if not task.isdigit():
        p.error(f"--task {opts.task!r}: not an index (nor in an array job)")
    run(opts.root, int(task))


if __name__ == "__main__":
    # Run as the module it is, not as __main__: the outcomes it pickles must name their class
    # by its importable name.
    from slurmddp.batch.functions import call as _this

    _this.main()

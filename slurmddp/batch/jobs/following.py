"""Following a job: its state changes and rank 0's log, streamed until it ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from slurmddp.batch.jobs.registry import JobRecord
from slurmddp.batch.jobs.status import UNKNOWN, counted, is_final, local_state
from slurmddp.errors import warn


def follow(
    record: JobRecord,
    state_of: Callable[[], str],
    out: TextIO = sys.stdout,
    *,
    poll_s: float = 1.0,
    max_poll_s: float = 10.0,
    settle_s: float = 0.5,
) -> str:
    """Print state changes and stream rank 0's log until the job reaches a final state; the log's
    last lines come before the final state's line. An array job's states are its tasks' counts
    (its tasks' logs are theirs: `slurmddp status -v` lists them).

    Polls back off from `poll_s` to `max_poll_s` while nothing changes. Returns the final state
    (COMPLETED for an array whose tasks all completed, else its counts). On Ctrl-C, says in one
    line (stderr) that the job goes on, and lets KeyboardInterrupt through.
    """
    last, offset, delay = "", 0, poll_s
    try:
        while True:
            state = state_of().strip()
            array = counted(state)
            if not array:
                state = (state.split() or [UNKNOWN])[0]  # sacct may say "CANCELLED by 0"
            final = is_final(state)
            # sacct may not know a job for a moment after sbatch
            if not final and state != last and state != UNKNOWN:
                print(f"[slurmddp] job {record.job_id}: {state}", file=out, flush=True)
                last, delay = state, poll_s
            if not array:
                offset = _copy_new(record.log(0), offset, out)
            if final:
                if not array:
                    _drain(record.log(0), offset, out, settle_s)
                print(f"[slurmddp] job {record.job_id}: {state}", file=out, flush=True)
                if array and state.startswith("COMPLETED ") and "," not in state:
                    return "COMPLETED"  # every task completed
                return state
            time.sleep(delay)
            delay = min(delay * 1.5, max_poll_s)
    except KeyboardInterrupt:
        out.flush()
        warn(_left_running(record, last))
        raise


def _left_running(record: JobRecord, last: str) -> str:
    """What a Ctrl-C during follow leaves behind, in one line."""
    j = record.job_id
    if record.engine == "local":
        # A --local job's processes are in the terminal's process group: its Ctrl-C reached them
        # too, and submitit's controller takes a few seconds to end the ranks.
        deadline = time.monotonic() + 5
        while (last := local_state(record)) == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.1)
        if last != "RUNNING":
            return f"stopped following job {j}, which ended with it ({last})"
    return (f"stopped following job {j}; the job goes on ({last or 'queued'}): slurmddp status "
            f"{j}, slurmddp logs {j} -f; slurmddp cancel {j} ends it")  # fmt: skip


def _drain(path: Path, offset: int, out: TextIO, settle_s: float) -> int:
    """Copy what is left of `path`: its last lines can land just after the state changed (a
    node's file system is behind), so read again until it stops growing (a few rounds at most)."""
    for _ in range(5):
        time.sleep(settle_s)
        grown = _copy_new(path, offset, out)
        if grown == offset:
            break
        offset = grown
    return offset


def _copy_new(path: Path, offset: int, out: TextIO) -> int:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    if chunk:
        out.write(chunk.decode("utf-8", "replace"))
        out.flush()
    return offset + len(chunk)

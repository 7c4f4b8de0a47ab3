"""Following a job: its state changes, its events and rank 0's log, streamed until it ends."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from slurmddp.batch.jobs import status
from slurmddp.batch.jobs.registry import JobRecord
from slurmddp.batch.jobs.status import UNKNOWN, counted, is_final, local_state
from slurmddp.errors import warn
from slurmddp.story import events, summary


def follow(
    record: JobRecord,
    state_of: Callable[[], str],
    out: TextIO = sys.stdout,
    *,
    settle_s: float = 0.5,
) -> str:
    """Stream rank 0's log, the job's events (`slurmddp.story`: a run started, a stop, a
    checkpoint, a requeue, a resume, a node left behind...) and its state changes until it
    reaches a final state; then the log's last lines, the summary (runs, steps and time lost,
    goodput) and the final state. An array job's states are its tasks' counts (its tasks' logs
    and stories are theirs: `slurmddp status -v` lists them).

    Slurm is asked for the state at most every `status.MAX_POLL_S` once nothing changes (every
    `FOLLOWED_POLL_S` while the job's events flow, which tell its runs' starts and ends); within
    a second once the events say the last run ended. A local job's state costs no call: it is
    looked at each tick. Returns the final state (COMPLETED for an array whose tasks all
    completed, else its counts). On Ctrl-C, says in one line (stderr) that the job goes on, and
    lets KeyboardInterrupt through.
    """
    j = record.job_id
    story, told = events.Tail(record.events_path), []
    last, offset = "", 0
    pause, next_ask = status.FIRST_POLL_S, 0.0
    try:
        while True:
            new = [] if record.array else story.new()  # an array's tasks keep their own
            told += new
            if new:
                offset = _copy_new(record.log(0), offset, out)  # the lines before the event
            for event in new:
                if line := events.describe(event):
                    print(f"[slurmddp] job {j}: {line}", file=out, flush=True)
            now = time.monotonic()
            if any(e["kind"] in ("run", "decision") for e in new):
                next_ask, pause = min(next_ask, now + status.FIRST_POLL_S), status.FIRST_POLL_S
            if record.engine == "local" or now >= next_ask or (events.ended(told) and
                                                               pause > status.FIRST_POLL_S):
                state = state_of().strip()
                array = counted(state)
                if not array:
                    state = (state.split() or [UNKNOWN])[0]  # sacct may say "CANCELLED by 0"
                final = is_final(state)
                # sacct may not know a job for a moment after sbatch, nor that it started, which
                # its events may already have said
                stale = state == "PENDING" and _running(told)
                if not final and state != last and state != UNKNOWN and not stale:
                    print(f"[slurmddp] job {j}: {state}", file=out, flush=True)
                    last, pause = state, status.FIRST_POLL_S
                if final:
                    if not array:
                        _drain(record.log(0), offset, out, settle_s)
                        told += story.new()
                        if told:
                            for line in summary.summarize(told, time.time()).lines():
                                print(f"[slurmddp] job {j}: {line}", file=out, flush=True)
                    print(f"[slurmddp] job {j}: {state}", file=out, flush=True)
                    if array and state.startswith("COMPLETED ") and "," not in state:
                        return "COMPLETED"  # every task completed
                    return state
                soon = events.ended(told)
                top = FOLLOWED_POLL_S if told else status.MAX_POLL_S
                pause = status.FIRST_POLL_S if soon else min(pause * 1.5, top)
                next_ask = now + pause
            if not record.array:
                offset = _copy_new(record.log(0), offset, out)
            time.sleep(status.TICK_S)
    except KeyboardInterrupt:
        out.flush()
        warn(_left_running(record, last))
        raise


def _running(told: list[events.Event]) -> bool:
    """Whether the events say a run has started and not ended."""
    ends = [e["kind"] for e in told if e["kind"] in ("run", "decision")]
    return bool(ends) and ends[-1] == "run"


# While a job's events flow, they tell what a user follows; Slurm is asked for the state this
# often at most (one sacct): 120 calls an hour, and a few more as each run ends.
FOLLOWED_POLL_S = 30.0


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
    node's file system is behind), so read again until it stops growing (a few rounds at most);
    then a last line without its newline, ended by one."""
    for _ in range(5):
        time.sleep(settle_s)
        grown = _copy_new(path, offset, out)
        if grown == offset:
            break
        offset = grown
    return _copy_new(path, offset, out, whole_lines=False)


def _copy_new(path: Path, offset: int, out: TextIO, *, whole_lines: bool = True) -> int:
    """Copy `path` from `offset` to its last newline (to its end, newline added, unless
    `whole_lines`): an event printed after it must not cut a line the job is writing in two.
    The new offset."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    taken = chunk.rfind(b"\n") + 1 if whole_lines else len(chunk)
    text = chunk[:taken].decode("utf-8", "replace")
    if text:
        out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
    return offset + taken

"""The job's events file: append one event (`emit`), read them back (`read`, `Tail`), say one in
words (`describe`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmddp.errors import first_time, warn
from slurmddp.files import FILE_MODE
from slurmddp.protocol import EVENTS_FILE_VAR

Event = dict[str, Any]

# The kinds that end a run, and those after which the job runs no more.
RUN_ENDS = ("decision",)
FINAL_ACTIONS = ("done", "finished", "stop", "final", "fail")


def emit(kind: str, environ: Mapping[str, str] = os.environ, **fields: Any) -> None:
    """Append one event of `kind` to the job's events file: the time, the run (Slurm's restart
    count) and `fields`. Nothing outside a slurmddp job; a file that cannot be written is said
    once per process, and the caller goes on."""
    path = environ.get(EVENTS_FILE_VAR)
    if not path:
        return
    run = environ.get("SLURM_RESTART_COUNT", "0")
    event = {"t": round(time.time(), 3), "kind": kind,
             "run": int(run) if run.isdigit() else 0, **fields}  # fmt: skip
    line = (json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    try:
        # One write of one line, appended: lines of several writers never interleave (O_APPEND).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        if first_time("events"):
            warn(f"cannot write the job's events to {path} ({e.strerror}): `slurmddp status` and "
                 "`report` will miss this run's story; the job goes on")  # fmt: skip


def read(path: Path) -> list[Event]:
    """Every event of the file, in order; a torn or foreign line is skipped. [] without one."""
    return Tail(path).new()


class Tail:
    """A reader that returns the events appended since its last call (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def new(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for later
        self.offset += len(whole)
        out = []
        for line in whole.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get("kind"), str):
                out.append(event)
        return out


def ended(events: list[Event]) -> bool:
    """Whether the job's last run ended it (a decision after which nothing runs again)."""
    for event in reversed(events):
        if event["kind"] == "decision":
            return event.get("action") in FINAL_ACTIONS
        if event["kind"] == "run":
            return False
    return False


def start(told: list[Event], run: int) -> Event | None:
    """The ``run`` event of `run`'s start (the last, where a run was told twice); None where
    it never started."""
    return next((e for e in reversed(told) if e.get("run") == run and e["kind"] == "run"), None)


def undecided(told: list[Event], run: int) -> str | None:
    """The nodes `run` started on, when it left no decision: the job was taken from it (Slurm
    requeued it); None when it decided, never started, or `run` is below 0."""
    started = start(told, run)
    if run < 0 or started is None or any(e.get("run") == run and e["kind"] == "decision"
                                         for e in told):  # fmt: skip
        return None
    return str(started.get("nodes") or "")


def size(n: float) -> str:
    """Bytes in words: 1.5 GB, 340 kB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError


def describe(event: Event) -> str | None:
    """The event in one line for a person following the job; None for those only counted
    (``training``, ``progress``, ``end``)."""
    kind, run = event["kind"], event.get("run", 0)
    if kind == "run":
        return f"run {run + 1} started on {event.get('nodes') or 'its nodes'}"
    if kind == "stop":
        why = "the time limit is near and no signal came" if event.get("self") \
            else f"{event.get('signal', 'a signal')} received"  # fmt: skip
        return f"stop requested ({why}): every rank stops after step {event.get('step', '?')}"
    if kind == "checkpoint":
        return (f"checkpoint of step {event.get('step')} written ({size(event.get('bytes', 0))}, "
                f"{event.get('seconds', 0):.1f} s): {event.get('path', '')}")  # fmt: skip
    if kind == "resumed":
        return f"resumed at step {event.get('step')} from {event.get('source', '?')}"
    if kind == "hang":
        return "hang: " + " ".join(event.get("lines", ()))[:300]
    if kind == "slow":
        return f"slow node: {event.get('line') or event.get('node', '?')}"
    if kind == "agent":
        return str(event.get("line", ""))
    if kind == "done":
        return f"the work is done (step {event.get('step', '?')})"
    if kind == "decision":
        cause = event.get("cause", "")
        behind = f"; {event['left_behind']} left behind" if event.get("left_behind") else ""
        if event.get("action") == "requeue":
            return f"requeued ({event.get('requeue')} of {event.get('allowed')}): {cause}{behind}"
        return f"run {run + 1} ended: {cause} (exit status {event.get('status')})"
    return None

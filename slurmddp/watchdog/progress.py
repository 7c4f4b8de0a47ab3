"""The rank's side of the watchdog: count progress, publish it, answer the monitor.

`heartbeat` is all a training loop pays: one addition. The `Reporter` thread does the rest, a
`layout.period_s` apart: it writes the count, and its busy time per step (`pace`), when the count
changed; once its own count has stood still
for two periods it also looks for the monitor's request (then writes its stacks) and its end
(then ends the process with `HANG_STATUS`). `arm` starts it at the rendezvous, and on global rank
0 starts the monitor too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurmddp import files
from slurmddp.errors import warn
from slurmddp.protocol import ASKED_FILE_VAR, HANG_STATUS
from slurmddp.watchdog import layout as layout_
from slurmddp.watchdog import pace, stacks
from slurmddp.watchdog.layout import Layout, Progress

_count = 0
_reporter: Reporter | None = None
_monitor: subprocess.Popen | None = None


def heartbeat() -> None:
    """Tell the hang watchdog that this rank made progress; `should_stop()` does it too.

    For loops that call neither elsewhere; it costs one addition (no communication, no I/O).
    """
    global _count
    _count += 1


def finish() -> None:
    """The work is done (`mark_done`): the watchdog judges this run no more."""
    if _reporter is not None:
        _reporter.publish(done=True)


class Reporter:
    """The daemon thread of one rank (see the module's docstring)."""

    def __init__(self, where: Layout, timeout_s: float, rank: int, node: str) -> None:
        self.layout, self.rank, self.node = where, rank, node
        self.period = layout_.period_s(timeout_s)
        self._written: Progress | None = None
        self._pace = pace.Pace()
        self._thread = threading.get_native_id()  # the training thread: it arms the watchdog
        self._lock = threading.Lock()

    def start(self) -> None:
        self.layout.progress(self.rank).parent.mkdir(parents=True, exist_ok=True)
        self.publish()
        threading.Thread(target=self._run, name="slurmddp-hang-watchdog", daemon=True).start()

    def publish(self, done: bool = False) -> bool:
        """Write this rank's progress if it changed; whether it did."""
        with self._lock:
            count, before = _count, self._written
            done = done or bool(before and before.done)
            measured = (before.pace_s, before.step_s) if before else (None, None)
            if before is None or count != before.count:
                fresh = self._pace.update(count, pace.busy_s(self._thread), time.monotonic())
                measured = measured if fresh is None else fresh
            now = Progress(count, self.node, done, *measured)
            if now == before:
                return False
            try:
                files.write_atomically(self.layout.progress(self.rank), now.text())
            except OSError as e:
                warn(f"the hang watchdog cannot write {self.layout.progress(self.rank)}: "
                     f"{e.strerror}")  # fmt: skip
                return False
            self._written = now
            return True

    def _run(self) -> None:
        still = 0.0  # seconds this rank's count has stood still
        dumped = False
        while True:
            time.sleep(self.period)
            if self.publish():
                still, dumped = 0.0, False
                continue
            still += self.period
            if still < 2 * self.period:
                continue
            if not dumped and self.layout.request.exists():
                self.dump()
                dumped = True
            if self.layout.end.exists():
                warn(f"rank {self.rank} ends: the hang watchdog judged the job hung "
                     f"({self.layout.report})")
                os._exit(HANG_STATUS)

    def dump(self) -> None:
        """Write this process's stacks (every thread) and, where torch keeps one, NCCL's record."""
        threads = stacks.threads()
        main = next(iter(threads.values()), [])
        record = _flight_record()
        header = {"rank": self.rank, "node": self.node, "pid": os.getpid(),
                  "run": self.layout.run, "count": _count, "collectives": collectives(record),
                  "waiting": stacks.waiting_in(main), "site": stacks.call_site(main)}  # fmt: skip
        try:
            if record is not None:
                files.write_atomically(self.layout.flight_record(self.rank), record)
            files.write_atomically(self.layout.stacks(self.rank), stacks.render(header, threads))
        except OSError as e:
            warn(f"the hang watchdog cannot write this rank's stacks: {e.strerror}")


def _flight_record() -> bytes | None:
    """torch's flight recorder (the last collectives of every process group, NCCL's and gloo's)
    as JSON, where torch keeps one (torch 2.13 does by default; ``TORCH_FR_BUFFER_SIZE``)."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json",
                                                                   None)  # older torch
    try:
        return None if dump is None else bytes(dump())
    except Exception:  # no group recorded, or a torch without the recorder: the stacks say much
        return None


def collectives(record: bytes | None) -> int | None:
    """How many collectives the default process group had enqueued, from a flight record."""
    if record is None:
        return None
    try:
        status = json.loads(record)["pg_status"]["0"]
        return int(status["last_enqueued_collective"])
    except (ValueError, KeyError, TypeError):
        return None


def arm(rank: int, world_size: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Start this rank's reporter (and on rank 0 the monitor), once per process; False when the
    watchdog is off or cannot run here (the run goes on without it, warned)."""
    global _reporter, _monitor
    settings = layout_.from_env(environ)
    if settings is None or _reporter is not None:
        return False
    where, timeout = settings
    node = environ.get("SLURMD_NODENAME") or os.uname().nodename
    reporter = Reporter(where, timeout, rank, node)
    try:
        reporter.start()
    except OSError as e:
        warn(f"no hang watchdog: cannot write in {where.hang_dir}: {e.strerror}")
        return False
    _reporter = reporter
    if rank == 0:
        asked = environ.get(ASKED_FILE_VAR)
        # The same script reported progress in an earlier run: judged from the rendezvous on.
        from_start = bool(asked) and Path(str(asked)).exists()
        _monitor = subprocess.Popen(
            [sys.executable, "-m", "slurmddp.watchdog.monitor", str(where.hang_dir),
             "--run", where.run, "--world-size", str(world_size), "--timeout", f"{timeout:g}",
             "--parent", str(os.getpid()), *(["--from-start"] if from_start else [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # its verdict goes to stderr
        )  # fmt: skip
    return True

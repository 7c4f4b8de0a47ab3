"""The watchdog's monitor: ``python -m slurmddp.watchdog.monitor HANG_DIR --run R ...``.

Started by global rank 0 at the rendezvous, a process of its own (rank 0 may be the one that is
stopped). It reads the ranks' progress files a period apart until the run is hung, done, or its
parent (rank 0) is gone; on a hang it asks for the stacks, judges, writes the report and the
run's verdict, prints the verdict (into rank 0's log), and ends the run: the ranks that can, exit;
if rank 0 did not answer or is still there after a grace period, the monitor kills it, and
``srun --kill-on-bad-exit`` the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurmddp import files
from slurmddp.story import events
from slurmddp.watchdog import layout as layout_
from slurmddp.watchdog import pace, stacks, verdict
from slurmddp.watchdog.layout import Layout, Progress


def read_progress(where: Layout, world_size: int) -> dict[int, Progress]:
    out = {}
    for rank in range(world_size):
        with contextlib.suppress(OSError):
            p = Progress.parse(where.progress(rank).read_text())
            if p is not None:
                out[rank] = p
    return out


def read_dumps(where: Layout, world_size: int) -> dict[int, dict[str, Any]]:
    """The headers of this run's stack files (an earlier hang's are not this run's)."""
    out = {}
    for rank in range(world_size):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            h = stacks.header(where.stacks(rank).read_text())
            if h is not None and h.get("run") == where.run and h.get("rank") == rank:
                out[rank] = h
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(where: Layout, world_size: int, timeout_s: float, parent: int,
          from_start: bool) -> int:  # fmt: skip
    period = layout_.period_s(timeout_s)
    seen = verdict.Watch(timeout_s, time.monotonic(), from_start)
    pacing = pace.Watch()
    told: dict[int, int] = {}
    while True:
        # Rank 0's end is noticed within a second: nothing of the job lingers after it.
        next_look = time.monotonic() + period
        while time.monotonic() < next_look:
            time.sleep(min(1.0, period))
            if os.getppid() != parent:
                return 0
        if where.end.exists():
            return 0
        now = time.monotonic()
        progress = read_progress(where, world_size)
        seen.observe(progress, now)
        told = _tell(progress, told)
        if fresh := pacing.observe(progress):
            _name_slow(where, fresh, pacing.ever)
        if seen.done:
            return 0
        if seen.hung(now):
            idle = seen.idle_s(now)
            break
    files.write_atomically(where.request, "stacks\n")
    deadline = time.monotonic() + layout_.dump_wait_s(timeout_s)
    dumps = read_dumps(where, world_size)
    while len(dumps) < world_size and time.monotonic() < deadline:
        time.sleep(0.5)
        dumps = read_dumps(where, world_size)
    judged = verdict.judge(world_size, progress, dumps, idle, timeout_s,
                           str(where.hang_dir / "rank-<R>.txt"))  # fmt: skip
    text = "".join(f"{line}\n" for line in judged.lines)
    # Before the verdict, which the supervisor looks for: their node may be left behind.
    files.write_atomically(where.suspects, "".join(
        f"{r} {progress[r].node}\n" for r in judged.stuck if r in progress))
    files.write_atomically(where.report, text)
    files.write_atomically(where.verdict, text)
    print(text, end="", file=sys.stderr, flush=True)
    files.write_atomically(where.end, "hung\n")
    if 0 not in dumps:
        os.kill(parent, signal.SIGKILL)
        return 0
    deadline = time.monotonic() + 2 * period + 5
    while time.monotonic() < deadline and _alive(parent) and os.getppid() == parent:
        time.sleep(0.5)
    if os.getppid() == parent:
        os.kill(parent, signal.SIGKILL)  # rank 0 could not leave by itself
    return 0


def _tell(progress: dict[int, Progress], told: dict[int, int]) -> dict[int, int]:
    """Each rank's count and busy seconds a step, for the job's story (steps per second and
    busy time over time), when a count changed; each rank's node the first time."""
    counts = {rank: p.count for rank, p in progress.items()}
    if any(counts.values()) and counts != told:  # nothing before the first step
        extra: dict[str, Any] = {}
        if not told:
            extra["nodes"] = {str(rank): p.node for rank, p in progress.items()}
        if busy := {str(r): round(p.pace_s, 6) for r, p in progress.items()
                    if p.pace_s is not None}:  # fmt: skip
            extra["busy"] = busy
        events.emit("progress", counts={str(r): c for r, c in counts.items()}, **extra)
    return counts


def _name_slow(where: Layout, fresh: list[pace.Slow], ever: dict[str, pace.Slow]) -> None:
    """Say which nodes are slow (rank 0's log, the job's story) and leave every node named in
    this run in its ``slow`` file, for the decision at its end."""
    for slow in fresh:
        print(f"slurmddp: {slow.line()}", file=sys.stderr, flush=True)
        events.emit("slow", node=slow.node, ranks=list(slow.ranks), factor=round(slow.factor, 2),
                    busy_s=round(slow.pace_s, 6), median_s=round(slow.median_s, 6),
                    line=slow.line())  # fmt: skip
    try:
        files.write_atomically(where.slow, "".join(f"{s.node} {s.why()}\n" for s in ever.values()))
    except OSError as e:  # the watchdog goes on: only the requeue's choice of nodes misses it
        print(f"slurmddp: cannot write {where.slow}: {e.strerror}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurmddp.watchdog.monitor")
    p.add_argument("hang_dir", type=Path)
    p.add_argument("--run", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--from-start", action="store_true")
    args = p.parse_args(argv)
    # The stop signals are the ranks' business; the job's end (TERM) ends the monitor too.
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        return watch(Layout(args.hang_dir, args.run), args.world_size, args.timeout, args.parent,
                     args.from_start)  # fmt: skip
    except OSError as e:
        print(f"slurmddp: the hang watchdog stops: {e}", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())

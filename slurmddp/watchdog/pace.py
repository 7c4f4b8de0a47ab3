"""Slow nodes, named: how long each rank is busy for a step, against the median rank.

In data-parallel training every rank waits for the slowest at each collective, so all of them
take the same steps per second: a throttled CPU, a noisy neighbour or a node short of cores shows
only as a job that crawls. What differs is where each rank spends a step. A rank on a good node
computes, then sleeps in the collective (blocked, not running); a rank on a slow node runs, or
waits for a CPU it may not have (the kernel's ``run_delay``: a cgroup's ``cpu.max`` quota spent,
cores taken by others), for most of the step. So:

- **Each rank** (`Pace`, in the watchdog's `progress.Reporter` thread, once a period when its
  count moved) reads the kernel's ``/proc/self/task/*/schedstat`` (every thread: time run, time
  waited for a CPU) and publishes its *busy seconds per step* over its last periods (the median
  of `WINDOW`) in its progress file. No collective, no I/O beyond the file it writes anyway.
- **The monitor** (`Watch`, pure) takes the median rank's busy time as the reference; a rank busy
  at least `FACTOR` times as long (and `MIN_EXTRA_S` more) is slow. A node whose ranks are slow
  at `CONFIRM` looks in a row is named once: a line in rank 0's log, a ``slow`` event in the
  job's story, and the run's ``slow`` file, from which ``--leave-slow-nodes`` leaves it out at the
  job's next requeue (`slurmddp.preemption.decision`).

A rank's pace is first published after two periods of progress and settles within `WINDOW`, so a
node that slows down is named within ``WINDOW + CONFIRM + 1`` periods (a period: a tenth of the
hang timeout, between 1 and 30 s). What this does not see: a GPU that computes slowly while its
rank's CPU thread spins in a CUDA synchronisation (busy on every rank alike); a rank slow in the
work of other processes (its DataLoader's workers). Linux only; without schedstat (a kernel
built without ``CONFIG_SCHED_INFO``) there is no pace and nothing is named.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from slurmddp.watchdog.layout import Progress

FACTOR = 2.0  # how many times the median rank's busy time a slow rank's is, at least
MIN_EXTRA_S = 0.01  # and how many seconds more a step: below it, noise (a store, a small save)
WINDOW = 3  # periods whose busy times a rank's pace is the median of
CONFIRM = 3  # looks in a row a node is slow at before it is named
_TASKS = Path("/proc/self/task")


def busy_s(tasks: Path = _TASKS) -> float | None:
    """Seconds every thread of this process has run or waited for a CPU, since it started;
    None where the kernel does not say (no schedstat)."""
    total = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            run, delay = (tasks / name / "schedstat").read_text().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that just ended; a kernel without schedstat leaves total at 0
        total += int(run) + int(delay)
    return total / 1e9 if total else None


class Pace:
    """One rank's busy seconds per step, over its last `WINDOW` periods of progress."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self._window: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def update(self, count: int, busy: float | None) -> float | None:
        """Take the count and busy seconds now; the pace to publish (None: none yet)."""
        if busy is None:
            return None
        if self._last is not None and count > self._last[0]:
            self._window.append(max(0.0, busy - self._last[1]) / (count - self._last[0]))
        self._last = (count, busy)
        return statistics.median(self._window) if self._window else None


@dataclasses.dataclass(frozen=True)
class Slow:
    """A node whose ranks are slow: their busy seconds per step, and the median rank's."""

    node: str
    ranks: tuple[int, ...]
    pace_s: float  # the slowest of its ranks
    median_s: float

    @property
    def factor(self) -> float:
        return self.pace_s / self.median_s

    def line(self) -> str:
        who = f"rank{'s' if len(self.ranks) > 1 else ''} {','.join(map(str, self.ranks))}"
        return (f"{self.node} is slow: {who} on it {'are' if len(self.ranks) > 1 else 'is'} busy "
                f"{self.factor:.1f} times as long a step as the median rank ({_ms(self.pace_s)} "
                f"against {_ms(self.median_s)}: running, or waiting for a CPU), and every rank "
                "waits for it at each collective")  # fmt: skip

    def why(self) -> str:
        """In a few words, for the decision that leaves the node out."""
        return f"its ranks busy {self.factor:.1f} times as long a step as the median rank"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"


def slow_now(progress: Mapping[int, Progress]) -> list[Slow]:
    """The nodes with a slow rank in this look at the ranks' progress (pure). Needs at least two
    ranks with a pace; the reference is the lower median, so that of two ranks the faster is."""
    paces = {r: p.pace_s for r, p in progress.items() if p.pace_s is not None}
    if len(paces) < 2:
        return []
    median = statistics.median_low(paces.values())
    if median <= 0:
        return []
    by_node: dict[str, list[int]] = {}
    for rank, pace in sorted(paces.items()):
        if pace >= FACTOR * median and pace - median >= MIN_EXTRA_S:
            by_node.setdefault(progress[rank].node, []).append(rank)
    return [Slow(node, tuple(ranks), max(paces[r] for r in ranks), median)
            for node, ranks in by_node.items()]  # fmt: skip


class Watch:
    """The monitor's side: which nodes to name now, each once while it stays slow."""

    def __init__(self) -> None:
        self._streak: dict[str, int] = {}
        self.named: dict[str, Slow] = {}  # slow now, and named
        self.ever: dict[str, Slow] = {}  # every node named in the run, as last named

    def observe(self, progress: Mapping[int, Progress]) -> list[Slow]:
        """The nodes slow at `CONFIRM` looks in a row, named now (a node that recovers may be
        named again later)."""
        slow = {s.node: s for s in slow_now(progress)}
        self._streak = {node: self._streak.get(node, 0) + 1 for node in slow}
        for node in list(self.named):
            if node not in slow:
                del self.named[node]
        fresh = [s for node, s in slow.items()
                 if self._streak[node] >= CONFIRM and node not in self.named]  # fmt: skip
        self.named.update((s.node, s) for s in fresh)
        self.ever.update((s.node, s) for s in fresh)
        return fresh

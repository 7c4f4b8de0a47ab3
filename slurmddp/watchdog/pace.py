"""Slow nodes, named: how long each rank is busy for a step, against the median rank.

In data-parallel training every rank waits for the slowest at each collective, so all of them
take the same steps per second: a throttled CPU, a noisy neighbour or a node short of cores shows
only as a job that crawls. What differs is where each rank spends a step. A rank on a good node
computes, then sleeps in the collective (blocked, not running); a rank on a slow node runs, or
waits for a CPU it may not have (the kernel's ``run_delay``: a cgroup's ``cpu.max`` quota spent,
cores taken by others), for most of the step. So:

- **Each rank** (`Pace`, in the watchdog's `progress.Reporter` thread, once a period when its
  count moved) reads the kernel's ``/proc/self/task/<tid>/schedstat`` of its training thread (the
  one that armed the watchdog, from ``slurmddp.init``: time run, time waited for a CPU) and
  publishes its *busy seconds per step* over its last periods (the median of `WINDOW`) in its
  progress file. No collective, no I/O beyond the file it writes anyway. The training thread
  alone: a thread of the user's own that computes beside it (an evaluation, a logger) is not the
  step's work, and one that holds the interpreter lock makes the training thread sleep, which is
  not busy either.
- **The monitor** (`Watch`, pure) takes the median rank's busy time as the reference; a rank busy
  at least `FACTOR` times as long (and `MIN_EXTRA_S` more) is slow. A node whose ranks are slow
  at `CONFIRM` looks in a row is named once: a line in rank 0's log, a ``slow`` event in the
  job's story, and the run's ``slow`` file, from which ``--leave-slow-nodes`` leaves it out at the
  job's next requeue (`slurmddp.preemption.decision`).

A rank's pace is first published after two periods of progress and settles within `WINDOW`, so a
node that slows down is named within ``WINDOW + CONFIRM + 1`` periods (a period: a tenth of the
hang timeout, between 1 and 30 s). What this does not see: a GPU that computes slowly while its
rank's CPU thread spins in a CUDA synchronisation (busy on every rank alike); a rank slow in the
work of other processes (its DataLoader's workers) or of threads other than the training thread
(torch's own intra-op threads are waited for by it: their slowness is its). Linux only; without
schedstat (a kernel built without ``CONFIG_SCHED_INFO``) there is no pace and nothing is named.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Mapping
from pathlib import Path

from slurmddp.watchdog.layout import Progress

FACTOR = 2.0  # how many times the median rank's busy time a slow rank's is, at least
# and how much more, as a share of the step (what every rank waits for it: below a fifth, the
# load of a shared machine or a rank's own extra work, not a node worth leaving), and in seconds
SHARE = 0.2
MIN_EXTRA_S = 0.01
WINDOW = 3  # periods whose busy times a rank's pace is the median of
CONFIRM = 3  # looks in a row a node is slow at before it is named
_TASKS = Path("/proc/self/task")


def busy_s(thread: int, tasks: Path = _TASKS) -> float | None:
    """Seconds thread `thread` (a native id) of this process has run or waited for a CPU, since it
    started; None where the kernel does not say (no schedstat) or the thread has ended."""
    try:
        run, delay = (tasks / str(thread) / "schedstat").read_text().split()[:2]
        total = int(run) + int(delay)
    except (OSError, ValueError):
        return None
    return total / 1e9 if total else None  # all zero: a kernel that keeps no schedstat


class Pace:
    """One rank's busy seconds and wall seconds a step, each the median of its last `WINDOW`
    periods of progress."""

    def __init__(self) -> None:
        self._last: tuple[int, float, float] | None = None
        self._window: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW)

    def update(self, count: int, busy: float | None, now: float) -> tuple[float, float] | None:
        """Take the count, the busy seconds and the clock now; (busy, wall) seconds a step to
        publish, or None: none yet."""
        if busy is None:
            return None
        if self._last is None:
            self._last = (count, busy, now)
        elif count > self._last[0]:  # a pause without a step counts into the next step's time
            steps = count - self._last[0]
            self._window.append((max(0.0, busy - self._last[1]) / steps,
                                 max(0.0, now - self._last[2]) / steps))  # fmt: skip
            self._last = (count, busy, now)
        if not self._window:
            return None
        return (statistics.median(b for b, _ in self._window),
                statistics.median(w for _, w in self._window))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Slow:
    """A node whose ranks are slow: their busy seconds a step, the median rank's, and the step's."""

    node: str
    ranks: tuple[int, ...]
    pace_s: float  # the slowest of its ranks
    median_s: float
    step_s: float

    @property
    def factor(self) -> float:
        return self.pace_s / self.median_s

    @property
    def share(self) -> float:
        """What of each step every rank waits for it."""
        return min(1.0, (self.pace_s - self.median_s) / self.step_s) if self.step_s > 0 else 1.0

    def line(self) -> str:
        who = f"rank{'s' if len(self.ranks) > 1 else ''} {','.join(map(str, self.ranks))}"
        return (f"{self.node} is slow: {who} on it {'are' if len(self.ranks) > 1 else 'is'} busy "
                f"{self.factor:.1f} times as long a step as the median rank ({_ms(self.pace_s)} "
                f"against {_ms(self.median_s)}: running, or waiting for a CPU), and every rank "
                f"waits for it: {self.share:.0%} of each step of {_ms(self.step_s)}")  # fmt: skip

    def why(self) -> str:
        """In a few words, for the decision that leaves the node out."""
        return (f"its ranks busy {self.factor:.1f} times as long a step as the median rank, "
                f"{self.share:.0%} of each step")  # fmt: skip


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"


def slow_now(progress: Mapping[int, Progress]) -> list[Slow]:
    """The nodes with a slow rank in this look at the ranks' progress (pure). Needs at least two
    ranks with a pace; the reference is the lower median, so that of two ranks the faster is."""
    busy = {r: (p.pace_s, p.step_s) for r, p in progress.items()
            if p.pace_s is not None and p.step_s is not None}  # fmt: skip
    if len(busy) < 2:
        return []
    median = statistics.median_low(b for b, _ in busy.values())
    step = statistics.median(w for _, w in busy.values())
    if median <= 0:
        return []
    by_node: dict[str, list[int]] = {}
    for rank, (pace, _) in sorted(busy.items()):
        if pace >= FACTOR * median and pace - median >= max(MIN_EXTRA_S, SHARE * step):
            by_node.setdefault(progress[rank].node, []).append(rank)
    return [Slow(node, tuple(ranks), max(busy[r][0] for r in ranks), median, step)
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

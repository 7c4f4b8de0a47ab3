"""How often snapshots are taken: every `every` steps, or less often when that would cost the
training more than its budget.

The idea is CheckFreq's (FAST 2021): measure what a snapshot costs while training, and space
them so that the cost stays under a fraction of the training's time. A snapshot costs its time
at the call (the state's capture, its copy) and whatever it slows the steps near it: those its
thread runs beside (checksum, write, exchange) and the next few, which may wait in a collective
for another rank whose thread still runs. The steps further away give the plain step time; the
steps near one, less that, its slowdown. The interval that keeps cost / (interval x plain step +
cost) within the budget, and no shorter than the thread's run (a snapshot due while the one
before still runs would wait for it), is each rank's need; at each snapshot the ranks take the
largest (one all-reduce of an integer) and use it from there, so every rank takes the same ones.
The first snapshot's cycle counts, less its one-off set-up, so that a large state learns its
spacing at the second snapshot, not after a few taken back to back. Pure arithmetic: the caller
supplies the clock's readings.

Training loops are not uniform: an evaluation, a durable save or a recompilation between two
steps makes one "step" seconds long. Such a step says nothing of the snapshots, so neither
estimate follows it: the plain step is the median of the recent plain ones, a snapshot's cost
the lower median of the recent cycles', and the slowdown near a snapshot is capped at what the
snapshot could have caused (its thread's running time, twice: the rank's own and the wait for
another rank's, which runs about as long), for a loop that evaluates after every snapshot.
"""

from __future__ import annotations

import collections
import math
import statistics

# The plain steps whose median is a plain step's time.
_WINDOW = 15
# The recent cycles (snapshot to snapshot) that give a snapshot's cost.
_CYCLES = 5
# The steps after a snapshot counted as near it even once this rank's thread is done.
_NEAR = 3
# The slowdown a snapshot can cause, in its thread's running time: beside its own thread, then
# waiting in collectives for another rank's.
_CAUSAL = 2.0


class Pace:
    """The interval between snapshots: `every` at least, a multiple of it, widened when a
    snapshot costs more than `budget` (a fraction of the training's time; None: never)."""

    def __init__(self, every: int, budget: float | None) -> None:
        self.every = every
        self.budget = budget
        self.interval = every  # agreed by every rank; applies from the next snapshot
        self.next: int | None = None  # no snapshot is due before this step
        self._plain: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._fresh = False  # a plain step was seen this cycle
        self._direct = 0.0  # seconds at the calls that took this cycle's snapshot
        self._timed = False  # whether they were timed (the first, which sets up, is not)
        self._near: list[float] = []  # seconds of the steps near it
        self._ran: float | None = None  # seconds its thread ran, once known
        self._costs: collections.deque[float] = collections.deque(maxlen=_CYCLES)
        self._age = _NEAR  # steps since the last snapshot (none yet: as if long ago)
        self.snapshot_cost = 0.0  # the seconds a snapshot takes from training (recent cycles')
        self.step_seconds = 0.0  # a step's, as the last `needed` reckoned it

    @property
    def plain(self) -> float | None:
        """A step's seconds far from any snapshot (the recent ones' median); None before one."""
        return statistics.median(self._plain) if self._plain else None

    def due(self, step: int) -> bool:
        return step % self.every == 0 and (self.next is None or step >= self.next)

    def stepped(self, seconds: float, beside: bool) -> None:
        """A step took `seconds`, from the end of one call to the start of the next; `beside`:
        this rank's snapshot was in flight when it began."""
        self._age += 1
        if beside or self._age <= _NEAR:
            self._near.append(seconds)
        else:
            self._plain.append(seconds)
            self._fresh = True

    def took(self, seconds: float) -> None:
        """A call that took a snapshot spent `seconds`, besides any wait for the one before."""
        self._direct += seconds
        self._timed = True

    def ran(self, seconds: float) -> None:
        """This cycle's snapshot's thread ran `seconds`."""
        self._ran = seconds

    def _step(self) -> float:
        """A plain step's seconds. Before any was seen, the quickest step near a snapshot. None
        seen this cycle (snapshots every few steps): no more than the median step near it, as the
        plain ones seen may be long gone."""
        plain = self.plain
        if plain is None:
            return min(self._near, default=0.0)
        if self._near and not self._fresh:
            return min(plain, statistics.median(self._near))
        return plain

    def cost(self) -> float:
        """This cycle's seconds taken from training: the calls, and the slowdown near them.
        Before any plain step was seen (a snapshot every step from the first), the slowdown
        cannot be told from the steps: the thread's whole run counts, as on a node whose cores
        the training takes, until a cycle with plain steps measures it."""
        if self.plain is None and self._ran is not None:
            return self._direct + self._ran
        slowdown = max(0.0, sum(self._near) - len(self._near) * self._step())
        if self._ran is not None:
            slowdown = min(slowdown, _CAUSAL * self._ran)
        return self._direct + slowdown

    def needed(self) -> int:
        """The interval this rank needs for the cycle just ended to fit the budget; the cycle's
        measures start again."""
        if self._timed:
            self._costs.append(self.cost())
        step = self.step_seconds = self._step()
        ran = self._ran or 0.0
        self._direct, self._near, self._ran, self._fresh, self._timed = 0.0, [], None, False, False
        # One cycle's measure is a few noisy steps, and one with an evaluation or a save beside
        # the snapshot is long (capped only at `_CAUSAL`): the recent cycles' lower median.
        cost = self.snapshot_cost = statistics.median_low(self._costs) if self._costs else 0.0
        if self.budget is None or step <= 0.0 or cost <= 0.0:
            return self.every
        wanted = max(cost * (1.0 - self.budget) / (self.budget * step), ran / step)
        return max(1, math.ceil(wanted / self.every - 1e-9)) * self.every

    def taken(self, step: int, agreed: int) -> None:
        """A snapshot was taken at `step`; `agreed` is the ranks' widest need at it."""
        self.interval = max(self.every, agreed)
        self.next = step + self.interval
        self._age = 0

"""How often snapshots are taken: every `every` steps, or less often when that would cost the
training more than its budget.

The idea is CheckFreq's (FAST 2021): measure what a snapshot costs while training, and space
them so that the cost stays under a fraction of the training's time. A snapshot costs its time
at the call (the state's capture, its copy, the wait for the snapshot before it) and whatever it
slows the steps near it: those its thread runs beside (checksum, write, exchange) and the next
few, which may wait in a collective for another rank whose thread still runs. The steps further
away give the plain step time; the steps near one, less that, its slowdown. The interval that
keeps cost / (interval x plain step + cost) within the budget is each rank's need; the ranks take
the largest (in the snapshot thread, one all-reduce per snapshot) and use it from their next
snapshot, so every rank takes the same ones. Pure arithmetic: the caller supplies the clock's
readings.
"""

from __future__ import annotations

import math

# How much a plain step's time moves towards each new sample (a moving average over ~10 steps).
_SMOOTHING = 0.1
# And a snapshot's cost towards each new cycle's.
_CYCLES = 0.3
# The steps after a snapshot counted as near it even once this rank's thread is done.
_NEAR = 3


class Pace:
    """The interval between snapshots: `every` at least, a multiple of it, widened when a
    snapshot costs more than `budget` (a fraction of the training's time; None: never)."""

    def __init__(self, every: int, budget: float | None) -> None:
        self.every = every
        self.budget = budget
        self.interval = every  # agreed by every rank; applies from the next snapshot
        self.next: int | None = None  # no snapshot is due before this step
        self.plain: float | None = None  # a step's seconds, far from any snapshot
        self._direct = 0.0  # seconds at the calls that took this cycle's snapshot
        self._near: list[float] = []  # seconds of the steps near it
        self._age = _NEAR  # steps since the last snapshot (none yet: as if long ago)
        self.snapshot_cost = 0.0  # the seconds a snapshot takes from training (averaged)
        self.step_seconds = 0.0  # a step's, as the last `needed` reckoned it

    def due(self, step: int) -> bool:
        return step % self.every == 0 and (self.next is None or step >= self.next)

    def stepped(self, seconds: float, beside: bool) -> None:
        """A step took `seconds`, from the end of one call to the start of the next; `beside`:
        this rank's snapshot was in flight when it began."""
        self._age += 1
        if beside or self._age <= _NEAR:
            self._near.append(seconds)
        elif self.plain is None:
            self.plain = seconds
        else:
            self.plain += _SMOOTHING * (seconds - self.plain)

    def took(self, seconds: float) -> None:
        """A call that took a snapshot spent `seconds`."""
        self._direct += seconds

    def _step(self) -> float:
        """A plain step's seconds; before one was seen, the quickest step near a snapshot."""
        return self.plain if self.plain is not None else min(self._near, default=0.0)

    def cost(self) -> float:
        """This cycle's seconds taken from training: the calls, and the slowdown near them."""
        slowdown = sum(self._near) - len(self._near) * self._step()
        return self._direct + max(0.0, slowdown)

    def needed(self) -> int:
        """The interval this rank needs for the cycle just ended to fit the budget; the cycle's
        measures start again."""
        cost = self.cost()
        step = self.step_seconds = self._step()
        self._direct, self._near = 0.0, []
        # Averaged over cycles: one cycle's measure is a few noisy steps.
        self.snapshot_cost = cost if not self.snapshot_cost else self.snapshot_cost + _CYCLES * (
            cost - self.snapshot_cost)  # fmt: skip
        cost = self.snapshot_cost
        if self.budget is None or step <= 0.0 or cost <= 0.0:
            return self.every
        wanted = cost * (1.0 - self.budget) / (self.budget * step)
        return max(1, math.ceil(wanted / self.every - 1e-9)) * self.every

    def taken(self, step: int, agreed: int) -> None:
        """A snapshot was taken at `step`; `agreed` is the ranks' interval from the one before."""
        self.interval = max(self.every, agreed)
        self.next = step + self.interval
        self._age = 0

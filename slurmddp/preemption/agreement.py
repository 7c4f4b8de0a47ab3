"""How the ranks agree to stop at the same step, within about two steps of a signal.

`should_stop()` is called at the same points on every rank; a stop must happen at the same call
everywhere, since the checkpoint that follows is collective. Two ways to settle that call:

**Through the rendezvous store** (the default whenever `slurmddp.rank.coordination` knows it, i.e.
under ``env://`` or torchrun). A call costs a lock and a comparison: no collective at all while
nothing happens. A rank that gets a signal announces it under a store key at its next call. Every
rank has a daemon thread blocked on that key (its own connection), so all of them hear it at
once, even while their main threads are deep in a step. Each such thread takes its main thread's
call count, holds the main thread at the next call, and publishes that call as its limit; once
all limits are in, the stop call is their maximum, the same for everyone, and no rank has passed
it. The main threads then go on to that call and stop there. From signal to stop this takes the
step the signal interrupts plus at most one more, whatever the pace of the steps. If some rank
never answers (it has left), the round is abandoned after `ABANDON_S` and the ranks go on.

**By collectives** otherwise (another init method, MPI, a `group`, or ``every=N``): one all_reduce
of three integers at agreed calls. The calls are paced: each agreement also settles, from the
slowest rank's measured pace, how many calls pass before the next one (about `AGREE_EVERY_S`
seconds' worth, at most double the last gap). Steps that slow down after an agreement delay the
next one; the store path has no such limit.

Which way is settled at the first call with a process group, by one all_reduce: the store way
only if every rank can reach the store.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import threading
import time
from typing import Any

from slurmddp import dist
from slurmddp.errors import warn
from slurmddp.preemption.signals import STOP, TERM
from slurmddp.rank import coordination

AGREE_EVERY_S = 1.0
MAX_CALLS_BETWEEN = 10_000
ABANDON_S = 30.0


def calls_between(previous: int, seconds_per_call: float, target_s: float = AGREE_EVERY_S) -> int:
    """How many calls this rank proposes until the next collective agreement, at its pace.

    At most double the previous gap, so that a fast first stretch cannot push the next agreement
    far away at once.
    """
    if seconds_per_call <= 0:
        return min(2 * previous, MAX_CALLS_BETWEEN)
    return max(1, min(int(target_s / seconds_per_call), 2 * previous, MAX_CALLS_BETWEEN))


@dataclasses.dataclass
class _Pace:
    """When the paced collective agreement next communicates (a call count, the same on all)."""

    next_call: int = 0
    gap: int = 1
    since_call: int = 0
    since_time: float = 0.0

    def propose(self, calls: int) -> int:
        now = time.monotonic()
        gap = 1 if self.since_call == 0 else calls_between(
            self.gap, (now - self.since_time) / (calls - self.since_call))  # fmt: skip
        self.since_call, self.since_time = calls, now
        return gap

    def settle(self, calls: int, gap: int) -> None:
        self.gap, self.next_call = gap, calls + gap


def _distributed() -> Any:
    """torch.distributed when a process group of more than one rank exists, else None."""
    td = dist.group()
    return td if td is not None and dist.group_size() > 1 else None


class Agreement:
    """A process's agreement state; the process's own is held by
    `slurmddp.preemption.api.state()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decided = threading.Condition(self._lock)
        self.calls = 0
        self._hold_at: int | None = None  # the main thread waits at this call for the outcome
        self._stop_at: int | None = None
        self._stop_bits = 0
        self._mode: str | None = None  # "store" or "collective", settled at the first call
        self._round = 0  # store rounds: one per announced stop (a new one after an abandon)
        self._announced = 0  # bits announced in the current round
        self._connection: Any = None  # the main thread's (coordination's), to announce
        self._watcher: threading.Thread | None = None
        self._pace = _Pace()
        self._flag: Any = None  # the all_reduce buffer, allocated once

    def __call__(self, local: int, every: int | None = None, group: Any = None) -> int:
        """The bits every rank agrees on at this call (0: go on); the same on every rank."""
        with self._lock:
            self.calls += 1
            calls, hold_at, stop_at = self.calls, self._hold_at, self._stop_at
        td = _distributed()
        if td is None:
            return local
        if every is not None or group is not None:
            if every is not None and every > 1 and calls % every:
                return 0
            return self._reduce(td, local, group, paced=False)[0]
        if self._mode is None:
            return self._settle_mode(td, local)
        if self._mode == "collective":
            if calls < self._pace.next_call:
                return 0
            return self._reduce(td, local, None, paced=True)[0]
        if local & ~self._announced:
            self._announce(local)
        if hold_at is not None and calls >= hold_at:
            stop_at = self._wait_for_outcome()
        if stop_at is not None and calls >= stop_at:
            return self._stop_bits
        return 0

    # -- collectives -------------------------------------------------------------------------

    def _settle_mode(self, td: Any, local: int) -> int:
        """First call: one all_reduce agrees on the way, and already on the bits."""
        ready = coordination.available() and self._start_watcher()
        bits, unready = self._reduce(td, local, None, paced=True, extra=0 if ready else 1)
        self._mode = "collective" if unready else "store"
        return bits

    def _reduce(self, td: Any, local: int, group: Any, *, paced: bool,
                extra: int = 0) -> tuple[int, int]:  # fmt: skip
        """The bits any rank saw and the largest `extra`, by one all_reduce (MAX) of 4 integers.

        The third settles the paced gap: MAX of the negated proposals is the smallest, so every
        rank waits for the same call, paced by the slowest.
        """
        import torch

        device = dist.collective_device(group)
        if self._flag is None or self._flag.device != device:
            self._flag = torch.zeros(4, dtype=torch.int32, device=device)
        proposal = self._pace.propose(self.calls) if paced else 1
        # One copy from a host tensor: element-wise writes to a CUDA tensor would be four copies.
        values = [local & STOP, local & TERM, -proposal, extra]
        self._flag.copy_(torch.tensor(values, dtype=torch.int32))
        td.all_reduce(self._flag, op=td.ReduceOp.MAX, group=group)  # NCCL has no bitwise OR
        stop, term, gap, largest = self._flag.tolist()
        if paced:
            self._pace.settle(self.calls, -gap)
        return stop | term, largest

    # -- the store ---------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([coordination.namespace(), "stop", *map(str, parts)])

    def _start_watcher(self) -> bool:
        try:
            watching = coordination.connect()
            self._connection = coordination.main_connection()
        except Exception:  # unreachable store: the collective way
            return False
        if watching is None or self._connection is None:
            return False
        self._watcher = threading.Thread(target=self._watch, args=(watching,),
                                         name="slurmddp-stop-watch", daemon=True)  # fmt: skip
        self._watcher.start()
        atexit.register(self.close)
        return True

    def _announce(self, local: int) -> None:
        """Tell every rank's watcher that this rank saw `local` (once per round and bit)."""
        with self._lock:
            round_, new = self._round, local & ~self._announced
            self._announced |= local
        try:
            for bit in (STOP, TERM):
                if new & bit:
                    self._connection.add(self._key(round_, f"bits{bit}"), 1)
            if self._connection.add(self._key(round_, "announced"), 1) == 1:
                # The first to announce wakes everyone: one request, whatever the world size.
                world = coordination.world_size()
                self._connection.multi_set([self._key(round_, "wake", r) for r in range(world)],
                                           ["stop"] * world)  # fmt: skip
        except Exception as e:  # the store is gone: rank 0 has ended, so has the job
            warn(f"cannot announce the stop to the other ranks: {e}")

    def close(self) -> None:
        """End the watcher (at mark_done, requeue and exit): no wait is left on the store."""
        watcher, self._watcher = self._watcher, None
        if watcher is None or not watcher.is_alive():
            return
        try:
            self._connection.set(self._key(self._round, "wake", coordination.rank()), "exit")
        except Exception:
            return  # the store is gone, and with it the watcher's wait
        watcher.join(timeout=5)

    def _watch(self, store: Any) -> None:
        """The watcher thread: one round per announced stop, until a stop call is settled."""
        rank, world = coordination.rank(), coordination.world_size()
        try:
            while True:
                round_ = self._round
                wake = self._key(round_, "wake", rank)
                store.wait([wake])
                if store.get(wake) == b"exit":
                    return
                with self._lock:
                    limit = self.calls + 1  # the main thread cannot pass it before the outcome
                    self._hold_at = limit
                store.set(self._key(round_, "limit", rank), str(limit))
                outcome = self._key(round_, "outcome")
                if store.add(self._key(round_, "count"), 1) == world:
                    limits = store.multi_get([self._key(round_, "limit", r) for r in range(world)])
                    bits = sum(bit for bit in (STOP, TERM)
                               if store.add(self._key(round_, f"bits{bit}"), 0))  # fmt: skip
                    at = max(int(x) for x in limits)
                    store.compare_set(outcome, "", f"{at} {bits}")
                try:
                    store.wait([outcome], datetime.timedelta(seconds=ABANDON_S))
                except RuntimeError:
                    store.compare_set(outcome, "", "abandoned")
                text = store.get(outcome).decode()
                with self._decided:
                    self._hold_at = None
                    if text == "abandoned":
                        self._round, self._announced = round_ + 1, 0
                    else:
                        at_text, bits_text = text.split()
                        self._stop_at, self._stop_bits = int(at_text), int(bits_text)
                    self._decided.notify_all()
                if text != "abandoned":
                    return
                warn(f"a rank did not answer the stop within {ABANDON_S:g} s: going on")
        except Exception:  # the store is gone (rank 0 ended): nobody can stop together any more
            with self._decided:
                self._hold_at = None
                self._decided.notify_all()

    def _wait_for_outcome(self) -> int | None:
        with self._decided:
            while self._hold_at is not None and self._stop_at is None:
                self._decided.wait()
            return self._stop_at

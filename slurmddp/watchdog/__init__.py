"""The hang watchdog: a job whose ranks stop making progress ends in minutes, saying which rank.

A rank that hangs (stopped, stuck in a sleep or a dead lock, a collective it skipped) holds every
GPU of the job until a collective times out, if one ever does. Here:

- **Progress** is what a training loop already calls: each `slurmddp.should_stop()`, or
  `heartbeat()` for loops without it. A call only adds one to a counter: no collective, no I/O.
- **Each rank** (`progress.Reporter`, a daemon thread armed at the rendezvous) writes its count to
  a small file when it changed, at most once a `layout.period_s`; when the monitor asks, it writes
  its Python stacks (every thread) to ``<hang dir>/rank-<R>.txt`` and leaves.
- **The monitor** (`monitor`, a process of its own that global rank 0 starts, so that it runs on
  when rank 0 itself is stopped) reads the counts; once no rank has progressed for the hang
  timeout (``$SLURMDDP_HANG_TIMEOUT``, ``--hang-timeout``), it asks for the stacks, judges
  (`verdict`: pure) which ranks stopped progressing and which merely wait for them, writes that
  to ``<hang dir>/report.txt`` and the run's state, and ends the run: the ranks exit with
  `HANG_STATUS` (``srun --kill-on-bad-exit`` ends a rank that cannot: stopped, or holding the
  interpreter lock); the job's supervisor names the suspects in its log.

The watchdog judges a run only once some rank has reported progress (a script that never calls
either function is never judged), or from the rendezvous when an earlier run of the job reported
progress (the same script): so a rank stuck in start-up is caught from the first requeue on, or
at once when the script calls `heartbeat()` right after its start.

The same files carry each rank's busy time a step, from which the monitor names a slow node
(`pace`: a throttled CPU, a noisy neighbour) without ending anything.

Everything lives in the hang directory (``$SLURMDDP_HANG_DIR``; ``slurmddp submit`` sets it to
``<output>/<job>/hang``): without it there is no watchdog.
"""

from __future__ import annotations

from slurmddp.protocol import HANG_STATUS
from slurmddp.watchdog.progress import heartbeat

__all__ = ["HANG_STATUS", "heartbeat"]

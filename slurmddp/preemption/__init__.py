"""How training survives preemption and time limits: signal → agreed step → checkpoint → requeue.

`signals` takes the stop signal and SIGTERM in the rank (only there); `workers` starts DataLoader
workers shielded from them, and forks one again if it is stuck in its fork; `agreement` turns every
rank's flag into one answer at the same step; `api` is what a training loop calls (`should_stop`,
`requeue`, `mark_done`); `decision` is the requeue policy, from the run's outcome and Slurm's
record of the job (pure), shared by the job's supervisor (`slurmddp.supervisor`) and rank 0;
`slurm` carries a verdict out with Slurm's clients, for both; `nodes` lays a failure on a node the
requeue leaves behind (pure).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slurmddp import _moved

__all__ = ["mark_done", "requeue", "should_stop"]

if TYPE_CHECKING:
    from slurmddp.preemption.api import mark_done, requeue, should_stop


def __getattr__(name: str) -> Any:
    # Loaded on first use: `python -m slurmddp.preemption.decision` must find the package without
    # its modules already imported (runpy warns when it does), and stay a quick start.
    if name in __all__:
        return getattr(importlib.import_module("slurmddp.preemption.api"), name)
    return _moved.attribute(__name__, name)  # the rest of the old module's names, deprecated

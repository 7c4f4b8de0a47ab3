"""How training survives preemption and time limits: signal → agreed step → checkpoint → requeue.

`signals` takes the stop signal and SIGTERM in the rank (only there: children such as DataLoader
workers are shielded); `agreement` turns every rank's flag into one answer at the same step;
`api` is what a training loop calls (`should_stop`, `requeue`, `mark_done`); `decision` is the
requeue policy, from the run's outcome and Slurm's record of the job (pure), shared by the
batch shell (``python -m slurmddp.preemption.decision``) and rank 0.
"""

from slurmddp.preemption.api import mark_done, requeue, should_stop

__all__ = ["mark_done", "requeue", "should_stop"]

"""slurmddp: PyTorch distributed training on Slurm and MPI batch clusters.

Importing the package is cheap (no torch); names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slurmddp import _moved

__version__ = "0.1.0"

# The previous release's module paths (slurmddp.train_state, ...) import for one more release,
# with a DeprecationWarning naming the new path.
_moved.install()

_LAZY = {
    "DistEnv": "slurmddp.rank.env",
    "EnvError": "slurmddp.rank.env",
    "resolve": "slurmddp.rank.env",
    "bootstrap": "slurmddp.rank.bootstrap",
    "run_id": "slurmddp.rank.identity",
    "init": "slurmddp.launch.process_group",
    "JobSpec": "slurmddp.batch.spec.jobspec",
    "build_spec": "slurmddp.batch.spec.jobspec",
    "submit": "slurmddp.batch.functions.executor",
    "Executor": "slurmddp.batch.functions.executor",
    "JobFailedError": "slurmddp.errors",
    "should_stop": "slurmddp.preemption.api",
    "requeue": "slurmddp.preemption.api",
    "mark_done": "slurmddp.preemption.api",
    "heartbeat": "slurmddp.watchdog.progress",
    "Checkpointer": "slurmddp.checkpoint",
    "ResumableDistributedSampler": "slurmddp.training.sampler",
}

__all__ = [
    "Checkpointer", "DistEnv", "EnvError", "Executor", "JobFailedError", "JobSpec",
    "ResumableDistributedSampler", "__version__", "bootstrap", "build_spec", "heartbeat", "init",
    "mark_done",
    "requeue", "resolve", "run_id", "should_stop", "submit",
]  # fmt: skip

if TYPE_CHECKING:
    from slurmddp.batch.functions.executor import Executor, submit
    from slurmddp.batch.spec.jobspec import JobSpec, build_spec
    from slurmddp.checkpoint import Checkpointer
    from slurmddp.errors import JobFailedError
    from slurmddp.launch.process_group import init
    from slurmddp.preemption.api import mark_done, requeue, should_stop
    from slurmddp.rank.bootstrap import bootstrap
    from slurmddp.rank.env import DistEnv, EnvError, resolve
    from slurmddp.rank.identity import run_id
    from slurmddp.training.sampler import ResumableDistributedSampler
    from slurmddp.watchdog.progress import heartbeat


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # Cached, so that a call in a training loop (slurmddp.should_stop()) is a plain lookup.
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'slurmddp' has no attribute {name!r}")

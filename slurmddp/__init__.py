"""slurmddp: PyTorch distributed training on Slurm and MPI batch clusters.

Importing the package is cheap (no torch); names are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "DistEnv": "slurmddp.env",
    "EnvError": "slurmddp.env",
    "resolve": "slurmddp.env",
    "bootstrap": "slurmddp.bootstrap",
    "init": "slurmddp.process_group",
    "JobSpec": "slurmddp.jobspec",
    "build_spec": "slurmddp.jobspec",
    "submit": "slurmddp.submission",
    "should_stop": "slurmddp.preemption",
    "requeue": "slurmddp.preemption",
    "mark_done": "slurmddp.preemption",
    "Checkpointer": "slurmddp.checkpoint",
    "ResumableDistributedSampler": "slurmddp.sampler",
}

__all__ = [
    "Checkpointer", "DistEnv", "EnvError", "JobSpec", "ResumableDistributedSampler", "__version__",
    "bootstrap", "build_spec", "init", "mark_done", "requeue", "resolve", "should_stop", "submit",
]  # fmt: skip

if TYPE_CHECKING:
    from slurmddp.bootstrap import bootstrap
    from slurmddp.checkpoint import Checkpointer
    from slurmddp.env import DistEnv, EnvError, resolve
    from slurmddp.jobspec import JobSpec, build_spec
    from slurmddp.preemption import mark_done, requeue, should_stop
    from slurmddp.process_group import init
    from slurmddp.sampler import ResumableDistributedSampler
    from slurmddp.submission import submit


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        # Cached, so that a call in a training loop (slurmddp.should_stop()) is a plain lookup.
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'slurmddp' has no attribute {name!r}")

"""Which run this process belongs to: one id for a job and every requeue of it.

`run_id` is the rule, and the only one: `slurmddp.rank.bootstrap` exports its answer as
$SLURMDDP_RUN_ID, the checkpoint manifest records it, and a script hands it to its tracker
(W&B, MLflow, TensorBoard) so that a requeued job goes on logging into the same run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from slurmddp.protocol import RUN_ID_VAR

# What every tracker takes as a run id or a directory name (W&B refuses / \ # ? % :).
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# torchrun's --rdzv-id when none is given: the same for every job, so it names no run.
_TORCHRUN_DEFAULT = "none"


def run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """This run's id, stable across requeues; None when nothing gives one. Pure given `environ`
    (default: this process's environment).

    First that applies:

    1. $SLURMDDP_RUN_ID, when set: the user's (to chain jobs into one run), or the one exported
       to this process by its parent's `bootstrap`.
    2. A Slurm job (SLURM_JOB_ID): ``<cluster>-<array job>_<task>`` for an array task
       (SLURM_CLUSTER_NAME, SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID), else
       ``<cluster>-<SLURM_JOB_ID>``; without ``<cluster>-`` when no cluster name is set. A
       requeue keeps the job id (only SLURM_RESTART_COUNT moves), so every run of the job gets
       the same id; the cluster name keeps two clusters' job 123 apart.
    3. torchrun's TORCHELASTIC_RUN_ID (its ``--rdzv-id``), unless it is torchrun's default
       ``none``. A single-node torchrun without ``--rdzv-id`` draws a new UUID at every launch.
    4. None: mpirun outside Slurm gives nothing that outlives one launch.

    Each run of characters outside ``[A-Za-z0-9_-]`` becomes one ``-`` (none at either end), as
    trackers take it; a value that is then empty counts as unset.
    """
    env = os.environ if environ is None else environ
    given = _safe(env.get(RUN_ID_VAR))
    if given:
        return given
    job = _safe(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    if job:
        # Set in the batch shell only; srun passes them on to the steps it starts from there.
        array_job = _safe(env.get("SLURM_ARRAY_JOB_ID"))
        task = _safe(env.get("SLURM_ARRAY_TASK_ID"))
        if array_job and task:
            job = f"{array_job}_{task}"
        cluster = _safe(env.get("SLURM_CLUSTER_NAME"))
        return f"{cluster}-{job}" if cluster else job
    torchrun = env.get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != _TORCHRUN_DEFAULT:
        return _safe(torchrun) or None
    return None


def _safe(value: str | None) -> str:
    """`value` as trackers take it (see `run_id`); "" for None."""
    return _UNSAFE.sub("-", value.strip()).strip("-") if value else ""

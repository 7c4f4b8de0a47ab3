"""When the job must end, and when the ranks stop by themselves if no stop signal comes.

Slurm's warning signal may never come: a site or a batch script without ``--signal``, a signal
lost on its way. The ranks know the job's end from what Slurm says at start, and `should_stop`
stops them at `stop_at` as if the signal had come: the signal's lead before the end, or longer
when the last measured save takes more (`SAVE_MARGIN` times it). Only rank 0 must know it: the
agreement carries its stop to every rank.

The end: SLURM_JOB_END_TIME, which Slurm sets in every job from 23.02 on; else rank 0 asks
``scontrol show job`` once per run (Slurm 22.05; no per-rank RPC, and nothing when there is no
``scontrol``, as in some containers). A time limit changed while the job runs is not seen.
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import subprocess
from collections.abc import Mapping

from slurmddp.protocol import DEFAULT_SIGNAL_LEAD_S, SIGNAL_LEAD_VAR

# A stop must leave this many times the last measured save's duration before the end.
SAVE_MARGIN = 1.5


def lead_s(environ: Mapping[str, str]) -> int:
    """The stop signal's lead ($SLURMDDP_SIGNAL_LEAD, else the default)."""
    text = environ.get(SIGNAL_LEAD_VAR, "")
    return int(text) if text.isdigit() else DEFAULT_SIGNAL_LEAD_S


def end_from_env(environ: Mapping[str, str]) -> float | None:
    """The job's end in epoch seconds from SLURM_JOB_END_TIME; None without it (or 0: none)."""
    text = environ.get("SLURM_JOB_END_TIME", "")
    return float(text) if text.isdigit() and int(text) > 0 else None


def end_from_scontrol(text: str) -> float | None:
    """The job's EndTime from ``scontrol show job -o``, read in this process's time zone (as
    scontrol wrote it); None when it has none (no time limit)."""
    from slurmddp.preemption.decision import job_fields

    try:
        end = datetime.datetime.strptime(job_fields(text).get("EndTime", ""), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    return end.timestamp()


def stop_at(end: float, lead: float, save_s: float | None = None) -> float:
    """When the ranks stop by themselves: the lead before `end`, more for a slow save."""
    return end - max(lead, math.ceil(SAVE_MARGIN * (save_s or 0.0)))


def slow_save(save_s: float, lead: float) -> str | None:
    """The warning for a save that takes longer than the stop signal's lead; None if it fits."""
    if save_s <= lead:
        return None
    return (f"the last checkpoint took {save_s:.0f} s to save, longer than the stop signal's "
            f"lead of {lead:g} s: a stop at the time limit would be cut off before its "
            "checkpoint is written; submit with --signal-lead "
            f"{math.ceil(SAVE_MARGIN * save_s)} or more (the ranks stop by themselves that long "
            "before the end when no signal comes)")  # fmt: skip


def job_end(environ: Mapping[str, str] | None = None, *, ask: bool = False) -> float | None:
    """The job's end: from the environment, else (`ask`: rank 0) one ``scontrol show job``."""
    env = os.environ if environ is None else environ
    end = end_from_env(env)
    job = env.get("SLURM_JOB_ID")
    if end is not None or not ask or not job or shutil.which("scontrol") is None:
        return end
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                               text=True, timeout=10, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return end_from_scontrol(shown)

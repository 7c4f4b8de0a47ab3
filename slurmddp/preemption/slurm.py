"""What the requeue policy asks of Slurm, done with its clients: the job's record in, the verdict
out.

`decision` is pure; this is its one edge. Both places that carry a verdict out use it: the batch
job's supervisor (`slurmddp.supervisor`) after its step, and rank 0 in a user's own batch script
(`slurmddp.preemption.api.requeue`).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from slurmddp.preemption import decision
from slurmddp.preemption.decision import Decision, Facts
from slurmddp.protocol import EXCLUDED_FILE_VAR

__all__ = ["carry_out", "scontrol", "show_job", "show_nodes", "show_partition"]


def scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    """``scontrol ARGS``, its output kept; status 127 when there is no scontrol here."""
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True)
    except OSError as e:
        return subprocess.CompletedProcess(["scontrol", *args], 127, "", e.strerror or str(e))


def show_job(job_id: str) -> dict[str, str]:
    """Slurm's record of the job (``scontrol show job -o``); empty when it cannot be read."""
    return decision.job_fields(scontrol("show", "job", "-o", job_id).stdout) if job_id else {}


def show_nodes(nodelist: str) -> dict[str, str]:
    """{node: its state} of `nodelist` (``scontrol show node -o``: ``DOWN+NOT_RESPONDING``);
    empty when it cannot be read."""
    out = scontrol("show", "node", "-o", nodelist).stdout if nodelist else ""
    return {m[1]: m[2] for m in re.finditer(r"^NodeName=(\S+).*?\sState=(\S+)", out, re.M)}


def show_partition(name: str) -> dict[str, str]:
    """The partition's record (``scontrol show partition -o``); empty when it cannot be read."""
    if not name:
        return {}
    return decision.partition_fields(scontrol("show", "partition", "-o", name).stdout.splitlines())


def carry_out(verdict: Decision, facts: Facts, job_id: str, environ: Mapping[str, str],
              say: Callable[[str], None]) -> Decision:  # fmt: skip
    """Do what `verdict` asks of Slurm; the decision that stands.

    `final`: Slurm is told not to requeue the job (it would requeue a preempted job itself).
    `requeue`: ``scontrol requeue``; when that fails the decision looks again at Slurm's record
    (the requeue's own TERM can end scontrol after the requeue went through), and its verdict
    stands. Then the job's new ExcNodeList, which Slurm takes only while the job is pending: in
    the begin time delay of a requeued job. Each node left behind, and why, goes to the job's
    excluded file (``slurmddp status``).
    """
    if verdict.action == "final":
        scontrol("update", f"JobId={job_id}", "Requeue=0")
    if verdict.action != "requeue":
        return verdict
    done = scontrol("requeue", facts.target)
    if done.returncode != 0:
        error = done.stderr.strip() or f"status {done.returncode}"
        after = decision.decide(dataclasses.replace(facts, job=show_job(job_id),
                                                    requeue_error=error))  # fmt: skip
        for line in after.lines:
            say(line)
        return after
    if verdict.exclude:
        excluding = scontrol("update", f"JobId={facts.target}", f"ExcNodeList={verdict.exclude}")
        if excluding.returncode:
            say(f"Slurm refused to exclude {verdict.exclude}; the requeued job may land there "
                "again")
        elif excluded := environ.get(EXCLUDED_FILE_VAR):
            try:
                with Path(excluded).open("a", encoding="utf-8") as f:
                    f.write(f"{verdict.left_behind}\n")
            except OSError as e:
                say(f"cannot write {excluded}: {e.strerror}")
    return verdict


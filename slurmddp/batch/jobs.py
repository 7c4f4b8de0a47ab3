"""Jobs after submission: where their files are, their state, their logs, cancel and follow.

Every submission appends one line to a small registry (``$XDG_STATE_HOME/slurmddp/jobs.jsonl``),
so ``slurmddp status|logs|cancel JOB`` find the job's folder without asking slurmctld. Slurm
states come from submitit's watcher: one ``sacct`` call (slurmdbd, not slurmctld) for all the jobs
asked about, and calls back off while a job runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from slurmddp.files import make_dirs

# Slurm states after which a job will not run again by itself.
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
     "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip


# The layouts of templates/sbatch.sh.j2 and of submitit's LocalExecutor.
SLURM_LOG_PATTERN = "{folder}/{job_id}/rank-{rank}.log"
TORCHRUN_LOG_PATTERN = "{folder}/{job_id}/node-{rank}.log"
LOCAL_LOG_PATTERN = "{folder}/{job_id}_{rank}_log.out"
MPIRUN_LOG_PATTERN = "{folder}/{job_id}/ranks.log"  # every rank's lines, tagged [rank/world]


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What the registry keeps of one submitted job."""

    job_id: str
    folder: str
    name: str
    engine: str  # "slurm" or "local"
    tasks: int
    submitted: float
    # Where each rank's output goes, formatted with folder, job_id and rank.
    log_pattern: str = SLURM_LOG_PATTERN

    def log(self, rank: int | str = 0) -> Path:
        """Rank `rank`'s output (a placeholder such as "<rank>" shows the pattern)."""
        return Path(self.log_pattern.format(folder=self.folder, job_id=self.job_id, rank=rank))


def registry_path(environ: Mapping[str, str] = os.environ) -> Path:
    """The registry file, under $XDG_STATE_HOME (default ~/.local/state)."""
    state = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME", "~")) / ".local/state")
    return Path(state).expanduser() / "slurmddp" / "jobs.jsonl"


def remember(record: JobRecord, environ: Mapping[str, str] = os.environ) -> None:
    """Append `record` to the registry, creating its directory (never world-writable)."""
    path = registry_path(environ)
    make_dirs(path.parent)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(record)) + "\n")


def recorded(environ: Mapping[str, str] = os.environ) -> list[JobRecord]:
    """Every registered job, oldest first; a later line for the same id wins."""
    path = registry_path(environ)
    if not path.exists():
        return []
    by_id: dict[str, JobRecord] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = JobRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue  # a torn line from a crash must not hide every other job
        by_id.pop(record.job_id, None)
        by_id[record.job_id] = record
    return list(by_id.values())


def find(job_id: str, environ: Mapping[str, str] = os.environ) -> JobRecord | None:
    return next((r for r in reversed(recorded(environ)) if r.job_id == job_id), None)


def states(records: Iterable[JobRecord]) -> dict[str, str]:
    """The current state of each job: one sacct call for all Slurm jobs."""
    records = list(records)
    out: dict[str, str] = {}
    slurm = [r for r in records if r.engine == "slurm"]
    if slurm:
        from submitit.slurm.slurm import SlurmJob

        jobs: list[Any] = [SlurmJob(folder=r.folder, job_id=r.job_id) for r in slurm]
        SlurmJob.watcher.update()  # one sacct call for every registered job
        for job in jobs:
            out[job.job_id] = job.watcher.get_state(job.job_id, mode="cache")
    for r in records:
        if r.engine == "local":
            out[r.job_id] = local_state(r)
    return out


# What Slurm's clients say when slurmctld does not answer.
_UNREACHABLE = "Unable to contact slurm controller"


def controller_unreachable(detail: str) -> str:
    """The one-line message for a command that needed slurmctld and could not reach it."""
    return (f"cannot reach the Slurm controller (slurmctld): {detail}; check `scontrol ping` and "
            "try again")  # fmt: skip


def unreachable(message: str) -> bool:
    """Whether a Slurm client's error `message` says that slurmctld did not answer."""
    return _UNREACHABLE in message


def controller_down() -> str | None:
    """None when slurmctld answers `scontrol ping` (one quick RPC); else what was said."""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol ping: {e}"
    if ping.returncode == 0:
        return None
    said = (ping.stdout + ping.stderr).strip().splitlines()  # "Slurmctld(primary) at H is DOWN"
    return f"scontrol ping: {said[0] if said else f'status {ping.returncode}'}"


def local_state(record: JobRecord) -> str:
    """A local job runs while its controller lives; then the ranks' exit files tell the end."""
    if _alive(int(record.job_id)):
        return "RUNNING"
    codes = [local_exit_code(record, rank) for rank in range(record.tasks)]
    if any(c is None for c in codes):
        return "CANCELLED"
    return "COMPLETED" if all(c == 0 for c in codes) else "FAILED"


def local_exit_path(folder: str | Path, job_id: str, rank: int) -> Path:
    return Path(folder) / f"{job_id}_{rank}_exit"


def local_exit_code(record: JobRecord, rank: int) -> int | None:
    path = local_exit_path(record.folder, record.job_id, rank)
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def exit_code(record: JobRecord) -> int:
    """How the job ended, as a process exit status (0 when it succeeded)."""
    if record.engine == "local":
        codes = [local_exit_code(record, rank) for rank in range(record.tasks)]
        return max((1 if c is None else c for c in codes), default=1)
    return slurm_exit_code(record.job_id)


def slurm_exit_code(job_id: str) -> int:
    """The batch job's exit status from sacct ("1:0" → 1; killed by a signal → 128+signal)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "ExitCode", "-j", job_id],
        capture_output=True, text=True, check=False,
    ).stdout.strip().splitlines()  # fmt: skip
    if not out or ":" not in out[-1]:
        return 1
    code, sig = (int(x) for x in out[-1].split(":")[:2])
    return 128 + sig if sig else code


def follow(
    record: JobRecord,
    state_of: Callable[[], str],
    out: TextIO = sys.stdout,
    *,
    poll_s: float = 1.0,
    max_poll_s: float = 10.0,
) -> str:
    """Print state changes and stream rank 0's log until the job reaches a final state.

    Polls back off from `poll_s` to `max_poll_s` while nothing changes. Returns the final state.
    """
    last, offset, delay = "", 0, poll_s
    while True:
        # sacct says "CANCELLED by 0", or nothing at all for a job it does not know yet.
        state = (state_of().split() or ["UNKNOWN"])[0]
        if state != last and state != "UNKNOWN":  # sacct may not know a job for a moment
            print(f"[slurmddp] job {record.job_id}: {state}", file=out, flush=True)
            last, delay = state, poll_s
        offset = _copy_new(record.log(0), offset, out)
        if state in FINAL_STATES:
            time.sleep(0.5)  # the last lines can land just after the state changes
            _copy_new(record.log(0), offset, out)
            return state
        time.sleep(delay)
        delay = min(delay * 1.5, max_poll_s)


def _copy_new(path: Path, offset: int, out: TextIO) -> int:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    if chunk:
        out.write(chunk.decode("utf-8", "replace"))
        out.flush()
    return offset + len(chunk)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        return False

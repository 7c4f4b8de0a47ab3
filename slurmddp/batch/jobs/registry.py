"""The job registry: one `JobRecord` per submitted job, and the record as the job's handle.

Every submission appends one line to a small registry (``$XDG_STATE_HOME/slurmddp/jobs.jsonl``),
so ``slurmddp status|logs|cancel JOB`` find the job's folder without asking slurmctld.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from slurmddp.batch.jobs import status
from slurmddp.files import make_dirs
from slurmddp.protocol import EVENTS_FILE_VAR, STATE_FILES
from slurmddp.story import events
from slurmddp.supervisor.launchers import LAUNCHERS

# The ranks' logs of each launcher (slurmddp.supervisor.launchers), and submitit's LocalExecutor's.
SLURM_LOG_PATTERN = LAUNCHERS["srun"].log_pattern
TORCHRUN_LOG_PATTERN = LAUNCHERS["torchrun"].log_pattern
LOCAL_LOG_PATTERN = "{folder}/{job_id}_{rank}_log.out"
MPIRUN_LOG_PATTERN = LAUNCHERS["mpirun"].log_pattern  # every rank's lines, tagged [rank/world]


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """One submitted job, as the registry keeps it, and its handle: `state`, `done`, `wait`,
    `cancel`, `log` (what `slurmddp.submit` of a `JobSpec` returns)."""

    job_id: str
    folder: str
    name: str
    engine: str  # "slurm" or "local"
    tasks: int
    submitted: float
    # Where each rank's output goes, formatted with folder, job_id and rank.
    log_pattern: str = SLURM_LOG_PATTERN
    # An array job's task indices as sbatch was given them ("0-15%4"), "" for a plain job:
    # accounting may list a task only once it starts, and a follow must not end before them all.
    array: str = ""

    def log(self, rank: int | str = 0) -> Path:
        """Rank `rank`'s output (a placeholder such as "<rank>" shows the pattern)."""
        return Path(self.log_pattern.format(folder=self.folder, job_id=self.job_id, rank=rank))

    @property
    def state(self) -> str:
        """Slurm's state of the job now (RUNNING, COMPLETED...; an array's as counts)."""
        return status.states([self])[self.job_id]

    def done(self) -> bool:
        """Whether the job has ended for good (a requeued one has not)."""
        return status.is_final(self.state)

    @property
    def job_dir(self) -> Path:
        """Where the job's runs leave their files: its events, ranks' logs, watchdog's reports."""
        return Path(self.folder) / self.job_id

    @property
    def events_path(self) -> Path:
        """The job's events (`slurmddp.story`): what happened to each run."""
        return self.job_dir / dict(STATE_FILES)[EVENTS_FILE_VAR]

    def events(self) -> list[events.Event]:
        """The job's events so far, in order."""
        return events.read(self.events_path)

    def ending(self) -> Callable[[], bool]:
        """A check, cheap to repeat, of whether the job's last run ended it (its events say so;
        a local job's state costs no call to Slurm: always)."""
        if self.engine == "local":
            return lambda: True
        tail, told = events.Tail(self.events_path), []

        def ended() -> bool:
            told.extend(tail.new())
            return events.ended(told)

        return ended

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the job has ended; its final state. Raises TimeoutError after `timeout` s."""
        return status.wait_until_final(lambda: self.state, timeout, f"job {self.job_id}",
                                       self.ending())  # fmt: skip

    def cancel(self) -> None:
        """Cancel the job (`cancel`)."""
        status.cancel([self])


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

"""Jobs' states, as Slurm has them: many jobs in one call, never one call per job.

States come from one ``sacct`` call (slurmdbd, not slurmctld) for all the jobs asked about; an
array job's tasks are counted per state. Without accounting (``sacct`` fails: no slurmdbd) they
come from the controller instead: one ``squeue`` and one ``scontrol show job`` for all jobs.
A ``--local`` job's state comes from its controller's process and its exit file. Also: cancel,
and how a job ended (its exit status).
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from slurmddp.errors import SubmissionError, warn

if TYPE_CHECKING:
    from slurmddp.batch.jobs.registry import JobRecord


# Slurm states after which a job will not run again by itself.
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
     "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip


UNKNOWN = "UNKNOWN"


@dataclasses.dataclass(frozen=True)
class TaskState:
    """One task of an array job."""

    task: str  # "<array job>_<index>"
    job_id: str  # its own job id, the directory of its logs ("" while it waits in the array)
    state: str


@dataclasses.dataclass(frozen=True)
class JobState:
    """A job's state: one Slurm state, or for an array job its tasks' states counted."""

    state: str  # "RUNNING", or "RUNNING 2, COMPLETED 1, PENDING 1" for an array
    tasks: tuple[TaskState, ...] = ()  # an array's tasks, by index


def states(records: Iterable[JobRecord]) -> dict[str, str]:
    """The current state of each job (an array's as counts): see `job_states`."""
    return {job_id: s.state for job_id, s in job_states(records).items()}


def job_states(records: Iterable[JobRecord]) -> dict[str, JobState]:
    """Each job's state: one sacct call for all Slurm jobs, or without accounting one squeue and
    one scontrol call (said once per process); local jobs from their processes and exit files."""
    records = list(records)
    out: dict[str, JobState] = {}
    slurm = [r.job_id for r in records if r.engine == "slurm"]
    if slurm:
        # Once accounting failed, this process (a follow's polls) asks the controller only.
        rows = None if _said_controller else _sacct_rows(slurm)
        if rows is None:
            rows = _controller_rows()
        tasks = _by_job(rows)
        arrays = {r.job_id: r.array for r in records}
        for job_id in slurm:
            seen = dict(tasks.get(job_id, {}))
            for task in array_tasks(job_id, arrays.get(job_id, "")):
                seen.setdefault(task, (job_id, "PENDING"))  # not listed yet: still waiting
            out[job_id] = _job_state(seen)
    for r in records:
        if r.engine == "local":
            out[r.job_id] = JobState(local_state(r))
    return out


def array_tasks(job_id: str, indices: str) -> list[str]:
    """The tasks ``JOB_I`` of an sbatch ``--array`` index list ("0-2", "1,3,8-10:2%4"); none for
    "" or a list this cannot read (then only what Slurm lists counts)."""
    tasks = []
    for part in indices.split("%")[0].split(","):
        span, _, step = part.partition(":")
        first, _, last = span.partition("-")
        if not (first.isdigit() and (last or first).isdigit() and (step or "1").isdigit()):
            return []
        tasks += [f"{job_id}_{i}" for i in range(int(first), int(last or first) + 1,
                                                  int(step or 1))]  # fmt: skip
    return tasks


def array_indices(sbatch_args: Iterable[str]) -> str:
    """The ``--array`` (``-a``) index list among sbatch's arguments, or ""."""
    args = list(sbatch_args)
    for i, arg in enumerate(args):
        if arg.startswith("--array="):
            return arg.split("=", 1)[1]
        if arg.startswith("-a") and len(arg) > 2:
            return arg[2:]
        if arg in ("--array", "-a") and i + 1 < len(args):
            return args[i + 1]
    return ""


def aggregate(task_states: Iterable[str]) -> str:
    """Tasks' states counted, most frequent first: "RUNNING 2, COMPLETED 1, PENDING 1"."""
    counts: dict[str, int] = {}
    for state in task_states:
        counts[state] = counts.get(state, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{state} {n}" for state, n in ordered)


_COUNTED = re.compile(r"^[A-Z_]+ \d+(, [A-Z_]+ \d+)*$")


def counted(state: str) -> bool:
    """Whether `state` is an array's tasks counted ("RUNNING 2, COMPLETED 1")."""
    return bool(_COUNTED.match(state))


def is_final(state: str) -> bool:
    """Whether the job (every task of an array) has reached a state it will not leave alone."""
    if _COUNTED.match(state):
        return all(part.split()[0] in FINAL_STATES for part in state.split(", "))
    return state in FINAL_STATES


# A job's state is asked ever less often, down to this (one sacct a call); while the job's
# story says it is about to end (`ending`), every FIRST_POLL_S. Between asks, `ending` (a read of
# a file) is looked at every TICK_S.
FIRST_POLL_S, MAX_POLL_S, TICK_S = 0.5, 10.0, 0.25


def wait_until_final(state_of: Callable[[], str], timeout: float | None, what: str,
                     ending: Callable[[], bool] | None = None) -> str:  # fmt: skip
    """Poll `state_of` until `is_final`, backing off; the final state. TimeoutError after
    `timeout` seconds, naming `what`. While `ending()` is true (the job's last run has ended,
    its events say), Slurm is asked every FIRST_POLL_S: the end is known within a second or so,
    at the cost of a few more calls at the very end."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FIRST_POLL_S
    while True:
        state = state_of()
        if is_final(state):
            return state
        if deadline is not None and time.monotonic() + pause > deadline:
            raise TimeoutError(f"{what} has not ended after {timeout} s: it is {state}")
        asked = time.monotonic()
        while (left := asked + pause - time.monotonic()) > 0:
            time.sleep(min(TICK_S, left))
            if ending is not None and pause > FIRST_POLL_S and ending():
                break
        soon = ending is not None and ending()
        pause = FIRST_POLL_S if soon else min(pause * 1.5, MAX_POLL_S)


# A row of what Slurm said: (job field, its own job id, state). The job field is "1234" for a
# plain job, "1234_5" for an array task and "1234_[6-9%2]" for the tasks still waiting in it.
_Row = tuple[str, str, str]

# sacct's own fields: JobID as above, JobIDRaw the job's own id.
_SACCT = ["sacct", "-X", "-n", "-P", "-o", "JobID,JobIDRaw,State"]

_said_controller = False  # whether this process has said that states come from the controller


def _sacct_rows(job_ids: list[str]) -> list[_Row] | None:
    """sacct's rows for `job_ids` (an array's id brings all its tasks); None when accounting
    does not answer."""
    try:
        done = subprocess.run([*_SACCT, "-j", ",".join(job_ids)], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        _say_controller(f"sacct: {e}")
        return None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        _say_controller(said[0] if said else f"sacct exited with status {done.returncode}")
        return None
    rows = []
    for line in done.stdout.splitlines():
        fields = line.split("|")
        if len(fields) >= 3 and fields[0]:
            # "CANCELLED by 0": the state is the first word.
            rows.append((fields[0], fields[1], (fields[2].split() or [UNKNOWN])[0]))
    return rows


def from_controller() -> bool:
    """Whether states came from slurmctld in this process, accounting having failed."""
    return _said_controller


def _say_controller(why: str) -> None:
    global _said_controller
    if not _said_controller:
        _said_controller = True
        warn(f"no Slurm accounting here ({why}): job states come from the controller (squeue, "
             "scontrol show job), which forgets finished jobs after MinJobAge: those show "
             f"{UNKNOWN}")  # fmt: skip


def _controller_rows() -> list[_Row]:
    """What slurmctld still knows: `squeue` (this user's pending and running jobs, one line per
    array task), then `scontrol show job` (every job in its memory, finished ones included until
    MinJobAge). One call each; an unreachable controller gives no rows."""
    # squeue's rows first: `_by_job` keeps a task's first row.
    user = pwd.getpwuid(os.getuid()).pw_name
    rows: list[_Row] = []
    for line in _run(["squeue", "-h", "-r", "-u", user, "-o", "%i|%A|%T"]).splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            rows.append((parts[0], parts[1], parts[2]))
    for line in _run(["scontrol", "show", "job", "-o"]).splitlines():
        fields = _scontrol_fields(line)
        if "JobId" not in fields or "JobState" not in fields:
            continue  # "No jobs in the system"
        own, array, index = fields["JobId"], fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        job = f"{array}_{index if index.isdigit() else f'[{index}]'}" if array and index else own
        rows.append((job, own, fields["JobState"]))
    return rows


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


# scontrol -o: "Key=Value" pairs separated by spaces; only values without spaces are read here.
_PAIR = re.compile(r"(?:^|\s)(JobId|ArrayJobId|ArrayTaskId|JobState|ExitCode)=(\S+)")


def _scontrol_fields(line: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for key, value in _PAIR.findall(line):
        fields.setdefault(key, value)  # the first: a later one may be inside a free-text value
    return fields


def _by_job(rows: Iterable[_Row]) -> dict[str, dict[str, tuple[str, str]]]:
    """Rows by job: {job id: {job field or task: (own job id, state)}}, waiting ranges expanded."""
    jobs: dict[str, dict[str, tuple[str, str]]] = {}
    for field, own, state in rows:
        job = field.split("_")[0].split("+")[0]  # a heterogeneous job's first component speaks
        for task in _expand(field):
            jobs.setdefault(job, {}).setdefault(task, (own, state))
    return jobs


def _expand(field: str) -> list[str]:
    """ "1234_[2-4,7%2]" → the tasks 1234_2, 1234_3, 1234_4, 1234_7; anything else as it is."""
    job, _, index = field.partition("_")
    if not index.startswith("["):
        return [field]
    tasks = []
    for part in index.strip("[]").split("%")[0].split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or not (last or first).isdigit():
            return [field]
        tasks += [f"{job}_{i}" for i in range(int(first), int(last or first) + 1)]
    return tasks


def _job_state(seen: dict[str, tuple[str, str]]) -> JobState:
    if not seen:
        return JobState(UNKNOWN)
    if not any("_" in task for task in seen):  # a plain job
        return JobState(next(iter(seen.values()))[1])

    def index(task: str) -> tuple[int, str]:
        i = task.rpartition("_")[2]
        return (int(i), task) if i.isdigit() else (1 << 62, task)

    tasks = tuple(
        # A task still waiting in the array has no id of its own yet: it shows the array's.
        TaskState(task, "" if state == "PENDING" and own == task.split("_")[0] else own, state)
        for task, (own, state) in sorted(seen.items(), key=lambda kv: index(kv[0]))
        if "_" in task
    )
    return JobState(aggregate(t.state for t in tasks), tasks)


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


def cancel(records: Iterable[JobRecord], tasks: Iterable[str] = ()) -> None:
    """Cancel these jobs (and these array tasks, ``JOB_I``): one scancel for all Slurm ones.
    Raises SubmissionError with scancel's complaint."""
    records = list(records)
    slurm = [r.job_id for r in records if r.engine == "slurm"] + list(tasks)
    if slurm:
        done = subprocess.run(["scancel", *slurm], capture_output=True, text=True)
        if done.returncode != 0:
            raise SubmissionError(f"scancel failed: {done.stderr.strip()}")
    for r in records:
        if r.engine == "local" and local_state(r) == "RUNNING":
            os.kill(int(r.job_id), signal.SIGTERM)  # submitit's controller passes it on


def local_state(record: JobRecord) -> str:
    """A local job runs while its controller lives; then its batch script's exit file tells the
    end (none: it was cancelled)."""
    if _alive(int(record.job_id)):
        return "RUNNING"
    code = local_exit_code(record)
    if code is None:
        return "CANCELLED"
    return "COMPLETED" if code == 0 else "FAILED"


def local_exit_path(folder: str | Path, job_id: str) -> Path:
    """Where a local job's batch script leaves its exit status
    (`slurmddp.batch.local.emulation`)."""
    return Path(folder) / f"{job_id}_exit"


def local_exit_code(record: JobRecord) -> int | None:
    path = local_exit_path(record.folder, record.job_id)
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def exit_code(record: JobRecord) -> int:
    """How the job ended, as a process exit status (0 when it succeeded)."""
    if record.engine == "local":
        code = local_exit_code(record)
        return 1 if code is None else code
    return slurm_exit_code(record.job_id)


def slurm_exit_code(job_id: str) -> int:
    """The batch job's exit status ("1:0" → 1; killed by a signal → 128+signal), the worst of an
    array's tasks; from sacct, else from slurmctld while it remembers the job."""
    try:
        done = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "ExitCode", "-j", job_id],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        said = done.stdout.split() if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        said = []
    if not said:  # no accounting
        shown = _run(["scontrol", "show", "job", "-o", job_id])
        said = [_scontrol_fields(line).get("ExitCode", "") for line in shown.splitlines()]
    codes = []
    for pair in said:
        code, _, sig = pair.partition(":")
        if code.isdigit() and sig.isdigit():
            codes.append(128 + int(sig) if int(sig) else int(code))
    return max(codes, default=1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        return False

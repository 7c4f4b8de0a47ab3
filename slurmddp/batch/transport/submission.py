"""Submitting a `JobSpec`, with submitit as the job engine.

On Slurm, submitit's SlurmExecutor submits our rendered batch script (not its own). With
``--local``, submitit's LocalExecutor runs the same rendered batch script on this machine, with
local stand-ins of srun and scontrol (`slurmddp.batch.local.emulation`). Either way the job lands in
the registry, and its record (`slurmddp.batch.jobs.JobRecord`: state, logs, wait, cancel) is
what `submit` returns: submitit's handle stays inside.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shlex
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from slurmddp.batch import jobs
from slurmddp.batch.local import emulation
from slurmddp.batch.script.sbatch import Context, context, render_for
from slurmddp.batch.spec.jobspec import JobSpec, SpecError
from slurmddp.batch.transport import snapshot
from slurmddp.errors import SubmissionError, UserError
from slurmddp.files import make_dirs
from slurmddp.preemption import rehearsal

# submitit's private API, used on purpose: submitit submits only pickled functions through its
# own batch script (`submit`, or a `CommandFunction` run by its Python wrapper, buffered), and has
# no public way to sbatch a script text of ours, nor to start a command under LocalExecutor's
# controller. So `_submit_command` (write the script, run sbatch, parse the id, make the job
# handle) is called directly and `_make_submission_file_text` overridden to return our script.
# pyproject.toml bounds submitit below the next minor release; tests/test_dependencies.py pins
# both methods' signatures and behaviour, and says which changed.


class _TemplateExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor, but the batch script is our rendered template."""

    def __init__(self, spec: JobSpec, script: str) -> None:
        super().__init__(folder=spec.output_dir, python=shlex.quote(spec.python))
        self._script = script
        # Only used by submitit to count the job's tasks (its log paths per task).
        self.update_parameters(nodes=spec.nodes_max, ntasks_per_node=spec.ntasks_per_node)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script


def submit(spec: JobSpec, *, local: bool = False, signal_after: Sequence[float | str] = (),
           template: Path | None = None, code_from: Path | None = None) -> jobs.JobRecord:
    """Submit `spec`; the job's record, as the registry keeps it (its state, logs, wait and
    cancel: `slurmddp.batch.jobs.JobRecord`).

    `template`: the user's batch script template, else the shipped one (a local job runs it
    too), rendered once, here. `signal_after` (local only): when to send each run's batch script
    the stop signal, one value per run: seconds after its first step, or "Nsteps" (its N-th).
    With `spec.snapshot` (and no `code_dir` yet) the job runs a snapshot of its code taken here,
    first (`slurmddp.batch.transport.snapshot`): of `code_from` when given (the directory a
    function's job imports it from), else of the target's.
    """
    if local and (problem := emulation.local_problem(spec)) is not None:
        raise SpecError(f"--local: {problem}")  # before anything is made
    if bad := [s for s in signal_after if rehearsal.parse(str(s)) is None]:
        raise SpecError(f"signal_after: {bad[0]!r} is neither seconds nor steps: give e.g. 20 "
                        "(seconds after a run's first step) or '50steps'")  # fmt: skip
    created = _make_output_dir(Path(spec.output_dir))  # sbatch needs the batch log's directory
    taken = None
    try:
        if spec.snapshot and spec.code_dir is None:
            taken = snapshot.take(spec, code_from=code_from)
            spec = taken.spec
        ctx = context(spec)
        script = render_for(ctx, template)
        job_id = (_submit_local(ctx, script, signal_after) if local
                  else _submit_slurm(spec, script))  # fmt: skip
    except (SubmissionError, UserError):
        if taken is not None:  # nothing half-done: no snapshot of a job that does not exist
            taken.discard()
        for path in created:  # deepest first
            with contextlib.suppress(OSError):  # not empty: something else wrote there
                path.rmdir()
        raise
    record = jobs.JobRecord(
        job_id=job_id,
        folder=str(Path(spec.output_dir).resolve()),
        name=spec.job_name,
        engine="local" if local else "slurm",
        tasks=spec.nodes_max * spec.ntasks_per_node,
        submitted=time.time(),
        log_pattern=ctx.launcher_type.log_pattern,  # --local's too: the same script
        array="" if local else jobs.array_indices(spec.sbatch_args),
    )
    jobs.remember(record)
    return record


def _make_output_dir(folder: Path) -> list[Path]:
    """mkdir -p `folder`, never world-writable (`slurmddp.files.make_dirs`); the directories
    created, deepest first. Raises SpecError when it is not a directory this user may write."""
    hint = "give --output a directory you may write to"
    try:
        created = make_dirs(folder)
    except OSError as e:
        raise SpecError(f"output directory {str(folder)!r} cannot be created: {e.strerror}; "
                        f"{hint}") from None  # fmt: skip
    if not folder.is_dir():
        raise SpecError(f"output directory {str(folder)!r} is not a directory: {hint}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(f"output directory {str(folder)!r} is not writable: {hint}")
    return created


def _submit_slurm(spec: JobSpec, script: str) -> str:
    """sbatch the batch script; the job's id."""
    if shutil.which("sbatch") is None:
        raise SubmissionError("sbatch not found: submit from a Slurm login node, or use --local")
    executor = _TemplateExecutor(spec, script)
    folder = Path(spec.output_dir)
    before = set(folder.glob(".submission_file_*"))
    try:
        # submitit prints sbatch's stderr itself on failure; our one-line error says it instead.
        with contextlib.redirect_stderr(io.StringIO()):
            # The command argument is unused: the template holds the launch line.
            return str(executor._submit_command("").job_id)
    except (FailedJobError, FailedSubmissionError) as e:
        for leftover in set(folder.glob(".submission_file_*")) - before:
            leftover.unlink()  # nothing half-done: no script of a job that does not exist
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        # sbatch's last line is its verdict ("Batch job submission failed: ...").
        verdict = lines[-1] if lines else str(e)
        if jobs.unreachable(verdict):
            said = verdict.rsplit("failed: ", 1)[-1]
            raise SubmissionError(jobs.controller_unreachable(
                f"sbatch says {said!r}, nothing was submitted")) from None  # fmt: skip
        raise SubmissionError(f"sbatch refused the job: {verdict}") from None


def _submit_local(ctx: Context, text: str, signal_after: Sequence[float | str]) -> str:
    """Run the job's batch script on this machine (`slurmddp.batch.local.emulation`), as one task of
    submitit's LocalExecutor, whose controller warns it before the time limit and starts it again
    when it was requeued; the job's id (the controller's pid)."""
    spec = ctx.spec
    folder = Path(spec.output_dir).resolve()
    script = folder / f".local_script_{secrets.token_hex(6)}.sh"
    script.write_text(text)
    script.chmod(0o700)
    executor = submitit.LocalExecutor(folder=spec.output_dir, python=shlex.quote(spec.python))
    timeout_s = (spec.time_minutes or 60 * 24 * 365) * 60
    executor.update_parameters(tasks_per_node=1, timeout_min=timeout_s / 60,
                               signal_delay_s=spec.signal_lead)  # fmt: skip
    command = [
        spec.python, "-u", "-m", "slurmddp.emulation", "batch",
        "--script", str(script),
        "--batch-log", ctx.batch_log,
        "--folder", str(folder),
        "--nodes", str(spec.nodes_max + spec.spare_nodes),
        "--ntasks-per-node", str(ctx.tasks_per_node),
        *([f"--cpus-per-task={ctx.cpus_per_task}"] if ctx.cpus_per_task else []),
        "--gpus-per-node", str(spec.gpus_per_node),
        "--job-name", spec.job_name,
        "--submit-dir", os.getcwd(),
        "--submit-host", socket.gethostname(),
        *([f"--time-limit={spec.time_minutes * 60}"] if spec.time_minutes else []),
        *([] if spec.requeue else ["--no-requeue"]),
        "--signal", spec.signal,
        *[f"--signal-after={s}" for s in signal_after],
    ]  # fmt: skip
    # submitit's local controller would be in the terminal's process group: a Ctrl-C meant for
    # `submit --follow` would end the job too, with a traceback. Started with SIGINT ignored (as
    # its children then are), it survives as a Slurm job does; `slurmddp cancel` ends it.
    try:
        with _controller_signal(spec.signal):
            if threading.current_thread() is not threading.main_thread():  # the main's signals
                return str(executor._submit_command(shlex.join(command)).job_id)
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                return str(executor._submit_command(shlex.join(command)).job_id)
            finally:
                signal.signal(signal.SIGINT, previous)
    except BaseException:
        script.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _controller_signal(name: str) -> Iterator[None]:
    """submitit's local controller (a child of this process) reads the signal it sends before the
    time-out from the environment it starts with: set for that start only, then as it was."""
    before = os.environ.get(_PREEMPT_SIGNAL)
    os.environ[_PREEMPT_SIGNAL] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PREEMPT_SIGNAL, None)
        else:
            os.environ[_PREEMPT_SIGNAL] = before


_PREEMPT_SIGNAL = "SUBMITIT_PREEMPT_SIGNAL"

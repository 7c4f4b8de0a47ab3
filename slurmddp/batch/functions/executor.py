"""Python functions as distributed jobs, in submitit's style.

    executor = slurmddp.Executor("jobs", nodes=2, gpus_per_node=4, time="4:00:00")
    job = executor.submit(train, config)      # train(config) on all 8 ranks
    job.result()                              # rank 0's return value
    jobs = executor.map_array(evaluate, seeds)  # one Slurm array, a task per seed
    jobs.state                                # "COMPLETED 3, RUNNING 1"

or in one call, ``slurmddp.submit(train, config, nodes=2)``. The keywords are the options of
``slurmddp submit`` (`slurmddp.batch.spec.options`), plus ``local=True`` to run on this machine.

Every rank runs the function with its place in the job set up (RANK, WORLD_SIZE, MASTER_ADDR...,
as for a script under ``slurmddp.run``): it calls `slurmddp.init()` for its process group. How a
rank runs it, and how a preempted function comes back (`slurmddp.should_stop()`, submitit's
``Checkpointable.checkpoint``), is `slurmddp.batch.functions.call`. The job is an ordinary slurmddp
job: ``slurmddp status|logs|cancel`` know it.

The function's code: functions of ``__main__`` (a notebook's, a script's) are pickled whole; one
from a module is imported by name on the nodes, from a snapshot of that module's directory taken
at submission (as ``slurmddp submit`` snapshots a script's), so that an edit after submitting
does not change what a requeued job runs. Installed packages are imported as they are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import secrets
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from submitit.helpers import DelayedSubmission

from slurmddp.batch import jobs
from slurmddp.batch.functions import call
from slurmddp.batch.spec import options
from slurmddp.batch.spec.jobspec import JobSpec, SpecError, build_spec
from slurmddp.batch.transport import submission
from slurmddp.errors import JobFailedError
from slurmddp.files import make_dirs

CALLS = "calls"  # <folder>/calls/<id>/: a submission's call directory


class RemoteTraceback(Exception):
    """A rank's traceback, as the cause of the `JobFailedError` that names the rank."""

    def __str__(self) -> str:
        return "\n\n" + str(self.args[0]).rstrip()


class Executor:
    """Submits Python functions as jobs; `folder` holds their logs and calls.

    `options`: those of ``slurmddp submit`` by their Python names (nodes, gpus_per_node,
    ntasks_per_node, time, partition, setup, env, sbatch_args...). `local`: run on this machine
    (``slurmddp submit --local``); `signal_after` (local only): when the stop signal comes in
    each run, to rehearse a preemption: seconds after its first step, or "Nsteps" (its N-th).
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None, *, local: bool = False,
                 template: str | os.PathLike[str] | None = None,
                 signal_after: Sequence[float | str] = (), **options: Any) -> None:  # fmt: skip
        self.folder = Path(folder if folder is not None else _default_folder()).absolute()
        self.local = local
        self.template = None if template is None else Path(template)
        self.signal_after = tuple(signal_after)
        self.parameters: dict[str, Any] = {}
        self.array_parallelism: int | None = None  # map_array's default
        self.update_parameters(**options)

    def update_parameters(self, **options: Any) -> None:
        """Set job options for the next submissions: ours, or submitit's names for them
        (`SUBMITIT_NAMES`); unknown names raise TypeError, bad values SpecError."""
        if "slurm_array_parallelism" in options:
            self.array_parallelism = options.pop("slurm_array_parallelism")
        options = {SUBMITIT_NAMES[k][0] if k in SUBMITIT_NAMES else k:
                   SUBMITIT_NAMES[k][1](v) if k in SUBMITIT_NAMES else v
                   for k, v in options.items()}  # fmt: skip
        unknown = sorted(set(options) - set(options_names()))
        if unknown:
            raise TypeError(
                f"unknown job option {', '.join(map(repr, unknown))}: the options are "
                f"{', '.join(options_names())}; give the function's own keyword arguments to "
                "Executor.submit (or bind them with functools.partial)"
            )
        merged = {**self.parameters, **options}
        build_spec(("-m", call.__name__), output_dir=str(self.folder), **merged)  # checks them now
        self.parameters = merged

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Job:
        """Run ``fn(*args, **kwargs)`` on every rank of one job; its handle."""
        return self._submit(fn, [DelayedSubmission(fn, *args, **kwargs)], array=False)[0]

    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any],
                  parallelism: int | None = None) -> JobArray:  # fmt: skip
        """``fn(*items)`` for each items of ``zip(*iterables)``, each on every rank of one task of
        a Slurm array (at most `parallelism` at once); their handles, as one `JobArray`."""
        calls = [DelayedSubmission(fn, *items) for items in zip(*iterables, strict=True)]
        if not calls:
            return JobArray([])
        if parallelism is None:
            parallelism = self.array_parallelism
        if parallelism is not None and parallelism < 1:
            raise SpecError(f"parallelism={parallelism}: give a count of at least 1")
        return JobArray(self._submit(fn, calls, array=True, parallelism=parallelism))

    def _submit(self, fn: Callable[..., Any], calls: list[DelayedSubmission], *, array: bool,
                parallelism: int | None = None) -> list[Job]:  # fmt: skip
        if not callable(fn):
            raise TypeError(f"{fn!r} is not callable: give the function to run on every rank")
        home = code_home(fn)
        root = self.folder / CALLS / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
        created = make_dirs(root)
        submitted: list[Job] = []
        try:
            for task, c in enumerate(calls):
                make_dirs(call.task_dir(root, task))
                call.write_call(call.task_dir(root, task) / call.CALL, c,
                                None if home is None else str(home))  # fmt: skip
            if array and not self.local:
                spec = self._spec(fn, root, call.ARRAY, home, _array_arg(len(calls), parallelism))
                record = self._send(spec, home)
                submitted += [Job(record, root, task, array=True) for task in range(len(calls))]
            else:
                for task in range(len(calls)):  # on this machine, an array is as many jobs
                    spec = self._spec(fn, root, str(task), home)
                    submitted.append(Job(self._send(spec, home), root, task))
            return submitted
        except BaseException:
            if not submitted:  # nothing half-done: no calls of a job that does not exist
                shutil.rmtree(root, ignore_errors=True)
                for path in created[1:]:  # deepest first; not empty: someone else's
                    with contextlib.suppress(OSError):
                        path.rmdir()
            raise

    def _spec(self, fn: Callable[..., Any], root: Path, task: str, home: Path | None,
              sbatch_more: tuple[str, ...] = ()) -> JobSpec:  # fmt: skip
        values = dict(self.parameters)
        values.setdefault("job_name", _job_name(fn))
        if home is None:
            values["snapshot"] = False  # all the code is installed, or pickled whole
        given = tuple(values.get("sbatch_args") or ())
        if sbatch_more and jobs.array_indices(given):
            raise SpecError("sbatch_args hold --array: map_array makes the array itself")
        values["sbatch_args"] = (*given, *sbatch_more)
        target = ("-m", call.__name__, str(root), "--task", task)
        return build_spec(target, output_dir=str(self.folder), **values)

    def _send(self, spec: JobSpec, home: Path | None) -> jobs.JobRecord:
        return submission.submit(spec, local=self.local, signal_after=self.signal_after,
                                 template=self.template, code_from=home)  # fmt: skip


def _same(value: Any) -> Any:
    return value


# submitit's executor parameters, as our options: a submitit user's update_parameters works.
SUBMITIT_NAMES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "timeout_min": ("time", str),  # minutes, as Slurm reads a bare number
    "mem_gb": ("mem", lambda gb: f"{gb}G"),
    "tasks_per_node": ("ntasks_per_node", _same),
    "name": ("job_name", _same),
    "slurm_partition": ("partition", _same),
    "slurm_account": ("account", _same),
    "slurm_qos": ("qos", _same),
    "slurm_constraint": ("constraint", _same),
    "slurm_setup": ("setup", _same),
    "slurm_srun_args": ("srun_args", _same),
    "slurm_additional_parameters": (
        "sbatch_args", lambda extra: [f"--{k.replace('_', '-')}={v}" for k, v in extra.items()]),
}


def options_names() -> list[str]:
    """The job options `Executor` and `submit` take, by their Python names."""
    return sorted(o.param for o in options.OPTIONS if o.spec and o.param != "output_dir")


class Job:
    """A submitted function: its state, its ranks' outcomes, and rank 0's value.

    For an array's task, `job_id` is Slurm's ``<array job>_<index>``.
    """

    def __init__(self, record: jobs.JobRecord, root: Path, task: int, array: bool = False):
        self.record = record
        self.root = root
        self.task = task
        self.array = array
        self.job_id = f"{record.job_id}_{task}" if array else record.job_id

    def __repr__(self) -> str:
        return f"Job<{self.job_id}, {self.record.name}>"

    @property
    def state(self) -> str:
        """Slurm's state of the job (RUNNING, COMPLETED...), asked now."""
        seen = jobs.job_states([self.record])[self.record.job_id]
        if not self.array:
            return seen.state
        for t in seen.tasks:
            if t.task == self.job_id:
                return t.state
        return "PENDING"

    def done(self) -> bool:
        """Whether the job has ended for good (a requeued one has not)."""
        return jobs.is_final(self.state)

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the job has ended; its final state. Raises TimeoutError after `timeout` s."""
        ending = self.record.ending() if not self.array else None
        return jobs.wait_until_final(lambda: self.state, timeout, self.job_id, ending)

    def outcomes(self) -> dict[int, call.Outcome]:
        """How each rank's call ended in the job's last run, by rank (those that said)."""
        runs = sorted(call.task_dir(self.root, self.task).glob("run-*"),
                      key=lambda p: int(p.name.split("-")[1]))  # fmt: skip
        if not runs:
            return {}
        out = {}
        for path in runs[-1].glob("rank-*.pkl"):
            o = call.read_outcome(path)
            out[o.rank] = o
        return out

    def exception(self, timeout: float | None = None) -> JobFailedError | None:
        """Why the job gave no value (waiting for its end first), or None when rank 0 gave one."""
        state = self.wait(timeout)
        seen = self.outcomes()
        failed = sorted((o for o in seen.values() if not o.ok), key=lambda o: o.ended)
        if failed:
            first = failed[0]
            others = f"; {len(failed) - 1} other rank(s) failed after it" if failed[1:] else ""
            error = JobFailedError(
                f"job {self.job_id}: rank {first.rank} of {first.world_size} (on {first.host}) "
                f"failed first: {first.error_text}{others}",
                rank=first.rank, error=_loaded(first), traceback=first.traceback,
            )  # fmt: skip
            error.__cause__ = RemoteTraceback(first.traceback)
            return error
        if 0 not in seen:
            return JobFailedError(f"job {self.job_id} ended {state} without a value from rank 0; "
                                  f"its log: {self.log(0)}")  # fmt: skip
        return None

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value, once the job has ended. Raises `JobFailedError` naming the
        first rank that failed and its exception, or saying how the job ended without one."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.outcomes()[0].load()

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's return value, by rank (raises as `result` does)."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        seen = self.outcomes()
        return [seen[r].load() for r in sorted(seen)]

    def log(self, rank: int = 0) -> Path:
        """Where rank `rank`'s output goes (an array task's: under the task's own job id)."""
        job_id = self.record.job_id
        if self.array:
            for t in jobs.job_states([self.record])[self.record.job_id].tasks:
                if t.task == self.job_id and t.job_id:
                    job_id = t.job_id
        return jobs.JobRecord(**{**self.record.__dict__, "job_id": job_id}).log(rank)

    def cancel(self) -> None:
        """Cancel the job (an array's task alone)."""
        if self.array:
            jobs.cancel([], tasks=[self.job_id])
        else:
            jobs.cancel([self.record])


class JobArray(Sequence[Job]):
    """The jobs of one `map_array`, in order, with their state counted as one."""

    def __init__(self, tasks: list[Job]) -> None:
        self._tasks = tasks

    @overload
    def __getitem__(self, i: int) -> Job: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Job]: ...
    def __getitem__(self, i: int | slice) -> Job | Sequence[Job]:
        return self._tasks[i]

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._tasks)

    def __repr__(self) -> str:
        return f"JobArray<{len(self)} tasks: {self.state}>"

    @property
    def state(self) -> str:
        """The tasks' states counted ("COMPLETED 3, RUNNING 1"), asked in one go."""
        records = {t.record.job_id: t.record for t in self._tasks}
        seen = jobs.job_states(records.values())
        states = []
        for t in self._tasks:
            s = seen[t.record.job_id]
            if t.array:
                states.append(next((x.state for x in s.tasks if x.task == t.job_id), "PENDING"))
            else:
                states.append(s.state)
        return jobs.aggregate(states)

    def done(self) -> bool:
        """Whether every task has ended for good."""
        return jobs.is_final(self.state) if self._tasks else True

    def wait(self, timeout: float | None = None) -> str:
        """Wait until every task has ended; their states counted."""
        if not self._tasks:
            return ""
        return jobs.wait_until_final(lambda: self.state, timeout, "the array")

    def results(self, timeout: float | None = None) -> list[Any]:
        """Each task's rank 0 value, in order (raises for the first task that failed)."""
        self.wait(timeout)
        return [t.result() for t in self._tasks]

    def cancel(self) -> None:
        """Cancel every task."""
        records = {t.record.job_id: t.record for t in self._tasks}
        jobs.cancel(records.values())


@overload
def submit(
    target: JobSpec,
    *,
    local: bool = ...,
    signal_after: Sequence[float | str] = ...,
    template: Path | None = ...,
    code_from: Path | None = ...,
) -> jobs.JobRecord: ...
@overload
def submit(target: Callable[..., Any], *args: Any, **options: Any) -> Job: ...
def submit(target: Any, *args: Any, **options: Any) -> Any:
    """Submit a job: a `JobSpec` (`slurmddp.batch.transport.submission.submit`: its `JobRecord`), or
    a function run on every rank, ``target(*args)``, with `Executor`'s options (its `Job`)."""
    if isinstance(target, JobSpec):
        return submission.submit(target, *args, **options)
    ex_keys = ("folder", "local", "template", "signal_after")
    given = {k: options.pop(k) for k in ex_keys if k in options}
    return Executor(**given, **options).submit(target, *args)


def code_home(fn: Callable[..., Any]) -> Path | None:
    """The directory `fn`'s module is imported from when it is the user's own code (None when
    installed, or pickled whole): what the job snapshots and puts first on sys.path. For a
    notebook's or an interactive session's ``__main__``, the working directory."""
    obj = _unwrapped(fn)
    if inspect.ismethod(obj):
        obj = obj.__func__
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        obj = type(obj)  # a callable object: its class's module
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None:
        return None
    name = getattr(getattr(module, "__spec__", None), "name", None) or module.__name__
    file = getattr(module, "__file__", None)
    if file is None:
        return Path.cwd() if name == "__main__" else None
    path = Path(os.path.realpath(file))
    if _installed(path):
        return None
    depth = name.count(".") + (1 if path.stem == "__init__" else 0)
    return path.parents[depth]


def _installed(path: Path) -> bool:
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    return any(path.is_relative_to(r) for r in roots)


def _default_folder() -> str:
    default = next(o.default for o in options.OPTIONS if o.param == "output_dir")
    return str(default)


def _unwrapped(fn: Callable[..., Any]) -> Any:
    """`fn` without its functools.partial layers."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _job_name(fn: Callable[..., Any]) -> str:
    obj = _unwrapped(fn)
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return re.sub(r"[^\w.-]", "_", name) or "function"


def _array_arg(n: int, parallelism: int | None) -> tuple[str, ...]:
    return (f"--array=0-{n - 1}" + (f"%{parallelism}" if parallelism else ""),)


def _loaded(outcome: call.Outcome) -> object:
    try:
        return outcome.load()
    except Exception:
        return None

"""The batch script of ``slurmddp submit``: a `JobSpec` rendered through templates/sbatch.sh.j2.

Log layout, one directory per job under the spec's output_dir (requeued runs append)::

    <output_dir>/<job id>.batch.log        the batch shell and the supervisor: setup, srun's
                                           own messages
    <output_dir>/<job id>/...              the ranks' logs, named by the launcher
                                           (`slurmddp.supervisor.launchers`)

Slurm does not create a missing directory for ``--output``, so the batch log sits in output_dir
itself (which must exist at submission) and the supervisor makes the per-job directory before
the step starts.

The script is directives, environment, the setup lines, and a hand-over to the job's supervisor
(`slurmddp.supervisor`) with the job's `plan` as JSON: the supervisor runs the step, passes the
stop signal on, asks `slurmddp.preemption.decision` what happens to the job and carries it out.
``--signal=B:USR2@lead`` (or USR1) warns the batch shell, which passes it on to the supervisor.

Every variable name, exit status and setting of that protocol reaches the template from
`slurmddp.protocol`, as ``p`` (``{{ p.DONE_FILE_VAR }}``): the template spells none itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from slurmddp import protocol
from slurmddp.batch.script import container, templating
from slurmddp.batch.spec.jobspec import JobSpec
from slurmddp.rank.env import LAUNCHER_PREFIXES, LAUNCHER_VARIABLES
from slurmddp.supervisor.launchers import Launcher, launcher
from slurmddp.supervisor.plan import Plan

__all__ = ["DEFAULT_TEMPLATE", "Context", "context", "directives", "plan", "render_for",
           "render_script"]

DEFAULT_TEMPLATE = "sbatch.sh.j2"


def render_script(spec: JobSpec, template: str = DEFAULT_TEMPLATE) -> str:
    """The batch script for `spec`, from the shipped template `template`."""
    return templating.render(template, **context(spec).variables())


def render_for(spec: JobSpec | Context, user_template: Path | None = None) -> str:
    """The batch script of `spec` (or of its `context`, made once by the caller): the shipped
    template, or the user's file (``template`` in a profile, ``--template``), sandboxed, with the
    same variables and filters."""
    variables = (spec if isinstance(spec, Context) else context(spec)).variables()
    if user_template is None:
        return templating.render(DEFAULT_TEMPLATE, **variables)
    return templating.render_file(user_template, **variables)


def plan(spec: JobSpec) -> Plan:
    """What the job's supervisor runs, for every run of the job."""
    kind = launcher(spec.launcher)
    return Plan(
        launcher=spec.launcher, python=spec.python, target=spec.target,
        log_root=_log_root(spec), rank_prefix=container.rank_prefix(spec),
        # srun's own options, then those that start each task in the image (pyxis).
        srun_args=(*spec.srun_args, *container.srun_args(spec)),
        cpus_per_task=kind.cpus_per_task(spec.ntasks_per_node, spec.cpus_per_task),
        mpi=spec.mpi, signal=spec.signal, preflight=spec.preflight,
        nodes=spec.nodes_min + spec.spare_nodes, nodes_min=spec.nodes_min,
        spare_nodes=spec.spare_nodes, elastic=spec.elastic, nproc_per_node=spec.ntasks_per_node,
        rdzv_backend=spec.rdzv_backend, rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_port=spec.rdzv_port, max_restarts=spec.max_restarts,
    )  # fmt: skip


def _log_root(spec: JobSpec) -> str:
    # Slurm expands %j, %t, %n... in log paths; %% is a literal %.
    return spec.output_dir.rstrip("/").replace("%", "%%")


def directives(spec: JobSpec) -> tuple[tuple[str, object], ...]:
    """The job's #SBATCH options before the user's own: (option, value or None for a flag)."""
    kind = launcher(spec.launcher)
    optional = (("--gpus-per-node", spec.gpus_per_node or None),
                ("--cpus-per-task", kind.cpus_per_task(spec.ntasks_per_node, spec.cpus_per_task)),
                ("--mem", spec.mem), ("--time", spec.time_minutes),
                ("--partition", spec.partition), ("--account", spec.account), ("--qos", spec.qos),
                ("--constraint", spec.constraint))  # fmt: skip
    if spec.requeue:
        stopping: tuple[tuple[str, object], ...] = (
            ("--requeue", None), ("--signal", f"B:{spec.signal}@{spec.signal_lead}"))
    else:
        stopping = (("--no-requeue", None),)
    return (
        ("--job-name", spec.job_name), ("--nodes", spec.allocated_nodes),
        ("--ntasks-per-node", kind.tasks_per_node(spec.ntasks_per_node)),
        *((o, v) for o, v in optional if v is not None),
        ("--output", f"{_log_root(spec)}/%j.batch.log"), ("--open-mode", "append"),
        *((("--no-kill", None),) if spec.elastic else ()), *stopping,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Context:
    """What a batch script template is rendered with (`variables`): every field of the spec by
    its name, then these, which take precedence. A template of the user's (``--template``) gets
    the same variables; ``protocol`` names reach it as ``p``."""

    spec: JobSpec
    output_dir: str
    """The spec's output directory, without a trailing slash."""
    nodes: str
    """The nodes asked of Slurm: ``N`` or ``MIN-MAX``, the spares included."""
    elastic: bool
    """torchrun's agents go on in place when a node is lost (`JobSpec.elastic`)."""
    tasks_per_node: int
    """Slurm's tasks a node: under torchrun one, which starts the workers itself."""
    cpus_per_task: int | None
    """Slurm's CPUs a task (under torchrun, the node's ranks' together); None: Slurm's default."""
    batch_log: str
    """The batch shell's log, as ``--output`` takes it (``%`` doubled, ``%j`` the job)."""
    rank_log: str
    """The ranks' logs, as srun's ``--output`` takes them."""
    launcher_type: Launcher
    """The launcher (`slurmddp.supervisor.launchers`): its task layout, logs, step."""
    directives: tuple[tuple[str, object], ...]
    """The ``#SBATCH`` options before the user's own: (option, value, or None for a flag)."""
    plan: str
    """What the supervisor runs, as one JSON word (`slurmddp.supervisor.plan.Plan`)."""
    fixed_nodes: bool
    """The node count is fixed (no range): for templates written for it."""
    nproc_per_node: int
    """The ranks a node."""
    p: Mapping[str, object]
    """The protocol's variable names, exit statuses and settings (`slurmddp.protocol`)."""
    state_files: tuple[tuple[str, str], ...]
    """(variable, file name) of each state file of the stop protocol."""
    protocol_env: tuple[tuple[str, object], ...]
    """What the ranks read: the backend ``init()`` takes by default, the stop protocol's
    settings."""
    rank_prefix: tuple[str, ...]
    """The words that start each rank (in its image, when the ranks run in one)."""
    srun_args: tuple[str, ...]
    """srun's own options, then those that start each task in the image (pyxis)."""
    decision_python: str
    """The supervisor's Python: on the host, also when the ranks run in an image."""
    not_requeued_status: int
    """The exit status of a job that ended wanting a requeue it did not get (also ``p``)."""
    srun_settle_s: float
    """Seconds after srun's start before a signal is passed on to it (also ``p``)."""
    launcher_variables: tuple[str, ...]
    """Launcher variables the batch shell unsets (the submitting shell's)."""
    launcher_prefixes: tuple[str, ...]
    """Prefixes of launcher variables the batch shell unsets."""

    def variables(self) -> dict[str, object]:
        """The template's variables, by name."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "spec"}  # fmt: skip
        return {**{f.name: getattr(self.spec, f.name) for f in dataclasses.fields(self.spec)},
                **own}


def context(spec: JobSpec) -> Context:
    """The template's context for `spec`: its fields plus the values derived from them."""
    kind = launcher(spec.launcher)
    log_root = _log_root(spec)
    return Context(
        spec=spec,
        output_dir=spec.output_dir.rstrip("/"),
        nodes=spec.allocated_nodes,
        elastic=spec.elastic,
        tasks_per_node=kind.tasks_per_node(spec.ntasks_per_node),
        cpus_per_task=kind.cpus_per_task(spec.ntasks_per_node, spec.cpus_per_task),
        batch_log=f"{log_root}/%j.batch.log",
        rank_log=f"{log_root}/%j/{kind.rank_log}",
        launcher_type=kind,
        directives=directives(spec),
        plan=plan(spec).to_json(),
        fixed_nodes=spec.nodes_min == spec.nodes_max,
        nproc_per_node=spec.ntasks_per_node,
        p=protocol.template_names(),
        state_files=protocol.STATE_FILES,
        protocol_env=(
            (protocol.BACKEND_VAR, spec.backend),
            (protocol.SIGNAL_VAR, spec.signal),
            (protocol.SIGNAL_LEAD_VAR, spec.signal_lead),
            (protocol.MAX_REQUEUES_VAR, spec.max_requeues if spec.requeue else 0),
            (protocol.HANG_TIMEOUT_VAR, spec.hang_timeout),
            (protocol.LEAVE_SLOW_NODES_VAR, int(spec.leave_slow_nodes)),
        ),
        rank_prefix=container.rank_prefix(spec),
        srun_args=(*spec.srun_args, *container.srun_args(spec)),
        decision_python=spec.python if spec.container is None else spec.host_python,
        not_requeued_status=protocol.NOT_REQUEUED_STATUS,
        srun_settle_s=protocol.SRUN_SETTLE_S,
        launcher_variables=LAUNCHER_VARIABLES,
        launcher_prefixes=LAUNCHER_PREFIXES,
    )

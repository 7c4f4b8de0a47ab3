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
from pathlib import Path

from slurmddp import protocol
from slurmddp.batch import container, templating
from slurmddp.batch.jobspec import JobSpec, validate
from slurmddp.rank.env import LAUNCHER_PREFIXES, LAUNCHER_VARIABLES
from slurmddp.supervisor.launchers import launcher
from slurmddp.supervisor.plan import Plan

DEFAULT_TEMPLATE = "sbatch.sh.j2"


def render_script(spec: JobSpec, template: str = DEFAULT_TEMPLATE) -> str:
    """The batch script for `spec` (validated first: raises `slurmddp.batch.jobspec.SpecError`)."""
    validate(spec)
    return templating.render(template, **context(spec))


def render_for(spec: JobSpec, user_template: Path | None = None) -> str:
    """The batch script of `spec`: the shipped template, or the user's file (``template`` in a
    profile, ``--template``), sandboxed, with the same variables and filters."""
    if user_template is None:
        return render_script(spec)
    validate(spec)
    return templating.render_file(user_template, **context(spec))


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


def context(spec: JobSpec) -> dict[str, object]:
    """The template's variables: the spec's fields plus the values derived from them."""
    kind = launcher(spec.launcher)
    root = spec.output_dir.rstrip("/")
    log_root = _log_root(spec)
    return {
        **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
        "output_dir": root,
        "nodes": spec.allocated_nodes,
        "elastic": spec.elastic,
        # Slurm tasks per node: under torchrun, one per node that starts the workers itself.
        "tasks_per_node": kind.tasks_per_node(spec.ntasks_per_node),
        "cpus_per_task": kind.cpus_per_task(spec.ntasks_per_node, spec.cpus_per_task),
        "batch_log": f"{log_root}/%j.batch.log",
        "rank_log": f"{log_root}/%j/{kind.rank_log}",
        "launcher_type": kind,
        "directives": directives(spec),
        # What the supervisor runs (slurmddp.supervisor.plan), handed over as one JSON word.
        "plan": plan(spec).to_json(),
        "fixed_nodes": spec.nodes_min == spec.nodes_max,  # for user templates written for it
        "nproc_per_node": spec.ntasks_per_node,
        "p": protocol.template_names(),
        "state_files": protocol.STATE_FILES,
        # What the ranks read: the backend init() takes by default, the stop protocol's settings.
        "protocol_env": (
            (protocol.BACKEND_VAR, spec.backend),
            (protocol.SIGNAL_VAR, spec.signal),
            (protocol.SIGNAL_LEAD_VAR, spec.signal_lead),
            (protocol.MAX_REQUEUES_VAR, spec.max_requeues if spec.requeue else 0),
            (protocol.HANG_TIMEOUT_VAR, spec.hang_timeout),
        ),
        "rank_prefix": container.rank_prefix(spec),
        # srun's own options, then those that start each task in the image (pyxis).
        "srun_args": (*spec.srun_args, *container.srun_args(spec)),
        # The supervisor's Python: on the host, also when the ranks run in an image.
        "decision_python": spec.python if spec.container is None else spec.host_python,
        # The shipped template reads these from `p`; user templates written for them still work.
        "not_requeued_status": protocol.NOT_REQUEUED_STATUS,
        "srun_settle_s": protocol.SRUN_SETTLE_S,
        "launcher_variables": LAUNCHER_VARIABLES,
        "launcher_prefixes": LAUNCHER_PREFIXES,
    }

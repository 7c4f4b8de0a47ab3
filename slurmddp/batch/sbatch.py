"""The batch script of ``slurmddp submit``: a `JobSpec` rendered through templates/sbatch.sh.j2.

Log layout, one directory per job under the spec's output_dir (requeued runs append)::

    <output_dir>/<job id>.batch.log        the batch shell: setup, srun's own messages
    <output_dir>/<job id>/rank-<rank>.log  launcher srun: one file per rank (%t)
    <output_dir>/<job id>/node-<node>.log  launcher torchrun: one per node (%n), lines tagged
                                           with the rank (torchrun's rendezvous, not the node
                                           order, decides which ranks a node runs)

Slurm does not create a missing directory for ``--output``, so the batch log sits in output_dir
itself (which must exist at submission) and the batch shell makes the per-job directory before
the step starts.

Launchers:

- ``srun``: one Slurm task per rank, each running ``python -m slurmddp.run TARGET``.
- ``torchrun``: one Slurm task per node running ``python -m slurmddp.agent`` (torchrun, relaying
  the stop signal to its workers), which starts ntasks_per_node workers. The job then asks for
  one task per node with all of that node's CPUs (ntasks_per_node x cpus_per_task): a job of
  ntasks_per_node tasks per node would make the step's ``srun --ntasks-per-node=1`` inherit
  SLURM_NTASKS and start that many torchruns per node (srun 22.05 warns and ignores
  --ntasks-per-node).
- ``mpirun``: the batch shell runs ``mpirun -np $SLURM_NTASKS``, which finds the allocation
  itself; one log holds every rank's lines, tagged with the rank.

Signals: ``--signal=B:USR2@lead`` (or USR1) warns the batch shell, which leaves it in the job's
stop file and passes it on to srun (or mpirun), which forwards it to every task (srun 22.05
forwards only USR1 and USR2 unchanged: see `jobspec.SIGNALS`); each rank starts with it
ignored (`signals.ignoring`) until its runner takes it. TERM is noted, never forwarded:
Slurm sends it to every step itself, and srun answers a TERM by killing its step with SIGKILL.
After the step, the shell asks `slurmddp.preemption.decision` what happens to the job, from the
ranks' files and Slurm's record of the job, and carries it out.

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


def context(spec: JobSpec) -> dict[str, object]:
    """The template's variables: the spec's fields plus the values derived from them."""
    torchrun = spec.launcher == "torchrun"
    root = spec.output_dir.rstrip("/")
    # Slurm expands %j, %t, %n... in log paths; %% is a literal %.
    log_root = root.replace("%", "%%")
    return {
        **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
        "output_dir": root,
        "nodes": spec.allocated_nodes,
        "elastic": spec.elastic,
        # Slurm tasks per node: under torchrun, one per node that starts the workers itself.
        "tasks_per_node": 1 if torchrun else spec.ntasks_per_node,
        "cpus_per_task": (
            spec.ntasks_per_node * (spec.cpus_per_task or 1) if torchrun else spec.cpus_per_task
        ),
        "batch_log": f"{log_root}/%j.batch.log",
        "rank_log": f"{log_root}/%j/" + ("node-%n.log" if torchrun else "rank-%t.log"),
        # Elastic (a node range or spares under torchrun): the agents take MIN up to the nodes
        # the allocation got, less the spares, so the first rendezvous closes as soon as all
        # have joined (torchrun's MIN:MAX would otherwise wait its last call for nodes the
        # allocation never has); a spare waits in torchrun's redundancy list.
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
        # The batch shell's Python (the requeue decision): on the host, also when the ranks run
        # in an image.
        "decision_python": spec.python if spec.container is None else spec.host_python,
        # The shipped template reads these from `p`; user templates written for them still work.
        "not_requeued_status": protocol.NOT_REQUEUED_STATUS,
        "srun_settle_s": protocol.SRUN_SETTLE_S,
        "launcher_variables": LAUNCHER_VARIABLES,
        "launcher_prefixes": LAUNCHER_PREFIXES,
    }

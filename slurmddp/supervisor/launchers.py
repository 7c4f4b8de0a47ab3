"""The launchers of ``slurmddp submit``, one type each: how the job's tasks are laid out, where the
ranks' logs go, and the step's command line.

- `Srun`: one Slurm task per rank, each running ``python -m slurmddp.run TARGET``; one log per
  rank.
- `Torchrun`: one Slurm task per node running ``python -m slurmddp.agent`` (torchrun, relaying the
  stop signal to its workers), which starts ntasks_per_node workers. The job asks for one task per
  node with all of that node's CPUs: a job of ntasks_per_node tasks per node would make the step's
  ``srun --ntasks-per-node=1`` inherit SLURM_NTASKS and start that many torchruns per node (srun
  22.05 warns and ignores --ntasks-per-node). One log per node, lines tagged with the rank
  (torchrun's rendezvous, not the node order, decides which ranks a node runs).
- `Mpirun`: ``mpirun -np $SLURM_NTASKS``, which finds the allocation itself (it starts its daemons
  with srun) and passes USR1/USR2 on to every rank; one log holds every rank's lines, tagged.

Pure: the submission side asks for the layout and the log names, the supervisor for the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from slurmddp.protocol import HANG_TIMEOUT_VAR, PREFLIGHT_MODULE
from slurmddp.supervisor.plan import Plan


@dataclasses.dataclass(frozen=True)
class Run:
    """What only the running job knows, from the variables Slurm gives its batch script."""

    job_id: str
    restart: int
    num_nodes: int
    ntasks: int
    first_node: str  # the allocation's first node ("" if unknown)

    @classmethod
    def of(cls, environ: Mapping[str, str]) -> Run:
        """This run, from SLURM_JOB_ID, SLURM_RESTART_COUNT, SLURM_JOB_NUM_NODES, SLURM_NTASKS
        and SLURM_JOB_NODELIST (expanded here: no call to Slurm)."""
        from slurmddp.rank import hostlist

        nodelist = environ.get("SLURM_JOB_NODELIST", "")
        try:
            first = hostlist.expand(nodelist)[0] if nodelist else ""
        except (ValueError, IndexError):
            first = ""
        return cls(job_id=environ.get("SLURM_JOB_ID", ""),
                   restart=_count(environ.get("SLURM_RESTART_COUNT")),
                   num_nodes=_count(environ.get("SLURM_JOB_NUM_NODES"), 1),
                   ntasks=_count(environ.get("SLURM_NTASKS"), 1), first_node=first)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Step:
    """A command the supervisor runs, and the file its output is appended to (None: the batch
    log, where srun's own messages belong)."""

    argv: tuple[str, ...]
    output: str | None = None


class Launcher:
    """One way of starting the ranks; `LAUNCHERS` holds one of each."""

    name: ClassVar[str]
    rank_log: ClassVar[str]  # the ranks' log under <output dir>/<job id>/, in srun's % patterns
    # The same for `slurmddp.batch.jobs` (logs, --follow): {folder}, {job_id}, {rank}.
    log_pattern: ClassVar[str]
    log_note: ClassVar[str]  # what the log holds, for the batch script's header
    # Why it cannot run under ``--local`` (words after "--local: "); None if it can.
    local_problem: ClassVar[str | None] = None
    # What applies to it, for the job's checks (slurmddp.batch.spec.jobspec): srun starts its tasks
    # (so an image's pyxis options reach them); srun's --mpi plugin; torchrun's agents (a
    # rendezvous, restarts, spare nodes, a node range that goes on in place).
    through_srun: ClassVar[bool] = True
    mpi_plugin: ClassVar[bool] = False
    agents: ClassVar[bool] = False

    def tasks_per_node(self, ntasks_per_node: int) -> int:
        """Slurm tasks per node for `ntasks_per_node` ranks per node."""
        return ntasks_per_node

    def cpus_per_task(self, ntasks_per_node: int, cpus_per_task: int | None) -> int | None:
        """Each Slurm task's CPUs, given each rank's."""
        return cpus_per_task

    def step(self, plan: Plan, run: Run) -> Step:
        """The step's command line for this run."""
        raise NotImplementedError

    def _rank(self, plan: Plan, *args: str) -> tuple[str, ...]:
        return (*plan.rank_prefix, plan.python, *args)


class Srun(Launcher):
    name = "srun"
    rank_log = "rank-%t.log"
    log_pattern = "{folder}/{job_id}/rank-{rank}.log"
    log_note = "each rank's output"
    mpi_plugin = True

    def step(self, plan: Plan, run: Run) -> Step:
        return Step(_srun(plan, self.rank_log) + self._rank(plan, "-m", "slurmddp.run",
                                                             *plan.target))  # fmt: skip


class Torchrun(Launcher):
    name = "torchrun"
    rank_log = "node-%n.log"
    log_pattern = "{folder}/{job_id}/node-{rank}.log"
    log_note = ("each node's torchrun, lines tagged [rank/world size] (torchrun's rendezvous "
                "decides which ranks a node runs)")  # fmt: skip
    agents = True

    def tasks_per_node(self, ntasks_per_node: int) -> int:
        return 1  # each node's agent starts its workers

    def cpus_per_task(self, ntasks_per_node: int, cpus_per_task: int | None) -> int | None:
        return ntasks_per_node * (cpus_per_task or 1)

    def step(self, plan: Plan, run: Run) -> Step:
        if plan.elastic:
            # The agents take MIN up to the nodes the allocation got, less the spares, so the
            # first rendezvous closes as soon as all have joined (torchrun's MIN:MAX would
            # otherwise wait its last call for nodes the allocation never has); a spare waits
            # in torchrun's redundancy list.
            nnodes = f"{plan.nodes_min}:{run.num_nodes - plan.spare_nodes}"
        else:
            nnodes = str(plan.nodes)
        endpoint = plan.rdzv_endpoint
        if endpoint is None:  # torchrun's rendezvous runs on the allocation's first node
            if not run.first_node:
                raise ValueError("cannot name the first node of the job's nodes "
                                 "(SLURM_JOB_NODELIST), where torchrun's rendezvous runs")
            port = "" if plan.rdzv_port is None else f":{plan.rdzv_port}"
            endpoint = run.first_node + port
        return Step(_srun(plan, self.rank_log, "--ntasks-per-node=1") + self._rank(
            plan, "-m", "slurmddp.agent", f"--nnodes={nnodes}",
            f"--nproc-per-node={plan.nproc_per_node}", f"--rdzv-backend={plan.rdzv_backend}",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run.job_id}.{run.restart}",
            f"--max-restarts={plan.max_restarts}", "-m", "slurmddp.run", "--tag-output",
            *plan.target))  # fmt: skip


class Mpirun(Launcher):
    name = "mpirun"
    rank_log = "ranks.log"
    log_pattern = "{folder}/{job_id}/ranks.log"
    log_note = "every rank's output, lines tagged [rank/world size]"
    local_problem = ("--launcher mpirun cannot run locally (mpirun finds the allocation's nodes "
                     "through Slurm): use --launcher srun or torchrun")  # fmt: skip
    through_srun = False

    def step(self, plan: Plan, run: Run) -> Step:
        return Step(("mpirun", "-np", str(run.ntasks),
                     *self._rank(plan, "-m", "slurmddp.run", "--tag-output", *plan.target)),
                    output=str(plan.job_dir(run.job_id) / self.rank_log))


LAUNCHERS: Mapping[str, Launcher] = {t.name: t() for t in (Srun, Torchrun, Mpirun)}


def launcher(name: str) -> Launcher:
    """The launcher called `name` (KeyError if none is)."""
    return LAUNCHERS[name]


def preflight(plan: Plan, run: Run) -> Step:
    """A task per node that proves the node and the collectives before the step (``--preflight``).

    No hang watchdog: the preflight has its own timeout.
    """
    return Step((
        "srun", "--kill-on-bad-exit=1", "--open-mode=append",
        f"--output={plan.log_root}/%j/preflight.log", f"--ntasks={run.num_nodes}",
        "--ntasks-per-node=1", f"--export=ALL,{HANG_TIMEOUT_VAR}=0",
        *_cpus(plan), *plan.srun_args, *plan.rank_prefix, plan.python, "-m", "slurmddp.run",
        "-m", PREFLIGHT_MODULE))  # fmt: skip


def spacer(plan: Plan) -> Step:
    """An empty step (a task that runs ``true``), to take a step id; see
    `slurmddp.supervisor.supervise.Supervisor._explain_the_last_run`."""
    return Step(("srun", "--nodes=1", "--ntasks=1", "--quiet", *_cpus(plan), "true"))


def _srun(plan: Plan, rank_log: str, *tasks: str) -> tuple[str, ...]:
    # Elastic: a node's end ends neither the step nor the job; the other agents re-rendezvous.
    ending = ("--kill-on-bad-exit=0", "--no-kill") if plan.elastic else ("--kill-on-bad-exit=1",)
    mpi = () if plan.mpi is None else (f"--mpi={plan.mpi}",)
    return ("srun", *ending, "--open-mode=append", f"--output={plan.log_root}/%j/{rank_log}",
            *tasks, *_cpus(plan), *mpi, *plan.srun_args)  # fmt: skip


def _cpus(plan: Plan) -> tuple[str, ...]:
    # srun 22.05 no longer takes --cpus-per-task from the job: the step asks for it again.
    return () if plan.cpus_per_task is None else (f"--cpus-per-task={plan.cpus_per_task}",)


def _count(text: str | None, default: int = 0) -> int:
    return int(text) if text and text.isascii() and text.isdigit() else default

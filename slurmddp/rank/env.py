"""Where this process sits in a distributed job, worked out from environment variables.

`resolve` is a pure function: it reads a mapping of environment variables and returns a frozen
`DistEnv` that records, for every field, the variable (or the rule) it came from. It performs no
I/O and calls no Slurm command, so every rank resolves itself without a slurmctld RPC.

Precedence, first match wins (rank and world size always come as a pair from one source):

1. torchrun (``TORCHELASTIC_RUN_ID`` set): its RANK, LOCAL_RANK, WORLD_SIZE... as they are.
2. torchrun-style variables set by hand (RANK and WORLD_SIZE without torchrun): launcher ``env``.
3. An MPI launcher: Open MPI (OMPI_COMM_WORLD_*), MVAPICH2 (MV2_COMM_WORLD_*), MPICH/Intel MPI
   Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID), PMIx (PMIX_RANK). When a Slurm step started these
   very processes (srun --mpi=pmix|pmi2: SLURM_PROCID and the step size agree with the MPI pair)
   the Slurm step answers instead, so both launch styles give the same values. Otherwise the Slurm
   variables belong to someone else (mpirun inside sbatch runs its daemons as a Slurm step) and
   are ignored.
4. A Slurm job step (SLURM_STEP_ID and SLURM_PROCID set): the step's variables, falling back to
   the job's only where the step's are absent.
5. Otherwise a single process. A batch shell or an interactive salloc shell has job variables but
   no step: it is one process, not SLURM_NTASKS of them.

A Slurm step's own layout (uneven tasks per node, rank 0's host) is read by
`slurmddp.rank.slurm_step`; every launcher's variables through the typed, source-recording reads
of `slurmddp.rank.variables`.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping, Sequence
from typing import Literal

from slurmddp.errors import EnvError
from slurmddp.protocol import PORT_RANGE_VAR
from slurmddp.rank import hostlist, slurm_step
from slurmddp.rank.slurm_step import hostfile_head as hostfile_head  # part of this module's API
from slurmddp.rank.variables import Launcher, Layout, Vars

__all__ = [
    "DEFAULT_PORT", "DEFAULT_PORTS", "LAUNCHER_PREFIXES", "LAUNCHER_VARIABLES", "LOOPBACK",
    "PORT_BASE", "PORT_SPAN", "DistEnv", "EnvError", "Launcher", "MpiNodes", "NodesUnknown",
    "derive_port", "hostfile_head", "launcher_variables", "port_range", "resolve",
]  # fmt: skip

# Derived master ports stay below Linux's ephemeral range (32768-60999) so that a port the kernel
# handed to some client socket is never picked, and above most well-known services.
PORT_BASE = 15000
"""The lowest port a job's MASTER_PORT is derived from."""
PORT_SPAN = 15000
"""How many ports, from PORT_BASE, a derived MASTER_PORT is taken from."""
DEFAULT_PORTS = range(PORT_BASE, PORT_BASE + PORT_SPAN)
"""The ports a job's MASTER_PORT is derived from, unless $SLURMDDP_PORT_RANGE names others."""
# Consecutive steps of one job get consecutive ports; consecutive jobs are this far apart.
_STEPS_PER_JOB = 8
DEFAULT_PORT = 29500
"""torch's own default MASTER_PORT, for a lone process outside any job."""
LOOPBACK = "127.0.0.1"
"""MASTER_ADDR of a job on one machine outside Slurm."""
_JOB_ID = re.compile(r"[0-9]+")


class NodesUnknown(EnvError):
    """An MPI job on several nodes: no variable says which node a rank is on, nor (outside
    Slurm) where rank 0 runs. `slurmddp.rank.bootstrap` then asks the ranks over MPI
    (`slurmddp.rank.mpi.survey`) and resolves again with the answer (`MpiNodes`)."""

    def __init__(self, message: str, world_size: int) -> None:
        super().__init__(message)
        self.world_size = world_size


@dataclasses.dataclass(frozen=True)
class MpiNodes:
    """Where the ranks of an MPI job run, as they told each other (`slurmddp.rank.mpi.survey`)."""

    node_rank: int  # this rank's node, counted in the order of each node's lowest rank
    num_nodes: int
    ranks_here: int  # how many ranks said they run on this rank's node
    master_host: str  # rank 0's host name


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, and where each value came from (see `sources`)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    serves_store: bool  # this process serves the rendezvous store at MASTER_ADDR (rank 0's, mostly)
    job_id: str | None
    restart_count: int
    launcher: Launcher
    sources: Mapping[str, str] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    def torchrun_env(self) -> dict[str, str]:
        """The variables torchrun would set, so a script written for torchrun runs unchanged."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.num_nodes),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def rows(self) -> list[tuple[str, str, str]]:
        """(field, value, source) for every field, in declaration order."""
        return [
            (f.name, str(getattr(self, f.name)), self.sources.get(f.name, ""))
            for f in dataclasses.fields(self)
            if f.name != "sources"
        ]


# (launcher family, rank, size, local rank, local size)
_MPI_FAMILIES: Sequence[tuple[str, str, str, str | None, str | None]] = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
     "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("Hydra (MPICH, Intel MPI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)  # fmt: skip

LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "PMIX_RANK",
    *(name for family in _MPI_FAMILIES for name in family[1:] if name),
)  # fmt: skip
"""The variables that decide a rank, torchrun's and MPI's. A batch script unsets them (and every
LAUNCHER_PREFIXES one) before it starts the ranks: sbatch passes the submitting shell's
environment on, and leftovers there (a torchrun tried by hand) must never decide a rank."""
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
"""Prefixes of launcher variables unset as LAUNCHER_VARIABLES are."""


def launcher_variables(environ: Mapping[str, str]) -> list[str]:
    """The names in `environ` that would decide a rank (`LAUNCHER_VARIABLES` and prefixes)."""
    return [n for n in environ if n in LAUNCHER_VARIABLES or n.startswith(LAUNCHER_PREFIXES)]


def resolve(environ: Mapping[str, str], *, master_host_format: str = "{host}",
            mpi_nodes: MpiNodes | Literal["block"] | None = None,
            hostfile_head: str | None = None) -> DistEnv:  # fmt: skip
    """Resolve this process's distributed placement from `environ` (pure; see module doc).

    `master_host_format` maps the chosen master host name to the address ranks should dial,
    e.g. ``"{host}-ib0"`` where a cluster wants its InfiniBand interface names. `mpi_nodes` is
    what the ranks of an MPI job on several nodes told each other, or "block" to assume block
    placement (mpi4py missing); without either such a job raises `NodesUnknown`.
    `hostfile_head` is the first host of $SLURM_HOSTFILE, rank 0's under
    ``--distribution=arbitrary`` (`hostfile_head` reads it).
    Raises `EnvError` naming the variables when they contradict each other.
    """
    v = Vars(environ)
    layout = (_from_torchrun(v) or _from_env(v) or _from_mpi(v, mpi_nodes)
              or slurm_step.layout(v, hostfile_head) or _single())  # fmt: skip
    _check(layout)

    job = v.first("SLURM_JOB_ID", "SLURM_JOBID")
    restart = v.integer("SLURM_RESTART_COUNT") or (0, "default")
    addr, addr_src = _master_addr(v, layout, master_host_format)
    port, port_src = _master_port(v, job, port_range(environ))
    # A MASTER_ADDR given is rank 0's host, as torch's env:// takes it.
    serves = (layout.serves_store if addr_src != "MASTER_ADDR" else None) or (
        layout.rank[0] == 0, "rule: rank 0 serves the rendezvous")

    sources = {
        "rank": layout.rank[1],
        "local_rank": layout.local_rank[1],
        "world_size": layout.world_size[1],
        "local_world_size": layout.local_world_size[1],
        "node_rank": layout.node_rank[1],
        "num_nodes": layout.num_nodes[1],
        "master_addr": addr_src,
        "master_port": port_src,
        "serves_store": serves[1],
        "job_id": job[1] if job else "unset",
        "restart_count": restart[1],
        "launcher": _LAUNCHER_RULES[layout.launcher],
    }
    return DistEnv(
        rank=layout.rank[0],
        local_rank=layout.local_rank[0],
        world_size=layout.world_size[0],
        local_world_size=layout.local_world_size[0],
        node_rank=layout.node_rank[0],
        num_nodes=layout.num_nodes[0],
        master_addr=addr,
        master_port=port,
        serves_store=serves[0],
        job_id=job[0] if job else None,
        restart_count=restart[0],
        launcher=layout.launcher,
        sources=types.MappingProxyType(sources),
    )


_LAUNCHER_RULES: Mapping[Launcher, str] = {
    "torchrun": "rule: TORCHELASTIC_RUN_ID is set",
    "env": "rule: RANK and WORLD_SIZE are set",
    "mpi": "rule: an MPI launcher's rank variables are set",
    "slurm": "rule: SLURM_STEP_ID and SLURM_PROCID are set",
    "single": "rule: no launcher variables",
}


def _from_torchrun(v: Vars) -> Layout | None:
    if not v.has("TORCHELASTIC_RUN_ID"):
        return None
    pair = v.pair("RANK", "WORLD_SIZE")
    if pair is None:
        raise EnvError(
            "TORCHELASTIC_RUN_ID is set but RANK and WORLD_SIZE are not: start the script with "
            "torchrun, or unset TORCHELASTIC_RUN_ID"
        )
    return _from_torchrun_names(v, "torchrun", *pair)


def _from_env(v: Vars) -> Layout | None:
    pair = v.pair("RANK", "WORLD_SIZE")
    if pair is None:
        if v.has("LOCAL_RANK"):
            raise EnvError("LOCAL_RANK is set but RANK and WORLD_SIZE are not: set all three")
        return None
    _check_against_the_step(v, *pair)
    return _from_torchrun_names(v, "env", *pair)


def _check_against_the_step(v: Vars, rank: tuple[int, str], size: tuple[int, str]) -> None:
    """RANK and WORLD_SIZE set by hand inside a Slurm step must be the step's own.

    Left over from a torchrun tried by hand (sbatch and salloc pass the whole environment on),
    they would make every task the same rank. Under an MPI launcher the step's variables belong
    to its daemons, not to this process: no check.
    """
    if any(v.pair(family[1], family[2]) for family in _MPI_FAMILIES):
        return
    try:
        step = slurm_step.layout(v)
    except EnvError:
        return
    if step is None or (step.rank[0], step.world_size[0]) == (rank[0], size[0]):
        return
    raise EnvError(
        f"RANK={rank[0]} and WORLD_SIZE={size[0]} are set, but this process is task "
        f"{step.rank[0]} of {step.world_size[0]} of a Slurm step ({step.rank[1]}, "
        f"{step.world_size[1]}): they are left over from another launch (torchrun by hand?); "
        f"unset {' '.join(LAUNCHER_VARIABLES[:4])} and the other torchrun variables before srun"
    )


def _from_torchrun_names(
    v: Vars, launcher: Launcher, rank: tuple[int, str], size: tuple[int, str]
) -> Layout:
    local_size = v.integer("LOCAL_WORLD_SIZE", minimum=1)
    local_rank = v.integer("LOCAL_RANK")
    if local_size is None:
        # Without a per-node size every rank is taken to share one node.
        local_size = (size[0], "rule: WORLD_SIZE (LOCAL_WORLD_SIZE unset)")
    if local_rank is None:
        local_rank = (rank[0] % local_size[0], "rule: RANK mod LOCAL_WORLD_SIZE")
    node_rank = v.integer("GROUP_RANK") or (
        rank[0] // local_size[0],
        "rule: RANK // LOCAL_WORLD_SIZE",
    )
    num_nodes = v.integer("GROUP_WORLD_SIZE", minimum=1) or (
        -(-size[0] // local_size[0]),
        "rule: WORLD_SIZE / LOCAL_WORLD_SIZE",
    )
    return Layout(launcher, rank, size, local_rank, local_size, node_rank, num_nodes)


def _from_mpi(v: Vars, told: MpiNodes | Literal["block"] | None) -> Layout | None:
    found = next(
        ((fam, pair) for fam in _MPI_FAMILIES if (pair := v.pair(fam[1], fam[2])) is not None),
        None,
    )
    if found is None:
        if not v.has("PMIX_RANK"):
            return None
        # PMIx publishes no world size in the environment: only a Slurm step can complete it.
        slurm = slurm_step.layout(v)
        pmix = v.integer("PMIX_RANK")
        assert pmix is not None
        if slurm is None or slurm.rank[0] != pmix[0]:
            raise EnvError(
                "PMIX_RANK is set but no launcher variable gives the world size: "
                "set WORLD_SIZE and RANK, or launch with srun or mpirun"
            )
        return slurm
    (family, rank_name, size_name, local_name, local_size_name), pair = found
    rank, size = pair

    try:
        slurm = slurm_step.layout(v)
    except EnvError:
        slurm = None  # a broken step here belongs to mpirun's daemon, not to this rank
    if slurm is not None and (slurm.rank[0], slurm.world_size[0]) == (rank[0], size[0]):
        # srun's own MPI plugin (pmi2, pmix) started this very process.
        return slurm

    local_rank = v.integer(local_name) if local_name else None
    local_size = v.integer(local_size_name, minimum=1) if local_size_name else None
    if local_rank is None or local_size is None:
        raise EnvError(
            f"{family}: {rank_name} and {size_name} are set but {local_name} or "
            f"{local_size_name} is not; set LOCAL_RANK and LOCAL_WORLD_SIZE with RANK and "
            "WORLD_SIZE to say where this rank runs"
        )
    _check_ranks(rank, size, local_rank, local_size)
    if local_size[0] == size[0]:
        rule = "rule: all ranks on one node"
        return Layout("mpi", rank, size, local_rank, local_size, (0, rule), (1, rule))
    # MPI gives no node index (OMPI_COMM_WORLD_NODE_RANK counts processes, not nodes), and
    # mpirun may map round-robin (--map-by node) or put uneven counts on the hosts.
    if told is None:
        raise NodesUnknown(f"{family}: {size[0]} ranks on several nodes", size[0])
    if told == "block":
        return _block_placement(rank, size, local_rank, local_size)
    source = "rule: ranks counted per host over MPI (mpi4py)"
    if told.ranks_here != local_size[0]:
        raise EnvError(
            f"{local_size[1]}={local_size[0]}, but {told.ranks_here} ranks report this rank's "
            "host: give each node a distinct host name (SLURMD_NODENAME or the system's)"
        )
    return Layout("mpi", rank, size, local_rank, local_size, (told.node_rank, source),
                   (told.num_nodes, source),
                   ([told.master_host], "rule: rank 0's host, told over MPI (mpi4py)"))  # fmt: skip


def _block_placement(rank: tuple[int, str], size: tuple[int, str], local_rank: tuple[int, str],
                     local_size: tuple[int, str]) -> Layout:  # fmt: skip
    """Nodes under the assumption that mpirun filled them in order, equally; refused where this
    rank can see that it did not."""
    per_node = local_size[0]
    if size[0] % per_node or rank[0] % per_node != local_rank[0]:
        raise EnvError(
            f"mpirun placed the ranks round-robin or unevenly over the nodes (rank {rank[0]} of "
            f"{size[0]} is local rank {local_rank[0]} of {per_node}): install mpi4py (pip install "
            "'slurmddp[mpi]') so that the ranks can count their nodes, or map by slot with as "
            "many ranks on every node"
        )
    rule = f"rule: block placement, {local_size[1]} ranks per node (mpi4py not installed)"
    return Layout("mpi", rank, size, local_rank, local_size,
                   (rank[0] // per_node, rule), (size[0] // per_node, rule))  # fmt: skip


def _single() -> Layout:
    rule = "rule: single process"
    return Layout("single", (0, rule), (1, rule), (0, rule), (1, rule), (0, rule), (1, rule))


def _check(layout: Layout) -> None:
    _check_ranks(layout.rank, layout.world_size, layout.local_rank, layout.local_world_size)
    if layout.node_rank[0] >= layout.num_nodes[0]:
        raise EnvError(f"{layout.node_rank[1]}={layout.node_rank[0]} is not below "
                       f"{layout.num_nodes[1]}={layout.num_nodes[0]}")  # fmt: skip


def _check_ranks(rank: tuple[int, str], size: tuple[int, str], local_rank: tuple[int, str],
                 local_size: tuple[int, str]) -> None:  # fmt: skip
    for value, limit in ((rank, size), (local_rank, local_size)):
        if value[0] >= limit[0]:
            raise EnvError(f"{value[1]}={value[0]} is not below {limit[1]}={limit[0]}")
    if local_size[0] > size[0]:
        raise EnvError(f"{local_size[1]}={local_size[0]} exceeds {size[1]}={size[0]}")


def _master_addr(v: Vars, layout: Layout, host_format: str) -> tuple[str, str]:
    given = v.first("MASTER_ADDR")
    if given is not None and given[0].strip():
        return given[0].strip(), "MASTER_ADDR"
    if layout.world_size[0] == 1 or (layout.num_nodes[0] == 1 and layout.launcher != "slurm"):
        return LOOPBACK, "rule: all ranks on one node"
    if layout.unplaced is not None:
        raise EnvError(layout.unplaced)
    if layout.nodes is not None:
        host = layout.nodes[0][0]
        source = layout.nodes[1]
    elif layout.launcher == "mpi" and (job := v.first("SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        # mpirun runs on the batch host, the allocation's first node, and puts rank 0 there.
        try:
            host = hostlist.expand(job[0])[0]
        except (ValueError, IndexError):
            raise EnvError(f"{job[1]}={job[0]!r} is not a usable node list") from None
        source = f"rule: first host of {job[1]} (mpirun inside an allocation)"
    elif layout.launcher == "mpi":
        raise EnvError(
            "MASTER_ADDR is not set and this MPI job spans several nodes outside Slurm: install "
            "mpi4py (pip install 'slurmddp[mpi]') so that rank 0 can share its address, or set "
            "MASTER_ADDR (and MASTER_PORT) for every rank"
        )
    else:
        raise EnvError(
            f"cannot tell rank 0's host for {layout.launcher} with {layout.num_nodes[0]} nodes: "
            "set MASTER_ADDR"
        )
    try:
        return host_format.format(host=host), f"{source}, formatted {host_format!r}"
    except (KeyError, IndexError, ValueError) as e:
        raise EnvError(
            f"master host format {host_format!r} is invalid ({type(e).__name__}: {e}): write "
            "{host} where the host name goes, e.g. '{host}-ib0'"
        ) from None


def _master_port(v: Vars, job: tuple[str, str] | None, ports: range) -> tuple[int, str]:
    given = v.integer("MASTER_PORT", minimum=1)
    if given is not None:
        if given[0] > 65535:
            raise EnvError(
                f"MASTER_PORT={given[0]} is not a TCP port: give 1 to 65535, or unset it for a "
                "port derived from the job"
            )
        return given
    if job is None:
        return DEFAULT_PORT, "default"
    if not _JOB_ID.fullmatch(job[0]):
        raise EnvError(
            f"{job[1]}={job[0]!r} is not a numeric Slurm job id, to derive the master port from: "
            "set MASTER_PORT"
        )
    job_id = int(job[0])
    step = v.step_id()
    step_id = step[0] if step else 0
    rule = f"rule: derived from {job[1]} and step id"
    if ports != DEFAULT_PORTS:
        rule += f", in {PORT_RANGE_VAR}"
    return derive_port(job_id, step_id, ports), rule


def port_range(environ: Mapping[str, str]) -> range:
    """The ports derived ones are taken from: $SLURMDDP_PORT_RANGE (``LOW-HIGH``, both included)
    or `DEFAULT_PORTS`. At least 8 ports, so that the steps of one job differ."""
    text = environ.get(PORT_RANGE_VAR, "").strip()
    if not text:
        return DEFAULT_PORTS
    m = re.fullmatch(r"([0-9]{1,5})\s*-\s*([0-9]{1,5})", text)
    low, high = (int(m[1]), int(m[2])) if m else (0, 0)
    if not 1 <= low <= high - _STEPS_PER_JOB + 1 or high > 65535:
        raise EnvError(
            f"{PORT_RANGE_VAR}={text!r} is not a range of at least {_STEPS_PER_JOB} TCP ports: "
            f"give LOW-HIGH within 1-65535, e.g. {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1}"
        )
    return range(low, high + 1)


def derive_port(job_id: int, step_id: int = 0, ports: range = DEFAULT_PORTS) -> int:
    """A master port for a job step: the same on every rank, different for nearby jobs and steps.

    Two jobs collide only when their ids differ by a multiple of len(ports) / 8 and their step
    ids agree modulo 8.
    """
    return ports[(job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB) % len(ports)]


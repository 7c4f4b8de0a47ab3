"""A Slurm job step's task layout, from the variables srun gives each task.

The step's variables answer first, the job's where the step's are absent. Tasks need not be
spread evenly (``srun -N3 -n5`` gives 2,2,1), and rank 0's host need not come first in the
sorted node list (``--distribution=arbitrary``, heterogeneous steps): both are read from what
Slurm exports, never from a slurmctld RPC.
"""

from __future__ import annotations

from collections.abc import Mapping

from slurmddp.errors import EnvError
from slurmddp.rank import hostlist
from slurmddp.rank.variables import Layout, Vars


def layout(v: Vars, hostfile_head: str | None = None) -> Layout | None:
    """The step's layout of this task; None outside a step (no SLURM_STEP_ID or SLURM_PROCID).

    `hostfile_head` is the first host of $SLURM_HOSTFILE (read by `hostfile_head`), rank 0's
    under ``--distribution=arbitrary``. Raises `EnvError` for an incomplete or inconsistent step.
    """
    if not (v.has("SLURM_STEP_ID", "SLURM_STEPID") and v.has("SLURM_PROCID")):
        return None
    rank = v.integer("SLURM_PROCID")
    size = v.integer("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    local_rank = v.integer("SLURM_LOCALID")
    node_rank = v.integer("SLURM_NODEID")
    num_nodes = v.integer("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1)
    missing = [
        name
        for name, value in (
            ("SLURM_STEP_NUM_TASKS", size),
            ("SLURM_LOCALID", local_rank),
            ("SLURM_NODEID", node_rank),
            ("SLURM_STEP_NUM_NODES", num_nodes),
        )
        if value is None
    ]
    if missing:
        raise EnvError(
            f"a Slurm step is incomplete: {', '.join(missing)} unset; start the ranks with srun, "
            "which sets them all"
        )
    assert rank and size and local_rank and node_rank and num_nodes
    if node_rank[0] >= num_nodes[0]:
        raise EnvError(f"{node_rank[1]}={node_rank[0]} is not below {num_nodes[1]}={num_nodes[0]}")

    nodes = None
    serves = None
    place = node_rank
    nodelist = v.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is not None:
        try:
            hosts = hostlist.expand(nodelist[0])
        except ValueError as e:
            raise EnvError(f"{nodelist[1]}: {e}") from None
        if len(hosts) != num_nodes[0] and nodelist[1] == "SLURM_STEP_NODELIST":
            raise EnvError(
                f"SLURM_STEP_NODELIST={nodelist[0]!r} names {len(hosts)} nodes but "
                f"{num_nodes[1]}={num_nodes[0]}"
            )
        # The node list and the tasks per node are sorted by name; SLURM_NODEID is not always
        # a place in them (a heterogeneous step counts its nodes component by component).
        me = v.first("SLURMD_NODENAME")
        if nodelist[1] == "SLURM_STEP_NODELIST" and me is not None and me[0] in hosts:
            place = (hosts.index(me[0]), me[1])
        nodes = _rank_0_first(v, hosts, nodelist[1], hostfile_head)
        if nodes is not None and _topology_ordered(v):
            first = nodes[0][0]
            nodes = nodes[0], f"{nodes[1]}, where its first task serves the rendezvous{_TOPOLOGY}"
            serves = (me is not None and me[0] == first and local_rank[0] == 0,
                      f"rule: the first task on {first}, the first host{_TOPOLOGY}")  # fmt: skip
    local_size = _local_size(v, place, num_nodes, size)
    unplaced = _HOSTFILE_UNREAD if nodelist is not None and nodes is None else None
    return Layout("slurm", rank, size, local_rank, local_size, node_rank, num_nodes, nodes,
                   unplaced, serves)  # fmt: skip


_TOPOLOGY = (" (a topology plugin may lay tasks out in topology order, as Slurm 26.05 does: rank 0 "
             "may run on another node)")  # fmt: skip


def _topology_ordered(v: Vars) -> bool:
    """Whether a topology plugin may have laid the step's tasks out in topology order, not in
    node-list order, so that rank 0 need not be on the first host (seen on 26.05, not on 24.11):
    SLURM_TOPOLOGY_ADDR_PATTERN names levels above the node (``switch.switch.node``,
    ``block.node``), unless a host file placed the tasks (``--distribution=arbitrary``)."""
    pattern = v.first("SLURM_TOPOLOGY_ADDR_PATTERN")
    distribution = v.first("SLURM_DISTRIBUTION")
    if distribution is not None and distribution[0].startswith("arbitrary"):
        return False
    return pattern is not None and "." in pattern[0]


_HOSTFILE_UNREAD = (
    "--distribution=arbitrary places rank 0 on the first host of SLURM_HOSTFILE, which this rank "
    "cannot read: keep the file on a shared file system, or set MASTER_ADDR to that host")


def _rank_0_first(v: Vars, hosts: list[str], name: str,
                  hostfile_head: str | None) -> tuple[list[str], str] | None:  # fmt: skip
    """The step's hosts with rank 0's first: the sorted node list is not in task order when the
    tasks follow a host file (``--distribution=arbitrary``) or come component by component (a
    heterogeneous step). None when the host file was needed and not read."""
    distribution = v.first("SLURM_DISTRIBUTION")
    if distribution is not None and distribution[0].startswith("arbitrary"):
        if hostfile_head is None:
            return None
        return [hostfile_head, *hosts], "rule: first host of SLURM_HOSTFILE (arbitrary)"
    components = v.integer("SLURM_HET_SIZE", "SLURM_PACK_SIZE", minimum=1)
    if components is None:
        return hosts, f"rule: first host of {name}"
    ordered: list[str] = []
    for group in range(components[0]):
        listed = v.first(f"SLURM_JOB_NODELIST_HET_GROUP_{group}",
                         f"SLURM_JOB_NODELIST_PACK_GROUP_{group}")  # fmt: skip
        if listed is None:
            continue
        try:
            ordered += hostlist.expand(listed[0])
        except ValueError as e:
            raise EnvError(f"{listed[1]}: {e}") from None
    step = set(hosts)
    ordered = [h for h in dict.fromkeys(ordered) if h in step]
    return ordered + [h for h in hosts if h not in ordered], (
        f"rule: first host of the first component in {name} (heterogeneous job)")


def _local_size(
    v: Vars, node_rank: tuple[int, str], num_nodes: tuple[int, str], size: tuple[int, str]
) -> tuple[int, str]:
    # Tasks are not spread evenly (srun -N3 -n5 gives 2,2,1), so ntasks // nnodes is wrong.
    spec = v.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec is None:
        if size[0] % num_nodes[0]:
            raise EnvError(
                f"SLURM_STEP_TASKS_PER_NODE is unset and {size[1]}={size[0]} does not divide "
                f"evenly over {num_nodes[1]}={num_nodes[0]}"
            )
        return size[0] // num_nodes[0], f"rule: {size[1]} / {num_nodes[1]}"
    try:
        counts = hostlist.expand_tasks_per_node(spec[0])
    except ValueError as e:
        raise EnvError(f"{spec[1]}: {e}") from None
    if len(counts) != num_nodes[0] or sum(counts) != size[0]:
        raise EnvError(
            f"{spec[1]}={spec[0]!r} disagrees with {num_nodes[1]}={num_nodes[0]} and "
            f"{size[1]}={size[0]}"
        )
    return counts[node_rank[0]], f"{spec[1]}[{node_rank[1]}]"


def hostfile_head(environ: Mapping[str, str]) -> str | None:
    """The first host of $SLURM_HOSTFILE where the tasks follow it (``--distribution=arbitrary``;
    rank 0 runs there), else None; None too where the file cannot be read."""
    if not environ.get("SLURM_DISTRIBUTION", "").startswith("arbitrary"):
        return None
    try:
        with open(environ["SLURM_HOSTFILE"]) as f:
            for line in f:
                first = line.replace(",", " ").split()
                if first:
                    return hostlist.expand(first[0])[0]
    except (KeyError, OSError, ValueError, IndexError):
        pass
    return None

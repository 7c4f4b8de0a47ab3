"""Unit tables for rank.env.resolve: every launcher's variables, the known traps, bad input."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmddp.rank.env import (
    PORT_BASE,
    PORT_SPAN,
    DistEnv,
    EnvError,
    MpiNodes,
    NodesUnknown,
    derive_port,
    hostfile_head,
    port_range,
    resolve,
)
from tests.fake_env import block_position, srun_env


def placement(d: DistEnv) -> tuple[int, int, int, int, int, int]:
    return d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.num_nodes


# --- single process and job shells -------------------------------------------------------------


def test_empty_environment_is_a_single_process():
    d = resolve({})
    assert placement(d) == (0, 0, 1, 1, 0, 1)
    assert (d.launcher, d.master_addr, d.master_port, d.job_id, d.restart_count) == (
        "single",
        "127.0.0.1",
        29500,
        None,
        0,
    )
    assert d.sources["rank"] == "rule: single process"


def test_salloc_shell_has_job_variables_but_no_step_so_it_is_one_process():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "8",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_TASKS_PER_NODE": "2(x4)",
    }
    d = resolve(env)
    assert placement(d) == (0, 0, 1, 1, 0, 1)
    assert d.launcher == "single"
    assert d.job_id == "77"
    assert d.master_port == derive_port(77, 0)


def test_batch_shell_procid_without_step_is_one_process():
    # The batch shell carries SLURM_PROCID=0 and the job's counts, but it is not a step.
    env = {"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2"}
    assert resolve(env).launcher == "single"


# --- Slurm steps -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [[2, 2, 2, 2], [2, 2, 1], [4, 2, 1, 1], [1], [3], [1, 1, 1, 1, 1]],
    ids=lambda t: "x".join(map(str, t)),
)
def test_srun_every_rank_gets_its_place(layout):
    world = sum(layout)
    seen = []
    for rank in range(world):
        d = resolve(srun_env(rank, layout))
        node, local = block_position(rank, layout)
        assert placement(d) == (rank, local, world, layout[node], node, len(layout))
        assert d.launcher == "slurm"
        assert d.master_addr == ("n1" if world > 1 else "127.0.0.1")
        seen.append((d.master_addr, d.master_port))
    assert len(set(seen)) == 1, "every rank must dial the same master"


def test_uneven_tasks_per_node_is_not_ntasks_over_nnodes():
    # srun -N3 -n5: 2,2,1. ntasks // nnodes would say 1 everywhere.
    d = resolve(srun_env(4, [2, 2, 1], spec="2(x2),1"))
    assert (d.node_rank, d.local_rank, d.local_world_size) == (2, 0, 1)
    assert d.sources["local_world_size"] == "SLURM_STEP_TASKS_PER_NODE[SLURMD_NODENAME]"
    d = resolve(srun_env(1, [2, 2, 1], spec="2(x2),1"))
    assert d.local_world_size == 2
    without_name = srun_env(4, [2, 2, 1]) | {"SLURMD_NODENAME": "elsewhere"}
    d = resolve(without_name)
    assert d.local_world_size == 1
    assert d.sources["local_world_size"] == "SLURM_STEP_TASKS_PER_NODE[SLURM_NODEID]"


# As the local cluster gave them: a heterogeneous step, component 0 (1 task) on n3, component 1
# (3 tasks) on n1 and n2. The node list and tasks per node are sorted by name; SLURM_NODEID
# follows the components (n3 is 0).
def het_env(rank: int) -> dict[str, str]:
    node, nodeid, local = {0: ("n3", 0, 0), 1: ("n1", 1, 0), 2: ("n1", 1, 1), 3: ("n2", 2, 0)}[rank]
    return {
        "SLURM_JOB_ID": "559", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local), "SLURM_NODEID": str(nodeid), "SLURMD_NODENAME": node,
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NODELIST": "n[1-3]",
        "SLURM_STEP_TASKS_PER_NODE": "2,1(x2)", "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n3",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[1-2]",
    }  # fmt: skip


def test_a_heterogeneous_step_takes_rank_0s_component_and_each_nodes_own_count():
    got = [resolve(het_env(r)) for r in range(4)]
    assert [(d.node_rank, d.local_rank, d.local_world_size) for d in got] == [
        (0, 0, 1), (1, 0, 2), (1, 1, 2), (2, 0, 1)]  # fmt: skip
    assert {d.master_addr for d in got} == {"n3"}
    assert "heterogeneous job" in got[1].sources["master_addr"]
    # Older Slurm names the components PACK_GROUP.
    old = {k.replace("HET_GROUP", "PACK_GROUP").replace("HET_SIZE", "PACK_SIZE"): v
           for k, v in het_env(2).items()}  # fmt: skip
    assert resolve(old).master_addr == "n3"


def test_a_step_in_one_component_of_a_heterogeneous_job_is_an_ordinary_step():
    env = srun_env(2, [2, 1], nodes=["n1", "n2"]) | {
        "SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "n3",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "n[1-2]"}  # fmt: skip
    assert resolve(env).master_addr == "n1"


def test_arbitrary_distribution_puts_the_master_on_the_hosts_files_first_host(tmp_path):
    # SLURM_HOSTFILE n3, n1, n1, n2: rank 0 runs on n3; the node list is sorted.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n3\nn1\nn1\nn2\n")
    env = srun_env(1, [2, 1, 1], nodes=["n1", "n2", "n3"]) | {
        "SLURM_DISTRIBUTION": "arbitrary", "SLURM_HOSTFILE": str(hostfile)}  # fmt: skip
    assert hostfile_head(env) == "n3"
    d = resolve(env, hostfile_head=hostfile_head(env))
    assert (d.master_addr, d.local_world_size) == ("n3", 2)
    assert d.sources["master_addr"].startswith("rule: first host of SLURM_HOSTFILE")
    hostfile.write_text("n[3-4],n1\n")
    assert hostfile_head(env) == "n3"
    with pytest.raises(EnvError, match="cannot read: keep the file on a shared file system"):
        resolve(env | {"SLURM_HOSTFILE": str(tmp_path / "gone")},
                hostfile_head=hostfile_head(env | {"SLURM_HOSTFILE": str(tmp_path / "gone")}))
    assert resolve(env | {"MASTER_ADDR": "n3"}).master_addr == "n3"  # said: no file needed


def _topology_task(rank: int, node: str, local: int) -> dict[str, str]:
    """A task of `srun -N4 -n8` under topology/tree on Slurm 26.05, switches [n3 n4] [n1 n2]:
    ranks 0-1 on n3, 2-3 on n4, 4-5 on n1, 6-7 on n2; SLURM_NODEID is still the node list's."""
    nodes = ["n1", "n2", "n3", "n4"]
    return srun_env(0, [2, 2, 2, 2]) | {
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURMD_NODENAME": node,
        "SLURM_NODEID": str(nodes.index(node)), "SLURM_STEP_NODELIST": "n[1-4]",
        "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node",
        "SLURM_TOPOLOGY_ADDR": f"top.s{1 if node in ('n3', 'n4') else 2}.{node}"}  # fmt: skip


TOPOLOGY_TASKS = [(0, "n3", 0), (1, "n3", 1), (2, "n4", 0), (4, "n1", 0), (5, "n1", 1),
                  (7, "n2", 1)]  # fmt: skip


@pytest.mark.parametrize(("rank", "node", "local"), TOPOLOGY_TASKS)
def test_under_a_topology_plugin_the_first_task_of_the_first_host_serves_the_rendezvous(
    rank, node, local
):
    # Rank 0 runs on n3, which no other task can know without asking slurmctld: the address all
    # dial is the node list's first host, and the task there with local id 0 (rank 4) serves.
    d = resolve(_topology_task(rank, node, local))
    assert (d.rank, d.master_addr, d.serves_store) == (rank, "n1", (node, local) == ("n1", 0))
    assert "topology order" in d.sources["serves_store"]
    assert "topology order" in d.sources["master_addr"]
    # A MASTER_ADDR given names rank 0's host, as torch's env:// takes it.
    given = resolve(_topology_task(rank, node, local) | {"MASTER_ADDR": "n3"})
    assert (given.master_addr, given.serves_store) == ("n3", rank == 0)


def test_without_a_topology_rank_0_serves_the_rendezvous_as_always():
    for rank in range(4):
        d = resolve(srun_env(rank, [2, 2]) | {"SLURM_TOPOLOGY_ADDR_PATTERN": "node"})
        assert d.serves_store == (rank == 0)
        assert d.sources["serves_store"].startswith("rule: rank 0")
    # A host file placed the tasks: its first host is rank 0's, topology or not.
    arbitrary = srun_env(0, [2, 2]) | {"SLURM_DISTRIBUTION": "arbitrary",
                                       "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.node"}  # fmt: skip
    d = resolve(arbitrary, hostfile_head="n2")
    assert (d.master_addr, d.serves_store) == ("n2", True)


def test_step_nodelist_wins_over_the_batch_shells_nodelist():
    env = srun_env(0, [1, 1], nodes=["n3", "n4"])
    env["SLURM_JOB_NODELIST"] = env["SLURM_NODELIST"] = "n[1-4]"
    env["SLURM_JOB_NUM_NODES"] = env["SLURM_NNODES"] = "4"
    d = resolve(env)
    assert d.master_addr == "n3"
    assert d.num_nodes == 2
    assert d.sources["master_addr"].startswith("rule: first host of SLURM_STEP_NODELIST")


def test_job_variables_are_the_fallback_when_step_ones_are_absent():
    env = srun_env(3, [2, 2])
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST",
                 "SLURM_STEP_TASKS_PER_NODE"):  # fmt: skip
        del env[name]
    d = resolve(env)
    assert placement(d) == (3, 1, 4, 2, 1, 2)
    assert d.sources["world_size"] == "SLURM_NTASKS"
    assert d.sources["local_world_size"] == "SLURM_TASKS_PER_NODE[SLURM_NODEID]"
    assert d.master_addr == "n1"


def test_explicit_master_addr_and_port_win():
    env = srun_env(1, [2]) | {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "12345"}
    d = resolve(env)
    assert (d.master_addr, d.master_port) == ("10.0.0.7", 12345)
    assert (d.sources["master_addr"], d.sources["master_port"]) == ("MASTER_ADDR", "MASTER_PORT")


def test_master_host_format_maps_the_host_to_an_interface_name():
    d = resolve(srun_env(0, [1, 1], nodes=["gpu001", "gpu002"]), master_host_format="{host}-ib0")
    assert d.master_addr == "gpu001-ib0"


def test_restart_count_and_job_id_come_from_slurm():
    d = resolve(srun_env(0, [1]) | {"SLURM_RESTART_COUNT": "3"})
    assert (d.restart_count, d.job_id) == (3, "4242")
    assert d.sources["restart_count"] == "SLURM_RESTART_COUNT"


def test_two_steps_of_one_job_get_different_ports():
    a = resolve(srun_env(0, [2], step=0)).master_port
    b = resolve(srun_env(0, [2], step=1)).master_port
    assert a != b


def test_slurm_2605s_negative_special_step_ids_are_read_as_earlier_versions_unsigned_ones():
    # The interactive step (LaunchParameters=use_interactive_step): 26.05 exports -6, 22.05 and
    # 24.11 4294967290; it holds one task, so the shell's script is one process.
    inside = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
              "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1",
              "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURMD_NODENAME": "n1"}
    old = resolve(inside | {"SLURM_STEP_ID": "4294967290"})
    new = resolve(inside | {"SLURM_STEP_ID": "-6"})
    assert (new.rank, new.world_size, new.master_port) == (old.rank, old.world_size,
                                                           old.master_port)  # fmt: skip
    assert new.world_size == 1
    with pytest.raises(EnvError, match="SLURM_STEP_ID='-6x' is not an integer"):
        resolve(inside | {"SLURM_STEP_ID": "-6x"})


def test_derived_ports_are_outside_the_ephemeral_range_and_differ_for_nearby_jobs():
    ports = {derive_port(job, step) for job in range(1000, 1100) for step in range(8)}
    assert len(ports) == 800
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN <= 32768 for p in ports)


def test_a_centres_port_range_holds_every_derived_port_and_the_source_says_so():
    env = srun_env(0, [2], step=3) | {"SLURM_JOB_ID": "3852", "SLURMDDP_PORT_RANGE": "5000-5999"}
    d = resolve(env)
    assert d.master_port == derive_port(3852, 3, range(5000, 6000)) == 5000 + (3852 * 8 + 3) % 1000
    assert d.sources["master_port"].endswith("in SLURMDDP_PORT_RANGE")
    ports = port_range(env)
    assert {derive_port(job, step, ports) for job in range(1000, 1125) for step in range(8)} == \
        set(range(5000, 6000))
    assert resolve(env | {"MASTER_PORT": "7000"}).master_port == 7000


@pytest.mark.parametrize("text", ["x", "6000-5000", "0-100", "100-70000", "1000-1006", "1000"])
def test_a_port_range_that_is_not_one_is_refused_in_one_line(text):
    env = srun_env(0, [2]) | {"SLURMDDP_PORT_RANGE": text}
    with pytest.raises(EnvError, match=r"^SLURMDDP_PORT_RANGE='.*' is not a range of at least 8 "
                                       r"TCP ports: give LOW-HIGH within 1-65535, e\.g\. "
                                       r"15000-29999$"):  # fmt: skip
        resolve(env)


def test_a_port_range_allows_spaces_and_the_smallest_span():
    assert port_range({"SLURMDDP_PORT_RANGE": " 1000 - 1007 "}) == range(1000, 1008)
    assert port_range({"SLURMDDP_PORT_RANGE": ""}) == range(PORT_BASE, PORT_BASE + PORT_SPAN)


# --- torchrun and hand-set env:// --------------------------------------------------------------


def torchrun_env(rank: int, local: int, world: int, local_world: int, group: int, groups: int):
    return {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group),
        "GROUP_WORLD_SIZE": str(groups),
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def test_torchrun_wins_over_the_slurm_step_of_its_agent():
    # srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node=2: the agent's step says 2 tasks.
    env = srun_env(1, [1, 1]) | torchrun_env(3, 1, 4, 2, 1, 2)
    d = resolve(env)
    assert placement(d) == (3, 1, 4, 2, 1, 2)
    assert d.launcher == "torchrun"
    assert (d.master_addr, d.master_port) == ("n1", 29400)
    assert d.sources["node_rank"] == "GROUP_RANK"


def test_hand_set_env_variables_are_launcher_env():
    d = resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert placement(d) == (1, 1, 2, 2, 0, 1)
    assert d.launcher == "env"


LEFTOVERS = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "localhost"}  # a torchrun by hand


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_leftover_torchrun_variables_that_contradict_the_step_are_refused(rank):
    # An salloc shell with them exported, then srun python -m slurmddp.run: every task would be
    # rank 0 and rendezvous at localhost.
    with pytest.raises(EnvError) as e:
        resolve(srun_env(rank, [2, 2]) | LEFTOVERS)
    message = str(e.value)
    assert "\n" not in message
    assert (f"RANK=0 and WORLD_SIZE=4 are set, but this process is task {rank} of 4 of a Slurm "
            "step (SLURM_PROCID, SLURM_STEP_NUM_TASKS)") in message  # fmt: skip
    assert "left over from another launch" in message and "unset RANK WORLD_SIZE" in message


def test_torchrun_variables_that_agree_with_the_step_are_fine():
    # Task 0 with the leftovers agrees by chance; a child of a bootstrapped rank agrees by design.
    assert resolve(srun_env(0, [2, 2]) | LEFTOVERS).rank == 0
    first = resolve(srun_env(3, [2, 2]))
    assert resolve(srun_env(3, [2, 2]) | first.torchrun_env()).rank == 3


def test_under_mpirun_the_step_of_its_daemons_is_not_held_against_rank_variables():
    env = srun_env(0, [1, 1]) | {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                                 "RANK": "3", "WORLD_SIZE": "4"}  # fmt: skip
    assert resolve(env).rank == 3


def test_exported_variables_resolve_to_the_same_place():
    # A child of a bootstrapped rank sees the exported torchrun names: same answer.
    first = resolve(srun_env(5, [4, 2, 1, 1]))
    again = resolve(first.torchrun_env())
    assert placement(again) == placement(first)
    assert (again.master_addr, again.master_port) == (first.master_addr, first.master_port)


# --- MPI launchers -----------------------------------------------------------------------------


def ompi_env(rank: int, world: int, local: int, local_world: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world),
        # Not the node index: Open MPI's NODE_RANK counts processes on the node.
        "OMPI_COMM_WORLD_NODE_RANK": str(local),
        "PMIX_RANK": str(rank),
    }


def test_open_mpi_on_one_host():
    d = resolve(ompi_env(2, 4, 2, 4))
    assert placement(d) == (2, 2, 4, 4, 0, 1)
    assert (d.launcher, d.master_addr) == ("mpi", "127.0.0.1")
    assert d.sources["rank"] == "OMPI_COMM_WORLD_RANK"


def test_mpirun_inside_sbatch_ignores_the_daemons_slurm_step():
    # mpirun starts its remote daemons with srun: ranks on the second node inherit the daemon's
    # SLURM_PROCID=0 of a one-task step. Those are not the rank's.
    daemon = srun_env(0, [1], nodes=["n2"], step=0)
    daemon |= {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]"}
    d = resolve(daemon | ompi_env(3, 4, 1, 2), mpi_nodes="block")
    assert placement(d) == (3, 1, 4, 2, 1, 2)
    assert d.launcher == "mpi"
    assert d.master_addr == "n1"
    assert "mpirun inside an allocation" in d.sources["master_addr"]


def test_mpi_on_several_nodes_needs_the_ranks_to_say_where_they_run():
    with pytest.raises(NodesUnknown):
        resolve(ompi_env(3, 4, 1, 2))  # bootstrap then asks them over MPI (slurmddp.rank.mpi)


# mpirun --map-by node over two nodes: ranks 0, 2 on the first, 1, 3 on the second. The ranks
# told each other where they run (slurmddp.rank.mpi.survey).
@pytest.mark.parametrize(
    ("rank", "local", "local_world", "told", "expected"),
    [
        (1, 0, 2, MpiNodes(1, 2, 2, "a"), (1, 0, 4, 2, 1, 2)),  # --map-by node
        (2, 1, 2, MpiNodes(0, 2, 2, "a"), (2, 1, 4, 2, 0, 2)),
        (2, 0, 1, MpiNodes(1, 2, 1, "a"), (2, 0, 3, 1, 1, 2)),  # -np 3 over hosts of 2 and 1
    ],
)
def test_mpi_nodes_as_the_ranks_told(rank, local, local_world, told, expected):
    world = expected[2]
    d = resolve(ompi_env(rank, world, local, local_world), mpi_nodes=told)
    assert placement(d) == expected
    assert d.master_addr == "a" and d.sources["node_rank"].endswith("over MPI (mpi4py)")


@pytest.mark.parametrize(
    ("rank", "world", "local", "local_world", "message"),
    [
        (1, 4, 0, 2, "rank 1 of 4 is local rank 0 of 2"),  # --map-by node
        (0, 3, 0, 2, "rank 0 of 3 is local rank 0 of 2"),  # -np 3 over hosts of 2 and 1
    ],
)
def test_without_mpi4py_a_placement_block_rules_cannot_explain_is_one_line(rank, world, local,
                                                                           local_world, message):
    with pytest.raises(EnvError, match="mpirun placed the ranks round-robin or unevenly") as e:
        resolve(ompi_env(rank, world, local, local_world) | {"MASTER_ADDR": "a"},
                mpi_nodes="block")  # fmt: skip
    assert message in str(e.value) and "pip install 'slurmddp[mpi]'" in str(e.value)


def test_without_mpi4py_outside_slurm_rank_0s_host_is_unknown():
    with pytest.raises(EnvError, match=r"install mpi4py .* or set MASTER_ADDR"):
        resolve(ompi_env(3, 4, 1, 2), mpi_nodes="block")


def test_ranks_that_share_a_host_name_across_nodes_are_refused():
    with pytest.raises(EnvError, match="but 4 ranks report this rank's host"):
        resolve(ompi_env(1, 4, 1, 2), mpi_nodes=MpiNodes(0, 1, 4, "a"))


def test_mpich_hydra():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    d = resolve(env | {"PMI_FD": "5"})
    assert placement(d) == (1, 1, 3, 3, 0, 1)
    assert d.sources["local_rank"] == "MPI_LOCALRANKID"


def test_mvapich2():
    env = {
        "MV2_COMM_WORLD_RANK": "5",
        "MV2_COMM_WORLD_SIZE": "8",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "head",
    }
    d = resolve(env, mpi_nodes="block")
    assert placement(d) == (5, 1, 8, 4, 1, 2)
    assert d.sources["node_rank"].startswith("rule: block placement")


def test_intel_mpi_uses_hydra_names():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "I_MPI_ROOT": "/opt/intel/mpi"}  # fmt: skip
    assert placement(resolve(env)) == (0, 0, 2, 2, 0, 1)


@pytest.mark.parametrize("plugin", ["pmi2", "pmix"])
def test_srun_mpi_plugins_give_the_same_answer_as_plain_srun(plugin):
    layout = [2, 2]
    for rank in range(4):
        plain = resolve(srun_env(rank, layout))
        extra = (
            {"PMI_RANK": str(rank), "PMI_SIZE": "4", "PMI_FD": "9"}
            if plugin == "pmi2"
            else {"PMIX_RANK": str(rank), "PMIX_NAMESPACE": "slurm.pmix.4242.0"}
        )
        with_mpi = resolve(srun_env(rank, layout) | extra)
        assert placement(with_mpi) == placement(plain)
        assert (with_mpi.master_addr, with_mpi.master_port) == (
            plain.master_addr,
            plain.master_port,
        )


# --- bad input: always an error naming the variables ------------------------------------------


BAD = [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' must be at least 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be at least 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 exceeds"),
    ({"TORCHELASTIC_RUN_ID": "x"}, "TORCHELASTIC_RUN_ID is set but RANK"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
    ({"PMI_SIZE": "4"}, "PMI_SIZE is set but PMI_RANK is not"),
    ({"PMIX_RANK": "0"}, "PMIX_RANK is set but no launcher variable gives the world size"),
    (ompi_env(4, 4, 0, 1), "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"),
    (srun_env(0, [2]) | {"SLURM_PROCID": "zero"}, "SLURM_PROCID='zero' is not an integer"),
    (
        srun_env(0, [2]) | {"SLURM_PROCID": "2"},
        "SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2",
    ),
    (srun_env(0, [2, 2]) | {"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below"),
    (srun_env(0, [2, 2]) | {"SLURM_STEP_TASKS_PER_NODE": "3,2"}, "disagrees with"),
    (srun_env(0, [2, 2]) | {"SLURM_STEP_TASKS_PER_NODE": "2(x"}, "SLURM_STEP_TASKS_PER_NODE"),
    (srun_env(0, [2, 2]) | {"SLURM_STEP_NODELIST": "n[1-"}, "SLURM_STEP_NODELIST"),
    (srun_env(0, [2, 2]) | {"SLURM_STEP_NODELIST": "n[1-3]"}, "names 3 nodes"),
    ({k: v for k, v in srun_env(0, [2]).items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID unset"),
    (srun_env(0, [2]) | {"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    (srun_env(0, [2]) | {"MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    (srun_env(0, [2]) | {"SLURM_JOB_ID": "12_3"}, "not a numeric Slurm job id"),
    (srun_env(0, [2]) | {"SLURM_RESTART_COUNT": "-2"}, "SLURM_RESTART_COUNT='-2'"),
]


@pytest.mark.parametrize(("environ", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_an_error_that_names_it(environ, message):
    with pytest.raises(EnvError, match=None) as info:
        resolve(environ)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_master_host_format_is_an_error():
    with pytest.raises(EnvError, match="master host format"):
        resolve(srun_env(0, [1, 1]), master_host_format="{hots}")


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=8))
def test_every_srun_layout_resolves_to_a_consistent_job(layout):
    envs = [resolve(srun_env(r, layout)) for r in range(sum(layout))]
    assert sorted(d.rank for d in envs) == list(range(sum(layout)))
    for node, count in enumerate(layout):
        on_node = [d for d in envs if d.node_rank == node]
        assert sorted(d.local_rank for d in on_node) == list(range(count))
        assert {d.local_world_size for d in on_node} == {count}
    assert len({(d.master_addr, d.master_port, d.world_size, d.num_nodes) for d in envs}) == 1


def test_distenv_is_frozen_and_sources_cover_every_field():
    d = resolve(srun_env(0, [2]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.rank = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        d.sources["rank"] = "x"  # type: ignore[index]
    assert {name for name, _, _ in d.rows()} == set(d.sources)

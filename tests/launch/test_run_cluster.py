"""`python -m slurmddp.run` on the real local Slurm cluster: every rank finds its place."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import Counter, defaultdict

import pytest

from slurmddp.rank.env import derive_port, port_range
from tests.conftest import EVERY_SLURM, PROGRAMS, ROOT, SLURM_VERSION, tagged_json

pytestmark = pytest.mark.cluster

PROBE = str(PROGRAMS / "probe.py")
NODES = ["n1", "n2", "n3", "n4"]
# Root may run mpirun only when it says so, four ranks oversubscribe two cores, and the local
# cluster's nodes share one host, where Open MPI's shared-memory transport between processes it
# believes on different nodes crashes (vader): TCP between them, as between real nodes.
MPIRUN_ON_NODES = "--allow-run-as-root --oversubscribe --mca btl self,tcp"


def batch_job(cluster, tmp_path, sbatch_options: str, body: str) -> str:
    """Run a batch script (`#SBATCH sbatch_options`, then `body`) to its end; its output."""
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    # Two minutes, well inside sbatch --wait's bound: a launch that hangs (an mpirun once did,
    # in one CI pass of hundreds) ends as TIMEOUT with its output kept, to show which ranks ran.
    script.write_text(f"#!/bin/bash\n#SBATCH -o {out} --time=2 {sbatch_options}\n{body}\n")
    r = cluster.run(["sbatch", "--wait", str(script)], cwd=tmp_path)
    text = out.read_text() if out.exists() else "(no output)"
    assert r.returncode == 0, f"sbatch --wait exited {r.returncode}: {r.stderr}\n{text}"
    return text


def check_probes(probes: list[dict], world: int, nodes: list[str]) -> None:
    """Every rank's exported values agree with where Slurm really put it. The steps name their
    `nodes` (-w): a node still completing the previous test's job would be passed over."""
    assert sorted(p["rank"] for p in probes) == list(range(world))
    per_node: dict[str, list[dict]] = defaultdict(list)
    for p in probes:
        env = p["env"]
        assert int(env["RANK"]) == p["rank"] and int(env["WORLD_SIZE"]) == world == p["world_size"]
        assert p["all_reduce"] == world * (world + 1) / 2
        per_node[env["SLURMD_NODENAME"]].append(p)
    assert sorted(per_node) == sorted(nodes)
    for node, ranks in per_node.items():
        envs = [r["env"] for r in ranks]
        assert sorted(int(e["LOCAL_RANK"]) for e in envs) == list(range(len(ranks)))
        assert {int(e["LOCAL_WORLD_SIZE"]) for e in envs} == {len(ranks)}
        assert {int(e["GROUP_RANK"]) for e in envs} == {nodes.index(node)}
    assert len({(p["env"]["MASTER_ADDR"], p["env"]["MASTER_PORT"]) for p in probes}) == 1
    assert probes[0]["env"]["MASTER_ADDR"] == nodes[0]


@EVERY_SLURM
def test_under_a_topology_plugin_the_rendezvous_is_served_where_master_addr_points(
    slurm_cluster, python
):
    # The topology variant puts n3 and n4 under the first leaf switch, n1 and n2 under the other:
    # Slurm 26.05's srun lays the tasks out in that order, rank 0 on n3. On one host every node
    # name dials the same loopback, so the check is what a real cluster would need: the one
    # process that serves the rendezvous runs on the host MASTER_ADDR names, the first of the two
    # tasks there. (One node of each switch: two nodes show the order as four did.)
    nodes = ["n1", "n3"]
    with slurm_cluster.variant("topology"):
        r = slurm_cluster.srun(["-N2", "-n4", "-w", ",".join(nodes)],
                               [python, "-m", "slurmddp.run", PROBE])  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    check_probes(probes, 4, nodes)
    servers = [p for p in probes if p["env"]["SLURMDDP_STORE_SERVER"] == "1"]
    assert len(servers) == 1, probes
    assert servers[0]["env"]["SLURMD_NODENAME"] == servers[0]["env"]["MASTER_ADDR"] == "n1"
    assert servers[0]["env"]["LOCAL_RANK"] == "0"
    rank_0 = next(p for p in probes if p["rank"] == 0)
    print(f"Slurm {slurm_cluster.version}: rank 0 on {rank_0['env']['SLURMD_NODENAME']}, the "
          f"rendezvous served by rank {servers[0]['rank']}")  # fmt: skip
    if slurm_cluster.version == "26.05":  # the case this test is for happened
        assert rank_0["env"]["SLURMD_NODENAME"] == "n3" and servers[0]["rank"] != 0


# [N4n8] (an even placement) is proven by [N3n5-uneven] (the same places, port and arguments, with
# a node of two tasks and a node of one) and, two tasks on each node, by the topology and
# MPI-plugin tests below (check_probes, on every version).
@EVERY_SLURM
@pytest.mark.parametrize(("n_nodes", "n_tasks"), [(3, 5)], ids=["N3n5-uneven"])
def test_srun_places_every_rank(slurm_cluster, python, n_nodes, n_tasks):
    r = slurm_cluster.srun([f"-N{n_nodes}", f"-n{n_tasks}", "-w", ",".join(NODES[:n_nodes])],
                           [python, "-m", "slurmddp.run", PROBE, "--x", "a b"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    assert len(probes) == n_tasks
    check_probes(probes, n_tasks, NODES[:n_nodes])
    # The port derived from the job and step, in the range this pass's environment names.
    env = probes[0]["env"]
    job, step = int(env["SLURM_JOB_ID"]), int(env["SLURM_STEP_ID"])
    assert int(env["MASTER_PORT"]) == derive_port(job, step, port_range(os.environ))
    assert all(p["argv"] == ["--x", "a b"] and p["name"] == "__main__" for p in probes)
    # Slurm spreads tasks unevenly; the test is only meaningful if it did here.
    if n_tasks == 5:
        counts = Counter(p["env"]["SLURMD_NODENAME"] for p in probes)
        assert sorted(counts.values()) != [1] * 5


@pytest.mark.parametrize("how", ["srun", "sbatch"])
def test_a_heterogeneous_step_places_every_rank(slurm_cluster, python, tmp_path, how):
    # Component 0 on n3, component 1 on n1 and n2: srun sorts the node list (n1, n2, n3) and
    # the tasks per node with it, while SLURM_NODEID follows the components (n3 is node 0).
    probe = f"{python} -m slurmddp.run {PROBE}"
    if how == "srun":
        r = slurm_cluster.run(["srun", "--kill-on-bad-exit=1", "-w", "n3", "-N1", "-n1",
                               *probe.split(), ":", "-w", "n1,n2", "-N2", "-n3",
                               *probe.split()])  # fmt: skip
        assert r.returncode == 0, r.stderr
        text = r.stdout
    else:
        text = batch_job(slurm_cluster, tmp_path, "-w n3 -N1 -n1\n#SBATCH hetjob\n"
                         "#SBATCH -w n1,n2 -N2 -n3", f"srun --het-group=0,1 {probe}")
    check_probes(tagged_json(text, "PROBE "), 4, ["n3", "n1", "n2"])  # rank 0's node first


def test_arbitrary_distribution_takes_the_master_from_the_host_file(slurm_cluster, python,
                                                                    tmp_path):  # fmt: skip
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n3\nn1\nn1\nn2\n")
    r = slurm_cluster.srun(["--distribution=arbitrary", "-n4"],
                           [python, "-m", "slurmddp.run", PROBE],
                           env=slurm_cluster.env(SLURM_HOSTFILE=str(hostfile)))  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = sorted(tagged_json(r.stdout, "PROBE "), key=lambda p: p["rank"])
    assert [p["env"]["SLURMD_NODENAME"] for p in probes] == ["n3", "n1", "n1", "n2"]
    assert [p["env"]["LOCAL_WORLD_SIZE"] for p in probes] == ["1", "2", "2", "1"]
    assert {p["env"]["MASTER_ADDR"] for p in probes} == {"n3"}
    assert all(p["all_reduce"] == 10 for p in probes)


@EVERY_SLURM
def test_torchrun_per_node_under_srun(slurm_cluster, python):
    port = port_range(os.environ)[-1]  # this pass's own range: the other cluster's jobs avoid it
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=n1:{port}", "--rdzv-id=slurmddp-test",
                "-m", "slurmddp.run", PROBE]  # fmt: skip
    # The endpoint's node in the step: each node is a host of its own.
    r = slurm_cluster.srun(["-N2", "--ntasks-per-node=1", "-w", "n1,n2"], torchrun,
                           env=slurm_cluster.env(OMP_NUM_THREADS="1"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    assert len(probes) == 4
    assert sorted(p["rank"] for p in probes) == [0, 1, 2, 3]
    assert all(p["all_reduce"] == 10 for p in probes)
    by_group = defaultdict(list)
    for p in probes:
        by_group[p["env"]["GROUP_RANK"]].append(int(p["env"]["LOCAL_RANK"]))
    assert {k: sorted(v) for k, v in by_group.items()} == {"0": [0, 1], "1": [0, 1]}
    # torchrun's own values are kept: its per-node agent is not mistaken for a rank.
    assert {p["env"]["LOCAL_WORLD_SIZE"] for p in probes} == {"2"}


def test_unchanged_torchrun_ddp_script_trains_to_identical_parameters(slurm_cluster, python):
    script = str(ROOT / "examples" / "ddp_train.py")
    r = slurm_cluster.srun(["-N2", "-n4"], [python, "-m", "slurmddp.run", script, "--steps", "8"])
    assert r.returncode == 0, r.stderr
    results = tagged_json(r.stdout, "RESULT ")
    assert sorted(x["rank"] for x in results) == list(range(4))
    assert len({x["digest"] for x in results}) == 1, results
    assert "parameters identical on all ranks: True" in r.stdout


def test_doctor_check_passes_on_every_collective(slurm_cluster, python):
    r = slurm_cluster.srun(["-N2", "-n4"], [python, "-m", "slurmddp", "doctor", "--check"])
    assert r.returncode == 0, r.stdout + r.stderr
    for check in ("all_reduce", "broadcast", "all_gather", "send_recv_ring"):
        line = next(x for x in r.stdout.splitlines() if x.strip().startswith(check))
        assert " pass " in line, line
    assert "4 ranks, 2 nodes, backend gloo, launcher slurm" in r.stdout
    assert "all checks passed" in r.stdout


def test_doctor_shows_sources(slurm_cluster, python):
    r = slurm_cluster.srun(["-N3", "-n5"], [python, "-m", "slurmddp", "doctor"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("launcher slurm") == 5
    assert "SLURM_STEP_TASKS_PER_NODE[SLURMD_NODENAME]" in r.stdout
    assert "rule: first host of SLURM_STEP_NODELIST" in r.stdout


def test_doctor_names_the_interface_each_library_takes_and_which_one_reaches_master(
        slurm_cluster, python, tmp_path):  # fmt: skip
    """Issue 48: each node's first interface (eth0) reaches no other node. NCCL's default takes
    it, gloo's (the host name's address) takes eth1; so does a GLOO_SOCKET_IFNAME copied from
    another cluster. The doctor says so on each rank, in one line naming the variable to set."""

    def told(*exports: str) -> list[dict]:
        # A file a task: srun cuts lines longer than its buffer between the tasks' output.
        export, out = ",".join(["ALL", *exports]), tmp_path / f"{len(exports)}-%t.json"
        r = slurm_cluster.srun(["-N2", "-n2", "-w", "n1,n2", f"--export={export}", f"-o{out}"],
                               [python, "-m", "slurmddp", "doctor", "--json"])  # fmt: skip
        assert r.returncode == 0, r.stderr
        return [json.loads((tmp_path / f"{len(exports)}-{t}.json").read_text()) for t in (0, 1)]

    for shown in told():
        net, node = shown["network"], shown["host"]
        assert [i["name"] for i in net["interfaces"]] == ["lo", "eth0", "eth1"], net
        assert net["master"] == {"name": "n1", "address": slurm_cluster.address("n1"),
                                 "through": "eth1"}, net  # fmt: skip
        assert [(p["library"], p["interface"]) for p in net["picks"]] == [("gloo", "eth1"),
                                                                        ("NCCL", "eth0")]
        assert net["concerns"] == [
            f"NCCL would use eth0 ({slurm_cluster.address(node + '-mgmt')}; NCCL's default: ib*, "
            "else the first but lo and docker*), but MASTER_ADDR n1 is reached through eth1 "
            f"({slurm_cluster.address(node)}): if "
            "its collectives hang, set NCCL_SOCKET_IFNAME=eth1 (submit --env, or a profile's env)"]
    for shown in told("NCCL_SOCKET_IFNAME=eth1", "GLOO_SOCKET_IFNAME=eth0"):
        (line,) = shown["network"]["concerns"]
        mgmt = slurm_cluster.address(shown["host"] + "-mgmt")
        assert line.startswith(f"gloo would use eth0 ({mgmt};") and line.endswith(
            "set GLOO_SOCKET_IFNAME=eth1 (submit --env, or a profile's env)"), line


# The local cluster's first interface (eth0) reaches no other node: a GLOO_SOCKET_IFNAME copied
# from another cluster's scripts names it. Without the check the first collective waits for its
# timeout; the start-up timeout is raised far above the bound so that no timeout can pass it.
WRONG_INTERFACE = "GLOO_SOCKET_IFNAME=eth0"
NO_TIMEOUT = "SLURMDDP_STARTUP_TIMEOUT=900"
FAILS_WITHIN_S = 120  # the promise: seconds (the start of two ranks on a loaded machine), not 900
NO_ROUTE = re.compile(
    r"rank [01] \(n[12]\) cannot reach rank [01] \(n[12]\) at 10\.78\.\d?[12]\.1, its eth0, where "
    r"gloo will connect to it \(GLOO_SOCKET_IFNAME=eth0\): no route to it; set "
    r"GLOO_SOCKET_IFNAME to an interface every node reaches the others on \(MASTER_ADDR n1 is "
    r"reached through eth1 here\)")  # fmt: skip


def failed_start(cluster, python, tmp_path, launcher: str, export: str,
                 torchrun: list[str]) -> tuple[str, float]:  # fmt: skip
    """PROBE on n1 and n2 under `launcher` with `export` (NAME=VALUE) and no start-up timeout
    that could end it; the output that says why it failed, and the seconds it took. Under
    torchrun, `torchrun` is the command before the script (its own module and options)."""
    t0 = time.monotonic()
    if launcher == "mpirun":
        said = batch_job(cluster, tmp_path, "-N2 --ntasks-per-node=1 -w n1,n2",
                         f"export {NO_TIMEOUT}\nmpirun {MPIRUN_ON_NODES} -np 2 --map-by node "
                         f"-x '{export}' {python} -m slurmddp.run {PROBE}; echo exit $?")
        assert not said.endswith("exit 0\n"), said
    else:
        command = [*torchrun, "-m", "slurmddp.run", PROBE] if launcher == "torchrun" else [
            python, "-m", "slurmddp.run", PROBE]  # fmt: skip
        r = cluster.srun(["-N2", "--ntasks-per-node=1", "-w", "n1,n2",
                          f"--export=ALL,{export},{NO_TIMEOUT}"], command)
        assert r.returncode != 0, r.stdout
        said = r.stderr
    assert "PROBE " not in said  # nothing trained
    return said, time.monotonic() - t0


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "mpirun"])
def test_an_interface_that_reaches_no_other_node_fails_in_seconds_in_one_line(
        slurm_cluster, python, tmp_path, launcher):  # fmt: skip
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=n1:{port_range(os.environ)[-2]}",
                "--rdzv-id=slurmddp-test"]  # fmt: skip
    said, took = failed_start(slurm_cluster, python, tmp_path, launcher, WRONG_INTERFACE,
                              torchrun)  # fmt: skip
    assert NO_ROUTE.search(said), said
    assert took < FAILS_WITHIN_S, said


@pytest.mark.parametrize("launcher", ["srun", "torchrun", "mpirun"])
def test_a_master_no_other_node_can_reach_fails_in_seconds_in_one_line(
        slurm_cluster, python, tmp_path, launcher):  # fmt: skip
    # n1-mgmt names n1's first interface, which no other node reaches (no route). Under torchrun
    # the rendezvous is torchrun's, at the endpoint given.
    port = port_range(os.environ)[-2]
    torchrun = [python, "-m", "slurmddp.agent", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=n1-mgmt:{port}",
                "--rdzv-id=slurmddp-test"]  # fmt: skip
    said, took = failed_start(slurm_cluster, python, tmp_path, launcher,
                              "SLURMDDP_MASTER_HOST_FORMAT={host}-mgmt", torchrun)  # fmt: skip
    if launcher == "torchrun":
        assert (f"slurmddp: agent (host n2): cannot reach torchrun's rendezvous at n1-mgmt:{port} "
                f"({slurm_cluster.address('n1-mgmt')}): no route to it; give --rdzv-endpoint a "
                "name of the first node on a "
                "network every node reaches") in said, said
    else:
        assert (f"rank 1 (n2) cannot reach MASTER_ADDR n1-mgmt ({slurm_cluster.address('n1-mgmt')})"
                ": no route to it. It must name the first node on a network every node reaches"
                ) in said, said
    assert took < FAILS_WITHIN_S, said


# ---- MPI launchers on the cluster ----------------------------------------------------------


# Debian's Slurm 26.05.5 (sid) ships no mpi_pmix plugin (`srun --mpi=list`: pmi2, cray_shasta).
MPI_PLUGINS = ["pmi2"] if SLURM_VERSION == "26.05" else ["pmix", "pmi2"]


@EVERY_SLURM
@pytest.mark.mpi
@pytest.mark.parametrize("plugin", MPI_PLUGINS)
def test_srun_with_an_mpi_plugin_gives_the_same_answers(slurm_cluster, python, plugin):
    r = slurm_cluster.srun([f"--mpi={plugin}", "-N2", "-n4", "-w", "n1,n2"],
                           [python, "-m", "slurmddp.run", PROBE])  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    assert len(probes) == 4
    check_probes(probes, 4, NODES[:2])
    # The collectives under the plugin, a rank a node (the places of two a node: the probes).
    doctor = slurm_cluster.srun([f"--mpi={plugin}", "-N2", "-n2", "-w", "n1,n2"],
                                [python, "-m", "slurmddp", "doctor", "--check"])  # fmt: skip
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "all checks passed" in doctor.stdout


@pytest.mark.mpi
def test_mpirun_inside_an_allocation_takes_the_ranks_from_mpi(slurm_cluster, python, tmp_path):
    # mpirun starts its daemons as a Slurm step: their SLURM_PROCID is the daemon's, not a rank's.
    mpirun = f"mpirun {MPIRUN_ON_NODES} -np 4 {python}"
    text = batch_job(slurm_cluster, tmp_path, "-N2 -w n1,n2 --ntasks-per-node=2",
                     f"{mpirun} -m slurmddp.run {PROBE} || exit 1\n"
                     f"{mpirun} -m slurmddp doctor --check")  # fmt: skip
    probes = tagged_json(text, "PROBE ")
    assert len(probes) == 4
    check_probes(probes, 4, NODES[:2])
    assert {p["env"]["OMPI_COMM_WORLD_RANK"] for p in probes} == {"0", "1", "2", "3"}
    assert "4 ranks, 2 nodes, backend gloo, launcher mpi" in text and "all checks passed" in text


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("allocation", "mapping", "per_node"),
    [("-N2 -w n1,n2 --ntasks-per-node=2", "--map-by node -np 4", {"n1": [0, 2], "n2": [1, 3]}),
     ("-N2 -w n1,n2 -n3", "-np 3", {"n1": [0, 1], "n2": [2]})],
    ids=["map-by-node", "uneven"],
)  # fmt: skip
def test_mpirun_round_robin_or_uneven_over_nodes(slurm_cluster, python, tmp_path, allocation,
                                                 mapping, per_node):  # fmt: skip
    text = batch_job(slurm_cluster, tmp_path, allocation,
                     f"mpirun {MPIRUN_ON_NODES} {mapping} {python} -m slurmddp.run {PROBE}")
    probes = tagged_json(text, "PROBE ")
    seen = defaultdict(list)
    for p in probes:
        seen[p["env"]["SLURMD_NODENAME"]].append(p["rank"])
    assert {n: sorted(ranks) for n, ranks in seen.items()} == per_node  # mpirun placed them so
    check_probes(probes, len(probes), ["n1", "n2"])


@EVERY_SLURM
def test_launcher_variables_left_in_an_salloc_shell_are_named_in_one_line(slurm_cluster, python):
    # RANK and WORLD_SIZE exported by hand (a torchrun tried earlier) contradict the step.
    env = slurm_cluster.env(RANK="0", WORLD_SIZE="4", MASTER_ADDR="localhost")
    r = slurm_cluster.srun(["-N2", "-n2"], [python, "-m", "slurmddp.run", PROBE], env=env)
    assert r.returncode != 0
    assert "are set, but this process is task" in r.stderr, r.stderr
    assert "left over from another launch" in r.stderr and "Traceback" not in r.stderr


@EVERY_SLURM
def test_in_an_interactive_step_a_script_is_one_process_and_srun_places_every_rank(
    slurm_cluster, python, tmp_path
):
    """Sites that set LaunchParameters=use_interactive_step give salloc's shell a job step of its
    own (SLURM_STEP_ID 4294967290, -6 from 26.05 on; SLURM_PROCID 0, one task) inside the job's
    allocation (SLURM_NTASKS 2): a script run there is one process, not rank 0 of two waiting
    for the other; srun from that shell places both ranks (a rank a node: the places of two a
    node are the other tests')."""
    # srun's stdin from /dev/null: it would take the "exit" typed after it.
    typed = (f"{python} -m slurmddp.run {PROBE}\n"
             f"srun {python} -m slurmddp.run {PROBE} </dev/null\nexit\n")  # fmt: skip
    # The step runs $SHELL (InteractiveStepOptions' default): a login always has one, CI may not.
    env = slurm_cluster.env(SHELL="/bin/bash")
    with slurm_cluster.variant("interactive-step"):
        # salloc starts the interactive step only for a shell on a terminal.
        r = subprocess.run(["script", "-qc", "salloc -N2 -w n1,n2 --ntasks-per-node=1",
                            "/dev/null"], input=typed, env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=180)  # fmt: skip
    probes = tagged_json(r.stdout, "PROBE ")
    assert len(probes) == 3, r.stdout + r.stderr
    alone, ranks = probes[0], probes[1:]
    interactive = "-6" if slurm_cluster.version == "26.05" else "4294967290"
    assert alone["env"]["SLURM_STEP_ID"] == interactive and alone["env"]["SLURM_NTASKS"] == "2"
    assert (alone["rank"], alone["world_size"], alone["all_reduce"]) == (0, 1, 1)
    check_probes(sorted(ranks, key=lambda p: p["rank"]), 2, NODES[:2])

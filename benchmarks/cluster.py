"""The local Slurm cluster, for the benchmarks that run on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from slurmddp.checkpoint.snapshots import store
from slurmddp.protocol import PORT_RANGE_VAR
from slurmddp.supervisor import fence

ROOT = Path(__file__).resolve().parent.parent


# A node's network namespace, "{node}" in it (scripts/slurm-cluster env): each node a host.
NODE_NETNS_VAR = "SLURMDDP_TEST_NODE_NETNS"


def cluster_env() -> dict[str, str]:
    """The environment of the local cluster's clients (started if it is not running): its
    SLURM_CONF, the range its jobs take their ports from (the clusters share this host), its
    nodes' network namespaces (NODE_NETNS_VAR), and on another Slurm ($SLURMDDP_SLURM) the PATH
    of its commands."""
    script = ROOT / "scripts" / "slurm-cluster"
    subprocess.run([str(script), "up"], check=True, capture_output=True)
    shown = subprocess.run(["bash", "-c", f'eval "$({script} env)" && printf "%s\\n%s\\n%s\\n%s" '
                            f'"$SLURM_CONF" "${PORT_RANGE_VAR}" "${NODE_NETNS_VAR}" "$PATH"'],
                           check=True, capture_output=True, text=True).stdout  # fmt: skip
    conf, ports, netns, path = shown.split("\n", 3)
    return os.environ | {"SLURM_CONF": conf, PORT_RANGE_VAR: ports, NODE_NETNS_VAR: netns,
                         "PATH": path}  # fmt: skip


@contextlib.contextmanager
def link_cut(node: str, node_netns: str) -> Iterator[None]:
    """`node`'s data link (eth1: its name's address, the other nodes, slurmctld) down for the
    block, then up again; its processes live on. `node_netns`: NODE_NETNS_VAR's value; each
    cluster's nodes have namespaces of their own, so the cut is this cluster's alone."""
    ns = Path(node_netns.format(node=node)).name
    subprocess.run(["ip", "-n", ns, "link", "set", "eth1", "down"], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", "eth1", "up"], check=True)


def job_processes(job: str, node: str, conf: str) -> dict[int, dict[str, str]]:
    """{pid: environment} of the job's processes on `node` of the cluster whose SLURM_CONF is
    `conf`, Slurm's own (slurmstepd) aside."""
    # The clusters on this host share node names and number their jobs alike, and tests emulate
    # nodes with the same variables outside any cluster: Slurm sets SLURM_CONF in its tasks.
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "environ").read_bytes().decode(errors="replace")
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        env = dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)
        if comm != "slurmstepd" and env.get("SLURM_JOB_ID") == job and (
                env.get("SLURMD_NODENAME") == node and env.get("SLURM_CONF") == conf):  # fmt: skip
            found[int(proc.name)] = env
    return found


def lose_node(job: str, node: str, conf: str, *, machine: bool = False,
              sig: signal.Signals = signal.SIGKILL) -> list[int]:  # fmt: skip
    """Lose `node`: SIGKILL the job's processes on it, as a GPU fault ends them (Slurm's
    daemons live on); with `machine`, the whole machine at once: the node's slurmd, the job's
    step daemons and its tasks, all stopped before any is killed, so that none reports or acts
    on another's end. SIGSTOP (`sig`) makes it a machine gone silent (a crash, a cut link): no
    connection of its is reset. The pids signalled."""
    tasks = job_processes(job, node, conf)
    daemons = []
    if machine:
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                comm = (proc / "comm").read_text().strip() if proc.name.isdigit() else ""
                if comm == "slurmstepd":  # the job's, on `node`: its children are the job's tasks
                    children = (proc / "task" / proc.name / "children").read_text().split()
                    if any(int(child) in tasks for child in children):
                        daemons.append(int(proc.name))
                elif comm == "slurmd" and _serves(proc, node, conf):
                    daemons.append(int(proc.name))
    hit = [*daemons, *tasks]
    if machine and sig == signal.SIGKILL:
        # At once, as a machine ends: killed one by one, a process would act on another's end
        # (srun's shepherd cancels the step on every node once srun is gone); see fence.kill.
        fence.kill(hit)
    else:
        for pid in list(hit):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                hit.remove(pid)
    # The node's memory goes with it: its snapshot stores, of every checkpoint directory (the
    # local nodes share one /dev/shm).
    for environ in tasks.values():
        if environ.get("SLURMD_NODENAME") == node:
            job, restart, step = store.run_key(environ)
            for held in store.root(environ).glob(f"{job}.{restart}.{step}*/{node}"):
                shutil.rmtree(held, ignore_errors=True)
    return hit


def _serves(slurmd: Path, node: str, conf: str) -> bool:
    """Whether the slurmd process is `node`'s of the cluster whose SLURM_CONF is `conf` (the
    22.05 and 24.11 clusters may both run here, with the same node names)."""
    argv = (slurmd / "cmdline").read_bytes().split(b"\0")
    environ = (slurmd / "environ").read_bytes().split(b"\0")
    return argv[1:3] == [b"-N", node.encode()] and f"SLURM_CONF={conf}".encode() in environ

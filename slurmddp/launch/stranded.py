"""An elastic job whose batch host is lost, requeued by an agent that survived it.

Under torchrun with ``--spare-nodes`` or ``--nodes MIN-MAX`` a ``slurmddp submit`` job runs with
``--no-kill``, so that Slurm keeps it when a node fails and the other agents go on. When the node
lost is the batch host (the batch script and its supervisor, and the agents' c10d rendezvous),
nothing can go on: Slurm (24.11, seen) removes the node from the job, kills its batch step, and
keeps the job RUNNING on the other nodes without a script, until its time limit.

The other agents learn it from torch where the host resets their connections (its processes
killed while its kernel answers): their rendezvous fails (``RendezvousConnectionError``). Then
`after_lost_rendezvous` runs in the agents of the step's second and third nodes (`WATCHERS`:
two, so that one lost with the batch host leaves the other; every agent asking Slurm would be a
thousand calls a period in a large job). It asks Slurm for the job's batch host
and dials that host's slurmd (a connection opened and closed): where it answers, the host is
there and its own batch script decides what the job does, so the agent ends at once, as
torchrun would have. Where it does not (a crashed machine, a cut link, its daemons killed), the
agent waits for Slurm to agree, one ``show job`` and one ``show node`` a `PERIOD_S`, at most
twice ``SlurmdTimeout``: once Slurm marks the host lost (DOWN, NOT_RESPONDING) and the job still
runs, the agent requeues it (``scontrol requeue``); it runs again on other nodes and resumes from
its checkpoint, and the next run names the node it lost. A job Slurm itself ended or requeued
meanwhile, or a host whose slurmd answers again, is left alone.

Not covered: a silent batch host (a crash, a cut link) that resets no connection. torch's agents
then wait on its store with no bound (seen: 160 s, until the link came back), so no rendezvous
fails and nothing here runs; finding it needs a thread that dials the store while the training
goes on.

Not covered: a batch host cut off whose link comes back while the requeued job runs. Its batch
step, ended when its slurmd registers again, reports its end then, and Slurm (24.11) takes it for
the requeued job's ("Batch completion ... sent from wrong node"), which ends FAILED; Slurm ignores
it after a requeue of its own, which it does not make under ``--no-kill``.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import time
from collections.abc import Callable, Mapping

from slurmddp.preemption import decision, nodes, slurm

PERIOD_S = 10.0
DIAL_TIMEOUT_S = 5.0
WATCHERS = ("1", "2")  # the SLURM_NODEID of the agents that act
SLURMD_PORT = 6818  # Slurm's default SlurmdPort
# When scontrol shows no SlurmdTimeout: Slurm's default (300 s).
DEFAULT_SLURMD_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Host:
    """A node as Slurm shows it: its state and where its slurmd listens."""

    name: str
    state: str
    address: str
    port: int

    @property
    def lost(self) -> bool:
        return bool(nodes.not_responding({self.name: self.state}))


def host(node: str, shown: str, config: str) -> Host | None:
    """`node` from ``scontrol show node -o NODE``'s text, its slurmd's port from the node's
    ``Port=`` or else the config's ``SlurmdPort``; None when Slurm did not show it."""
    line = re.search(rf"^NodeName={re.escape(node)}\s.*$", shown, re.M)
    if line is None:
        return None
    fields = dict(re.findall(r"(\w+)=(\S*)", line.group(0)))
    default = re.search(r"^SlurmdPort\s*=\s*(\d+)", config, re.M)
    port = fields.get("Port", "")
    return Host(node, fields.get("State", ""), fields.get("NodeAddr") or node,
                int(port) if port.isdigit() else int(default.group(1)) if default else SLURMD_PORT)


def slurmd_timeout_s(config: str) -> float:
    """``SlurmdTimeout`` of ``scontrol show config``'s text (0 there: Slurm never gives up)."""
    found = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", config, re.M)
    return float(found.group(1)) if found else DEFAULT_SLURMD_TIMEOUT_S


def answering(address: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> bool:
    """Whether something accepts a connection at `address`:`port` now (opened, then closed)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def requeue(target: str) -> str | None:
    """``scontrol requeue TARGET``; None when it worked, else what scontrol said."""
    done = slurm.scontrol("requeue", target)
    return None if done.returncode == 0 else (done.stderr.strip() or f"status {done.returncode}")


@dataclasses.dataclass
class Slurm:
    """What `after_lost_rendezvous` asks of Slurm and of the batch host: the real calls, or
    stand-ins (tests)."""

    show_job: Callable[[str], dict[str, str]] = slurm.show_job
    show_node: Callable[[str], str] = lambda node: slurm.scontrol("show", "node", "-o",
                                                                  node).stdout  # fmt: skip
    show_config: Callable[[], str] = lambda: slurm.scontrol("show", "config").stdout
    answering: Callable[[str, int], bool] = answering
    requeue: Callable[[str], str | None] = requeue
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


def after_lost_rendezvous(environ: Mapping[str, str], say: Callable[[str, bool], None],
                          calls: Slurm | None = None) -> None:
    """Called once this agent's rendezvous failed: requeue the job where its batch host is lost
    (see the module's docstring). `say(line, requeued)` tells what is done: before the requeue,
    whose TERM to the job's tasks follows at once."""
    calls = calls or Slurm()
    job_id, node_id = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_NODEID")
    if node_id not in WATCHERS or not job_id.isdigit():
        return
    job = calls.show_job(job_id)
    batch, restarts = job.get("BatchHost", ""), job.get("Restarts")

    def running() -> bool:  # and not requeued meanwhile, by Slurm or the other watcher
        return job.get("JobState") == "RUNNING" and job.get("Restarts") == restarts

    if not running() or not batch:
        return
    config = calls.show_config()
    where = host(batch, calls.show_node(batch), config)
    if where is None or (not where.lost and calls.answering(where.address, where.port)):
        return  # the batch host is there: its batch script decides
    deadline = calls.clock() + 2 * slurmd_timeout_s(config) + PERIOD_S
    # The first watcher acts; the second a period later, where the first did not.
    turns = 1 if node_id == WATCHERS[0] else 2
    while turns:
        if where.lost:
            turns -= 1
            if not turns:
                break
        elif calls.clock() >= deadline:
            say(f"the batch host {batch} does not answer, but Slurm still has it ({where.state}) "
                "after twice its SlurmdTimeout: the job is left to Slurm", False)
            return
        calls.sleep(PERIOD_S)
        job = calls.show_job(job_id)
        if not running():
            return
        where = host(batch, calls.show_node(batch), config) or where
        if not where.lost and calls.answering(where.address, where.port):
            return  # back
    said = (f"the batch host {batch} is lost ({where.state}), and with it torchrun's rendezvous; "
            "Slurm keeps the job without its batch script (--no-kill)")
    target = decision.requeue_target(environ) or job_id
    say(f"{said}: requeued, to resume from its checkpoint on other nodes", True)
    refused = calls.requeue(target)
    if refused is not None:
        job = calls.show_job(job_id)
        if running():
            say(f"scontrol requeue {target} failed: {refused}; the job is left to Slurm", False)

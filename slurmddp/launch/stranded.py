"""An elastic job whose batch host is lost, requeued by an agent that survived it.

Under torchrun with ``--spare-nodes`` or ``--nodes MIN-MAX`` a ``slurmddp submit`` job runs with
``--no-kill``, so that Slurm keeps it when a node fails and the other agents go on. When the node
lost is the batch host (the batch script and its supervisor, and the agents' c10d rendezvous),
nothing can go on: Slurm (24.11, seen) removes the node from the job, kills its batch step, and
keeps the job RUNNING on the other nodes without a script, until its time limit.

The other agents learn it in one of two ways. Where the host resets their connections (its
processes killed while its kernel answers), torch tells them: their rendezvous fails
(``RendezvousConnectionError``), and `after_lost_rendezvous` runs in the agent's main thread. Where
the host is silent (a crash, a cut link), torch says nothing: its agents wait on the silent store
with no bound (seen: 160 s, until the link came back). So the agents of the step's second and
third nodes (`WATCHERS`: two, so that one lost with the batch host leaves the other; every agent
asking Slurm would be a thousand calls a period in a large job) each run `watch` in a daemon
thread: every `PERIOD_S` it dials the rendezvous (a connection opened and closed; torch's store
says nothing of it). A host that accepts or refuses is there (a refusal: its processes ended, and
torch's own failure follows); nothing else happens, and Slurm is not asked. One that stays silent
`DIAL_TIMEOUT_S` gets `after_lost_rendezvous` too.

`after_lost_rendezvous` asks Slurm for the job's batch host and dials that host's slurmd: where it
answers, the host is there and its own batch script decides what the job does (the main thread's
agent ends at once, as torchrun would have; the watcher goes on watching). Where it does not (a
crashed machine, a cut link, its daemons killed), the agent waits for Slurm to agree, one
``show job`` and one ``show node`` a `PERIOD_S`, at most twice ``SlurmdTimeout``: once Slurm
marks the host lost (DOWN, NOT_RESPONDING) and the job still runs, the agent requeues it
(``scontrol requeue``); it runs again on other nodes and resumes from its checkpoint, and the
next run names the node it lost and the agent that requeued it. A job Slurm itself ended or
requeued meanwhile, or a host whose slurmd answers again, is left alone. One agent's two ways
take turns (a lock): the second finds the job requeued, and leaves it.

A batch host cut off whose link comes back while the requeued job runs: its step daemon then
reports the end of the last run's step 0, which Slurm (24.11) takes for the requeued run's step 0
after a requeue of ours (it ignores it after one of its own) and cancels it; the next run's
supervisor runs an empty step first to take that id (`slurmddp.supervisor.supervise`).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping

from slurmddp.launch import network
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


# One agent's main thread and its watcher act in turn.
_ACTING = threading.Lock()


def after_lost_rendezvous(environ: Mapping[str, str], say: Callable[[str, bool], None],
                          calls: Slurm | None = None) -> bool:
    """Called once this agent's rendezvous failed or went silent: requeue the job where its
    batch host is lost (see the module's docstring). `say(line, requeued)` tells what is done:
    before the requeue, whose TERM to the job's tasks follows at once. False where there is
    more to watch: the host's slurmd answered, or Slurm did not (this node may be the one cut
    off); True where not (requeued, the job no longer running, left to Slurm, not a watcher)."""
    with _ACTING:
        return _act(environ, say, calls or Slurm())


def _act(environ: Mapping[str, str], say: Callable[[str, bool], None], calls: Slurm) -> bool:
    job_id, node_id = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_NODEID")
    if node_id not in WATCHERS or not job_id.isdigit():
        return True
    job = calls.show_job(job_id)
    if not job:
        return False  # Slurm did not answer
    batch, restarts = job.get("BatchHost", ""), job.get("Restarts")

    def running() -> bool:  # and not requeued meanwhile, by Slurm or the other watcher
        return job.get("JobState") == "RUNNING" and job.get("Restarts") == restarts

    if not running() or not batch:
        return True
    config = calls.show_config()
    where = host(batch, calls.show_node(batch), config)
    if where is None:
        return False
    if not where.lost and calls.answering(where.address, where.port):
        return False  # the batch host is there: its batch script decides
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
            return True
        calls.sleep(PERIOD_S)
        job = calls.show_job(job_id) or job  # (Slurm silent a period: as it was)
        if not running():
            return True
        where = host(batch, calls.show_node(batch), config) or where
        if not where.lost and calls.answering(where.address, where.port):
            return False  # back
    said = (f"the batch host {batch} is lost ({where.state}), and with it torchrun's rendezvous; "
            "Slurm keeps the job without its batch script (--no-kill)")
    target = decision.requeue_target(environ) or job_id
    say(f"{said}: requeued, to resume from its checkpoint on other nodes", True)
    refused = calls.requeue(target)
    if refused is not None:
        job = calls.show_job(job_id)
        if running():
            say(f"scontrol requeue {target} failed: {refused}; the job is left to Slurm", False)
    return True


def watch(environ: Mapping[str, str], address: str, port: int,
          say: Callable[[str, bool], None], calls: Slurm | None = None,
          reach: Callable[[str, int, float], None] = network.reach,
          rounds: int | None = None) -> None:  # fmt: skip
    """Dial the rendezvous at `address`:`port` every `PERIOD_S`; where it stays silent
    `DIAL_TIMEOUT_S`, `after_lost_rendezvous`, until that is done (see the module's docstring).
    `rounds` bounds the periods (tests)."""
    calls = calls or Slurm()
    done = 0
    while rounds is None or done < rounds:
        done += 1
        calls.sleep(PERIOD_S)
        try:
            reach(address, port, DIAL_TIMEOUT_S)  # accepting or refusing: its host is there
            continue
        except network.Unreachable:
            pass
        if after_lost_rendezvous(environ, say, calls):
            return


def start(environ: Mapping[str, str], endpoint: str, say: Callable[[str, bool], None]
          ) -> threading.Thread | None:  # fmt: skip
    """`watch`'s daemon thread for torchrun's c10d rendezvous at `endpoint` (HOST:PORT), where
    this agent is a watcher in a Slurm job; None elsewhere."""
    name, _, port = endpoint.rpartition(":")
    if (environ.get("SLURM_NODEID") not in WATCHERS or not environ.get("SLURM_JOB_ID", "").isdigit()
            or not port.isdigit()):  # fmt: skip
        return None
    address = network.resolve(name)
    if address is None:
        return None
    def run() -> None:
        try:
            watch(environ, address, int(port), say)
        except Exception as e:  # the training goes on without the watch: said, not a traceback
            say(f"the watch of torchrun's rendezvous ended ({type(e).__name__}: {e})", False)

    thread = threading.Thread(target=run, name="slurmddp-batch-host", daemon=True)
    thread.start()
    return thread

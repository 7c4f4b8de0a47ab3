"""An elastic job whose batch host is lost, requeued from a node that survived it.

Under torchrun with ``--spare-nodes`` or ``--nodes MIN-MAX`` a ``slurmddp submit`` job runs with
``--no-kill``, so that Slurm keeps it when a node fails and the other agents go on. When the node
lost is the batch host (the batch script and its supervisor, and the agents' c10d rendezvous),
nothing goes on: the other agents wait on a rendezvous that no longer answers (a silent host
resets no connection), and Slurm (24.11, seen) removes the node from the job, kills its batch
step, and keeps the job RUNNING on the other nodes without a script, until its time limit.

So the agents of the step's second and third nodes (`WATCHERS`: two, so that one lost with the
batch host leaves the other) each run `watch` in a daemon thread: every `PERIOD_S` it dials the
rendezvous (a connection opened and closed: torch's store says nothing of it). While the store
accepts, nothing else happens. While it does not (its host silent, or refusing: its processes
killed, or the job ending), one ``scontrol show job`` and one ``show node`` of the batch host a
period: once Slurm marks that host lost (DOWN, NOT_RESPONDING: after ``SlurmdTimeout``) and the
job still runs, the agent requeues it (``scontrol requeue``); it runs again on other nodes and
resumes from its checkpoint, and the next run names the node it lost. A job Slurm itself ends or
requeues (one without ``--no-kill``) is left to Slurm. An agent whose torchrun failed on the lost
rendezvous (its host's processes killed: the connection reset) stays for it (`linger`).

Not covered: a batch host cut off whose link comes back while the requeued job runs. Its batch
step, ended when its slurmd registers again, reports its end then, and Slurm (24.11) takes it for
the requeued job's ("Batch completion ... sent from wrong node"), which ends FAILED; Slurm ignores
it after a requeue of its own, which it does not make under ``--no-kill``.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

from slurmddp.preemption import decision, nodes, slurm
from slurmddp.story import events

PERIOD_S = 10.0
DIAL_TIMEOUT_S = 5.0
WATCHERS = ("1", "2")  # the SLURM_NODEID of the agents that watch


def accepting(host: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> bool:
    """Whether something accepts a connection at `host`:`port` now (opened, then closed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def requeue(target: str) -> str | None:
    """``scontrol requeue TARGET``; None when it worked, else what scontrol said."""
    done = slurm.scontrol("requeue", target)
    return None if done.returncode == 0 else (done.stderr.strip() or f"status {done.returncode}")


def watch(environ: Mapping[str, str], host: str, port: int, *,
          answering: Callable[[str, int], bool] = accepting,
          show_job: Callable[[str], dict[str, str]] = slurm.show_job,
          show_nodes: Callable[[str], dict[str, str]] = slurm.show_nodes,
          requeuing: Callable[[str], str | None] = requeue,
          sleep: Callable[[float], None] = time.sleep, rounds: int | None = None) -> str | None:
    """Watch the rendezvous at `host`:`port` (see the module's docstring) until this agent has
    requeued the job (the line that says so) or the job no longer runs (None); `rounds` bounds
    the periods (tests)."""
    job_id = environ.get("SLURM_JOB_ID", "")
    done = 0
    while rounds is None or done < rounds:
        done += 1
        if not answering(host, port):
            job = show_job(job_id)  # {} where Slurm does not answer: this node may be the cut one
            batch = job.get("BatchHost", "")
            if job and job.get("JobState") != "RUNNING":
                return None
            state = show_nodes(batch).get(batch, "") if batch else ""
            if nodes.not_responding({batch: state}):
                target = decision.requeue_target(environ) or job_id
                said = (f"the batch host {batch} is lost ({state}), and with it torchrun's "
                        "rendezvous; Slurm keeps the job without its batch script (--no-kill)")
                refused = requeuing(target)
                if refused is not None:
                    return f"{said}: scontrol requeue {target} failed: {refused}"
                return f"{said}: requeued, to resume from its checkpoint on other nodes"
        sleep(PERIOD_S)
    return None


def linger(watcher: threading.Thread, config: Callable[[], str] = lambda: _config()) -> None:
    """Keep this agent, whose torchrun failed on its lost rendezvous, alive while `watcher`
    decides: at most twice ``SlurmdTimeout`` (10 minutes where it cannot be read), by which time
    Slurm has marked a lost batch host; a batch host Slurm keeps (its store alone ended) costs
    the run's end that long."""
    m = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", config(), re.MULTILINE)
    watcher.join(2 * int(m.group(1)) if m and int(m.group(1)) > 0 else 600)


def _config() -> str:
    return slurm.scontrol("show", "config").stdout


def start(environ: Mapping[str, str], endpoint: str | None, backend: str, node: str
          ) -> threading.Thread | None:  # fmt: skip
    """`watch`'s thread in this agent, where it is a watcher of a c10d rendezvous at `endpoint`
    (HOST:PORT) in a Slurm job; None elsewhere."""
    host, _, port = (endpoint or "").rpartition(":")
    if (backend != "c10d" or not host or not port.isdigit()
            or environ.get("SLURM_NODEID") not in WATCHERS
            or not environ.get("SLURM_JOB_ID", "").isdigit()):  # fmt: skip
        return None

    def run() -> None:
        line = watch(environ, host, int(port))
        if line is not None:
            print(f"slurmddp: agent (host {node}): {line}", file=sys.stderr, flush=True)
            events.emit("agent", environ, line=f"agent (host {node}): {line}")

    thread = threading.Thread(target=run, name="slurmddp-batch-host", daemon=True)
    thread.start()
    return thread

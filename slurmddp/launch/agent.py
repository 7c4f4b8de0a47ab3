"""``python -m slurmddp.agent [torchrun options] ...``: torchrun that passes the stop signal on.

srun delivers the stop signal (USR2) to every task of the step. Under the torchrun launcher the
task is torchrun's agent, for which USR2 is fatal; and its workers run in sessions of their own,
so a scheduler that signals by process group would never reach them. This agent catches the
signal and relays it to its direct children, the workers, which stop together at a step
boundary (slurmddp.preemption).

A ``--rdzv-endpoint`` given without a port gets one derived from the job and step ids, as
MASTER_PORT is (`env.derive_port`): a fixed port would let a second job whose first node
is shared join the first job's rendezvous. A node whose rendezvous beats stop (lost, or gone
silent) sends the other agents back to the rendezvous at once (`restart_when_a_peer_is_lost`);
a lost batch host, and the rendezvous with it, gets the job requeued by an agent that survived
it (`slurmddp.launch.stranded`).
torchrun's log directory, when the workers' logs do not go there, leaves nothing behind:
torch makes one in /tmp per agent and run (``torchelastic_*``) and keeps it, empty, forever.
Everything else is torchrun's (torch.distributed.run).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from slurmddp import patches
from slurmddp.errors import EnvError
from slurmddp.launch import network, stranded
from slurmddp.preemption import signals
from slurmddp.protocol import NODES_LOST_FILE_VAR, NOT_REQUEUED_STATUS
from slurmddp.rank.env import derive_port, port_range
from slurmddp.rank.variables import Vars
from slurmddp.story import events


def children(pid: int, proc: str = "/proc") -> list[int]:
    """The pids whose parent is `pid`, read from /proc/<pid>/stat."""
    found = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone since listdir
        # Field 4 is the parent pid; field 2, the name in parentheses, may hold spaces.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _relay(signum: int, frame: object) -> None:
    for child in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # exited since
            os.kill(child, signum)


def with_rdzv_port(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """`argv` with a port added to a ``--rdzv-endpoint`` that has none (inside a Slurm job)."""
    args = list(argv)
    job = environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return args
    try:
        step = Vars(environ).step_id()
    except EnvError:  # not a number: the port of step 0, as for none
        step = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        for option in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg == option and i + 1 < len(args):
                index, value, prefix = i + 1, args[i + 1], ""
            elif arg.startswith(option + "="):
                index, value, prefix = i, arg.split("=", 1)[1], option + "="
            else:
                continue
            if value and ":" not in value.rsplit("]", 1)[-1]:
                port = derive_port(int(job), step[0] if step else 0, port_range(environ))
                args[index] = f"{prefix}{value}:{port}"
            return args
    return args


def _option(args: Sequence[str], *names: str) -> str | None:
    """The value of the first of `names` in `args` (``--name value`` or ``--name=value``)."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def with_rdzv_conf(argv: Sequence[str], environ: Mapping[str, str], timeout_s: float) -> list[str]:
    """`argv` with torchrun's ``--rdzv-conf``: the join timeout is the start-up timeout
    ($SLURMDDP_STARTUP_TIMEOUT); a lost node is known after 6 s without its beat; a round with
    fewer nodes than the maximum waits 10 s for more (torch: 30 s); under c10d
    inside a Slurm step, the store's host is the agent of the endpoint's node, by name. torch
    guesses it from addresses instead, which fails where node names and host names differ, and
    where several nodes share a host (each then thinks it is the one). Options that give a
    ``--rdzv-conf`` of their own are left as they are."""
    args = list(argv)
    if _option(args, "--rdzv-conf", "--rdzv_conf") is not None:
        return args  # (a script's own option of that name counts too: rare, and harmless)
    # A lost node leaves the rendezvous once its keep-alive beats stop: 2 s apart, 3 missed (6 s;
    # torch's 5 s x 3 would hold every restart 15 s).
    # A round that has its minimum but not its maximum (the survivors of a loss, or nodes slow to
    # start) waits 10 s for more: a node that comes later joins at the next change.
    conf = (f"join_timeout={timeout_s:g},last_call_timeout=10,keep_alive_interval=2,"
            "keep_alive_max_attempt=3")  # fmt: skip
    endpoint = _option(args, "--rdzv-endpoint", "--rdzv_endpoint")
    node = environ.get("SLURMD_NODENAME")
    backend = _option(args, "--rdzv-backend", "--rdzv_backend") or "static"
    if backend == "c10d" and endpoint and node:
        conf += f",is_host={str(hosts_store(endpoint.rsplit(':', 1)[0], node, environ)).lower()}"
    return [f"--rdzv-conf={conf}", *args]


def reach_rendezvous(args: Sequence[str], environ: Mapping[str, str]) -> None:
    """An agent that does not host torchrun's c10d store fails at once where the endpoint has no
    address or no route from its node, or once its host stayed silent `network.SILENCE_S`: not
    after the join timeout."""
    endpoint = _option(args, "--rdzv-endpoint", "--rdzv_endpoint") or ""
    backend = _option(args, "--rdzv-backend", "--rdzv_backend") or "static"
    node = environ.get("SLURMD_NODENAME")
    host, _, port = endpoint.rpartition(":")
    if backend != "c10d" or not node or not port.isdigit() or hosts_store(host, node, environ):
        return
    address = network.resolve(host)
    try:
        if address is None:
            raise network.Unreachable("it has no address here")
        network.reach(address, int(port))
    except network.Unreachable as e:
        raise SystemExit(f"slurmddp: agent (host {node}): cannot reach torchrun's rendezvous at "
                         f"{endpoint}{f' ({address})' if address else ''}: {e}; give "
                         "--rdzv-endpoint a name of the first node on a network every node "
                         "reaches") from None  # fmt: skip


def hosts_store(host: str, node: str, environ: Mapping[str, str]) -> bool:
    """Whether the agent of `node` hosts the c10d store at `host`: the endpoint's node, by name;
    where several nodes of the step bear that name (``--local``'s, all localhost), the first of
    them (by SLURM_NODEID), as it is the first node's agent on a cluster."""
    if host != node:
        return False
    from slurmddp.rank import hostlist

    try:
        names = hostlist.expand(environ.get("SLURM_STEP_NODELIST")
                                or environ.get("SLURM_JOB_NODELIST", ""))  # fmt: skip
    except hostlist.HostlistError:
        return True
    index = environ.get("SLURM_NODEID", "")
    if names.count(node) < 2 or not index.isdigit():
        return True
    return names.index(node) == int(index)


def lost_a_node(state: Any, size: int) -> bool:
    """Whether a rendezvous `state` (torch's) that completed a round of `size` nodes, still
    open, has fewer of them now."""
    return bool(state.complete and not state.closed and len(state.participants) < size)


def full(state: Any, max_nodes: int) -> bool:
    """Whether a rendezvous `state` (torch's) completed a round with as many nodes as it takes:
    a node in its wait list cannot join before one of them is lost."""
    return bool(state.complete and len(state.participants) >= max_nodes)


_HANDLER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler"
# id(handler): how many nodes its last round completed with.
_round_sizes: dict[int, int] = {}


def _state(handler: Any) -> Any:
    # torch's private state: where a later torch renames it, torch's own behaviour stays.
    return getattr(getattr(handler, "_state_holder", None), "state", None)


def _noting_the_round(joined: Any) -> Any:
    def next_rendezvous(self: Any) -> Any:
        info = joined(self)
        _round_sizes[id(self)] = len(getattr(_state(self), "participants", ()))
        return info

    return next_rendezvous


def _counting_a_lost_node(waiting: Any) -> Any:
    def num_nodes_waiting(self: Any) -> int:
        count = waiting(self)  # (synchronises the state, dropping nodes whose beats stopped)
        now = _state(self)
        if now is None:
            return count
        if not lost_a_node(now, _round_sizes.get(id(self), 0)):
            settings = getattr(self, "_settings", None)
            if count and settings is not None and full(now, settings.max_nodes):
                return 0
            return count
        for worker in children(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        from slurmddp.launch.startup import host_name

        events.emit("agent", line=f"agent (host {host_name()}): a node of the round was lost: "
                                  "its workers go back to the rendezvous")  # fmt: skip
        return max(count, 1)

    return num_nodes_waiting


ROUND_SIZE = patches.Patch(
    f"{_HANDLER}.next_rendezvous",
    why="notes how many nodes each round completed with, for num_nodes_waiting",
    by="slurmddp.agent",
    make=_noting_the_round,
)
LOST_NODE = patches.Patch(
    f"{_HANDLER}.num_nodes_waiting",
    why="a round that lost a node sends the agents back to the rendezvous (torch restarts "
    "workers only for a node that waits to join), and a node waiting on a full round does not",
    by="slurmddp.agent",
    make=_counting_a_lost_node,
)


def restart_when_a_peer_is_lost() -> None:
    """Make torchrun's agents restart their workers when a node of their round is lost.

    torch drops a node from the rendezvous once its keep-alive beats stop, but an agent whose
    workers run restarts them only when a node waits to join (a spare). Without one, the
    survivors' workers wait on the lost node's, forever where its machine went silent (no
    connection reset: a crash, a cut link) and rank 0's store and hang watchdog were there.
    Counting a round that lost a node as a change of membership sends them to the
    rendezvous, which goes on with the nodes left (at least --nnodes' minimum) or gives up.
    The workers are killed first: they cannot reach a step boundary without the lost ones, and
    torchrun would give them 30 s to stop on its TERM.

    And the reverse: a node in the wait list of a round that is full (two spares, one of them
    left over once the other took a lost node's place, and joined as that round formed) is not
    a reason to restart. torch would, every time, and each new round would leave a node waiting
    again: the workers restarted every second, for good (seen with --spare-nodes 2). It joins
    the round after a loss.

    The patches `ROUND_SIZE` and `LOST_NODE` (`slurmddp.patches`), in the agent's process."""
    patches.apply(ROUND_SIZE)
    patches.apply(LOST_NODE)


def _say(said: str, requeued: bool) -> None:
    """What `stranded` did, in the agent's log and the job's events."""
    from slurmddp.launch.startup import host_name

    line = f"slurmddp: agent (host {host_name()}): {said}"
    print(line, file=sys.stderr, flush=True)
    events.emit("agent", line=line.removeprefix("slurmddp: "), host=host_name(),
                requeued=requeued)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    # Workers are born with the stop signal blocked, so it cannot end one before its runner
    # takes it; the relay then reaches them as a pending signal at the latest.
    signals.route(signals.stop_signal(os.environ), _relay)
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import main as torchrun

    from slurmddp.launch.startup import host_name, startup_timeout

    # Each rendezvous round gets a store of its own (rank 0's worker serves it, on a port the
    # round's agents agree on). torchrun's default shares the agents' store with the workers
    # across rounds, under the same keys: a restarted worker then reads a dead one's address
    # (gloo's full mesh), and a spare that joins in a later round counts other restarts.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    restart_when_a_peer_is_lost()
    timeout_s = startup_timeout(os.environ)
    args = with_rdzv_conf(with_rdzv_port(sys.argv[1:] if argv is None else argv, os.environ),
                          os.environ, timeout_s)  # fmt: skip
    reach_rendezvous(args, os.environ)
    if (_option(args, "--rdzv-backend", "--rdzv_backend") or "static") == "c10d":
        stranded.start(os.environ, _option(args, "--rdzv-endpoint", "--rdzv_endpoint") or "", _say)
    # Given first, so that a --log-dir of the user's, later, wins (argparse keeps the last).
    log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        torchrun([f"--log-dir={log_dir}", *args])
    except AttributeError as e:
        # torch 2.13: a spare's agent, still waiting when the others' work ends and closes the
        # rendezvous, gets None from its run and torchrun fails reading it (launch_agent).
        if "is_failed" not in str(e):
            raise
        print(f"slurmddp: agent (host {host_name()}): a spare, released: the rendezvous closed",
              file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(0) from None
    except RendezvousConnectionError:
        stranded.after_lost_rendezvous(os.environ, _say)
        raise
    except RendezvousTimeoutError:
        # Too few nodes came back after a loss (or at the start) for --nnodes' minimum: the
        # supervisor's decision requeues the job (slurmddp.preemption.decision).
        line = (f"slurmddp: agent (host {host_name()}): fewer nodes than the minimum joined "
                f"torchrun's rendezvous within {timeout_s:g} s")  # fmt: skip
        print(line, file=sys.stderr, flush=True)
        events.emit("agent", line=line.removeprefix("slurmddp: "))
        path = os.environ.get(NODES_LOST_FILE_VAR)
        if path:
            with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        raise SystemExit(NOT_REQUEUED_STATUS) from None
    finally:
        remove_empty_dirs(log_dir)


def remove_empty_dirs(root: str) -> None:
    """`root` and the directories under it that hold no file (a worker's redirected output or
    error report is kept, where torchrun keeps it)."""
    for directory, _, _ in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(directory)

"""A batch host cut off from the controller ends its own run before its link comes back.

When a node stops answering slurmctld for ``SlurmdTimeout``, Slurm marks it DOWN and requeues
its jobs: the next run starts on other nodes, with the same job id and step ids counted from 0
again. The processes of the cut node live on, unaware. If that node was the batch host, its srun
(or mpirun) and rank 0 outlive the run; once the link is back, srun's ``--kill-on-bad-exit``
cancels "step 0" of the job, which is now the next run's, and rank 0's lines land in the next
run's log. So the supervisor watches the route to slurmctld (`cut_for`: the kernel's route to
its addresses, looked up once; no packet sent, no RPC) and, once Slurm has taken the job
(``SlurmdTimeout`` and a ping round without a route: `GRACE`), fences its run: it kills the step
and this node's tasks of the run (`tasks_of`), says so, and exits, writing nothing the next run
reads.

A partition further away (a switch, the controller's own link) leaves the route in place: Slurm
still requeues the job, and the processes of the batch host meet the next run's only if they
reach the controller before slurmd is told to end them when it registers again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from slurmddp.launch import network

PERIOD_S = 5.0  # how often the route is looked at: a fence comes at most this late
# Slurm takes a node's jobs from it at the first ping round (every third of SlurmdTimeout) after
# SlurmdTimeout without an answer: a link back within that round keeps the job, which a fence
# at SlurmdTimeout itself would have ended. So the fence waits half as long again.
GRACE = 1.5

_HOST = re.compile(r"^SlurmctldHost\[\d+\]\s*=\s*(\S+)", re.MULTILINE)
_TIMEOUT = re.compile(r"^SlurmdTimeout\s*=\s*(\d+)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Controller:
    """Where slurmctld is (its hosts, the backups after the primary), and how long Slurm lets a
    node go without answering before it takes the node's jobs from it."""

    hosts: tuple[str, ...]
    slurmd_timeout_s: float


def controller(config: str) -> Controller | None:
    """The controller of ``scontrol show config``'s text; None without a host or a timeout (a
    stand-in of scontrol, a timeout of 0: Slurm never gives up on a node)."""
    # "name(address)": the address when given, as slurmd uses it, else the name.
    hosts = tuple(m.group(1).partition("(")[2].rstrip(")") or m.group(1).partition("(")[0]
                  for m in _HOST.finditer(config))  # fmt: skip
    timeout = _TIMEOUT.search(config)
    if not hosts or timeout is None or int(timeout.group(1)) == 0:
        return None
    return Controller(hosts, float(timeout.group(1)))


def addresses(where: Controller, resolve: Callable[[str], str | None] = network.resolve
              ) -> tuple[str, ...]:  # fmt: skip
    """The controller's IPv4 addresses, looked up once: a name server that fails later must not
    look like a cut link. Empty when none resolves (nothing is then watched)."""
    return tuple(a for a in map(resolve, where.hosts) if a)


def routed(addresses: Iterable[str], route: Callable[[str], str | None] = network.route) -> bool:
    """Whether the kernel has a route to one of `addresses`."""
    return any(route(address) is not None for address in addresses)


def cut_for(timeout_s: float, has_route: Callable[[], bool], *,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> float:  # fmt: skip
    """Block until `has_route()` has been false for `timeout_s` (SlurmdTimeout); the seconds it
    lasted."""
    last = clock()
    while True:
        if has_route():
            last = clock()
        elif clock() - last >= timeout_s:
            return clock() - last
        sleep(PERIOD_S)


def tasks_of(job: str, restart: str, node: str, environs: Mapping[int, Mapping[str, str]],
             spare: Iterable[int]) -> list[int]:  # fmt: skip
    """The pids of `environs` that are the job's tasks (and their children) of run `restart` on
    `node`, but those in `spare` (this process and the batch shell): pure."""
    keep = set(spare)
    return sorted(pid for pid, env in environs.items()
                  if pid not in keep and env.get("SLURM_JOB_ID") == job
                  and env.get("SLURM_RESTART_COUNT", "0") == restart
                  and env.get("SLURMD_NODENAME") == node and "SLURM_STEP_ID" in env)  # fmt: skip


def environs() -> dict[int, dict[str, str]]:
    """{pid: environment} of the processes this user may read."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                raw = (proc / "environ").read_bytes().decode(errors="replace")
                out[int(proc.name)] = dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)
    return out


def watch(where: Controller, on_cut: Callable[[float], None]) -> threading.Thread | None:
    """A daemon thread that calls `on_cut(seconds)` once no route to the controller has been
    there for `GRACE` times SlurmdTimeout; None when no address of it resolves."""
    found = addresses(where)
    if not found:
        return None
    thread = threading.Thread(
        target=lambda: on_cut(cut_for(GRACE * where.slurmd_timeout_s, lambda: routed(found))),
        name="slurmddp-fence", daemon=True)  # fmt: skip
    thread.start()
    return thread


def parents() -> dict[int, int]:
    """{pid: its parent's pid} of every process, from one look at /proc (``stat``)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # After the command's name, which may hold spaces and parentheses: state, ppid.
                stat = (proc / "stat").read_text().rpartition(")")[2]
                found[int(proc.name)] = int(stat.split()[1])
    return found


def descendants(pid: int) -> list[int]:
    """`pid`'s children, theirs and so on."""
    children: dict[int, list[int]] = {}
    for child, parent in parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each of `pids` still there, all stopped first: none may act once its run is
    fenced, nor on another's end (srun's shepherd, a child of srun, cancels the step by its id
    once srun is gone: the id the next run's step may have). Each dies after its descendants
    among them: a process group whose last parent outside it dies while members of it are
    stopped is woken by the kernel (SIGHUP, then SIGCONT), an srun there among them."""
    pids = list(dict.fromkeys(pids))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
    parent, among = parents(), set(pids)

    def depth(pid: int) -> int:
        seen = {pid}
        while (pid := parent.get(pid, 0)) in among and pid not in seen:
            seen.add(pid)
        return len(seen)

    for pid in sorted(pids, key=depth, reverse=True):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

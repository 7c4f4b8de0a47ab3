"""Which node a failed run blames, and whether the job still fits without it: pure.

A run that fails because of its node, not its script, is requeued without that node
(`slurmddp.preemption.decision` decides; the supervisor sets the job's ExcNodeList while the
requeued job waits for its begin time, the only moment Slurm lets it change). A node is blamed
when the failure looks like a machine's, never for a script's own error:

- srun saw a task of that node ended by a signal that broken hardware sends (`NODE_SIGNALS`),
  first or after others (a rank whose peer died so exits at once, and may reach srun first);
- srun aborted the step for that node: it lost the step's daemon there and the node's slurmd
  came back without it (a machine that crashed and rebooted, or a restarted slurmd, within
  ``SlurmdTimeout``): srun then ends every task of the step, ``--no-kill`` or not (`aborted`);
- a rank of that node reported an error its GPU or driver gives when broken (`NODE_ERRORS`);
- the hang watchdog's suspects all run on that node and are stuck on their own: stopped, or not
  waiting for any other rank (`slurmddp.watchdog.verdict`; a rank merely out of step with the
  others, which skipped a collective, follows the code's path on any node);
- the preflight (``--preflight``) failed there: ended by any signal, or a check of the node's
  own failed (`slurmddp.errors.NodeCheckError`).

The exclusion is bounded: the partition must keep enough nodes for the job.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

from slurmddp.errors import HostlistError, NodeCheckError
from slurmddp.rank import hostlist

# What srun prints for a task ended by SIGBUS (a memory or ECC error, a lost mapped file) and
# SIGILL (a CPU that cannot run the code it was built for). SIGSEGV and SIGKILL are left out: a
# script's own bug or the out-of-memory killer sends them, and they follow it to any node.
NODE_SIGNALS = ("Bus error", "Illegal instruction")
# What CUDA and the driver say when a GPU, not the code, is broken (lower case).
NODE_ERRORS = (
    "uncorrectable ecc error",
    "cuda-capable device(s) is/are busy or unavailable",
    "no cuda-capable device is detected",
    "gpu is lost",
    "has fallen off the bus",
)

# srun's words for the abort (22.05 to 26.05); K is the node's place in the step's node list.
_ABORT_LINE = re.compile(r"srun: error: Aborting, io error and missing step on node (?P<index>\d+)")
_SRUN_LINE = re.compile(r"srun: error: (?P<node>[^ ]+): (?P<tasks>tasks? [0-9,-]+): (?P<what>.*)")
_RANK_LINE = re.compile(r"rank (?P<rank>\S+) \(host (?P<node>[^)\s]+)\) (?P<what>.*)")


@dataclasses.dataclass(frozen=True)
class Blame:
    """The node a run's failure is laid on, and why (a clause for the log)."""

    node: str
    why: str


@dataclasses.dataclass(frozen=True)
class Failure:
    """How a step failed, from srun's first error line and the first rank's own line."""

    status: int
    seen: str | None = None  # srun's first "srun: error: NODE: task(s) N: WHAT" of this run
    reported: str | None = None  # the first line of the failure file (a rank raised or exited)
    # srun's first line of a task ended by a `NODE_SIGNALS` signal, where it is not `seen`: a rank
    # that lost its peer to the node's fault may exit, and reach srun, before the peer's end does.
    signalled: str | None = None
    aborted: str | None = None  # the node srun aborted the step for (`aborted`)

    def _seen(self) -> re.Match[str] | None:
        return _SRUN_LINE.fullmatch(self.seen.strip()) if self.seen else None

    def summary(self, what: str = "the step") -> tuple[str, ...]:
        """Which rank failed first and how, for the batch log."""
        m = self._seen()
        if self.aborted:  # srun ended every task itself: who ended first says nothing
            return (f"{what} failed with status {self.status}: srun aborted it, having lost the "
                    f"step's daemon on {self.aborted} (its slurmd came back without it: the "
                    "machine crashed and rebooted, or its slurmd restarted)",)  # fmt: skip
        lines = [f"{what} failed with status {self.status}" + (
            f"; the first to end, as srun saw it: {m['tasks']} on {m['node']} ({m['what']})"
            if m else "")]  # fmt: skip
        if self.reported:
            lines.append(f"the first failure a rank reported: {_strip(self.reported)}")
        if m and "Exited with exit code" not in m["what"]:
            lines.append(f"{m['tasks']} on {m['node']} was ended by a signal and could not report; "
                         "failures after it followed from losing it")  # fmt: skip
        elif s := self._signalled():
            lines.append(f"then {s['tasks']} on {s['node']} was ended by a signal ({s['what']}) "
                         "and could not report: the failures before it followed from losing "
                         "it")  # fmt: skip
        return tuple(lines)

    def _signalled(self) -> re.Match[str] | None:
        m = _SRUN_LINE.fullmatch(self.signalled.strip()) if self.signalled else None
        return m if m and m.group(0) != (self.seen or "").strip() else None

    def blame(self, *, preflight: bool = False) -> Blame | None:
        """The node this failure is laid on; None when it looks like the script's own.

        In the preflight any task ended by a signal blames its node (the preflight runs no code
        of the user's), and so does a rank whose own check failed (`NodeCheckError`)."""
        if self.aborted:
            return Blame(self.aborted, "srun lost the step's daemon there and aborted the step")
        m = self._seen()
        if m and "Exited with exit code" not in m["what"] and (
                preflight or any(s in m["what"] for s in NODE_SIGNALS)):  # fmt: skip
            return Blame(m["node"], f"{m['tasks']} on it ended by a signal ({m['what']})")
        if s := self._signalled():
            return Blame(s["node"], f"{s['tasks']} on it ended by a signal ({s['what']})")
        r = _RANK_LINE.match(_strip(self.reported or ""))
        if r and (f"{NodeCheckError.__name__}: " in r["what"]
                  or any(e in r["what"].lower() for e in NODE_ERRORS)):
            return Blame(r["node"], f"rank {r['rank']} on it {r['what']}")
        return None


def hang_blame(suspects: Iterable[tuple[int, str]]) -> Blame | None:
    """The node of the hang watchdog's suspects (rank, node), when they all run on one."""
    pairs = sorted(set(suspects))
    if not pairs or len({node for _, node in pairs}) != 1:
        return None
    ranks = ",".join(str(r) for r, _ in pairs)
    return Blame(pairs[0][1], f"rank{'s' if len(pairs) > 1 else ''} {ranks} on it stopped "
                 "progressing (the hang watchdog's suspect)")  # fmt: skip


# Slurm's states of a node that stopped answering it or was failed (the base state, or a flag).
_LOST_STATES = frozenset({"DOWN", "FAIL", "NOT_RESPONDING"})


def not_responding(states: Mapping[str, str]) -> list[str]:
    """The nodes of {node: Slurm's state} that Slurm lost: DOWN, FAILed or not responding."""
    return sorted((node for node, state in states.items()
                   if _LOST_STATES & set(state.upper().split("+"))), key=_natural)  # fmt: skip


def excluded_now(job: Mapping[str, str]) -> list[str]:
    """The nodes the job already excludes (its ExcNodeList), expanded."""
    text = job.get("ExcNodeList", "")
    if text in ("", "(null)"):
        return []
    try:
        return hostlist.expand(text)
    except HostlistError:
        return text.split(",")


def exclusion(node: str, job: Mapping[str, str], partition: Mapping[str, str]
              ) -> tuple[str | None, str]:  # fmt: skip
    """(the ExcNodeList that leaves `node` behind, "") when the job still fits without it, else
    (None, why not). `job` and `partition` are ``scontrol show job|partition -o``'s fields."""
    before = excluded_now(job)
    after = before if node in before else [*before, node]
    total, needed = _count(partition.get("TotalNodes")), _count(job.get("NumNodes"))
    if total is None or needed is None:
        return None, "Slurm's record does not say how many nodes the partition has"
    if total - len(after) < needed:
        return None, (f"the job needs {needed} of partition {partition.get('PartitionName', '?')}'s"
                      f" {total} nodes and would then exclude {len(after)}")  # fmt: skip
    return hostlist.compress(sorted(after, key=_natural)), ""


def _count(text: str | None) -> int | None:
    m = re.match(r"\d+", text or "")  # NumNodes may be a range, 2-4: the least is what must fit
    return int(m.group()) if m else None


def _natural(node: str) -> list[tuple[int, int, str]]:
    """n2 before n10; a number never meets a word (its tag comes first)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", node)]


def signalled(lines: Iterable[str]) -> str | None:
    """The first of srun's error lines that says a task was ended by a `NODE_SIGNALS` signal."""
    for line in lines:
        m = _SRUN_LINE.fullmatch(line.strip())
        if m and any(s in m["what"] for s in NODE_SIGNALS):
            return m.group(0)
    return None


def aborted(text: str, step_nodes: Sequence[str]) -> str | None:
    """The node of `step_nodes` (the step's, in order) that srun aborted the step for, from its
    output `text`; None where it did not, or names a node the list does not have."""
    m = _ABORT_LINE.search(text)
    index = int(m["index"]) if m else -1
    return step_nodes[index] if 0 <= index < len(step_nodes) else None


def _strip(line: str) -> str:
    return line.strip().removeprefix("slurmddp: ")

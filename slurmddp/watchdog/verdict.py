"""When a run is hung, and which ranks hold it: pure, from what the ranks wrote.

`Watch` follows the progress files: the run is hung once no rank's file has changed for the hang
timeout (changes are timed by the monitor's own clock: the nodes' clocks need not agree). It is
judged only once armed: some rank has reported progress, or the monitor was told to judge from
the rendezvous on.

`judge` names the suspects, first rule that finds any:

1. ranks that did not write their stacks when asked: their process is stopped, or holds the
   interpreter lock; every other rank waits for them;
2. ranks whose main thread is not waiting for other ranks (a sleep, a loop, a data loader) while
   others are: they hold the others;
3. ranks at a different place (progress count and where they wait) from the others, who all
   agree: e.g. a rank that skipped a collective waits in the next one, or in a checkpoint's wait.

Otherwise no rank stands out (every rank waits at the same place), and the report says so.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from slurmddp.watchdog.layout import Progress

_SHOWN = 8  # ranks named one by one in a line, at most


class Watch:
    """When the ranks last made progress, as the monitor saw it."""

    def __init__(self, timeout_s: float, now: float, from_start: bool = False) -> None:
        self.timeout_s = timeout_s
        self.armed = from_start
        self.done = False
        self.last_change = now
        self._seen: dict[int, Progress] = {}

    def observe(self, progress: Mapping[int, Progress], now: float) -> None:
        for rank, p in progress.items():
            if self._seen.get(rank) != p:
                self._seen[rank] = p
                self.last_change = now
            self.armed |= p.count > 0
            self.done |= p.done

    def idle_s(self, now: float) -> float:
        return now - self.last_change

    def hung(self, now: float) -> bool:
        return self.armed and not self.done and self.idle_s(now) >= self.timeout_s


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The suspects, and the lines that say so (for the batch log and the report)."""

    suspects: tuple[int, ...]
    lines: tuple[str, ...]
    # The suspects stuck on their own (rules 1 and 2), where their node may be the cause; not
    # those merely out of step with the others (rule 3): that is the code's path, on any node.
    stuck: tuple[int, ...] = ()


def ranks_text(ranks: Iterable[int]) -> str:
    """``0-2,5`` for ranks 0, 1, 2 and 5."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def _place(h: Mapping[str, Any]) -> str:
    return f"waiting in {h['waiting']}, from {h['site']}" if h.get("waiting") else f"in {h['site']}"


def _progress(h: Mapping[str, Any]) -> str:
    done = h.get("collectives")
    return f"progress call {h.get('count')}" + ("" if done is None else f" and collective {done}")


def _whole(h: Mapping[str, Any]) -> str:
    return f"{_progress(h)}, {_place(h)}"


def judge(world_size: int, progress: Mapping[int, Progress], dumps: Mapping[int, Mapping[str, Any]],
          idle_s: float, timeout_s: float, stacks_at: str) -> Verdict:  # fmt: skip
    """The verdict on a hung run (see the module's docstring); `dumps` holds the stack files'
    headers of the ranks that answered."""

    def node(rank: int) -> str:
        p = progress.get(rank)
        return p.node if p is not None else "an unknown node"

    ranks = range(world_size)
    silent = [r for r in ranks if r not in dumps]
    reasons: dict[int, str] = {}
    for r in silent:
        reasons[r] = ("it did not answer: its process is stopped, or holds the interpreter lock"
                      if r in progress else "it never reported after the rendezvous")  # fmt: skip
    if not reasons:
        waiting = [r for r in ranks if dumps[r].get("waiting")]
        if waiting:
            for r in ranks:
                if r not in waiting:
                    reasons[r] = f"it is not waiting for another rank: it is {_place(dumps[r])}"
    stuck = tuple(sorted(reasons))
    if not reasons:
        places = {r: (dumps[r].get("count"), dumps[r].get("collectives"), dumps[r].get("waiting"),
                      dumps[r].get("site")) for r in ranks}  # fmt: skip
        common, n = collections.Counter(places.values()).most_common(1)[0]
        if n < world_size and n > world_size - n:  # a strict majority agrees, someone does not
            example = dumps[next(r for r in ranks if places[r] == common)]
            for r in ranks:
                if places[r] != common:
                    reasons[r] = (f"it is at {_progress(dumps[r])}, {_place(dumps[r])}, while "
                                  f"the others are at {_progress(example)}, {_place(example)}")
    lines = [f"slurmddp: no rank made progress for {idle_s:.0f} s (hang timeout {timeout_s:g} s): "
             "the run is judged hung"]  # fmt: skip
    for r, why in sorted(reasons.items()):
        lines.append(f"slurmddp: rank {r} on {node(r)} stopped progressing: {why}")
    others = [r for r in ranks if r not in reasons]
    if reasons and others:
        lines.append(f"slurmddp: rank{'s' if len(others) > 1 else ''} {ranks_text(others)} "
                     f"merely wait{'s' if len(others) == 1 else ''} for "
                     f"{'it' if len(reasons) == 1 else 'them'}")  # fmt: skip
    elif len({_whole(h) for h in dumps.values()}) == 1:
        lines.append("slurmddp: no rank stands out: every rank is at the same place "
                     f"({_whole(next(iter(dumps.values())))}), so none can be named as the cause")
    else:
        shown = [f"rank {r}: {_whole(dumps[r])}" for r in sorted(dumps)[:_SHOWN]]
        lines.append("slurmddp: no rank stands out (no majority is at the same place): "
                     + "; ".join(shown) + ("; ..." if len(dumps) > _SHOWN else ""))
    lines.append(f"slurmddp: the stacks of every rank that answered: {stacks_at}")
    return Verdict(tuple(sorted(reasons)), tuple(lines), stuck)

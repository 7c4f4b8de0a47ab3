"""Pure rules of the snapshots: which rank keeps whose replica, and from what the ranks resume.

Nothing here reads a file or talks to a peer: node names and inventories in, a frozen answer out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurmddp.checkpoint.snapshots.store import Shard


def replica_keepers(nodes: Sequence[str]) -> dict[int, int]:
    """{rank: the rank that keeps its replica}, `nodes[r]` being rank r's node.

    Each node's ranks send to the ranks of the next node (in the order the nodes first appear),
    the i-th to its i-th (wrapping round a node with fewer); with one node there is none.
    """
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return {}
    ranks_on: dict[str, list[int]] = {node: [] for node in order}
    for rank, node in enumerate(nodes):
        ranks_on[node].append(rank)
    keepers = {}
    for i, node in enumerate(order):
        after = ranks_on[order[(i + 1) % len(order)]]
        for j, rank in enumerate(ranks_on[node]):
            keepers[rank] = after[j % len(after)]
    return keepers


@dataclass(frozen=True)
class Fetch:
    """`receiver` gets `shard` from `sender`, whose node holds it."""

    shard: Shard
    sender: int
    receiver: int


@dataclass(frozen=True)
class Recovery:
    """Resume at `step`: rank r loads `shards[r]` (all of one incarnation), from its own node or
    by `fetches`."""

    step: int
    shards: tuple[Shard, ...]
    fetches: tuple[Fetch, ...]


def candidates(held: Mapping[str, Sequence[Shard]], nodes: Sequence[str],
               newer_than: int | None) -> tuple[list[Recovery], str]:  # fmt: skip
    """Every snapshot after step `newer_than` whose shards the ranks need are all on the nodes in
    `held` ({node: its shards}), newest first, with how each rank gets its own; and why the
    newest snapshot newer than all of them is incomplete ("" when none is).

    A snapshot is the shards of one step, world and incarnation (`Shard.inc`): the shards of two
    incarnations at one step never make one set. At one step the larger incarnation comes first;
    every rank computes the same list from the same inventories. The caller tries them in order
    (a shard whose checksum fails: the next one).

    `nodes[r]` is the node of rank r now. Rank r loads the shard of rank r of the snapshot's
    world, or rank 0's where that world was smaller; a snapshot of a larger world needs only the
    shards of the ranks that remain. A shard comes from the rank's own node when that holds it,
    else from the first rank on a node that holds it. A snapshot with two different shards of
    one rank (not taken as one) is none.
    """
    holders: dict[Shard, list[str]] = {}
    for node, shards in held.items():
        for shard in shards:
            holders.setdefault(shard, []).append(node)
    sets: dict[tuple[int, int, int], dict[int, set[Shard]]] = {}
    for s in holders:
        if newer_than is None or s.step > newer_than:
            sets.setdefault((s.step, s.inc, s.world), {}).setdefault(s.rank, set()).add(s)
    found: list[Recovery] = []
    why, why_step = "", -1
    for step, inc, world in sorted(sets, reverse=True):
        wanted = [r if r < world else 0 for r in range(len(nodes))]
        ranks = sets[step, inc, world]
        missing = sorted({r for r in wanted if r not in ranks})
        if missing or any(len(ranks[r]) > 1 for r in wanted):
            if missing and not why:
                why_step = step
                why = (f"the snapshot of step {step} lacks the shards of rank"
                       f"{'s' if len(missing) > 1 else ''} {_ranks(missing)} (lost with their "
                       "nodes)")  # fmt: skip
            continue
        shards = tuple(next(iter(ranks[r])) for r in wanted)
        fetches = []
        for rank, shard in enumerate(shards):
            on = holders[shard]
            if nodes[rank] in on:
                continue
            sender = next(r for r, node in enumerate(nodes) if node in on)
            fetches.append(Fetch(shard, sender, rank))
        found.append(Recovery(step, shards, tuple(fetches)))
    # An incomplete one at the step of a complete one is not why that one was not taken.
    return found, "" if found and why_step <= found[0].step else why


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:6]))
    return shown + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")

"""Pure rules of the snapshots: which rank keeps whose replica, and from what the ranks resume.

Nothing here reads a file or talks to a peer: node names and inventories in, a frozen answer out.
"""

from __future__ import annotations

import dataclasses
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
    """`receiver` gets the file of `shard` (a rank's, or the base a rank's part completes) from
    `sender`, whose node holds it."""

    shard: Shard
    sender: int
    receiver: int


@dataclass(frozen=True)
class Recovery:
    """Resume at `step`: rank r loads `shards[r]` (all of one incarnation), over `bases[r]` where
    that is a part (None: a full shard), each file from its own node or by `fetches`."""

    step: int
    shards: tuple[Shard, ...]
    fetches: tuple[Fetch, ...]
    bases: tuple[Shard | None, ...] = ()

    def files(self, rank: int) -> list[Shard]:
        """The files rank `rank` reads: its shard, and its base where that is a part."""
        base = self.bases[rank] if rank < len(self.bases) else None
        return [self.shards[rank]] + ([base] if base is not None else [])


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
    shards of the ranks that remain. A part (`Shard.part`) counts only with its base, the full
    shard of its `base` rank in the same snapshot (a rank below it: one the snapshot needs in any
    case). Each file a rank reads comes from the rank's own node when that holds it, else from
    the first rank on a node that holds it (a part and its base may come from two). A snapshot
    with two different shards of one rank (not taken as one) is none.
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
        chosen = {r: next(iter(ranks[r])) for r in set(wanted) if len(ranks.get(r, ())) == 1}
        bases: dict[int, Shard | None] = {}
        for r, shard in sorted(chosen.items()):
            base = chosen.get(shard.base) if shard.part else None
            if shard.part and (base is None or base.part):  # it cannot be rebuilt
                del chosen[r]
            else:
                bases[r] = base
        # Absent, or a part that cannot be rebuilt (two shards of a rank: no snapshot, unsaid).
        missing = sorted({r for r in wanted if r not in ranks or (r not in chosen
                                                                  and len(ranks[r]) == 1)})
        if missing or len(chosen) < len(set(wanted)):
            if missing and not why:
                why_step = step
                why = (f"the snapshot of step {step} lacks the shards of rank"
                       f"{'s' if len(missing) > 1 else ''} {_ranks(missing)} (lost with their "
                       "nodes)")  # fmt: skip
            continue
        recovery = Recovery(step, tuple(chosen[r] for r in wanted), (),
                            tuple(bases[r] for r in wanted))  # fmt: skip
        fetches = []
        for rank in range(len(nodes)):
            for shard in recovery.files(rank):
                on = holders[shard]
                if nodes[rank] not in on:
                    sender = next(r for r, node in enumerate(nodes) if node in on)
                    fetches.append(Fetch(shard, sender, rank))
        found.append(dataclasses.replace(recovery, fetches=tuple(fetches)))
    # An incomplete one at the step of a complete one is not why that one was not taken.
    return found, "" if found and why_step <= found[0].step else why


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:6]))
    return shown + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")

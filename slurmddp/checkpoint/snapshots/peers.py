"""Shards between ranks: point-to-point over gloo groups of their own, so that a replica goes to
another node beside the training's collectives (NCCL's or gloo's), from a background thread.

Two groups, because a transfer that times out closes its group's connections: the transfers'
(`exchange`, from the background thread, every wait bounded) is rebuilt after an error, and the
training thread's agreements (`largest`, `all_gather_json`) run on one the transfers never touch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
from collections.abc import Sequence
from typing import Any

import torch

from slurmddp.checkpoint.snapshots.store import Shard

# A shard's header: step, rank, world, incarnation, crc32, size, base (`Shard`'s fields); a size
# below 0 says the sender has no shard this time (its snapshot failed), and nothing follows.
HEADER = 7
NO_SHARD = -1
_SIZE = 5


def header(shard: Shard | None) -> torch.Tensor:
    """What a peer is told of `shard` (None: the sender has none this time)."""
    if shard is None:
        fields = [0] * HEADER
        fields[_SIZE] = NO_SHARD
        return torch.tensor(fields, dtype=torch.int64)
    return torch.tensor(dataclasses.astuple(shard), dtype=torch.int64)


def shard_of(head: torch.Tensor) -> Shard | None:
    """The shard a peer's `header` names; None when it has none."""
    fields = [int(v) for v in head.tolist()]
    return None if fields[_SIZE] < 0 else Shard(*fields)


def side_group() -> Any:
    """A new gloo group of every rank (collective: every rank creates it at the same call)."""
    import torch.distributed as td

    return td.new_group(backend="gloo")


def drop(group: Any) -> None:
    """Close `group`'s connections (a transfer's error left them closed or stuck)."""
    import torch.distributed as td

    with contextlib.suppress(Exception):  # already closed on this side: nothing left to free
        td.destroy_process_group(group)


def exchange(group: Any, sends: Sequence[tuple[int, torch.Tensor]],
             receives: Sequence[tuple[int, torch.Tensor]], timeout: float) -> None:  # fmt: skip
    """Send each (peer, tensor) and fill each (peer, buffer) from its peer; returns when all are
    done, raises when one is not done within `timeout` seconds (then `group` is unusable: gloo
    closes the pair). Peers are ranks of the default group (the side group holds them all)."""
    import torch.distributed as td

    ops = [td.P2POp(td.isend, tensor, peer, group) for peer, tensor in sends]
    ops += [td.P2POp(td.irecv, buffer, peer, group) for peer, buffer in receives]
    if ops:
        wait = datetime.timedelta(seconds=timeout)
        for request in td.batch_isend_irecv(ops):
            request.wait(wait)


def largest(group: Any, values: Sequence[int]) -> list[int]:
    """The largest of every rank's `values`, each (collective over `group`)."""
    import torch.distributed as td

    tensor = torch.tensor(list(values), dtype=torch.int64)
    td.all_reduce(tensor, op=td.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]


def all_gather_json(group: Any, value: Any) -> list[Any]:
    """Every rank's `value` (anything JSON holds; tuples come back as lists), in rank order
    (collective over `group`). Not torch's all_gather_object: that needs numpy, which neither
    torch nor slurmddp installs, and unpickles what the peers send."""
    import torch.distributed as td

    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = td.get_world_size(group)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    td.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(size.item()) for size in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    td.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(n.item())].tolist()).decode())
            for g, n in zip(gathered, sizes, strict=True)]  # fmt: skip


def as_tensor(data: memoryview | bytes | bytearray) -> torch.Tensor:
    """`data` as a uint8 tensor, without a copy where it is writable."""
    if isinstance(data, bytes):
        data = bytearray(data)
    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)

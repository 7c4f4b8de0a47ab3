"""`ResumableDistributedSampler`: torch's DistributedSampler that can start mid-epoch.

An epoch has one global order: the permutation of torch.Generator seeded with ``seed + epoch``
(or ``range`` without shuffling). Rank ``r`` of ``W`` yields every W-th entry of that order from
``start + r``, where `start` counts the samples all ranks together consumed this epoch. From
``start == 0`` this is exactly what DistributedSampler yields for the same arguments.

Epoch end: the samples left after `start` are padded by repeating their own head (or, with
``drop_last``, truncated) to a multiple of the world size *at the time of the resume*, so every
rank yields the same number of samples whatever the world size was when the checkpoint was taken.
Resuming at another world size therefore continues with the first sample not yet consumed and
visits each remaining sample once; only the padding (fewer than W repeats) or the dropped tail
(fewer than W samples) depends on the new world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    """Drop-in for torch.utils.data.DistributedSampler with `state_dict`/`load_state_dict`.

    `num_replicas` and `rank` default to the process group's, or 1 and 0 without one.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            import torch.distributed as td

            grouped = td.is_available() and td.is_initialized()
            if num_replicas is None:
                num_replicas = td.get_world_size() if grouped else 1
            if rank is None:
                rank = td.get_rank() if grouped else 0
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")  # fmt: skip
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0
        # A position restored by load_state_dict, kept by the next set_epoch of that epoch.
        self._resume: tuple[int, int] | None = None

    def set_epoch(self, epoch: int, start: int | None = None) -> None:
        """Start `epoch` at global sample `start`.

        `start` omitted: 0, except right after `load_state_dict` for the same epoch, where the
        restored position is kept; so the usual ``sampler.set_epoch(epoch)`` at the top of the
        epoch loop does not throw a resume away.
        """
        if start is None:
            start = self._resume[1] if self._resume and self._resume[0] == epoch else 0
        if start < 0:
            raise ValueError(f"start must be >= 0, not {start}")
        self._resume = None
        self.epoch = epoch
        self.start = start

    def state_dict(self, consumed: int) -> dict[str, Any]:
        """The position to resume from; `consumed` = global samples consumed so far this epoch.

        From `start`, a loop that ran S steps of B samples per rank since `set_epoch` has
        consumed ``start + S * B * num_replicas``.
        """
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, not {consumed}")
        return {"epoch": self.epoch, "start": int(consumed), "seed": self.seed,
                "shuffle": self.shuffle, "dataset_len": len(self.dataset)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved global position, at any world size; seed and shuffle come along."""
        saved_len = int(state["dataset_len"])
        if saved_len != len(self.dataset):
            raise ValueError(
                f"the checkpoint's sampler ran over {saved_len} samples but this dataset has "
                f"{len(self.dataset)}: the order would differ"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.set_epoch(int(state["epoch"]), int(state["start"]))
        self._resume = (self.epoch, self.start)

    def global_order(self) -> list[int]:
        """This epoch's order of dataset indices, before any padding."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _remaining(self) -> list[int]:
        """Global order from `start`, padded or truncated to a multiple of num_replicas."""
        rest = self.global_order()[self.start:]
        extra = len(rest) % self.num_replicas
        if self.drop_last:
            return rest[: len(rest) - extra]
        if extra and rest:
            pad = self.num_replicas - extra
            # As DistributedSampler: repeat the head, as many times as it takes.
            rest += (rest * math.ceil(pad / len(rest)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        left = max(len(self.dataset) - self.start, 0)
        if self.drop_last:
            return left // self.num_replicas
        return math.ceil(left / self.num_replicas)

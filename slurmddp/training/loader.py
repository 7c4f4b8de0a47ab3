"""Exact data loading: a DataLoader's randomness comes from (seed, epoch, sample), never from the
training's random stream, and a resumed epoch skips its consumed batches without fetching them.

Why: torch's DataLoader draws a base seed from the global generator every time an iterator is
made (with ``num_workers=0`` too), a RandomSampler without a generator draws another at its first
batch, and what a worker's augmentation draws depends on every sample that worker fetched before.
Restoring the random generators at a checkpoint puts none of that back, so a resumed run's
dropout and augmentation drift from the uninterrupted run's.

`install()` (run by ``slurmddp.init()``, by importing ``slurmddp.training`` and by the framework
integrations) changes every DataLoader of the process, subclasses and torchdata's
StatefulDataLoader included:

- an iterator's base seed comes from a generator seeded by (seed, epoch, rank), and a sampler
  that draws from torch's global generator (RandomSampler, SubsetRandomSampler,
  WeightedRandomSampler without a generator of their own) gets one seeded by (seed, epoch);
- before each sample is fetched, torch's CPU generator, numpy's global one and python's `random`
  are seeded by (seed, epoch, dataset index): in the worker that fetches it, or, with
  ``num_workers=0``, in the main process between a save and a restore of those generators, so
  data loading never consumes the training's stream;
- the loader counts its iterators and the batches each yielded: `state(loader)` is what
  `train_state.capture(loader=...)` saves, and `load(loader, state)` makes the next iterator
  that one again, skipping its consumed batches in the batch sampler, unfetched.

"Epoch" is the sampler's own (``set_epoch``) with the iterators made since it last changed, or,
for a sampler without one, the iterators made: a framework that rebuilds a loader to skip
batches (the Hugging Face Trainer) still sets its sampler's epoch, and the seeds follow it
(Accelerate's loaders write theirs on a sampler that keeps none: `follow_accelerate_epochs`). The
seed is ``torch.initial_seed()`` when the loader first iterates (the seed the script gave
``torch.manual_seed``, or torch's fixed default), then the checkpoint's. Augmentation therefore
differs from vanilla PyTorch's, but is the same in a resumed and an uninterrupted run, at any
``num_workers``, start method, persistence and ``prefetch_factor``, and a sample gets the same
augmentation at any world size. ``SLURMDDP_EXACT_DATA=0`` leaves DataLoaders as torch made them.
"""

from __future__ import annotations

import os
import random
import sys
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import dataloader as _dataloader
from torch.utils.data._utils import fetch as _fetch

from slurmddp import dist, protocol

_MASK = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 over each): stable across processes and Pythons."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK)) & _MASK
        h = (h + 0x9E3779B97F4A7C15) & _MASK
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
        h ^= h >> 31
    return h >> 1


# Domain tags: the base seed, a sampler's generator and the samples never share a stream.
_BASE, _SAMPLER, _SAMPLE = 1, 2, 3


def enabled() -> bool:
    """Whether DataLoaders are seeded for an exact resume ($SLURMDDP_EXACT_DATA is not 0)."""
    return os.environ.get(protocol.EXACT_DATA_VAR, "1") != "0"


class _Track:
    """One DataLoader's epochs and position."""

    def __init__(self) -> None:
        self.seed: int | None = None
        self.epoch = -1  # the epoch of the last iterator made; -1: none yet
        self.skip = 0  # batches the last iterator skipped at its start
        self.exhausted = False  # the last iterator raised StopIteration
        self.iterator: weakref.ref | None = None
        self.pending: dict | None = None  # from load(): the next iterator's epoch and position
        # The seeds' epoch: (the sampler's own epoch, iterators made since it last changed),
        # or (-1, iterators made) for a sampler without one. A framework that rebuilds the
        # loader (to skip batches, say) still sets the sampler's epoch: the seeds follow it.
        self.key = (-1, 0)
        self.sampler_epoch: int | None = None
        self.ours: torch.Generator | None = None  # the sampler generator we gave, this epoch
        self.users: torch.Generator | None = None  # a sampler's own generator, if it has one
        self.sampler_state: torch.Tensor | None = None  # and its state at this epoch's start

    def begin(self, loader: DataLoader) -> None:
        if self.epoch < 0 and self.pending is None:
            self.pending = _adopt(loader)
        if self.seed is None:
            self.seed = torch.initial_seed()
        restored_generator = None
        resumed_key = None
        if self.pending is not None:
            saved = self.pending
            self.seed = int(saved["seed"])
            self.epoch, self.skip = int(saved["epoch"]), int(saved["consumed"])
            restored_generator = saved.get("sampler_generator")
            if "key" in saved:
                key = (int(saved["key"][0]), int(saved["key"][1]))
                if saved.get("after"):  # the iterator after the saved one
                    self.sampler_epoch, self.key = key[0], key
                else:  # the saved one, resumed
                    resumed_key = key
            self.pending = None
        else:
            self.epoch, self.skip = self.epoch + 1, 0
        self.exhausted = False
        sampler = sampler_of(loader)
        live = getattr(sampler, "epoch", None)
        if resumed_key is not None:
            self.key = resumed_key
            self.sampler_epoch = resumed_key[0]
        elif not isinstance(live, int) or isinstance(live, bool):
            self.key = (-1, self.epoch)
        elif live == self.sampler_epoch:
            self.key = (live, self.key[1] + 1)
        else:
            self.sampler_epoch, self.key = live, (live, 0)
        from slurmddp.training.sampler import ResumableDistributedSampler

        if isinstance(sampler, ResumableDistributedSampler) and sampler.start > 0:
            self.skip = 0  # set_epoch(epoch, start=...) resumes it: skipping again would double
        generator: Any = getattr(sampler, "generator", _NONE)
        self.users = self.sampler_state = None
        if generator is _NONE:
            pass
        elif (generator is None or generator is loader.generator
              or generator is getattr(sampler, _GIVEN, None)):  # fmt: skip
            # It would draw its seed from the global generator (or share the loader's), or has
            # one we gave it (perhaps through another loader on the same sampler, as Accelerate's
            # skip_first_batches makes): give it one of this epoch's.
            self.ours = torch.Generator().manual_seed(mix(self.seed, _SAMPLER, *self.key))
            sampler.generator = self.ours
            setattr(sampler, _GIVEN, self.ours)
        else:  # the user's own generator: its state at the epoch's start is the epoch's order
            if restored_generator is not None:
                generator.set_state(restored_generator)
            self.users = generator
            self.sampler_state = generator.get_state()

    def state(self, loader: DataLoader) -> dict:
        """{"seed", "epoch", "consumed", "loader"}: the next iterator's epoch, the batches it
        skips, and what the loader is (for `expect`)."""
        seed = self.seed if self.seed is not None else torch.initial_seed()
        if self.pending is not None:  # loaded, not iterated since: keep what was loaded
            return dict(self.pending)
        it = self.iterator() if self.iterator is not None else None
        state: dict[str, Any] = {"seed": seed, "loader": fingerprint(loader)}
        if self.epoch < 0:
            state |= {"epoch": 0, "consumed": 0}
        elif self.exhausted:
            state |= {"epoch": self.epoch + 1, "consumed": 0, "key": list(self.key),
                      "after": True}  # fmt: skip
            if self.users is not None:  # the next epoch starts where this one left it
                state["sampler_generator"] = self.users.get_state()
        else:
            yielded = getattr(it, "_num_yielded", 0) if it is not None else 0
            state |= {"epoch": self.epoch, "consumed": self.skip + yielded,
                      "key": list(self.key)}  # fmt: skip
            if self.sampler_state is not None:
                state["sampler_generator"] = self.sampler_state
        return state


_NONE = object()
# On a sampler: the generator we gave it (torch's Generator takes no attribute, nor, before
# torch 2.9 or so, a weak reference).
_GIVEN = "_slurmddp_generator"
_TRACK = "_slurmddp_track"
# Every loader that made an iterator in this process (for the note when capture names none).
_seen: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def track(loader: DataLoader) -> _Track:
    found = loader.__dict__.get(_TRACK)
    if found is None:
        found = _Track()
        loader.__dict__[_TRACK] = found
    return found


def follow_accelerate_epochs() -> None:
    """Have Accelerate's prepared loaders write their epoch on a sampler that keeps none.

    They keep the epoch themselves (`set_epoch`, which each of their iterators also calls); a
    RandomSampler has none, so the seeds would count the iterators made, and the loader that
    `skip_first_batches` makes to resume an epoch would draw epoch 0's order (at more than one
    process, where the order comes from the sampler's generator). Written on the sampler, which
    the rebuilt loader shares, the epoch is what the seeds follow. Idempotent."""
    from accelerate import data_loader  # type: ignore[import-untyped]

    for cls in (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher):
        original = cls.__dict__.get("set_epoch")
        if original is None or getattr(original, "_slurmddp", False):
            continue

        def set_epoch(self: Any, epoch: int, _original: Any = original) -> None:
            _original(self, epoch)
            sampler = sampler_of(getattr(self, "base_dataloader", self))
            if sampler is not None and not callable(getattr(sampler, "set_epoch", None)):
                sampler.epoch = epoch

        set_epoch._slurmddp = True  # type: ignore[attr-defined]
        cls.set_epoch = set_epoch


def sampler_of(loader: DataLoader) -> Any:
    """The sampler whose order the loader's batches follow: a batch sampler's own, through
    batch samplers that wrap others (Accelerate's shards and skips)."""
    batches = loader.batch_sampler
    while batches is not None:
        inner = getattr(batches, "sampler", None)
        if inner is not None:
            return inner
        batches = getattr(batches, "batch_sampler", None)
    return loader.sampler


def state(loader: DataLoader) -> dict:
    """Where `loader` stands: the seed, the epoch of its next (or current) iterator and the
    batches of it consumed. Plain values (and a generator state tensor), for a checkpoint."""
    return track(loader).state(loader)


def load(loader: DataLoader, saved: dict) -> None:
    """Make `loader`'s next iterator the saved epoch, skipping its consumed batches unfetched."""
    track(loader).pending = _checked(saved)


def _checked(saved: dict) -> dict:
    missing = {"seed", "epoch", "consumed"} - set(saved)
    if missing:
        raise ValueError(f"a loader state needs {', '.join(sorted(missing))}")
    return dict(saved)


def fingerprint(loader: DataLoader) -> str:
    """What a loader iterates, the same for a loader a framework rebuilds around the dataset."""
    dataset = loader.dataset
    size = len(dataset) if hasattr(dataset, "__len__") else "?"
    return f"{type(dataset).__name__}[{size}] batch {loader.batch_size}"


# States for loaders not made yet (a framework builds its own from the user's, after the
# checkpoint is read): the first loader of the same fingerprint to iterate takes one.
_expected: list[dict] = []


def expect(states: list[dict]) -> None:
    """Give each saved state to the first loader with its fingerprint that makes an iterator."""
    _expected[:] = [_checked(s) for s in states]


def _adopt(loader: DataLoader) -> dict | None:
    mine = fingerprint(loader)
    for i, saved in enumerate(_expected):
        if saved.get("loader") == mine:
            return _expected.pop(i)
    return None


def tracked(loader: Any) -> bool:
    """Whether `loader` is a DataLoader that made an iterator under this module's seeding."""
    return isinstance(loader, DataLoader) and _TRACK in loader.__dict__


def seen_loaders() -> list[DataLoader]:
    return list(_seen)


def inexact(loader: DataLoader) -> list[str]:
    """Why a resume of `loader` cannot be bitwise, if it cannot: one phrase per reason."""
    reasons = []
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        reasons.append(f"{type(dataset).__name__} is an IterableDataset: its position and its "
                       "workers' streams are its own")  # fmt: skip
    if not getattr(loader, "in_order", True):
        reasons.append("in_order=False delivers batches as workers finish them")
    own = [name for name, value in getattr(dataset, "__dict__", {}).items()
           if _is_generator(value)]  # fmt: skip
    if own and not hasattr(dataset, "state_dict"):
        reasons.append(f"{type(dataset).__name__} draws from generators of its own "
                       f"({', '.join(own)}), which per-sample seeding does not reach")  # fmt: skip
    sampler = sampler_of(loader)
    if not _known_sampler(sampler):
        reasons.append(f"the sampler {type(sampler).__name__} is assumed to order an epoch by "
                       "its epoch alone")  # fmt: skip
    return reasons


def _fetches_batches(dataset: Any) -> bool:
    """Whether the fetcher hands `dataset` a whole batch (its own ``__getitems__``): a Subset's
    passes each key on unless the dataset under it fetches batches itself."""
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        return _fetches_batches(dataset.dataset)
    return bool(getattr(dataset, "__getitems__", None))


def _is_generator(value: Any) -> bool:
    if isinstance(value, random.Random | torch.Generator):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.random.Generator | np.random.RandomState)


def _known_sampler(sampler: Any) -> bool:
    from torch.utils.data import distributed
    from torch.utils.data import sampler as samplers

    from slurmddp.training.sampler import ResumableDistributedSampler

    known = (samplers.SequentialSampler, samplers.RandomSampler, samplers.SubsetRandomSampler,
             samplers.WeightedRandomSampler, distributed.DistributedSampler,
             ResumableDistributedSampler)  # fmt: skip
    return isinstance(sampler, known)


# -- what travels to the fetcher: a batch's keys with its epoch's seed -------------------------


class Seeded:
    """A batch of dataset keys (or one key) and the seed of its epoch, sent to the fetcher."""

    __slots__ = ("base", "keys")

    def __init__(self, keys: Any, base: int) -> None:
        self.keys = keys
        self.base = base

    def __reduce__(self) -> tuple:  # to a spawned worker: unpickling imports this module there
        return (Seeded, (self.keys, self.base))


def _key_number(key: Any) -> int:
    if isinstance(key, int):
        return key
    return zlib.crc32(repr(key).encode())  # str hashes differ between processes


def _seed_sample(base: int, key: Any) -> None:
    seed = mix(base, _key_number(key))
    torch.default_generator.manual_seed(seed)  # the CPU's: the training's CUDA stream is not ours
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


def _save_generators() -> tuple:
    np = sys.modules.get("numpy")
    return (torch.get_rng_state(), random.getstate(),
            np.random.get_state() if np is not None else None)  # fmt: skip


def _restore_generators(saved: tuple) -> None:
    torch_state, python_state, numpy_state = saved
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    if numpy_state is not None:
        sys.modules["numpy"].random.set_state(numpy_state)


class _Indices:
    """The loader's index sampler, seen through its epoch: skips the consumed batches, then
    sends each batch with its epoch's seed. Read again at every iterator (persistent workers
    keep this object), so it follows the loader's current epoch."""

    def __init__(self, inner: Any, track_: _Track) -> None:
        self.inner = inner
        self.track = track_

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Seeded]:
        t = self.track
        base = mix(t.seed or 0, _SAMPLE, *t.key)
        it = iter(self.inner)
        for _ in range(t.skip):  # indices only: nothing is fetched for a consumed batch
            if next(it, _NONE) is _NONE:
                return
        for keys in it:
            yield Seeded(keys, base)


# -- the patches ---------------------------------------------------------------------------------

_original: dict[str, Any] = {}


def _fetch_seeded(self: Any, index: Any) -> Any:
    if not isinstance(index, Seeded):
        return _original["fetch"](self, index)
    in_main = torch.utils.data.get_worker_info() is None
    saved = _save_generators() if in_main else None
    try:
        keys = index.keys
        if self.auto_collation:
            if _fetches_batches(self.dataset):
                _seed_sample(index.base, keys[0] if len(keys) else 0)
                data = self.dataset.__getitems__(keys)
            else:
                data = []
                for key in keys:
                    _seed_sample(index.base, key)
                    data.append(self.dataset[key])
        else:
            _seed_sample(index.base, keys)
            data = self.dataset[keys]
        return self.collate_fn(data)
    finally:
        if saved is not None:
            _restore_generators(saved)


def _index_sampler(self: DataLoader) -> Any:
    inner = _original["index_sampler"].fget(self)
    t = self.__dict__.get(_TRACK)
    if t is None or t.epoch < 0 or isinstance(self.dataset, IterableDataset) or not enabled():
        return inner
    return _Indices(inner, t)


def _iterating(original: Any) -> Any:
    """`original` (a loader class's own __iter__) under this module's epochs and seeds."""

    def __iter__(self: DataLoader) -> Any:
        return _iter(self, original)

    return __iter__


def _iter(self: DataLoader, original: Any) -> Any:
    if not enabled():
        return original(self)
    t = track(self)
    t.begin(self)
    _seen.add(self)
    persistent = self.persistent_workers and self.num_workers > 0
    # A persistent loader's workers take their base seed once: the same in every run.
    key = (0, 0) if persistent else t.key
    users = self.generator
    self.generator = torch.Generator().manual_seed(mix(t.seed or 0, _BASE, *key, dist.rank()))
    try:
        it = original(self)
    finally:
        self.generator = users
    it.__dict__[_TRACK] = t
    t.iterator = weakref.ref(it)
    return it


def _next(self: Any) -> Any:
    try:
        return _original["next"](self)
    except StopIteration:
        t = self.__dict__.get(_TRACK)
        if t is not None:
            t.exhausted = True
        raise


def install() -> None:
    """Patch torch's DataLoader as the module docstring says; idempotent."""
    if "iter" in _original:
        return
    _install_fetch()
    _original["iter"] = DataLoader.__iter__
    _original["index_sampler"] = DataLoader.__dict__["_index_sampler"]
    _original["next"] = _dataloader._BaseDataLoaderIter.__next__
    DataLoader.__iter__ = _iterating(DataLoader.__iter__)  # type: ignore[method-assign]
    DataLoader._index_sampler = property(_index_sampler)  # type: ignore[assignment,method-assign]
    _dataloader._BaseDataLoaderIter.__next__ = _next  # type: ignore[method-assign]
    # torchdata's StatefulDataLoader makes its iterators itself (from torch's iterator classes):
    # its position is its own (state_dict), its seeding becomes ours.
    import importlib.util

    if importlib.util.find_spec("torchdata") is not None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]
        except ImportError:
            return
        StatefulDataLoader.__iter__ = _iterating(StatefulDataLoader.__iter__)


def _install_fetch() -> None:
    if "fetch" not in _original:
        _original["fetch"] = _fetch._MapDatasetFetcher.fetch
        _fetch._MapDatasetFetcher.fetch = _fetch_seeded  # type: ignore[method-assign]


# A spawned or forkserver worker imports this module when it unpickles its first Seeded batch:
# its fetcher must understand them. Harmless elsewhere (only Seeded batches take the new path).
_install_fetch()

__all__ = ["enabled", "expect", "fingerprint", "inexact", "install", "load", "mix",
           "sampler_of", "state", "tracked"]

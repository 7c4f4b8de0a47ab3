"""Exact data loading: a resumed DataLoader continues at its epoch and batch, with the order and
the random augmentation the uninterrupted run had, and its consumed batches are skipped unfetched.

Why: torch's DataLoader draws a base seed from the global generator every time an iterator is
made (with ``num_workers=0`` too), a RandomSampler without a generator draws another at its first
batch, and what a worker's augmentation draws depends on every sample that worker fetched before.
Restoring the random generators at a checkpoint puts none of that back.

Nothing changes on import. `install()` starts it, in this process, for every DataLoader
(subclasses included) that does not opt out with `exclude`; ``slurmddp.init()``,
``python -m slurmddp.run`` and the framework integrations' objects call it, and `uninstall()`
puts torch back. What it changes, and only while installed:

- an iterator's base seed comes from a generator seeded by (loader seed, epoch, rank), and a
  sampler that would draw from torch's global generator or share the loader's (RandomSampler,
  SubsetRandomSampler, WeightedRandomSampler without a generator of their own) is given one seeded
  by (loader seed, epoch). The loader seed is the initial seed of the loader's own ``generator=``
  where there is one, else ``torch.initial_seed()``, mixed with the loader's slot: the n-th loader
  alive at once over the same kind of data (so two such loaders are not correlated); a new loader
  that takes the place of one that is gone continues its epochs if it draws from the same
  generator. The user's generators are read, never drawn from or replaced;
- with workers, each batch seeds the worker's torch, numpy and python generators by (the epoch's
  seed, the rank, the batch's keys): the function torch gives a worker at its start
  (``worker_init_fn``, wrapped) installs that in the worker process alone;
- with ``num_workers=0`` the samples draw from the iterating thread's generators, as in torch:
  nothing is seeded, saved or restored in the training process, from any thread. Those generators
  are in the checkpoint (`train_state.capture`), so the resumed batches draw what the
  uninterrupted run's drew, provided the loader is iterated by the thread that trains;
- the loader counts its iterators and the batches consumed, on the loader (a loop that breaks
  keeps its place): `state(loader)` is what `train_state.capture(loader=...)` saves, `load`
  makes the next iterator that one again, its consumed batches skipped in the sampler, unfetched.

A loader with torchdata's Stateful protocol (``state_dict``/``load_state_dict``: torchdata's
StatefulDataLoader) is left as it is and saved by its own protocol. An IterableDataset's position
is its own: `state` refuses it.

"Epoch" is the sampler's own (``set_epoch``) with the iterators made since it last changed, or,
for a sampler without one, the iterators made: a framework that rebuilds a loader to skip batches
(the Hugging Face Trainer) still sets its sampler's epoch, and the seeds follow it (Accelerate's
loaders write theirs on a sampler that keeps none: `follow_accelerate_epochs`).
``SLURMDDP_EXACT_DATA=0`` leaves every DataLoader as torch made it.
"""

from __future__ import annotations

import operator
import os
import random
import sys
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils import fetch as _fetch

from slurmddp import dist, patches, protocol

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


# Domain tags: the base seed, a sampler's generator, the batches and the slots never share a
# stream.
_BASE, _SAMPLER, _SAMPLE, _SLOT = 1, 2, 3, 4


def enabled() -> bool:
    """Whether DataLoaders are seeded for an exact resume ($SLURMDDP_EXACT_DATA is not 0)."""
    return os.environ.get(protocol.EXACT_DATA_VAR, "1") != "0"


class NotResumable(ValueError):
    """A loader whose position slurmddp does not keep; the message says why and what to do."""


class _Track:
    """One loader slot's epochs and position."""

    def __init__(self, fingerprint: str, slot: int) -> None:
        self.fingerprint = fingerprint
        self.slot = slot
        self.seed: int | None = None
        self.epoch_seed = 0  # what this epoch's seeds derive from
        self.epoch = -1  # the epoch of the last iterator made; -1: none yet
        self.skip = 0  # batches the last iterator skipped at its start
        # The last iterator's count of batches yielded, read from its attributes while it lives
        # (a finalizer holds them, not the iterator) and kept as it dies: a loop that breaks
        # drops its iterator, and the position stays, at no cost per batch.
        self.watch: weakref.finalize | None = None
        self.final = 0
        self.exhausted = False  # the last iterator raised StopIteration
        self.generation = 0  # which iterator counts (an older one may still be iterated)
        self.workers = False  # the last iterator's batches are fetched by workers
        self.pending: dict | None = None  # from load(): the next iterator's epoch and position
        # The seeds' epoch: (the sampler's own epoch, iterators made since it last changed),
        # or (-1, iterators made) for a sampler without one. A framework that rebuilds the
        # loader (to skip batches, say) still sets the sampler's epoch: the seeds follow it.
        self.key = (-1, 0)
        self.sampler_epoch: int | None = None
        self.users: torch.Generator | None = None  # a sampler's own generator, if it has one
        self.sampler_state: torch.Tensor | None = None  # and its state at this epoch's start

    def begin(self, loader: DataLoader) -> None:
        if self.epoch < 0 and self.pending is None:
            self.pending = _adopt(self)
        if self.seed is None:
            self.seed = _seed_of(loader, self.slot)
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
        self.generation += 1
        self.workers = loader.num_workers > 0
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
        self.epoch_seed = mix(self.seed, *self.key)
        from slurmddp.training.sampler import ResumableDistributedSampler

        if isinstance(sampler, ResumableDistributedSampler) and sampler.start > 0:
            self.skip = 0  # set_epoch(epoch, start=...) resumes it: skipping again would double
        self.final = 0
        generator: Any = getattr(sampler, "generator", _NONE)
        self.users = self.sampler_state = None
        if generator is _NONE:
            pass
        elif (generator is None or generator is loader.generator
              or generator is getattr(sampler, _GIVEN, None)):  # fmt: skip
            # It would draw its seed from the global generator (or from the user's loader
            # generator, which torch would advance), or has one we gave it (perhaps through
            # another loader on the same sampler, as Accelerate's skip_first_batches makes):
            # give it one of this epoch's.
            ours = torch.Generator().manual_seed(mix(self.epoch_seed, _SAMPLER))
            sampler.generator = ours
            setattr(sampler, _GIVEN, ours)
        else:  # the user's own generator: its state at the epoch's start is the epoch's order
            if restored_generator is not None:
                generator.set_state(restored_generator)
            self.users = generator
            self.sampler_state = generator.get_state()

    def state(self, loader: DataLoader) -> dict:
        """{"seed", "epoch", "consumed", "loader", "slot"}: the next iterator's epoch, the
        batches it skips, and which loader it is (for `expect`)."""
        if self.pending is not None:  # loaded, not iterated since: keep what was loaded
            return dict(self.pending)
        seed = self.seed if self.seed is not None else _seed_of(loader, self.slot)
        state: dict[str, Any] = {"seed": seed, "loader": self.fingerprint, "slot": self.slot}
        if self.epoch < 0:
            state |= {"epoch": 0, "consumed": 0}
        elif self.exhausted:
            state |= {"epoch": self.epoch + 1, "consumed": 0, "key": list(self.key),
                      "after": True}  # fmt: skip
            if self.users is not None:  # the next epoch starts where this one left it
                state["sampler_generator"] = self.users.get_state()
        else:
            state |= {"epoch": self.epoch, "consumed": self.skip + self.yielded(),
                      "key": list(self.key)}  # fmt: skip
            if self.sampler_state is not None:
                state["sampler_generator"] = self.sampler_state
        return state


    def follow(self, it: Any) -> None:
        """Count `it`'s batches as this epoch's."""
        it.__dict__[_TRACK] = (self, self.generation)
        held = self.watch.peek() if self.watch is not None else None
        if held is not None and held[0] is it:  # persistent workers: the same iterator again
            return
        self.watch = weakref.finalize(it, self._died, it.__dict__, self.generation)
        self.watch.atexit = False

    def _died(self, attributes: dict, generation: int) -> None:
        if generation == self.generation:
            self.final = attributes.get("_num_yielded", 0)

    def yielded(self) -> int:
        held = self.watch.peek() if self.watch is not None else None
        return held[2][0].get("_num_yielded", 0) if held is not None else self.final


def _seed_of(loader: DataLoader, slot: int) -> int:
    """The loader's seed: its own generator's initial seed (read, never drawn from), else the
    process's; told apart by the slot (loaders alive at once over the same kind of data)."""
    own = loader.generator
    seed = own.initial_seed() if isinstance(own, torch.Generator) else torch.initial_seed()
    return seed if slot == 0 else mix(seed, _SLOT, slot)


_NONE = object()
# On a sampler: the generator we gave it (torch's Generator takes no attribute, nor, before
# torch 2.9 or so, a weak reference).
_GIVEN = "_slurmddp_generator"
_TRACK = "_slurmddp_track"
_LEFT = "_slurmddp_excluded"
# Every loader that made an iterator under the seeding (for the note when capture names none).
_seen: weakref.WeakSet[DataLoader] = weakref.WeakSet()
# (fingerprint, slot) -> (the loader holding it, its track, its own generator). A slot whose
# loader is gone is taken by the next loader of that fingerprint, which continues its epochs if
# it draws from the same generator (the process's, or the same generator object): a loop that
# makes a new loader every epoch gets a new order every epoch, and a loader given a generator
# seeded anew starts over, as with torch.
_slots: dict[tuple[str, int], tuple[weakref.ref, _Track, Any]] = {}


def track(loader: DataLoader) -> _Track:
    """The loader's epochs and position, in a slot of its own (see `_slots`)."""
    found = loader.__dict__.get(_TRACK)
    if found is not None:
        return found
    mine = fingerprint(loader)
    own = loader.generator
    slot = 0
    while True:
        held = _slots.get((mine, slot))
        if held is None:
            found = _Track(mine, slot)
            break
        if held[0]() is None:
            found = held[1] if held[2] is own else _Track(mine, slot)
            break
        slot += 1
    _slots[mine, slot] = (weakref.ref(loader), found, own)
    loader.__dict__[_TRACK] = found
    return found


def exclude(loader: DataLoader) -> DataLoader:
    """Leave `loader` as torch makes it: torch's seeding, no position kept. Returns it."""
    loader.__dict__[_LEFT] = True
    return loader


def follow_accelerate_epochs() -> None:
    """Have Accelerate's prepared loaders write their epoch on a sampler that keeps none.

    They keep the epoch themselves (`set_epoch`, which each of their iterators also calls); a
    RandomSampler has none, so the seeds would count the iterators made, and the loader that
    `skip_first_batches` makes to resume an epoch would draw epoch 0's order (at more than one
    process, where the order comes from the sampler's generator). Written on the sampler, which
    the rebuilt loader shares, the epoch is what the seeds follow. Idempotent; `uninstall` puts
    Accelerate's own back."""
    for patch in _ACCELERATE_EPOCHS:
        patches.apply(patch)


def _writing_the_epoch(original: Any) -> Any:
    def set_epoch(self: Any, epoch: int) -> None:
        original(self, epoch)
        sampler = sampler_of(getattr(self, "base_dataloader", self))
        if sampler is not None and not callable(getattr(sampler, "set_epoch", None)):
            sampler.epoch = epoch

    return set_epoch


_ACCELERATE_EPOCHS = tuple(
    patches.Patch(
        f"accelerate.data_loader:{cls}.set_epoch",
        why="Accelerate's prepared loader writes its epoch on a sampler that keeps none, so that "
        "the seeds of a resumed epoch's rebuilt loader follow it",
        by="slurmddp.integrations.accelerate.Preemptible",
        make=_writing_the_epoch,
    )
    for cls in ("DataLoaderShard", "DataLoaderDispatcher")
)


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


def _base(loader: Any) -> Any:
    """The DataLoader that iterates: Accelerate's adapters wrap one (``base_dataloader``)."""
    while "base_dataloader" in getattr(loader, "__dict__", {}):
        loader = loader.__dict__["base_dataloader"]
    return loader


def _stateful(loader: Any) -> bool:
    """Whether `loader` keeps its own position (torchdata's Stateful protocol)."""
    loader = _base(loader)
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


def state(loader: DataLoader) -> dict:
    """Where `loader` stands: the seed, the epoch of its next (or current) iterator and the
    batches of it consumed; or, for a Stateful loader, ``{"stateful": its state_dict()}``.
    Plain values and tensors, for a checkpoint. Raises NotResumable for a loader whose position
    is not kept (an IterableDataset's, one excluded, one iterated before `install`)."""
    loader = _base(loader)
    if _stateful(loader):
        return {"stateful": loader.state_dict()}  # type: ignore[attr-defined]
    what = f"the DataLoader over {type(loader.dataset).__name__}"
    if isinstance(loader.dataset, IterableDataset):
        raise NotResumable(
            f"{what} is an IterableDataset, whose position is its own: give a map-style "
            "Dataset, or torchdata's StatefulDataLoader over a Stateful dataset, or leave "
            "loader= out and resume the stream yourself")
    if loader.__dict__.get(_LEFT):
        raise NotResumable(f"{what} was excluded from exact loading (loader.exclude): its "
                           "position is not kept; leave it out of loader=")  # fmt: skip
    if enabled() and not installed() and _TRACK not in loader.__dict__:
        raise NotResumable(f"exact data loading is not started, so {what} keeps no position: "
                           "call slurmddp.init() (or run under python -m slurmddp.run) before "
                           "its first batch")  # fmt: skip
    return track(loader).state(loader)


def load(loader: DataLoader, saved: dict) -> None:
    """Make `loader`'s next iterator the saved epoch, skipping its consumed batches unfetched."""
    loader = _base(loader)
    if "stateful" in saved:
        if not _stateful(loader):
            raise ValueError(f"the saved position is a Stateful loader's (torchdata's), and "
                             f"{type(loader).__name__} has no load_state_dict")  # fmt: skip
        loader.load_state_dict(saved["stateful"])  # type: ignore[attr-defined]
        return
    if _stateful(loader):
        raise ValueError(f"{type(loader).__name__} keeps its own position (load_state_dict), "
                         "and the saved one is slurmddp's: save and restore it with the same "
                         "kind of loader")  # fmt: skip
    if enabled() and not installed():
        raise NotResumable("exact data loading is not started: call slurmddp.init() (or run "
                           "under python -m slurmddp.run) before restoring a loader")  # fmt: skip
    track(loader).pending = _checked(saved)


def _checked(saved: dict) -> dict:
    missing = {"seed", "epoch", "consumed"} - set(saved)
    if missing:
        raise ValueError(f"a loader state needs {', '.join(sorted(missing))}")
    return dict(saved)


def fingerprint(loader: DataLoader) -> str:
    """What a loader iterates and in what order: the same for a loader a framework rebuilds
    around the dataset and its sampler, different for a training and a validation loader."""
    dataset = loader.dataset
    size = len(dataset) if hasattr(dataset, "__len__") else "?"
    sampler = sampler_of(loader)
    shuffled = " shuffled" if getattr(sampler, "shuffle", False) is True else ""
    return (f"{type(dataset).__name__}[{size}] batch {loader.batch_size} "
            f"{type(sampler).__name__}{shuffled}")  # fmt: skip


# States for loaders not made yet (a framework builds its own from the user's, after the
# checkpoint is read): the first loader of the same fingerprint and slot to iterate takes one.
_expected: list[dict] = []


def expect(states: list[dict]) -> None:
    """Give each saved state to the first loader with its fingerprint that makes an iterator."""
    _expected[:] = [_checked(s) for s in states]


def _adopt(t: _Track) -> dict | None:
    for i, saved in enumerate(_expected):
        name = saved.get("loader")
        # A state saved before the fingerprint named the sampler: its first part.
        known = name == t.fingerprint or (
            "slot" not in saved and isinstance(name, str)
            and t.fingerprint.startswith(name + " "))  # fmt: skip
        if known and int(saved.get("slot", 0)) == t.slot:
            return _expected.pop(i)
    return None


def tracked(loader: Any) -> bool:
    """Whether `loader` is a DataLoader that made an iterator under this module's seeding."""
    return isinstance(loader, DataLoader) and _TRACK in loader.__dict__


def seen_loaders() -> list[DataLoader]:
    return list(_seen)


def inexact(loader: DataLoader) -> list[str]:
    """Why a resume of `loader` cannot be bitwise, if it cannot: one phrase per reason."""
    if _stateful(loader):
        return []  # its own protocol's promise, not ours
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
                       f"({', '.join(own)}), which per-batch seeding does not reach")  # fmt: skip
    sampler = sampler_of(loader)
    if not _known_sampler(sampler):
        reasons.append(f"the sampler {type(sampler).__name__} is assumed to order an epoch by "
                       "its epoch alone")  # fmt: skip
    return reasons


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


# -- what travels to a worker: a batch's keys with its seed ---------------------------------------


class Seeded:
    """A batch of dataset keys (or one key) and its epoch's seed, sent to a worker's fetcher,
    which seeds the batch by both (`_fetch_seeded`)."""

    __slots__ = ("base", "keys")

    def __init__(self, keys: Any, base: int) -> None:
        self.keys = keys
        self.base = base

    def __reduce__(self) -> tuple:  # to a spawned worker: unpickling imports this module there
        return (Seeded, (self.keys, self.base))


class _Indices:
    """The loader's index sampler, seen through its epoch: skips the consumed batches, then
    (with workers) sends each batch with its seed. Read again at every iterator (persistent
    workers keep this object), so it follows the loader's current epoch."""

    def __init__(self, inner: Any, track_: _Track) -> None:
        self.inner = inner
        self.track = track_

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        t = self.track
        it = iter(self.inner)
        for _ in range(t.skip):  # indices only: nothing is fetched for a consumed batch
            if next(it, _NONE) is _NONE:
                return
        if not t.workers:
            yield from it
            return
        base = mix(t.epoch_seed, _SAMPLE, dist.rank())
        for keys in it:
            yield Seeded(keys, base)


class _WorkerStart:
    """The ``worker_init_fn`` a loader's workers start with: seeds each batch in this worker
    process (and no other), then runs the user's own. `keyed`: batches come as the sampler gives
    them (a StatefulDataLoader's, whose position is its own), seeded by the iterator's base seed
    (which torchdata saves and restores), the rank and the batch's keys."""

    __slots__ = ("keyed", "user")

    def __init__(self, user: Any, keyed: bool = False) -> None:
        self.user = user
        self.keyed = keyed

    def __reduce__(self) -> tuple:
        return (_WorkerStart, (self.user, self.keyed))

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        if info is not None and not _in_worker:
            _in_worker.append(_fetch._MapDatasetFetcher.fetch)
            if self.keyed:
                _in_worker.append(mix(info.seed - info.id, _SAMPLE, dist.rank()))
            _fetch._MapDatasetFetcher.fetch = _fetch_seeded  # type: ignore[method-assign]
        if self.user is not None:
            self.user(worker_id)


# In a worker: the fetch it had before `_WorkerStart`, and for keyed batches their base.
_in_worker: list[Any] = []


def _fetch_seeded(self: Any, index: Any) -> Any:
    # A batch is seeded by its keys, not its place: a framework's loader that resumes an epoch
    # by skipping its first batches (Accelerate's skip_first_batches) numbers them from 0.
    if isinstance(index, Seeded):
        base, index = index.base, index.keys
    elif len(_in_worker) > 1:
        base = _in_worker[1]
    else:
        return _in_worker[0](self, index)
    keys = index if isinstance(index, list | tuple) else [index]
    seed = mix(base, *map(_key_number, keys))
    # A worker's generators are its own process's: the training's are never touched.
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)
    return _in_worker[0](self, index)


def _key_number(key: Any) -> int:
    """A dataset key as a number: the same for 5, numpy's 5 and a tensor's 5."""
    try:
        return operator.index(key)
    except TypeError:
        return zlib.crc32(repr(key).encode())  # str hashes differ between processes


# -- what `install` changes in the training process ---------------------------------------------

def installed() -> bool:
    """Whether `install` has started exact data loading in this process."""
    return _ITER.target in patches.applied()


def _indexing(original: property) -> property:
    """`original` (DataLoader's _index_sampler) skipping consumed batches and keying seeds."""

    def _index_sampler(self: DataLoader) -> Any:
        inner = original.fget(self)  # type: ignore[misc]
        t = self.__dict__.get(_TRACK)
        if (t is None or t.epoch < 0 or isinstance(self.dataset, IterableDataset)
                or not enabled() or self.__dict__.get(_LEFT)):  # fmt: skip
            return inner
        return _Indices(inner, t)

    return property(_index_sampler)


def _iterating(original: Any) -> Any:
    """`original` (DataLoader's own __iter__) under this module's epochs and seeds."""

    def __iter__(self: DataLoader) -> Any:
        if not enabled() or self.__dict__.get(_LEFT) or _stateful(self):
            return original(self)
        return _iter(self, original)

    return __iter__


def _iter(self: DataLoader, original: Any) -> Any:
    t = track(self)
    t.begin(self)
    _seen.add(self)
    users, init = self.generator, self.worker_init_fn
    base = t.epoch_seed
    if self.persistent_workers and self.num_workers > 0:
        base = t.seed or 0  # its workers take their base seed once: the same in every run
    self.generator = torch.Generator().manual_seed(mix(base, _BASE, dist.rank()))
    if t.workers and not isinstance(self.dataset, IterableDataset):
        self.worker_init_fn = _WorkerStart(init)
    try:
        it = original(self)
    finally:
        self.generator, self.worker_init_fn = users, init
    t.follow(it)
    return it


def _noting_the_end(original: Any) -> Any:
    """`original` (the iterators' __next__) noting that an epoch ran out: the next is new."""

    def __next__(self: Any) -> Any:
        try:
            return original(self)
        except StopIteration:
            mark = self.__dict__.get(_TRACK)
            if mark is not None and mark[0].generation == mark[1]:
                mark[0].exhausted = True
            raise

    return __next__


def install() -> None:
    """Start exact data loading in this process, as the module docstring says; idempotent.

    Run by ``slurmddp.init()``, ``python -m slurmddp.run`` and the integrations' objects: before
    any DataLoader iterates, in a fresh run as in a resumed one (the seeds must match)."""
    for patch in (_ITER, _INDEX_SAMPLER, _NEXT, _STATEFUL_ITERATOR):
        patches.apply(patch)


def _seeding_stateful_workers(original: Any) -> Any:
    """torchdata's StatefulDataLoader keeps its own position and base seeds: its workers are only
    given the per-batch seeding (`_WorkerStart`, keyed) as its iterators start them, so that a
    resumed epoch's augmentation is the uninterrupted one's (torchdata restores the base seed,
    not what each worker drew since); persistent workers take their base seed once and are left
    as they are."""

    def _get_iterator(self: Any) -> Any:
        if not enabled() or self.__dict__.get(_LEFT) or isinstance(self.dataset, IterableDataset):
            return original(self)
        init = self.worker_init_fn
        if self.num_workers > 0 and not self.persistent_workers:
            self.worker_init_fn = _WorkerStart(init, keyed=True)
        # A resumed iterator still draws its base seed (and an unseeded sampler its seed) from
        # torch's generator before it puts the saved ones in their place: taken back, on the
        # thread that makes it, so that the training's stream goes on where it was restored.
        resumed = torch.get_rng_state() if self.next_iter_state is not None else None
        try:
            return original(self)
        finally:
            self.worker_init_fn = init
            if resumed is not None:
                torch.set_rng_state(resumed)

    return _get_iterator


_BY = "slurmddp.init(), python -m slurmddp.run, the integrations' objects"
_ITER = patches.Patch(
    "torch.utils.data.dataloader:DataLoader.__iter__",
    why="each iterator's base seed from (loader seed, epoch, rank); its workers seeded per batch; "
    "the loader's epoch and position counted on the loader",
    by=_BY, make=_iterating,
)
_INDEX_SAMPLER = patches.Patch(
    "torch.utils.data.dataloader:DataLoader._index_sampler",
    why="a resumed epoch skips its consumed batches unfetched, and hands each batch's keys to "
    "its worker's seeding",
    by=_BY, make=_indexing,
)
_NEXT = patches.Patch(
    "torch.utils.data.dataloader:_BaseDataLoaderIter.__next__",
    why="notes that an epoch ran out, so the next iterator starts the next epoch",
    by=_BY, make=_noting_the_end,
)
_STATEFUL_ITERATOR = patches.Patch(
    "torchdata.stateful_dataloader:StatefulDataLoader._get_iterator",
    why="torchdata's StatefulDataLoader keeps its own protocol; only its workers are seeded per "
    "batch, so a resumed epoch's augmentation is the uninterrupted one's",
    by=_BY, make=_seeding_stateful_workers,
)


def uninstall() -> None:
    """Put torch (and torchdata and Accelerate) back as they were, and forget every loader's
    slot."""
    for patch in (_ITER, _INDEX_SAMPLER, _NEXT, _STATEFUL_ITERATOR, *_ACCELERATE_EPOCHS):
        patches.remove(patch)
    _slots.clear()
    _expected.clear()


__all__ = ["NotResumable", "enabled", "exclude", "expect", "fingerprint", "inexact", "install",
           "installed", "load", "mix", "sampler_of", "state", "tracked", "uninstall"]

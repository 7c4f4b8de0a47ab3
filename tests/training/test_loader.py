"""slurmddp.training.loader: a DataLoader's randomness from (seed, epoch, sample), resumed exactly.

In-process tables first (a fresh DataLoader stands for the resumed process); then the guide's
loop (docs/guide/preemption.md) as a user fills it in (tests/programs/readme_data_loop.py:
dropout, random augmentation from torch, numpy and random, an ordinary DataLoader), and the
README's quick-start block itself (tests/programs/readme_quickstart.py), preempted at 2 ranks
(twice, or once where only the loading differs), against the same job uninterrupted, with the
controls that show the tests can fail.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from slurmddp.training import loader as exact
from slurmddp.training import train_state
from tests.conftest import PROGRAMS, ROOT
from tests.training.test_train_state import run_ranks


class Augmented(Dataset):
    """Each fetch draws from torch, numpy and random, as random augmentation does."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()])


def make(workers: int = 0, method: str | None = None, persistent: bool = False,
         **kw) -> DataLoader:  # fmt: skip
    if workers:
        kw |= {"multiprocessing_context": method, "persistent_workers": persistent,
               "prefetch_factor": 3}  # fmt: skip
    kw.setdefault("shuffle", "sampler" not in kw and "batch_sampler" not in kw)
    batch = {} if "batch_sampler" in kw else {"batch_size": 3}
    return DataLoader(kw.pop("dataset", Augmented()), num_workers=workers, **batch, **kw)


def run(loader: DataLoader, epochs: int, stop: int | None = None, saved: dict | None = None):
    """Batches over `epochs` epochs (from `saved`); with `stop`, also the state after it."""
    if saved is not None:
        exact.load(loader, saved)
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(batch)
            if len(out) == stop:
                return out, exact.state(loader)
    return out, None


def resumed(factory, epochs: int, stop: int) -> list:
    first, saved = run(factory(), epochs, stop=stop)
    rest, _ = run(factory(), epochs - saved["epoch"], saved=saved)
    return first + rest


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# Mid-epoch, at an epoch's last batch (7 of 7), and after it (the next epoch's first).
EVERY_STOP = (4, 7, 8, 14)
# How workers start (spawn, forkserver) changes how their seeds reach them, not where a stop
# falls: those stop mid-epoch only (each stop starts workers that import torch: seconds each).
LOADERS = [
    pytest.param(0, None, False, EVERY_STOP, id="in-process"),
    pytest.param(2, "fork", False, EVERY_STOP, id="fork", marks=pytest.mark.floor),
    pytest.param(2, "spawn", False, (4,), id="spawn"),
    pytest.param(2, "forkserver", False, (4,), id="forkserver"),
]


@pytest.mark.parametrize(("workers", "method", "persistent", "stops"), LOADERS)
@pytest.mark.ranks
def test_a_resumed_loader_yields_what_the_uninterrupted_one_did(workers, method, persistent,
                                                                stops):  # fmt: skip
    torch.manual_seed(0)

    def factory():
        return make(workers, method, persistent)

    # The reference is the loader without workers: each resumed loader below yields every batch
    # from its workers (those before the stop and those after), so its equality with it is also
    # that the samples' augmentation depends on neither the workers nor how they start. (Each
    # iterator of a loader with workers starts them: with spawn, two interpreters importing
    # torch.)
    reference, _ = run(make(), 3)
    assert len(reference) == 21
    for stop in stops:
        assert same(resumed(factory, 3, stop), reference), stop


def test_loading_never_draws_from_the_training_generators():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    run(make(), 2)
    assert torch.equal(before[0], torch.get_rng_state())
    assert (before[1] == np.random.get_state()[1]).all() and before[2] == random.getstate()


def test_the_control_without_the_seeding_drifts(monkeypatch):
    # torch's own seeding: the iterator draws its seeds from the global generator, which the
    # resumed process has elsewhere, and the consumed batches come again.
    monkeypatch.setenv("SLURMDDP_EXACT_DATA", "0")
    torch.manual_seed(0)
    reference, _ = run(make(), 3)
    first, _ = run(make(), 3, stop=4)
    torch.manual_seed(0)  # as the resumed process starts
    rest, _ = run(make(), 3)
    assert not same(first + rest[: len(reference) - 4], reference)


def test_a_consumed_batch_is_not_fetched_again():
    fetched = []

    class Counting(Augmented):
        def __getitem__(self, i):
            fetched.append(i)
            return super().__getitem__(i)

    torch.manual_seed(0)
    _, saved = run(make(dataset=Counting()), 1, stop=5)
    fetched.clear()
    rest, _ = run(make(dataset=Counting()), 1, saved=saved)
    assert len(rest) == 2 and len(fetched) == 20 - 15  # the last two batches, 3 + 2 samples


def test_the_state_is_the_next_iterators_epoch_and_position():
    loader = make()
    assert exact.state(loader) | {"seed": 0} == {"seed": 0, "epoch": 0, "consumed": 0,
                                                 "loader": "Augmented[20] batch 3"}
    it = iter(loader)
    next(it), next(it)
    assert exact.state(loader)["epoch"] == 0 and exact.state(loader)["consumed"] == 2
    list(it)  # the epoch ran out: the next iterator is the next epoch's
    assert (exact.state(loader)["epoch"], exact.state(loader)["consumed"]) == (1, 0)
    exact.load(loader, {"seed": 5, "epoch": 3, "consumed": 1})
    assert exact.state(loader)["epoch"] == 3  # loaded, not yet iterated: what was loaded
    assert len(list(loader)) == 6 and exact.state(loader)["epoch"] == 4


def test_a_sampler_with_a_generator_of_its_own_resumes_from_its_saved_state():
    from torch.utils.data import RandomSampler

    def factory():
        g = torch.Generator().manual_seed(7)
        return make(sampler=RandomSampler(range(20), generator=g))

    reference, _ = run(factory(), 3)
    for stop in (4, 7, 9):
        assert same(resumed(factory, 3, stop), reference), stop


class Batched(Augmented):
    """Fetches a batch at once (`__getitems__`): one seed per batch, the same when resumed."""

    def __getitems__(self, keys):
        noise = torch.rand(len(keys))
        return [torch.tensor([float(k), float(n)]) for k, n in zip(keys, noise, strict=True)]


@pytest.mark.parametrize("kind", ["subset", "batch_sampler", "no_batching", "weighted",
                                  "getitems"])  # fmt: skip
def test_other_loader_shapes_resume_exactly(kind):
    from torch.utils.data import BatchSampler, RandomSampler, WeightedRandomSampler

    def factory():
        if kind == "subset":
            return make(dataset=Subset(Augmented(), list(range(0, 20, 2))))
        if kind == "batch_sampler":
            return make(batch_sampler=BatchSampler(RandomSampler(range(20)), 4, False))
        if kind == "no_batching":
            return DataLoader(Augmented(), batch_size=None, shuffle=True)
        if kind == "getitems":
            return make(dataset=Batched(), workers=2, method="fork")
        return make(sampler=WeightedRandomSampler([1.0] * 20, 20))

    torch.manual_seed(0)
    reference, _ = run(factory(), 2)
    assert same(resumed(factory, 2, 3), reference)


def test_what_cannot_be_exact_is_named():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    class OwnRng(Augmented):
        def __init__(self):
            self.rng = np.random.default_rng(0)

    assert exact.inexact(make()) == []
    assert "IterableDataset" in exact.inexact(DataLoader(Stream()))[0]
    assert "generators of its own (rng)" in exact.inexact(make(dataset=OwnRng()))[0]
    ordered = DataLoader(Augmented(), num_workers=2, in_order=False)
    assert any("in_order=False" in r for r in exact.inexact(ordered))
    assert exact.inexact(make(dataset=TensorDataset(torch.zeros(4)))) == []


def test_capture_and_restore_carry_the_loader(tmp_path, capsys):
    torch.manual_seed(0)
    reference, _ = run(make(), 2)
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    state = train_state.capture(loader=loader, step=5)
    other = make()
    train_state.restore(state, loader=other)
    rest, _ = run(other, 2 - state["loader"]["epoch"])
    assert same(first + rest, reference)
    with pytest.raises(train_state.CheckpointError, match="no loader state"):
        train_state.restore({"step": 1}, loader=make())


def test_a_loop_that_names_no_loader_is_told_once_at_its_first_save(monkeypatch, capsys):
    monkeypatch.setattr(train_state, "_noted", False)
    loader = make()
    it = iter(loader)
    next(it)
    train_state.capture(step=1)
    train_state.capture(step=2)
    err = capsys.readouterr().err
    assert err.count("is in use but train_state.capture was given no loader=") == 1, err
    assert err.startswith("slurmddp: a DataLoader over "), err


# -- the guide's loop, as a user fills it in, in real processes -------------------------------

DATA_LOOP = str(PROGRAMS / "readme_data_loop.py")


def run_loop(checkpoints, *args: str, world: int = 2, **env: str) -> list[dict]:
    return run_ranks(DATA_LOOP, checkpoints, *args, world=world, **env)


def preempted(checkpoints, stops: str, *args: str, world: int = 2, **env: str) -> set:
    """The loop stopped at each of `stops` (requeued), then run to its end: the ranks' digests."""
    for _ in stops.split(","):
        assert run_loop(checkpoints, "--stop-at", stops, *args, world=world, **env) == []
    results = run_loop(checkpoints, "--stop-at", stops, *args, world=world, **env)
    assert len(results) == world and {r["start"] for r in results} == {int(stops.split(",")[-1])}
    return {r["digest"] for r in results}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted loop's digest by (sampler, world), each run once: how the samples are
    loaded (workers, how they start) changes none of them (test_a_resumed_loader_yields_...)."""
    digests: dict[tuple[str, int], set] = {}

    def digest(sampler: str, world: int) -> set:
        if (sampler, world) not in digests:
            work = tmp_path_factory.mktemp(f"uninterrupted-{sampler}-{world}")
            digests[sampler, world] = {r["digest"] for r in run_loop(work, "--sampler", sampler,
                                                                     world=world)}  # fmt: skip
            assert len(digests[sampler, world]) == 1
        return digests[sampler, world]

    return digest


# 48 samples, 4 per rank per step: at 2 ranks 6 steps an epoch (12 with the RandomSampler, every
# rank the whole dataset). Stopped mid-epoch, then at the last step of the next epoch; the loaders
# whose workers start otherwise (spawn, forkserver) and persist are stopped mid-epoch only: how
# the seeds reach the workers differs, not where a stop falls (as in
# test_a_resumed_loader_yields_what_the_uninterrupted_one_did; each run of the loop is two ranks
# importing torch, and with spawn their workers too).
# [4-ranks-resumable-fork] (4 ranks, 2 forked workers, ResumableDistributedSampler) is proven by
# tests/checkpoint/test_snapshots.py::test_killed_ranks_resume_from_the_snapshot_in_place_bitwise:
# the same loop, loader and sampler at 4 ranks (on 2 nodes), killed and resumed bitwise.
@pytest.mark.parametrize(
    ("sampler", "loading", "stops"),
    [("resumable", [], "4,12"),
     ("distributed", ["--workers", "2", "--start-method", "forkserver", "--persistent",
                      "--prefetch", "4"], "4"),
     ("random", ["--workers", "2", "--start-method", "spawn", "--persistent"], "4"),
     pytest.param("distributed", ["--workers", "2", "--start-method", "fork"], "4,12",
                  marks=pytest.mark.floor)],
    ids=["resumable-in-process", "distributed-forkserver-persistent-prefetch4",
         "random-spawn-persistent", "distributed-fork"],
)  # fmt: skip
@pytest.mark.ranks
def test_the_readme_loop_with_dropout_and_augmentation_resumes_bitwise(tmp_path, uninterrupted,
                                                                        sampler, loading,
                                                                        stops):  # fmt: skip
    reference = uninterrupted(sampler, 2)
    assert preempted(tmp_path / "b", stops, "--sampler", sampler, *loading) == reference


@pytest.mark.ranks
def test_the_readme_loop_without_the_seeding_drifts_the_control(tmp_path):
    reference = {r["digest"] for r in run_loop(tmp_path / "a", SLURMDDP_EXACT_DATA="0")}
    assert preempted(tmp_path / "b", "4", SLURMDDP_EXACT_DATA="0") != reference


def test_the_guides_table_of_what_is_exact_names_these_tests():
    # The table is written from these tests: each row names one, and each case of the guide's
    # loop's test has its row.
    guide = (ROOT / "docs" / "guide" / "preemption.md").read_text()
    section = guide.split("## Exact resume with a DataLoader", 1)[1]
    table = section[section.index("| loader |"):].split("\n\n", 1)[0]
    rows = table.splitlines()[2:]
    cells = [row.rsplit("|", 2)[1] for row in rows]
    named = [n.rstrip(".") for cell in cells for n in re.findall(r"`([^`]+)`", cell)]
    source = Path(__file__).read_text()
    assert named and all(n in source or (ROOT / n).exists() for n in named), named
    ids = re.search(r"ids=\[([^\]]*)\]", source.split("def test_the_readme_loop_with")[0]
                    .rsplit("@pytest.mark.parametrize", 1)[1]).group(1)  # fmt: skip
    assert set(re.findall(r'"([^"]+)"', ids)) <= set(named)


QUICK_START = str(PROGRAMS / "readme_quickstart.py")


@pytest.mark.ranks
def test_the_readmes_quick_start_loop_as_written_resumes_bitwise(tmp_path):
    # The README's own block, executed (not a copy): dropout, augmenting workers, a sampler.
    reference = {r["digest"] for r in run_ranks(QUICK_START, tmp_path / "a", world=2)}
    assert len(reference) == 1

    def preempted(checkpoints, stops: str, **env: str) -> set:
        for _ in stops.split(","):
            assert run_ranks(QUICK_START, checkpoints, "--stop-at", stops, world=2, **env) == []
        return {r["digest"] for r in run_ranks(QUICK_START, checkpoints, "--stop-at", stops,
                                               world=2, **env)}  # fmt: skip

    assert preempted(tmp_path / "b", "4,12") == reference
    # The control: without the loaders' seeding the same job ends in other bits (one stop is
    # enough for that).
    assert preempted(tmp_path / "c", "4", SLURMDDP_EXACT_DATA="0") != reference

"""slurmddp.training.loader: a DataLoader resumed at its epoch and batch, with the uninterrupted
run's order and augmentation.

In-process tables first (a fresh DataLoader after `fresh()` stands for the resumed process: the
loading is started anew, as `slurmddp.init()` starts it); then what a user does that the design
did not aim at (a thread, a `break`, their own generators, torchdata's own protocol, an
IterableDataset), and what `install` changes and puts back; then the guide's
loop (docs/guide/preemption.md) as a user fills it in (tests/programs/readme_data_loop.py:
dropout, random augmentation from torch, numpy and random, an ordinary DataLoader), preempted
at 2 ranks (twice, or once where only the loading differs), against the same job uninterrupted,
with the controls that show the tests can fail. The README's quick-start block itself runs as
the shipped train.py (tests/cli/test_cli_quickstart.py).
"""

from __future__ import annotations

import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from slurmddp.errors import CheckpointError
from slurmddp.training import loader as exact
from slurmddp.training import train_state
from tests.conftest import PROGRAMS, ROOT
from tests.training.test_train_state import run_ranks


@pytest.fixture(autouse=True)
def started():
    """Exact loading started for the test, and torch put back after it."""
    exact.install()
    yield
    exact.uninstall()


def fresh() -> None:
    """As a new process starts: the loading started anew, no loader's epochs remembered."""
    exact.uninstall()
    exact.install()


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
    """Batches over `epochs` epochs (from `saved`); with `stop`, also the state after it. The
    generators are in the state too, as `train_state.capture` saves them."""
    if saved is not None:
        train_state.restore_rng(saved["rng"])
        exact.load(loader, saved)
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(batch)
            if len(out) == stop:
                return out, exact.state(loader) | {"rng": train_state.capture_rng()}
    return out, None


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def straight(factory, epochs: int) -> list:
    fresh()
    seed_all(0)
    return run(factory(), epochs)[0]


def resumed(factory, epochs: int, stop: int) -> list:
    fresh()
    seed_all(0)
    first, saved = run(factory(), epochs, stop=stop)
    fresh()
    seed_all(1)  # the resumed process's own start: the state puts the generators back
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


@pytest.fixture(scope="module")
def with_workers():
    """The uninterrupted batches of a loader whose workers fetch them (forked; how they start
    changes no seed, which each case below shows by equalling it)."""
    return straight(lambda: make(2, "fork"), 3)


@pytest.mark.parametrize(("workers", "method", "persistent", "stops"), LOADERS)
@pytest.mark.ranks
def test_a_resumed_loader_yields_what_the_uninterrupted_one_did(workers, method, persistent,
                                                                stops, request):  # fmt: skip
    def factory():
        return make(workers, method, persistent)

    # In the process, the samples draw from the training's generators (which the state holds);
    # in workers, from each batch's seed. (Each iterator of a loader with workers starts them:
    # with spawn, two interpreters importing torch.)
    reference = request.getfixturevalue("with_workers") if workers else straight(factory, 3)
    assert len(reference) == 21
    for stop in stops:
        assert same(resumed(factory, 3, stop), reference), stop


def test_workers_never_draw_from_the_training_generators():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    run(make(2, "fork"), 2)
    assert torch.equal(before[0], torch.get_rng_state())
    assert (before[1] == np.random.get_state()[1]).all() and before[2] == random.getstate()


def test_the_control_without_the_seeding_drifts(monkeypatch):
    # torch's own seeding: the iterator draws its seeds from the global generator, which the
    # resumed process has elsewhere, and the consumed batches come again.
    monkeypatch.setenv("SLURMDDP_EXACT_DATA", "0")
    torch.manual_seed(0)
    reference, _ = run(make(2, "fork"), 3)
    first, _ = run(make(2, "fork"), 3, stop=4)
    torch.manual_seed(0)  # as the resumed process starts
    rest, _ = run(make(2, "fork"), 3)
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
    assert exact.state(loader) | {"seed": 0} == {
        "seed": 0, "epoch": 0, "consumed": 0, "loader": "Augmented[20] batch 3 RandomSampler",
        "slot": 0}  # fmt: skip
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

    reference = straight(factory, 3)
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

    assert same(resumed(factory, 2, 3), straight(factory, 2))


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
    reference = straight(make, 2)
    fresh()
    seed_all(0)
    loader = make()
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    state = train_state.capture(loader=loader, step=5)
    fresh()
    other = make()
    train_state.restore(state, loader=other)
    rest, _ = run(other, 2 - state["loader"]["epoch"])
    assert same(first + rest, reference)
    with pytest.raises(train_state.CheckpointError, match="no loader state"):
        train_state.restore({"step": 1}, loader=make())


def test_a_loop_that_names_no_loader_is_told_once_at_its_first_save(monkeypatch, capsys):
    from slurmddp import errors

    monkeypatch.setattr(errors, "_said", set())
    loader = make()
    it = iter(loader)
    next(it)
    train_state.capture(step=1)
    train_state.capture(step=2)
    err = capsys.readouterr().err
    assert err.count("is in use but train_state.capture was given no loader=") == 1, err
    assert err.startswith("slurmddp: a DataLoader over "), err


# -- what users do that the design did not aim at (issue 44: each failed before) -------------


class Plain(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> int:
        return i


def test_a_loader_iterated_by_another_thread_leaves_the_training_threads_numbers_alone():
    # A prefetching thread iterates the loader while the training thread draws: the training
    # thread's numbers are torch's own stream (before, 18,752 of 20,000 differed).
    torch.manual_seed(0)
    reference = torch.rand(20_000)
    torch.manual_seed(0)
    loader = DataLoader(Plain(), batch_size=4, shuffle=True)
    stop = threading.Event()
    fetched = []

    def prefetch() -> None:
        for batch in loader:
            fetched.append(batch)
            if stop.is_set():
                return

    thread = threading.Thread(target=prefetch)
    thread.start()
    drawn = torch.stack([torch.rand(()) for _ in range(20_000)])
    stop.set()
    thread.join()
    assert fetched and torch.equal(drawn, reference)


def test_the_loaders_own_generators_decide_its_order_and_augmentation():
    def batches(seed: int, workers: int = 0) -> list:
        g = torch.Generator().manual_seed(seed)
        return list(make(workers, "fork" if workers else None, generator=g))

    one, two = batches(1), batches(2)
    assert not any(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(one, two, strict=True))
    # A generator seeded again starts over, as torch's does (in the process the augmentation
    # is the training's stream, which went on).
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(batches(1), one, strict=True))
    with_workers = batches(1, workers=2), batches(2, workers=2)
    assert not any(torch.equal(a, b) for a, b in zip(*with_workers, strict=True))
    assert same(batches(1, workers=2), with_workers[0])


def test_a_loader_with_its_own_generator_resumes_exactly():
    def factory():
        return make(generator=torch.Generator().manual_seed(5))

    for stop in (4, 7, 9):
        assert same(resumed(factory, 3, stop), straight(factory, 3)), stop


def test_two_loaders_alive_at_once_are_not_correlated():
    # Paired, teacher and student: the same data, no generators of their own.
    torch.manual_seed(0)
    first, second = make(2, "fork"), make(2, "fork")
    a, b = list(first), list(second)
    assert not any(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_new_loader_every_epoch_gets_a_new_order_every_epoch():
    torch.manual_seed(0)
    orders = [torch.cat([b[:, 0] for b in make()]) for _ in range(3)]
    assert len({tuple(o.tolist()) for o in orders}) == 3


def test_each_rank_augments_a_sample_its_own_way(monkeypatch):
    # DistributedSampler pads with duplicates, repeated-augmentation samplers repeat samples on
    # purpose: the same sample on two ranks is not augmented alike.
    def on_rank(rank: int) -> list:
        monkeypatch.setenv("RANK", str(rank))
        fresh()
        torch.manual_seed(0)
        return list(make(2, "fork", shuffle=False))

    zero, one = on_rank(0), on_rank(1)
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(zero, one, strict=True))
    assert not any(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(zero, one, strict=True))


def test_a_loop_that_breaks_mid_epoch_keeps_its_place():
    def factory():
        return make()

    reference = straight(factory, 2)
    fresh()
    seed_all(0)
    loader = factory()
    first = []
    for step, batch in enumerate(loader):
        first.append(batch)
        if step == 2:
            break
    state = train_state.capture(loader=loader)
    del loader  # the iterator is long gone: the position is the loader's
    fresh()
    other = factory()
    train_state.restore(state, loader=other)
    rest, _ = run(other, 2)
    assert state["loader"]["consumed"] == 3
    assert same(first + rest, reference)


@pytest.mark.parametrize("workers", [0, 2])
def test_torchdatas_own_resume_is_left_to_it_and_carried_by_capture(workers, tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def factory():
        return stateful.StatefulDataLoader(Augmented(), batch_size=3, shuffle=True,
                                           num_workers=workers)  # fmt: skip

    def rows(batches) -> list:
        return [row for b in batches for row in b.tolist()]

    seed_all(0)
    loader = factory()
    reference = rows(b for _ in range(2) for b in loader)
    # Its own protocol: state_dict mid-epoch 1, load_state_dict in a fresh loader (before,
    # with slurmddp imported, 3 samples came twice and 3 never); the augmentation in workers
    # is seeded by batch, so that it too is the uninterrupted run's.
    for through_capture in (False, True):
        fresh()
        seed_all(0)
        loader = factory()
        seen = rows(loader)
        it = iter(loader)
        seen += rows([next(it), next(it)])
        if through_capture:  # and what a checkpoint holds: weights-only loadable
            torch.save(train_state.capture(loader=loader), tmp_path / "s.pt")
            saved = torch.load(tmp_path / "s.pt", weights_only=True)
        else:
            saved = {"loader": loader.state_dict(), "rng": train_state.capture_rng()}
        del it, loader
        fresh()
        seed_all(3)
        again = factory()
        if through_capture:
            train_state.restore(saved, loader=again)
        else:
            again.load_state_dict(saved["loader"])
            train_state.restore_rng(saved["rng"])
        seen += rows(again)
        assert [r[0] for r in seen] == [r[0] for r in reference], through_capture  # the order
        assert seen == reference, through_capture  # and the augmentation


def test_an_iterable_datasets_loader_is_refused_at_the_first_save_in_one_line():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(CheckpointError) as refused:
        train_state.capture(loader=DataLoader(Stream()))
    message = str(refused.value)
    assert "\n" not in message and "IterableDataset" in message and "StatefulDataLoader" in message


def test_an_excluded_loader_is_torchs_own_and_keeps_no_position():
    def order(loader: DataLoader) -> list:
        torch.manual_seed(0)
        return [b[:, 0].tolist() for b in loader]

    exact.uninstall()
    torchs = order(make())
    exact.install()
    assert order(make()) != torchs
    excluded = exact.exclude(make())
    assert order(excluded) == torchs
    with pytest.raises(CheckpointError, match="excluded"):
        train_state.capture(loader=excluded)


def test_a_loader_iterated_before_the_start_is_refused_not_resumed_wrong():
    exact.uninstall()
    loader = make()
    next(iter(loader))
    with pytest.raises(CheckpointError, match=r"call slurmddp.init\(\)"):
        train_state.capture(loader=loader)


def test_a_saved_state_goes_to_its_own_loader_not_a_lookalike():
    # Lightning's sanity check iterates the validation loader before the training one: the same
    # dataset size and batch, another sampler.
    fresh()
    train = make()
    it = iter(train)
    next(it), next(it)
    saved = exact.state(train)
    fresh()
    exact.expect([saved])
    validation, train = make(shuffle=False), make()
    next(iter(validation))
    assert exact.state(validation)["consumed"] == 1
    next(iter(train))
    assert exact.state(train)["consumed"] == 3


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
    """The uninterrupted loop's digest by (sampler, world, whether workers fetch), each run once:
    how workers start and persist changes none of them (test_a_resumed_loader_yields_...)."""
    digests: dict[tuple[str, int, bool], set] = {}

    def digest(sampler: str, world: int, workers: bool) -> set:
        if (sampler, world, workers) not in digests:
            work = tmp_path_factory.mktemp(f"uninterrupted-{sampler}-{world}")
            loading = ["--workers", "2", "--start-method", "fork"] if workers else []
            digests[sampler, world, workers] = {
                r["digest"] for r in run_loop(work, "--sampler", sampler, *loading, world=world)}
            assert len(digests[sampler, world, workers]) == 1
        return digests[sampler, world, workers]

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
    reference = uninterrupted(sampler, 2, "--workers" in loading)
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



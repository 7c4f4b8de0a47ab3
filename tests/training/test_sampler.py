"""ResumableDistributedSampler: DistributedSampler's order from the start, any world size after."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

from slurmddp.training.sampler import ResumableDistributedSampler


def global_order(size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if not shuffle:
        return list(range(size))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g).tolist()


@pytest.mark.parametrize("size", [0, 1, 3, 8, 10, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_from_the_start_it_yields_what_distributed_sampler_yields(size, world, drop_last,
                                                                  shuffle):  # fmt: skip
    data = range(size)
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableDistributedSampler(data, world, rank, shuffle=shuffle, seed=5,
                                               drop_last=drop_last)  # fmt: skip
            theirs = DistributedSampler(data, world, rank, shuffle=shuffle, seed=5,
                                        drop_last=drop_last)  # fmt: skip
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 70),
    batch=st.integers(1, 4),
    new_world=st.sampled_from([1, 2, 3, 5]),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 4),
    data=st.data(),
)
def test_resume_at_another_world_size_continues_at_the_same_sample(
    size, batch, new_world, drop_last, shuffle, seed, epoch, data
):
    old_world = 4
    before = [ResumableDistributedSampler(range(size), old_world, r, shuffle=shuffle,
                                          seed=seed, drop_last=drop_last)
              for r in range(old_world)]  # fmt: skip
    for s in before:
        s.set_epoch(epoch)
    steps = data.draw(st.integers(0, len(before[0]) // batch), label="steps before the checkpoint")
    taken = [list(s)[: steps * batch] for s in before]
    consumed = steps * batch * old_world
    state = before[0].state_dict(consumed)
    assert state == {"epoch": epoch, "start": consumed, "seed": seed, "shuffle": shuffle,
                     "dataset_len": size}  # fmt: skip

    after = [ResumableDistributedSampler(range(size), new_world, r, shuffle=not shuffle,
                                         seed=seed + 1, drop_last=drop_last)
             for r in range(new_world)]  # fmt: skip
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # the usual call at the top of the epoch keeps the restored position
    rest_taken = [list(s) for s in after]
    assert len({len(t) for t in rest_taken}) == 1  # every rank runs the same number of steps
    assert [len(t) for t in rest_taken] == [len(s) for s in after]

    # Rank r held global positions r, r + W, ...: put both halves back in global order.
    first = [taken[i % old_world][i // old_world] for i in range(consumed)]
    second = [rest_taken[i % new_world][i // new_world]
              for i in range(len(rest_taken[0]) * new_world)]  # fmt: skip
    order = global_order(size, seed, epoch, shuffle)
    if consumed >= size:  # the old world finished the real samples and was into its padding
        assert first[:size] == order and second == []
        return
    assert first == order[:consumed]
    rest = order[consumed:]
    if drop_last:
        assert second == rest[: len(rest) - len(rest) % new_world]
    else:
        # Each remaining sample once, then fewer than new_world repeats from the rest's head.
        assert second[: len(rest)] == rest
        padding = second[len(rest):]
        assert len(padding) == (-len(rest)) % new_world
        assert padding == (rest * new_world)[: len(padding)]
        assert first + second[: len(rest)] == order  # nothing skipped, nothing repeated


def test_len_counts_what_this_rank_yields_from_start():
    for size, world, drop_last in [(10, 3, False), (10, 3, True), (7, 2, False), (5, 8, False)]:
        for start in range(size + 2):
            for rank in range(world):
                s = ResumableDistributedSampler(range(size), world, rank, drop_last=drop_last)
                s.set_epoch(1, start=start)
                assert len(s) == len(list(s)), (size, world, drop_last, start, rank)


def test_set_epoch_keeps_a_restored_position_only_for_its_epoch():
    saved = ResumableDistributedSampler(range(20), 2, 0, seed=1)
    saved.set_epoch(3)
    state = saved.state_dict(6)
    s = ResumableDistributedSampler(range(20), 1, 0, seed=1)
    s.load_state_dict(state)
    assert (s.epoch, s.start) == (3, 6)
    s.set_epoch(3)
    assert s.start == 6 and list(s) == global_order(20, 1, 3, True)[6:]
    s.set_epoch(3)  # once only: the next pass over epoch 3 starts from the beginning
    assert s.start == 0
    s.load_state_dict(state)
    s.set_epoch(4)
    assert s.start == 0
    s.set_epoch(4, start=5)
    assert s.start == 5 and len(s) == 15


def test_defaults_without_a_process_group_and_argument_checks():
    s = ResumableDistributedSampler(range(6))
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (1, 0, True, 0, False)
    with pytest.raises(ValueError, match=r"Invalid rank 2, rank should be in the interval \[0, 1"):
        ResumableDistributedSampler(range(6), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="start must be >= 0"):
        s.set_epoch(0, start=-1)
    state = ResumableDistributedSampler(range(7), 1, 0).state_dict(3)
    with pytest.raises(ValueError, match="ran over 7 samples but this dataset has 6"):
        s.load_state_dict(state)


def test_works_as_a_dataloader_sampler():
    s = ResumableDistributedSampler(range(10), 2, 1, shuffle=False)
    s.set_epoch(0, start=4)
    batches = [b.tolist() for b in DataLoader(list(range(10)), batch_size=2, sampler=s)]
    assert batches == [[5, 7], [9]]

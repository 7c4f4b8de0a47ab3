"""The hang judgement, from hand-written progress and stack headers."""

from __future__ import annotations

import pytest

from slurmddp.watchdog.layout import Progress
from slurmddp.watchdog.verdict import Watch, judge, ranks_text

IN_ALL_REDUCE = {"waiting": "a torch.distributed call", "site": "train.py:50 in step"}
SLEEPING = {"waiting": None, "site": "train.py:44 in step"}


def dump(rank: int, count: int = 7, collectives: int | None = 7, **where) -> dict:
    return {"rank": rank, "count": count, "collectives": collectives, **(where or IN_ALL_REDUCE)}


def progress(world: int) -> dict[int, Progress]:
    return {r: Progress(7, f"n{r // 2 + 1}") for r in range(world)}


def verdict(world, dumps):
    return judge(world, progress(world), dumps, 21, 20, "/out/1/hang/rank-<R>.txt")


def test_a_rank_that_did_not_answer_is_the_suspect_and_the_others_wait_for_it():
    v = verdict(4, {0: dump(0), 1: dump(1), 3: dump(3)})
    assert v.suspects == v.stuck == (2,)
    assert v.lines[0].startswith("slurmddp: no rank made progress for 21 s (hang timeout 20 s)")
    assert "rank 2 on n2 stopped progressing: it did not answer: its process is stopped" in (
        v.lines[1])
    assert v.lines[2] == "slurmddp: ranks 0-1,3 merely wait for it"
    assert v.lines[-1] == ("slurmddp: the stacks of every rank that answered: "
                           "/out/1/hang/rank-<R>.txt")


def test_a_rank_outside_any_wait_holds_those_inside_one():
    v = verdict(4, {0: dump(0), 1: dump(1, **SLEEPING), 2: dump(2), 3: dump(3)})
    assert v.suspects == v.stuck == (1,)
    assert "rank 1 on n1 stopped progressing: it is not waiting for another rank: it is in " \
           "train.py:44 in step" in v.lines[1]  # fmt: skip


def test_the_odd_one_out_of_a_dead_lock_is_named_with_where_it_and_the_others_are():
    checkpoint_wait = {"waiting": "a wait for every rank", "site": "train.py:56 in save"}
    dumps = {r: dump(r) for r in (0, 2, 3)} | {1: dump(1, count=8, **checkpoint_wait)}
    v = verdict(4, dumps)
    assert v.suspects == (1,)
    assert v.stuck == ()  # out of step is the code's path: no node is to blame
    assert ("rank 1 on n1 stopped progressing: it is at progress call 8 and collective 7, waiting "
            "in a wait for every rank, from train.py:56 in save, while the others are at progress "
            "call 7 and collective 7, waiting in a torch.distributed call, from train.py:50 in "
            "step") in v.lines[1]  # fmt: skip


@pytest.mark.parametrize("world, dumps, said", [
    (4, {r: dump(r) for r in range(4)}, "every rank is at the same place (progress call 7 and "
     "collective 7, waiting in a torch.distributed call, from train.py:50 in step)"),
    (2, {0: dump(0), 1: dump(1, count=8)}, "no majority is at the same place): rank 0: progress "
     "call 7 and collective 7, waiting in a torch.distributed call, from train.py:50 in step; "
     "rank 1: progress call 8"),
])  # fmt: skip
def test_when_no_rank_stands_out_none_is_named(world, dumps, said):
    v = verdict(world, dumps)
    assert v.suspects == ()
    assert said in v.lines[1] and "stopped progressing" not in "".join(v.lines)


def test_every_rank_but_one_sleeping_makes_every_sleeper_a_suspect_only_when_some_wait():
    # Nobody waits for anyone: rule 2 does not apply, and no majority disagrees.
    v = verdict(2, {0: dump(0, **SLEEPING), 1: dump(1, **SLEEPING)})
    assert v.suspects == ()


def test_a_rank_that_never_reported_is_named_as_such():
    v = judge(2, {0: Progress(3, "n1")}, {0: dump(0)}, 25, 20, "x")
    assert v.suspects == (1,)
    assert "rank 1 on an unknown node stopped progressing: it never reported after the " \
           "rendezvous" in v.lines[1]  # fmt: skip


def test_watch_judges_only_once_armed_and_never_after_the_work_is_done():
    w = Watch(20, now=0)
    w.observe({0: Progress(0, "n1"), 1: Progress(0, "n1")}, now=1)
    assert not w.hung(100)  # nobody reported progress: a script that never calls should_stop()
    w.observe({0: Progress(1, "n1"), 1: Progress(0, "n1")}, now=101)
    assert w.armed and not w.hung(120) and w.hung(121)
    assert w.idle_s(121) == 20
    w.observe({0: Progress(1, "n1", done=True), 1: Progress(0, "n1")}, now=130)
    assert not w.hung(1000)


def test_watch_from_the_start_judges_a_run_that_never_progressed():
    w = Watch(20, now=0, from_start=True)
    w.observe({0: Progress(0, "n1")}, now=1)
    assert not w.hung(20.5) and w.hung(21)


def test_any_change_of_any_rank_is_progress():
    w = Watch(20, now=0)
    w.observe({0: Progress(5, "n1"), 1: Progress(5, "n1")}, now=0)
    w.observe({0: Progress(5, "n1"), 1: Progress(6, "n1")}, now=19)
    assert not w.hung(30) and w.hung(39)


def test_ranks_text_compresses_runs():
    assert ranks_text([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ranks_text([3]) == "3"

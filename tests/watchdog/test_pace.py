"""Slow nodes, named: each rank's busy time a step, against the median rank's."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

from slurmddp.watchdog import monitor, pace, progress
from slurmddp.watchdog.layout import Layout, Progress


def test_busy_time_is_the_threads_time_run_and_waited_for_a_cpu(tmp_path):
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "schedstat").write_text("2000000000 500000000 7\n")
    assert pace.busy_s(41, tmp_path) == 2.5
    assert pace.busy_s(42, tmp_path) is None  # a thread that ended
    # A kernel that keeps no schedstat: nothing to measure, so nothing is named.
    (tmp_path / "41" / "schedstat").write_text("0 0 0\n")
    assert pace.busy_s(41, tmp_path) is None


def burn(seconds: float) -> None:
    start, block = time.thread_time(), bytes(1 << 16)
    while time.thread_time() - start < seconds:
        hashlib.sha256(block).digest()


def test_the_training_threads_busy_time_grows_with_its_work_and_not_another_threads():
    me = threading.get_native_id()
    before = pace.busy_s(me)
    assert before is not None
    burn(0.2)
    assert pace.busy_s(me) - before >= 0.2
    # A thread of the user's own computing beside it (an evaluation, a logger) while the training
    # thread waits: not the training's work.
    before = pace.busy_s(me)
    side = threading.Thread(target=burn, args=(0.3,))
    side.start()
    side.join()
    assert pace.busy_s(me) - before < 0.1


def test_a_pace_is_the_median_busy_and_wall_time_a_step_of_the_last_periods():
    p = pace.Pace()
    assert p.update(0, 10.0, 100.0) is None  # nothing to divide yet
    assert p.update(10, 11.0, 102.0) == pytest.approx((0.1, 0.2))
    assert p.update(10, 12.0, 103.0) == pytest.approx((0.1, 0.2))  # no step made: no new measure
    # The 10 steps since step 10 at 102 s, the pause without a step included.
    assert p.update(20, 14.0, 105.0) == pytest.approx((0.2, 0.25))
    assert p.update(30, 24.0, 115.0) == pytest.approx((0.3, 0.3))  # medians of three periods
    assert p.update(40, 25.0, 116.0) == pytest.approx((0.3, 0.3))  # the window: the last three
    assert p.update(50, None, 117.0) is None  # a kernel that stopped saying


def _look(paces, nodes=None, step=0.25):
    return {r: Progress(100, (nodes or {}).get(r, f"n{r // 2 + 1}"), False, v,
                        None if v is None else step)
            for r, v in paces.items()}  # fmt: skip


def test_a_node_whose_ranks_are_busy_twice_the_median_is_slow():
    slow = pace.slow_now(_look({0: 0.05, 1: 0.05, 2: 0.20, 3: 0.16, 4: 0.05, 5: 0.06}))
    assert [(s.node, s.ranks) for s in slow] == [("n2", (2, 3))]
    assert slow[0].factor == pytest.approx(4.0)  # its slowest rank against the median rank
    assert slow[0].share == pytest.approx(0.6)  # 150 ms of each 250 ms step
    assert slow[0].line() == (
        "n2 is slow: ranks 2,3 on it are busy 4.0 times as long a step as the median rank (200 ms "
        "against 50 ms: running, or waiting for a CPU), and every rank waits for it: 60% of each "
        "step of 250 ms")
    assert slow[0].why() == ("its ranks busy 4.0 times as long a step as the median rank, 60% of "
                             "each step")  # fmt: skip
    # Of two ranks the faster is the reference, so the slow one is named.
    assert [s.node for s in pace.slow_now(_look({0: 0.01, 1: 0.08}, {0: "a", 1: "b"}))] == ["b"]


@pytest.mark.parametrize("paces, step", [
    ({0: 0.05, 1: 0.09, 2: 0.05, 3: 0.05}, 0.25),  # under twice the median
    ({0: 0.0001, 1: 0.0009, 2: 0.0001, 3: 0.0001}, 0.001),  # nine times, but under 10 ms more
    # Twice and 14 ms more, but of a 125 ms step (most of it asleep): 11% of it, under a fifth.
    # What CI's loaded machine made of rank 0 of a job sleeping 0.1 s a step (fresh run 30).
    ({0: 0.0245, 1: 0.0103}, 0.125),
    ({0: 0.05}, 0.25),  # one rank: nothing to compare
    ({0: None, 1: 0.5}, 0.25),  # one rank with a pace
    ({0: 0.0, 1: 0.0, 2: 0.3}, 0.25),  # a median of nothing
])  # fmt: skip
def test_nothing_is_named_slow_without_a_clear_difference(paces, step):
    assert pace.slow_now(_look(paces, step=step)) == []


def test_a_node_is_named_once_after_three_slow_looks_and_again_after_it_recovered():
    w = pace.Watch()
    slow, fine = _look({0: 0.05, 1: 0.05, 2: 0.2}), _look({0: 0.05, 1: 0.05, 2: 0.05})
    assert [w.observe(slow) for _ in range(2)] == [[], []]
    assert [s.node for s in w.observe(slow)] == ["n2"]
    assert w.observe(slow) == [] and w.observe(slow) == []  # named once
    assert w.observe(fine) == [] and w.named == {} and list(w.ever) == ["n2"]
    assert w.observe(slow) == [] and w.observe(slow) == []
    assert [s.node for s in w.observe(slow)] == ["n2"]  # slow again: named again
    # A look in between that does not find it slow starts its count again.
    w = pace.Watch()
    for look in (slow, slow, fine, slow, slow):
        assert w.observe(look) == []


def test_a_rank_publishes_its_busy_time_a_step_once_it_has_one(tmp_path, monkeypatch):
    where = Layout(tmp_path / "hang", "0")
    reporter = progress.Reporter(where, 20, 1, "n2")
    busy = iter([5.0, 5.5, 6.5])
    clock = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    asked = []
    monkeypatch.setattr(pace, "busy_s", lambda thread: asked.append(thread) or next(busy))
    monkeypatch.setattr(progress, "_count", 0)
    where.progress(1).parent.mkdir(parents=True)
    assert reporter.publish()
    assert Progress.parse(where.progress(1).read_text()) == Progress(0, "n2")
    monkeypatch.setattr(progress, "_count", 10)
    assert reporter.publish()
    assert Progress.parse(where.progress(1).read_text()) == Progress(10, "n2", False, 0.05, 0.1)
    assert not reporter.publish()  # no step since: nothing new, nothing measured
    monkeypatch.setattr(progress, "_count", 20)
    assert reporter.publish()
    published = Progress.parse(where.progress(1).read_text())
    assert (published.pace_s, published.step_s) == pytest.approx((0.075, 0.15))
    assert set(asked) == {threading.get_native_id()}  # the thread that armed it: the training's


def test_the_monitor_names_a_slow_node_in_the_log_the_story_and_the_runs_slow_file(
        tmp_path, monkeypatch, capsys):  # fmt: skip
    events_file = tmp_path / "events.jsonl"
    monkeypatch.setenv("SLURMDDP_EVENTS_FILE", str(events_file))
    where = Layout(tmp_path / "hang", "0")
    where.state.mkdir(parents=True)
    w = pace.Watch()
    for _ in range(3):
        fresh = w.observe(_look({0: 0.05, 1: 0.05, 2: 0.2, 3: 0.05}))
    monitor._name_slow(where, fresh, w.ever)
    assert capsys.readouterr().err == f"slurmddp: {fresh[0].line()}\n"
    assert where.slow.read_text() == (
        "n2 its ranks busy 4.0 times as long a step as the median rank, 60% of each step\n")
    event = json.loads(events_file.read_text())
    assert [event[k] for k in ("kind", "node", "ranks", "factor")] == ["slow", "n2", [2], 4.0]
    # The file cannot be written: said, and the watchdog goes on.
    monkeypatch.setattr(monitor.files, "write_atomically",
                        lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    monitor._name_slow(where, [], w.ever)
    assert capsys.readouterr().err == f"slurmddp: cannot write {where.slow}: Permission denied\n"

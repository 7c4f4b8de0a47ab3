"""Slow nodes, named: each rank's busy time a step, against the median rank's."""

from __future__ import annotations

import hashlib
import json

import pytest

from slurmddp.watchdog import monitor, pace, progress
from slurmddp.watchdog.layout import Layout, Progress


def _tasks(tmp_path, **threads):
    for name, stat in threads.items():
        (tmp_path / name).mkdir()
        if stat is not None:
            (tmp_path / name / "schedstat").write_text(stat)
    return tmp_path


def test_busy_time_is_every_threads_time_run_and_waited_for_a_cpu(tmp_path):
    tasks = _tasks(tmp_path, a="2000000000 500000000 7\n", b="1000000000 0 3\n", c=None)
    assert pace.busy_s(tasks) == 3.5  # c ended as it was read: left out
    assert pace.busy_s(tmp_path / "absent") is None
    # A kernel that keeps no schedstat: nothing to measure, so nothing is named.
    (tmp_path / "none").mkdir()
    assert pace.busy_s(_tasks(tmp_path / "none", x="0 0 0\n")) is None


def test_this_processs_busy_time_grows_with_the_work_it_does():
    before = pace.busy_s()
    assert before is not None
    work = bytes(1 << 20)
    for _ in range(200):
        hashlib.sha256(work).digest()
    assert pace.busy_s() - before >= 0.05  # 200 MiB hashed: well over 50 ms of a CPU


def test_a_pace_is_the_median_busy_time_a_step_of_the_last_periods():
    p = pace.Pace()
    assert p.update(0, 10.0) is None  # nothing to divide yet
    assert p.update(10, 11.0) == pytest.approx(0.1)
    assert p.update(10, 12.0) == pytest.approx(0.1)  # no step made: no new measure
    assert p.update(20, 14.0) == pytest.approx(0.15)  # 2 s for the 10 steps since 10 at 11 s
    assert p.update(30, 24.0) == pytest.approx(0.2)  # median of 0.1, 0.2, 1.0
    assert p.update(40, 25.0) == pytest.approx(0.2)  # the window keeps the last three
    assert p.update(50, None) is None  # a kernel that stopped saying


def _look(paces, nodes=None):
    return {r: Progress(100, (nodes or {}).get(r, f"n{r // 2 + 1}"), False, v)
            for r, v in paces.items()}  # fmt: skip


def test_a_node_whose_ranks_are_busy_twice_the_median_is_slow():
    slow = pace.slow_now(_look({0: 0.05, 1: 0.05, 2: 0.20, 3: 0.16, 4: 0.05, 5: 0.06}))
    assert [(s.node, s.ranks) for s in slow] == [("n2", (2, 3))]
    assert slow[0].factor == pytest.approx(4.0)  # its slowest rank against the median rank
    assert slow[0].line() == (
        "n2 is slow: ranks 2,3 on it are busy 4.0 times as long a step as the median rank (200 ms "
        "against 50 ms: running, or waiting for a CPU), and every rank waits for it at each "
        "collective")
    # Of two ranks the faster is the reference, so the slow one is named.
    assert [s.node for s in pace.slow_now(_look({0: 0.01, 1: 0.03}, {0: "a", 1: "b"}))] == ["b"]


@pytest.mark.parametrize("paces", [
    {0: 0.05, 1: 0.09, 2: 0.05, 3: 0.05},  # under twice the median
    {0: 0.0001, 1: 0.0009, 2: 0.0001, 3: 0.0001},  # nine times, but under 2 ms more: noise
    {0: 0.05},  # one rank: nothing to compare
    {0: None, 1: 0.5},  # one rank with a pace
    {0: 0.0, 1: 0.0, 2: 0.3},  # a median of nothing
])  # fmt: skip
def test_nothing_is_named_slow_without_a_clear_difference(paces):
    assert pace.slow_now(_look(paces)) == []


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
    monkeypatch.setattr(pace, "busy_s", lambda: next(busy))
    monkeypatch.setattr(progress, "_count", 0)
    where.progress(1).parent.mkdir(parents=True)
    assert reporter.publish()
    assert Progress.parse(where.progress(1).read_text()) == Progress(0, "n2")
    monkeypatch.setattr(progress, "_count", 10)
    assert reporter.publish()
    assert Progress.parse(where.progress(1).read_text()) == Progress(10, "n2", False, 0.05)
    assert not reporter.publish()  # no step since: nothing new, nothing measured
    monkeypatch.setattr(progress, "_count", 20)
    assert reporter.publish()
    assert Progress.parse(where.progress(1).read_text()).pace_s == pytest.approx(0.075)


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
        "n2 its ranks busy 4.0 times as long a step as the median rank\n")
    event = json.loads(events_file.read_text())
    assert [event[k] for k in ("kind", "node", "ranks", "factor")] == ["slow", "n2", [2], 4.0]
    # The file cannot be written: said, and the watchdog goes on.
    monkeypatch.setattr(monitor.files, "write_atomically",
                        lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    monitor._name_slow(where, [], w.ever)
    assert capsys.readouterr().err == f"slurmddp: cannot write {where.slow}: Permission denied\n"

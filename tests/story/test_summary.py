"""A job's story in numbers: runs, requeues, steps and time lost by cause, goodput."""

from __future__ import annotations

import pytest

from slurmddp.story import summary


def ev(t, kind, run=0, **fields):
    return {"t": float(t), "kind": kind, "run": run, **fields}


# Run 1: starts at 0, its first step ends at 10, then 10 steps/s; preempted: the stop agreed at
# call 101 (t=20), checkpointed, requeued at t=25. Run 2: starts at 40 (15 s queued), resumes at
# step 101, first step at 45; crashes at t=65, the slowest rank's last count 151 (step 252), the
# last checkpoint step 201's. Run 3: starts at 70, resumes at step 201, first step at 75, done
# at call 101 (t=85), ends at 86.
STORY = [
    ev(0, "run", nodes="n[1-2]"), ev(10, "training", step=1),
    ev(15, "progress", counts={"0": 52, "1": 51}, nodes={"0": "n1", "1": "n2"}),
    ev(20, "stop", signal="USR2", step=101, calls=101),
    ev(21, "checkpoint", step=101, seconds=1.0, path="/c/step-101", bytes=10),
    ev(25, "decision", action="requeue", cause="preempted", requeue=1, allowed=3),
    ev(40, "run", 1, nodes="n[1-2]"), ev(44, "resumed", 1, step=101, source="/c/step-101"),
    ev(45, "training", 1, step=102), ev(55, "checkpoint", 1, step=201, path="/c/step-201"),
    ev(60, "progress", 1, counts={"0": 152, "1": 151}),
    ev(65, "decision", 1, action="requeue", cause="crash", requeue=2, allowed=3),
    ev(70, "run", 2, nodes="n[2-3]"), ev(74, "resumed", 2, step=201, source="/c/step-201"),
    ev(75, "training", 2, step=202), ev(85, "done", 2, step=302, calls=101),
    ev(86, "decision", 2, action="done", cause="finished"),
]


def test_a_preempted_then_crashed_job_in_numbers():
    s = summary.summarize(STORY, now=1000)
    assert (s.runs, s.requeues, s.ended, s.step) == (3, 2, True, 302)
    # The crash lost the steps past the checkpoint the next run resumed at: 252 - 201.
    assert s.steps_lost == {"crash": 51}
    assert s.held_s == 25 + 25 + 16
    # 10 steps/s in every run: 101 + 100 + 101 steps kept.
    assert s.productive_s == pytest.approx(30.2)
    assert s.goodput == pytest.approx(30.2 / 66)
    # Start-up ends where the first step began (0.1 s before it ended).
    assert s.time_lost_s == pytest.approx({"startup": 9.9 + 4.9 + 4.9, "preempted": 5,
                                           "crash": 10.1, "finishing": 1})
    assert sum(s.time_lost_s.values()) + s.productive_s == pytest.approx(s.held_s)
    assert s.elapsed_s == 86  # the 20 s between runs count to completion, not as held
    assert s.last_checkpoint == {"step": 201, "path": "/c/step-201", "t": 55.0}
    assert s.lines()[0] == "3 runs, 2 requeues, 302 steps, 86 s from start to end"
    assert "51 (crash)" in s.lines()[1] and s.lines()[2].startswith("goodput: 45.8%")


def test_the_slowest_rank_sets_the_pace():
    runs = summary.runs(STORY)
    assert [r.reached for r in runs] == [101, 252, 302]
    assert runs[1].counts[-1] == (60.0, 151)  # rank 1's count, not rank 0's


def test_a_running_job_counts_to_now_and_has_lost_nothing_yet():
    s = summary.summarize(STORY[:3], now=30)
    assert (s.runs, s.requeues, s.ended, s.step, s.held_s) == (1, 0, False, 51, 30)
    assert s.time_lost_s == pytest.approx({"startup": 9.9}) and s.steps_lost == {}


def test_without_a_rate_goodput_is_unknown_not_invented():
    story = [ev(0, "run"), ev(3, "training", step=1),
             ev(5, "decision", action="requeue", cause="preempted"),
             ev(9, "run", 1), ev(12, "decision", 1, action="finished", cause="finished")]
    s = summary.summarize(story, now=100)
    assert s.goodput is None and s.productive_s is None and s.step == 1
    assert s.to_dict()["goodput"] is None and "unknown" in s.lines()[2]
    assert summary.summarize([], now=5).to_dict()["runs"] == 0


def test_a_script_without_the_stop_protocol_gets_its_runs_only():
    story = [ev(0, "run"), ev(12, "decision", action="finished", cause="finished")]
    said = summary.summarize(story, now=100).lines()
    assert said == ["1 run, 0 requeues, 12 s from start to end"]

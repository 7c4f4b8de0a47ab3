"""The job's events file: appended by several processes at once, read back whole lines only,
said in words; never a failure of the training."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from slurmddp.protocol import EVENTS_FILE_VAR
from slurmddp.story import events


def _writer(path: str, who: int, n: int) -> None:
    env = {EVENTS_FILE_VAR: path, "SLURM_RESTART_COUNT": "2"}
    for i in range(n):
        events.emit("progress", env, who=who, i=i, pad="x" * 300)


def test_lines_of_processes_writing_at_once_never_interleave(tmp_path):
    path = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), who, 300)) for who in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    told = events.read(path)
    assert len(told) == 1200 and len(path.read_text().splitlines()) == 1200
    for who in range(4):  # each writer's lines complete and in its order
        assert [e["i"] for e in told if e["who"] == who] == list(range(300))
    assert {e["run"] for e in told} == {2}


def test_outside_a_job_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    events.emit("stop", {}, signal="USR2")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, capsys,
                                                                         monkeypatch):  # fmt: skip
    monkeypatch.setattr("slurmddp.errors._said", set())
    env = {EVENTS_FILE_VAR: str(tmp_path / "missing" / "events.jsonl")}
    events.emit("stop", env)
    events.emit("checkpoint", env)
    err = capsys.readouterr().err
    assert err.count("cannot write the job's events") == 1 and "the job goes on" in err


def test_a_reader_takes_whole_lines_only_and_skips_torn_and_foreign_ones(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "kind": "run", "run": 0}\nnot json\n[1, 2]\n{"t": 2, "kind": "st')
    tail = events.Tail(path)
    assert [e["kind"] for e in tail.new()] == ["run"]
    with path.open("a") as f:
        f.write('op", "run": 0}\n')  # the line being written is finished
    assert [e["kind"] for e in tail.new()] == ["stop"]
    assert tail.new() == []
    assert events.read(tmp_path / "none.jsonl") == []


@pytest.mark.parametrize(("event", "said"), [
    ({"kind": "run", "run": 1, "nodes": "n[1-2]"}, "run 2 started on n[1-2]"),
    ({"kind": "stop", "signal": "USR2", "step": 42}, "stop requested (USR2 received): every rank "
                                                     "stops after step 42"),
    ({"kind": "stop", "self": True, "step": 7}, "stop requested (the time limit is near and no "
                                                "signal came): every rank stops after step 7"),
    ({"kind": "checkpoint", "step": 42, "bytes": 1_500_000, "seconds": 2.04, "path": "/c/s"},
     "checkpoint of step 42 written (1.5 MB, 2.0 s): /c/s"),
    ({"kind": "resumed", "step": 42, "source": "/c/s"}, "resumed at step 42 from /c/s"),
    ({"kind": "decision", "action": "requeue", "requeue": 1, "allowed": 3, "cause": "preempted",
      "left_behind": "n2: hung"}, "requeued (1 of 3): preempted; n2: hung left behind"),
    ({"kind": "decision", "run": 2, "action": "fail", "status": 124, "cause": "hang"},
     "run 3 ended: hang (exit status 124)"),
    ({"kind": "progress", "counts": {"0": 3}}, None),
])  # fmt: skip
def test_each_event_in_words(event, said):
    assert events.describe({"t": 0, **event}) == said


def test_the_job_has_ended_only_once_a_decision_ends_it_and_no_run_follows():
    run = {"kind": "run", "t": 0}
    requeue = {"kind": "decision", "action": "requeue", "t": 1}
    finished = {"kind": "decision", "action": "finished", "t": 2}
    assert not events.ended([run, requeue]) and not events.ended([run, requeue, run])
    assert events.ended([run, requeue, run, finished])
    assert json.loads(json.dumps(finished)) == finished
    assert os.environ.get(EVENTS_FILE_VAR) is None  # the suite's own process is in no job


def test_a_run_that_left_no_decision_is_told_by_its_nodes():
    told = [{"kind": "run", "run": 0, "nodes": "n[1-2]"}, {"kind": "training", "run": 0},
            {"kind": "run", "run": 1, "nodes": "n[2-3]"},
            {"kind": "decision", "run": 1, "action": "requeue"}]  # fmt: skip
    assert events.undecided(told, 0) == "n[1-2]"  # Slurm took the job from it
    assert events.undecided(told, 1) is None  # it decided
    assert events.undecided(told, 2) is None and events.undecided(told, -1) is None

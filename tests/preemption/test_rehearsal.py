"""The local emulation's rehearsed stop, counted from training's first step."""

from __future__ import annotations

import os
import signal
import time

import pytest

from slurmddp.preemption import rehearsal
from slurmddp.protocol import (
    LOCAL_BATCH_PID_VAR,
    LOCAL_REHEARSAL_VAR,
    LOCAL_STATE_VAR,
    SIGNAL_VAR,
)


@pytest.mark.parametrize(("text", "parsed"), [
    ("20", ("seconds", 20.0)), ("2.5s", ("seconds", 2.5)), ("0", ("seconds", 0.0)),
    ("50steps", ("steps", 50.0)), (" 7steps ", ("steps", 7.0)),
    ("soon", None), ("-1", None), ("inf", None), ("2.5steps", None), ("steps", None), ("", None),
])  # fmt: skip
def test_seconds_or_steps(text, parsed):
    assert rehearsal.parse(text) == parsed


@pytest.fixture
def taken(monkeypatch):
    """The signals this process takes (it stands for the emulated batch job)."""
    got: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    yield got
    signal.signal(signal.SIGUSR1, old)


def env(tmp_path, asked: str) -> dict[str, str]:
    return {LOCAL_REHEARSAL_VAR: asked, LOCAL_BATCH_PID_VAR: str(os.getpid()),
            LOCAL_STATE_VAR: str(tmp_path), SIGNAL_VAR: "USR1"}  # fmt: skip


def test_after_n_steps_the_stop_signal_goes_to_the_batch_job_once_a_run(tmp_path, taken):
    armed = rehearsal.arm(env(tmp_path, "3steps"))
    assert armed is not None
    armed.step(2)
    assert taken == []
    armed.step(3)
    armed.step(4)
    assert taken == [signal.SIGUSR1]
    # A worker torchrun restarts within the same run arms nothing: the run had its stop.
    assert rehearsal.arm(env(tmp_path, "3steps")) is None


def test_after_s_seconds_from_the_first_step(tmp_path, taken):
    rehearsal.arm(env(tmp_path, "0.2"))
    deadline = time.monotonic() + 30
    while not taken and time.monotonic() < deadline:
        time.sleep(0.01)
    assert taken == [signal.SIGUSR1]


def test_nothing_outside_a_local_job_that_asked():
    assert rehearsal.arm({}) is None
    assert rehearsal.arm({LOCAL_REHEARSAL_VAR: "3steps"}) is None  # no batch job to tell

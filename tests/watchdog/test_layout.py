"""The watchdog's settings and files."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmddp.errors import UserError
from slurmddp.watchdog import layout
from slurmddp.watchdog.layout import Layout, Progress


@pytest.mark.parametrize("timeout, period", [(600, 30.0), (20, 2.0), (5, 1.0), (3600, 30.0)])
def test_the_period_is_a_tenth_of_the_timeout_within_bounds(timeout, period):
    assert layout.period_s(timeout) == period


def test_settings_come_from_the_environment():
    assert layout.from_env({}) is None  # no directory: no watchdog
    where, timeout = layout.from_env({"SLURMDDP_HANG_DIR": "/o/7/hang", "SLURM_RESTART_COUNT": "2",
                                      "TORCHELASTIC_RUN_ID": "7.2",
                                      "TORCHELASTIC_RESTART_COUNT": "1"})  # fmt: skip
    assert (where, timeout) == (Layout(Path("/o/7/hang"), "2.1"), 600.0)
    assert where.progress(3) == Path("/o/7/hang/.state/2.1/progress/rank-3")
    assert where.stacks(3) == Path("/o/7/hang/rank-3.txt")
    assert layout.from_env({"SLURMDDP_HANG_DIR": "/o", "SLURMDDP_HANG_TIMEOUT": "0"}) is None
    assert layout.from_env({"SLURMDDP_HANG_DIR": "/o", "SLURMDDP_HANG_TIMEOUT": "20"})[1] == 20


@pytest.mark.parametrize("text", ["ten", "-1", "inf", "nan"])
def test_a_bad_timeout_is_one_clear_error(text):
    with pytest.raises(UserError, match=rf"SLURMDDP_HANG_TIMEOUT='{text}' is not a number of "
                       "seconds: give one such as 600, or 0 for no hang watchdog"):  # fmt: skip
        layout.timeout_s({"SLURMDDP_HANG_TIMEOUT": text})


def test_progress_round_trips_and_refuses_what_it_did_not_write():
    for p in (Progress(0, "n1"), Progress(12, "gpu-a17", done=True),
              Progress(3, "n2", False, 0.25, 0.5)):  # fmt: skip
        assert Progress.parse(p.text()) == p
    assert Progress.parse("") is None and Progress.parse("x n1 running") is None
    # A pace that is not a number of seconds is no pace: the count still counts.
    for bad in ("nan 0.5", "0.5 inf", "-1 0.5", "fast 0.5"):
        assert Progress.parse(f"3 n2 running {bad}") == Progress(3, "n2")

"""The integrations' tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_stop_protocol_in_pytests_process(monkeypatch):
    """The integrations' objects install the stop protocol as they are made (its signal handler,
    the DataLoader workers' shield): not in the process that every other test shares. Their
    programs, run as processes of their own, install it."""
    from slurmddp.preemption import api

    monkeypatch.setattr(api, "install", lambda environ=None: ())

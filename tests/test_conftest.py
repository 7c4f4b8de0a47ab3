"""The suite's own helpers (tests/conftest.py)."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.conftest import _PROJECT_PORTS, free_port


def test_free_port_is_bindable_and_never_ephemeral_nor_the_projects():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = free_port()
        assert not low <= port <= high and port not in _PROJECT_PORTS, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

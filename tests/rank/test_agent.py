"""slurmddp.agent: the rendezvous port it derives, and the stop signal it relays to workers."""

from __future__ import annotations

import pytest

from slurmddp.rank.agent import with_rdzv_port
from slurmddp.rank.env import derive_port

JOB = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rdzv-endpoint=n1", "-m", "x"], [f"--rdzv-endpoint=n1:{derive_port(4242)}", "-m", "x"]),
        (["--rdzv_endpoint", "n1", "t.py"], ["--rdzv_endpoint", f"n1:{derive_port(4242)}", "t.py"]),
        (["--rdzv-endpoint=n1:29500", "t.py"], ["--rdzv-endpoint=n1:29500", "t.py"]),
        (["--rdzv-endpoint=[fe80::1]", "t.py"], [f"--rdzv-endpoint=[fe80::1]:{derive_port(4242)}",
                                                  "t.py"]),
        (["t.py", "--", "--rdzv-endpoint=n1"], ["t.py", "--", "--rdzv-endpoint=n1"]),
    ],
    ids=["equals", "separate", "port-given", "ipv6", "script-argument"],
)  # fmt: skip
def test_a_rendezvous_endpoint_without_a_port_gets_the_jobs_own(argv, expected):
    assert with_rdzv_port(argv, JOB) == expected


def test_two_jobs_sharing_a_node_rendezvous_on_different_ports():
    first = with_rdzv_port(["--rdzv-endpoint=n1"], JOB)
    second = with_rdzv_port(["--rdzv-endpoint=n1"], JOB | {"SLURM_JOB_ID": "4243"})
    assert first != second


def test_outside_a_slurm_job_the_endpoint_is_left_to_torchrun():
    assert with_rdzv_port(["--rdzv-endpoint=n1"], {}) == ["--rdzv-endpoint=n1"]

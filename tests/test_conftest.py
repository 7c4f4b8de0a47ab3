"""The suite's own helpers (tests/conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import _PROJECT_PORTS, free_port


def test_free_port_is_bindable_and_never_ephemeral_nor_the_projects():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = free_port()
        assert not low <= port <= high and port not in _PROJECT_PORTS, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_never_hands_one_port_twice_across_processes(tmp_path):
    """Two pytests side by side (scripts/test's passes) must not pick the same port before either
    binds it: by chance alone, 300 picks among the 8,512 ports this machine leaves repeat one in
    all but one run of 200."""
    pick = "from tests.conftest import free_port; print(*(free_port() for _ in range(100)))"
    procs = [subprocess.Popen([sys.executable, "-c", pick], stdout=subprocess.PIPE, text=True,
                              cwd=tmp_path) for _ in range(2)]
    ours = [free_port() for _ in range(100)]
    theirs = [int(port) for p in procs for port in p.communicate(timeout=120)[0].split()]
    assert all(p.returncode == 0 for p in procs)
    assert len(theirs) == 200 and len(set(ours + theirs)) == 300


# A session of its own, in two modules: a module's shared jobs outlive each of its tests and end
# with the module; a failed test's job and the node it drained are gone before the next test.
SHARED = '''
import pytest

pytestmark = pytest.mark.cluster
SLEEP = ["sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "sleep 600"]


def queued(cluster):
    return cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()


@pytest.fixture(scope="module")
def shared_job(slurm_cluster):
    return slurm_cluster.run(SLEEP).stdout.strip()


def test_reads_the_shared_job(slurm_cluster, shared_job):
    assert shared_job in queued(slurm_cluster)


def test_still_finds_the_shared_job_and_fails_leaving_its_own(slurm_cluster, shared_job):
    assert shared_job in queued(slurm_cluster)
    own = slurm_cluster.run(SLEEP + ["--nodelist=n4"]).stdout.strip()
    slurm_cluster.run(["scontrol", "update", "NodeName=n4", "State=DRAIN", "Reason=test"])
    print("JOBS", shared_job, own)
    raise AssertionError("fails on purpose")
'''
AFTER = '''
import pytest

pytestmark = pytest.mark.cluster


def test_no_job_runs_or_waits_and_every_node_is_in_service(slurm_cluster):
    waiting = slurm_cluster.run(["squeue", "-h", "-t", "PD,R", "-o", "%i"]).stdout
    assert waiting.split() == []
    nodes = slurm_cluster.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"]).stdout
    assert len(nodes.split()) == 8 and not {"drain", "drng", "down"} & set(nodes.split()), nodes
'''


@pytest.mark.cluster
def test_a_failed_cluster_test_leaves_no_job_and_no_drained_node(slurm_cluster, tmp_path):
    (tmp_path / "test_a_shared.py").write_text(SHARED)
    (tmp_path / "test_b_after.py").write_text(AFTER)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p",
                        "no:cacheprovider", "-rA", "-q", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "1 failed, 2 passed" in r.stdout, r.stdout + r.stderr
    assert "test_still_finds_the_shared_job_and_fails_leaving_its_own" in r.stdout, r.stdout

"""MPI launchers for real: Open MPI's mpirun, MPICH's Hydra, mpi4py sharing rank 0's address."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slurmddp.rank import mpi
from tests.conftest import PROGRAMS, launcher_free_env, tagged_json

pytestmark = pytest.mark.mpi

PROBE = str(PROGRAMS / "probe.py")
# Root may run mpirun only when it says so; four ranks on two cores oversubscribe them.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=launcher_free_env(OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def values(probes: list[dict], *names: str) -> list[tuple]:
    """Per rank (in rank order), the exported values named."""
    ordered = sorted(probes, key=lambda p: p["rank"])
    return [tuple(p["env"][n] for n in names) for p in ordered]


def test_mpirun_on_one_host_places_every_rank():
    r = run([*MPIRUN, "-np", "4", sys.executable, "-m", "slurmddp.run", PROBE, "a b"])
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "OMPI_COMM_WORLD_RANK")  # fmt: skip
    assert values(probes, *names) == [(str(i), str(i), "4", "4", "0", str(i)) for i in range(4)]
    assert {p["all_reduce"] for p in probes} == {10.0}
    assert {p["env"]["MASTER_ADDR"] for p in probes} == {"127.0.0.1"}
    assert all(p["argv"] == ["a b"] for p in probes)


@pytest.mark.parametrize(
    ("mapping", "np", "expected"),
    [
        # (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE) in rank order
        ("slot", 4, [("0", "0", "2", "0", "2"), ("1", "1", "2", "0", "2"),
                     ("2", "0", "2", "1", "2"), ("3", "1", "2", "1", "2")]),
        ("node", 4, [("0", "0", "2", "0", "2"), ("1", "0", "2", "1", "2"),
                     ("2", "1", "2", "0", "2"), ("3", "1", "2", "1", "2")]),
        ("uneven", 3, [("0", "0", "2", "0", "2"), ("1", "1", "2", "0", "2"),
                       ("2", "0", "1", "1", "2")]),
    ],
)  # fmt: skip
@pytest.mark.ranks
def test_across_hosts_outside_slurm_the_ranks_say_where_they_run(mapping, np, expected):
    # mpi_two_hosts.py makes mpirun's variables say two hosts; the rest is real.
    r = run([*MPIRUN, "-np", str(np), sys.executable, str(PROGRAMS / "mpi_two_hosts.py"),
             mapping, PROBE])  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    assert values(probes, "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE") == expected  # fmt: skip
    masters = {(p["env"]["MASTER_ADDR"], p["env"]["MASTER_PORT"]) for p in probes}
    assert len(masters) == 1 and masters.pop()[0] == "localhost"  # rank 0's node
    assert {p["all_reduce"] for p in probes} == {np * (np + 1) / 2}


@pytest.mark.parametrize(
    ("local_rank", "extra", "says"),
    [
        ("1", {}, "or set MASTER_ADDR"),  # block placement, but where is rank 0?
        ("0", {"MASTER_ADDR": "head"}, "mpirun placed the ranks round-robin or unevenly"),
    ],
)
def test_across_hosts_without_mpi4py_the_error_says_what_to_do(local_rank, extra, says):
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "from slurmddp import run; sys.exit(run.main(sys.argv[1:]))")  # fmt: skip
    fake = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    r = run([sys.executable, "-c", code, PROBE], **fake, **extra)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "pip install 'slurmddp[mpi]'" in r.stderr and says in r.stderr, r.stderr


def test_mpich_hydra_launches_every_rank():
    # mpi4py is built for Open MPI here, so Hydra's ranks get MASTER_ADDR given.
    r = run(["mpiexec.hydra", "-n", "3", sys.executable, "-m", "slurmddp.run", PROBE],
            MASTER_ADDR="127.0.0.1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    probes = tagged_json(r.stdout, "PROBE ")
    assert values(probes, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE") == [
        (str(i), str(i), "3", "3") for i in range(3)]
    assert {p["all_reduce"] for p in probes} == {6.0}


@pytest.mark.parametrize("launcher", [[*MPIRUN, "-np", "3"], ["mpiexec.hydra", "-n", "3"]],
                         ids=["mpirun", "hydra"])  # fmt: skip
@pytest.mark.ranks
def test_doctor_check_under_mpi_launchers(launcher):
    r = run([*launcher, sys.executable, "-m", "slurmddp", "doctor", "--check"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 ranks, 1 nodes, backend gloo, launcher mpi" in r.stdout
    assert "all checks passed" in r.stdout


@pytest.mark.ranks
def test_backend_mpi_without_torch_mpi_says_what_works_instead():
    code = "import slurmddp; slurmddp.init(backend='mpi')"
    r = run([*MPIRUN, "-np", "1", sys.executable, "-c", code])
    assert r.returncode != 0
    assert "this torch build has no MPI backend" in r.stderr


def test_abort_ends_the_mpi_job_only_where_this_process_started_mpi(monkeypatch):
    called = []

    class World:
        def Abort(self, status):
            called.append(status)

    class FakeMPI:
        COMM_WORLD = World()
        started, ended = True, False

        @classmethod
        def Is_initialized(cls):
            return cls.started

        @classmethod
        def Is_finalized(cls):
            return cls.ended

    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    mpi.abort(1)  # MPI never imported: nothing
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", FakeMPI)
    FakeMPI.started = False
    mpi.abort(1)  # imported, never started: nothing
    FakeMPI.started, FakeMPI.ended = True, True
    mpi.abort(1)  # already finalized: nothing
    FakeMPI.ended = False
    mpi.abort(3)
    assert called == [3]

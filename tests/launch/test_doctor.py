"""slurmddp.launch.doctor: the shared memory warning (the checks themselves: test_process_group)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from slurmddp.launch.doctor import shm_problem
from tests.conftest import launcher_free_env

MIB = 1 << 20


@pytest.mark.parametrize(
    ("space", "says"),
    [
        ((24 << 30, 24 << 30), None),
        ((1 << 30, 1 << 30), None),
        ((64 * MIB, 60 * MIB), "/dev/shm has 60 MiB free of 64 MiB; NCCL between the GPUs of a "
                               "node and DataLoader workers need 1 GiB or more"),
        ((32 << 30, 100 * MIB), "/dev/shm has 100 MiB free of 32768 MiB"),  # full, not small
        (None, "/dev/shm does not exist; NCCL"),
    ],
)  # fmt: skip
def test_shared_memory_below_a_gib_is_named(space, says):
    problem = shm_problem("/dev/shm", space)
    assert problem == says if says is None else problem.startswith(says), problem


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="mounting a small /dev/shm needs root and unshare")  # fmt: skip
def test_doctor_warns_in_a_container_sized_dev_shm():
    # Docker's default: a 64 MiB /dev/shm, in a mount namespace of the doctor's own.
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    r = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", sys.executable, "-m",
                        "slurmddp", "doctor"], env=launcher_free_env(), capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("slurmddp doctor: warning: /dev/shm has 64 MiB free of 64 MiB; "
                               "NCCL between the GPUs"), r.stderr  # fmt: skip
    assert r.stdout.startswith("rank 0/1 on ")
    plain = subprocess.run([sys.executable, "-m", "slurmddp", "doctor"], env=launcher_free_env(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plain.returncode == 0 and "warning" not in plain.stderr, plain.stderr
    # --json: the same values, one object (what a script gathers from every rank under srun).
    shown = subprocess.run(["unshare", "--mount", "sh", "-c", script, "sh", sys.executable, "-m",
                            "slurmddp", "doctor", "--json"], env=launcher_free_env(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    told = json.loads(shown.stdout)
    assert (told["rank"], told["world_size"]) == (0, 1) and "64 MiB free" in told["shm_problem"]
    assert {"rank", "world_size", "master_addr"} <= {v["name"] for v in told["values"]}

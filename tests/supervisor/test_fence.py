"""The fence of a batch host cut off from slurmctld: the controller read, the route watched, the
run's tasks found. Its whole effect (the step and tasks ended, nothing left for the next run) is
tested on the cluster, the batch host's link taken down (tests/test_network_faults_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurmddp.supervisor import fence
from tests.conftest import wait_until

CONFIG = """Configuration data as of 2026-12-07T04:40:00
AccountingStorageHost   = 10.77.0.254
SlurmctldHost[0]        = vm(10.77.0.254)
SlurmctldHost[1]        = backup
SlurmctldPort           = 12817
SlurmdTimeout           = 60 sec
"""


def test_the_controller_is_read_from_scontrols_config():
    assert fence.controller(CONFIG) == fence.Controller(("10.77.0.254", "backup"), 60.0)
    assert fence.controller(CONFIG.replace("= 60 sec", "= 0 sec")) is None  # never gives up
    assert fence.controller("") is None  # a stand-in of scontrol, or none at all


def test_a_route_to_any_of_the_controllers_addresses_will_do():
    where = fence.controller(CONFIG)
    assert where is not None
    names = {"10.77.0.254": "10.77.0.254", "backup": "10.77.0.9"}
    assert fence.addresses(where, names.get) == ("10.77.0.254", "10.77.0.9")
    assert fence.addresses(where, {}.get) == ()  # none resolves (IPv6 alone): nothing watched
    routes = {"10.77.0.9": "10.77.0.2"}
    assert fence.routed(("10.77.0.254", "10.77.0.9"), routes.get)
    assert not fence.routed(("10.77.0.254",), routes.get)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.mark.parametrize("routes, cut_at", [
    ("", 60),  # gone from the start: SlurmdTimeout after
    ("yyyy" + "n" * 4 + "y" + "n" * 20, 100),  # back after 20 s: counted again from there
])  # fmt: skip
def test_the_run_is_fenced_once_the_route_is_gone_for_slurmd_timeout(routes, cut_at):
    clock, looks = Clock(), iter(routes)
    seconds = fence.cut_for(60.0, lambda: next(looks, "n") == "y", clock=clock,
                            sleep=clock.sleep)  # fmt: skip
    assert seconds >= 60 and clock.now == cut_at


def test_the_tasks_of_the_run_on_this_node_are_found_and_nothing_else():
    task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n1",
            "SLURM_RESTART_COUNT": "1"}  # fmt: skip
    environs = {
        10: task, 11: task | {"SLURM_STEP_ID": "1"},  # the run's steps
        12: {k: v for k, v in task.items() if k != "SLURM_STEP_ID"},  # the batch shell
        13: task | {"SLURM_RESTART_COUNT": "2"},  # the next run's (one host for all nodes)
        14: task | {"SLURMD_NODENAME": "n2"},  # another node's, seen on the same host
        15: task | {"SLURM_JOB_ID": "8"}, 16: {}, 17: task,  # another job's; this process
    }
    assert fence.tasks_of("7", "1", "n1", environs, spare=(17,)) == [10, 11]
    assert fence.tasks_of("7", "0", "n1", {20: task | {"SLURM_RESTART_COUNT": "0"},
                                            21: {k: v for k, v in task.items()
                                                 if k != "SLURM_RESTART_COUNT"}},
                          spare=()) == [20, 21]  # run 0: Slurm sets no count  # fmt: skip


# A stand-in of srun and its shepherd: the child waits on a pipe from its parent and, once the
# parent is gone, acts (srun's cancels the step on every node; this one writes a file).
SHEPHERD = """
import os, sys, time
read, write = os.pipe()
if os.fork() == 0:
    os.close(write)
    os.read(read, 1)
    open(sys.argv[1], "w").close()
    os._exit(0)
os.close(read)
print("started", flush=True)
time.sleep(600)
"""


def test_the_launcher_is_fenced_with_what_it_started_none_acting_on_anothers_end(tmp_path):
    acted = tmp_path / "acted"
    srun = subprocess.Popen([sys.executable, "-c", SHEPHERD, str(acted)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert srun.stdout is not None and srun.stdout.readline() == "started\n"
        shepherd = fence.descendants(srun.pid)
        assert len(shepherd) == 1
        fence.kill([srun.pid, *shepherd])
        srun.wait(timeout=60)
        # Killed while stopped: it never ran after its parent's end (then reparented, reaped).
        wait_until(lambda: ended(shepherd[0]), 60, "the shepherd's end", interval=0.05)
        assert not acted.exists()
    finally:
        srun.kill()


def test_all_are_stopped_then_each_killed_after_its_descendants(monkeypatch):
    # Killed parents first, a process group whose last parent outside it dies with members
    # stopped is woken by the kernel (SIGHUP, SIGCONT): srun said "got SIGCONT" and ended the
    # step on every node (fresh run 42). 11 -> 12 -> 13, and 14 beside them.
    monkeypatch.setattr(fence, "parents", lambda: {11: 1, 12: 11, 13: 12, 14: 1, 15: 14})
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(fence.os, "kill", lambda pid, s: sent.append((pid, s)))
    fence.kill([11, 12, 13, 14, 11])
    stop, kill = fence.signal.SIGSTOP, fence.signal.SIGKILL
    assert sent == [(11, stop), (12, stop), (13, stop), (14, stop),
                    (13, kill), (12, kill), (11, kill), (14, kill)]  # fmt: skip


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True

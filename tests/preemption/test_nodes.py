"""preemption.nodes: which node a failure is laid on, and whether the job fits without it."""

from __future__ import annotations

import pytest

from slurmddp.preemption.decision import partition_fields
from slurmddp.preemption.nodes import (
    Blame,
    Failure,
    aborted,
    exclusion,
    hang_blame,
    not_responding,
)

JOB = {"NumNodes": "2", "ExcNodeList": "(null)"}
PARTITION = {"PartitionName": "debug", "TotalNodes": "4"}


@pytest.mark.parametrize(("seen", "reported", "preflight", "node"), [
    ("srun: error: n2: task 1: Bus error", None, False, "n2"),
    ("srun: error: n3: tasks 2-3: Illegal instruction (core dumped)", None, False, "n3"),
    ("srun: error: n2: task 1: Segmentation fault", None, False, None),  # a script's bug, mostly
    ("srun: error: n2: task 1: Killed", None, False, None),  # OOM killer or by hand
    ("srun: error: n2: task 1: Killed", None, True, "n2"),  # the preflight runs no user code
    ("srun: error: n2: task 1: Exited with exit code 1", None, True, None),
    (None, "slurmddp: rank 5 (host gpu-17) failed: RuntimeError: CUDA error: no CUDA-capable "
     "device is detected", False, "gpu-17"),
    (None, "slurmddp: rank 5 (host gpu-17) failed: NodeCheckError: GPU 3 is lost", True, "gpu-17"),
    (None, "slurmddp: rank 5 (host gpu-17) failed: ValueError: no cuda", False, None),
    (None, "slurmddp: rank ? (host gpu-17) exited with status 1", True, None),
    ("srun: error: n2: task 1: bus", "garbage", False, None),
])  # fmt: skip
def test_which_failures_blame_a_node(seen, reported, preflight, node):
    blame = Failure(1, seen, reported).blame(preflight=preflight)
    assert (blame.node if blame else None) == node, blame


def test_the_summary_names_the_first_to_end_and_the_first_report():
    lines = Failure(1, "srun: error: n2: tasks 2-3: Bus error",
                    "slurmddp: rank 0 (host n1) failed: RuntimeError: x").summary()  # fmt: skip
    assert lines == (
        "the step failed with status 1; the first to end, as srun saw it: tasks 2-3 on n2 (Bus "
        "error)",
        "the first failure a rank reported: rank 0 (host n1) failed: RuntimeError: x",
        "tasks 2-3 on n2 was ended by a signal and could not report; failures after it followed "
        "from losing it",
    )
    assert Failure(3).summary("the preflight") == ("the preflight failed with status 3",)


ABORTED = """srun: error: _server_write write failed: Bad file descriptor
srun: error: Aborting, io error and missing step on node 1
srun: Job step aborted: Waiting up to 7 seconds for job step to finish.
srun: error: n1: task 0: Killed
srun: error: n3: task 2: Killed
"""  # a 22.05 batch log: n2 crashed, and its slurmd came back within SlurmdTimeout


def test_a_step_srun_aborted_for_a_node_blames_that_node_not_the_first_it_killed():
    node = aborted(ABORTED, ["n1", "n2", "n3"])
    assert node == "n2"
    failure = Failure(137, "srun: error: n1: task 0: Killed", "slurmddp: rank 0 (host n1) failed: "
                      "RuntimeError: Connection closed by peer", aborted=node)  # fmt: skip
    assert failure.blame() == Blame("n2", "srun lost the step's daemon there and aborted the step")
    assert failure.summary() == (
        "the step failed with status 137: srun aborted it, having lost the step's daemon on n2 "
        "(its slurmd came back without it: the machine crashed and rebooted, or its slurmd "
        "restarted)",)
    # No abort, or a node the step's list does not have: nothing.
    assert aborted(ABORTED.replace("Aborting", "Quitting"), ["n1", "n2"]) is None
    assert aborted(ABORTED, ["n1"]) is None and aborted(ABORTED, []) is None


@pytest.mark.parametrize(("excluded", "node", "result"), [
    ("(null)", "n2", "n2"),
    ("n1", "n2", "n[1-2]"),
    ("n[1-2]", "n2", "n[1-2]"),  # already excluded: nothing new, still fits
    ("n[1,3]", "n2", None),  # 4 - 3 < 2
    ("n10", "n9", "n[9-10]"),  # in the nodes' order, not the text's
])  # fmt: skip
def test_the_exclusion_is_bounded_by_the_partition(excluded, node, result):
    exclude, why_not = exclusion(node, JOB | {"ExcNodeList": excluded}, PARTITION)
    assert exclude == result
    assert bool(why_not) == (result is None)


def test_a_node_range_job_must_fit_its_least():
    assert exclusion("n2", {"NumNodes": "2-4", "ExcNodeList": "n1"}, PARTITION)[0] == "n[1-2]"
    assert exclusion("n2", JOB, {})[0] is None  # no partition record: nothing is excluded


def test_a_hang_is_laid_on_a_node_only_when_its_suspects_share_it():
    assert hang_blame([(3, "n2"), (2, "n2")]).why.startswith("ranks 2,3 on it")  # type: ignore[union-attr]
    assert hang_blame([(1, "n1"), (3, "n2")]) is None
    assert hang_blame([]) is None


def test_the_partition_line_is_found_among_the_lines():
    fields = partition_fields(["JobId=1 JobState=RUNNING", "PartitionName=debug TotalNodes=4"])
    assert fields == {"PartitionName": "debug", "TotalNodes": "4"}
    assert partition_fields(["JobId=1"]) == {}


def test_the_nodes_slurm_lost_are_those_down_failed_or_not_responding():
    states = {"n10": "DOWN+NOT_RESPONDING", "n2": "IDLE", "n3": "MIXED+NOT_RESPONDING",
              "n4": "FAIL", "n5": "DRAINED"}  # fmt: skip
    assert not_responding(states) == ["n3", "n4", "n10"]

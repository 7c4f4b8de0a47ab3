"""Snapshots when something fails (slurmddp.checkpoint.snapshots.snapshotter): a rank whose store
cannot be made, a copy that fails, a peer stuck in its transfer, a damaged newest snapshot, a
process restarted beside its predecessor's files, an exit with a transfer in flight. Each on a
real world of 2 ranks on 2 emulated nodes (gloo): training never waits more than the transfers'
timeout for a failed snapshot, and never resumes from a mix of two. And at 2 ranks a node, the
node's one copy of what its ranks hold alike: a lead whose write fails, a damaged part."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmddp.checkpoint.snapshots import store
from tests.checkpoint.test_snapshots import copy_into
from tests.conftest import free_port, launcher_free_env, tagged_json

PROGRAM = str(Path(__file__).resolve().parents[1] / "programs" / "snapshot_faults.py")
FAR = str(int(time.time()) + 86_400)  # the emulated job's end: no scontrol asked
NODES = ["n1", "n2"]
# A hang guard, never a bound on the product: without the fixes, a failed snapshot held the
# peers in gloo for torch's default 30 minutes.
HANG_S = 120


def run_world(work: Path, steps: int, *faults: str, shm: dict[int, Path] | None = None,
              nodes: list[str] = NODES) -> tuple[list[dict], list[str]]:  # fmt: skip
    """The program at len(nodes) ranks, rank r on node nodes[r]; (RESULT lines, each rank's
    stderr)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "slurmddp.run", PROGRAM, "--checkpoint-dir", str(work / "ckpt"),
             "--steps", str(steps), *(f for fault in faults for f in ("--fault", fault))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=launcher_free_env(RANK=str(r), WORLD_SIZE=str(len(nodes)), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=port, OMP_NUM_THREADS="1", SLURMD_NODENAME=node,
                                  SLURM_JOB_ID="78", SLURM_JOB_END_TIME=FAR,
                                  SLURMDDP_SNAPSHOT_TIMEOUT="1",
                                  SLURMDDP_SNAPSHOT_DIR=str((shm or {}).get(r, work / "shm"))))
        for r, node in enumerate(nodes)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=HANG_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    return [r for out, _ in outs for r in tagged_json(out, "RESULT ")], [e for _, e in outs]


def held(work: Path) -> dict[str, list[store.Shard]]:
    """{node: the whole snapshot files of its store}, found by listing as recovery does."""
    found: dict[str, list[store.Shard]] = {}
    for path in sorted((work / "shm").rglob("*.snap")):
        shard = store.parse(path.name, path.stat().st_size)
        if shard is not None:
            found.setdefault(path.parent.name, []).append(shard)
    return found


def total(steps: int) -> float:
    return float(sum(range(1, steps + 1)))


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> tuple[Path, list[dict], list[str]]:
    """8 steps: rank 1's store cannot be made (its SLURMDDP_SNAPSHOT_DIR is a file), rank 0's
    copy of step 3 fails, rank 1's transfer thread is held past the timeout at step 5."""
    work = tmp_path_factory.mktemp("faulted")
    (work / "not-a-directory").write_text("")
    results, errs = run_world(work, 8, "0:pack:3", "1:stuck:5",
                              shm={1: work / "not-a-directory"})  # fmt: skip
    return work, results, errs


@pytest.mark.ranks
def test_a_rank_whose_store_fails_stalls_no_peer_and_its_replica_is_kept(faulted):
    work, results, errs = faulted
    assert {(r["start"], r["sum"]) for r in results} == {(0, total(8))}
    assert "slurmddp: node n2 keeps no snapshot: " in errs[1], errs[1]
    assert "slurmddp: a snapshot failed on node n1 (injected: the copy of step 3 failed)" in \
        errs[0], errs[0]
    # n2 kept nothing; n1 kept its rank's shards and rank 1's replicas, of the last two steps:
    # the transfers came back after the stuck one (their group rebuilt on every rank).
    shards = held(work)
    assert set(shards) == {"n1"}, shards
    assert {(s.step, s.rank) for s in shards["n1"]} == {(7, 0), (7, 1), (8, 0), (8, 1)}


@pytest.mark.ranks
def test_a_restart_resumes_from_the_replicas_and_leaves_none_of_its_predecessors_files(
        faulted, tmp_path):  # fmt: skip
    work, _, _ = faulted
    copy_into(tmp_path, work, job="78")
    results, errs = run_world(tmp_path, 11)
    assert {(r["start"], r["sum"]) for r in results} == {(8, total(11))}, errs[0]
    assert "resuming from the snapshot of step 8" in errs[0] and "1 of 2 shards fetched" in errs[0]
    shards = held(tmp_path)
    # One incarnation, its own last two steps: the predecessor's 7 and 8 pruned by listing.
    assert {(s.step, s.rank) for s in shards["n1"]} == {(10, 0), (10, 1), (11, 0), (11, 1)}
    assert {(s.step, s.rank) for s in shards["n2"]} == {(10, 0), (10, 1), (11, 0), (11, 1)}
    assert len({s.inc for node in shards.values() for s in node}) == 1
    assert len({s.inc for s in held(work)["n1"]} | {shards["n1"][0].inc}) == 2

    # The newest snapshot damaged on the node that loads it: the one before, never a mix, and
    # not the durable checkpoint. Rank 1's transfer thread hangs in the last snapshot: the
    # process still exits.
    newest = tmp_path / "shm"
    path = next(p for p in newest.rglob("step-0000000011.rank-00000.*.snap")
                if p.parent.name == "n1")  # fmt: skip
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    results, errs = run_world(tmp_path, 12, "1:hang:12")
    assert "the snapshot of step 11 did not load on every rank" in errs[0], errs[0]
    assert "trying the snapshot of step 10" in errs[0]
    assert {(r["start"], r["sum"]) for r in results} == {(10, total(12))}
    assert "a snapshot was still being taken on node n2 at exit" in errs[1], errs[1]


TWO_EACH = ["n1", "n1", "n2", "n2"]


def own(rank: int, steps: int) -> float:
    return (rank + 1) * total(steps)


@pytest.mark.ranks
def test_a_nodes_ranks_keep_one_copy_of_what_they_hold_alike(tmp_path):
    # 2 nodes of 2 ranks, a state as under DDP: 64 KiB alike on every rank, 64 bytes each its own.
    # Rank 0's write of its step 5 fails (its node's store refuses it): rank 1 keeps its whole
    # state that step; otherwise ranks 1 and 3 keep parts over their leads' (0's and 2's).
    results, errs = run_world(tmp_path, 6, "0:write:5", nodes=TWO_EACH)
    assert {(r["rank"], r["sum"], r["own"]) for r in results} == {
        (r, total(6), own(r, 6)) for r in range(4)}  # fmt: skip
    assert "node n1 keeps no snapshot: injected: the write of step 5 failed" in errs[0], errs[0]
    shards = {node: {(s.step, s.rank): s for s in found} for node, found in held(tmp_path).items()}
    # n1 lacks rank 0's step 5 (and keeps its step 4: its two newest).
    assert set(shards["n1"]) == {(4, 0), (5, 1), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (6, 3)}
    assert set(shards["n2"]) == {(step, r) for step in (5, 6) for r in range(4)}
    for node in ("n1", "n2"):
        kept = shards[node]
        assert [kept[6, r].base for r in range(4)] == [0, 0, 2, 2]
        assert kept[5, 1].base == 1 and kept[5, 3].base == 2  # rank 1 whole at step 5
        whole = kept[6, 0].size
        assert whole > 1 << 16 and all(s.size < whole // 64 for s in kept.values() if s.part)
    # A node's store of a step: its lead's state, the other node's lead's replica and two small
    # parts; not four states (13 KiB more, not 128).
    step_6 = sum(s.size for (step, _), s in shards["n1"].items() if step == 6)
    assert step_6 < 2 * whole + (1 << 12), shards["n1"]

    # Rank 1's part of step 6 damaged: it fails its check, and every rank resumes from step 5,
    # rank 0's shard fetched from n2, rank 1's whole one, rank 3's part over rank 2's; exactly.
    path = next(p for p in (tmp_path / "shm").rglob("step-0000000006.rank-00001.*.snap")
                if p.parent.name == "n1")  # fmt: skip
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)
    results, errs = run_world(tmp_path, 8, nodes=TWO_EACH)
    assert "the snapshot of step 6 did not load on every rank" in errs[0], errs[0]
    assert "resuming from the snapshot of step 5" in errs[0] and "1 of 4 shards fetched" in errs[0]
    assert {(r["rank"], r["start"], r["sum"], r["own"]) for r in results} == {
        (r, 5, total(8), own(r, 8)) for r in range(4)}  # fmt: skip

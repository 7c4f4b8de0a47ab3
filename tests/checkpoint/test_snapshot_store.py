"""The snapshots' node store and pure rules (slurmddp.checkpoint.snapshots.store, .plan): which rank
keeps whose replica, which complete snapshots the ranks may resume from, the files' names and
pruning, the store's privacy, its place and its cleanup, and its room. As root, the privacy tests
try what another user (nobody) could do."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmddp.checkpoint.snapshots import plan, store
from slurmddp.checkpoint.snapshots.store import NodeStore, Shard
from tests.conftest import umask

NOBODY = 65534
DOCS = Path(__file__).resolve().parents[2] / "docs" / "concepts" / "snapshots.md"
as_root = pytest.mark.skipif(os.getuid() != 0, reason="acts as another user: needs root")


# -- the rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes, keepers", [
    (["n1", "n1", "n2", "n2"], {0: 2, 1: 3, 2: 0, 3: 1}),
    (["n1", "n2", "n3"], {0: 1, 1: 2, 2: 0}),
    (["n1", "n1", "n1", "n2"], {0: 3, 1: 3, 2: 3, 3: 0}),  # a node of fewer ranks keeps more
    (["n1", "n1"], {}),  # one node: no other node to keep a replica
])  # fmt: skip
def test_each_rank_has_a_replica_kept_on_the_next_node(nodes, keepers):
    assert plan.replica_keepers(nodes) == keepers
    assert all(nodes[rank] != nodes[keeper] for rank, keeper in keepers.items())


def shards(step: int, ranks, world: int = 4, inc: int = 7) -> list[Shard]:
    return [Shard(step, r, world, inc, 1000 * step + r, 10) for r in ranks]


def test_the_complete_snapshots_come_newest_first_and_missing_shards_from_a_holder():
    # n2 was lost and n3 took its ranks: n1 has its own shards and n2's replicas of steps 7 and 8;
    # step 9 was being taken (rank 3's replica never reached n1, then n2 was lost).
    held = {"n1": shards(7, range(4)) + shards(8, range(4)) + shards(9, [0, 1, 2]), "n3": []}
    nodes = ["n1", "n1", "n3", "n3"]
    found, why = plan.candidates(held, nodes, newer_than=5)
    assert [r.step for r in found] == [8, 7]  # a checksum failing at 8: 7 before the checkpoint
    assert found[0].shards == tuple(shards(8, range(4)))
    fetched = [(f.shard.rank, f.sender, f.receiver) for f in found[0].fetches]
    assert fetched == [(2, 0, 2), (3, 0, 3)]
    assert why == "the snapshot of step 9 lacks the shards of rank 3 (lost with their nodes)"


A, B = 0x1A2B3C4D, 0x0000FFFF  # two incarnations: a world, and the one restarted after it


@pytest.mark.parametrize("held, nodes, newer_than, chosen, fetched", [
    ({"n1": shards(4, [0, 1])}, ["n1", "n1"], 4, [], 0),  # not newer than the checkpoint
    ({"n1": shards(4, [0, 1])}, ["n1", "n1"], None, [(4, 7)], 0),
    ({"n1": shards(4, [0])}, ["n1", "n1", "n1"], None, [], 0),  # rank 1's is nowhere
    ({"n1": shards(6, range(4)), "n2": shards(6, range(4))}, ["n1", "n2"], 2, [(6, 7)],
     0),  # shrink
    ({"n1": shards(6, [0, 1], world=2)}, ["n1", "n2", "n2"], 2, [(6, 7)],
     2),  # grow: rank 0's for rank 2
    # Two incarnations at step 6, each incomplete, together complete: never one snapshot.
    ({"n1": shards(6, [0], inc=A) + shards(6, [1], inc=B)}, ["n1", "n1"], None, [], 0),
    # ... and the older step both took whole comes first, then the one before.
    ({"n1": shards(6, [0], inc=A) + shards(6, [1], inc=B) + shards(5, [0, 1], inc=B)
      + shards(4, [0, 1], inc=A)}, ["n1", "n1"], None, [(5, B), (4, A)], 0),
    # Both whole at one step: the larger incarnation first.
    ({"n1": shards(6, [0, 1], inc=B) + shards(6, [0, 1], inc=A)}, ["n1", "n1"], None,
     [(6, A), (6, B)], 0),
    # Two different shards of rank 1 in one incarnation at a step: not one snapshot.
    ({"n1": shards(6, [0, 1]), "n2": [Shard(6, 1, 4, 7, 99, 10)]}, ["n1", "n1"], None, [], 0),
])  # fmt: skip
def test_what_is_chosen(held, nodes, newer_than, chosen, fetched):
    found, _ = plan.candidates(held, nodes, newer_than)
    assert [(r.step, r.shards[0].inc) for r in found] == chosen
    assert all(len({s.inc for s in r.shards}) == 1 for r in found)  # never mixed
    assert (len(found[0].fetches) if found else 0) == fetched


def test_every_rank_computes_the_same_candidates_whatever_the_order_it_heard_them_in():
    n1 = shards(6, [0, 1], inc=A) + shards(6, [0, 1], inc=B) + shards(6, [0, 1], world=2)
    n2 = shards(6, [2, 3], inc=A) + shards(6, [2, 3], inc=B) + shards(5, range(4))
    held = {"n1": n1, "n2": n2}
    nodes = ["n1", "n1", "n2", "n2"]
    reference, _ = plan.candidates(held, nodes, None)
    # at step 6, three incarnations (one of a world of 2: its rank 0 for ranks 2 and 3)
    assert [(r.step, r.shards[0].inc) for r in reference] == [(6, A), (6, B), (6, 7), (5, 7)]
    for seed in range(5):
        shuffled = {n: random.Random(seed).sample(s, len(s)) for n, s in reversed(held.items())}
        assert plan.candidates(shuffled, nodes, None)[0] == reference


@pytest.mark.parametrize("held, why", [
    # the newest is incomplete, an older one whole: why the newest was not taken
    ({"n1": shards(9, [0]) + shards(8, [0, 1])}, "the snapshot of step 9 lacks the shards of "
     "rank 1 (lost with their nodes)"),
    # an incomplete one older than a whole one, or beside it at its step: nothing to say
    ({"n1": shards(9, [0, 1]) + shards(8, [0])}, ""),
    ({"n1": shards(9, [0, 1], inc=B) + shards(9, [0], inc=A)}, ""),
    ({"n1": shards(9, [1], inc=A) + shards(8, [1])}, "the snapshot of step 9 lacks the shards of "
     "rank 0 (lost with their nodes)"),
])  # fmt: skip
def test_why_the_newest_snapshot_was_not_taken(held, why):
    assert plan.candidates(held, ["n1", "n1"], None)[1] == why


# A node's ranks keep one copy of what they hold alike: its lead (lowest rank) a full shard, the
# others parts over it.


def alike(step: int, nodes: list[list[int]], world: int = 4, inc: int = 7) -> list[Shard]:
    """The shards of `nodes` (each a list of ranks, its lead first) at `step`: the leads' full
    (10 bytes), the others' parts over them (2 bytes)."""
    return [Shard(step, r, world, inc, 1000 * step + r, 10 if r == ranks[0] else 2,
                  base=ranks[0]) for ranks in nodes for r in ranks]  # fmt: skip


TWO_BY_TWO = [[0, 1], [2, 3]]


def test_a_part_counts_with_its_base_and_a_spare_fetches_both():
    # n2 lost, n3 in its place: n1 holds its own base and part and n2's replicas. Rank 2 fetches
    # its full shard; rank 3 its part and the base it completes (rank 2's), both from n1.
    held = {"n1": alike(8, TWO_BY_TWO), "n3": []}
    (found,), why = plan.candidates(held, ["n1", "n1", "n3", "n3"], None)
    assert why == "" and found.step == 8
    assert [s.part for s in found.shards] == [False, True, False, True]
    assert found.bases == (None, found.shards[0], None, found.shards[2])
    assert [(f.shard.rank, f.sender, f.receiver) for f in found.fetches] == [
        (2, 0, 2), (3, 0, 3), (2, 0, 3)]  # fmt: skip
    assert found.files(3) == [found.shards[3], found.shards[2]]


def test_a_part_and_its_base_may_come_from_two_nodes():
    # Rank 1's part is on n2, where rank 1 now runs, its base on n1 only (n2 had no room for
    # it): the part is read in place, the base fetched from rank 0.
    base, part = alike(8, [[0, 1]], world=2)
    (found,), _ = plan.candidates({"n1": [base], "n2": [part]}, ["n1", "n2"], None)
    assert [(f.shard, f.sender, f.receiver) for f in found.fetches] == [(base, 0, 1)]


@pytest.mark.parametrize("held, why", [
    # the base of rank 1's part is of another incarnation: no set of step 9 is whole (A's
    # lacks rank 1's shard, B's the base)
    ({"n1": [alike(9, [[0, 1]], 2, inc=A)[0], alike(9, [[0, 1]], 2, inc=B)[1],
             *alike(8, [[0, 1]], 2)]}, "the snapshot of step 9 lacks the shards of rank 1"),
    # the base is gone everywhere (its node lost, no replica kept)
    ({"n1": alike(9, [[0, 1]], 2)[1:] + alike(8, [[0, 1]], 2)},
     "the snapshot of step 9 lacks the shards of ranks 0, 1"),
    # a "base" that is a part itself: never written so, never rebuilt
    ({"n1": [Shard(9, 0, 2, 7, 1, 2, base=1), Shard(9, 1, 2, 7, 1, 2, base=0),
             *alike(8, [[0, 1]], 2)]}, "the snapshot of step 9 lacks the shards of ranks 0, 1"),
])  # fmt: skip
def test_a_part_without_its_base_is_not_counted(held, why):
    found, said = plan.candidates(held, ["n1", "n1"], None)
    assert [r.step for r in found] == [8]
    assert said == why + " (lost with their nodes)"


def test_a_smaller_or_larger_world_reads_parts_over_their_bases():
    held = {"n1": alike(6, TWO_BY_TWO), "n2": alike(6, TWO_BY_TWO)}
    (shrunk,), _ = plan.candidates(held, ["n1", "n1"], None)  # ranks 0 and 1 remain
    assert shrunk.bases == (None, shrunk.shards[0]) and not shrunk.fetches
    two = alike(6, [[0, 1]], world=2)
    (grown,), _ = plan.candidates({"n1": two}, ["n1", "n1", "n2"], None)
    assert grown.shards == (two[0], two[1], two[0]) and grown.bases == (None, two[0], None)
    assert [(f.shard.rank, f.receiver) for f in grown.fetches] == [(0, 2)]


def test_pruning_each_ranks_steps_never_costs_a_snapshot_its_base(tmp_path):
    # Rank 0 (the lead) failed to write step 12, so rank 1 kept its whole state then; pruned to
    # two steps each, rank 1's part of step 11 still has its base, and the snapshots that are
    # complete are those full shards would have made.
    node = NodeStore(tmp_path / "n1")
    written = alike(10, [[0, 1]], 2) + alike(11, [[0, 1]], 2) + [Shard(12, 1, 2, 7, 5, 10)]
    for shard in written:
        node.put(shard, b"x" * shard.size)
    node.prune([0], 2, 7)
    node.prune([1], 2, 7)
    assert sorted((s.step, s.rank, s.part) for s in node.shards()) == [
        (10, 0, False), (11, 0, False), (11, 1, True), (12, 1, False)]  # fmt: skip
    found, why = plan.candidates({"n1": node.shards()}, ["n1", "n1"], None)
    assert [r.step for r in found] == [11] and "step 12 lacks the shards of rank 0" in why


# -- the files ----------------------------------------------------------------------------------


def test_a_shards_name_says_its_incarnation_and_an_old_name_is_no_shard():
    shard = Shard(120, 3, 4, 0x1A2B3C4D, 0xDEADBEEF, 5)
    assert shard.name == "step-0000000120.rank-00003.of-00004.inc-1a2b3c4d.crc-deadbeef.snap"
    assert store.parse(shard.name, 5) == shard
    assert store.parse("step-0000000120.rank-00003.of-00004.crc-deadbeef.snap") is None
    fields = [f.name for f in Shard.__dataclass_fields__.values()]
    assert fields == ["step", "rank", "world", "inc", "crc", "size", "base"]
    assert shard.base == 3 and not shard.part  # a full shard is its own base


def test_a_parts_name_says_the_rank_whose_full_shard_it_completes():
    part = Shard(120, 3, 4, 0x1A2B3C4D, 0xDEADBEEF, 5, base=2)
    assert part.part and part.name == ("step-0000000120.rank-00003.of-00004.inc-1a2b3c4d."
                                       "base-00002.crc-deadbeef.snap")  # fmt: skip
    assert store.parse(part.name, 5) == part
    assert store.parse(part.name.replace("base-00002", "base-00003")) is None  # not ours
    assert Shard(1, 2, 4, A, 9, 5, base=2) == Shard(1, 2, 4, A, 9, 5)  # one spelling of full


def test_a_store_names_its_files_by_what_they_hold_and_keeps_the_newest_steps(tmp_path):
    node = NodeStore(tmp_path / "n1")
    written = [Shard(step, rank, 4, A, step + rank, 3) for step in (3, 4, 5) for rank in (0, 2)]
    for shard in written:
        node.put(shard, b"abc")
    (node.directory / f".{Shard(6, 0, 4, A, 6).name}.tmp-1").write_bytes(b"a")  # cut short
    assert node.shards()[0] == Shard(3, 0, 4, A, 3, 3) and len(node.shards()) == 6
    left = node.prune([0], 2, A)  # rank 0's: rank 2's are another's to prune
    assert [(s.step, s.rank) for s in left] == [(4, 0), (5, 0)]
    assert sorted((s.step, s.rank) for s in node.shards()) == [(3, 2), (4, 0), (4, 2), (5, 0),
                                                               (5, 2)]  # fmt: skip
    node.drop_partial()
    assert not list(node.directory.glob(".*"))
    node.remove([0, 2])
    assert not node.directory.exists()


def test_a_restarted_worker_prunes_what_its_predecessor_left(tmp_path):
    # Its predecessor (incarnation A) wrote steps 10 and 20 of ranks 0 and 1, and died; the new
    # worker (B) wrote 40 and 50 of rank 0 and knows nothing of the old files but their names.
    node = NodeStore(tmp_path / "n1")
    for shard in shards(10, [0, 1], inc=A) + shards(20, [0, 1], inc=A) + shards(40, [0], inc=B) \
            + shards(50, [0], inc=B):  # fmt: skip
        node.put(shard, b"x" * shard.size)
    assert [(s.step, s.inc) for s in node.prune([0], 2, B)] == [(40, B), (50, B)]
    assert sorted((s.step, s.rank) for s in node.shards()) == [(10, 1), (20, 1), (40, 0), (50, 0)]
    # One incarnation a step: this one's where both took it, else the larger.
    for shard in shards(60, [1], inc=A) + shards(60, [1], inc=B) + shards(20, [1], inc=0xFF):
        node.put(shard, b"x" * shard.size)
    assert [(s.step, s.inc) for s in node.prune([1], 2, B)] == [(20, A), (60, B)]
    assert [(s.step, s.inc) for s in node.prune([1], 3, 0xFF)] == [(20, A), (60, B)]
    assert [(s.step, s.inc) for s in node.prune([1], 2, 0xFF)] == [(20, A), (60, B)]


@pytest.mark.parametrize("data", [b"abcdef", b"ab", b"abc"])
def test_an_old_shards_file_is_written_over_for_a_new_one(tmp_path, data):
    # In memory, writing a new file costs its pages' allocation and zeroing first (2 to 3 times
    # the copy): a shard due for pruning gives its file instead, longer, shorter or alike.
    node = NodeStore(tmp_path / "n1")
    old, new = Shard(3, 0, 2, A, 1, 3), Shard(5, 0, 2, A, 2, len(data))
    node.put(old, b"xyz")
    inode = node.path(old).stat().st_ino
    node.put(new, data, reuse=old)
    assert node.shards() == [new] and node.path(new).read_bytes() == data
    assert node.path(new).stat().st_ino == inode
    node.put(Shard(6, 0, 2, A, 3, 1), b"q", reuse=old)  # gone already: a new file
    assert [s.step for s in node.shards()] == [5, 6]


def test_a_replica_arrives_straight_in_its_file_kept_whole_or_not_at_all(tmp_path):
    # A buffer of the replica's size first cost as much as receiving it (1 GiB: 0.47 s of
    # allocation and zeroing, then 0.19 s of write): the bytes land in the file's pages.
    node = NodeStore(tmp_path / "n1")
    old, new = Shard(3, 1, 2, A, 1, 4), Shard(5, 1, 2, A, 2, 6)
    node.put(old, b"wxyz")
    inode = node.path(old).stat().st_ino
    with node.receiving(new, reuse=old) as view:
        view[:] = b"abcdef"
        assert node.shards() == []  # hidden until every byte is in
    assert node.shards() == [new] and node.path(new).read_bytes() == b"abcdef"
    assert node.path(new).stat().st_ino == inode
    with pytest.raises(RuntimeError), node.receiving(Shard(6, 1, 2, A, 3, 3)) as view:
        view[:2] = b"ab"
        raise RuntimeError("the sender died")
    assert node.shards() == [new] and not list(node.directory.glob(".*"))


# -- privacy --------------------------------------------------------------------------------------


def in_child(work: Callable[[], Any], user: int | None = None, orphaned: bool = False) -> Any:
    """`work()`'s result (JSON), or {"error": ...}, from a forked process: as `user`; with
    `orphaned`, in a grandchild whose parent ends with it (neither is left when this returns)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (a child)
        status = 1
        try:
            os.close(r)
            if orphaned and os.fork():
                status = os.waitstatus_to_exitcode(os.wait()[1])
            else:
                if user is not None:
                    os.setgroups([])
                    os.setgid(user)
                    os.setuid(user)
                try:
                    out = {"result": work()}
                except Exception as e:
                    out = {"error": f"{type(e).__name__}: {e}"}
                os.write(w, json.dumps(out).encode())
                status = 0
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return json.loads(data)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may write, as /dev/shm (tmp_path's parents are root's, 0700)."""
    base = Path(tempfile.mkdtemp(prefix="slurmddp-store-test-"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base)


def env(base: Path, job: str = "41", node: str = "n1", **more: str) -> dict[str, str]:
    return {"SLURMDDP_SNAPSHOT_DIR": str(base), "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0",
            "SLURMD_NODENAME": node, **more}  # fmt: skip


@as_root
@pytest.mark.parametrize("mask", [0o000, 0o277])  # everyone's bits left; the owner's taken
def test_a_stores_directories_and_files_are_its_users_alone_whatever_the_umask(shared, mask):
    with umask(mask):
        node = NodeStore.of_this_node(env(shared))
        node.put(Shard(1, 0, 1, A, 2, 3), b"abc")
        with node.receiving(Shard(2, 0, 1, A, 3, 3)) as view:
            view[:] = b"def"
    levels = [node.root, node.directory.parent, node.directory]
    assert [stat.S_IMODE(p.stat().st_mode) for p in levels] == [0o700] * 3
    assert {stat.S_IMODE(node.path(s).stat().st_mode) for s in node.shards()} == {0o600}
    target = node.path(node.shards()[0])
    assert "PermissionError" in in_child(target.read_bytes, user=NOBODY)["error"]
    # And the files themselves, were the directories open to all.
    for path in levels:
        path.chmod(0o711)
    assert "PermissionError" in in_child(target.read_bytes, user=NOBODY)["error"]
    assert "PermissionError" in in_child(lambda: os.listdir(target.parent), user=NOBODY)["error"]


def plant(base: Path, uid: int) -> None:
    """As nobody: the root of user `uid`'s stores, with a complete set for job 41's step 0."""
    directory = base / f"slurmddp-snapshots-{uid}" / "41.0.0" / "n1"

    def work() -> None:
        os.umask(0o077)  # all of it private-looking
        os.makedirs(directory)
        for shard in shards(9, [0, 1], world=2):
            (directory / shard.name).write_bytes(b"x" * 10)

    assert in_child(work, user=NOBODY) == {"result": None}


@as_root
def test_a_root_another_user_made_is_refused(shared):
    plant(shared, os.getuid())
    with pytest.raises(store.StoreRefused) as refused:
        NodeStore.of_this_node(env(shared))
    assert str(refused.value) == (
        f"{shared}/slurmddp-snapshots-0 is not a private directory of this user (owner uid "
        "65534, not 0): no snapshot is kept there; set $SLURMDDP_SNAPSHOT_DIR to a private "
        "node-local directory")  # fmt: skip
    assert isinstance(refused.value, OSError)
    assert NodeStore(shared / "slurmddp-snapshots-0" / "41.0.0" / "n1").shards() == []
    # A store of it made without `of_this_node` writes nothing there either (its owner could
    # swap the run directory the store would make for a link).
    with pytest.raises(store.StoreRefused, match="owner uid 65534"):
        NodeStore(store.node_directory(env(shared, job="42"))).put(shards(1, [0])[0], b"x" * 10)
    assert not (shared / "slurmddp-snapshots-0" / "42.0.0").exists()


def private(*paths: Path, mode: int = 0o700) -> None:
    """Make each of `paths` a directory of mode 0700, the last of `mode`."""
    for path in paths:
        path.mkdir(mode=0o700)
    paths[-1].chmod(mode)


@pytest.mark.parametrize("make, wrong", [
    (lambda root: root.symlink_to(root.with_name("elsewhere"), target_is_directory=True),
     "a symbolic link"),
    (lambda root: private(root, mode=0o775), "mode 0775, writable by others"),
    (lambda root: private(root, root / "41.0.0", mode=0o757), "mode 0757, writable by others"),
    (lambda root: private(root, root / "41.0.0", root / "41.0.0" / "n1", mode=0o1777),
     "mode 1777, writable by others"),
    (lambda root: root.write_bytes(b""), "not a directory"),
])  # fmt: skip
def test_a_store_directory_that_is_not_private_is_refused(tmp_path, make, wrong):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    make(tmp_path / f"slurmddp-snapshots-{os.getuid()}")
    with pytest.raises(store.StoreRefused, match=re.escape(wrong)):
        NodeStore.of_this_node(env(tmp_path))
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_store_directory_of_this_users_that_others_may_only_read_is_made_private(tmp_path):
    # As an earlier version left them (0755): no one else could have put anything there.
    private(tmp_path / f"slurmddp-snapshots-{os.getuid()}", mode=0o755)
    node = NodeStore.of_this_node(env(tmp_path))
    assert stat.S_IMODE(node.root.stat().st_mode) == 0o700


@as_root
def test_only_this_users_regular_files_count_as_shards(tmp_path):
    node = NodeStore(tmp_path / "n1")
    real = Shard(1, 0, 2, A, 1, 3)
    node.put(real, b"abc")
    node.path(Shard(2, 0, 2, A, 1)).symlink_to(node.path(real))
    node.path(Shard(3, 0, 2, A, 1)).mkdir()
    os.mkfifo(node.path(Shard(4, 0, 2, A, 1)))
    foreign = node.path(Shard(5, 0, 2, A, 1))
    foreign.write_bytes(b"abc")
    os.chown(foreign, NOBODY, NOBODY)
    assert node.shards() == [real]


@as_root
def test_a_user_other_than_root_keeps_its_own_store(shared):
    def work() -> Any:
        node = NodeStore.of_this_node(env(shared))
        for shard in shards(1, [0]) + shards(2, [0]) + shards(3, [0]):
            node.put(shard, b"x" * shard.size)
        kept = node.prune([0], 2, 7)
        room = node.room_for(1)
        listed = [s.step for s in node.shards()]
        node.remove([0])
        return [str(node.directory), [s.step for s in kept], listed, room.ok,
                node.directory.exists(), sorted(os.listdir(node.root))]  # fmt: skip

    where, kept, listed, room, exists, left = in_child(work, user=NOBODY)["result"]
    assert where == f"{shared}/slurmddp-snapshots-65534/41.0.0/n1"
    assert kept == listed == [2, 3] and room and not exists and left == [".lock"]


# -- the place and the cleanup --------------------------------------------------------------------


def test_a_stores_place_is_the_job_its_restart_its_step_and_the_node(tmp_path):
    base = tmp_path / f"slurmddp-snapshots-{os.getuid()}"
    assert store.node_directory(env(tmp_path, SLURM_RESTART_COUNT="1")) == base / "41.1.0" / "n1"
    assert store.run_key({"SLURM_JOB_ID": "41", "SLURM_STEPID": "4294967290"}) == (
        "41", "0", "4294967290")  # fmt: skip
    assert store.run_key({"SLURM_JOB_ID": "41"}) == ("41", "0", "batch")
    assert store.run_key({"TORCHELASTIC_RUN_ID": "a/b.c"}) == ("a_b_c", "0", "torchrun")
    # torchrun's default run id, or no launcher: the process that outlives the run's workers
    agent = f"{os.getppid()}-{store._start_time(os.getppid())}"
    assert store.run_key({"TORCHELASTIC_RUN_ID": "none"}) == ("local", "0", agent)
    assert store.run_key({"WORLD_SIZE": "2"}) == ("local", "0", agent)
    assert store.run_key({}) == ("local", "0", f"{os.getpid()}-{store._start_time(os.getpid())}")
    assert in_child(lambda: store.run_key({}))["result"] != list(store.run_key({}))
    # A store belongs to the directory of its checkpoints: two Checkpointers of one run never
    # share one; a lone run started again in the same directory finds its predecessor's.
    tag = store.scope_tag(tmp_path / "ckpt")
    assert len(tag) == 12 and tag != store.scope_tag(tmp_path / "other")
    assert store.scope_tag("ckpt") == store.scope_tag(Path("ckpt").absolute())
    assert store.run_key({"SLURM_JOB_ID": "41"}, tmp_path / "ckpt") == ("41", "0", f"batch-{tag}")
    assert store.run_key({"TORCHELASTIC_RUN_ID": "r"}, tmp_path / "ckpt")[2] == f"torchrun-{tag}"
    assert store.run_key({}, tmp_path / "ckpt") == ("local", "0", tag)
    assert in_child(lambda: store.run_key({}, tmp_path / "ckpt"))["result"] == ["local", "0", tag]


def test_a_new_restart_removes_its_jobs_earlier_ones_and_no_other_step(tmp_path):
    # All owned by this live process: another step of the new restart, running already.
    other_step = NodeStore.of_this_node(env(tmp_path, SLURM_RESTART_COUNT="1", SLURM_STEP_ID="1"))
    other_job = NodeStore.of_this_node(env(tmp_path, job="410"))
    earlier = NodeStore.of_this_node(env(tmp_path))
    for node in (earlier, other_step, other_job):
        node.put(Shard(1, 0, 1, A, 1, 1), b"a")
    node = NodeStore.of_this_node(env(tmp_path, SLURM_RESTART_COUNT="1"))
    assert node.directory == tmp_path / f"slurmddp-snapshots-{os.getuid()}" / "41.1.0" / "n1"
    assert not earlier.directory.parent.exists()
    assert other_step.shards() and other_job.shards()


def test_stores_whose_owners_are_gone_are_swept_and_no_other(tmp_path):
    home = tmp_path / f"slurmddp-snapshots-{os.getuid()}"

    def made(job: str) -> str:
        node = NodeStore.of_this_node(env(tmp_path, job=job))
        node.put(Shard(1, 0, 1, A, 1, 1), b"a")
        return str(node.directory)

    alive = Path(made("2"))  # this process owns it
    # Job 3's owners were recorded in another pid namespace: they cannot be told, so they stay.
    other_ns = Path(in_child(lambda: made("3"), orphaned=True)["result"])
    for path, owner in store._owners(other_ns):
        path.rename(other_ns / owner._replace(ns="1").name)
    # Job 1's process and its parent are gone.
    gone = Path(in_child(lambda: made("1"), orphaned=True)["result"])
    # Job 4's node directory has no owner: a crash between its making and its record, or kept
    # as stores were before records. The Hugging Face integration's directory is none of these.
    (home / "4.0.0" / "n1").mkdir(mode=0o700, parents=True)
    (home / "slurmddp-resume-x1y2").mkdir(mode=0o700)
    assert gone.exists()
    NodeStore.of_this_node(env(tmp_path, job="5"))
    assert not gone.parent.exists() and not (home / "4.0.0").exists()
    assert alive.exists() and other_ns.exists() and (home / "slurmddp-resume-x1y2").exists()
    # The records and the lock are no shards.
    assert [s.step for s in NodeStore(alive).shards()] == [1]
    assert sorted(p.name for p in home.glob(".*")) == [".lock"]


def test_the_end_of_a_run_removes_its_owners_record_and_those_of_crashed_workers(tmp_path):
    # A worker crashed (its record stays while its parent, the agent, lives); the one started in
    # its place ends the run, beside another rank of the node still running.
    crashed = Path(in_child(lambda: str(NodeStore.of_this_node(env(tmp_path)).directory))[
        "result"])  # fmt: skip
    assert len(store._owners(crashed)) == 1
    node = NodeStore.of_this_node(env(tmp_path))
    assert node.directory == crashed and len(store._owners(crashed)) == 2  # the agent lives
    parent = os.getppid()
    running = store.Owner(store._pid_namespace(), parent, store._start_time(parent) or 0, 0, 0)
    (crashed / running.name).touch()
    node.put(Shard(1, 0, 2, A, 1, 1), b"a")
    node.put(Shard(1, 1, 2, A, 1, 1), b"a")
    node.remove([0])
    assert [o for _, o in store._owners(crashed)] == [running]
    assert [s.rank for s in node.shards()] == [1]
    (crashed / running.name).unlink()
    NodeStore.of_this_node(env(tmp_path, job="2"))  # its last owner gone: swept
    assert not crashed.parent.exists()


def test_the_epilog_recipe_removes_the_ended_jobs_stores_and_no_other(tmp_path):
    recipe = re.search(r"```bash\n(.*?SLURM_JOB_UID.*?)```", DOCS.read_text(), re.S)
    assert recipe is not None
    ended = NodeStore.of_this_node(env(tmp_path, job="41", node="n1"))
    ended_step = NodeStore.of_this_node(env(tmp_path, job="41", SLURM_STEP_ID="1"))
    running = NodeStore.of_this_node(env(tmp_path, job="42"))
    for node in (ended, ended_step, running):
        node.put(Shard(1, 0, 1, A, 1, 1), b"a")
    epilog = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "41", "SLURM_JOB_UID": str(os.getuid()),
              "SLURMDDP_SNAPSHOT_DIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run(["bash", "-c", recipe[1]], env=epilog, capture_output=True, text=True)
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert sorted(p.name for p in ended.root.iterdir()) == [".lock", "42.0.0"]
    assert running.shards()
    gone = subprocess.run(["bash", "-c", recipe[1]], env={**epilog, "SLURM_JOB_ID": "43",
                          "SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "none")})  # fmt: skip
    assert gone.returncode == 0  # nothing there: the epilog still succeeds


# -- room ---------------------------------------------------------------------------------------

GIB = 1 << 30


def cgroup(tmp_path: Path, limits: dict[str, tuple[str, int]]) -> tuple[Path, Path]:
    """A fake cgroup v2 tree: {relative path: (memory.max, memory.current)}; this process in the
    deepest."""
    mount = tmp_path / "cgroup"
    for where, (limit, current) in limits.items():
        (mount / where).mkdir(parents=True, exist_ok=True)
        (mount / where / "memory.max").write_text(f"{limit}\n")
        (mount / where / "memory.current").write_text(f"{current}\n")
    own = max(limits, key=len)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"4:memory:/elsewhere\n0::/{own}\n")
    return proc, mount


def test_a_store_in_memory_leaves_room_within_the_jobs_memory_cgroup(tmp_path):
    node = NodeStore(tmp_path / "n1")
    # Slurm limits the job's cgroup; the task's own says "max". 4 GiB, 3.5 used: 0.5 GiB free,
    # of which a tenth of the limit (0.4 GiB) stays.
    job = {"job_1": (str(4 * GIB), 3 * GIB + GIB // 2), "job_1/step_0": ("max", 0)}
    paths = cgroup(tmp_path, {**job, "job_1/step_0/task_0": ("max", 0)})
    tmpfs = tmp_path / "mounts"
    tmpfs.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n")
    room = node.room_for(GIB // 20, paths, tmpfs)  # 51 MiB of the 102 MiB left
    assert room == store.Room(True, GIB // 2, 4 * GIB, f"the memory cgroup {paths[1]}/job_1")
    assert not node.room_for(GIB // 5, paths, tmpfs).ok
    # On a disk the pages are cache, not the cgroup's to keep: the file system's room.
    disk = tmp_path / "disk-mounts"
    disk.write_text(f"/dev/vda / ext4 rw 0 0\n/dev/vdb {tmp_path} ext4 rw 0 0\n")
    room = node.room_for(GIB // 5, paths, disk)
    usage = shutil.disk_usage(tmp_path)
    assert room.ok == (usage.free - GIB // 5 >= min(GIB, usage.total // 10))
    assert room.where == str(node.directory) and room.total == usage.total
    # No limit anywhere, or no cgroup v2: the file system's room.
    unlimited = cgroup(tmp_path / "u", {"job_1": ("max", 3 * GIB)})
    assert node.room_for(GIB // 5, unlimited, tmpfs).where == str(node.directory)
    assert store.memory_limit(tmp_path / "no-such-file", paths[1]) is None

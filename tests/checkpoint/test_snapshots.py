"""Snapshots (slurmddp.checkpoint.snapshots): the pure rules, the node store, and the guide's loop
with a Dropout layer and DataLoader workers that augment at random, on 2 emulated nodes (gloo; 2
ranks each, or 1 where a node's number of ranks is not what is tested), killed and resumed from
the snapshots of the nodes that remain."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from slurmddp import Checkpointer
from slurmddp.checkpoint.snapshots import Snapshots, flat, store
from slurmddp.checkpoint.snapshots.pace import Pace
from slurmddp.checkpoint.snapshots.store import NodeStore, Shard
from slurmddp.errors import CheckpointError
from tests.conftest import free_port, launcher_free_env, tagged_json

PROGRAM = str(Path(__file__).resolve().parents[1] / "programs" / "readme_data_loop.py")


# -- the format ---------------------------------------------------------------------------------


def test_a_state_comes_back_as_it_was_packed_without_pickle():
    weight = torch.randn(3, 2)
    state = {
        "model": OrderedDict(w=weight, tied=weight, b=torch.zeros(0)),
        "optimizer": {"state": {0: {"momentum": torch.ones(2, dtype=torch.bfloat16)}},
                      "param_groups": [{"lr": 0.1, "params": [0, 1], "nesterov": False}]},
        "rng": {"torch": torch.get_rng_state(), "python": {"gauss_next": None}},
        "misc": (1, 2.5, "x", b"\x00", {3, 4}, complex(1, 2), torch.Size([2]), torch.int8,
                 torch.device("cpu"), torch.tensor([True, False]), torch.tensor([1 + 2j])),
    }  # fmt: skip
    buffer = flat.Buffer()
    _, size = flat.pack(state, buffer)
    data = bytes(buffer.view(size))
    assert b"pickle" not in data and not data.startswith(b"PK")  # no zip, no pickle stream
    out = flat.unpack(data)
    assert type(out["model"]) is OrderedDict and list(out["model"]) == ["w", "tied", "b"]
    assert torch.equal(out["model"]["w"], weight) and out["model"]["b"].shape == (0,)
    assert out["model"]["w"] is out["model"]["tied"]  # tied weights stay one tensor
    assert out["optimizer"]["state"][0]["momentum"].dtype == torch.bfloat16
    assert out["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert out["misc"][:9] == state["misc"][:9]
    assert torch.equal(out["misc"][9], state["misc"][9])
    assert torch.equal(out["misc"][10], state["misc"][10])
    torch.set_rng_state(out["rng"]["torch"])  # its own storage (a view of the buffer crashed)
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])


@pytest.mark.parametrize("state, error", [
    ({"a": object()}, "a snapshot cannot hold a object"),
    ({"a": torch.eye(2).to_sparse()}, "dense tensors only"),
])  # fmt: skip
def test_what_a_snapshot_cannot_hold_is_refused(state, error):
    with pytest.raises(CheckpointError, match=error):
        flat.pack(state, flat.Buffer())


@pytest.mark.parametrize("damage, error", [
    (lambda d: b"PK" + d[2:], "not a slurmddp snapshot"),
    (lambda d: d.replace(b'"float32"', b'"compile"'), "names no torch dtype: 'compile'"),
    (lambda d: d.replace(b'{"A"', b'{"Q"'), "unknown entry 'Q'"),
])  # fmt: skip
def test_a_damaged_snapshot_is_refused_and_runs_nothing(damage, error):
    buffer = flat.Buffer()
    _, size = flat.pack({"w": torch.ones(2)}, buffer)
    with pytest.raises(CheckpointError, match=error):
        flat.unpack(damage(bytes(buffer.view(size))))


def packed(state: dict, buffer: flat.Buffer | None = None) -> torch.Tensor:
    """`state` as `pack` lays it out, a tensor of its own."""
    out, size = flat.pack(state, buffer or flat.Buffer())
    return out[:size].clone()


def rank_state(rank: int, model: dict) -> dict:
    """A DDP rank's state: `model` alike on every rank; its generator, data position and a list
    whose length (so the header's) differ."""
    return {"model": model, "rng": torch.Generator().manual_seed(rank).get_state(),
            "loader": {"consumed": 7 * rank, "key": [rank] * rank}, "step": 5}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def test_one_state_is_always_the_same_bytes_whatever_the_buffer_held():
    state = {"w": torch.ones(3), "b": torch.zeros(1, dtype=torch.int8), "x": "y"}
    dirty = flat.Buffer()
    flat.pack({"w": torch.full((100,), float("nan"))}, dirty)  # garbage where padding will be
    assert torch.equal(packed(state, dirty), packed(state))


def test_a_part_holds_what_differs_from_its_base_and_rebuilds_the_state_exactly():
    model = {"w": torch.randn(64, 64), "b": torch.randn(64), "m": torch.randn(64, 64)}
    base = bytearray(packed(rank_state(0, model)).numpy())
    for variant in (
        rank_state(3, model),  # its generator, position and header differ
        rank_state(3, dict(model, b=model["b"] + 1)),  # and one tensor of the model
        rank_state(3, dict(model, extra=torch.arange(9))),  # and one more than the base has
    ):
        own = packed(variant)
        part = flat.make_part(own, base, zlib.crc32(base))
        assert part is not None and flat.base_crc(part) == zlib.crc32(base)
        assert flat.checksum(part, base) == zlib.crc32(own.numpy())
        assert_same(variant, flat.unpack(part, base=base))
        assert len(part) < own.numel() // 4  # the two 16 KiB matrices are the base's
    # Nothing alike (another model): the whole state, not a part.
    other = packed(rank_state(1, {k: v + 1 for k, v in model.items()}))
    assert flat.make_part(other, base, zlib.crc32(base)) is None


WEIGHTS = torch.randn(64, 64)


def flip(data: bytes, at: int) -> bytes:
    assert at >= 0
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize("damage, error", [
    (lambda part, base: (flip(part, len(part) - 1), base), None),  # its own bytes
    # the base's bytes the part shares
    (lambda part, base: (part, flip(base, base.find(WEIGHTS.numpy().tobytes()))), None),
    (lambda part, base: (part, base[: base.find(WEIGHTS.numpy().tobytes()) + 64]),
     "does not fit it or its base"),  # the base cut short
    (lambda part, base: (part[:-64], base), "does not fit it or its base"),
    (lambda part, base: (part, None), "read without its base"),
    (lambda part, base: (re.sub(rb'"size":(\d+)', lambda m: b'"size":' + b"9" * len(m[1]), part),
                         base), "does not fit it or its base"),  # a larger state than it holds
    (lambda part, base: (part.replace(b'"runs":[', b'"runs":[9,'), base), "table is damaged"),
], ids=["part", "base", "base-short", "part-short", "no-base", "size", "table"])  # fmt: skip
def test_a_damaged_part_or_base_fails_its_check(damage, error):
    model = {"w": WEIGHTS}
    base = bytes(packed(rank_state(0, model)).numpy())
    own = packed(rank_state(1, model))
    part = flat.make_part(own, bytearray(base), zlib.crc32(base))
    assert part is not None
    data, under = damage(bytes(part), base)
    if error is None:
        assert flat.checksum(data, under) != zlib.crc32(own.numpy())
    else:
        with pytest.raises(CheckpointError, match=error):
            flat.checksum(data, under)


def test_a_part_is_read_over_its_base_in_the_stores_mapped_files(tmp_path):
    node = NodeStore(tmp_path / "n1")
    model = {"w": torch.randn(256)}
    base_bytes = bytearray(packed(rank_state(0, model)).numpy())
    own = packed(rank_state(1, model))
    part_bytes = flat.make_part(own, base_bytes, zlib.crc32(base_bytes))
    assert part_bytes is not None
    base = Shard(4, 0, 2, 7, zlib.crc32(base_bytes), len(base_bytes))
    part = Shard(4, 1, 2, 7, zlib.crc32(own.numpy()), len(part_bytes), base=0)
    node.put(base, base_bytes)
    node.put(part, part_bytes)
    with node.mapped(part) as data, node.mapped(base) as under:
        assert flat.checksum(data, under) == part.crc
        assert_same(rank_state(1, model), flat.unpack(data, base=under))
    with pytest.raises(OSError, match="holds"), node.mapped(dataclasses.replace(part, size=3)):
        pass


# -- the node store -------------------------------------------------------------------------------


MS = 1e-3


PLAIN = [(10 * MS, False)] * 3
EVALUATION = 2.0  # seconds: a step with an evaluation or a durable save after it


@pytest.mark.parametrize(("every", "budget", "before", "after", "took", "needed"), [
    # 1 ms at the call, plain steps of 10 ms, 2%: 1 x 0.98 / (0.02 x 10) = 4.9 -> 5 steps
    (1, 0.02, PLAIN, [], 1 * MS, 5),
    (2, 0.02, PLAIN, [], 1 * MS, 6),  # a multiple of every
    (1, 0.5, PLAIN, [], 1 * MS, 1),  # within the budget: every step
    (3, None, PLAIN, [], 9 * MS, 3),  # no budget: every, whatever it costs
    # the three steps after a snapshot (its thread running beside the first) are 6 ms slower in
    # all: 7 ms, 34.3 -> 35 steps; later steps count as plain ones
    (1, 0.02, PLAIN, [(14 * MS, True), (12 * MS, False), (10 * MS, False), (10 * MS, False)],
     1 * MS, 35),
    # still beside the snapshot after three steps: near it
    (1, 0.02, PLAIN, [(10 * MS, True)] * 3 + [(12 * MS, True)], 1 * MS, 15),
    # no plain step seen yet: the quickest step near a snapshot stands for one
    (1, 0.02, [], [(12 * MS, True), (10 * MS, True)], 1 * MS, 15),
    # an evaluation among the plain steps: their median stands, as without it (5)
    (1, 0.02, [*PLAIN, (EVALUATION, False), *PLAIN], [], 1 * MS, 5),
    # none this cycle and the one seen before was slower: no more than the median step near the
    # snapshot (11 ms: 4.45 -> 5; the 30 ms seen before would give 2)
    (1, 0.02, [(30 * MS, False)], [(12 * MS, True), (10 * MS, False)], 1 * MS, 5),
])
def test_snapshots_are_spaced_to_keep_their_cost_within_the_budget(every, budget, before, after,
                                                                     took, needed):  # fmt: skip
    assert one_cycle(Pace(every, budget), before, took, after) == needed


def one_cycle(pace: Pace, before: list, took: float, after: list, ran: float | None = None) -> int:
    """The interval `pace` needs after the steps `before` (no snapshot yet), a snapshot whose call
    took `took`, the steps `after` and its thread's running time `ran`."""
    for seconds, beside in before:
        pace.stepped(seconds, beside)
    pace.needed()  # as a snapshot is taken: the cycle before the first costs nothing
    pace.taken(pace.every, agreed=pace.every)
    pace.took(took)
    for seconds, beside in after:
        pace.stepped(seconds, beside)
    if ran is not None:
        pace.ran(ran)
    return pace.needed()


@pytest.mark.parametrize(("ran", "needed"), [
    (None, 9_805),  # its thread's time unknown: 1 ms + the evaluation's 2 s -> 9,805 steps
    (2 * MS, 25),  # no more than twice its thread's 2 ms: 1 + 4 ms -> 24.5 -> 25
    (0.5 * MS, 10),  # 1 + 1 ms -> 9.8 -> 10
])
def test_an_evaluation_beside_a_snapshot_counts_no_more_than_its_thread_could_cause(ran, needed):
    after = [(10 * MS + EVALUATION, True), *PLAIN, *PLAIN[:1]]
    assert one_cycle(Pace(1, 0.02), PLAIN, 1 * MS, after, ran) == needed


def test_the_interval_lets_a_snapshots_thread_finish_before_the_next_is_due():
    # 0.1 ms at the call, no slowdown (the thread ran beside a GPU's work, say), but the thread
    # ran 45 ms against 10 ms steps: within the budget every step would do (0.49), yet the next
    # snapshot would wait for this one; 5 steps apart it does not.
    assert one_cycle(Pace(1, 0.02), PLAIN, 0.1 * MS, [*PLAIN, *PLAIN], 45 * MS) == 5


def test_before_any_plain_step_a_snapshot_costs_its_threads_whole_run():
    # A snapshot every step from the first: the one step between the first two ran beside the
    # thread, so the slowdown cannot be measured (its quickest near step would say none, and a
    # 1 GiB state was then taken a few steps apart before a cycle measured it). 1 ms at the
    # call + 40 ms of thread against a 12 ms step: 0.98 x 41 / (0.02 x 12) = 167.4 -> 168.
    assert one_cycle(Pace(1, 0.02), [], 1 * MS, [(12 * MS, True)], 40 * MS) == 168
    # once a plain step has been seen, the steps measure it: 12 - 10 ms + 1 ms -> 14.7 -> 15
    assert one_cycle(Pace(1, 0.02), PLAIN, 1 * MS, [(12 * MS, True)], 40 * MS) == 15


def test_the_agreed_interval_applies_from_the_snapshot_taken():
    pace = Pace(2, 0.02)
    assert [s for s in range(1, 7) if pace.due(s)] == [2, 4, 6]  # before the first snapshot
    pace.taken(4, agreed=6)
    assert pace.interval == 6 and [s for s in range(1, 20) if pace.due(s)] == [10, 12, 14, 16, 18]
    pace.taken(10, agreed=1)  # never below every
    assert pace.interval == 2 and pace.next == 12


def test_a_snapshots_cost_is_the_recent_cycles_lower_median():
    pace = Pace(1, 0.02)
    costs = []
    for took in (3, 900, 1, 2, 4, 5, 6):  # ms; one cycle had an evaluation beside it
        pace.stepped(10 * MS, False)  # a plain step; then a snapshot
        pace.taken(1, agreed=1)
        pace.took(took * MS)
        pace.stepped(10 * MS, False)
        pace.needed()
        costs.append(round(pace.snapshot_cost / MS))
    # the lower median of the last five: [3], [3, 900], [3, 900, 1], ... [900, 1, 2, 4, 5]
    assert costs == [3, 3, 3, 2, 3, 4, 4]


@pytest.mark.ranks
def test_an_evaluation_after_a_snapshot_leaves_the_spacing_as_it_was(tmp_path, monkeypatch):
    # One rank, steps of ~5 ms (a sleep leaves the interpreter to the snapshot's thread, as a
    # GPU's work does), a 2 MiB state, snapshot_every=4 within half the training's time: 4 or 8
    # steps apart, loaded machine or not (a snapshot costs a few ms; within the default 2% that
    # would be 49 times as many steps, and hundreds on a loaded machine). Past step 300, two
    # evaluations of 1 s right after a snapshot: counted whole, they would space the snapshots
    # 16 to 70 steps apart here; they stay as they were (4, 8 at most).
    monkeypatch.setenv("SLURMDDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    ckpt = Checkpointer(tmp_path / "ckpt", snapshot_every=4, snapshot_budget=0.5)
    weights = torch.zeros(1 << 19)
    taken: list[int] = []
    evaluated: list[int] = []
    step = 0

    def state():
        taken.append(step)
        return {"w": weights}

    for step in range(1, 601):
        time.sleep(0.005)
        weights.add_(1)
        ckpt.snapshot(step, state)
        if step >= 300 and len(evaluated) < 2 and taken[-1] == step:
            evaluated.append(step)
            time.sleep(1.0)
    ckpt.wait()
    gaps = [b - a for a, b in itertools.pairwise(taken) if a >= evaluated[0]]
    assert max(gaps) <= 12 and step - taken[-1] <= 12, (taken, evaluated)


def test_a_replica_a_full_store_cannot_hold_is_received_and_dropped(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    # The room check passed, then the file system filled: the sender sends anyway, so the
    # bytes are taken into memory and dropped, said once; no file is left half there.
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    snapshots = Snapshots(1, 2)
    snapshots._store = NodeStore(tmp_path / "n2")
    with contextlib.ExitStack() as files:
        sink = snapshots._sink(Shard(5, 1, 2, 0xA, 2, 6), files)
        assert isinstance(sink, bytearray) and len(sink) == 6
    assert snapshots._store.shards() == [] and not list(snapshots._store.directory.glob(".*"))
    assert "slurmddp: node n2 keeps no snapshot: [Errno 28] No space left on device; the " \
        "durable checkpoints stand" in capsys.readouterr().err
    assert snapshots._written == []


def test_a_rank_writes_its_snapshots_over_the_files_of_those_it_prunes(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMDDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("SLURM_JOB_ID", "79")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    ckpt = Checkpointer(tmp_path / "ckpt", snapshot_every=1, snapshot_budget=None)
    here = node_store(tmp_path, "n1", job="79")
    for step in range(1, 5):
        ckpt.snapshot(step, {"w": torch.full((1000,), float(step))})
        ckpt.wait()
        files = sorted(here.glob("*.snap"))
        assert len(files) == min(step, 2)  # snapshot_keep=2
        if step == 2:
            os.link(files[0], tmp_path / "step-1")  # a second name for step 1's file
    # Step 3's snapshot went into step 1's file (a new one would have left the link's bytes).
    assert (tmp_path / "step-1").read_bytes() == files[0].read_bytes() != files[1].read_bytes()
    loaded = ckpt.load_latest()
    assert loaded is not None and loaded.state["w"][0] == 4


def test_snapshot_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="snapshot_every must be an integer >= 0, not -1"):
        Checkpointer(tmp_path, snapshot_every=-1)
    with pytest.raises(ValueError, match="snapshot_keep must be a positive integer, not 0"):
        Checkpointer(tmp_path, snapshot_every=1, snapshot_keep=0)
    with pytest.raises(ValueError, match="snapshots keep replicated states only"):
        Checkpointer(tmp_path, snapshot_every=1, sharded=True)
    for budget in (0, 1, 2.5, -0.1, True, "2%"):
        with pytest.raises(ValueError, match=r"snapshot_budget must be a fraction of the "
                           r"training's time between 0 and 1 \(0.02 is 2%\), or None for no "
                           rf"limit, not {re.escape(repr(budget))}$"):  # fmt: skip
            Checkpointer(tmp_path, snapshot_every=1, snapshot_budget=budget)
    assert Checkpointer(tmp_path, snapshot_every=1, snapshot_budget=None).snapshot_interval == 1
    assert Checkpointer(tmp_path, snapshot_budget=0.5).snapshot_interval == 0  # no snapshots
    Checkpointer(tmp_path).snapshot(1, {"a": 1})  # without snapshot_every: nothing
    assert not list(tmp_path.iterdir())


# -- the guide's loop, killed ---------------------------------------------------------------------

# 2 DataLoader workers (fork) augmenting with torch, numpy and random, a ResumableDistributedSampler
# (the smaller world resumes with it); 6 epochs of 3 steps at 4 ranks, of 6 at 2; snapshots every
# --snapshot-every steps whatever they cost (the tests count steps).
LOOP = ["--workers", "2", "--start-method", "fork", "--sampler", "resumable", "--epochs", "6",
        "--snapshot-budget", "none"]
# The emulated job's end, a day away: without it rank 0 would ask scontrol, and a local cluster
# running beside these tests may have a job 77 of its own, long ended (the ranks would stop).
FAR = str(int(time.time()) + 86_400)
# Two ranks a node where that is what is tested (a node's store holding its ranks' shards and the
# other node's replicas: resumed in place, onto a spare, into a smaller world); one rank a node
# elsewhere (each start of a world is its ranks importing torch: seconds each).
TWO_NODES = ["n1", "n1", "n2", "n2"]
ONE_EACH = ["n1", "n2"]


def run_world(work: Path, nodes: list[str], *args: str,
              **env: str) -> tuple[list[dict], str]:  # fmt: skip
    """The loop at len(nodes) ranks, rank r on node nodes[r] (its own store), in `work`; once a
    rank is SIGKILLed the others are too, as torchrun ends a failed generation. (RESULT lines,
    rank 0's slurmddp lines)."""
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-m", "slurmddp.run", PROGRAM, "--checkpoint-dir",
                          str(work / "ckpt"), *LOOP, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=launcher_free_env(RANK=str(r), WORLD_SIZE=str(len(nodes)),
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                               OMP_NUM_THREADS="1", SLURMD_NODENAME=node,
                                               SLURM_JOB_ID="77", SLURM_JOB_END_TIME=FAR,
                                               SLURMDDP_SNAPSHOT_DIR=str(work / "shm"),
                                               **env))
        for r, node in enumerate(nodes)
    ]  # fmt: skip
    def killed() -> bool:
        return any(p.returncode == -signal.SIGKILL for p in procs)

    def end_groups() -> None:  # each rank's process group: its DataLoader workers too
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    deadline = time.monotonic() + 240
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if killed():
            end_groups()
        time.sleep(0.1)
    # And when every rank died between two looks: a worker forked in the instant before its rank
    # died takes the init process for its parent (torch's watchdog reads the parent as it starts)
    # and never ends, holding the ranks' pipes (seen: the run's pipes open for 24 minutes).
    if killed():
        end_groups()
    outs = [p.communicate(timeout=60) for p in procs]
    lines = "\n".join(line for line in outs[0][1].splitlines() if line.startswith("slurmddp:"))
    # A rank killed, the others may fail first, on the collective it left (gloo says so).
    assert killed() or all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    return [r for out, _ in outs for r in tagged_json(out, "RESULT ")], lines


def node_store(work: Path, node: str, job: str = "77") -> Path:
    """`node`'s store of the loop run in `work` (its checkpoints in work/ckpt)."""
    return store.node_directory({"SLURMDDP_SNAPSHOT_DIR": str(work / "shm"), "SLURM_JOB_ID": job,
                                 "SLURMD_NODENAME": node}, work / "ckpt")  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted loop's digest at a world of `ranks`, each run once."""
    digests: dict[int, str] = {}

    def digest(ranks: int) -> str:
        if ranks not in digests:
            nodes = {4: TWO_NODES, 2: ONE_EACH}[ranks]
            results, _ = run_world(tmp_path_factory.mktemp(f"reference-{ranks}"), nodes)
            found = {r["digest"] for r in results}
            assert len(results) == ranks and len(found) == 1
            digests[ranks] = found.pop()
        return digests[ranks]

    return digest


# A world killed at step 10 leaves the same state for every test that starts it with the same
# arguments: it runs once, and each such test acts on its own copy (the state names no path of
# its own: the stores and checkpoints are found from the directories the ranks are given).
def killed_world(tmp_path_factory, nodes: list[str], *args: str) -> Path:
    work = tmp_path_factory.mktemp("killed")
    ended, _ = run_world(work, nodes, *args, "--crash-at", "10")
    assert ended == []
    return work


def copy_into(tmp_path: Path, work: Path, job: str = "77") -> None:
    """`work`'s run copied into `tmp_path`, its stores renamed for the checkpoints' new place
    (a store belongs to the directory of its checkpoints)."""
    shutil.copytree(work, tmp_path, symlinks=True, dirs_exist_ok=True)
    run = node_store(work, "n1", job).parent
    for node in run.iterdir():
        if node.is_dir():
            node_store(tmp_path, node.name, job).parent.mkdir(mode=0o700, exist_ok=True)
            (tmp_path / node.relative_to(work)).rename(node_store(tmp_path, node.name, job))
    shutil.rmtree(tmp_path / run.relative_to(work))


@pytest.fixture(scope="module")
def killed_snapshotting(tmp_path_factory) -> Path:
    return killed_world(tmp_path_factory, TWO_NODES, "--snapshot-every", "1")


@pytest.fixture(scope="module")
def killed_snapshotting_and_saving(tmp_path_factory) -> Path:
    return killed_world(tmp_path_factory, ONE_EACH, "--snapshot-every", "1", "--save-every", "4")


@pytest.mark.ranks
def test_killed_ranks_resume_from_the_snapshot_in_place_bitwise(tmp_path, uninterrupted,
                                                                 killed_snapshotting):  # fmt: skip
    copy_into(tmp_path, killed_snapshotting)
    results, said = run_world(tmp_path, TWO_NODES, "--snapshot-every", "1")
    # Killed right after step 10's snapshot began: it, or step 9's, is complete.
    assert {r["start"] for r in results} in ({10}, {9}), results
    assert "resuming from the snapshot of step" in said and "0 of 4 shards fetched" in said
    assert {r["digest"] for r in results} == {uninterrupted(4)}
    assert not node_store(tmp_path, "n1").exists()  # mark_done removed the run's snapshots


@pytest.mark.ranks
@pytest.mark.floor
def test_a_lost_nodes_shards_come_from_their_replicas_to_the_spare_bitwise(
        tmp_path, uninterrupted, killed_snapshotting):  # fmt: skip
    copy_into(tmp_path, killed_snapshotting)
    subprocess.run(["rm", "-r", node_store(tmp_path, "n2")], check=True)  # lost with its node
    results, said = run_world(tmp_path, ["n1", "n1", "n3", "n3"], "--snapshot-every", "1")
    assert {r["start"] for r in results} in ({10}, {9}), results
    assert "2 of 4 shards fetched from peers" in said, said
    assert {r["digest"] for r in results} == {uninterrupted(4)}
    assert {Path(r["resumed"]).parent.name for r in results} == {"n1"}  # the holder of all four


@pytest.mark.ranks
def test_without_a_complete_snapshot_the_durable_checkpoint_is_used(
        tmp_path, uninterrupted, killed_snapshotting_and_saving):  # fmt: skip
    # With both nodes lost nothing of the snapshots is left.
    copy_into(tmp_path, killed_snapshotting_and_saving)
    for node in ONE_EACH:
        subprocess.run(["rm", "-r", node_store(tmp_path, node)], check=True)
    results, said = run_world(tmp_path, ["n3", "n4"], "--snapshot-every", "1", "--save-every", "4")
    assert {r["start"] for r in results} == {8}, results
    assert "resuming from the snapshot" not in said
    assert {r["digest"] for r in results} == {uninterrupted(2)}


@pytest.mark.ranks
def test_a_failure_during_a_snapshot_leaves_the_one_before(tmp_path, uninterrupted):
    # Rank 1 dies writing its snapshot of step 10: that step lacks its shard; step 9 is whole.
    ended, _ = run_world(tmp_path, ONE_EACH, "--snapshot-every", "1", "--die-in-snapshot", "10")
    assert ended == []
    results, said = run_world(tmp_path, ONE_EACH, "--snapshot-every", "1")
    assert {r["start"] for r in results} == {9}, results
    assert "resuming from the snapshot of step 9" in said, said
    assert {r["digest"] for r in results} == {uninterrupted(2)}


@pytest.mark.ranks
def test_a_requeued_run_finds_no_snapshot_and_says_so(tmp_path, uninterrupted,
                                                       killed_snapshotting_and_saving):  # fmt: skip
    # A requeue is a new run of the job (SLURM_RESTART_COUNT): the run before's snapshots stay
    # with it (here its stores are on the same nodes, and are removed as stale).
    copy_into(tmp_path, killed_snapshotting_and_saving)
    results, said = run_world(tmp_path, ONE_EACH, "--snapshot-every", "1", "--save-every", "4",
                              SLURM_RESTART_COUNT="1")  # fmt: skip
    assert {r["start"] for r in results} == {8}, results
    assert "no snapshot of this job is on its nodes" in said, said
    assert not node_store(tmp_path, "n1").exists()  # the run before's, removed
    assert {r["digest"] for r in results} == {uninterrupted(2)}


@pytest.mark.ranks
def test_a_smaller_world_resumes_from_the_snapshot(tmp_path, killed_snapshotting):
    # 4 ranks on 2 nodes killed; 2 ranks on one node come back (a shrink): each takes the shard
    # of its own rank, all of them on that node, and trains on to the end (not bitwise: the
    # world changed; tests/training/test_sampler.py has the samples across world sizes).
    copy_into(tmp_path, killed_snapshotting)
    results, said = run_world(tmp_path, ["n1", "n1"], "--snapshot-every", "1")
    assert "resuming from the snapshot of step" in said and "0 of 2 shards fetched" in said
    assert len(results) == 2 and {r["start"] for r in results} <= {9, 10}, results


@pytest.mark.ranks
def test_snapshots_over_their_budget_are_spaced_alike_on_every_rank(tmp_path, uninterrupted):
    # A budget no snapshot fits (0.01% of the time): the first snapshot's cycle is measured (less
    # its set-up), and at the second the ranks agree on the widest need, applied from there:
    # after step 2 they space them out alike; killed at step 10, both resume from step 2's, the
    # newest they both took, bitwise.
    fast = ["--snapshot-every", "1", "--snapshot-budget", "0.0001"]
    ended, said = run_world(tmp_path, ONE_EACH, *fast, "--crash-at", "10")
    assert ended == []
    results, said = run_world(tmp_path, ONE_EACH, *fast)
    assert {r["start"] for r in results} == {2}, results
    assert "resuming from the snapshot of step 2 " in said, said
    assert re.search(r"snapshots every \d+ steps rather than every 1, to keep them within 0.01% "
                     r"of the training's time \(snapshot_budget\): on rank 0 one "
                     r"takes [\d.]+ ms against steps of [\d.]+ ms; the ranks take the widest "
                     r"need", said), said
    assert {r["digest"] for r in results} == {uninterrupted(2)}

"""Asynchronous sharded checkpoints (``sharded=True, async_save=True``): `save` returns once each
rank's part is copied, DCP writes it in the background, and the publish, verification and
fallback are those of every other mode. FSDP2 (`fully_shard`) on two gloo CPU ranks."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from slurmddp.checkpoint import Checkpointer, CheckpointError, wait_for_saves, writers
from tests.checkpoint.test_checkpoint import PRELUDE, entries, pointer, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def gate_writes(monkeypatch) -> threading.Event:
    """DCP's writes wait until the returned event is set."""
    gate = threading.Event()
    real = FileSystemWriter.write_data

    def gated(self, *args, **kwargs):
        assert gate.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", gated)
    return gate


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# -- one process -------------------------------------------------------------------------------


def test_save_returns_before_the_write_and_loads_what_it_copied(tmp_path, monkeypatch):
    gate = gate_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, sharded=True, async_save=True)
    weights = torch.arange(4.0)
    ckpt.save(1, {"w": weights, "meta": {"lr": 0.5}})
    assert ckpt.latest_step is None and not (tmp_path / "step-00000001").exists()
    weights += 10  # training goes on and changes the model while the save is in flight
    gate.set()
    ckpt.wait()
    assert ckpt.latest_step == 1 and pointer(tmp_path) == "step-00000001"
    assert entries(tmp_path / "step-00000001") == [".metadata", "__0_0.distcp", "manifest.json"]
    into = {"w": torch.zeros(4), "meta": {"lr": 0.0}}
    loaded = ckpt.load_latest(into=into)
    assert loaded.step == 1 and loaded.state is into
    assert torch.equal(into["w"], torch.arange(4.0)) and into["meta"] == {"lr": 0.5}


def test_wait_for_saves_and_load_latest_settle_a_save_in_flight(tmp_path, monkeypatch):
    gate = gate_writes(monkeypatch)
    ckpt = Checkpointer(tmp_path, sharded=True, async_save=True)
    ckpt.save(1, {"w": torch.ones(2)})
    threading.Timer(0.2, gate.set).start()
    wait_for_saves()
    assert ckpt.latest_step == 1
    gate.clear()
    ckpt.save(2, {"w": torch.full((2,), 2.0)})
    threading.Timer(0.2, gate.set).start()
    into = {"w": torch.zeros(2)}
    assert ckpt.load_latest(into=into).step == 2 and into["w"].tolist() == [2.0, 2.0]


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, sharded=True, async_save=True)
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((64,), float(step))})
    ckpt.wait()
    newest = tmp_path / "step-00000002"
    flip_a_byte(newest / "__0_0.distcp")
    into = {"w": torch.zeros(64)}
    assert ckpt.load_latest(into=into).step == 1 and torch.equal(into["w"], torch.ones(64))
    assert capsys.readouterr().err == (
        f"slurmddp: checkpoint {newest} is corrupt (the crc32 of __0_0.distcp does not match its "
        f"manifest); falling back to {tmp_path / 'step-00000001'}\n"
        f"slurmddp: resuming from step 1 (saved without a run id): {tmp_path / 'step-00000001'}\n"
    )


def test_a_failed_write_is_raised_once_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, sharded=True, async_save=True)
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.wait()

    def enospc(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writers, "fsync_and_hash", enospc)
    ckpt.save(2, {"w": torch.zeros(2)})  # fails in the background
    with pytest.raises(CheckpointError, match=r"^cannot save checkpoint step 2 .*No space left"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.wait()  # raised once only
    assert ckpt.latest_step == 1 and entries(tmp_path) == ["latest", "step-00000001"]
    ckpt.save(3, {"w": torch.full((2,), 3.0)})
    ckpt.wait()
    assert ckpt.latest_step == 3


# -- FSDP2 on two gloo ranks -------------------------------------------------------------------

FSDP = """
import threading
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from slurmddp.checkpoint import writers
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (2,))
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=mesh)
opt = torch.optim.Adam(model.parameters(), lr=0.1)

def train():
    opt.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    opt.step()

def state():
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}

def full():  # a collective: every rank gathers every parameter
    return [p.full_tensor().clone() for p in model.parameters()]

def load(c):
    s = state()
    loaded = c.load_latest(into=s)
    set_state_dict(model, opt, model_state_dict=s["model"], optim_state_dict=s["optim"])
    return loaded

def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

# DCP's writes wait at `gate`; `writing` is set once they started.
gate, writing = threading.Event(), threading.Event()
gate.set()
real_write = FileSystemWriter.write_data
def gated_write(self, *args, **kwargs):
    writing.set()
    assert gate.wait(120)
    return real_write(self, *args, **kwargs)
FileSystemWriter.write_data = gated_write
c = Checkpointer(D, sharded=True, async_save=True)
out = {}
"""
PRELUDE_FSDP = PRELUDE + FSDP


@pytest.mark.ranks
@pytest.mark.floor
def test_fsdp2_saves_in_the_background_while_training_goes_on(tmp_path):
    results = run_ranks(
        """
        train()
        gate.clear()
        c.save(1, state())
        out["returned"] = c.latest_step is None and not os.path.exists(D + "/step-00000001")
        saved = full()  # collectives of the training's group while DCP's thread waits
        train(); train()  # training goes on while the save is in flight
        out["moved"] = not same(saved, full())
        gate.set()
        c.wait()
        out["latest"] = c.latest_step
        loaded = load(c)
        out["loaded"] = [loaded.step, same(saved, full())]
        out["files"] = sorted(os.listdir(loaded.path))
        train()
        c.save(2, state())
        c.wait()
        if rank == 0:  # rank 1's shard of step 2 is damaged: every rank falls back to step 1
            path = D + "/step-00000002/__1_0.distcp"
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 1
            open(path, "wb").write(bytes(data))
        td.barrier()
        loaded = load(c)
        out["fallback"] = [loaded.step, same(saved, full())]
        td.destroy_process_group()
        """,
        tmp_path / "ck", prelude=PRELUDE_FSDP,
    )  # fmt: skip
    for out in results:
        assert out["returned"] and out["moved"]
        assert out["latest"] == 1
        assert out["loaded"] == [1, True]
        assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
        assert out["fallback"] == [1, True]


def kill_mid_write(directory: Path, where: str) -> None:
    # Both ranks die with step 2 in flight: while DCP writes the shards, or while rank 0
    # checksums the complete shards for the manifest.
    run_ranks(
        f"""
        train()
        c.save(1, state())
        c.wait()
        if rank == 0:
            torch.save(full(), D + ".want")
        else:
            full()
        train()
        under_way = writing  # set once this rank's DCP write started
        if "{where}" == "shards":
            gate.clear()
            writing.clear()
        else:
            under_way = threading.Event()  # set once rank 0 checksums the complete shards
            if rank != 0:
                under_way.set()
            def hang(path):
                under_way.set()
                threading.Event().wait()
            writers.fsync_and_hash = hang
        c.save(2, state())
        assert under_way.wait(60)
        td.barrier()  # both ranks are mid-write
        os.kill(os.getpid(), 9)
        """,
        directory, prelude=PRELUDE_FSDP, status=-9,
    )  # fmt: skip


KILLED_MID_WRITE = ["shards", "manifest"]


@pytest.fixture(scope="module")
def killed_mid_write(tmp_path_factory) -> tuple[dict[str, str], list[dict]]:
    """The `latest` each kill left, then what one world resuming both found: a world's start
    (two interpreters importing torch) costs more than a resume, and each resume loads the whole
    model and optimizer and works in a directory of its own."""
    base = tmp_path_factory.mktemp("killed")
    latest = {}
    for where in KILLED_MID_WRITE:
        kill_mid_write(base / where, where)
        latest[where] = pointer(base / where)
    results = run_ranks(
        """
        for where in ("shards", "manifest"):
            d = f"{D}/{where}"
            c = Checkpointer(d, sharded=True, async_save=True)
            loaded = load(c)
            found = {"loaded": [loaded.step, same(torch.load(d + ".want"), full())]}
            found["left"] = sorted(n.split("-")[0] for n in os.listdir(d) if n.startswith("."))
            train()
            c.save(2, state())
            c.wait()
            # Rank 0 removed the leftovers (before its wait returned); the others may see them
            # go.
            left = [n for n in os.listdir(d) if n != "save-time.json"]  # the last save's time
            found["after"] = sorted(left) if rank == 0 else None
            out[where] = found
        td.destroy_process_group()
        """,
        base, prelude=PRELUDE_FSDP,
    )  # fmt: skip
    return latest, results


@pytest.mark.parametrize("where", KILLED_MID_WRITE)
@pytest.mark.ranks
def test_killed_mid_write_the_previous_checkpoint_stays_the_latest(killed_mid_write, where):
    latest, results = killed_mid_write
    assert latest[where] == "step-00000001"
    for out in results:
        assert out[where]["loaded"] == [1, True]
        assert out[where]["left"] == [".tmp"]  # what the killed save left, unpublished
    assert results[0][where]["after"] == ["latest", "step-00000001", "step-00000002"]

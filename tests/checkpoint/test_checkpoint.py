"""Checkpointer: atomic publish under SIGKILL, verified load with fallback, no code in pickles,
async saves, and replicated and sharded saves across two gloo ranks."""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from slurmddp.checkpoint import (
    Checkpoint,
    Checkpointer,
    CheckpointError,
    crc32,
    layout,
    wait_for_saves,
    writers,
)
from slurmddp.checkpoint import dcp as safe_dcp
from slurmddp.checkpoint import manifest as manifests
from slurmddp.protocol import RUN_ID_VAR
from tests.conftest import free_port, launcher_free_env


def state_at(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step,
            "nested": collections.OrderedDict(m=[torch.arange(3), (1, "a", None)])}  # fmt: skip


def save_steps(directory: Path, steps, keep: int = 3) -> Checkpointer:
    ckpt = Checkpointer(directory, keep=keep)
    for step in steps:
        ckpt.save(step, state_at(step))
    ckpt.wait()  # old checkpoints are removed in the background
    return ckpt


def entries(directory: Path) -> list[str]:
    """The checkpoint directory's entries, but the last save's duration (save-time.json) that
    every save rewrites (tests/preemption/test_deadline.py)."""
    return sorted(n for n in os.listdir(directory) if n != SAVE_TIME)


SAVE_TIME = "save-time.json"


def resumed(path: Path, run: str | None = None) -> str:
    """The line rank 0 prints when it resumes from checkpoint `path`, saved by `run`."""
    saved_by = f"of run {run}" if run else "(saved without a run id)"
    return f"slurmddp: resuming from step {int(path.name[5:])} {saved_by}: {path}\n"


def pointer(directory: Path) -> str:
    return (directory / "latest").read_text().strip()


def write_manifest(path: Path, step: int, mode: str = "replicated") -> None:
    """A manifest that matches whatever files `path` holds now (to craft checkpoints); format 1,
    with sha256 sums, as older versions wrote: it still loads."""
    files = {}
    for f in sorted(path.iterdir()):
        if f.name != "manifest.json":
            data = f.read_bytes()
            files[f.name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "mode": mode,
                                                    "files": files}))  # fmt: skip


@pytest.fixture
def run_as(monkeypatch):
    """Make this process's run id (`slurmddp.run_id`) `value`; None: nothing gives one."""

    def set_to(value: str | None) -> None:
        for name in (RUN_ID_VAR, "SLURM_JOB_ID", "SLURM_JOBID", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name, raising=False)
        if value is not None:
            monkeypatch.setenv(RUN_ID_VAR, value)

    return set_to


def assert_loads(directory: Path, step: int) -> Checkpoint:
    loaded = Checkpointer(directory).load_latest()
    assert loaded is not None and loaded.step == step
    assert loaded.state["step"] == step and torch.equal(loaded.state["w"], state_at(step)["w"])
    return loaded


# -- round trip, layout, pruning ---------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path, run_as):
    run_as("linux-40_3")
    directory = tmp_path / "a" / "b"  # created, parents too
    state = {"t": torch.randn(3, 2), "p": torch.nn.Parameter(torch.ones(2)), "i": 7, "f": 0.5,
             "s": "x", "b": b"\x00", "none": None, "size": torch.Size([2, 3]),
             "dtype": torch.bfloat16, "dev": torch.device("cpu"), "c": 1 + 2j, "set": {1, 2},
             "od": collections.OrderedDict(z=1, a=[torch.zeros(1), (2, 3)])}  # fmt: skip
    ckpt = Checkpointer(directory)
    assert ckpt.latest_step is None
    ckpt.save(12, state)
    assert entries(directory) == ["latest", "step-00000012"]
    assert pointer(directory) == "step-00000012" and ckpt.latest_step == 12
    assert entries(directory / "step-00000012") == ["manifest.json", "state.pt"]
    manifest = json.loads((directory / "step-00000012" / "manifest.json").read_text())
    data = (directory / "step-00000012" / "state.pt").read_bytes()
    crc = f"{zlib.crc32(data):08x}"
    assert manifest == {"format": 2, "step": 12, "mode": "replicated", "run_id": "linux-40_3",
                        "files": {"state.pt": {"size": len(data), "crc32": crc}}}  # fmt: skip
    run_as("another-run")  # asks for it: the checkpoint's run, not the loader's
    ckpt = Checkpointer(directory, resume_from="linux-40_3")
    loaded = ckpt.load_latest()
    assert loaded.step == 12 and loaded.path == directory / "step-00000012"
    assert loaded.run_id == "linux-40_3"
    assert loaded.state.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded.state[key], value)
        elif key != "od":
            assert loaded.state[key] == value and type(loaded.state[key]) is type(value)
    assert type(loaded.state["od"]) is collections.OrderedDict
    assert list(loaded.state["od"]) == ["z", "a"] and loaded.state["od"]["a"][1] == (2, 3)

    into = {"keep": 1}
    again = ckpt.load_latest(into=into)
    assert again.state is into and into["keep"] == 1 and into["i"] == 7


def test_without_a_run_id_the_manifest_records_none(tmp_path, run_as):
    run_as(None)
    save_steps(tmp_path, [1])
    assert json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())["run_id"] is None
    assert assert_loads(tmp_path, 1).run_id is None  # a process without one resumes it


def test_fresh_start_is_none(tmp_path):
    assert Checkpointer(tmp_path / "missing").load_latest() is None
    assert Checkpointer(tmp_path).load_latest() is None
    (tmp_path / ".tmp-step-3-abcdef").mkdir()  # a writer that died before publishing anything
    assert Checkpointer(tmp_path).load_latest() is None


def test_keep_prunes_the_oldest_only_after_the_new_one_is_published(tmp_path, monkeypatch):
    seen = []
    real = layout.write_pointer

    def spy(directory, name):
        seen.append((name, entries(directory)))
        real(directory, name)

    monkeypatch.setattr(layout, "write_pointer", spy)
    ckpt = save_steps(tmp_path, range(1, 6), keep=2)
    assert entries(tmp_path) == ["latest", "step-00000004", "step-00000005"]
    # When the pointer moved to step 5, step 3 (beyond keep) still existed.
    name, before = seen[-1]
    assert name == "step-00000005" and "step-00000003" in before
    assert ckpt.latest_step == 5
    assert_loads(tmp_path, 5)


def test_keep_counts_only_steps_up_to_the_one_saved(tmp_path):
    save_steps(tmp_path, [10, 20, 30], keep=3)
    (tmp_path / "latest").write_text("step-00000010\n")  # as after a fallback to step 10
    save_steps(tmp_path, [11], keep=2)
    # 30 and 20 (newer than 11: an abandoned run) stay; below 11 only `keep` are kept.
    assert entries(tmp_path) == ["latest", "step-00000010", "step-00000011", "step-00000020",
                                 "step-00000030"]  # fmt: skip
    save_steps(tmp_path, [12], keep=2)
    assert "step-00000010" not in entries(tmp_path)


def test_saving_a_step_again_replaces_it(tmp_path):
    ckpt = save_steps(tmp_path, [1, 2])
    ckpt.save(2, {"w": torch.zeros(1), "step": 2, "again": True})
    ckpt.wait()
    assert entries(tmp_path) == ["latest", "step-00000001", "step-00000002"]
    loaded = ckpt.load_latest()
    assert loaded.step == 2 and loaded.state["again"] is True


def test_stale_temporary_directories_are_removed_after_a_save(tmp_path):
    save_steps(tmp_path, [1])
    for name in (".tmp-step-2-0011", ".trash-step-00000001-22", ".prev-step-00000001-33"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(b"partial")
    (tmp_path / ".latest.tmp-44").write_text("x")
    save_steps(tmp_path, [2])
    assert entries(tmp_path) == ["latest", "step-00000001", "step-00000002"]


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_created_paths_follow_the_umask_and_are_never_world_writable(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_steps(tmp_path / "new" / "ck", [1, 2])
    finally:
        os.umask(old)
    want_dir, want_file = 0o775 & ~umask, 0o664 & ~umask
    for path in [tmp_path / "new", *sorted((tmp_path / "new").rglob("*"))]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (want_dir if path.is_dir() else want_file), (path, oct(mode))


# -- refusing bad input ------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    ("step", "state", "message"),
    [
        (-1, {}, "checkpoint step must be an integer >= 0, not -1"),
        (True, {}, "checkpoint step must be an integer >= 0, not True"),
        ("3", {}, "checkpoint step must be an integer >= 0, not '3'"),
        (1, [torch.ones(1)], "checkpoint state must be a mapping (a dict of tensors and plain "
                             "values), not list"),
        (1, {"m": {"x": Opaque()}},
         "state['m']['x'] has type tests.checkpoint.test_checkpoint.Opaque, "),
        (1, {"a": np.zeros(2)}, "state['a'] has type numpy.ndarray, "),
        (1, {"d": collections.defaultdict(int)}, "state['d'] has type collections.defaultdict"),
        (1, {"l": [1, (2, lambda: 0)]}, "state['l'][1][1] has type function, "),
        (1, {Opaque(): 1}, "a key of state has type tests.checkpoint.test_checkpoint.Opaque, "),
    ],
)  # fmt: skip
def test_save_refuses_bad_input_before_writing(tmp_path, step, state, message):
    directory = tmp_path / "ck"
    with pytest.raises(CheckpointError) as info:
        Checkpointer(directory).save(step, state)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text
    if "has type" in text:
        assert "torch.load(weights_only=True) refuses" in text
    assert not directory.exists()


def test_keep_is_checked(tmp_path):
    with pytest.raises(ValueError, match="keep must be a positive integer, not 0"):
        Checkpointer(tmp_path, keep=0)


# -- failures while saving keep the previous checkpoint ----------------------------------------


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "write", "state", "pointer"])
def test_disk_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    ckpt = save_steps(tmp_path, [1])
    if where == "fsync":
        monkeypatch.setattr(os, "fsync", enospc)
    elif where == "write":  # in the middle of torch.save's output
        real_write = os.write

        def write(fd, data):
            if len(data) > 64:
                enospc()
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)
    elif where == "state":
        monkeypatch.setattr(writers, "write_state", enospc)
    else:
        monkeypatch.setattr(os, "replace", enospc)  # the pointer's rename
    with pytest.raises(CheckpointError) as info:
        ckpt.save(2, state_at(2))
    monkeypatch.undo()
    assert str(info.value) == (
        f"cannot save checkpoint step 2 in {tmp_path}: [Errno 28] No space left on device; the "
        "previous checkpoint stays the latest: check free space, quota and permissions there"
    )
    assert pointer(tmp_path) == "step-00000001"
    assert not [n for n in entries(tmp_path) if n.startswith(".tmp-")]
    assert_loads(tmp_path, 1)
    ckpt.save(2, state_at(2))  # and the next save works once there is room again
    assert_loads(tmp_path, 2)


def test_unwritable_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    directory = tmp_path / "file" / "ck"
    with pytest.raises(CheckpointError) as info:
        Checkpointer(directory).save(1, state_at(1))
    assert str(info.value).startswith(f"cannot save checkpoint step 1 in {directory}: [Errno 20]"
                                      " Not a directory: ")  # fmt: skip
    assert "\n" not in str(info.value)


# -- verified load and fallback ----------------------------------------------------------------


def newest_two(tmp_path) -> tuple[Path, Path]:
    save_steps(tmp_path, [1, 2, 3])
    return tmp_path / "step-00000003", tmp_path / "step-00000002"


def test_corrupt_newest_falls_back_to_the_previous(tmp_path, capsys):
    newest, previous = newest_two(tmp_path)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "state.pt").write_bytes(bytes(data))
    assert_loads(tmp_path, 2)
    assert capsys.readouterr().err == (
        f"slurmddp: checkpoint {newest} is corrupt (the crc32 of state.pt does not match its "
        f"manifest); falling back to {previous}\n"
    ) + resumed(previous)


def test_format_1_manifests_with_sha256_still_load_and_verify(tmp_path, capsys, run_as):
    newest, previous = newest_two(tmp_path)
    for path, step in ((newest, 3), (previous, 2)):
        (path / "manifest.json").unlink()
        write_manifest(path, step)  # as written before run ids
    run_as(None)  # they record no run: resumed by a process without one (or asked for)
    assert assert_loads(tmp_path, 3).run_id is None
    capsys.readouterr()
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "state.pt").write_bytes(bytes(data))
    assert_loads(tmp_path, 2)
    assert capsys.readouterr().err == (
        f"slurmddp: checkpoint {newest} is corrupt (the sha256 of state.pt does not match its "
        f"manifest); falling back to {previous}\n"
    ) + resumed(previous)


def test_a_newer_manifest_format_is_skipped(tmp_path, capsys):
    newest, previous = newest_two(tmp_path)
    manifest = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps({**manifest, "format": 3}))
    assert_loads(tmp_path, 2)
    assert capsys.readouterr().err == (f"slurmddp: checkpoint {newest} is in an unknown format "
                                       f"(version 3); falling back to {previous}\n"
                                       ) + resumed(previous)  # fmt: skip


def test_a_large_state_is_checksummed_while_written_and_flushed_early(tmp_path, monkeypatch):
    # Small thresholds: the 6 MiB of tensors take the crc32 in parts, combined, and background
    # fdatasyncs.
    monkeypatch.setattr(writers, "PARALLEL_CRC", 1 << 16)
    monkeypatch.setattr(writers, "FLUSH_EVERY", 1 << 20)
    synced = []
    real_fdatasync = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(fd) or real_fdatasync(fd))
    state = {f"t{i}": torch.randn(1 << 18) for i in range(6)} | {"small": torch.ones(3)}
    Checkpointer(tmp_path).save(1, state)
    path = tmp_path / "step-00000001"
    data = (path / "state.pt").read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"]["state.pt"] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert synced  # the disk got the first MiBs before the end
    loaded = Checkpointer(tmp_path).load_latest()
    assert all(torch.equal(loaded.state[k], v) for k, v in state.items())


def test_crc32_combine_matches_zlib():
    rng = random.Random(7)
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(0, 3000)), rng.randbytes(rng.randrange(0, 3000))
        whole = crc32.combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert whole == zlib.crc32(a + b)
    assert crc32.combine(0x12345678, 0, 0) == 0x12345678  # B empty
    # Lengths of 512 MiB and more wrap around the table: (A+B)+C must equal A+(B+C).
    combine = crc32.combine
    for _ in range(20):
        c1, c2, c3 = (rng.getrandbits(32) for _ in range(3))
        l2, l3 = rng.randrange(1 << 29, 1 << 42), rng.randrange(1 << 29, 1 << 42)
        assert combine(combine(c1, c2, l2), c3, l3) == combine(c1, combine(c2, c3, l3), l2 + l3)


def test_a_failed_background_flush_fails_the_save(tmp_path, monkeypatch):
    ckpt = save_steps(tmp_path, [1])
    monkeypatch.setattr(writers, "FLUSH_EVERY", 1 << 20)

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(CheckpointError, match=r"^cannot save checkpoint step 2 in .*: \[Errno 5\] "
                                              r"Input/output error; the previous"):  # fmt: skip
        ckpt.save(2, {"w": torch.randn(1 << 20), "step": 2})
    monkeypatch.undo()
    assert pointer(tmp_path) == "step-00000001"
    assert not [n for n in entries(tmp_path) if n.startswith(".tmp-")]
    assert_loads(tmp_path, 1)


def test_truncated_newest_falls_back_to_the_previous(tmp_path, capsys):
    newest, previous = newest_two(tmp_path)
    size = (newest / "state.pt").stat().st_size
    os.truncate(newest / "state.pt", 100)
    assert_loads(tmp_path, 2)
    assert capsys.readouterr().err == (
        f"slurmddp: checkpoint {newest} is truncated (state.pt has 100 bytes, its manifest says "
        f"{size}); falling back to {previous}\n"
    ) + resumed(previous)


def test_without_verify_an_unreadable_file_still_falls_back(tmp_path, capsys):
    newest, previous = newest_two(tmp_path)
    os.truncate(newest / "state.pt", 100)
    loaded = Checkpointer(tmp_path, verify=False).load_latest()
    assert loaded.step == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slurmddp: checkpoint {newest} is unreadable by torch.load (")
    assert err.endswith(f"); falling back to {previous}\n" + resumed(previous))
    assert err.count("\n") == 2


@pytest.mark.parametrize("damage", ["no pointer", "dangling", "garbage", "no manifest", "bad json"])
def test_damaged_pointer_or_manifest_falls_back(tmp_path, capsys, damage):
    newest, previous = newest_two(tmp_path)
    if damage == "no pointer":
        (tmp_path / "latest").unlink()
        what, target = f"pointer {tmp_path / 'latest'} is missing", newest
        expect = 3
    elif damage == "dangling":
        (tmp_path / "latest").write_text("step-00000009\n")
        what = f"{tmp_path / 'step-00000009'} is missing (named by {tmp_path / 'latest'})"
        target, expect = newest, 3
    elif damage == "garbage":
        (tmp_path / "latest").write_text("../../etc\n")
        what = f"pointer {tmp_path / 'latest'} is unreadable (it does not name a checkpoint)"
        target, expect = newest, 3
    elif damage == "no manifest":
        (newest / "manifest.json").unlink()
        what, target, expect = f"{newest} is incomplete (it has no manifest.json)", previous, 2
    else:
        (newest / "manifest.json").write_text('{"format": 1, "files": ')
        what = f"{newest} is corrupt (its manifest.json does not parse)"
        target, expect = previous, 2
    assert_loads(tmp_path, expect)
    assert capsys.readouterr().err == (f"slurmddp: checkpoint {what}; falling back to "
                                       f"{target}\n") + resumed(target)  # fmt: skip


def test_all_invalid_is_an_error_not_a_fresh_start(tmp_path, capsys):
    save_steps(tmp_path, [1, 2])
    for step in (1, 2):
        os.truncate(tmp_path / f"step-{step:08d}" / "state.pt", 10)
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path).load_latest()
    assert str(info.value) == (
        f"no valid checkpoint in {tmp_path}: {tmp_path / 'step-00000001'} is truncated "
        f"(state.pt has 10 bytes, its manifest says "
        f"{json.loads((tmp_path / 'step-00000001' / 'manifest.json').read_text())['files']['state.pt']['size']})"  # noqa: E501
        ", and the 1 newer one(s) are unusable too; repair or remove them to start from scratch"
    )
    assert capsys.readouterr().err.count("\n") == 1  # step 2 -> step 1


def test_a_dangling_pointer_with_nothing_left_is_an_error(tmp_path):
    tmp_path.joinpath("latest").write_text("step-00000004\n")
    with pytest.raises(CheckpointError, match=r"^no valid checkpoint in .*4 is missing \(named"):
        Checkpointer(tmp_path).load_latest()


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("form", ["torch.save", "raw pickle"])
def test_a_crafted_pickle_does_not_run(tmp_path, form):
    marker = tmp_path / "pwned"
    save_steps(tmp_path / "ck", [1])
    path = tmp_path / "ck" / "step-00000001"
    if form == "torch.save":
        torch.save({"w": Evil(marker)}, path / "state.pt")
    else:
        (path / "state.pt").write_bytes(pickle.dumps({"w": Evil(marker)}, protocol=2))
    write_manifest(path, 1)  # the manifest matches: only the loader stands in the way
    with pytest.raises(CheckpointError) as info:
        Checkpointer(tmp_path / "ck").load_latest()
    assert str(info.value) == (
        f"checkpoint file {path / 'state.pt'} holds something other than tensors and plain "
        "containers; refusing to load it (torch.load weights_only=True): remove it unless you "
        "trust and convert it"
    )
    assert not marker.exists()


def test_loading_a_sharded_checkpoint_as_replicated_says_so(tmp_path):
    Checkpointer(tmp_path, sharded=True).save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="is sharded but this Checkpointer loads replicated "
                                              "ones: construct it with sharded=True"):  # fmt: skip
        Checkpointer(tmp_path).load_latest()


# -- SIGKILL anywhere --------------------------------------------------------------------------


def verify_pointer(directory: Path) -> int:
    """The step `latest` names, after checking that checkpoint file by file."""
    name = pointer(directory)
    manifest, problem = manifests.verify(directory / name, True, sharded=False)
    assert problem is None, (name, problem)
    return manifest["step"]


def in_child(body) -> int:
    """Run `body()` in a forked child that ends with os._exit (1 if it raised); its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


@pytest.mark.ranks
def test_sigkill_at_random_points_never_publishes_a_partial_checkpoint(tmp_path):
    directory = tmp_path / "ck"
    rng = random.Random(20240611)
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB, made before forking
    # The state every save holds, the first too: a trial killed before any save of its own
    # returned leaves the one before it the latest (under load, the first trial did).
    first = Checkpointer(directory, keep=2)
    first.save(0, {"w": big, "step": 0})
    first.wait()
    start = 0
    for trial in range(40):
        read_end, write_end = os.pipe()

        def saver(first=start, write_end=write_end):
            ckpt = Checkpointer(directory, keep=2)
            step = first  # the step loaded is saved again first, as after a resume
            while True:
                ckpt.save(step, {"w": big, "step": step})
                os.write(write_end, f"{step}\n".encode())
                step += 1

        pid = in_child(saver)
        os.close(write_end)
        with os.fdopen(read_end) as f:
            # Every other trial kills from the start (in the loaded step's save again, or
            # later); the others once a new step's save returned, so the saves progress whatever
            # the machine's load (a kill within a fixed time of the fork may come before any).
            published = [] if trial % 2 else [int(f.readline() or -1), int(f.readline() or -1)]
            time.sleep(rng.uniform(0, 0.15))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            published += [int(line) for line in f.read().split()]
        named = verify_pointer(directory)
        loaded = Checkpointer(directory).load_latest()
        assert loaded.step == named
        assert loaded.state["step"] == named and torch.equal(loaded.state["w"], big)
        newest_returned = published[-1] if published else start
        # Every save that returned is published; the one killed may or may not be.
        assert newest_returned <= named <= newest_returned + 1
        if trial % 2 == 0:
            assert named > start, published  # a new step's save returned before the kill
        start = named


MUTATORS = [(os, "mkdir"), (os, "rename"), (os, "replace"), (os, "link"), (os, "fsync"),
            (os, "unlink"), (shutil, "rmtree")]  # fmt: skip


def patch_mutators(setattr_, on_call) -> None:
    """Call `on_call()` before every filesystem change: each MUTATOR and os.open with O_CREAT."""
    for module, name in MUTATORS:
        real = getattr(module, name)

        def wrapper(*args, _real=real, **kwargs):
            on_call()
            return _real(*args, **kwargs)

        setattr_(module, name, wrapper)
    real_open = os.open

    def opener(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            on_call()
        return real_open(path, flags, *args, **kwargs)

    setattr_(os, "open", opener)


@pytest.mark.parametrize("same_step", [False, True], ids=["new step", "same step again"])
def test_killed_before_each_filesystem_change_of_a_save(tmp_path, monkeypatch, same_step):
    template = tmp_path / "template"
    save_steps(template, [1, 2], keep=2)
    step = 2 if same_step else 3
    new_state = {"w": torch.full((8,), -1.0), "step": step}

    calls = [0]
    shutil.copytree(template, tmp_path / "count")
    patch_mutators(monkeypatch.setattr, lambda: calls.__setitem__(0, calls[0] + 1))
    ckpt = Checkpointer(tmp_path / "count", keep=2)
    ckpt.save(step, new_state)
    ckpt.wait()
    monkeypatch.undo()
    total = calls[0]
    assert total > 10  # every mkdir, create, fsync, rename, replace and removal

    outcomes = []
    for k in range(1, total + 2):  # the last one runs the save to its end
        directory = tmp_path / f"k{k}"
        shutil.copytree(template, directory)

        def body(k=k, directory=directory):
            seen = [0]

            def die_at_k():
                seen[0] += 1
                if seen[0] == k:
                    os._exit(0)

            patch_mutators(setattr, die_at_k)
            ckpt = Checkpointer(directory, keep=2)
            ckpt.save(step, new_state)
            ckpt.wait()

        _, status = os.waitpid(in_child(body), 0)
        assert os.waitstatus_to_exitcode(status) == 0
        named = verify_pointer(directory)
        loaded = Checkpointer(directory, keep=2).load_latest()
        assert loaded.step == named
        is_new = loaded.state["w"][0].item() == -1
        assert loaded.state["step"] == (step if is_new else 2)
        if not is_new:
            assert torch.equal(loaded.state["w"], state_at(2)["w"])
        outcomes.append(is_new)
        # Whatever the crash left behind, the next save publishes and tidies up.
        save_steps(directory, [4], keep=2)
        left = entries(directory)
        assert left[0] == "latest" and left[-1] == "step-00000004" and len(left) == 3, (k, left)
    # The old checkpoint up to one point, the new one from there on: a single publish instant.
    assert outcomes == sorted(outcomes) and not outcomes[0] and outcomes[-1], outcomes


# -- async saves -------------------------------------------------------------------------------


def test_async_save_returns_before_the_write_and_snapshots_the_state(tmp_path, monkeypatch):
    gate = threading.Event()
    real = writers.write_state

    def slow(path, state):
        assert gate.wait(10)
        return real(path, state)

    monkeypatch.setattr(writers, "write_state", slow)
    ckpt = Checkpointer(tmp_path, async_save=True)
    weights = torch.zeros(4)
    ckpt.save(1, {"w": weights, "l": [weights]})
    assert ckpt.latest_step is None  # save returned; nothing is published yet
    weights += 5  # training goes on and changes the model
    gate.set()
    ckpt.wait()
    assert ckpt.latest_step == 1
    loaded = ckpt.load_latest()
    assert torch.equal(loaded.state["w"], torch.zeros(4))
    assert loaded.state["l"][0] is loaded.state["w"]  # one tensor reachable twice stays one
    ckpt.wait()  # nothing in flight: returns at once


def test_async_save_waits_for_the_previous_one(tmp_path):
    ckpt = Checkpointer(tmp_path, async_save=True, keep=5)
    for step in range(1, 4):
        ckpt.save(step, state_at(step))
    wait_for_saves()
    assert entries(tmp_path) == ["latest", "step-00000001", "step-00000002", "step-00000003"]
    assert_loads(tmp_path, 3)


@pytest.mark.parametrize("surfaced_by", ["wait", "save", "wait_for_saves"])
def test_async_error_is_raised_once_by_the_next_call(tmp_path, monkeypatch, surfaced_by):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state_at(1))
    ckpt.wait()
    monkeypatch.setattr(writers, "write_state", enospc)
    ckpt.save(2, state_at(2))  # fails in the background
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint step 2 .*No space left"):
        if surfaced_by == "wait":
            ckpt.wait()
        elif surfaced_by == "save":
            ckpt.save(3, state_at(3))
        else:
            wait_for_saves()
    monkeypatch.undo()
    ckpt.wait()  # raised once only
    wait_for_saves()
    assert ckpt.latest_step == 1
    ckpt.save(3, state_at(3))
    ckpt.wait()
    assert_loads(tmp_path, 3)


# -- sharded, in one process -------------------------------------------------------------------


def test_sharded_save_and_load_without_a_process_group(tmp_path, run_as):
    run_as("linux-41")
    ckpt = Checkpointer(tmp_path, sharded=True)
    assert ckpt.load_latest(into={"w": torch.zeros(3)}) is None
    ckpt.save(4, {"w": torch.arange(3.0), "meta": {"lr": 0.5, "name": "x"}})
    assert entries(tmp_path / "step-00000004") == [".metadata", "__0_0.distcp", "manifest.json"]
    into = {"w": torch.zeros(3), "meta": {"lr": 0.0, "name": ""}}
    run_as(None)
    assert ckpt.load_latest(into=into) is None  # another run's: passed over
    ckpt = Checkpointer(tmp_path, sharded=True, resume_from="linux-41")
    loaded = ckpt.load_latest(into=into)
    assert loaded.step == 4 and loaded.state is into and loaded.run_id == "linux-41"
    assert torch.equal(into["w"], torch.arange(3.0)) and into["meta"] == {"lr": 0.5, "name": "x"}
    with pytest.raises(CheckpointError, match="load in place: pass into="):
        ckpt.load_latest()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoints_refuse_crafted_pickles(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    # Crafted metadata: the manifest matches, the unpickler must refuse it.
    ckpt = Checkpointer(tmp_path / "meta", sharded=True)
    ckpt.save(1, {"w": torch.ones(2)})
    path = tmp_path / "meta" / "step-00000001"
    (path / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    write_manifest(path, 1, "sharded")
    with pytest.raises(CheckpointError, match=r"\.metadata holds something other than tensors"):
        ckpt.load_latest(into={"w": torch.zeros(2)})
    with pytest.raises(pickle.UnpicklingError, match=r"global posix\.system is not allowed"):
        safe_dcp.reader_class()(path).read_metadata()  # what every rank reads it with
    # A crafted non-tensor item (DCP itself would load it with weights_only=False).
    path = tmp_path / "item" / "step-00000001"
    dcp.save({"w": torch.ones(2), "evil": Evil(marker)}, storage_writer=dcp.FileSystemWriter(path))
    write_manifest(path, 1, "sharded")
    (tmp_path / "item" / "latest").write_text("step-00000001\n")
    with pytest.raises(CheckpointError, match="holds something other than tensors and plain"):
        Checkpointer(tmp_path / "item", sharded=True).load_latest(into={"w": torch.zeros(2),
                                                                        "evil": 0})  # fmt: skip
    assert not marker.exists()


class _EnumsByName(pickle.Pickler):
    """Pickles an enum member as ``getattr(cls, name)``, as some Python 3.11 releases do (Debian
    12's 3.11.2): metadata written there must load on every other interpreter."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _GetattrOf:
    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_metadata_with_enums_pickled_by_name_loads_and_nothing_else_by_getattr(tmp_path):
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    ckpt = Checkpointer(tmp_path / "ck", sharded=True)
    ckpt.save(1, {"w": torch.arange(3.0), "meta": {"lr": 0.5}})
    path = tmp_path / "ck" / "step-00000001"
    metadata = pickle.loads((path / ".metadata").read_bytes())
    by_name = io.BytesIO()
    _EnumsByName(by_name).dump(metadata)
    assert b"getattr" in by_name.getvalue()  # the form the test is about
    (path / ".metadata").write_bytes(by_name.getvalue())
    write_manifest(path, 1, "sharded")
    into = {"w": torch.zeros(3), "meta": {"lr": 0.0}}
    ckpt.load_latest(into=into)
    assert torch.equal(into["w"], torch.arange(3.0)) and into["meta"] == {"lr": 0.5}
    # getattr names an enum member of DCP's own, nothing else: not an attribute of an allowed
    # class, nor of a DCP class that is no enum.
    for owner, name in [(torch.Size, "__subclasses__"), (MetadataIndex, "__init__")]:
        (path / ".metadata").write_bytes(pickle.dumps(_GetattrOf(owner, name)))
        with pytest.raises(pickle.UnpicklingError, match=r"getattr\(.*\) is not allowed"):
            safe_dcp.reader_class()(path).read_metadata()


# -- two gloo ranks ----------------------------------------------------------------------------

PRELUDE = """
import datetime, json, os, sys, warnings
import torch, torch.distributed as td
warnings.simplefilter("ignore")
td.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = td.get_rank()
D = os.environ["CKPT_DIR"]
from slurmddp.checkpoint import Checkpointer, CheckpointError, wait_for_saves
"""



def run_ranks(code: str, directory: Path, world: int = 2, prelude: str = PRELUDE,
              status: int = 0, **env: str) -> list[dict]:  # fmt: skip
    """Run `code` on `world` gloo ranks; the `out` dict of each (none unless `status` is 0)."""
    port = str(free_port())
    # gloo's teardown at interpreter exit can abort a rank that has finished its work ("terminate
    # called without an active exception"): leave as slurmddp.run does, with os._exit.
    program = (prelude + textwrap.dedent(code) + "\nprint('RESULT', json.dumps(out), flush=True)"
               "\nos._exit(0)\n")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=launcher_free_env(RANK=str(r), WORLD_SIZE=str(world),
                                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                    CKPT_DIR=str(directory), **env))
             for r in range(world)]  # fmt: skip
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [status] * world, outs
    return [json.loads(o.split("RESULT ", 1)[1]) for o, _ in outs] if status == 0 else []


def test_two_ranks_replicated_sync_and_async(tmp_path):
    results = run_ranks(
        """
        out = {}
        c = Checkpointer(D + "/rep", keep=2)
        out["fresh"] = c.load_latest() is None
        out["latest"] = []
        for step in (1, 2, 3):
            c.save(step, {"w": torch.full((3,), float(step)), "writer": rank})
            out["latest"].append(c.latest_step)  # published on every rank when save returns
        loaded = c.load_latest()
        out["loaded"] = [loaded.step, loaded.state["w"].tolist(), loaded.state["writer"]]
        out["run_id"] = loaded.run_id
        # Hidden names: old checkpoints rank 0 may still be removing in the background.
        out["dirs"] = sorted(n for n in os.listdir(D + "/rep")
                             if not n.startswith(".") and n != "save-time.json")
        try:  # refused on rank 1 only: both ranks raise, nothing is written
            c.save(4, {"x": object() if rank == 1 else 1})
        except CheckpointError as e:
            out["refused"] = str(e)
        if rank == 0:
            open(D + "/file", "w").close()
        td.barrier()
        try:  # rank 0 cannot write: every rank hears of it
            Checkpointer(D + "/file/ck").save(1, {"w": torch.ones(1)})
        except CheckpointError as e:
            out["unwritable"] = str(e)
        a = Checkpointer(D + "/async", async_save=True)
        t = torch.zeros(3)
        a.save(1, {"t": t})
        t += 5
        a.save(2, {"t": t})
        wait_for_saves()
        la = a.load_latest()
        out["async"] = [la.step, la.state["t"].tolist(), a.latest_step]
        first = torch.load(D + "/async/step-00000001/state.pt", weights_only=True)
        out["async_first"] = first["t"].tolist()
        td.destroy_process_group()
        """,
        tmp_path,
        **{RUN_ID_VAR: "linux-41"},
    )
    for rank, out in enumerate(results):
        assert out["fresh"] is True
        assert out["latest"] == [1, 2, 3]
        assert out["loaded"] == [3, [3.0, 3.0, 3.0], 0]  # rank 0's state is the one written
        assert out["run_id"] == "linux-41"
        assert out["dirs"] == ["latest", "step-00000002", "step-00000003"]
        if rank == 1:
            assert out["refused"].startswith("state['x'] has type object, which torch.load")
            assert out["unwritable"] == (f"rank 0 could not save checkpoint step 1 in "
                                         f"{tmp_path}/file/ck: see its error")  # fmt: skip
        else:
            assert out["refused"] == "checkpoint step 4 was refused on another rank: see its error"
            assert out["unwritable"].startswith(f"cannot save checkpoint step 1 in "
                                                f"{tmp_path}/file/ck: [Errno 20]")  # fmt: skip
        assert out["async"] == [2, [5.0, 5.0, 5.0], 2]
        assert out["async_first"] == [0.0, 0.0, 0.0]


def test_two_ranks_sharded_plain_tensors_and_fsdp2(tmp_path):
    results = run_ranks(
        """
        out = {}
        c = Checkpointer(D + "/sh", sharded=True)
        out["fresh"] = c.load_latest(into={"common": torch.zeros(3)}) is None
        mine = f"rank{rank}"
        c.save(5, {mine: torch.full((4,), float(rank + 1)), "common": torch.arange(3.0),
                   "meta": {"lr": 0.25, "tag": "x"}})
        into = {mine: torch.zeros(4), "common": torch.zeros(3), "meta": {"lr": 0.0, "tag": ""}}
        ck = c.load_latest(into=into)
        out["plain"] = [ck.step, into[mine].tolist(), into["common"].tolist(), into["meta"]]
        out["files"] = sorted(os.listdir(ck.path))

        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2,))
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        def step():
            opt.zero_grad()
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
        step()
        f = Checkpointer(D + "/fsdp", sharded=True)
        msd, osd = get_state_dict(model, opt)
        f.save(1, {"model": msd, "optim": osd})
        want = [p.full_tensor().clone() for p in model.parameters()]
        step(); step()  # move away from the checkpoint
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        loaded = f.load_latest(into=state)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = [p.full_tensor() for p in model.parameters()]
        out["fsdp"] = [loaded.step, all(torch.equal(a, b) for a, b in zip(want, got))]
        td.destroy_process_group()
        """,
        tmp_path,
    )
    for rank, out in enumerate(results):
        assert out["fresh"] is True
        assert out["plain"] == [5, [float(rank + 1)] * 4, [0.0, 1.0, 2.0],
                                {"lr": 0.25, "tag": "x"}]  # fmt: skip
        assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
        assert out["fsdp"] == [1, True]


# The ranks start through slurmddp.init, so the rendezvous store is known (rank.coordination).
SLURMDDP_PRELUDE = """
import datetime, json, os, sys, time, warnings
import torch, torch.distributed as td
warnings.simplefilter("ignore")
import slurmddp
from slurmddp.checkpoint import state as states
from slurmddp.checkpoint import writers
dist = slurmddp.init("gloo", timeout=float(os.environ.get("PG_TIMEOUT", "60")))
rank = dist.rank
D = os.environ["CKPT_DIR"]
from slurmddp.checkpoint import Checkpointer

def slow_on_rank_0(module, name, seconds):
    # rank 0's part of a save or load takes `seconds` more, as on a slow file system
    original = getattr(module, name)
    def slow(*args, **kwargs):
        if rank == 0:
            time.sleep(seconds)
        return original(*args, **kwargs)
    setattr(module, name, slow)
"""


def test_every_rank_loads_the_same_checkpoint_after_an_async_save(tmp_path):
    results = run_ranks(
        """
        c = Checkpointer(D, async_save=True)
        c.save(100, {"w": torch.full((2,), 100.0)})
        c.wait()
        slow_on_rank_0(writers, "write_state", 1.0)  # step 200 is still being written...
        c.save(200, {"w": torch.full((2,), 200.0)})
        loaded = c.load_latest()  # ...when every rank looks for the latest
        out = {"step": loaded.step, "w": loaded.state["w"].tolist()}
        """,
        tmp_path, prelude=SLURMDDP_PRELUDE,
    )  # fmt: skip
    assert results == [{"step": 200, "w": [200.0, 200.0]}] * 2


# Each case in a directory of its own, its patch undone after it: the cases share one world,
# whose start (two interpreters importing torch) costs more than all four cases.
SLOW_CASES = """
def slowed(module, name, seconds, case):
    original = getattr(module, name)
    slow_on_rank_0(module, name, seconds)
    try:
        return case(f"{D}/{case.__name__}")
    finally:
        setattr(module, name, original)

def sync(d):
    Checkpointer(d).save(1, {"w": torch.ones(2)})
    return Checkpointer(d).latest_step

def async_(d):
    c = Checkpointer(d, async_save=True)
    c.save(1, {"w": torch.ones(2)})
    c.wait()
    return c.latest_step

def sharded(d):
    c = Checkpointer(d, sharded=True)
    c.save(1, {"w": torch.ones(2) * rank})
    return c.latest_step

def load(d):
    Checkpointer(d).save(1, {"w": torch.ones(2)})  # at its pace: only a load calls load_state
    return Checkpointer(d).load_latest().step

out = {
    "sync": slowed(writers, "write_state", 5, sync),
    "async": slowed(writers, "write_state", 5, async_),
    "sharded": slowed(writers, "fsync_and_hash", 2.5, sharded),  # once per file: two or more
    "load": slowed(states, "load_state", 5, load),
}
"""


@pytest.fixture(scope="module")
def slow_rank_0(tmp_path_factory) -> list[dict]:
    # The process group's collectives time out after 2 s; rank 0's file system work takes 5 s
    # more, while rank 1 waits for it.
    return run_ranks(SLOW_CASES, tmp_path_factory.mktemp("slow"), prelude=SLURMDDP_PRELUDE,
                     PG_TIMEOUT="2")  # fmt: skip


@pytest.mark.parametrize("what", ["sync", "async", "sharded", "load"])
@pytest.mark.ranks
@pytest.mark.floor
def test_a_save_or_load_longer_than_the_collective_timeout_completes(slow_rank_0, what):
    assert [out[what] for out in slow_rank_0] == [1, 1]  # the latest step, on both ranks

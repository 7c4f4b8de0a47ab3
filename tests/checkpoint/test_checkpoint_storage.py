"""Checkpoints on a real full or read-only file system (issue 7): the save fails with one clear
line and the previous checkpoint stays the latest, loadable.

Root ignores permission bits, so "read-only" is a tmpfs remounted read-only and "full" a 1 MiB
tmpfs; both need root (the project's tests run as root).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurmddp.checkpoint import Checkpointer, CheckpointError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

MODES = {"sync": {}, "async": {"async_save": True}, "sharded": {"sharded": True},
         "async sharded": {"sharded": True, "async_save": True}}  # fmt: skip
SMALL = {"w": torch.zeros(8), "step": 1}
BIG = {"w": torch.zeros(512 * 1024), "step": 2}  # 2 MiB: more than the whole 1 MiB tmpfs


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mount)],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True, capture_output=True)


def failed_save(ckpt: Checkpointer, step: int, state: dict) -> str:
    """The error of saving `state`; an async save reports it when waited for."""
    with pytest.raises(CheckpointError) as info:
        ckpt.save(step, state)
        ckpt.wait()
    return str(info.value)


def latest(directory: Path, mode: str) -> int | None:
    """The step a fresh Checkpointer loads from `directory` (sharded: into a state like SMALL)."""
    sharded = MODES[mode].get("sharded", False)
    into = {"w": torch.ones(8), "step": 0} if sharded else None
    loaded = Checkpointer(directory, sharded=sharded).load_latest(into=into)
    if loaded is None:
        return None
    assert torch.equal(loaded.state["w"], SMALL["w"])
    return loaded.step


def assert_previous_is_latest(directory: Path, mode: str) -> None:
    assert (directory / "latest").read_text().strip() == "step-00000001"
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert latest(directory, mode) == 1


# case: (make the file system refuse, what the error names)
CASES = {
    "full": (lambda mount: None, "No space left on device"),
    "read-only": (
        lambda mount: subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True),
        "Read-only file system",
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_a_refused_save_is_one_line_and_keeps_the_previous_checkpoint(tmpfs, case, mode):
    directory = tmpfs / "ckpt"
    ckpt = Checkpointer(directory, **MODES[mode])
    ckpt.save(1, SMALL)
    ckpt.wait()
    refuse, says = CASES[case]
    refuse(tmpfs)
    message = failed_save(ckpt, 2, BIG if case == "full" else SMALL | {"step": 2})
    assert "\n" not in message
    assert message.startswith(f"cannot save checkpoint step 2 in {directory}: "), message
    assert says in message, message
    assert message.endswith("the previous checkpoint stays the latest: check free space, quota "
                            "and permissions there"), message  # fmt: skip
    assert_previous_is_latest(directory, mode)
    if case == "full":  # nothing of the failed save is left taking space: a smaller one fits
        ckpt.save(2, SMALL | {"step": 2})
        ckpt.wait()
        assert latest(directory, mode) == 2

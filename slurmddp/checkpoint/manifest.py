"""The manifest: written last into a checkpoint, it lists every file with its size and checksum,
and a checkpoint is complete exactly when its files match it. It also names the run that wrote
it ($SLURMDDP_RUN_ID, `slurmddp.rank.identity`), None in manifests from before that."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from slurmddp import files as fs
from slurmddp.checkpoint import layout
from slurmddp.checkpoint.crc32 import Crc32
from slurmddp.errors import CheckpointError, one_line
from slurmddp.protocol import CHECKPOINT_MANIFEST
from slurmddp.rank.identity import run_id

FORMAT = 2
# The checksum of each file that a manifest of each format records.
CHECKSUMS = {1: "sha256", 2: "crc32"}
MANIFEST = CHECKPOINT_MANIFEST
STATE_FILE = "state.pt"  # replicated mode: rank 0's state, by torch.save
METADATA = ".metadata"  # sharded mode: torch.distributed.checkpoint's index of the shards
_CHUNK = 8 << 20

Manifest = dict[str, Any]


def write(directory: Path, step: int, mode: str, files: dict[str, dict]) -> None:
    """Write the manifest of `directory` (fsynced); `files` maps names to {"size", "crc32"}.

    It records this process's run id (`slurmddp.rank.identity.run_id`, null without one).
    """
    # A new key, not a new FORMAT: readers of format 2 that predate it ignore it.
    text = json.dumps({"format": FORMAT, "step": step, "mode": mode, "run_id": run_id(),
                       "files": files}, indent=1)  # fmt: skip
    fs.write_new(directory / MANIFEST, text.encode())


def run_id_of(manifest: Manifest | None) -> str | None:
    """The run id `manifest` records; None when it records none (written before run ids)."""
    found = manifest.get("run_id") if manifest is not None else None
    return found if isinstance(found, str) and found else None


def verify(path: Path, verify: bool, *, sharded: bool,
           hashes: bool = True) -> tuple[Manifest | None, str | None]:  # fmt: skip
    """(manifest, None) when `path` is a complete checkpoint, else (manifest or None, problem).

    Checks the manifest, then the size of every file, then (with `hashes`) their checksums.
    Without `verify` only the manifest is read (when present). Raises CheckpointError when the
    checkpoint is of the other mode than `sharded` says.
    """
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return None, ("incomplete (it has no manifest.json)" if verify else None)
    except OSError as e:
        return None, f"unreadable ({one_line(e)})"
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in files
        ):
            raise ValueError("bad file list")
    except (ValueError, KeyError, TypeError):
        return None, "corrupt (its manifest.json does not parse)"
    _check_mode(path, manifest, sharded)
    if not isinstance(manifest.get("format"), int) or manifest["format"] not in CHECKSUMS:
        return manifest, f"in an unknown format (version {manifest.get('format')!r})"
    needed = METADATA if sharded else STATE_FILE
    if needed not in files:
        return manifest, f"corrupt (its manifest.json lists no {needed})"
    if not verify:
        return manifest, None
    problem = _size_problem(path, files)
    if problem is None and hashes:
        problem = hash_problem(path, manifest)
    return manifest, problem


def _check_mode(path: Path, manifest: Manifest, sharded: bool) -> None:
    mode = manifest.get("mode", "replicated")
    if mode != ("sharded" if sharded else "replicated"):
        raise CheckpointError(
            f"checkpoint {path} is {mode} but this Checkpointer loads "
            f"{'sharded' if sharded else 'replicated'} ones: construct it with "
            f"sharded={mode == 'sharded'}"
        )


def _size_problem(path: Path, files: dict[str, Any]) -> str | None:
    for name, expected in files.items():
        want = expected.get("size") if isinstance(expected, dict) else None
        try:
            size = os.stat(path / name).st_size
        except FileNotFoundError:
            return f"incomplete ({name} is missing)"
        except OSError as e:
            return f"unreadable ({one_line(e)})"
        if size != want:
            what = "truncated" if isinstance(want, int) and size < want else "corrupt"
            return f"{what} ({name} has {size} bytes, its manifest says {want})"
    return None


def hash_problem(path: Path, manifest: Manifest) -> str | None:
    """Which file of `path` does not checksum as its manifest says, or None."""
    algorithm = CHECKSUMS[manifest["format"]]
    for name, expected in manifest["files"].items():
        try:
            size, digest = hash_file(path / name, algorithm)
        except OSError as e:
            return f"unreadable ({one_line(e)})"
        if size != expected.get("size"):
            return f"changing ({name} has {size} bytes now, its manifest says {expected['size']})"
        if digest != expected.get(algorithm):
            return f"corrupt (the {algorithm} of {name} does not match its manifest)"
    return None


def hash_file(path: Path, algorithm: str) -> tuple[int, str]:
    """The size and checksum (`algorithm`: "crc32" or "sha256") of the file at `path`."""
    digest: Any = Crc32() if algorithm == "crc32" else hashlib.new(algorithm)
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def step_of(path: Path, manifest: Manifest | None) -> int:
    """The step of checkpoint `path`: its manifest's, else its directory name's."""
    if manifest is not None and isinstance(manifest.get("step"), int):
        return int(manifest["step"])
    step = layout.step_of(path.name)
    if step is None:
        raise CheckpointError(f"cannot tell the step of checkpoint {path}: its manifest.json is "
                              "unreadable; rename it step-<step>")  # fmt: skip
    return step

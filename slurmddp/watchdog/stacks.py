"""A rank's Python stacks, written for people and read back by the monitor.

Where the main thread is says what the rank is doing while nothing progresses: inside a
collective, a wait for every rank or a backward pass (DDP's gradient reduction waits there), it
waits for another rank; anywhere else (a sleep, a loop, a data loader) it is what holds the
others. The file starts with one ``# {json}`` line, what the monitor judges from; the stacks of
every thread follow, innermost call last, as Python prints a traceback.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

Frame = tuple[str, int, str]  # file, line, function

# (a part of the file's path, what a main thread whose innermost frame lies there is waiting in)
_WAITS = (
    ("/torch/distributed/", "a torch.distributed call"),
    ("/torch/nn/parallel/distributed.py", "DistributedDataParallel's communication"),
    ("/torch/autograd/", "a backward pass (DDP's gradient reduction waits in it)"),
    ("/slurmddp/rank/coordination.py", "a wait for every rank"),
    ("/slurmddp/preemption/agreement.py", "the stop agreement"),
)
# Files that are not the user's: the call site shown is the innermost frame outside them.
_LIBRARY = ("/torch/", "/slurmddp/", "/lightning/", "/transformers/", "/accelerate/",
            "/threading.py", "/runpy.py")  # fmt: skip


def waiting_in(frames: Sequence[Frame]) -> str | None:
    """What the innermost frame (frames: outermost first) waits in, if it waits for other ranks."""
    if not frames:
        return None
    path = frames[-1][0].replace("\\", "/")
    return next((what for part, what in _WAITS if part in path), None)


def call_site(frames: Sequence[Frame]) -> str:
    """The innermost frame of the user's own code, as ``file:line in function``."""
    for file, line, function in reversed(frames):
        if not any(part in file.replace("\\", "/") for part in _LIBRARY):
            return f"{file}:{line} in {function}"
    if frames:
        file, line, function = frames[-1]
        return f"{file}:{line} in {function}"
    return "(no Python frame)"


def threads() -> dict[str, list[Frame]]:
    """Every thread's frames, outermost first, by thread name (the main thread first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out: dict[str, list[Frame]] = {}
    current = sys._current_frames()
    for ident in sorted(current, key=lambda i: i != main):
        summary = traceback.extract_stack(current[ident])
        name = names.get(ident, f"thread {ident:#x}")
        out[name] = [(f.filename, f.lineno or 0, f.name) for f in summary]
    return out


def render(header: Mapping[str, Any], stacks: Mapping[str, Sequence[Frame]]) -> str:
    """The file: the header line, then each thread's stack."""
    parts = ["# " + json.dumps(dict(header), sort_keys=True)]
    for name, frames in stacks.items():
        parts.append(f"\nThread {name!r} (most recent call last):")
        parts.extend(f'  File "{file}", line {line}, in {function}'
                     for file, line, function in frames)  # fmt: skip
    return "\n".join(parts) + "\n"


def header(text: str) -> dict[str, Any] | None:
    """The header of a file `render` wrote; None if `text` has none."""
    first = text.split("\n", 1)[0]
    if not first.startswith("# "):
        return None
    try:
        value = json.loads(first[2:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

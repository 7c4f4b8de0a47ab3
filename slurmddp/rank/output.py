"""Prefix every line a rank prints with its rank, so interleaved logs stay readable."""

from __future__ import annotations

import io
import sys
from typing import TextIO


class PrefixedStream(io.TextIOBase):
    """A text stream that writes `prefix` at the start of every line to `target`.

    Whole lines go to `target` in one write: `print` writes a line's text and its newline
    separately, and ranks sharing one pipe (torchrun's workers) would split each other's lines
    between the two. A line without its end yet goes out at `flush`.
    """

    def __init__(self, target: TextIO, prefix: str) -> None:
        self._target = target
        self._prefix = prefix
        self._at_line_start = True
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text:
            self._pending += text
            cut = self._pending.rfind("\n") + 1
            if cut:
                self._emit(self._pending[:cut])
                self._pending = self._pending[cut:]
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._emit(self._pending)
            self._pending = ""
        self._target.flush()

    def _emit(self, text: str) -> None:
        out = []
        for line in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(line)
            self._at_line_start = line.endswith("\n")
        self._target.write("".join(out))

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")


def prefix_output(rank: int, world_size: int) -> None:
    """Replace sys.stdout and sys.stderr with rank-prefixed streams ("[3/8] ...").

    Only Python-level writes are prefixed; output of C extensions and child processes is not
    (`srun --label` prefixes everything a task writes).
    """
    width = len(str(max(world_size - 1, 0)))
    prefix = f"[{rank:>{width}}/{world_size}] "
    sys.stdout = PrefixedStream(sys.stdout, prefix)
    sys.stderr = PrefixedStream(sys.stderr, prefix)

"""One-line user errors: what was wrong and what to do, exit status 2, no traceback.

Every entry point runs under `reported`: a `UserError` (bad options, files, environment or
checkpoints) becomes one ``prog: error: ...`` line and exit status 2, anything unexpected one line
naming the exception and exit status 1. ``SLURMDDP_DEBUG=1`` in the environment adds the
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import NoReturn

USAGE_ERROR = 2
INTERNAL_ERROR = 1
DEBUG_VARIABLE = "SLURMDDP_DEBUG"


class UserError(Exception):
    """Bad input from the user; the message alone, one line, says what and what to do."""


def debug() -> bool:
    """Whether ``$SLURMDDP_DEBUG`` asks for tracebacks (set, and not empty or 0)."""
    return os.environ.get(DEBUG_VARIABLE, "0") not in ("", "0")


def report(message: str, *, prog: str = "slurmddp") -> None:
    """Print ``prog: error: message`` on stderr; under `debug`, the traceback first."""
    if debug():
        if sys.exc_info()[1] is not None:
            traceback.print_exc()
        else:
            traceback.print_stack()
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def fail(message: str, *, prog: str = "slurmddp", status: int = USAGE_ERROR) -> NoReturn:
    """`report` the message and exit with `status`."""
    report(message, prog=prog)
    raise SystemExit(status)


@contextlib.contextmanager
def reported(prog: str) -> Iterator[None]:
    """Exit with one line for any exception raised inside (see the module docstring)."""
    try:
        yield
    except UserError as e:
        fail(one_line(e), prog=prog)
    except Exception as e:
        fail(f"{type(e).__name__}: {one_line(e)} (set {DEBUG_VARIABLE}=1 for the traceback)",
             prog=prog, status=INTERNAL_ERROR)  # fmt: skip


def one_line(e: BaseException) -> str:
    """The exception's message with its line breaks folded, or its type without one."""
    return " ".join(str(e).split()) or type(e).__name__


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: what was wrong``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)", prog=self.prog)

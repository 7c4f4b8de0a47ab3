"""One-line user errors: what was wrong and what to do, exit status 2, no traceback.

Every entry point runs under `reported`: a `UserError` (bad options, files, environment or
checkpoints) becomes one ``prog: error: ...`` line and exit status 2, anything unexpected one line
naming the exception and exit status 1, Ctrl-C exit status 130 without a word (a command with
something left behind, such as a followed job, says so itself). ``SLURMDDP_DEBUG=1`` in the
environment adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from slurmddp.protocol import DEBUG_VAR as DEBUG_VARIABLE
from slurmddp.protocol import INTERNAL_ERROR, USAGE_ERROR

# A shell's status for a command ended by Ctrl-C (128 + SIGINT).
INTERRUPTED = 130


class SlurmddpError(Exception):
    """Every error slurmddp raises on purpose; the message is one line."""


class UserError(SlurmddpError):
    """Bad input from the user; the message alone, one line, says what and what to do."""


# Bad input, by where it came from. The second base keeps ``except ValueError`` (or
# RuntimeError) working for callers that caught what these were before.


class EnvError(UserError, ValueError):
    """The environment describes no consistent distributed job; the message names the variables."""


class PlacementError(UserError, ValueError):
    """The requested backend cannot run here; the message says what to use instead."""


class ConfigError(UserError, ValueError):
    """A configuration file or option is wrong; the one-line message names it and the fix."""


class SpecError(UserError, ValueError):
    """A job description sbatch would refuse or misread; the message says which value and why."""


class TemplateError(UserError, ValueError):
    """A user template cannot be read or rendered; the message names the file and the fault."""


class HostlistError(UserError, ValueError):
    """A Slurm host list or tasks-per-node expression that cannot be parsed."""


class SignalError(UserError, ValueError):
    """A stop signal name that is no signal, or one Slurm cannot deliver as asked."""


class SnapshotError(UserError):
    """The job's code cannot be snapshotted (too large, unreadable); the message says what to do."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint could not be saved or loaded; the message is one line and says what to do."""


# Failures of the system rather than of the input: the message says why and what to do.


class StartupError(SlurmddpError, RuntimeError):
    """The process group could not start; the message says why and what to do."""


class NodeCheckError(SlurmddpError, RuntimeError):
    """This node failed a check of its own (the preflight's): the job should leave it behind."""


class SubmissionError(SlurmddpError, RuntimeError):
    """sbatch refused the job or could not be run; the message says why."""


class JobFailedError(SlurmddpError, RuntimeError):
    """A function's job ended without a value: a rank raised (the message names the first, its
    exception and its traceback), or the job ended before rank 0 returned."""

    def __init__(self, message: str, *, rank: int | None = None, error: object = None,
                 traceback: str = "") -> None:  # fmt: skip
        super().__init__(message)
        self.rank = rank  # the first rank that failed; None when no rank said why
        self.error = error  # its exception, where it could be brought back
        self.traceback = traceback  # its traceback, as the rank printed it


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
    except KeyboardInterrupt:
        # The user's own choice, not a failure: no traceback unless asked for.
        if debug():
            traceback.print_exc()
        raise SystemExit(INTERRUPTED) from None
    except UserError as e:
        fail(one_line(e), prog=prog)
    except Exception as e:
        fail(f"{type(e).__name__}: {one_line(e)} (set {DEBUG_VARIABLE}=1 for the traceback)",
             prog=prog, status=INTERNAL_ERROR)  # fmt: skip


def warn(message: str) -> None:
    """``slurmddp: message`` on stderr: something the user should know, not an error."""
    print(f"slurmddp: {message}", file=sys.stderr, flush=True)


_said: set[str] = set()


def first_time(what: str) -> bool:
    """True the first time this process asks about `what`: for what is said once a process."""
    if what in _said:
        return False
    _said.add(what)
    return True


def one_line(e: BaseException) -> str:
    """The exception's message with its line breaks folded, or its type without one."""
    return " ".join(str(e).split()) or type(e).__name__


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: what was wrong``, exit status 2; the
    description and epilog are printed as written (a wrapped URL breaks at its hyphens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)", prog=self.prog)

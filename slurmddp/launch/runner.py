"""``python -m slurmddp.run [options] SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``).

Resolves this rank from the SLURM_*, MPI or torchrun variables, exports the torchrun names
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), then runs
the script as ``__main__`` in this same process with its own argv, and exits with its status.
A script written for torchrun runs unchanged::

    srun -N4 --ntasks-per-node=2 python -m slurmddp.run train.py --lr 0.1
    mpirun -np 4 python -m slurmddp.run train.py

Everything after SCRIPT (or after ``-m MODULE``) belongs to the script, verbatim.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from slurmddp import errors, patches
from slurmddp.errors import EnvError, Parser, UserError, fail, one_line, report, reported
from slurmddp.launch import startup
from slurmddp.links import help_link
from slurmddp.preemption import api as preemption
from slurmddp.protocol import (
    CODE_DIR_VAR,
    FAILURE_FILE_VAR,
    MASTER_HOST_FORMAT_VAR,
    NOT_REQUEUED_STATUS,
    USAGE_ERROR,
)
from slurmddp.rank import mpi
from slurmddp.rank.bootstrap import bootstrap, current

PROG = "python -m slurmddp.run"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The runner's own options (those before SCRIPT)."""
    p = Parser(
        prog=prog,
        usage=f"{prog} [options] SCRIPT [ARGS...] | -m MODULE [ARGS...]",
        description="Run a torchrun-style training script on this rank of a Slurm, MPI or "
        "torchrun job.",
        epilog=help_link("run"),
    )
    p.add_argument(
        "--tag-output",
        action="store_true",
        help="prefix every line the script prints with [rank/world_size]",
    )
    p.add_argument(
        "--master-host-format",
        metavar="FMT",
        help="address other ranks dial for rank 0's host, e.g. '{host}-ib0' "
        f"(default: ${MASTER_HOST_FORMAT_VAR} or '{{host}}')",
    )
    p.add_argument(
        "--print-env",
        action="store_true",
        help="print the resolved values and their sources to stderr before running",
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module, like python -m")
    return p


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at SCRIPT (or at -m MODULE): runner options before, the script's argv after."""
    takes_value = {"--master-host-format"}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in takes_value else 1
    return list(argv), []


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int | str | None:
    """Entry point; returns the script's exit status (a SystemExit code, for sys.exit).

    The runner's own errors are one line (`slurmddp.errors.reported`); so are slurmddp's
    `UserError`s raised in the script (a bad checkpoint, say), with status 2. The script's other
    exceptions keep their traceback.
    """
    with reported(prog):
        module, rest = _prepare(sys.argv[1:] if argv is None else argv, prog)
    try:
        _execute(module, rest)
    except SystemExit as e:
        # 75: stopped for good after a checkpoint (slurmddp.preemption said why), not a failure.
        if e.code not in (None, 0, NOT_REQUEUED_STATUS):
            _note_failure(f"exited with status {e.code if isinstance(e.code, int) else 1}")
            mpi.abort(e.code if isinstance(e.code, int) else 1)
        return e.code
    except UserError as e:
        report(one_line(e), prog=prog)
        _note_failure(f"failed: {one_line(e)}", echo=False)  # the line above says it already
        mpi.abort(USAGE_ERROR)
        return USAGE_ERROR
    except Exception as e:
        # First a line that names the rank and its node, so that the job's summary and a grep
        # of the logs find the failure; then, as Python would, the traceback.
        _note_failure(f"failed: {type(e).__name__}: {one_line(e)}")
        said_all = (startup.StartupError, errors.NodeCheckError)  # their message says it all
        if not isinstance(e, said_all) or errors.debug():
            traceback.print_exc()
        mpi.abort(1)
        return 1
    return 0


def _note_failure(what: str, *, echo: bool = True) -> None:
    """``slurmddp: rank R (host H) <what>`` on stderr (this rank's log), and appended to
    $SLURMDDP_FAILURE_FILE where the batch script gave one, after this run's restart count and a
    tab: its first line of the run is the first rank that failed. (A rank of an earlier run, on
    a node whose link comes back after Slurm requeued the job, may write there still.)"""
    dist = current()
    line = f"slurmddp: rank {dist.rank if dist else '?'} (host {startup.host_name()}) {what}"
    if echo:
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get(FAILURE_FILE_VAR)
    if path:
        with contextlib.suppress(OSError):  # the report must not hide the failure itself
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                run = os.environ.get("SLURM_RESTART_COUNT") or "0"
                os.write(fd, f"{run}\t{line}\n".encode("utf-8", "replace"))  # one append: atomic
            finally:
                os.close(fd)


def _prepare(argv: Sequence[str], prog: str) -> tuple[str | None, list[str]]:
    """Parse the runner's options, resolve and export this rank; (module, script argv)."""
    parser = build_parser(prog)
    own, rest = split_argv(argv)
    opts = parser.parse_args(own)
    if opts.module is None and not rest:
        parser.error("give a SCRIPT to run, or -m MODULE")
    if opts.module is None and not os.path.isfile(rest[0]):
        fail(f"script {rest[0]!r} not found: give the path of a Python file", prog=prog)

    try:
        dist = bootstrap(master_host_format=opts.master_host_format)
    except EnvError as e:
        fail(f"cannot resolve this rank: {e}", prog=prog)
    # Before the script runs: the stop signal must set the flag, not end the rank.
    preemption.install()
    # A script's own init_process_group() gets the bounded, explained rendezvous too.
    startup.install_hook()
    # DataLoaders resume exactly from the script's first one; torch is the script's to import.
    patches.when_imported("torch", _exact_data)
    if opts.print_env:
        for name, value, source in dist.rows():
            print(f"{name:>16} = {value:<20} ({source})", file=sys.stderr)
    if opts.tag_output:
        from slurmddp.rank.output import prefix_output

        prefix_output(dist.rank, dist.world_size)
    return opts.module, rest


def _exact_data(_torch: object) -> None:
    from slurmddp.training import loader

    loader.install()


def _execute(module: str | None, rest: list[str]) -> None:
    if module is not None:
        sys.argv = [module, *rest]
        code_dir = os.environ.get(CODE_DIR_VAR)
        if code_dir:
            # The job's code snapshot (slurmddp.batch.transport.snapshot) before the working
            # directory, which `python -m` put first and which holds the files as they are now.
            # PYTHONPATH would not do: it comes after the working directory.
            sys.path.insert(0, code_dir)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = rest[0]
    sys.argv = list(rest)
    # As `python script.py` does: the script's own directory comes first on sys.path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def exit_process(status: int | str | None) -> NoReturn:
    """Exit like sys.exit(status), but skip interpreter finalization once torch.distributed ran.

    atexit handlers (logging's flush among them) run, stdout and stderr are flushed; then, if the
    script used torch.distributed, the process ends with os._exit: torch's gloo teardown during
    finalization can abort a rank that has finished its work ("terminate called without an
    active exception"), and srun --kill-on-bad-exit then fails the whole job.

    The stop signal is ignored from here on: one that comes as the script ends (the time limit's
    warning, passed on by srun a little late) would end the rank in its teardown, where Python
    gives the script's own handler up, and fail a job whose work is done.
    """
    with contextlib.suppress(UserError, ValueError):  # a bad $SLURMDDP_SIGNAL; not the main thread
        signal.signal(preemption.stop_signal(os.environ), signal.SIG_IGN)
    if "torch.distributed" not in sys.modules:
        sys.exit(status)
    if isinstance(status, str):
        print(status, file=sys.stderr)
    code = status if isinstance(status, int) else (0 if status is None else 1)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:  # no stream at all under pythonw and some daemons
                stream.flush()
    if "mpi4py.MPI" in sys.modules:
        # mpi4py finalizes MPI at interpreter shutdown, which os._exit skips; mpirun counts a
        # rank that leaves without MPI_Finalize as failed.
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)

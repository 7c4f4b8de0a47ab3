"""The ``slurmddp`` command. Subcommands import their modules lazily: ``--help`` stays fast and
never imports torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slurmddp import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slurmddp",
        description="PyTorch distributed training on Slurm and MPI clusters.",
    )
    p.add_argument("--version", action="version", version=f"slurmddp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser(
        "run",
        help="run a torchrun-style script on this rank (same as python -m slurmddp.run)",
        add_help=False,
    )
    doctor = sub.add_parser(
        "doctor", help="show this rank's resolved values; --check tests the collectives"
    )
    from slurmddp import doctor as doctor_mod

    doctor_mod.add_arguments(doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # The runner's argv is split by hand: everything after SCRIPT is the script's.
        from slurmddp import run

        return run.main(argv[1:], prog="slurmddp run")
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.command == "doctor":
        from slurmddp import doctor

        return doctor.main(opts)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

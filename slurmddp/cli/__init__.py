"""The ``slurmddp`` command. Subcommands import their modules lazily: ``--help`` stays fast and
``submit`` never imports torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from slurmddp import __version__
from slurmddp.errors import Parser, reported
from slurmddp.links import help_link


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from slurmddp.cli import jobs as cli_jobs
    from slurmddp.cli import quickstart as cli_quickstart
    from slurmddp.cli import submit as cli_submit
    from slurmddp.launch import doctor

    # No abbreviations: a prefix of one option may be another's whole name in sbatch (--ntasks
    # once read as --ntasks-per-node); a near miss gets "did you mean" (slurmddp.cli.submit).
    p = Parser(
        prog="slurmddp",
        description="PyTorch distributed training on Slurm and MPI.",
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version", version=f"slurmddp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands: dict[str, argparse.ArgumentParser] = {
        "submit": sub.add_parser(
            "submit", help="submit SCRIPT [ARGS...] as a distributed job (or run it --local)",
            usage="slurmddp submit [options] SCRIPT [ARGS...] | -m MODULE [ARGS...]",
        ),
        "template": sub.add_parser(
            "template", help="write the sbatch script for SCRIPT, to submit with sbatch yourself",
            usage="slurmddp template [options] SCRIPT [ARGS...] | -m MODULE [ARGS...]",
        ),
        "status": sub.add_parser("status", help="state of submitted jobs"),
        "logs": sub.add_parser("logs", help="a rank's log of a submitted job"),
        "cancel": sub.add_parser("cancel", help="cancel submitted jobs"),
        "report": sub.add_parser("report", help="a page with a job's timeline and summary"),
        "profiles": sub.add_parser("profiles", help="list cluster profiles, with sources"),
        "quickstart": sub.add_parser("quickstart", help="write a complete train.py to start from"),
        "doctor": sub.add_parser(
            "doctor", help="show this rank's resolved values; --check tests the collectives"
        ),
        "run": sub.add_parser(
            "run", add_help=False,
            help="run a torchrun-style script on this rank (same as python -m slurmddp.run)",
        ),
    }  # fmt: skip
    cli_submit.add_arguments(commands["submit"], command="submit")
    cli_submit.add_arguments(commands["template"], command="template")
    cli_jobs.add_status(commands["status"])
    cli_jobs.add_logs(commands["logs"])
    cli_jobs.add_cancel(commands["cancel"])
    cli_jobs.add_report(commands["report"])
    cli_jobs.add_profiles(commands["profiles"])
    cli_quickstart.add_arguments(commands["quickstart"])
    doctor.add_arguments(commands["doctor"])
    p.epilog = help_link("slurmddp")
    for name, command in commands.items():
        command.epilog = help_link(name)
        command.allow_abbrev = False
    return p, commands


def main(argv: Sequence[str] | None = None) -> int | str | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command == "run":
        # The runner's argv is split by hand: everything after SCRIPT is the script's.
        from slurmddp.launch import runner as run

        run.exit_process(run.main(argv[1:], prog="slurmddp run"))
    with reported(f"slurmddp {command}" if command and command[0] != "-" else "slurmddp"):
        return _dispatch(argv, command)


def _dispatch(argv: list[str], command: str | None) -> int | str | None:
    parser, commands = build_parser()
    if command in ("submit", "template"):
        from slurmddp.cli import submit as cli_submit

        handler = cli_submit.main_submit if command == "submit" else cli_submit.main_template
        return handler(argv[1:], commands[command])
    opts, unknown = parser.parse_known_args(argv)
    if unknown:  # a subcommand's: its own parser says so, under its own name
        commands.get(opts.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    opts.prog = f"slurmddp {opts.command}" if opts.command else "slurmddp"
    if opts.command == "quickstart":
        from slurmddp.cli import quickstart

        return quickstart.main(opts)
    if opts.command == "doctor":
        from slurmddp.launch import doctor

        return doctor.main(opts)
    if opts.command in ("status", "logs", "cancel", "report", "profiles"):
        from slurmddp.cli import jobs as cli_jobs

        return getattr(cli_jobs, opts.command)(opts)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``slurmddp submit`` and ``slurmddp template``: options → settings → `JobSpec` → script → job.

Nothing here imports torch; validation happens before anything is queued, and every bad input
is a one-line error with exit status 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from slurmddp import files
from slurmddp.batch.spec import options
from slurmddp.errors import SpecError, fail

if TYPE_CHECKING:
    from slurmddp.batch.spec.jobspec import JobSpec


class _Flag(NamedTuple):
    """One of the commands' own flags (the job's options are in `slurmddp.batch.spec.options`)."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any]
    commands: tuple[str, ...] = ("submit", "template")

    @property
    def takes_value(self) -> bool:
        return self.kwargs.get("action") != "store_true"


def _rehearsals(text: str) -> tuple[str, ...]:
    from slurmddp.preemption.rehearsal import parse  # pure, and imports no torch

    values = tuple(x.strip() for x in text.split(","))
    if not all(parse(v) for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of seconds or steps: give e.g. 20, 20,40 or 50steps (one "
            "value per run, counted from its first step)"
        )
    return values


_FLAGS = (
    _Flag(("--profile",), {"help": "a cluster profile from the configuration files"}),
    _Flag(("-m",), {"dest": "module", "metavar": "MODULE",
                    "help": "run a module instead of a script"}),
    _Flag(("--dry-run",), {"action": "store_true", "help": "print the script, submit nothing"},
          ("submit",)),
    _Flag(("--follow",), {"action": "store_true",
                          "help": "show state changes and rank 0's log until the job ends"},
          ("submit",)),
    _Flag(("--json",), {"action": "store_true", "help": "print the submission as JSON"},
          ("submit",)),
    _Flag(("--local",), {"action": "store_true",
                         "help": "run here without Slurm: the same batch script, with "
                                 "local stand-ins of srun and scontrol"}, ("submit",)),
    _Flag(("--local-signal-after",), {
        "type": _rehearsals, "metavar": "S|Nsteps[,...]",
        "help": "with --local: send the stop signal to the batch script S seconds after each "
                "run's first step (or at its N-th step), one value per run (preempting it that "
                "often)"}, ("submit",)),
    _Flag(("-o", "--output-file"), {"dest": "output_file", "metavar": "FILE",
                                    "help": "write the script here (default: standard output)"},
          ("template",)),
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser, *, command: str) -> None:
    """The options of `command`, ``submit`` or ``template``: the job's, then the command's."""
    options.add_arguments(p)
    for flag in _FLAGS:
        if command in flag.commands:
            p.add_argument(*flag.flags, **flag.kwargs)


def split_target(argv: Sequence[str], *, command: str) -> tuple[list[str], list[str]]:
    """Split at SCRIPT (or after -m MODULE): our options before, the script's argv after.

    An option's value is glued to it (``--sbatch-arg=--exclusive``) so that argparse takes a
    value that starts with a dash as a value, not as an unknown option.
    """
    takes_value = {n for o in options.OPTIONS if o.takes_value for n in (o.flag, o.short) if n}
    takes_value |= {n for f in _FLAGS if command in f.commands and f.takes_value for n in f.flags}
    own: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return own + list(argv[i : i + 2]), list(argv[i + 2 :])
        if arg == "--":
            return own, list(argv[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            return own, list(argv[i:])
        if arg in takes_value and i + 1 < len(argv):
            own.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            own.append(arg)
            i += 1
    return own, []


def _names(command: str) -> set[str]:
    """Every option name of `command`, as argparse takes it whole (it abbreviates none)."""
    names = {"-h", "--help"} | {name for f in _FLAGS if command in f.commands for name in f.flags}
    for o in options.OPTIONS:
        names |= {o.flag, o.short} - {""}
        if not o.takes_value:
            names.add("--no-" + o.flag.removeprefix("--"))
    return names


def check_names(own: Sequence[str], parser: argparse.ArgumentParser, *, command: str) -> None:
    """Refuse in one line an option `command` does not have: an sbatch name with what to type
    instead, anything else with the option it is nearest to."""
    names = _names(command)
    for i, arg in enumerate(own):
        if not arg.startswith("-") or own[i - 1 : i] == ["-m"]:
            continue
        name = arg.partition("=")[0] if arg.startswith("--") else arg[:2]
        if name in names:
            continue
        instead = options.sbatch_instead(arg)
        if instead is not None:
            fail(instead, prog=parser.prog)
        parser.error(f"unrecognized arguments: {name}{_near(name, names)}")


def _near(name: str, names: set[str]) -> str:
    """``; did you mean --nodes?`` for --node (sbatch's refused names too, with why), or ""."""
    if not name.startswith("--"):
        return ""
    longs = sorted(n for n in {*names, *options.SBATCH_REFUSED} if n.startswith("--"))
    # Compared without the dashes, which every candidate shares.
    close = difflib.get_close_matches(name[2:], [n[2:] for n in longs], n=1, cutoff=0.8)
    meant = [f"--{close[0]}"] if close else [n for n in longs if n.startswith(name)]
    if not meant or len(meant) > 3:
        return ""
    if meant[0] in options.SBATCH_REFUSED:
        return f"; did you mean {meant[0]}? {options.sbatch_instead(meant[0])}"
    return f"; did you mean {', '.join(meant[:-1]) + ' or ' if meant[1:] else ''}{meant[-1]}?"


def build(
    opts: argparse.Namespace, rest: list[str], *, preview: bool = False
) -> tuple[JobSpec, Path | None]:
    """(spec, the user's template or None) from parsed options and the script's arguments.

    The spec runs the code as it is at each run: `slurmddp template` takes no snapshot, and
    ``submit`` takes it as it submits (and renders the script then, once). `preview` (``submit
    --dry-run``): the spec runs the snapshot that submit would take, named and bounded as it
    would be, but nothing is written.

    Bad input raises a `slurmddp.errors.UserError` (SpecError, ConfigError, TemplateError); the
    command's caller reports it.
    """
    from slurmddp.batch.spec import config, jobspec

    target = ["-m", opts.module, *rest] if opts.module else rest
    if not target:
        raise SpecError("give the SCRIPT to run (or -m MODULE)")
    if not opts.module and not os.path.isfile(target[0]):
        raise SpecError(f"script {target[0]!r} not found: give the path of a Python file")

    typed = {o.key: getattr(opts, o.key) for o in options.OPTIONS if o.config}
    found = config.load_sources(Path.cwd(), os.environ)
    settings = config.resolve_settings(typed, opts.profile, found)
    keywords = options.spec_keywords(settings.items())
    spec = jobspec.build_spec(target, job_name=opts.job_name, **keywords)
    if preview and spec.snapshot:
        from slurmddp.batch.transport import snapshot

        spec = snapshot.preview(spec)
    template = settings.get("template")
    user_template = None if template is None else Path(str(template))
    return spec, user_template


def main_submit(argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    prog = parser.prog
    own, rest = split_target(argv, command="submit")
    check_names(own, parser, command="submit")
    opts = parser.parse_args(own)
    spec, template = build(opts, rest, preview=opts.dry_run)
    if opts.dry_run:
        from slurmddp.batch.script import sbatch

        sys.stdout.write(sbatch.render_for(spec, template))
        return 0

    from slurmddp.batch import jobs
    from slurmddp.batch.transport import submission

    try:
        record = submission.submit(spec, local=opts.local, template=template,
                                   signal_after=opts.local_signal_after or ())
    except submission.SubmissionError as e:
        fail(str(e), prog=prog, status=1)
    summary = {
        "job_id": record.job_id,
        "name": record.name,
        "engine": record.engine,
        "job_dir": record.folder,
        "logs": str(record.log("<rank>")),
    }
    if opts.json:
        print(json.dumps(summary))
    else:
        print(f"submitted job {record.job_id} ({record.name}, {record.engine})")
        print(f"  job directory: {record.folder}")
        print(f"  logs:          {summary['logs']}")
    if not opts.follow:
        return 0
    final = jobs.follow(record, lambda: jobs.states([record])[record.job_id])
    return 0 if final == "COMPLETED" else jobs.exit_code(record) or 1


def main_template(argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    own, rest = split_target(argv, command="template")
    check_names(own, parser, command="template")
    opts = parser.parse_args(own)
    from slurmddp.batch.script import sbatch

    script = sbatch.render_for(*build(opts, rest))
    if opts.output_file:
        try:
            Path(opts.output_file).write_text(script, encoding="utf-8")
            Path(opts.output_file).chmod(0o755 & ~files.umask())
        except OSError as e:
            fail(f"cannot write {opts.output_file!r}: {e.strerror}; give -o a file in a directory "
                 "you may write to", prog=parser.prog)  # fmt: skip
    else:
        sys.stdout.write(script)
    return 0

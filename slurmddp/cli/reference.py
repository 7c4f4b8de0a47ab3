"""The documentation site's generated pages, and the links ``--help`` gives to it.

Nothing here is written twice: the command-line reference comes from the commands' own parsers
and, for the job's options, from their one table (`slurmddp.batch.spec.options.OPTIONS`: default,
configuration key, check), as TorchX renders its runopts; the environment variables come from
their declarations in `slurmddp.protocol`. docs/hooks/reference.py puts both into the site as
it is built (``<!-- generated: cli -->``, ``<!-- generated: environment -->``). Pure: it reads
parsers and source, and imports neither torch nor anything that does. The links themselves, which
every rank's runner builds its --help with, live in slurmddp.links (no option table).
"""

from __future__ import annotations

import argparse
import html
import inspect
import re
from collections.abc import Iterator

from slurmddp import protocol
from slurmddp.batch.spec import options

__all__ = ["cli_markdown", "environment_markdown", "variables"]

# -- the command-line reference --------------------------------------------------------------------


def _commands() -> Iterator[tuple[str, str, argparse.ArgumentParser, str]]:
    """(title, anchor, parser, summary) of every command, in the order of ``slurmddp --help``."""
    from slurmddp.cli import build_parser
    from slurmddp.launch import runner

    parser, commands = build_parser()
    yield "slurmddp", "slurmddp", parser, parser.description or ""
    summaries = {a.dest: a.help or "" for a in _subcommand_actions(parser)}
    for name, sub in commands.items():
        if name == "run":  # the runner parses its own argv: its parser is the runner's
            sub = runner.build_parser(prog="slurmddp run")
        yield f"slurmddp {name}", f"slurmddp-{name}", sub, summaries.get(name, "")


def _subcommand_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action._choices_actions)
    return []


def _cell(text: object) -> str:
    # Markdown would read "|" as a cell's end and a closing "{ ... }" as attributes.
    text = html.escape(str(text), quote=False).replace("{", "&#123;").replace("}", "&#125;")
    return text.replace("|", "\\|").replace("\n", " ")


def _check(opt: options.Option) -> str:
    """What a value must be, in the words of the option's own check."""
    try:
        opt.check(object())
    except options.Invalid as e:
        return str(e).removeprefix("must be ")
    raise AssertionError(f"{opt.key}: its check takes anything")  # pragma: no cover


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    return ", ".join(f"`{s} {metavar}`" for s in action.option_strings)


def _row(action: argparse.Action, opt: options.Option | None) -> list[str]:
    """flag, what it does, default, configuration key, what a value must be."""
    if opt is None:
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or isinstance(default, list) \
            else str(default)  # fmt: skip
        return [_flag(action), _cell(action.help or ""), _cell(shown), "", ""]
    choices = f": one of {', '.join(opt.choices)}" if opt.choices else ""
    default = opt.default_help or ("" if opt.default is None else options.format_value(opt.default))
    key = f"`{options.toml_key(opt.key)}`" if opt.config else "—"
    return [_flag(action), _cell(opt.help + choices), _cell(default or "—"), key,
            _cell(_check(opt))]  # fmt: skip


def cli_markdown() -> str:
    """The reference of every command and option, as Markdown."""
    by_key = {o.key: o for o in options.OPTIONS}
    out = [
        "Every command and option, generated from the commands' parsers and the table of the "
        "job's options (`slurmddp/batch/spec/options.py`). An option with a configuration key may "
        "also be set in `slurmddp.toml`, `[tool.slurmddp]` in `pyproject.toml`, or a profile "
        "([Centre profiles](../recipes/centre-profiles.md)); the command line wins.",
        "",
    ]
    for title, anchor, parser, summary in _commands():
        out += [f"## {title} {{#{anchor}}}", ""]
        if summary:
            out += [_cell(summary[0].upper() + summary[1:]).rstrip(".") + ".", ""]
        usage = " ".join(parser.format_usage().removeprefix("usage:").split())
        out += ["```text", usage, "```", ""]
        skip = (argparse._SubParsersAction, argparse._HelpAction)
        actions = [a for a in parser._actions
                   if a.help != argparse.SUPPRESS and not isinstance(a, skip)]  # fmt: skip
        if not actions:
            continue
        # The job's options are the table's under submit and template only.
        table = by_key if title in ("slurmddp submit", "slurmddp template") else {}
        out += ["| option | what it does | default | configuration key | a value must be |",
                "|---|---|---|---|---|"]  # fmt: skip
        out += ["| " + " | ".join(_row(a, table.get(a.dest))) + " |" for a in actions]
        out.append("")
    return "\n".join(out + _sbatch_names())


def _sbatch_names() -> list[str]:
    """The section on sbatch's option names: those `submit` refuses, and why."""
    shared = ", ".join(f"`{o.short}`" for o in options.OPTIONS if o.short)
    out = ["## sbatch's option names {#sbatch-names}", "",
           "An option of `submit` and `template` named as sbatch names one means what it means "
           f"in sbatch, its one-letter names too ({shared}). These sbatch names are refused, "
           "with what to type instead; any other sbatch option is refused with the "
           "`--sbatch-arg` that passes it on (`--exclusive`: `--sbatch-arg=--exclusive`). No "
           "option is abbreviated: a near miss is refused with the option it is nearest to. "
           "`--output` is the logs' directory, not sbatch's file pattern: Slurm's filename "
           "patterns (`%j`, `%x`...) are refused in it. `-m` is Python's (a module to run), not "
           "sbatch's `--distribution`; `template -o` is the file the script is written to.", "",
           "| sbatch's option | in slurmddp |", "|---|---|"]  # fmt: skip
    by_reason: dict[str, list[str]] = {}
    for name, reason in options.SBATCH_REFUSED.items():
        by_reason.setdefault(reason, []).append(f"`{name}`")
    out += [f"| {', '.join(names)} | {_cell(reason)} |" for reason, names in by_reason.items()]
    return [*out, ""]


# -- the environment variables -------------------------------------------------------------------

_SECTION = re.compile(r"# -- (.+?) -+$")
_VARIABLE = re.compile(r'(\w+_VAR): Final = "(SLURMDDP_\w+)"(?:\s+#\s*(.*))?$')


def variables() -> list[tuple[str, str, str]]:
    """(section, variable, meaning) of every ``*_VAR`` that protocol.py declares, the meaning
    being the comment beside or just above its declaration."""
    found: list[tuple[str, str, str]] = []
    section, comment = "", list[str]()
    for line in inspect.getsource(protocol).splitlines():
        if m := _SECTION.match(line):
            section, comment = m[1], []
        elif line.startswith("#"):
            comment.append(line.lstrip("# "))
        elif m := _VARIABLE.match(line):
            found.append((section, m[2], m[3] or " ".join(comment)))
            comment = []
        else:
            comment = []
    return found


def environment_markdown() -> str:
    """Every ``SLURMDDP_*`` variable, by who sets it, as Markdown."""
    out = ["Every `SLURMDDP_*` variable, generated from their declarations in "
           "`slurmddp/protocol.py`, where each is named once.", ""]  # fmt: skip
    current = None
    for section, name, meaning in variables():
        if section != current:
            current = section
            out += ["", f"## {section[0].upper()}{section[1:]}", "", "| variable | meaning |",
                    "|---|---|"]  # fmt: skip
        out.append(f"| `{name}` | {_cell(meaning)} |")
    return "\n".join(out) + "\n"

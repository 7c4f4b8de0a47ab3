"""The option table of ``slurmddp submit``: one declaration feeds argparse, the configuration
files and `build_spec`, with the same keys and defaults (a copy anywhere else fails here)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import pytest

from slurmddp.batch.spec import config, options
from slurmddp.batch.spec.jobspec import JobSpec, SpecError, build_spec
from slurmddp.cli import build_parser
from slurmddp.cli import submit as cli_submit

TABLE = options.OPTIONS
IDS = [o.key for o in TABLE]
# JobSpec fields whose name is not the build_spec keyword (the keyword's text is parsed).
FIELD = {"nodes": "nodes_min", "time": "time_minutes"}


def flat_help(command: str) -> str:
    return " ".join(build_parser()[1][command].format_help().split())


@pytest.mark.parametrize("opt", TABLE, ids=IDS)
@pytest.mark.parametrize("command", ["submit", "template"])
def test_argparse_takes_the_flag_keeps_no_default_and_shows_the_tables(opt, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping, so help reads back as declared
    parser = build_parser()[1][command]
    assert getattr(parser.parse_args([]), opt.key) is None  # absent: the layers decide
    if opt.takes_value:
        typed = getattr(parser.parse_args([f"{opt.flag}=x"]), opt.key)
        assert typed == (["x"] if opt.repeated else "x")  # as typed: the table's check parses it
        assert f"{opt.flag} " in flat_help(command)
    else:  # a bool: --flag or --no-flag
        assert getattr(parser.parse_args([opt.flag]), opt.key) is True
        no = "--no-" + opt.flag.removeprefix("--")
        assert getattr(parser.parse_args([no]), opt.key) is False
        assert f"{opt.flag}, {no} " in flat_help(command)
    assert opt.help_text() in flat_help(command)
    if opt.default is not None:
        assert opt.help_text().endswith(f"(default: {opt.default})")
    assert "default" not in opt.help, "the default is shown from the table, not written in help"


@pytest.mark.parametrize("opt", TABLE, ids=IDS)
def test_the_configuration_has_the_key_and_the_default(opt, tmp_path):
    settings = config.resolve_settings({}, None, config.ConfigFiles(tmp_path))
    if not opt.config:
        assert opt.key not in config.OPTIONS
        with pytest.raises(config.ConfigError, match=f"unknown key {opt.key!r}"):
            config.parse_config(f'{opt.key} = "x"\n', tmp_path / "slurmddp.toml", "project")
        return
    assert opt.key in config.OPTIONS
    if opt.default is None:
        assert opt.key not in settings
    elif opt.kind == "path":
        assert settings[opt.key] == tmp_path / opt.default
    else:
        assert settings[opt.key] == opt.default
        assert settings.sources[opt.key] == config.BUILT_IN


@pytest.mark.parametrize("opt", [o for o in TABLE if o.spec], ids=[o.key for o in TABLE if o.spec])
def test_build_spec_takes_the_keyword_with_the_tables_default(opt):
    field = FIELD.get(opt.param, opt.param)
    declared = {f.name: f.default for f in dataclasses.fields(JobSpec)}
    built = getattr(build_spec(["t.py"], cwd="/x"), field)
    assert built == getattr(build_spec(["t.py"], cwd="/x", **{opt.param: None}), field)
    if opt.default is not None:
        assert built == (os.path.join("/x", opt.default) if opt.kind == "path" else opt.default)
        if declared[field] is not dataclasses.MISSING:
            assert declared[field] == opt.default
    elif opt.repeated:
        assert built == declared[field] == ()
    elif opt.default_help:  # computed when the job is built
        assert built == {"job_name": "t", "ntasks_per_node": 1, "python": sys.executable}[field]
    else:
        assert built is None


def test_build_spec_refuses_a_keyword_no_option_has():
    with pytest.raises(TypeError, match="unexpected keyword arguments nodez; known: "):
        build_spec(["t.py"], nodez=2)


def test_every_config_key_reaches_build_spec_or_the_template():
    values = {o.key: object() for o in TABLE if o.config}
    keywords = options.spec_keywords(values.items())
    assert set(keywords) == {o.param for o in TABLE if o.config and o.spec}
    assert set(values) - {o.key for o in TABLE if o.spec} == {"template"}


SIGNAL_NAMES = ["USR2", "USR1", "HUP", "TERM", "INT", "KILL", "SIGUSR2", "usr2", "12", "RTMIN",
                "USR1@60", "FOO"]  # fmt: skip


@pytest.mark.parametrize("name", SIGNAL_NAMES)
def test_configuration_and_jobspec_accept_the_same_signals(name, tmp_path):
    try:
        dataclasses.replace(build_spec(["t.py"], cwd="/x"), signal=name)  # validated as made
        spec_ok = True
    except SpecError:
        spec_ok = False
    try:
        config.parse_config(f'signal = "{name}"\n', tmp_path / "slurmddp.toml", "project")
        config_ok = True
    except config.ConfigError:
        config_ok = False
    assert spec_ok == config_ok == (name in options.SIGNALS)


def test_env_stays_a_mapping_from_the_configuration_to_the_spec(tmp_path):
    settings = config.resolve_settings({"env": ["A=x=y", "B="]}, None, config.ConfigFiles(tmp_path))
    keywords = options.spec_keywords(settings.items())
    assert dict(keywords["env"]) == {"A": "x=y", "B": ""}
    spec = build_spec(["t.py"], cwd="/x", **keywords)
    assert spec.env == (("A", "x=y"), ("B", ""))


def test_build_raises_and_leaves_reporting_to_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opts = build_parser()[1]["submit"].parse_args([])
    with pytest.raises(SpecError, match="give the SCRIPT to run"):
        cli_submit.build(opts, [])
    with pytest.raises(SpecError, match=r"script 'nope\.py' not found"):
        cli_submit.build(opts, ["nope.py"])


def test_the_command_line_reads_no_private_argparse_state():
    assert "_actions" not in inspect.getsource(cli_submit)


# ---- sbatch's names (issue 44) ---------------------------------------------------------------

# sbatch's one-letter options (its man page), for the options the table shares with it.
SBATCH_SHORT = {
    "-J": "--job-name",
    "-p": "--partition",
    "-A": "--account",
    "-q": "--qos",
    "-C": "--constraint",
    "-N": "--nodes",
    "-c": "--cpus-per-task",
    "-t": "--time",
}


def test_the_short_options_are_sbatchs_for_the_same_option():
    assert {o.short: o.flag for o in TABLE if o.short} == SBATCH_SHORT


@pytest.mark.parametrize("opt", TABLE, ids=IDS)
@pytest.mark.parametrize("command", ["submit", "template"])
def test_argparse_abbreviates_no_flag(opt, command):
    # Once, --ntasks=8 was read as --ntasks-per-node=8: a prefix is no name.
    parser = build_parser()[1][command]
    prefix = opt.flag[:-1]
    with pytest.raises(SystemExit):
        parser.parse_args([f"{prefix}=1" if opt.takes_value else prefix])


def test_sbatchs_names_are_the_tables_or_refused_never_both():
    ours = {name for o in TABLE for name in (o.flag, o.short) if name}
    assert not ours & set(options.SBATCH_REFUSED)
    for name in options.SBATCH_REFUSED:
        assert options.sbatch_instead(name) == f"{name} {options.SBATCH_REFUSED[name]}"
    for name in ours:
        assert options.sbatch_instead(name) is None, name  # sbatch's meaning: not refused


@pytest.mark.parametrize(("typed", "says"), [
    ("--exclusive", "--exclusive is an sbatch option slurmddp does not set: pass it on as "
                    "--sbatch-arg=--exclusive"),
    ("--reservation", "pass it on as --sbatch-arg=--reservation=VALUE"),
    ("--reservation=r1", "pass it on as --sbatch-arg=--reservation=r1"),
    ("-wnode1", "-w (sbatch's --nodelist) is an sbatch option slurmddp does not set: pass it on "
                "as --sbatch-arg=--nodelist=node1"),
    ("-H", "-H (sbatch's --hold) is an sbatch option slurmddp does not set: pass it on as "
           "--sbatch-arg=--hold"),
    ("-n8", "-n is sbatch's total of tasks"),
])  # fmt: skip
def test_sbatchs_other_options_are_passed_on_with_sbatch_arg(typed, says):
    assert says in options.sbatch_instead(typed)


def test_no_sbatch_name_is_taken_for_an_unknown_one():
    assert options.sbatch_instead("--bogus") is None and options.sbatch_instead("-z") is None


@pytest.mark.parametrize(("value", "ok"), [
    ("logs", True), ("/scratch/runs/100%", True), ("5%off", True), ("%j.out", False),
    ("logs/%x-%A_%a", False), ("logs/%3a", False), ("100%%", False), ("runs/%u", False),
])  # fmt: skip
def test_the_log_directory_refuses_slurms_filename_patterns(value, ok, tmp_path):
    output = options.by_key("output")
    if ok:
        assert output.check(value) == value
    else:
        with pytest.raises(options.Invalid, match=r"^must be a directory, and '%.*' is Slurm's "):
            output.check(value)
    assert options.by_key("template").check(value) == value  # a template's name may be anything


@pytest.mark.parametrize(("name", "says"), [
    ("USR1@60", "must be the signal alone, e.g. 'USR1' and the lead time as signal_lead "
                "(--signal-lead 60)"),
    ("B:USR2@90", "must be the signal alone, e.g. 'USR2' and the lead time as signal_lead"),
    ("R:USR1", "must be the signal alone, e.g. 'USR1': slurmddp writes"),
    ("12", "must be a signal name, USR2 or USR1"),
])  # fmt: skip
def test_sbatchs_signal_form_is_refused_naming_signal_lead(name, says):
    assert options.signal_problem(name).startswith(says)

"""The option table of ``slurmddp submit``: one declaration feeds argparse, the configuration
files and `build_spec`, with the same keys and defaults (a copy anywhere else fails here)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import pytest

from slurmddp.batch import config, options
from slurmddp.batch.jobspec import JobSpec, SpecError, build_spec, validate
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
    good = dataclasses.replace(build_spec(["t.py"], cwd="/x"), signal=name)
    try:
        validate(good)
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

"""Defaults for ``slurmddp submit``: configuration files and cluster profiles.

A value comes from the first of these layers that sets it:

1. the command line (only the options the user typed);
2. the named profile (``--profile NAME``, else the ``profile = "NAME"`` of the most specific file
   that names one), after its ``extends`` chain;
3. the project: ``slurmddp.toml``, or ``[tool.slurmddp]`` in ``pyproject.toml``, in the nearest
   directory from the current one upwards (to the filesystem root) that has either. When one
   directory has both, ``slurmddp.toml`` wins, as a file of its own is the more deliberate
   choice, and the ``[tool.slurmddp]`` table is ignored with a warning (`ConfigFiles.warnings`).
   A ``pyproject.toml`` without that table does not stop the search;
4. the user's ``$XDG_CONFIG_HOME/slurmddp/profiles.toml`` (``~/.config/...`` by default);
5. the centre's file named by ``$SLURMDDP_PROFILES``;
6. built-in defaults (`DEFAULTS`).

Every file has the same shape, so an HPC centre's documentation can ship one file::

    profile = "jeanzay"          # the default profile (not allowed inside a profile)
    account = "abc@v100"         # top-level options: defaults for every job

    [profiles.jeanzay]
    partition = "gpu_p13"
    gpus_per_node = 4
    setup = ["module purge", "module load pytorch-gpu/py3/2.3.0"]
    env = { NCCL_DEBUG = "WARN" }

    [profiles.jeanzay-big]
    extends = "jeanzay"
    nodes = 16

Profile names are looked up in the most specific file first (project, user, centre); a profile
with the same name in a more specific file hides the other one whole. ``extends`` looks in the
profile's own file, then in less specific ones; a profile that extends its own name extends the
definition in the next less specific file, which is how a user tweaks the centre's profile.

Merge rules:

- scalars: the most specific layer wins (within a profile, the child beats its base);
- ``env`` tables merge key by key, the more specific layer winning per variable;
- ``setup``, ``sbatch_args`` and ``srun_args`` lists are never replaced: every layer's entries
  are kept, in order from the machine to the submission: built-in, centre, user, the profile (its
  ``extends`` base first), the project, the command line. The profile comes before the project
  here, unlike for scalars, because a cluster's ``module load`` must run before a project's
  ``source .venv/bin/activate`` (a module load would otherwise put its own python first on
  PATH). sbatch and srun take the last of a repeated option, so the command line's win.

Relative paths (``template``, ``output``, and a ``python`` with a slash) are relative to the
file that sets them, or to the current directory for the command line; ``~`` means ``$HOME``.
`load_sources` is the only function here that touches the filesystem.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
import types
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence
from pathlib import Path
from typing import Literal

from slurmddp.batch.jobspec import LAUNCHERS
from slurmddp.errors import ConfigError
from slurmddp.rank.placement import BACKENDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

Origin = Literal["project", "user", "centre"]

PROJECT_FILE = "slurmddp.toml"
PYPROJECT_FILE = "pyproject.toml"
PROFILES_VARIABLE = "SLURMDDP_PROFILES"
USER_FILE = Path("slurmddp", "profiles.toml")  # under $XDG_CONFIG_HOME or ~/.config

# Option keys in display order; a profile may set any of them, and so may a file's top level.
OPTIONS = (
    "partition", "account", "qos", "constraint", "nodes", "ntasks_per_node", "gpus_per_node",
    "cpus_per_task", "mem", "time", "signal", "signal_lead", "max_requeues", "max_restarts",
    "launcher", "backend", "python", "template", "output", "setup", "env", "sbatch_args",
    "srun_args", "mpi",
)  # fmt: skip
_LISTS = frozenset({"setup", "sbatch_args", "srun_args"})
_MINIMUM = {
    "nodes": 1,
    "ntasks_per_node": 1,
    "gpus_per_node": 0,
    "cpus_per_task": 1,
    "signal_lead": 0,
    "max_requeues": 0,
    "max_restarts": 0,
}
# Slurm reads a bare number as minutes (--time) or megabytes (--mem), so integers are fine too;
# 0 means no limit (--time) or all of the node's memory (--mem).
_STRING_OR_INT = frozenset({"mem", "time"})
_CHOICES: Mapping[str, Sequence[str]] = {"launcher": LAUNCHERS, "backend": BACKENDS}
_PATHS = frozenset({"template", "output"})
_FILE_KEYS = frozenset(OPTIONS) | {"profile", "profiles"}
_PROFILE_KEYS = frozenset(OPTIONS) | {"extends"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SIGNAL = re.compile(r"(SIG)?[A-Z][A-Z0-9+]*|[0-9]+")

DEFAULTS: Mapping[str, object] = types.MappingProxyType(
    {
        "nodes": 1,
        "launcher": "srun",
        "backend": "auto",
        # Preemption and time limits warn the job this many seconds ahead, so it can checkpoint.
        "signal": "USR2",
        "signal_lead": 120,
        "max_requeues": 3,
    }
)
BUILT_IN = "built-in default"
COMMAND_LINE = "command line"



@dataclasses.dataclass(frozen=True)
class ProfileInfo:
    """One ``[profiles.NAME]`` table as written (validated), and where it is defined."""

    name: str
    file: Path
    values: Mapping[str, object]  # its own option keys, without ``extends``
    extends: str | None = None
    shadowed_by: Path | None = None  # set by `list_profiles` when a more specific file wins

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.values)

    @property
    def label(self) -> str:
        return f"profile {self.name!r} ({self.file})"


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """One configuration file's slurmddp table, validated."""

    path: Path
    origin: Origin
    label: str  # how `Settings.sources` names it
    options: Mapping[str, object]
    default_profile: str | None
    profiles: Mapping[str, ProfileInfo]


@dataclasses.dataclass(frozen=True)
class ConfigFiles:
    """Everything `load_sources` found, most specific file first (project, user, centre)."""

    cwd: Path
    files: tuple[ConfigFile, ...] = ()
    searched: tuple[Path, ...] = ()  # directories looked at for a project file, nearest first
    warnings: tuple[str, ...] = ()

    @property
    def project(self) -> ConfigFile | None:
        return next((f for f in self.files if f.origin == "project"), None)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved submit options and the layer each came from; reads like a read-only mapping.

    Not a `Mapping` subclass: that would make ``values`` a method.
    """

    values: Mapping[str, object]
    sources: Mapping[str, str]

    def __getitem__(self, key: str) -> object:
        return self.values[key]

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def get(self, key: str, default: object = None) -> object:
        return self.values.get(key, default)

    def keys(self) -> KeysView[str]:
        return self.values.keys()

    def items(self) -> ItemsView[str, object]:
        return self.values.items()

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, value as TOML, source) for every set value."""
        return [(k, format_value(v), self.sources[k]) for k, v in self.values.items()]


# --- reading files (the only I/O) --------------------------------------------------------------


def load_sources(cwd: Path, environ: Mapping[str, str]) -> ConfigFiles:
    """Find and parse the project, user and centre files for a command run in `cwd`.

    Raises `ConfigError` for unreadable or invalid files, and when ``$SLURMDDP_PROFILES`` names a
    file that does not exist (a missing user file is fine: most users have none).
    """
    cwd = Path(os.path.abspath(cwd))
    home = environ.get("HOME") or None
    files: list[ConfigFile] = []
    warnings: list[str] = []
    searched: list[Path] = []
    for directory in (cwd, *cwd.parents):
        searched.append(directory)
        own, pyproject = directory / PROJECT_FILE, directory / PYPROJECT_FILE
        if own.is_file():
            files.append(_parse_required(own, "project", home))
            if _has_tool_table(_read(pyproject)):
                warnings.append(
                    f"{pyproject}: [tool.slurmddp] is ignored because {own} exists; "
                    "move its settings there"
                )
            break
        from_pyproject = parse_config(_read(pyproject), pyproject, "project", home=home)
        if from_pyproject is not None:
            files.append(from_pyproject)
            break

    user = user_profiles_path(environ)
    if user is not None and user.is_file():
        files.append(_parse_required(user, "user", home))
    centre = environ.get(PROFILES_VARIABLE)
    if centre:
        path = _path(centre, cwd, home)
        if not path.is_file():
            raise ConfigError(
                f"${PROFILES_VARIABLE}={centre!r}: no such file; fix or unset the variable"
            )
        files.append(_parse_required(path, "centre", home))
    return ConfigFiles(cwd, tuple(files), tuple(searched), tuple(warnings))


def user_profiles_path(environ: Mapping[str, str]) -> Path | None:
    """``$XDG_CONFIG_HOME/slurmddp/profiles.toml``, else under ``$HOME/.config``; None if neither.

    The XDG spec says a relative XDG_CONFIG_HOME is invalid and must be ignored.
    """
    xdg = environ.get("XDG_CONFIG_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / USER_FILE
    home = environ.get("HOME")
    return Path(home) / ".config" / USER_FILE if home else None


def _read(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None


def _has_tool_table(text: str | None) -> bool:
    """Whether an ignored pyproject.toml has a [tool.slurmddp] table, without judging it."""
    try:
        tool = tomllib.loads(text or "").get("tool")
    except tomllib.TOMLDecodeError:
        return False  # not ours to report: this file is not read for settings
    return isinstance(tool, dict) and "slurmddp" in tool


def _parse_required(path: Path, origin: Origin, home: str | None) -> ConfigFile:
    parsed = parse_config(_read(path), path, origin, home=home)
    assert parsed is not None  # only a pyproject.toml can lack our table
    return parsed


# --- parsing and validation (pure) -------------------------------------------------------------


def parse_config(
    text: str | None, path: Path, origin: Origin, *, home: str | None = None
) -> ConfigFile | None:
    """Validate one file's text; None for no text, or a pyproject.toml without [tool.slurmddp].

    `path` names the file in messages and anchors relative paths; `home` expands ``~``.
    """
    if text is None:
        return None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    prefix, label = "", f"{path.name} ({path})"
    if origin == "user":
        label = f"user profiles ({path})"
    elif origin == "centre":
        label = f"centre profiles ${PROFILES_VARIABLE} ({path})"
    elif path.name == PYPROJECT_FILE:
        tool = document.get("tool")
        if not isinstance(tool, dict) or "slurmddp" not in tool:
            return None
        document, prefix = tool["slurmddp"], "tool.slurmddp."
        label = f"{PYPROJECT_FILE} [tool.slurmddp] ({path})"
        if not isinstance(document, dict):
            raise ConfigError(f"{path}: tool.slurmddp must be a table, not {_toml_type(document)}")

    base = path.parent
    where = f"{path}: {prefix}"
    _reject_unknown(document, _FILE_KEYS, f"{path}: [{prefix.rstrip('.')}]" if prefix else path)
    options = _check_table(
        {k: v for k, v in document.items() if k in OPTIONS}, where, base=base, home=home
    )
    default = document.get("profile")
    if default is not None and not _nonempty_string(default):
        raise _invalid(where, "profile", default, "a profile name (a non-empty string)")

    tables = document.get("profiles", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{where}profiles must be a table of [profiles.NAME] tables")
    profiles = {}
    for name, table in tables.items():
        key = f"{prefix}profiles.{_toml_key(name)}"
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {key} must be a table, not {_toml_type(table)}")
        _reject_unknown(table, _PROFILE_KEYS, f"{path}: [{key}]")
        extends = table.get("extends")
        if extends is not None and not _nonempty_string(extends):
            raise _invalid(f"{path}: {key}.", "extends", extends, "a profile name")
        values = _check_table(
            {k: v for k, v in table.items() if k != "extends"},
            f"{path}: {key}.",
            base=base,
            home=home,
        )
        profiles[name] = ProfileInfo(name, path, values, extends)
    return ConfigFile(path, origin, label, options, default, types.MappingProxyType(profiles))


def _check_table(
    table: Mapping[str, object],
    where: str,
    *,
    base: Path,
    home: str | None,
    cli: bool = False,
) -> Mapping[str, object]:
    """Validated, normalised, read-only copy: lists become tuples, paths become Paths."""
    out = {}
    for key, value in table.items():
        try:
            out[key] = _check_value(key, value, base=base, home=home, cli=cli)
        except _Expected as e:
            name = f"--{key.replace('_', '-')}" if cli else key
            raise _invalid(where, name, value, str(e)) from None
    return types.MappingProxyType(out)


class _Expected(Exception):
    """What a value should have been, for `_invalid`."""


def _check_value(key: str, value: object, *, base: Path, home: str | None, cli: bool) -> object:
    if key in _LISTS:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise _Expected("a list of strings")
        if not all(isinstance(item, str) for item in value):
            raise _Expected("a list of strings (quote every item)")
        return tuple(value)
    if key == "env":
        return _check_env(value, cli=cli)
    if key == "nodes" and isinstance(value, str) and re.fullmatch(r"[0-9]+-[0-9]+", value):
        return value  # a MIN-MAX range; slurmddp.batch.jobspec.parse_nodes checks its bounds
    if key in _MINIMUM:
        # Command lines carry text; in a file, a quoted number is a mistake worth naming.
        if cli and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < _MINIMUM[key]:
            hint = ' or a range "MIN-MAX"' if key == "nodes" else ""
            raise _Expected(f"an integer >= {_MINIMUM[key]}{hint}")
        return value
    if key in _STRING_OR_INT:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return str(value)
        if not _nonempty_string(value):
            raise _Expected('a Slurm value such as "64G" or "02:00:00", or an integer >= 0')
        return value
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise _Expected(f"one of {', '.join(_CHOICES[key])}")
        return value
    if key == "signal":
        if not isinstance(value, str) or not _SIGNAL.fullmatch(value):
            raise _Expected('a signal name or number such as "USR2"')
        return value
    if not _nonempty_string(value):
        raise _Expected("a path (a non-empty string)" if key in _PATHS else "a non-empty string")
    assert isinstance(value, str)
    if key in _PATHS:
        return _path(value, base, home)
    if key == "python" and ("/" in value or value.startswith("~")):
        return str(_path(value, base, home))  # a bare "python3" is looked up on PATH
    return value


def _check_env(value: object, *, cli: bool) -> Mapping[str, str]:
    if cli and isinstance(value, (list, tuple)):
        pairs = {}
        for item in value:
            if not isinstance(item, str) or "=" not in item:
                raise _Expected("NAME=VALUE")
            name, _, text = item.partition("=")
            pairs[name] = text
        value = pairs
    if not isinstance(value, Mapping):
        raise _Expected('a table of variables such as { NCCL_DEBUG = "INFO" }')
    out = {}
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise _Expected(f"a table of variables, and {name!r} is not a variable name")
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)  # OMP_NUM_THREADS = 8 means what it says
        if not isinstance(text, str):
            raise _Expected(f"a table of strings, and {name} = {format_value(text)} is not one")
        out[name] = text
    return types.MappingProxyType(out)


def _path(value: str, base: Path, home: str | None) -> Path:
    if value == "~" or value.startswith("~/"):
        if not home:
            return Path(value)
        value = home + value[1:]
    return Path(os.path.normpath(base / value))


def _nonempty_string(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _reject_unknown(table: Mapping[str, object], known: frozenset[str], where: object) -> None:
    for key in table:
        if key not in known:
            raise _unknown(where, "key", key, sorted(known))


def _unknown(where: object, what: str, name: str, known: Sequence[str]) -> ConfigError:
    hint = _did_you_mean(name, known)
    listed = ", ".join(known) if known else "none"
    return ConfigError(f"{where}: unknown {what} {name!r}; {hint}known: {listed}")


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    # Abbreviations ("gpus" for gpus_per_node) score too low for difflib.
    close = close or [k for k in known if k.startswith(name) or name.startswith(k)][:1]
    return f"did you mean {close[0]!r}? " if close else ""


def _invalid(where: str, key: str, value: object, expected: str) -> ConfigError:
    sep = "" if where.endswith((".", " ")) else ": "
    return ConfigError(f"{where}{sep}{key} = {format_value(value)} must be {expected}")


def _toml_type(value: object) -> str:
    return {dict: "a table", list: "an array", str: "a string"}.get(type(value), "a value")


def _toml_key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


# --- resolution (pure) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layer:
    label: str
    values: Mapping[str, object]


def resolve_settings(
    cli: Mapping[str, object],
    profile: str | None,
    files: ConfigFiles,
    *,
    defaults: Mapping[str, object] = DEFAULTS,
) -> Settings:
    """Merge the layers (see the module docstring for precedence and merge rules).

    `cli` holds only the options the user typed (None values count as not typed); ints may come
    as text and ``env`` as ``["NAME=VALUE", ...]``. `profile` is the ``--profile`` value: None
    defers to the files' ``profile = "NAME"``, ``""`` asks for no profile at all. The chosen
    profile name is in the result as ``"profile"``. Raises `ConfigError`.
    """
    given = {k: v for k, v in cli.items() if v is not None}
    _reject_unknown(given, frozenset(OPTIONS), COMMAND_LINE)
    # The shell has already expanded ~ on a command line.
    checked = _check_table(given, COMMAND_LINE, base=files.cwd, home=None, cli=True)
    cli_layer = _Layer(COMMAND_LINE, checked)
    default_layer = _Layer(
        BUILT_IN, _check_table(defaults, BUILT_IN, base=files.cwd, home=None, cli=True)
    )

    chosen = _chosen_profile(profile, files)
    chain = _chain(chosen[0], chosen[1], files) if chosen else []
    profile_layers = [_Layer(label, p.values) for p, label in chain]  # base first
    project = [_Layer(f.label, f.options) for f in files.files if f.origin == "project"]
    site = [_Layer(f.label, f.options) for f in files.files if f.origin != "project"]

    by_precedence = [cli_layer, *reversed(profile_layers), *project, *site, default_layer]
    list_order = [default_layer, *reversed(site), *profile_layers, *project, cli_layer]

    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    if chosen:
        values["profile"], sources["profile"] = chosen
    for key in OPTIONS:
        merged: object
        if key in _LISTS:
            parts = [layer for layer in list_order if key in layer.values]
            merged = tuple(item for layer in parts for item in layer.values[key])
        elif key == "env":
            parts = [layer for layer in reversed(by_precedence) if key in layer.values]
            env: dict[str, str] = {}
            for layer in parts:
                env.update(layer.values[key])
            merged = types.MappingProxyType(env)
        else:
            parts = [layer for layer in by_precedence if key in layer.values][:1]
            merged = parts[0].values[key] if parts else None
        if parts:
            values[key] = merged
            sources[key] = " + ".join(layer.label for layer in parts)
    return Settings(types.MappingProxyType(values), types.MappingProxyType(sources))


def _chosen_profile(profile: str | None, files: ConfigFiles) -> tuple[str, str] | None:
    """(name, what named it), or None for no profile."""
    if profile is not None:
        return (profile, COMMAND_LINE) if profile else None
    return next(((f.default_profile, f.label) for f in files.files if f.default_profile), None)


def _chain(name: str, named_by: str, files: ConfigFiles) -> list[tuple[ProfileInfo, str]]:
    """The profile `name` and its ``extends`` ancestors, base first, with source labels."""
    found = _find(name, files, 0)
    if found is None:
        by = "on the command line" if named_by == COMMAND_LINE else f"as the default by {named_by}"
        raise _no_profile(name, f"named {by}", files, 0)
    chain: list[tuple[ProfileInfo, str]] = []
    seen: list[tuple[int, str]] = []
    index, current, child = found[0], found[1], None
    while True:
        if (index, current.name) in seen:
            trail = " extends ".join(f"{n!r} ({files.files[i].path})" for i, n in seen)
            raise ConfigError(
                f"profile cycle: {trail} extends {current.name!r}; remove one 'extends'"
            )
        seen.append((index, current.name))
        label = current.label if child is None else f"{current.label}, extended by {child!r}"
        chain.append((current, label))
        if current.extends is None:
            return chain[::-1]
        # A profile that extends its own name means the next, less specific definition.
        start = index + 1 if current.extends == current.name else index
        base = _find(current.extends, files, start)
        if base is None:
            context = f"extended by {current.name!r} in {current.file}"
            if start > index:
                context += ", which names itself and so looks only in less specific files"
            raise _no_profile(current.extends, context, files, start)
        child = current.name
        index, current = base


def _find(name: str, files: ConfigFiles, start: int) -> tuple[int, ProfileInfo] | None:
    for index in range(start, len(files.files)):
        if name in files.files[index].profiles:
            return index, files.files[index].profiles[name]
    return None


def _no_profile(name: str, context: str, files: ConfigFiles, start: int) -> ConfigError:
    names = sorted({n for f in files.files[start:] for n in f.profiles})
    if not names:
        return ConfigError(
            f"unknown profile {name!r} ({context}): no profile is defined; add "
            f"[profiles.{_toml_key(name)}] to {PROJECT_FILE}, ~/.config/{USER_FILE.as_posix()} "
            f"or the file named by ${PROFILES_VARIABLE}"
        )
    hint = _did_you_mean(name, names)
    return ConfigError(f"unknown profile {name!r} ({context}); {hint}available: {', '.join(names)}")


# --- listing ------------------------------------------------------------------------------------


def list_profiles(files: ConfigFiles) -> list[ProfileInfo]:
    """Every profile definition, most specific file first; hidden ones say which file wins."""
    winner: dict[str, Path] = {}
    out = []
    for f in files.files:
        for name, info in f.profiles.items():
            if name in winner:
                info = dataclasses.replace(info, shadowed_by=winner[name])
            else:
                winner[name] = f.path
            out.append(info)
    return out


def format_profiles(profiles: Sequence[ProfileInfo], settings: Settings | None = None) -> str:
    """The profiles with their own keys, then (given `settings`) each value and its source."""
    lines = []
    if not profiles:
        lines.append(
            f"no profiles: add [profiles.NAME] tables to {PROJECT_FILE}, "
            f"~/.config/{USER_FILE.as_posix()} or the file named by ${PROFILES_VARIABLE}"
        )
    for p in profiles:
        hidden = f"  (hidden by {p.shadowed_by})" if p.shadowed_by else ""
        lines.append(f"{p.name}  {p.file}{hidden}")
        if p.extends is not None:
            lines.append(f"  extends = {format_value(p.extends)}")
        lines += [f"  {k} = {format_value(v)}" for k, v in p.values.items()]
    if settings is not None:
        chosen = settings.get("profile")
        lines += ["", f"settings with profile {chosen!r}:" if chosen else "settings (no profile):"]
        rows = settings.rows()
        width = max((len(k) for k, _, _ in rows), default=0) + 2
        # Long values (env tables, paths) push their own source along instead of every row's.
        vwidth = min(max((len(v) for _, v, _ in rows), default=0), 30)
        lines += [f"  {k:<{width}}{v:<{vwidth}}  {source}" for k, v, source in rows]
    return "\n".join(lines)


def format_value(value: object) -> str:
    """A value as it would be written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, Mapping):
        inner = ", ".join(f"{_toml_key(str(k))} = {format_value(v)}" for k, v in value.items())
        return f"{{ {inner} }}" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)

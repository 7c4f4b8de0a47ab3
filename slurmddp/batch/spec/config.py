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

Relative paths (``template``, ``output``, a ``python`` with a slash, a ``container`` image file)
are relative to the file that sets them, or to the current directory for the command line; ``~``
means ``$HOME``.
`load_sources` is the only function here that touches the filesystem. Which keys exist, their
types and checks come from the option table, `slurmddp.batch.spec.options`;
`slurmddp.batch.spec.profiles` lists the profiles.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from slurmddp.batch.spec import options
from slurmddp.batch.spec.options import format_value, toml_key
from slurmddp.errors import ConfigError
from slurmddp.protocol import PROFILES_VAR as PROFILES_VARIABLE

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

Origin = Literal["project", "user", "centre"]

PROJECT_FILE = "slurmddp.toml"
PYPROJECT_FILE = "pyproject.toml"
USER_FILE = Path("slurmddp", "profiles.toml")  # under $XDG_CONFIG_HOME or ~/.config

# Option keys in display order; a profile may set any of them, and so may a file's top level.
OPTIONS = tuple(o.key for o in options.OPTIONS if o.config)
_LISTS = frozenset(o.key for o in options.OPTIONS if o.kind == "lines")
_PATHS = frozenset(o.key for o in options.OPTIONS if o.kind == "path")
_FILE_KEYS = frozenset(OPTIONS) | {"profile", "profiles"}
_PROFILE_KEYS = frozenset(OPTIONS) | {"extends"}
DEFAULTS: Mapping[str, object] = options.DEFAULTS
BUILT_IN = "built-in default"
COMMAND_LINE = "command line"


@dataclasses.dataclass(frozen=True)
class ProfileInfo:
    """One ``[profiles.NAME]`` table as written (validated), and where it is defined."""

    name: str
    file: Path
    values: Mapping[str, object]  # its own option keys, without ``extends``
    extends: str | None = None
    shadowed_by: Path | None = None  # set by `profiles.list_profiles`: a more specific file wins

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
    top = _check_table(
        {k: v for k, v in document.items() if k in OPTIONS}, where, base=base, home=home
    )
    default = document.get("profile")
    if default is not None and not options.nonempty(default):
        raise _invalid(where, "profile", default, "must be a profile name (a non-empty string)")

    tables = document.get("profiles", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{where}profiles must be a table of [profiles.NAME] tables")
    profiles = {}
    for name, table in tables.items():
        key = f"{prefix}profiles.{toml_key(name)}"
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {key} must be a table, not {_toml_type(table)}")
        _reject_unknown(table, _PROFILE_KEYS, f"{path}: [{key}]")
        extends = table.get("extends")
        if extends is not None and not options.nonempty(extends):
            raise _invalid(f"{path}: {key}.", "extends", extends, "must be a profile name")
        values = _check_table(
            {k: v for k, v in table.items() if k != "extends"},
            f"{path}: {key}.",
            base=base,
            home=home,
        )
        profiles[name] = ProfileInfo(name, path, values, extends)
    return ConfigFile(path, origin, label, top, default, types.MappingProxyType(profiles))


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
        option = options.by_key(key)
        try:
            checked = option.check(value, typed=cli)
        except options.Invalid as e:
            raise _invalid(where, option.flag if cli else key, value, str(e)) from None
        if key in _PATHS:
            checked = _path(str(checked), base, home)
        elif key == "python" and ("/" in str(checked) or str(checked).startswith("~")):
            checked = str(_path(str(checked), base, home))  # a bare "python3" is looked up on PATH
        elif key == "container" and "://" not in str(checked):
            checked = str(_path(str(checked), base, home))  # an image file, not a registry's URI
        out[key] = checked
    return types.MappingProxyType(out)


def _path(value: str, base: Path, home: str | None) -> Path:
    if value == "~" or value.startswith("~/"):
        if not home:
            return Path(value)
        value = home + value[1:]
    return Path(os.path.normpath(base / value))


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


def _invalid(where: str, key: str, value: object, complaint: str) -> ConfigError:
    """``WHERE: KEY = VALUE must be ...``; `complaint` is what follows the value."""
    sep = "" if where.endswith((".", " ")) else ": "
    return ConfigError(f"{where}{sep}{key} = {format_value(value)} {complaint}")


def _toml_type(value: object) -> str:
    kinds = ((dict, "a table"), (list, "an array"), (str, "a string"))
    return next((name for kind, name in kinds if type(value) is kind), "a value")


# --- resolution (pure) -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layer:
    label: str
    values: Mapping[str, Any]  # checked by the option table: lists are tuples, env a mapping


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
            f"[profiles.{toml_key(name)}] to {PROJECT_FILE}, ~/.config/{USER_FILE.as_posix()} "
            f"or the file named by ${PROFILES_VARIABLE}"
        )
    hint = _did_you_mean(name, names)
    return ConfigError(f"unknown profile {name!r} ({context}); {hint}available: {', '.join(names)}")

"""``slurmddp profiles``: every profile definition, which are hidden, and what one resolves to."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from slurmddp.batch.spec.config import (
    PROFILES_VARIABLE,
    PROJECT_FILE,
    USER_FILE,
    ConfigFiles,
    ProfileInfo,
    Settings,
)
from slurmddp.batch.spec.options import format_value


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

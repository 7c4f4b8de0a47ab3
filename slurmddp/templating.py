"""Jinja rendering of the shipped templates (templates/ in the repository, slurmddp.templates
once installed). Every value that reaches a shell goes through the ``sh`` filter."""

from __future__ import annotations

import shlex
from importlib import resources

import jinja2
import jinja2.sandbox

TEMPLATE_PACKAGE = "slurmddp.templates"


def template_names() -> list[str]:
    """Names of the shipped templates."""
    root = resources.files(TEMPLATE_PACKAGE)
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".j2"))


def environment() -> jinja2.Environment:
    """A sandboxed environment that refuses undefined variables and quotes with ``| sh``."""
    env = jinja2.sandbox.SandboxedEnvironment(
        loader=jinja2.FunctionLoader(_load_shipped),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # shell scripts, not HTML: quoting is the sh filter's job
    )
    env.filters["sh"] = shell_quote
    return env


def render(name: str, **context: object) -> str:
    """Render the shipped template `name` with `context`."""
    return environment().get_template(name).render(**context)


def shell_quote(value: object) -> str:
    """One shell word that reads back as exactly str(value): spaces, quotes, $() and newlines."""
    return shlex.quote(str(value))


def _load_shipped(name: str) -> str | None:
    path = resources.files(TEMPLATE_PACKAGE) / name
    return path.read_text(encoding="utf-8") if path.is_file() else None

"""Jinja rendering of the shipped templates (templates/ in the repository, slurmddp.templates
once installed). Every value that reaches a shell goes through the ``sh`` filter, every value on an
``#SBATCH`` line through ``directive``."""

from __future__ import annotations

import re
import shlex
from importlib import resources
from pathlib import Path

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
    env.filters["directive"] = directive_quote
    return env


def render(name: str, **context: object) -> str:
    """Render the shipped template `name` with `context`."""
    return environment().get_template(name).render(**context)


class TemplateError(ValueError):
    """A user template cannot be read or rendered; the message names the file and the fault."""


def render_file(path: Path, **context: object) -> str:
    """Render a user's template file, sandboxed, with the same filters as the shipped ones."""
    try:
        text = path.read_text(encoding="utf-8")
        return environment().from_string(text).render(**context)
    except OSError as e:
        raise TemplateError(f"template {str(path)!r} cannot be read: {e.strerror}") from None
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"template {str(path)!r} line {e.lineno}: {e.message}") from None
    except (jinja2.UndefinedError, jinja2.sandbox.SecurityError) as e:
        raise TemplateError(f"template {str(path)!r}: {e}") from None


def shell_quote(value: object) -> str:
    """One shell word that reads back as exactly str(value): spaces, quotes, $() and newlines."""
    return shlex.quote(str(value))


# Words sbatch reads back unchanged on an #SBATCH line without quotes.
_PLAIN_DIRECTIVE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def directive_quote(value: object) -> str:
    """One word of an ``#SBATCH`` line that sbatch reads back as exactly str(value).

    sbatch splits directive lines itself, not through a shell: inside double quotes spaces, '#'
    and single quotes are kept, and a backslash escapes the next character (checked with sbatch
    22.05). A newline cannot be carried, since directives are read line by line: ValueError.
    """
    text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise ValueError(f"{text!r} cannot be written on an #SBATCH line: it holds a line break")
    if _PLAIN_DIRECTIVE_WORD.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _load_shipped(name: str) -> str | None:
    path = resources.files(TEMPLATE_PACKAGE) / name
    return path.read_text(encoding="utf-8") if path.is_file() else None

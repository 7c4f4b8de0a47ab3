"""Jinja rendering of the shipped templates (templates/ in the repository, slurmddp.templates
once installed). Every value that reaches a shell goes through the ``sh`` filter, every value on an
``#SBATCH`` line through ``directive``."""

from __future__ import annotations

import re
import shlex
import traceback
from importlib import resources
from pathlib import Path

import jinja2
import jinja2.sandbox

from slurmddp.errors import TemplateError

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



def render_file(path: Path, **context: object) -> str:
    """Render a user's template file, sandboxed, with the same filters as the shipped ones."""
    where = repr(str(path))
    try:
        template = environment().from_string(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TemplateError(f"template {where} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise TemplateError(f"template {where} cannot be read: it is not UTF-8 text ({e.reason} "
                            f"at byte {e.start})") from None  # fmt: skip
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"template {where} line {e.lineno}: {e.message}") from None
    try:
        return template.render(**context)
    except Exception as e:  # an undefined name, the sandbox, a failing filter or expression
        line = _template_line(e)
        if isinstance(e, jinja2.UndefinedError):
            what = f"{e}; its variables are {', '.join(sorted(context))}"
        elif isinstance(e, jinja2.sandbox.SecurityError):
            what = f"{e} (templates are sandboxed: use the variables and filters only)"
        else:
            what = f"{type(e).__name__}: {e}"
        raise TemplateError(f"template {where}{f' line {line}' if line else ''}: {what}") from None


def _template_line(e: BaseException) -> int | None:
    """The line of the template being rendered where `e` was raised (Jinja maps its frames)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
    return frames[-1].lineno if frames else None


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

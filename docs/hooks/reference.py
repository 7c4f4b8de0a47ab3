"""MkDocs hook: the generated pages' parts (``<!-- generated: NAME -->``) and the site's URL.

The references come from slurmddp.cli.reference, the URL ``--help`` links to from
slurmddp.links; the home page
says what the README says, from the README (its links made the site's).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from slurmddp import links
from slurmddp.cli import reference

README = Path(__file__).resolve().parents[2] / "README.md"


def readme() -> str:
    """The README from what slurmddp is on, without its developer's commands and docs pointer."""
    text = README.read_text(encoding="utf-8")
    text = text[text.index("slurmddp makes") :]
    text = re.sub(r"\n\*\*Documentation\*\*.*?\n\n", "\n", text, flags=re.S)
    return text.replace("](docs/", "](")


_GENERATED = {
    "cli": reference.cli_markdown,
    "environment": reference.environment_markdown,
    "readme": readme,
}
_MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.M)


def on_config(config: Any) -> Any:
    config.site_url = links.docs_url()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    # An unknown name fails the build: a page cannot ask for a reference that is not generated.
    return _MARKER.sub(lambda m: _GENERATED[m[1]](), markdown)

"""The documentation site's address, and the page each command's ``--help`` links to.

Apart from slurmddp.cli.reference (which generates the site's reference pages) so that the
runner, which every rank starts, builds its --help without importing the option table.
"""

from __future__ import annotations

import os

from slurmddp import protocol

__all__ = ["DOCS_URL", "PAGES", "docs_url", "help_link"]

# Where the site is published; a centre that hosts its own copy (compute nodes are often
# offline) sets $SLURMDDP_DOCS_URL, and every --help link follows it.
DOCS_URL = "https://slurmddp.readthedocs.io/en/latest/"

# The page that explains each command, relative to the site's root: its --help ends with it.
PAGES = {
    "slurmddp": "",
    "submit": "guide/submitting/",
    "template": "recipes/plain-srun/",
    "status": "guide/submitting/#following-a-job",
    "logs": "guide/submitting/#following-a-job",
    "cancel": "guide/submitting/#following-a-job",
    "report": "concepts/job-story/",
    "profiles": "recipes/centre-profiles/",
    "quickstart": "getting-started/",
    "doctor": "recipes/troubleshooting/",
    "run": "guide/running/",
}


def docs_url() -> str:
    """The site's root URL, ending in a slash."""
    url = os.environ.get(protocol.DOCS_URL_VAR) or DOCS_URL
    return url if url.endswith("/") else url + "/"


def help_link(command: str) -> str:
    """The closing lines of `command`'s --help: the page that explains it and its reference."""
    anchor = "slurmddp" if command == "slurmddp" else f"slurmddp-{command}"
    return (f"explained at: {docs_url()}{PAGES[command]}\n"
            f"every option: {docs_url()}reference/cli/#{anchor}")  # fmt: skip

"""The documentation site (mkdocs.yml, docs/) builds with --strict, and what it generates is whole.

The site is built once, as a user of a checkout would (``mkdocs build --strict``): no broken
link or anchor, no page left out of the navigation. Its references are then checked against the
code they come from, found independently of the generator: every option of every command
(walked from the parsers' subcommands, the runner's too), every ``SLURMDDP_*`` name in the
package's source, every public name pinned by tests/test_public_api.py. Every ``--help`` link
names a page and an anchor the site has. The runnable blocks of every page are
tests/test_recipes.py's.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmddp import links
from slurmddp.cli import build_parser, main, reference
from slurmddp.launch import runner
from tests.conftest import ROOT
from tests.test_public_api import PUBLIC


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # No bytecode beside the hook in the checkout; no advertisement of MkDocs' successor.
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1", "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                        str(ROOT / "mkdocs.yml"), "-d", str(out)], cwd=out, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


def page(site: Path, path: str) -> str:
    """The HTML of a page, by its URL path (``guide/submitting/``)."""
    return (site / path / "index.html").read_text(encoding="utf-8")


def text_of(html_text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", html_text))


def test_every_page_under_docs_is_built(site):
    for md in (ROOT / "docs").rglob("*.md"):
        rel = md.relative_to(ROOT / "docs").with_suffix("")
        url = rel.parent if rel.name in ("index", "README") else rel
        assert (site / url / "index.html").is_file(), md


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(anchor of its section in the CLI reference, parser) of every command."""
    parser, _ = build_parser()
    found = [("slurmddp", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"slurmddp-{name}", p) for name, p in action.choices.items()]
    return [*found, ("slurmddp-run", runner.build_parser())]  # `slurmddp run` parses its own


def _section(site: Path, anchor: str) -> str:
    return page(site, "reference/cli").split(f'id="{anchor}"', 1)[1].split("<h2", 1)[0]


def _rows(section: str) -> dict[str, list[str]]:
    """The cells of a reference table's rows, by each flag of the row's first cell."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", section, re.S):
        cells = [text_of(c).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
        for flag in re.findall(r"(?<![\w-])--?[\w-]+", cells[0] if cells else ""):
            rows[flag] = cells
    return rows


def test_every_option_of_every_command_has_its_row_in_the_cli_reference(site):
    missing = []
    for anchor, parser in _parsers():
        rows = _rows(_section(site, anchor))
        missing += [f"{anchor}: {flag}" for action in parser._actions
                    for flag in action.option_strings
                    if flag not in ("-h", "--help") and flag not in rows]  # fmt: skip
    assert not missing, f"the command-line reference lacks {missing}"


def test_every_job_option_has_its_default_key_and_check_in_its_row(site):
    from slurmddp.batch.spec import options

    rows = _rows(_section(site, "slurmddp-submit"))
    for opt in options.OPTIONS:
        _, _, default, key, check = rows[opt.flag]
        assert key == (opt.key if opt.config else "—"), opt.flag
        assert opt.default is None or options.format_value(opt.default) == default, opt.flag
        try:
            opt.check(object())
        except options.Invalid as e:
            assert f"must be {check}" == str(e), opt.flag
    assert rows["--nodes"][4] == 'an integer >= 1 or a range "MIN-MAX"'


def test_every_slurmddp_variable_of_the_package_is_in_the_environment_reference(site):
    env = text_of(page(site, "reference/environment"))
    used = set()
    # Files only: a checkout whose templates package was imported has a __pycache__ there.
    templates = [p for p in (ROOT / "templates").rglob("*") if p.is_file() and p.suffix != ".pyc"]
    for path in [*(ROOT / "slurmddp").rglob("*.py"), *templates]:
        used |= set(re.findall(r"\bSLURMDDP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(n for n in used if n not in env)
    assert not missing, f"the environment reference lacks {missing}"
    assert {name for _, name, _ in reference.variables()} >= used


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_is_in_the_api_reference(site, module):
    api = page(site, "reference/api")
    if all(_is_module(f"{module}.{n}") for n in PUBLIC[module]):
        return  # a package of modules (slurmddp.training): each has its own section
    assert f'id="{module}"' in api, module
    missing = [n for n in PUBLIC[module] if not n.startswith("_")
               and not _is_module(f"{module}.{n}") and f'id="{module}.{n}"' not in api]  # fmt: skip
    assert not missing, f"the API reference lacks {module}: {missing}"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a name inside a module: its parent is no package
        return False


@pytest.mark.parametrize("command", sorted(links.PAGES))
def test_every_help_links_to_a_page_and_anchor_the_site_has(site, command, capsys):
    for url in re.findall(r"https?://\S+", links.help_link(command)):
        path, _, anchor = url.removeprefix(links.DOCS_URL).partition("#")
        target = page(site, path.rstrip("/") or ".")
        assert not anchor or f'id="{anchor}"' in target, url
    # And the command's --help says it, each URL whole on its line.
    argv = {"slurmddp": ["--help"], "run": ["run", "--help"]}.get(command, [command, "--help"])
    with pytest.raises(SystemExit):
        main(argv)
    assert links.help_link(command) in capsys.readouterr().out


def test_a_centre_hosting_its_own_copy_gets_its_links(monkeypatch):
    monkeypatch.setenv("SLURMDDP_DOCS_URL", "https://docs.example.org/slurmddp")
    assert links.help_link("submit").startswith(
        "explained at: https://docs.example.org/slurmddp/guide/submitting/\n")


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 10 * 1024, len(readme.encode())
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, broken
    # Every page it links is in the site (a page outside the nav fails the strict build).
    assert all(link.startswith("docs/") for link in links if "://" not in link)

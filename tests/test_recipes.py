"""docs/ agrees with the code: every script and message a recipe (or any page of the site) shows
is what the real CLI prints for the command the page gives.

A page marks each block of program output with the command that produced it, and each input
file that command reads (a profile, a wrapper script) with its path::

    <!-- file: ~/.config/slurmddp/profiles.toml -->
    ```toml
    ...
    ```
    <!-- rendered: slurmddp template --nodes 4 --gpus-per-node 8 train.py --lr 0.1 -->
    ```bash
    #!/bin/bash
    ...
    ```

Each command runs as ``slurmddp`` (or ``python FILE``, a program a file block gave, for the
Python API) in a subprocess, in a fresh sandbox that looks like Alice's
machine: the project directory /home/alice/project (the commands' working directory, holding every
``*.py`` the command names), HOME /home/alice, the files marked earlier in the same recipe, and no
other configuration. A leading ``NAME=VALUE`` sets a variable; absolute paths in such values and
in ``file:`` markers are inside the sandbox. The interpreter the script names and the host name
are fixed, so nothing depends on this machine. The block must equal stdout and stderr together,
and the command must exit 0, or with the status its marker names for an error shown on purpose
(``<!-- rendered, exit 2: slurmddp template --sbatch-arg=--time=10 train.py -->``).

Regenerate the blocks after an intended change with
``SLURMDDP_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_recipes.py`` (as for the golden
files of tests/batch/script/test_sbatch.py), or ``.venv/bin/python -m tests.test_recipes --update``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RECIPES = DOCS / "recipes"
UPDATE = os.environ.get("SLURMDDP_UPDATE_GOLDEN") == "1"

HOME = "/home/alice"
PROJECT = f"{HOME}/project"
PYTHON = f"{PROJECT}/.venv/bin/python"  # what `sys.executable` is in the rendering CLI
HOST = "gpu001"  # what `socket.gethostname()` says there
# Its network, as doctor sees it: Ethernet and IPoIB; the node names resolve to the Ethernet.
INTERFACES = [("lo", "127.0.0.1"), ("eth0", "10.1.0.11"), ("ib0", "10.2.0.11")]
RESOLVES = {"gpu001": "10.1.0.11", "gpu002": "10.1.0.12", "gpu001-ib0": "10.2.0.11",
            "127.0.0.1": "127.0.0.1"}  # fmt: skip
# The real CLI, as the `slurmddp` console script runs it, with the machine-specific values fixed
# (the script names the interpreter that rendered it; doctor names its host and its network: a
# route to a node's own address leaves from that address).
BOOT = (
    "import socket, sys; "
    f"sys.executable = {PYTHON!r}; "
    f"socket.gethostname = lambda: {HOST!r}; "
    "import slurmddp.launch.network as net; "
    f"net.interfaces = lambda: [net.Interface(*i) for i in {INTERFACES!r}]; "
    f"net.resolve = {RESOLVES!r}.get; "
    f"net.route = {{a: a for _, a in {INTERFACES!r}}}.get; "
    "from slurmddp.cli import main; "
    "sys.exit(main())"
)

_MARKER = re.compile(r"<!-- (rendered|file)(?:, exit ([0-9]+))?: (.+?) -->")
_SCRIPT_ARG = re.compile(r"[\w.-][\w./-]*\.py")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_EXAMPLE = re.compile(r"\bexamples/[\w./-]+\.py\b")


@dataclasses.dataclass(frozen=True)
class Block:
    """A marked fenced block: `kind` is rendered or file, `arg` the command or the path."""

    kind: str
    arg: str
    status: int  # the exit status the command must have (`<!-- rendered, exit 2: ... -->`)
    line: int  # 1-based line of the marker, for messages
    start: int  # index of the block's first content line
    end: int  # index of its closing fence
    content: str


def blocks(text: str, name: str = "") -> list[Block]:
    """Every marked block of a recipe, in document order."""
    lines = text.split("\n")
    found = []
    for i, line in enumerate(lines):
        m = _MARKER.fullmatch(line.strip())
        if m is None:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or not lines[j].startswith("```"):
            raise AssertionError(f"{name}:{i + 1}: a fenced block must follow {line.strip()!r}")
        end = next((k for k in range(j + 1, len(lines)) if lines[k] == "```"), None)
        if end is None:
            raise AssertionError(f"{name}:{j + 1}: the fenced block is never closed")
        content = "\n".join(lines[j + 1 : end])
        found.append(Block(m[1], m[3].strip(), int(m[2] or 0), i + 1, j + 1, end,
                           content + "\n" * (end > j + 1)))  # fmt: skip
    return found


def replace_blocks(text: str, new: dict[int, str]) -> str:
    """`text` with the content of the blocks starting at these line indexes replaced."""
    lines = text.split("\n")
    for block in sorted(blocks(text), key=lambda b: b.start, reverse=True):
        if block.start in new:
            content = new[block.start].rstrip("\n")
            lines[block.start : block.end] = content.split("\n") if content else []
    return "\n".join(lines)


class Sandbox:
    """Alice's machine under a temporary root: her home, her project, nothing else."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.project = self.path(PROJECT)
        self.project.mkdir(parents=True)

    def path(self, text: str) -> Path:
        """Where a path of a recipe lives in the sandbox (relative ones: in the project)."""
        if text == "~" or text.startswith("~/"):
            text = HOME + text[1:]
        if text.startswith("/"):
            return self.root / text.lstrip("/")
        return self.project / text

    def write(self, where: str, content: str) -> None:
        path = self.path(where)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        if content.startswith("#!"):
            path.chmod(0o755)

    def run(self, command: str) -> tuple[str, int]:
        """stdout and stderr of one recipe command, paths as on Alice's machine; exit status."""
        words = shlex.split(command)
        # slurmddp as installed in this interpreter's environment, as on Alice's machine.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.path(HOME)),
               "LANG": "C.UTF-8"}  # fmt: skip
        while words and _ASSIGNMENT.match(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = str(self.path(value)) if value.startswith(("/", "~/")) else value
        if words[:1] == ["python"]:
            # A Python program the recipe gave in a file block, run for real (local jobs only:
            # no cluster here). The jobs' ranks need no more than the CLI's threads.
            argv = [sys.executable, *words[1:]]
            env["OMP_NUM_THREADS"] = "1"
        else:
            assert words[:1] == ["slurmddp"], f"a recipe command runs slurmddp or python, not "\
                                              f"{command!r}"  # fmt: skip
            for arg in words[1:]:
                if _SCRIPT_ARG.fullmatch(arg) and not self.path(arg).exists():
                    self.write(arg, "")  # the CLI checks that the script exists, nothing more
            argv = [sys.executable, "-c", BOOT, *words[1:]]
        r = subprocess.run(argv, cwd=self.project, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)  # fmt: skip
        out = r.stdout.replace(str(self.root), "").rstrip("\n")
        return (out + "\n" if out else ""), r.returncode  # the text as a fenced block holds it


def render(text: str, name: str) -> dict[int, tuple[str, int]]:
    """What each rendered block of a recipe should hold, and the command's exit status, by the
    index of the block's first line."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="slurmddp-recipe-") as tmp:
        sandbox = Sandbox(Path(tmp))
        for block in blocks(text, name):
            if block.kind == "file":
                sandbox.write(block.arg, block.content)
            else:
                out[block.start] = sandbox.run(block.arg)
    return out


def recipe_files() -> list[Path]:
    """Every page of the site: a block marked runnable is checked wherever it is."""
    return sorted(DOCS.rglob("*.md"))


def recipe_ids() -> list[str]:
    return [str(p.relative_to(DOCS)) for p in recipe_files()]


def visible(text: str) -> str:
    """The text a reader sees, markers removed, continuation lines joined, spaces collapsed."""
    text = _MARKER.sub("", text).replace("\\\n", " ")
    return "\n".join(" ".join(line.split()) for line in text.split("\n"))


def update(path: Path) -> bool:
    """Rewrite the rendered blocks of one recipe; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    new = replace_blocks(text, {k: v[0] for k, v in render(text, path.name).items()})
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


# --- tests --------------------------------------------------------------------------------------


def test_there_are_recipes_and_an_index():
    names = [p.name for p in RECIPES.glob("*.md")]
    assert "README.md" in names and len(names) > 1, names
    index = (RECIPES / "README.md").read_text(encoding="utf-8")
    missing = [n for n in names if n != "README.md" and f"({n})" not in index]
    assert not missing, f"docs/recipes/README.md does not link {missing}"


@pytest.mark.parametrize("name", recipe_ids())
@pytest.mark.ranks
def test_rendered_blocks_are_what_the_cli_prints(name):
    path = DOCS / name
    if UPDATE:
        update(path)
    text = path.read_text(encoding="utf-8")
    expected = render(text, name)
    stale = []
    for block in (b for b in blocks(text, name) if b.kind == "rendered"):
        output, status = expected[block.start]
        # An error shown on purpose says so in its marker: no example fails unnoticed.
        assert status == block.status, (
            f"{name}:{block.line}: {block.arg!r} exits with {status}, not {block.status}:\n{output}"
        )
        if block.content != output:
            stale.append(f"line {block.line}: {block.arg}")
    assert not stale, (
        f"{name}: these blocks differ from what the command prints now: {stale}; if the change is "
        "intended, rerun with SLURMDDP_UPDATE_GOLDEN=1 (or python -m tests.test_recipes --update)"
    )


@pytest.mark.parametrize("name", [n for n in recipe_ids()
                                  if n.startswith("recipes/") and n != "recipes/README.md"])
def test_every_recipe_shows_a_rendered_block_for_a_command_it_gives(name):
    text = (DOCS / name).read_text(encoding="utf-8")
    commands = [b.arg for b in blocks(text, name) if b.kind == "rendered"]
    assert commands, f"{name} has no <!-- rendered: ... --> block"
    shown = visible(text)
    for command in commands:
        # The reader is told the command: as written, or as `submit` with the same options.
        forms = {command, command.replace("slurmddp template ", "slurmddp submit ", 1)}
        assert any(" ".join(f.split()) in shown for f in forms), (
            f"{name}: the command {command!r} of a rendered block is not shown to the reader"
        )


@pytest.mark.parametrize("name", recipe_ids())
def test_every_example_a_recipe_names_exists(name):
    text = (DOCS / name).read_text(encoding="utf-8")
    missing = sorted({m for m in _EXAMPLE.findall(text) if not (ROOT / m).is_file()})
    assert not missing, f"{name} names {missing}, which do not exist"


def test_blocks_are_found_and_replaced():
    text = (
        "a\n<!-- rendered: slurmddp x -->\n\n```bash\nold\n```\n<!-- file: f -->\n```\n```\n"
        "<!-- rendered, exit 2: slurmddp y -->\n```text\nerror\n```\n"
    )
    found = blocks(text)
    assert [(b.kind, b.arg, b.status, b.content) for b in found] == [
        ("rendered", "slurmddp x", 0, "old\n"), ("file", "f", 0, ""),
        ("rendered", "slurmddp y", 2, "error\n"),
    ]  # fmt: skip
    assert replace_blocks(text, {found[0].start: "new\nlines\n"}) == text.replace(
        "old", "new\nlines"
    )


def main(argv: list[str]) -> int:
    if argv != ["--update"]:
        print("usage: python -m tests.test_recipes --update", file=sys.stderr)
        return 2
    for path in recipe_files():
        if update(path):
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

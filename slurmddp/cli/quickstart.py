"""``slurmddp quickstart [DIR]``: a complete train.py to start from, the README's loop filled in."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from slurmddp.errors import fail

NAME = "train.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", nargs="?", default=".",
                   help="where to write train.py (default: here)")


def script() -> str:
    """The shipped train.py (templates/train.py in a checkout)."""
    return resources.files("slurmddp.templates").joinpath(NAME).read_text(encoding="utf-8")


def main(opts: argparse.Namespace) -> int:
    target = Path(opts.directory) / NAME
    if not target.parent.is_dir():
        fail(f"{target.parent} is not a directory: give an existing one", prog=opts.prog)
    try:
        with target.open("x", encoding="utf-8") as f:  # never over a file of the user's
            f.write(script())
    except FileExistsError:
        fail(f"{target} exists: move it away, or give another directory", prog=opts.prog)
    except OSError as e:
        fail(f"cannot write {target}: {e.strerror}", prog=opts.prog, status=1)
    print(f"wrote {target}; try it here, stopped twice as a preemption would:\n"
          f"  slurmddp submit --local --follow --nodes 2 --ntasks-per-node 2 "
          f"--local-signal-after 40steps,80steps {target}")  # fmt: skip
    return 0

"""CLI latency: whole ``slurmddp`` processes against ``python -c pass`` and ``import torch``.

    python -m benchmarks.cli_latency [--repeats 10]

`slurmddp submit --dry-run` renders a batch script without importing torch; its cost should be
near an empty interpreter's and far below torch's import.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.table import Row, alternate, report, timed

ROOT = Path(__file__).resolve().parent.parent


def run(repeats: int = 10) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
        env = os.environ | {"XDG_CONFIG_HOME": work, "XDG_STATE_HOME": work}
        env.pop("SLURMDDP_PROFILES", None)

        def process(*argv: str):
            return lambda: timed(lambda: subprocess.run(
                [sys.executable, *argv], env=env, cwd=work, check=True,
                stdout=subprocess.DEVNULL))  # fmt: skip

        train = str(ROOT / "examples" / "ddp_train.py")
        submit = ["-m", "slurmddp", "submit", "--dry-run", "--nodes", "4", "--gpus-per-node", "8"]
        medians = alternate(
            {
                "pass": process("-c", "pass"),
                "torch": process("-c", "import torch"),
                "dry-run": process(*submit, train, "--lr", "0.1"),
                "help": process("-m", "slurmddp", "--help"),
            },
            repeats,
        )
    return [
        Row("cli", "submit --dry-run", medians["dry-run"], medians["pass"], "s",
            "python -c pass", "< 0.25 s"),
        Row("cli", "submit --dry-run", medians["dry-run"], medians["torch"], "s",
            "python -c 'import torch'", "<= 0.15"),
        Row("cli", "--help", medians["help"], medians["torch"], "s",
            "python -c 'import torch'", "<= 0.15"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cli_latency")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    rows = run(opts.repeats)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

"""Steady-state overhead of the stop protocol and the hang watchdog: steps per second of a small
DDP loop (2 ranks, gloo) under ``python -m slurmddp.run`` calling ``should_stop()`` every step,
with the hang watchdog on as ``slurmddp submit`` has it (torch's flight recorder included),
against the same loop started with env:// by hand and no check; and the watchdog alone, at its
shortest period (1 s: each rank publishes its count and measures its busy time a step for the
slow-node pace every second), against the same loop with the watchdog off.

    python -m benchmarks.training_overhead [--steps 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.table import Row, alternate, report

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "steps.py")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps_per_second(command: list[str], **extra: str) -> float:
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    base |= extra
    procs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                         env=base | {"RANK": str(r), "WORLD_SIZE": str(WORLD),
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                     "OMP_NUM_THREADS": "1"})
        for r in range(WORLD)
    ]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the training loop failed: {outs}")
    return float(outs[0].split("STEPS_PER_S ", 1)[1])


def run(steps: int = 2000, repeats: int = 5) -> list[Row]:
    n = str(steps)
    # The watchdog monitors may still be leaving as the directory goes.
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-hang-",
                                     ignore_cleanup_errors=True) as hang_dir:
        ours = [sys.executable, "-m", "slurmddp.run", PROGRAM, "--steps", n, "--check"]
        medians = alternate(
            {
                "ours": lambda: _steps_per_second(ours, SLURMDDP_HANG_DIR=hang_dir),
                "plain": lambda: _steps_per_second([sys.executable, PROGRAM, "--steps", n]),
                "watchdog every second": lambda: _steps_per_second(
                    ours, SLURMDDP_HANG_DIR=hang_dir, SLURMDDP_HANG_TIMEOUT="10"),
                "no watchdog": lambda: _steps_per_second(ours, SLURMDDP_HANG_TIMEOUT="0"),
            },
            repeats,
        )
    return [Row("training", "steps/s, should_stop() every step, hang watchdog on", medians["ours"],
                medians["plain"], "steps/s", "env:// by hand, no check", ">= 0.98"),
            Row("training", "steps/s, the hang watchdog and its slow-node pace every second",
                medians["watchdog every second"], medians["no watchdog"], "steps/s",
                "the same loop, no watchdog", ">= 0.99")]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.training_overhead")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    rows = run(opts.steps, opts.repeats)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

"""The local Slurm cluster, for the benchmarks that run on it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cluster_env() -> dict[str, str]:
    """The environment of the local cluster's clients (started if it is not running)."""
    script = ROOT / "scripts" / "slurm-cluster"
    subprocess.run([str(script), "up"], check=True, capture_output=True)
    shown = subprocess.run([str(script), "env"], check=True, capture_output=True, text=True).stdout
    line = next(line for line in shown.splitlines() if line.startswith("export SLURM_CONF="))
    conf = line.split("=", 1)[1].strip().strip("'\"")
    return os.environ | {"SLURM_CONF": conf}

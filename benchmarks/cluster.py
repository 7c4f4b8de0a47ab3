"""The local Slurm cluster, for the benchmarks that run on it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cluster_env() -> dict[str, str]:
    """The environment of the local cluster's clients (started if it is not running): its
    SLURM_CONF, and on Slurm 24.11 ($SLURMDDP_SLURM) the PATH of its commands."""
    script = ROOT / "scripts" / "slurm-cluster"
    subprocess.run([str(script), "up"], check=True, capture_output=True)
    shown = subprocess.run(["bash", "-c", f'eval "$({script} env)" && printf "%s\\n%s" '
                            '"$SLURM_CONF" "$PATH"'], check=True, capture_output=True,
                           text=True).stdout  # fmt: skip
    conf, path = shown.split("\n", 1)
    return os.environ | {"SLURM_CONF": conf, "PATH": path}

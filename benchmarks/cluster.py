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


def job_processes(job: str, node: str) -> dict[int, dict[str, str]]:
    """{pid: environment} of the job's processes on `node`, Slurm's own (slurmstepd) aside."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "environ").read_bytes().decode(errors="replace")
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        env = dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)
        if comm != "slurmstepd" and env.get("SLURM_JOB_ID") == job and (
                env.get("SLURMD_NODENAME") == node):  # fmt: skip
            found[int(proc.name)] = env
    return found

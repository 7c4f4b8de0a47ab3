"""CPU threads per rank under srun: steps per second of a 2 nodes x 2 ranks DDP loop (gloo) on
the local cluster, started by ``python -m slurmddp.run`` (which sets each rank's intra-op threads,
`slurmddp.rank.placement.cpu_threads`) against the same loop with env:// set by hand and torch's
default threads, and under ``srun torchrun`` (which sets OMP_NUM_THREADS=1 itself).

    python -m benchmarks.cpu_threads [--steps 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.cluster import cluster_env
from benchmarks.table import Row, alternate, report

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "steps.py")
NODES, PER_NODE = 2, 2  # the benchmark's; the test takes a smaller step


def _commands(steps: int, port: int, nodes: int = NODES,
              per_node: int = PER_NODE) -> dict[str, list[str]]:  # fmt: skip
    py, n = sys.executable, str(steps)
    # n1 in the step: MASTER_ADDR and the endpoint name it, and each node is a host of its own.
    srun = ["srun", "--kill-on-bad-exit=1", "-p", "debug", f"-N{nodes}", f"--nodelist=n[1-{nodes}]"]
    by_hand = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
               f"MASTER_ADDR=n1 MASTER_PORT={port} exec {py} {PROGRAM} --steps {n}")  # fmt: skip
    return {
        "ours": [*srun, f"--ntasks-per-node={per_node}", py, "-m", "slurmddp.run", PROGRAM,
                 "--steps", n],
        "default": [*srun, f"--ntasks-per-node={per_node}", "bash", "-c", by_hand],
        "torchrun": [*srun, "--ntasks-per-node=1", py, "-m", "torch.distributed.run",
                     f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=n1:{port + 1}", f"--rdzv-id=threads{port}", PROGRAM,
                     "--steps", n],
    }  # fmt: skip


def _steps_per_second(command: list[str], env: dict[str, str]) -> float:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode or "STEPS_PER_S " not in done.stdout:
        raise RuntimeError(f"{command[:8]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(done.stdout.split("STEPS_PER_S ", 1)[1].split()[0])


def run(steps: int = 300, repeats: int = 3, nodes: int = NODES,
        per_node: int = PER_NODE) -> list[Row]:  # fmt: skip
    env = {k: v for k, v in cluster_env().items() if k != "OMP_NUM_THREADS"}
    commands = _commands(steps, 24000 + os.getpid() % 1000 * 2, nodes, per_node)
    medians = alternate({name: (lambda c=c: _steps_per_second(c, env))
                         for name, c in commands.items()}, repeats)  # fmt: skip
    metric = f"steps/s, {nodes} nodes x {per_node} ranks under srun, no OMP_NUM_THREADS set"
    return [
        Row("threads", metric, medians["ours"], medians["default"], "steps/s",
            "env:// by hand, torch's default threads", "> 1"),
        Row("threads", "same", medians["ours"], medians["torchrun"], "steps/s",
            "srun torchrun (OMP_NUM_THREADS=1)"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_threads")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    report(run(opts.steps, opts.repeats), opts.json)


if __name__ == "__main__":
    main()

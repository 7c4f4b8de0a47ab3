"""Time to first collective on the local Slurm cluster: 4 nodes x 2 ranks, gloo.

    python -m benchmarks.first_collective [--repeats 5]

Inside one allocation (``salloc -N4 --ntasks-per-node=2``), each contender starts the same
probe (programs/probe.py: init_process_group("gloo") with env://, one all_reduce) with ``srun``;
the time is from just before ``srun`` starts to the moment the last rank's all_reduce returned
(every node runs on this machine, so one clock serves all ranks). Contenders, alternated:

- ours: ``srun python -m slurmddp.run probe.py``
- floor: ``srun bash -c 'RANK=$SLURM_PROCID ... exec python probe.py'``, env:// set by hand
- torchrun: ``srun --ntasks-per-node=1 torchrun --nproc-per-node=2 --rdzv-backend=c10d ...``
- submitit: ``srun python submitit_probe.py``, submitit's TorchDistributedEnvironment().export()

Most of every time is eight processes importing torch on this machine's two cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster import cluster_env
from benchmarks.table import Row, alternate, report
from slurmddp.rank.env import derive_port, port_range
from slurmddp.rank.hostlist import expand

PROGRAMS = Path(__file__).resolve().parent / "programs"
PROBE = str(PROGRAMS / "probe.py")
NODES, PER_NODE = 4, 2  # the benchmark's; the tests take a smaller allocation


def _allocation(nodes: int, per_node: int) -> list[str]:
    return ["salloc", f"-N{nodes}", f"--ntasks-per-node={per_node}", "--partition=debug",
            "--time=30", "--quiet"]  # fmt: skip


def _commands(head: str, port: int, nodes: int, per_node: int) -> dict[str, list[str]]:
    """Each contender's command; `head` is the allocation's first node."""
    py = sys.executable
    srun = ["srun", "--kill-on-bad-exit=1"]
    by_hand = (f"RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID "
               f"MASTER_ADDR={head} MASTER_PORT={port} exec {py} {PROBE}")  # fmt: skip
    return {
        "ours": [*srun, py, "-m", "slurmddp.run", PROBE],
        "floor": [*srun, "bash", "-c", by_hand],
        "torchrun": [*srun, f"--ntasks={nodes}", "--ntasks-per-node=1", py, "-m",
                     "torch.distributed.run", f"--nnodes={nodes}",
                     f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={head}:{port}", f"--rdzv-id=bench{port}", PROBE],
        "submitit": [*srun, py, str(PROGRAMS / "submitit_probe.py")],
    }  # fmt: skip


def _first_collective(command: list[str], env: dict[str, str], world: int) -> float:
    """Seconds from starting `command` to the last rank's first all_reduce returning."""
    start = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln.split() for ln in done.stdout.splitlines() if ln.startswith("FIRST_COLLECTIVE ")]
    if done.returncode or len(lines) != world or {ln[3] for ln in lines} != {str(world)}:
        raise RuntimeError(f"{command[:6]} failed ({done.returncode}): {done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    return max(float(ln[1]) for ln in lines) - start


def measure(repeats: int) -> dict[str, float]:
    """Inside the allocation: the median time of each contender, alternated."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    head = expand(env["SLURM_JOB_NODELIST"])[0]
    nodes, per_node = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_NTASKS_PER_NODE"])
    # The allocation's own ports, as slurmddp derives its steps': no other cluster's job (scripts/
    # test runs three at once here) nor a job of this one running beside it takes them.
    job, in_range = int(env["SLURM_JOB_ID"]), port_range(env)
    ports = (derive_port(job, step, in_range) for step in itertools.count())

    def contender(name: str):
        return lambda: _first_collective(_commands(head, next(ports), nodes, per_node)[name], env,
                                         nodes * per_node)  # fmt: skip

    return alternate({name: contender(name) for name in _commands(head, 0, nodes, per_node)},
                     repeats)  # fmt: skip


def run(repeats: int = 5, nodes: int = NODES, per_node: int = PER_NODE) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
        out = Path(work) / "medians.json"
        subprocess.run([*_allocation(nodes, per_node), sys.executable, "-m",
                        "benchmarks.first_collective",
                        "--in-allocation", str(out), "--repeats", str(repeats)],
                       env=cluster_env(), check=True)  # fmt: skip
        medians = json.loads(out.read_text())
    metric = f"time to first collective, {nodes}x{per_node} ranks"
    return [
        Row("startup", metric, medians["ours"], medians["floor"], "s", "env:// by hand",
            "<= 1.05"),
        Row("startup", metric, medians["ours"], medians["torchrun"], "s",
            "srun torchrun, c10d", "<= 0.7"),
        Row("startup", metric, medians["ours"], medians["submitit"], "s",
            "submitit TorchDistributedEnvironment"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_collective")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    p.add_argument("--in-allocation", type=Path, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.in_allocation:
        opts.in_allocation.write_text(json.dumps(measure(opts.repeats)))
        return
    report(run(opts.repeats), opts.json)


if __name__ == "__main__":
    main()

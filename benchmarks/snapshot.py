"""Snapshots (slurmddp.checkpoint.snapshots): what they cost a training step, and what they save
when a node is lost.

    python -m benchmarks.snapshot [--repeats 3] [--no-cluster] [--memory]

- **Cost**: the training benchmark's DDP loop (benchmarks/programs/snapshot_steps.py, 2 ranks
  on 2 emulated nodes, gloo) with `Checkpointer.snapshot` every step, and every 10 steps,
  against the same loop with no snapshot; then at a 1 GiB state (5 layers of 8192, SGD: the
  parameters are the state; up to 8 GiB of stores on this one host), every step within the
  default budget (100 steps) and every step whatever it costs (`large_rows`).
  On this machine the two ranks take both cores: what a snapshot does in the background (its
  checksum, its write and its exchange with the other node) is taken from training, where a GPU
  node would have idle cores for it.
- **Memory**: the same DDP loop (0.5 MiB a rank, `snapshot_keep=2`) on 2 emulated nodes of 1,
  2 and 4 ranks each, a snapshot every step: the bytes each node's store holds after the last
  one, against 1 rank a node (flat: a node keeps one copy of what its ranks hold alike, and each
  rank's own part), and as each rank kept its whole state before (`--no-share`). Bytes, not
  time: one run each (`--memory` runs these rows alone).
- **A node lost** (local cluster, torchrun, 2 nodes x 2 workers and a spare, examples/
  resumable_train.py at 0.1 s a step): every process of a working node killed at step 70 or
  so (ten past a durable checkpoint of the baseline's); the steps of work lost (the last step
  logged before the loss minus the step resumed at) and the time to training again, with a
  snapshot every step against durable checkpoints every 20 steps (what a run had before); and
  the part of that time the shards' fetch took.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.table import Row, alternate, report

PROGRAM = str(Path(__file__).resolve().parent / "programs" / "snapshot_steps.py")
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(args: tuple[str, ...], nodes: list[str]) -> list[str]:
    """snapshot_steps.py at len(nodes) ranks, rank r on emulated node nodes[r]; each rank's
    stdout."""
    port = str(_free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "OMPI_", "PMI"))}
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-shm-", dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:  # fmt: skip
        procs = [
            subprocess.Popen([sys.executable, "-m", "slurmddp.run", PROGRAM, *args,
                              "--checkpoint-dir", work],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=base | {"RANK": str(r), "WORLD_SIZE": str(len(nodes)),
                                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                         "OMP_NUM_THREADS": "1", "SLURMD_NODENAME": node,
                                         "SLURMDDP_SNAPSHOT_DIR": shm})
            for r, node in enumerate(nodes)
        ]  # fmt: skip
        outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the training loop failed: {[err[-2000:] for _, err in outs]}")
    return [out for out, _ in outs]


def _steps_per_second(*args: str, ranks: int = 2) -> float:
    """Rank 0's steps per second; the snapshot interval it ended with goes to `INTERVALS`."""
    outs = _run_ranks(args, [f"n{r + 1}" for r in range(ranks)])
    printed = dict(line.split(" ", 1) for line in outs[0].splitlines() if " " in line)
    INTERVALS.setdefault(args, []).append(int(printed["INTERVAL"]))
    return float(printed["STEPS_PER_S"])


INTERVALS: dict[tuple[str, ...], list[int]] = {}
LABEL = "no snapshot"
NO_BUDGET = ("--budget", "none")


def _cost_rows(where: str, rate: Callable[..., float], repeats: int, n: str) -> list[Row]:
    """Every step with the default budget, every step and every 10th whatever they cost,
    against none."""
    paced = ("--steps", n, "--snapshot-every", "1")
    INTERVALS.clear()
    got = alternate({
        "paced": lambda: rate(*paced),
        "every": lambda: rate("--steps", n, "--snapshot-every", "1", *NO_BUDGET),
        "tenth": lambda: rate("--steps", n, "--snapshot-every", "10", *NO_BUDGET),
        "none": lambda: rate("--steps", n, "--snapshot-every", "0"),
    }, repeats)  # fmt: skip
    spacing = statistics.median(next(v for k, v in INTERVALS.items() if k[-len(paced):] == paced))
    return [
        Row("snapshot", f"steps/s, snapshot_every=1 within the default budget (2%), {where}",
            got["paced"], got["none"], "steps/s", LABEL, ">= 0.97"),
        Row("snapshot", "the interval it settled at (steps between snapshots)", spacing, None,
            "steps"),
        Row("snapshot", "steps/s, a snapshot every step whatever it costs (snapshot_budget=None)",
            got["every"], got["none"], "steps/s", LABEL),
        Row("snapshot", "steps/s, a snapshot every 10 steps whatever it costs", got["tenth"],
            got["none"], "steps/s", LABEL),
    ]  # fmt: skip


def cost(repeats: int, steps: int = 2000, large: bool = True, ranks: int = 2) -> list[Row]:
    """The rows of what a snapshot costs; `large`: also at a 1 GiB state (`large_rows`);
    `ranks`: the benchmark's 2, each on its emulated node (1: the same rows, no peer to send a
    snapshot's replica to)."""

    def rate(*args: str) -> float:
        return _steps_per_second(*args, ranks=ranks)

    rows = _cost_rows(f"0.5 MiB a rank, {ranks} rank{'s' * (ranks > 1)} on {ranks} emulated "
                      f"node{'s' * (ranks > 1)}", rate, repeats, str(steps))  # fmt: skip
    return rows + (large_rows(1) if large else [])


def large_rows(repeats: int, steps: int = 100) -> list[Row]:
    """At a 1 GiB state (5 layers of 8192), 2 ranks: `steps` steps within the default budget
    (of seconds each here: the budget spaces the snapshots tens of steps apart, so a run needs
    about a hundred steps to take a few), a snapshot every step whatever it costs, none (about
    10 minutes a repeat on this machine)."""
    big = ["--width", "8192", "--layers", "5", "--warmup", "2"]
    INTERVALS.clear()
    gib = alternate({
        "paced": lambda: _steps_per_second(*big, "--steps", str(steps), "--snapshot-every", "1"),
        "every": lambda: _steps_per_second(*big, "--steps", "5", "--snapshot-every", "1",
                                           *NO_BUDGET),
        "none": lambda: _steps_per_second(*big, "--steps", str(steps), "--snapshot-every", "0"),
    }, repeats)  # fmt: skip
    spacing = statistics.median(v for k, vs in INTERVALS.items() if "--budget" not in k
                                and k[-1] == "1" for v in vs)  # fmt: skip
    return [
        Row("snapshot", "steps/s at a 1 GiB state, snapshot_every=1 within the default budget",
            gib["paced"], gib["none"], "steps/s", LABEL, ">= 0.97"),
        Row("snapshot", "the interval it settled at, at 1 GiB (steps between snapshots)",
            spacing, None, "steps"),
        Row("snapshot", "steps/s, a snapshot every step at a 1 GiB state, whatever it costs",
            gib["every"], gib["none"], "steps/s", LABEL),
    ]  # fmt: skip


def store_bytes(per_node: int, share: bool = True, steps: int = 5) -> float:
    """The largest of the bytes each of 2 emulated nodes' stores holds after `steps` steps with a
    snapshot each (`per_node` ranks a node)."""
    args = ("--steps", str(steps), "--warmup", "2", "--snapshot-every", "1", *NO_BUDGET,
            "--report-store", *(() if share else ("--no-share",)))  # fmt: skip
    nodes = [f"n{r // per_node + 1}" for r in range(2 * per_node)]
    held = {line.split()[1]: int(line.split()[2]) for out in _run_ranks(args, nodes)
            for line in out.splitlines() if line.startswith("STORE ")}  # fmt: skip
    if set(held) != {"n1", "n2"}:
        raise RuntimeError(f"the stores were not reported: {held}")
    return float(max(held.values()))


def memory(per_node: tuple[int, ...] = (1, 2, 4)) -> list[Row]:
    """Bytes a node's store holds at each number of ranks a node, against 1 rank a node; and as
    each rank kept its whole state."""
    mib = 1 << 20
    shared = {k: store_bytes(k) / mib for k in per_node}
    whole = {k: store_bytes(k, share=False) / mib for k in per_node if k > 1}
    one = shared[per_node[0]]
    label = f"{per_node[0]} rank{'s' * (per_node[0] > 1)} a node"
    rows = [Row("snapshot", f"MiB a node's store holds, {per_node[0]} rank"
                f"{'s' * (per_node[0] > 1)} a node (0.5 MiB a rank, snapshot_keep=2, 2 emulated "
                "nodes)", one, None, "MiB")]  # fmt: skip
    for k in per_node[1:]:
        rows += [
            Row("snapshot", f"same, {k} ranks a node (one copy of what they hold alike, each "
                "rank's own part beside it)", shared[k], one, "MiB", label, "flat"),
            Row("snapshot", f"same, {k} ranks a node, each rank keeping its whole state "
                "(before)", whole[k], one, "MiB", label),
        ]  # fmt: skip
    return rows


def one_loss(env: dict[str, str], work: Path, *, snapshots: bool) -> dict[str, float]:
    """A node's processes killed once the training passed step 70: {"lost" (steps), "back" (s),
    "fetch" (s), "interval" (the steps between snapshots then, within the default budget)}."""
    from benchmarks.cluster import job_processes, lose_node
    from benchmarks.preemption_turnaround import _wait

    extra = ["--snapshot-every", "1", "--save-every", "100000"] if snapshots else [
        "--save-every", "20"]  # fmt: skip
    submitted = subprocess.run(
        [sys.executable, "-m", "slurmddp", "submit", "--json", "--partition", "debug",
         "--nodes", "2", "--spare-nodes", "1", "--ntasks-per-node", "2", "--launcher", "torchrun",
         "--max-restarts", "3", "--output", str(work / "jobs"), "--env", "OMP_NUM_THREADS=1",
         "--env", f"SLURMDDP_SNAPSHOT_DIR={work / 'shm'}",
         str(ROOT / "examples" / "resumable_train.py"), "--steps", "100000", "--step-time",
         "0.1", "--log-every", "1", *extra, "--checkpoint-dir", str(work / "ckpt")],
        env=env | {"XDG_STATE_HOME": str(work / "state")}, cwd=work, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    job = re.search(r'"job_id": "(\d+)"', submitted).group(1)  # type: ignore[union-attr]

    def logs() -> list[str]:
        return [p.read_text(errors="replace") for p in (work / "jobs" / job).glob("node-*.log")]

    try:
        _wait(lambda: "] step 70 " in "".join(logs()), 240, "training")  # 10 past a checkpoint
        nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], env=env,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        nodes = subprocess.run(["scontrol", "show", "hostnames", nodes], env=env,
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        conf = env["SLURM_CONF"]
        lost = next(n for n in nodes[1:]
                    if any("RANK" in e for e in job_processes(job, n, conf).values()))  # fmt: skip
        lose_node(job, lost, conf)
        lost_at = time.time()
        _wait(lambda: "resumed from" in "".join(logs()), 400, "resumed run")
        back = time.time() - lost_at
        before = max(int(n) for text in logs() for n in re.findall(
            r"\] step (\d+) loss", text.split("resumed from")[0]))  # fmt: skip
        at = int(re.search(r"resumed from \S+ at step (\d+)", "".join(logs())).group(1))  # type: ignore[union-attr]
        fetched = re.search(r"fetched from peers \(.*?\) in ([\d.]+) s", "".join(logs()))
        spacing = re.findall(rf"\] step {before} loss \S+ snapshots every (\d+)", "".join(logs()))
        return {"lost": before - at, "back": back,
                "fetch": float(fetched.group(1)) if fetched else 0.0,
                "interval": max((float(n) for n in spacing), default=0.0)}  # fmt: skip
    finally:
        subprocess.run(["scancel", job], env=env)
        _wait(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env,
                                         capture_output=True, text=True).stdout.strip(),
              180, "end of the job")  # fmt: skip


def node_lost(repeats: int) -> list[Row]:
    from benchmarks.cluster import cluster_env

    env = cluster_env()
    samples: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(repeats):
        for snapshots in (True, False):
            with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
                samples[snapshots].append(one_loss(env, Path(work), snapshots=snapshots))

    def median(snapshots: bool, key: str) -> float:
        return statistics.median(s[key] for s in samples[snapshots])

    label = "durable checkpoints every 20 steps"
    return [
        Row("snapshot", "steps of work lost when a node's processes are killed (spare in place)",
            median(True, "lost"), median(False, "lost"), "steps", label, "<= the interval"),
        Row("snapshot", "the interval then (snapshot_every=1 within the default budget)",
            median(True, "interval"), None, "steps"),
        Row("snapshot", "node's processes lost -> training again, with snapshots",
            median(True, "back"), median(False, "back"), "s", label, "<= 15 s"),
        Row("snapshot", "of which: fetching the lost node's shards from its replicas",
            median(True, "fetch"), None, "s"),
    ]  # fmt: skip


def cost_on_gpu(repeats: int, steps: int = 1000) -> list[Row]:
    """The cost rows with the state on one GPU: one rank (NCCL; one GPU takes one rank), so its
    snapshots are written to its node's store and not replicated."""

    def rate(*args: str) -> float:
        return _steps_per_second("--device", "cuda", *args, ranks=1)

    rows = _cost_rows("on a GPU, 0.5 MiB, 1 rank", rate, repeats, str(steps))
    big = ["--width", "8192", "--layers", "5", "--steps", "10", "--warmup", "2",
           *NO_BUDGET]  # fmt: skip
    gib = alternate({
        "every": lambda: rate(*big, "--snapshot-every", "1"),
        "none": lambda: rate(*big, "--snapshot-every", "0"),
    }, repeats)  # fmt: skip
    return [*rows, Row("snapshot", "steps/s on a GPU, a snapshot every step at a 1 GiB state, "
                       "whatever it costs (1 rank)", gib["every"], gib["none"], "steps/s",
                       LABEL)]  # fmt: skip


def run(repeats: int = 3, cluster: bool = True, device: str = "cpu") -> list[Row]:
    if device == "cuda":
        return cost_on_gpu(repeats)
    return cost(repeats) + memory() + (node_lost(max(1, repeats // 3)) if cluster else [])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.snapshot")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-cluster", action="store_true", help="only the cost rows")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the cost rows with the state on a GPU, one rank")  # fmt: skip
    p.add_argument("--memory", action="store_true", help="only the memory rows")
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    rows = memory() if opts.memory else run(opts.repeats, not opts.no_cluster, opts.device)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

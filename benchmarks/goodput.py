"""Goodput under one fault schedule: slurmddp against what users would pick instead.

    python -m benchmarks goodput                      # every variant: about an hour
    python -m benchmarks.goodput [--only NAME ...] [--steps N] [--spread K] [--json PATH]

One training (goodput_train.py: 2 nodes x 1 rank, gloo, --steps steps of 0.1 s each, 150 s
undisturbed at the default 1500) runs under each tool on the local cluster, and the same faults
hit it, each at its time counted from the training's first step, once the training runs again
after the fault before (a job waiting in the queue or starting up is not hit):

====  =====================================================================================
  20  preempted: a job of the urgent partition takes its nodes for 10 s
  60  preempted again
 100  the time limit: its TimeLimit set to end 75 s later (each tool's signal 60 s before)
 150  a node killed: its slurmd, the job's step daemon and processes on it at once (its slurmd
      is started again once the job trains again, or after 2 minutes)
 200  a rank hangs (SIGSTOP)
 250  a rank crashes (SIGKILL, as the OOM killer ends it)
====  =====================================================================================

The contenders (`VARIANTS`): slurmddp's defaults (a checkpoint every 100 steps and at the agreed
stop, the hang watchdog at 60 s), with a spare node (the torchrun launcher, elastic), and with
snapshots every 10 steps; against them, as each documents itself: submitit's Checkpointable
(torch.save every 100 steps, requeued by submitit on the signal), ``sbatch --requeue`` with
``torchrun --max-restarts 3`` (torch.save every 100 steps), and Lightning's SLURMEnvironment
auto-requeue (its HPC checkpoint at the signal, a ModelCheckpoint every 100 steps). Every job has
a 15-minute limit (twice the undisturbed training where that is longer). ``--spread K``
multiplies the schedule's times: ``--steps 9000 --spread 3.5`` puts the six faults in 15 minutes of
training, where the default packs them into 150 s. A job that ends without finishing is submitted
again at once, as a user (or a dependency chain) would; its time counts.

Goodput: the node-time that trained the steps kept, over the node-time held: the undisturbed
run's seconds a step x the steps x the 2 training nodes, over each run's time on its nodes x
their count (``sacct --duplicates``: every run of every submission). Beside it, the issue's own
words, the productive training time over the time the job held its nodes (the same runs' time,
not multiplied by their nodes): the two differ only where a run holds more nodes than train (a
spare), which node-time charges and the job's time does not. Time to completion: from the
first submission to the last step. Each variant also says where its time went: each fault's
outage, the longest time between two steps from it to the next fault ("never": it did not train
again).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.cluster import ROOT, cluster_env, job_processes, lose_node
from benchmarks.preemption_turnaround import _wait
from benchmarks.table import Row, report

PROGRAMS = ROOT / "benchmarks" / "programs"
TRAIN = PROGRAMS / "goodput_train.py"
NODES = 2  # that train
TIME_LIMIT_MIN = 15  # at least; twice the undisturbed training where that is longer
SIGNAL_LEAD_S = 60
GIVE_UP_S = 30 * 60  # (or two time limits) a variant still not done by then is cancelled
MAX_SUBMISSIONS = 6

# (seconds from the first step, fault)
SCHEDULE = ((20, "preempted"), (60, "preempted"), (100, "time limit"), (150, "node killed"),
            (200, "hang"), (250, "crash"))  # fmt: skip

# Anywhere in a line: torchrun's workers' lines come tagged with their rank.
_STEP = re.compile(r"\bSTEP (\d+) ([0-9.]+)\s*$", re.M)
_DONE = re.compile(r"\bDONE (\d+)\s*$", re.M)


@dataclasses.dataclass
class Run:
    """One variant's run through the schedule: its submissions and what it printed."""

    name: str
    work: Path
    env: dict[str, str]
    steps: int
    faults: bool
    spread: float = 1.0  # the schedule's times multiplied
    jobs: list[str] = dataclasses.field(default_factory=list)
    submitted: float = 0.0
    recovered: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    lost_node: str = ""  # killed, its slurmd not started again yet

    def logs(self) -> str:
        """Every log of every submission (only rank 0 prints STEP and DONE). The checkpoint
        directory is left out: its rotation removes directories while they are listed (a full
        schedule's run once died so, in rglob)."""
        found = []
        for top, dirs, files in os.walk(self.work):  # errors (a vanished directory) ignored
            dirs[:] = sorted(d for d in dirs if Path(top, d) != self.work / "ckpt")
            found += [Path(top, f) for f in files if f.endswith((".out", ".log"))]
        text = []
        for path in sorted(found):
            with contextlib.suppress(OSError):
                text.append(path.read_text(errors="replace"))
        return "".join(text)

    def progress(self) -> list[tuple[int, float]]:
        """(step, time) of every STEP line printed, by time."""
        return sorted(((int(n), float(t)) for n, t in _STEP.findall(self.logs())),
                      key=lambda st: st[1])  # fmt: skip

    def done(self) -> bool:
        return bool(_DONE.search(self.logs()))

    @property
    def limit_min(self) -> int:
        """Every job's time limit: 15 minutes, or twice the undisturbed training if longer."""
        return max(TIME_LIMIT_MIN, -(-self.steps * 2 // 600))


# ---- the contenders: each submits the training once more, and returns the job id ---------------


def _slurmddp(*extra: str, snapshot_every: int = 0) -> Callable[[Run], str]:
    def submit(run: Run) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "slurmddp", "submit", "--json", "--partition", "debug",
             "--nodes", str(NODES), "--ntasks-per-node", "1", "--time", str(run.limit_min),
             "--signal-lead", str(SIGNAL_LEAD_S), "--hang-timeout", "60", "--max-requeues", "20",
             "--output", str(run.work / "jobs"), "--env", "OMP_NUM_THREADS=1",
             "--env", "SLURMDDP_RUN_ID=goodput", "--no-snapshot", *extra, str(TRAIN),
             "--style", "slurmddp", "--steps", str(run.steps), "--snapshot-every",
             str(snapshot_every), "--checkpoint-dir", str(run.work / "ckpt")],
            env=run.env | {"XDG_STATE_HOME": str(run.work / "state")}, cwd=run.work,
            capture_output=True, text=True, check=True).stdout  # fmt: skip
        return re.search(r'"job_id": "(\d+)"', out).group(1)  # type: ignore[union-attr]

    return submit


def _submitit(run: Run) -> str:
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "goodput_submitit.py"), str(run.work / "submitit"),
         "--nodes", str(NODES), "--time-min", str(run.limit_min), "--signal-lead",
         str(SIGNAL_LEAD_S), "--", "--steps", str(run.steps), "--checkpoint-dir",
         str(run.work / "ckpt")],
        env=run.env | {"PYTHONPATH": str(PROGRAMS), "OMP_NUM_THREADS": "1"}, cwd=run.work,
        capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.split()[-1]


def _sbatch(run: Run, name: str, body: str, *directives: str) -> str:
    script = run.work / f"{name}.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {d}\n" for d in (
        "--partition=debug", f"--nodes={NODES}", "--ntasks-per-node=1",
        f"--time={run.limit_min}", "--requeue", f"--output={run.work}/{name}-%j.out",
        *directives)) + "export OMP_NUM_THREADS=1\n" + body)  # fmt: skip
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=run.env, cwd=run.work,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out.strip().split(";")[0]


def _torchrun(run: Run) -> str:
    args = shlex.join([str(TRAIN), "--style", "plain", "--steps", str(run.steps),
                       "--checkpoint-dir", str(run.work / "ckpt")])  # fmt: skip
    low, _, high = run.env.get("SLURMDDP_PORT_RANGE", "29500-29999").partition("-")
    body = (f'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
            f"port=$(( {low} + SLURM_JOB_ID % ({high} - {low}) ))\n"
            f"srun {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes {NODES} "
            f"--nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d "
            f'--rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" {args}\n')  # fmt: skip
    return _sbatch(run, "torchrun", body)


def _lightning(run: Run) -> str:
    args = shlex.join([str(PROGRAMS / "goodput_lightning.py"), "--steps", str(run.steps),
                       "--nodes", str(NODES), "--checkpoint-dir", str(run.work / "ckpt")])
    body = f"srun {shlex.quote(sys.executable)} {args}\n"
    return _sbatch(run, "lightning", body, f"--signal=SIGUSR1@{SIGNAL_LEAD_S}")


VARIANTS: dict[str, Callable[[Run], str]] = {
    "slurmddp": _slurmddp(),
    "sbatch --requeue + torchrun --max-restarts": _torchrun,
    "submitit Checkpointable": _submitit,
    "Lightning SLURMEnvironment": _lightning,
    "slurmddp, a spare node": _slurmddp("--launcher", "torchrun", "--spare-nodes", "1",
                                        "--max-restarts", "3"),
    "slurmddp, snapshots": _slurmddp(snapshot_every=10),
}
PEERS = ("submitit Checkpointable", "sbatch --requeue + torchrun --max-restarts",
         "Lightning SLURMEnvironment")  # fmt: skip


# ---- Slurm, asked ------------------------------------------------------------------------------


def _show(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
                         text=True).stdout  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _nodes(env: dict[str, str], nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env,
                          capture_output=True, text=True).stdout.split()  # fmt: skip


def _state(env: dict[str, str], job: str) -> str:
    return _show(env, job).get("JobState", "UNKNOWN")


def _held(env: dict[str, str], jobs: list[str]) -> tuple[float, float]:
    """Every run of every job (``sacct --duplicates``): (its time on its nodes x their count,
    its time), summed."""
    out = subprocess.run(["sacct", "-X", "-n", "-P", "--duplicates", "-o",
                          "JobID,Start,End,NNodes", "-j", ",".join(jobs)], env=env,
                         capture_output=True, text=True).stdout  # fmt: skip
    node_seconds = seconds = 0.0
    for line in out.splitlines():
        _, start, end, nodes = line.split("|")
        if "T" in start and "T" in end:
            took = max(0.0, (datetime.datetime.fromisoformat(end)
                             - datetime.datetime.fromisoformat(start)).total_seconds())  # fmt: skip
            node_seconds += took * int(nodes or 0)
            seconds += took
    return node_seconds, seconds


# ---- the faults --------------------------------------------------------------------------------


def _rank_process(run: Run, job: str, nodes: list[str]) -> tuple[str, int] | None:
    """A training process (not an agent, not srun's or Slurm's) on the last of `nodes` that has
    one (a spare node has none), and its node."""
    for node in reversed(nodes):
        for pid in job_processes(job, node, run.env["SLURM_CONF"]):
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if ("goodput_" in cmd or "submitit" in cmd) and not any(
                        other in cmd for other in ("torch.distributed.run", "slurmddp.agent",
                                                   "slurmddp.supervisor", "srun ")):  # fmt: skip
                    return node, pid
    return None


def hit(run: Run, fault: str) -> float:
    """Apply `fault` to the run's job now running; when it hit."""
    job = run.jobs[-1]
    at = time.time()
    shown = _show(run.env, job)
    nodes = _nodes(run.env, shown.get("NodeList", ""))
    if fault == "preempted":
        # Whole nodes: a job that fits beside the training would not preempt it.
        urgent = subprocess.run(
            ["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N", str(len(nodes)), "-w",
             ",".join(nodes), "--wrap", "sleep 10", f"--output={run.work}/urgent-%j.txt"],
            env=run.env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        time.sleep(2)  # scontrol knows it by then
        _wait(lambda: _state(run.env, urgent) in FINAL, 300, "the urgent job's end")
    elif fault == "time limit":
        run_time = _seconds(shown.get("RunTime", "0:0"))
        limit = int(run_time + SIGNAL_LEAD_S + 15)
        subprocess.run(["scontrol", "update", f"JobId={job}",
                        f"TimeLimit={limit // 3600}:{limit % 3600 // 60:02d}:{limit % 60:02d}"],
                       env=run.env, check=True, capture_output=True)  # fmt: skip
    elif fault == "node killed":
        node, _ = _wait(lambda: _rank_process(run, job, nodes), 30, "a rank process")
        run.lost_node = node
        lose_node(job, node, run.env["SLURM_CONF"], machine=True, sig=signal.SIGKILL)
    elif fault in ("hang", "crash"):
        _, pid = _wait(lambda: _rank_process(run, job, nodes), 30, "a rank process")
        os.kill(pid, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
    return at


def _node_back(run: Run) -> None:
    """The killed node's slurmd started again (scripts/slurm-cluster up starts what is missing)."""
    subprocess.run([str(ROOT / "scripts" / "slurm-cluster"), "up"], env=run.env,
                   capture_output=True, check=True)  # fmt: skip
    run.lost_node = ""


def _seconds(text: str) -> float:
    days, _, hms = text.rpartition("-")
    parts = [int(x) for x in hms.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return int(days or 0) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]


# ---- one variant through the schedule -------------------------------------------------------


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "UNKNOWN",
         "DEADLINE", "BOOT_FAIL", "PREEMPTED")  # fmt: skip


def through(run: Run, submit: Callable[[Run], str]) -> Run:
    """Submit, apply the schedule (when `run.faults`), resubmit what ends unfinished, to DONE."""
    run.submitted = time.time()
    run.jobs.append(submit(run))
    pending = [(at * run.spread, fault) for at, fault in SCHEDULE] if run.faults else []
    first: float | None = None
    last_fault = 0.0
    restored = True
    deadline = time.monotonic() + max(GIVE_UP_S, run.limit_min * 120)
    while time.monotonic() < deadline:
        steps = run.progress()
        if first is None and steps:
            first = steps[0][1]
        state = _state(run.env, run.jobs[-1])
        if not restored and state == "PENDING":  # the requeued job gets its limit back
            subprocess.run(["scontrol", "update", f"JobId={run.jobs[-1]}",
                            f"TimeLimit={run.limit_min}"], env=run.env, capture_output=True)
            restored = True
        if run.done() and state in FINAL:
            return run
        if state in FINAL and not run.done():
            if len(run.jobs) > MAX_SUBMISSIONS:
                break  # no use: it fails by itself (its logs say why)
            run.jobs.append(submit(run))  # a user submits it again
            restored = True
            continue
        training_since = steps[-1][1] if steps else 0.0
        if run.lost_node and (training_since > last_fault or time.time() > last_fault + 120):
            _node_back(run)
        if pending and first is not None and state == "RUNNING":
            at, fault = pending[0]
            if training_since > max(first + at, last_fault) and time.time() >= first + at:
                at = hit(run, fault)
                last_fault = time.time()
                run.recovered.append((fault, at))
                restored = fault != "time limit"
                pending.pop(0)
        time.sleep(0.5)
    for job in run.jobs:
        subprocess.run(["scancel", job], env=run.env, capture_output=True)
    if run.lost_node:
        _node_back(run)
    return run


def measure(name: str, env: dict[str, str], steps: int, faults: bool,
            spread: float = 1.0) -> dict[str, object]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slurmddp-goodput-") as work:
        run = through(Run(name, Path(work), env, steps, faults, spread), VARIANTS[name])
        progress = run.progress()
        _wait(lambda: all(_state(env, j) in FINAL for j in run.jobs), 120, "the jobs' end")
        time.sleep(2)  # accounting records the end a moment later
        held, held_s = _held(env, run.jobs)
        reached = max((n for n, _ in progress), default=0)
        ended = progress[-1][1] if progress else time.time()
        lost = []  # each fault's outage: the longest time between two steps until the next fault
        hits = [at for _, at in run.recovered] + [float("inf")]
        for (fault, at), until in zip(run.recovered, hits[1:], strict=False):
            times = [t for _, t in progress if at - 5 <= t < until]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            lost.append((fault, max(gaps) if gaps and times[-1] > at else None))
        return {"name": name, "held": held, "held_s": held_s, "reached": reached,
                "done": run.done(),
                "completion": ended - run.submitted, "jobs": len(run.jobs), "lost": lost,
                "seconds_per_step": _pace(progress)}  # fmt: skip


def _pace(progress: list[tuple[int, float]]) -> float | None:
    """Seconds a step while it trains: the median over consecutive STEP lines of one stretch
    (an outage, a redone step, a restart left out)."""
    paces = sorted((t1 - t0) / (n1 - n0) for (n0, t0), (n1, t1) in itertools.pairwise(progress)
                   if n1 > n0)  # fmt: skip
    return paces[len(paces) // 2] if paces else None


def run(names: list[str] | None = None, steps: int = 1500, keep: Path | None = None,
        spread: float = 1.0) -> list[Row]:  # fmt: skip
    """The rows; each variant's measurement is also appended to `keep` (JSON lines) as it ends."""
    env = cluster_env()

    def measured(name: str, faults: bool) -> dict[str, object]:
        m = measure(name, env, steps, faults, spread)
        print(f"measured {name} (faults: {faults}): {m}", flush=True)
        if keep is not None:
            with keep.open("a") as f:
                f.write(json.dumps(m | {"faults": faults, "steps": steps, "spread": spread}) + "\n")
        return m

    def goodput(m: dict[str, object], of: str = "held") -> float:
        """Each run's steps at its own pace while it trains: the time the steps took undisturbed
        (a tool's per-step cost is the training benchmark's), over the node-time held (`of`
        "held_s": over the time held, the steps' time not multiplied by the nodes)."""
        pace = float(m["seconds_per_step"])  # type: ignore[arg-type]
        nodes = NODES if of == "held" else 1
        return pace * int(m["reached"]) * nodes / float(m[of])  # type: ignore[arg-type]

    baseline = measured("slurmddp", faults=False)
    clean = goodput(baseline)
    results = {name: measured(name, faults=True) for name in names or VARIANTS}
    rows = []
    for name, m in results.items():
        said = ", ".join(f"{f} {s:.0f} s" if s is not None else f"{f} never"
                         for f, s in m["lost"])  # type: ignore[attr-defined]  # fmt: skip
        print(f"{name}: goodput {goodput(m):.3f} (undisturbed {clean:.3f}), done {m['done']}, "
              f"{m['jobs']} submissions, {m['completion']:.0f} s to the end; to training again "
              f"after each fault: {said}", flush=True)  # fmt: skip
        rows.append(Row("goodput", f"{name}: goodput under the faults", goodput(m), clean, "",
                        "undisturbed run", ">= 0.9" if name.startswith("slurmddp") else ""))
        if "held_s" in m and abs(goodput(m, "held_s") - goodput(m)) > 1e-3:  # a spare held
            rows.append(Row("goodput", f"{name}: goodput of the job's time (productive time "
                            "over the time it held its nodes)", goodput(m, "held_s"),
                            goodput(baseline, "held_s"), "", "undisturbed run",
                            ">= 0.9" if name.startswith("slurmddp") else ""))  # fmt: skip
        rows.append(Row("goodput", f"{name}: time to completion", float(m["completion"]),  # type: ignore[arg-type]
                        float(baseline["completion"]), "s", "undisturbed run"))  # type: ignore[arg-type]
    ours = results.get("slurmddp")
    for peer in (p for p in PEERS if p in results and ours is not None):
        rows.append(Row("goodput", f"slurmddp against {peer}: goodput", goodput(ours),
                        goodput(results[peer]), "", peer, ">= 1.3"))  # type: ignore[arg-type]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput")
    p.add_argument("--only", action="append", choices=list(VARIANTS), metavar="NAME",
                   help=f"one of: {'; '.join(VARIANTS)} (default: all)")  # fmt: skip
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--spread", type=float, default=1.0,
                   help="the schedule's times multiplied (with --steps 9000 and 3.5: the six "
                        "faults over 15 minutes of training, the issue's density)")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="append each variant's measurement here (JSON lines)")
    opts = p.parse_args()
    report(run(opts.only, opts.steps, opts.keep, opts.spread), opts.json)


if __name__ == "__main__":
    main()

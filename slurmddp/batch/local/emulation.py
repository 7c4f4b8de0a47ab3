"""Slurm in miniature, for ``slurmddp submit --local``: the job's own batch script, on this machine.

A local job runs what a Slurm job runs: the batch script `slurmddp submit` renders for Slurm
(its setup lines, the stop protocol, the hang watchdog, the decision after the step, the
requeue and its cap, the done marker), so that each behaves as on the cluster. In place of
Slurm's daemons and tools, three roles of ``python -m slurmddp.emulation``:

- ``batch`` (slurmd's part), the one task submitit's LocalExecutor starts: it gives the script
  the variables sbatch gives a job (`job_environment`), puts the stand-ins below first on PATH,
  runs the script with its output in ``<output>/<job>.batch.log``, passes the stop signal to it
  (the time limit's warning from submitit's controller, or ``--local-signal-after``'s, which
  rank 0 sends here counted from its first step: `slurmddp.preemption.rehearsal`), the job's
  end (TERM) to all its processes, and has submitit start it again when it was requeued;
- ``srun``: starts the step's tasks, each with the variables a real task has
  (`step_environment`), writes their output where ``--output`` says, passes USR1/USR2 on, and
  with ``--kill-on-bad-exit`` names the first task that ended badly, as srun does
  (``srun: error: NODE: task N: ...``), and ends the others;
- ``scontrol``: answers what the batch script asks of Slurm (``show hostnames|job|partition``)
  from what this emulation knows, and ``requeue`` by submitit's requeue.

Every emulated node is this machine, named localhost, in a partition of its own
(`LOCAL_PARTITION`) of that many nodes: a node the decision blames cannot be left behind.
What a local job refuses, or takes without meaning (`local_problem`): docs/behaviour/local.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slurmddp import protocol
from slurmddp.batch.spec.jobspec import JobSpec
from slurmddp.rank import hostlist
from slurmddp.supervisor.launchers import launcher

LOCAL_HOST = "localhost"
LOCAL_PARTITION = "local"  # the one partition of this machine's emulated cluster
LOCAL_JOB_NAME = "local"
# Seconds between the TERM that ends tasks (a bad exit, the job's end) and the KILL for those
# still there: Slurm's KillWait, shortened for one machine.
KILL_WAIT_S = 5
_POLL_S = 0.1
# The stand-ins' files in the job's state directory ($SLURMDDP_LOCAL_STATE).
_JOB_FILE, _STEPS_FILE = "job.json", "steps"
_REQUEUED_FILE, _NO_REQUEUE_FILE = "requeued", "no-requeue"


def local_problem(spec: JobSpec) -> str | None:
    """Why `spec` cannot run under ``--local``, in words that follow "--local: "; None if it can.

    Refused: what changes how the ranks start on a cluster and has no meaning on one machine
    (mpirun, srun's MPI plugin, srun and sbatch options). Taken without meaning: where the job
    queues and what it is charged to (partition, account, qos, constraint, a profile's usual
    settings) and the memory limit, which nothing enforces here.
    """
    if (problem := launcher(spec.launcher).local_problem) is not None:
        return problem
    if spec.mpi is not None:
        return f"--mpi {spec.mpi} is srun's MPI plugin, which only a Slurm cluster has: drop --mpi"
    if spec.srun_args:
        return (f"--srun-arg {spec.srun_args[0]} cannot be honoured by the local stand-in of srun: "
                "drop --srun-arg")  # fmt: skip
    if spec.sbatch_args:
        return (f"--sbatch-arg {spec.sbatch_args[0]} means nothing without sbatch: drop "
                "--sbatch-arg")  # fmt: skip
    return None


def job_environment(
    nodes: int, tasks_per_node: int, job_id: str, *, job_name: str = LOCAL_JOB_NAME,
    cpus_per_task: int | None = None, gpus_per_node: int = 0, submit_dir: str = "",
    submit_host: str = LOCAL_HOST,
) -> dict[str, str]:  # fmt: skip
    """The SLURM_* variables sbatch gives the batch script of ``sbatch --nodes N
    --ntasks-per-node T [--cpus-per-task C] [--gpus-per-node G]`` (a step's tasks inherit them),
    less what only a real cluster has (its name, the user's ids)."""
    world = nodes * tasks_per_node
    # Every emulated node is this machine, so every one is named localhost.
    nodelist = hostlist.compress([LOCAL_HOST] * nodes)
    cpus_on_node = tasks_per_node * (cpus_per_task or 1)
    env = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": job_name,
        "SLURM_JOB_PARTITION": LOCAL_PARTITION,
        "SLURM_SUBMIT_DIR": submit_dir,
        "SLURM_SUBMIT_HOST": submit_host,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_NTASKS": str(world),
        "SLURM_NPROCS": str(world),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": _per_node(tasks_per_node, nodes),
        "SLURM_JOB_CPUS_PER_NODE": _per_node(cpus_on_node, nodes),
        "SLURM_CPUS_ON_NODE": str(cpus_on_node),
        "SLURMD_NODENAME": LOCAL_HOST,
        "SLURM_NODEID": "0",  # the batch script runs on the first node
    }
    if cpus_per_task is not None:  # as Slurm: only when the job asked for it
        env["SLURM_CPUS_PER_TASK"] = str(cpus_per_task)
    if gpus_per_node:
        env["SLURM_GPUS_PER_NODE"] = str(gpus_per_node)
        env["SLURM_GPUS_ON_NODE"] = str(gpus_per_node)
    return env


def step_environment(
    global_rank: int, nodes: int, tasks_per_node: int, job_id: str, step_id: int = 0,
    **job: str | int | None,
) -> dict[str, str]:  # fmt: skip
    """The SLURM_* variables task `global_rank` of an even, block-distributed step of the whole
    job has: the job's (`job_environment`, same keywords) and those srun adds for the step and
    the task."""
    return {**job_environment(nodes, tasks_per_node, job_id, **job),  # type: ignore[arg-type]
            **task_variables(global_rank, nodes, tasks_per_node, step_id)}  # fmt: skip


def task_variables(global_rank: int, nodes: int, tasks_per_node: int,
                   step_id: int) -> dict[str, str]:  # fmt: skip
    """What srun sets for task `global_rank` of a block-distributed step of `nodes` x
    `tasks_per_node` tasks, over the job's variables."""
    world = nodes * tasks_per_node
    nodelist = hostlist.compress([LOCAL_HOST] * nodes)
    node = global_rank // tasks_per_node
    first = node * tasks_per_node
    return {
        "SLURM_STEP_ID": str(step_id),
        "SLURM_STEPID": str(step_id),
        "SLURM_NTASKS": str(world),
        "SLURM_NPROCS": str(world),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": _per_node(tasks_per_node, nodes),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": _per_node(tasks_per_node, nodes),
        "SLURM_GTIDS": ",".join(str(r) for r in range(first, first + tasks_per_node)),
        "SLURM_PROCID": str(global_rank),
        "SLURM_LOCALID": str(global_rank % tasks_per_node),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": LOCAL_HOST,
    }


def _per_node(count: int, nodes: int) -> str:
    """Slurm's compressed per-node count: ``2`` on one node, ``2(x3)`` on three."""
    return f"{count}(x{nodes})" if nodes > 1 else str(count)


def output_path(pattern: str, job_id: str, step_id: int, task: int, node: int,
                job_name: str) -> str:  # fmt: skip
    """srun's ``--output`` pattern for one task: %j, %s, %t, %n, %N, %x and %% expanded."""
    values = {"j": job_id, "J": job_id, "s": str(step_id), "t": str(task), "n": str(node),
              "N": LOCAL_HOST, "x": job_name, "%": "%"}  # fmt: skip
    return re.sub(r"%([jJstnNx%])", lambda m: values[m.group(1)], pattern)


def srun_error(task: int, returncode: int) -> str:
    """srun's line for a task that ended badly (the decision reads the first one)."""
    if returncode < 0:
        what = signal.strsignal(-returncode) or f"signal {-returncode}"
    else:
        what = f"Exited with exit code {returncode}"
    return f"srun: error: {LOCAL_HOST}: task {task}: {what}"


def slurm_duration(seconds: float) -> str:
    """Seconds as Slurm prints RunTime and TimeLimit: [D-]HH:MM:SS."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text


def job_record(job: Mapping[str, Any], environ: Mapping[str, str], now: float) -> str:
    """``scontrol show job -o``'s line for the local job: the fields the decision reads."""
    limit = job.get("time_limit_s")
    requeue = job.get("requeue") and not job.get("no_requeue")
    fields = {
        "JobId": environ.get("SLURM_JOB_ID", ""),
        "JobName": environ.get("SLURM_JOB_NAME", ""),
        "JobState": "RUNNING",
        "Requeue": "1" if requeue else "0",
        "Restarts": environ.get("SLURM_RESTART_COUNT") or "0",
        "RunTime": slurm_duration(now - float(job.get("started") or now)),
        "TimeLimit": "UNLIMITED" if limit is None else slurm_duration(float(limit)),
        "PreemptTime": "None",
        "Partition": LOCAL_PARTITION,
        "NodeList": environ.get("SLURM_JOB_NODELIST", LOCAL_HOST),
        "NumNodes": environ.get("SLURM_JOB_NUM_NODES", "1"),
        "ExcNodeList": "(null)",
    }
    return " ".join(f"{k}={v}" for k, v in fields.items())


def partition_record(environ: Mapping[str, str]) -> str:
    """``scontrol show partition -o``'s line: the emulated cluster is the job's nodes."""
    nodes = environ.get("SLURM_JOB_NUM_NODES", "1")
    return (f"PartitionName={LOCAL_PARTITION} State=UP TotalNodes={nodes} "
            f"Nodes={environ.get('SLURM_JOB_NODELIST', LOCAL_HOST)}")  # fmt: skip



def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slurmddp.emulation batch|srun|scontrol ...``: one role (the module's doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    role, rest = (args[0], args[1:]) if args else ("", [])
    roles = {"batch": batch, "srun": srun, "scontrol": scontrol}
    if role not in roles:
        print(f"python -m slurmddp.emulation: give one of {', '.join(roles)}", file=sys.stderr)
        return protocol.USAGE_ERROR
    return roles[role](rest)


# ---- batch: slurmd's part --------------------------------------------------------------------


def batch(argv: Sequence[str]) -> int:
    """Run the job's batch script as slurmd would, once per run of the job."""
    p = argparse.ArgumentParser(prog="python -m slurmddp.emulation batch")
    p.add_argument("--script", required=True)
    p.add_argument("--batch-log", required=True, help="sbatch --output's pattern (%%j)")
    p.add_argument("--folder", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ntasks-per-node", type=int, required=True)
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--job-name", default=LOCAL_JOB_NAME)
    p.add_argument("--submit-dir", default=os.getcwd())
    p.add_argument("--submit-host", default=LOCAL_HOST)
    p.add_argument("--time-limit", type=float, help="seconds (none: unlimited)")
    p.add_argument("--no-requeue", action="store_true", help="sbatch --no-requeue")
    p.add_argument("--signal", default=protocol.DEFAULT_SIGNAL)
    p.add_argument("--signal-after", action="append", default=[], metavar="S|Nsteps",
                   help="send the stop signal S seconds after the run's first step, or at its "
                        "N-th step; once per run, in order")
    opts = p.parse_args(argv)

    job_id = os.environ["SUBMITIT_LOCAL_JOB_ID"]
    counter = restart_counter_path(opts.folder, job_id)
    restart = int(counter.read_text()) if counter.exists() else 0
    state = Path(tempfile.mkdtemp(prefix=f"slurmddp-local-{job_id}-"))
    try:
        bin_dir = state / "bin"
        bin_dir.mkdir()
        for tool in ("srun", "scontrol"):  # the stand-ins, first on the script's PATH
            shim = bin_dir / tool
            shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m "
                            f"slurmddp.emulation {tool} \"$@\"\n")  # fmt: skip
            shim.chmod(0o755)
        (state / _JOB_FILE).write_text(json.dumps({
            "started": time.time(), "time_limit_s": opts.time_limit,
            "requeue": not opts.no_requeue, "restart_counter": str(counter),
        }))  # fmt: skip
        env = dict(os.environ)
        env.update(job_environment(
            opts.nodes, opts.ntasks_per_node, job_id, job_name=opts.job_name,
            cpus_per_task=opts.cpus_per_task, gpus_per_node=opts.gpus_per_node,
            submit_dir=opts.submit_dir, submit_host=opts.submit_host))  # fmt: skip
        env.pop("SLURM_RESTART_COUNT", None)
        if restart:  # as Slurm: only once the job has been requeued
            env["SLURM_RESTART_COUNT"] = str(restart)
        env[protocol.LOCAL_STATE_VAR] = str(state)
        for name in (protocol.LOCAL_REHEARSAL_VAR, protocol.LOCAL_BATCH_PID_VAR):
            env.pop(name, None)
        if rehearsed := opts.signal_after[restart:restart + 1]:
            # Rank 0 sends it, counted from its first step (slurmddp.preemption.rehearsal), to
            # this process, which hands it to the script.
            env[protocol.LOCAL_REHEARSAL_VAR] = rehearsed[0]
            env[protocol.LOCAL_BATCH_PID_VAR] = str(os.getpid())
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
        log = Path(output_path(opts.batch_log, job_id, 0, 0, 0, opts.job_name))
        with log.open("a") as out:
            status, ended = _run_script(opts.script, opts.submit_dir, env, out)
        requeued = (state / _REQUEUED_FILE).exists()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    if requeued:
        return protocol.LOCAL_REQUEUE_STATUS  # submitit's controller starts the job again
    if ended:  # else cancelled: no exit status, as for a Slurm job scancel ended
        from slurmddp.batch import jobs

        jobs.local_exit_path(opts.folder, job_id).write_text(f"{status}\n")
    return status


def _run_script(script: str, cwd: str, env: dict[str, str], out: object) -> tuple[int, bool]:
    """Run the batch script, in a session of its own; (its exit status, whether it ended
    without the job being ended from outside)."""
    proc = subprocess.Popen([script], cwd=cwd or None, env=env, stdout=out,  # type: ignore[call-overload]
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    ended_from_outside = threading.Event()

    def warn(signum: int, frame: object) -> None:  # Slurm's --signal=B:SIG: the shell alone
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    def end(signum: int, frame: object) -> None:
        # scancel, the time limit, submitit's controller: TERM to every process of the job, then
        # KILL for those still there, as Slurm does (KillWait).
        ended_from_outside.set()
        _end_group(proc.pid)

    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, warn)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, end)
    status = proc.wait()
    return (status if status >= 0 else 128 - status), not ended_from_outside.is_set()


def _end_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    # Detached, so that it outlives this process when submitit kills it a second later.
    subprocess.Popen(["sh", "-c", f"sleep {KILL_WAIT_S}; kill -KILL -{pgid} 2>/dev/null"],
                     start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)  # fmt: skip


def restart_counter_path(folder: str, job_id: str) -> Path:
    """Where a local job counts its restarts (written by the stand-in scontrol's requeue)."""
    return Path(folder) / f"{job_id}_restarts"


# ---- srun: a step's tasks --------------------------------------------------------------------


def srun(argv: Sequence[str]) -> int:
    """Start a step of the job's tasks on this machine, as srun would in the allocation."""
    p = argparse.ArgumentParser(prog="srun", allow_abbrev=False)
    p.add_argument("--kill-on-bad-exit", type=int, default=0)
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--open-mode", choices=("append", "truncate"), default="append")
    p.add_argument("--output")
    p.add_argument("--ntasks", type=int)
    p.add_argument("--ntasks-per-node", type=int)
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--export", default="ALL")
    p.add_argument("command", nargs=argparse.REMAINDER)
    opts = p.parse_args(argv)
    env = dict(os.environ)
    nodes = int(env.get("SLURM_JOB_NUM_NODES", "1"))
    per_node = opts.ntasks_per_node or (
        opts.ntasks // nodes if opts.ntasks else int(env.get("SLURM_NTASKS_PER_NODE", "1")))
    if opts.ntasks is not None and opts.ntasks != nodes * per_node:
        print(f"srun: error: the local stand-in of srun runs {per_node} task(s) on each of the "
              f"{nodes} node(s), not {opts.ntasks}", file=sys.stderr)  # fmt: skip
        return 1
    kind, _, extra = opts.export.partition(",")
    if kind != "ALL":
        print("srun: error: the local stand-in of srun takes --export=ALL[,NAME=VALUE...] only",
              file=sys.stderr)  # fmt: skip
        return 1
    env.update(pair.partition("=")[::2] for pair in extra.split(",") if pair)
    state = Path(env[protocol.LOCAL_STATE_VAR])
    step = _next_step(state / _STEPS_FILE)
    job_id = env.get("SLURM_JOB_ID", "0")
    tasks: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(nodes * per_node):
            task_env = {**env, **task_variables(rank, nodes, per_node, step)}
            if opts.cpus_per_task is not None:
                task_env["SLURM_CPUS_PER_TASK"] = str(opts.cpus_per_task)
            out = None
            if opts.output:
                path = output_path(opts.output, job_id, step, rank, rank // per_node,
                                   env.get("SLURM_JOB_NAME", ""))  # fmt: skip
                out = open(path, "a" if opts.open_mode == "append" else "w")  # noqa: SIM115
                logs.append(out)
            tasks.append(subprocess.Popen(opts.command, env=task_env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None))  # fmt: skip
        return _wait_step(tasks, kill_on_bad_exit=bool(opts.kill_on_bad_exit))
    finally:
        for f in logs:
            f.close()


def _next_step(path: Path) -> int:
    """This job run's next step id (the preflight's is 0, the training's 1, as on Slurm)."""
    step = int(path.read_text()) if path.exists() else 0
    path.write_text(f"{step + 1}\n")
    return step


def _wait_step(tasks: list[subprocess.Popen[bytes]], *, kill_on_bad_exit: bool) -> int:
    """Wait for the step's tasks, passing the user signals on; the first bad exit's status.

    The job's end (TERM) reaches the tasks from the stand-in slurmd, as Slurm sends it to every
    process: here it is only waited out."""

    def forward(signum: int, frame: object) -> None:
        for t in tasks:
            if t.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    t.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    first_bad: int | None = None
    said: set[int] = set()
    kill_at: float | None = None
    while True:
        codes = [t.poll() for t in tasks]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in said:
                said.add(rank)
                print(srun_error(rank, code), file=sys.stderr, flush=True)
                if first_bad is None:
                    first_bad = code if code > 0 else 128 - code
        if all(c is not None for c in codes):
            return first_bad or 0
        if first_bad is not None and kill_on_bad_exit and kill_at is None:
            # srun --kill-on-bad-exit: the step ends with its first bad task.
            forward(signal.SIGTERM, None)
            kill_at = time.monotonic() + KILL_WAIT_S
        if kill_at is not None and time.monotonic() > kill_at:
            forward(signal.SIGKILL, None)
        time.sleep(_POLL_S)


# ---- scontrol: what the batch script asks of Slurm -------------------------------------------


def scontrol(argv: Sequence[str]) -> int:
    """The batch script's questions to Slurm, and its requeue, answered for the local job."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head -n 1` ends it quietly, as any tool
    words = [w for w in argv if w != "-o"]
    env = os.environ
    state = Path(env[protocol.LOCAL_STATE_VAR])
    job = json.loads((state / _JOB_FILE).read_text())
    job["no_requeue"] = (state / _NO_REQUEUE_FILE).exists()
    if words[:2] == ["show", "hostnames"]:
        nodelist = words[2] if len(words) > 2 else env.get("SLURM_JOB_NODELIST", "")
        print("\n".join(hostlist.expand(nodelist)))
        return 0
    if words[:2] == ["show", "job"]:
        print(job_record(job, env, time.time()))
        return 0
    if words[:2] == ["show", "partition"]:
        print(partition_record(env))
        return 0
    if words[:1] == ["requeue"] and not job["no_requeue"] and job["requeue"]:
        restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        Path(job["restart_counter"]).write_text(f"{restart + 1}\n")
        (state / _REQUEUED_FILE).touch()
        return 0
    if words[:1] == ["update"] and words[2:] == ["Requeue=0"]:
        (state / _NO_REQUEUE_FILE).touch()
        return 0
    print(f"scontrol: error: the local emulation cannot do: scontrol {shlex.join(argv)}",
          file=sys.stderr)  # fmt: skip
    return 1

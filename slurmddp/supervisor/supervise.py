"""The supervisor process: the stop signal, the step, the facts, the verdict, carried out.

Started by the batch script once its setup lines have run (``python -m slurmddp.supervisor``),
with the stop signal and TERM ignored until it listens, and told the signals the shell took
before. Once it listens it tells the shell so with SIGURG: the shell passes on again what it took
since (a signal the supervisor ignored), and each one after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurmddp import protocol
from slurmddp.story import events
from slurmddp.supervisor import fence
from slurmddp.supervisor.launchers import LAUNCHERS, Run, Step, preflight, spacer
from slurmddp.supervisor.plan import Plan

# The signal with which the supervisor tells the batch shell it listens: nothing else sends it.
READY_SIGNAL = signal.SIGURG


class Supervisor:
    """One run of a job: `listen`, then `run`."""

    def __init__(self, plan: Plan, environ: Mapping[str, str]) -> None:
        self.plan = plan
        self.environ = environ
        self.stop = signal.Signals[f"SIG{plan.signal}"]
        self.launcher = LAUNCHERS[plan.launcher]
        self.received: list[str] = []  # the signals taken, in order, each once
        self.stop_file: Path | None = None  # set once an earlier run's is removed
        self._step: subprocess.Popen[bytes] | None = None
        self._step_started = 0.0
        self._spacers = 0  # empty steps to run first (`_explain_the_last_run`)

    def listen(self) -> None:
        """Take the stop signal and TERM from now on."""
        signal.signal(self.stop, self._on_stop)
        signal.signal(signal.SIGTERM, self._on_term)

    def run(self) -> int:
        """Run the step unless a stop came first, decide what happens to the job, do it; the
        batch job's exit status."""
        run = Run.of(self.environ)
        nodelist = self.environ.get("SLURM_JOB_NODELIST", "")
        job_dir = self.plan.job_dir(run.job_id)
        try:
            self._start_run(job_dir)
        except OSError as e:
            _say(f"cannot make the job's directory {str(job_dir)!r} ({e.strerror}: {e.filename}): "
                 "submit with --output a directory the job may write to")  # fmt: skip
            return protocol.INTERNAL_ERROR
        for aside in (self._explain_the_last_run, self._fence_if_cut_off):
            try:  # neither may end the job
                aside(run)
            except Exception as e:
                _say(f"{aside.__name__.strip('_').replace('_', ' ')}: skipped "
                     f"({type(e).__name__}: {e})")  # fmt: skip
        events.emit("run", self.environ, nodes=nodelist, job=run.job_id, spacers=self._spacers)
        batch_log, log_start = _log_position()
        for _ in range(self._spacers):
            try:
                subprocess.run(spacer(self.plan).argv, stdin=subprocess.DEVNULL, timeout=120,
                               check=False)  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as e:
                _say(f"an empty step failed ({type(e).__name__}: {e})")
        status = preflight_status = None
        if self.received:
            _say(f"{' '.join(self.received)} came before the step started: not starting it")
        elif self.plan.preflight:
            _say(f"preflight on {nodelist}")
            checked = self._run_step(preflight(self.plan, run))
            if checked != 0 and not self.received:
                preflight_status = checked
            elif not self.received:
                _say("preflight passed")
        if not self.received and preflight_status is None:
            try:
                step = self.launcher.step(self.plan, run)
            except ValueError as e:
                _say(str(e))
                return protocol.INTERNAL_ERROR
            status = self._run_step(step)
        # A requeue (Slurm's, or the one decided below) sends TERM to this process and what it
        # runs, which must finish: ignored from here on, and so by every command started from
        # here.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            return self._decide(run, status, preflight_status, batch_log, log_start)
        except Exception as e:  # the job must end, with the step's status
            _say(f"no decision ({type(e).__name__}: {e}); the job ends with the step's status")
            return protocol.INTERNAL_ERROR if status is None else status

    def _explain_the_last_run(self, run: Run) -> None:
        """Name what ended the last run where it left no decision: Slurm took the job from it
        (a node of it stopped answering, its batch host among them) and requeued it."""
        path = self.environ.get(protocol.EVENTS_FILE_VAR)
        told = events.read(Path(path)) if path else []
        last = events.undecided(told, run.restart - 1)
        if last is None:
            return
        from slurmddp.preemption import decision, nodes, slurm

        lost = nodes.not_responding(slurm.show_nodes(last))
        cause = f"node lost: {','.join(lost)}" if lost else "requeued by Slurm"
        why = (f"Slurm lost {', '.join(lost)} (not responding: the machine, its slurmd or its "
               "link)" if lost else "Slurm requeued the job")  # fmt: skip
        # An elastic job's lost batch host: an agent of another node requeued it (launch.stranded).
        by = next((f"the agent on {e.get('host')}" for e in told if e["kind"] == "agent"
                   and e.get("run") == run.restart - 1 and e.get("requeued")), "Slurm")  # fmt: skip
        line = (f"run {run.restart} on {last or 'its nodes'} ended without a decision: {why}; "
                f"requeued by {by}")
        _say(line)
        if lost:
            # Once back, a lost node's step daemon reports the end of the last run's step, by its
            # id: the step ids count from 0 again in each run, and Slurm (24.11, after a requeue
            # by `scontrol requeue`: an elastic job's agent's, launch.stranded) took the report
            # for this run's step of that id and cancelled it. So the ids the last run's steps
            # of the supervisor had (its own empty steps', the preflight's, the step's: the setup
            # lines' are the same in both runs, and long done) go to empty steps first.
            before = (events.start(told, run.restart - 1) or {}).get("spacers")
            before = before if type(before) is int and 0 <= before < 100 else 0  # else not ours
            self._spacers = before + (2 if self.plan.preflight else 1)
            _say(f"{', '.join(lost)} may report the end of run {run.restart}'s step once back, "
                 "which Slurm would take for this run's step of the same id: "
                 f"{self._spacers} empty step{'s' if self._spacers > 1 else ''} first")
        _, allowed = decision.requeue_budget(self.environ)
        events.emit("decision", self.environ, run=run.restart - 1, action="requeue", status=None,
                    cause=cause, left_behind=",".join(lost), lines=[line],
                    requeue=run.restart, allowed=allowed)  # fmt: skip

    def _fence_if_cut_off(self, run: Run) -> None:
        """Watch the route to slurmctld (`fence`): cut off past SlurmdTimeout, this run ends."""
        from slurmddp.preemption import slurm

        where = fence.controller(slurm.scontrol("show", "config").stdout)
        if where is None:
            return
        node = self.environ.get("SLURMD_NODENAME", "")

        def fenced(seconds: float) -> None:
            # The step's launcher and what it started (srun's shepherd among them), before any
            # can cancel the next run's step of the same id; this node's tasks of the run.
            step = self._step
            launched = [] if step is None else [step.pid, *fence.descendants(step.pid)]
            fence.kill([*launched, *fence.tasks_of(run.job_id, str(run.restart), node,
                                                   fence.environs(), (os.getpid(), os.getppid()))])
            _say(f"{node or 'this node'} has had no route to slurmctld ({', '.join(where.hosts)}) "
                 f"for {seconds:.0f} s, over its SlurmdTimeout ({where.slurmd_timeout_s:.0f} s): "
                 "Slurm has taken the job from it to run it again elsewhere; this run's step and "
                 "tasks here are ended (fenced)")
            os._exit(protocol.FENCED_STATUS)

        fence.watch(where, fenced)

    def _start_run(self, job_dir: Path) -> None:
        _make_private_dir(job_dir)
        # An earlier run's (one killed before its decision leaves them behind); the hang
        # watchdog's stacks and report of an earlier run stay, its working state goes.
        for name in (protocol.REQUEUE_FILE_VAR, protocol.FAILURE_FILE_VAR,
                     protocol.STOP_FILE_VAR, protocol.NODES_LOST_FILE_VAR):  # fmt: skip
            if path := self.environ.get(name):
                Path(path).unlink(missing_ok=True)
        if hang := self.environ.get(protocol.HANG_DIR_VAR):
            shutil.rmtree(Path(hang) / ".state", ignore_errors=True)
        if stop_file := self.environ.get(protocol.STOP_FILE_VAR):
            self.stop_file = Path(stop_file)
            self._leave_stop()

    def _run_step(self, step: Step) -> int:
        """Run `step` to its end, passing the stop signal on; its exit status (128+n: signal n)."""
        try:
            out = None if step.output is None else open(step.output, "ab")  # noqa: SIM115
        except OSError as e:
            _say(f"cannot open {step.output}: {e.strerror}")
            return protocol.INTERNAL_ERROR
        try:
            proc = subprocess.Popen(step.argv, stdout=out, stderr=None if out is None else out)
        except OSError as e:
            _say(f"cannot start {step.argv[0]}: {e.strerror}")
            return 127
        finally:
            if out is not None:
                out.close()
        self._step, self._step_started = proc, time.monotonic()
        if self.plan.signal in self.received:  # taken between the check and the start
            self._pass_on()
        status = proc.wait()  # a handler runs meanwhile; the wait goes on after it (PEP 475)
        self._step = None
        return status if status >= 0 else 128 - status

    def _decide(self, run: Run, status: int | None, preflight_status: int | None,
                batch_log: Path | None, log_start: int) -> int:  # fmt: skip
        from slurmddp.preemption import decision, slurm
        from slurmddp.supervisor import outcome

        ended = outcome.read(self.environ, batch_log=batch_log, log_start=log_start,
                             elastic=self.plan.elastic)  # fmt: skip
        for hang in ended.verdicts:  # which ranks hung, and where
            print(hang, file=sys.stderr, flush=True)
            events.emit("hang", self.environ, lines=hang.splitlines())
        job = slurm.show_job(run.job_id)
        partition = slurm.show_partition(self.environ.get("SLURM_JOB_PARTITION", ""))
        facts = decision.facts_from(self.environ, step_status=status, received=tuple(self.received),
                                    job=job, partition=partition, elastic=self.plan.elastic,
                                    preflight_status=preflight_status,
                                    **ended.facts())  # fmt: skip
        verdict = decision.decide(facts)
        for line in verdict.lines:
            _say(line)
        verdict = slurm.carry_out(verdict, facts, run.job_id, self.environ, _say)
        counted = {"requeue": facts.restart + 1, "allowed": facts.allowed} \
            if verdict.action == "requeue" else {}  # fmt: skip
        events.emit("decision", self.environ, action=verdict.action, status=verdict.status,
                    cause=decision.cause(facts, verdict), left_behind=verdict.left_behind,
                    lines=list(verdict.lines), **counted)  # fmt: skip
        done = self.environ.get(protocol.DONE_FILE_VAR)
        if verdict.action == "finished" and done:
            Path(done).touch()  # a requeue racing this exit must not run the job again
        return verdict.status

    def _on_stop(self, signum: int, frame: object) -> None:
        if self.plan.signal in self.received:  # the shell passes on again what came before
            return
        self.received.append(self.plan.signal)
        self._leave_stop()
        self._pass_on()

    def _on_term(self, signum: int, frame: object) -> None:
        # Only noted: Slurm sends TERM to every step itself, and srun would answer a TERM passed
        # on by killing its step.
        if "TERM" not in self.received:
            self.received.append("TERM")

    def _leave_stop(self) -> None:
        """The stop signal, in the stop file, for ranks not yet able to take it."""
        if self.stop_file is not None and self.plan.signal in self.received:
            with contextlib.suppress(OSError):
                self.stop_file.write_text(f"{self.plan.signal}\n")

    def _pass_on(self) -> None:
        """The stop signal to the step: srun passes it on to every task; not in srun's first
        seconds, which it would kill or drop (docs/slurm-behaviour.md, Q6)."""
        step = self._step
        if step is None:
            return
        early = self._step_started + protocol.SRUN_SETTLE_S - time.monotonic()
        if early <= 0:
            self._signal(step)
            return
        timer = threading.Timer(early, self._signal, (step,))
        timer.daemon = True
        timer.start()

    def _signal(self, step: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            step.send_signal(self.stop)  # nothing once the step is reaped


def _make_private_dir(path: Path) -> None:
    """`path` and its parents, never world-writable, whatever the umask."""
    old = os.umask(0)
    try:
        os.umask(old | 0o002)
        path.mkdir(parents=True, exist_ok=True)
    finally:
        os.umask(old)


def _log_position() -> tuple[Path | None, int]:
    """The batch log (this process's stdout, appended to across runs) and its size: srun's
    messages of this run begin there."""
    try:
        log = Path(os.readlink("/proc/self/fd/1"))
        return (log, log.stat().st_size) if log.is_file() else (None, 0)
    except OSError:
        return None, 0


def _say(line: str) -> None:
    print(f"slurmddp: {line}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slurmddp.supervisor --plan JSON [--received SIGNALS] [--notify PID]``: one run
    of a job."""
    p = argparse.ArgumentParser(prog="python -m slurmddp.supervisor")
    p.add_argument("--plan", required=True, help="the job's plan, as the batch script hands it")
    p.add_argument("--received", default="", metavar="SIGNALS",
                   help="the signals the batch shell took before this process started")
    p.add_argument("--notify", type=int, metavar="PID",
                   help="the batch shell, told with SIGURG once this process listens")  # fmt: skip
    args = p.parse_args(argv)
    try:
        plan = Plan.from_json(args.plan)
        supervisor = Supervisor(plan, os.environ)
    except (ValueError, KeyError, TypeError) as e:
        _say(f"the batch script's plan cannot be read ({e}): submit the job again with this "
             "slurmddp")  # fmt: skip
        return protocol.USAGE_ERROR
    for name in args.received.split():
        if name in (plan.signal, "TERM") and name not in supervisor.received:
            supervisor.received.append(name)
    supervisor.listen()
    if args.notify:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(args.notify, READY_SIGNAL)
    return supervisor.run()

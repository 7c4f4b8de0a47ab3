"""Why a run ended and what happens to the job next: the requeue policy, in one place.

`decide` is pure: facts in, a `Decision` out. Its callers gather the facts and carry it out
(`slurmddp.preemption.slurm`):

- the supervisor of a ``slurmddp submit`` job (`slurmddp.supervisor`), after its step, also
  under ``--local`` (with stand-ins of Slurm's clients);
- rank 0 in a user's own batch script (`slurmddp.preemption.api.requeue`), with the same facts;
- a batch script of an earlier slurmddp's template (a user's own ``--template``): ``python -m
  slurmddp.preemption.decision`` reads ``scontrol show job -o`` and ``show partition -o`` on
  stdin and the step's outcome from its options, prints its messages on stderr and one line
  ``ACTION STATUS TARGET EXCLUDE LEFT_BEHIND`` on stdout (`main`).

The rules, first match wins:

0. The supervisor (or rank 0) could not requeue the job as decided: if Slurm's record shows the
   requeue went through anyway (its answer was lost), nothing to do; otherwise the job stops.
1. The ranks reached `mark_done()`: the work is done, whatever happened after (the step fails
   if it ended non-zero, unless elastic: a node lost along the way ends it so).
   The hang watchdog ended the run (`slurmddp.watchdog`): the job fails (its report says why),
   unless its suspects are stuck on their own on one node: then it is requeued without that
   node (below).
2. Slurm requeued the job already (a preemption with GraceTime=0 does at once; its Restarts
   count is then ahead of this run's): nothing to do.
3. The job is marked not to be requeued (``scontrol update JobId=N Requeue=0``): it stops.
4. Slurm preempted the job (it stamps PreemptTime on it; a requeue clears it): requeue it,
   however the ranks ended (stopped at their agreed step, ended by TERM, a framework that exits
   0 on SIGTERM, or not started yet). Slurm signals a preemption by the user signal or by
   SIGTERM depending on its configuration: which signal came says nothing. A PreemptMode=CANCEL
   partition cancels the job when GraceTime ends: a requeue before that wins.
5. The ranks stopped on the stop signal (the time limit's warning, or sent by hand): requeue.
   On SIGTERM without preemption (scancel, the hard time limit): never requeue.
6. A stop signal came before the step started: requeue. The preflight (``--preflight``) failed:
   requeue without the node it failed on (below), else the job fails.
7. The step ended 0: finished. Otherwise it failed; elastic, with fewer nodes left than the
   minimum (an agent said so), the job is requeued; a failure laid on a node (a rank of it ended
   by SIGBUS, a broken GPU: `slurmddp.preemption.nodes`) requeues the job without that node.

Any requeue of rules 4 to 7 that leaves no node behind leaves out, under ``--leave-slow-nodes``,
a node the watchdog named slow in the run (`slurmddp.watchdog.pace`), where the job fits without it.

A requeue without a node counts against the same budget, and happens only while the partition
keeps enough nodes for the job (the verdict then names the job's new ExcNodeList).

docs/slurm-behaviour.md has what Slurm 22.05 was seen to do in each configuration.

Requeues are counted by SLURM_RESTART_COUNT and capped by $SLURMDDP_MAX_REQUEUES; at the cap the
job stops with `NOT_REQUEUED_STATUS` and Slurm is told not to requeue it either. Which id
``scontrol requeue`` takes (the array task's ``<job>_<task>``, else the job's) is settled here
too (`requeue_target`): the shell only runs what the verdict names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from slurmddp.errors import EnvError, UserError, one_line
from slurmddp.preemption import nodes
from slurmddp.protocol import (
    ACTIONS,
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL,
    DEFAULT_SIGNAL_LEAD_S,
    HANG_STATUS,
    LEAVE_SLOW_NODES_VAR,
    MAX_REQUEUES_VAR,
    NOT_REQUEUED_STATUS,
    SIGNAL_LEAD_VAR,
    USAGE_ERROR,
)

# The protocol's names among these are kept for modules that imported them from here.
__all__ = [
    "ACTIONS", "DEFAULT_MAX_REQUEUES", "MAX_REQUEUES_VAR", "NOT_REQUEUED_STATUS", "SIGNAL_LEAD_VAR",
    "Decision", "Facts", "cause", "decide", "facts_from", "job_fields", "main", "partition_fields",
    "requeue_budget", "requeue_target", "seconds", "seconds_left",
]  # fmt: skip

# A stop signal within this long of the lead before the end is the time limit's warning
# (slurmctld sends it at its first time-limit sweep, every 30 s, from 30 s before the lead:
# up to 60 s early).
_LIMIT_SLACK_S = 60


@dataclasses.dataclass(frozen=True)
class Facts:
    """What is known when a run ends."""

    step_status: int | None  # None: the step never started
    asked: str | None = None  # the stop the ranks agreed on and checkpointed at (USR2, TERM...)
    done: bool = False  # mark_done() was reached
    protocol_used: bool = True  # the script called should_stop()
    received: tuple[str, ...] = ()  # signals the batch script and its supervisor got
    job: Mapping[str, str] = dataclasses.field(default_factory=dict)  # scontrol show job -o
    restart: int = 0
    allowed: int = DEFAULT_MAX_REQUEUES
    target: str = ""
    stop_signal: str = DEFAULT_SIGNAL
    lead_s: int = DEFAULT_SIGNAL_LEAD_S
    # The requeue a `requeue` verdict asked for failed: None (not tried, or it worked), else what
    # scontrol said (may be empty). `job` is then Slurm's record read after the attempt.
    requeue_error: str | None = None
    hung: bool = False  # the hang watchdog ended the run
    elastic: bool = False  # torchrun's agents go on without a lost node (slurmddp submit)
    nodes_lost: str | None = None  # an agent's line: too few nodes came back to the rendezvous
    suspects: tuple[tuple[int, str], ...] = ()  # the hang's suspects: (rank, node)
    seen: str | None = None  # srun's first error line of this run ("srun: error: NODE: task...")
    signalled: str | None = None  # its first of a task ended by a node's signal (SIGBUS, SIGILL)
    aborted: str | None = None  # the node srun aborted the step for (its step daemon lost there)
    reported: str | None = None  # the first failure a rank reported (the failure file's first line)
    preflight_status: int | None = None  # the preflight's status when it failed
    slow: tuple[tuple[str, str], ...] = ()  # nodes the watchdog's pace named slow: (node, why)
    leave_slow: bool = False  # --leave-slow-nodes: a requeue leaves the first of them out
    partition: Mapping[str, str] = dataclasses.field(default_factory=dict)  # show partition -o


@dataclasses.dataclass(frozen=True)
class Decision:
    """What happens to the job: an `ACTIONS` word, the exit status, messages for the log."""

    action: str
    status: int
    lines: tuple[str, ...] = ()
    exclude: str = ""  # requeue: the job's ExcNodeList from now on ("": unchanged)
    left_behind: str = ""  # requeue: the node left behind, and why (for `slurmddp status`)


def decide(f: Facts) -> Decision:
    """What to do with the job once a run has ended (the rules in the module's docstring)."""
    d = _decide(f)
    if d.action != "requeue" or d.exclude or not (f.leave_slow and f.slow):
        return d
    node, why = f.slow[0]
    exclude, why_not = nodes.exclusion(node, f.job, f.partition)
    if exclude is None:
        return dataclasses.replace(d, lines=(*d.lines, (
            f"{node} was slow ({why}), but the job is not requeued without it: {why_not}")))
    return dataclasses.replace(d, exclude=exclude, left_behind=f"{node}: slow, {why}", lines=(
        *d.lines, f"{node} is left out as the job is requeued (--leave-slow-nodes): it was slow "
        f"({why}); the job now excludes {exclude}"))


def _decide(f: Facts) -> Decision:
    if f.requeue_error is not None:
        return _after_failed_requeue(f)
    notes = _unused_protocol(f)
    if f.done:
        if f.step_status in (0, None):
            return Decision("done", 0, notes)
        if f.elastic:  # a lost node's agent, or a spare's whose store went first, ends non-zero
            return Decision("done", 0, (*notes, *_failure(f).summary(), (
                "the work is done: the other nodes finished it (elastic: a node lost, or a spare "
                "whose rendezvous closed under it, ends non-zero)")))
        return Decision("fail", f.step_status, (*notes, *_failure(f).summary()))
    if f.hung:
        return _without_node(f, nodes.hang_blame(f.suspects), "hung", notes, Decision(
            "fail", HANG_STATUS, (*notes, (
                f"{_job(f)} ended at restart {f.restart}: the hang watchdog judged the run hung "
                "(above: which ranks); not requeued"))))
    if _requeued_already(f):
        # Slurm requeued it as it ended (a preemption with GraceTime=0 does, with no PreemptTime
        # to show for it): its count of restarts is ahead of this run's.
        why = f"{f.asked} after" if f.asked else "after"
        return Decision("stop", 0, (*notes, f"{_job(f)} was requeued by Slurm itself ({why} "
                                    f"restart {f.restart}); it resumes from its checkpoint"))
    preempted = _stamped(f.job.get("PreemptTime"))
    if f.job.get("Requeue") == "0" and (f.asked or f.step_status is None or preempted):
        return Decision("stop", NOT_REQUEUED_STATUS, (*notes, (
            f"{_job(f)} stopped ({f.asked or ('preempted' if preempted else 'before its step')}) "
            f"at restart {f.restart}: the job is marked not to be requeued (Requeue=0)")))
    if preempted:
        if f.asked:
            why = f"preempted, {f.asked}"
        elif f.step_status is None:
            why = "preempted before the step started"
        else:
            why = (f"preempted; the step ended with status {f.step_status} before the ranks "
                   "agreed to stop")  # fmt: skip
        return _requeue(f, why, notes)
    if f.asked:
        if f.asked == "TERM":
            return Decision("stop", NOT_REQUEUED_STATUS, (*notes, (
                f"{_job(f)} stopped (TERM, {_term_cause(f)}) at restart {f.restart} after "
                f"its checkpoint: not requeued, as only a preemption or {f.stop_signal} "
                "requeues a job")))
        return _requeue(f, f"{_stop_cause(f)}, {f.asked}", notes)
    if f.step_status is None:
        if f.preflight_status is not None and not f.received:
            preflight = nodes.Failure(f.preflight_status, f.seen, f.reported, f.signalled,
                                      f.aborted)
            said = (*notes, *preflight.summary("the preflight"))
            return _without_node(f, preflight.blame(preflight=True), "failed its preflight",
                                 said, Decision("fail", f.preflight_status, said))  # fmt: skip
        if f.stop_signal in f.received:
            return _requeue(f, f"{_stop_cause(f)}, {f.stop_signal}, before the step started",
                            notes)  # fmt: skip
        return Decision("stop", NOT_REQUEUED_STATUS, (*notes, (
            f"{_job(f)} ended by {', '.join(f.received) or 'a signal'} before the step "
            f"started: not requeued")))
    if f.step_status == 0:
        return Decision("done" if f.received else "finished", 0, notes)
    if f.received:
        notes = (*notes, f"the step ended with status {f.step_status} after "
                 f"{', '.join(f.received)}; no rank asked for a requeue")  # fmt: skip
    failure = _failure(f)
    said = (*notes, *failure.summary())
    if f.elastic and f.nodes_lost:
        return _requeue(f, "nodes lost: fewer than the minimum rejoined torchrun's rendezvous",
                        (*said, f.nodes_lost.removeprefix("slurmddp: ")))  # fmt: skip
    return _without_node(f, failure.blame(), "failed", said,
                         Decision("fail", f.step_status, said))


def cause(f: Facts, d: Decision) -> str:
    """Why the run ended, in a few words, for the job's story (`slurmddp.story`): finished,
    preempted, time limit, signal, hang, node failure, nodes lost, crash..."""
    if f.requeue_error is not None:
        return "requeue failed"
    if d.action in ("done", "finished"):
        return "finished"
    if f.hung:
        return "hang"
    if _stamped(f.job.get("PreemptTime")) or _requeued_already(f):
        return "preempted"
    if f.asked == "TERM":
        return _term_cause(f)
    if f.asked or (f.step_status is None and f.stop_signal in f.received):
        return _stop_cause(f)
    if f.step_status is None:
        return "preflight failed" if f.preflight_status is not None else "stopped before the step"
    if f.elastic and f.nodes_lost:
        return "nodes lost"
    return "node failure" if d.left_behind else "crash"


def _failure(f: Facts) -> nodes.Failure:
    return nodes.Failure(f.step_status or 0, f.seen, f.reported, f.signalled, f.aborted)


def _without_node(f: Facts, blame: nodes.Blame | None, what: str, said: tuple[str, ...],
                  otherwise: Decision) -> Decision:  # fmt: skip
    """A requeue without the node the run's end is laid on, when there is one and the job may and
    can be requeued without it; else `otherwise`, with a line saying why not."""
    if blame is None:
        return otherwise
    exclude: str | None = None
    if f.job.get("Requeue") == "0":
        why_not = "the job is marked not to be requeued (Requeue=0)"
    elif f.restart >= f.allowed:
        why_not = f"the limit of {f.allowed} requeues (--max-requeues) is reached"
    else:
        exclude, why_not = nodes.exclusion(blame.node, f.job, f.partition)
    if exclude is None:
        return dataclasses.replace(otherwise, lines=(*otherwise.lines, (
            f"{blame.node} looks broken ({blame.why}), but the job is not requeued without it: "
            f"{why_not}")))
    return Decision("requeue", 0, (*said, (
        f"{_job(f)} {what} at restart {f.restart} because of node {blame.node} ({blame.why}): "
        f"requeued without it ({f.restart + 1} of {f.allowed}); the job now excludes {exclude}")),
        exclude=exclude, left_behind=f"{blame.node}: {blame.why}")


def _requeue(f: Facts, why: str, notes: tuple[str, ...]) -> Decision:
    after = " after its checkpoint" if f.asked else ""
    if f.restart >= f.allowed:
        return Decision("final", NOT_REQUEUED_STATUS, (*notes, (
            f"{_job(f)} stopped ({why}) at restart {f.restart}{after}: not requeued, the "
            f"limit of {f.allowed} requeues (--max-requeues) is reached; submit again to resume")))
    return Decision("requeue", 0, (*notes, (
        f"{_job(f)} stopped ({why}) at restart {f.restart}{after}: requeued "
        f"({f.restart + 1} of {f.allowed})")))


def _after_failed_requeue(f: Facts) -> Decision:
    # The requeue's own TERM can end scontrol before it answers: Slurm's record says whether it
    # went through.
    if _requeued_already(f):
        return Decision("stop", 0)
    said = f": {f.requeue_error}" if f.requeue_error else ""
    return Decision("stop", NOT_REQUEUED_STATUS, (
        f"scontrol requeue {f.target or 'of the job'} failed{said}: the job ends here; submit "
        "again to resume",))  # fmt: skip


def _job(f: Facts) -> str:
    return f"job {f.target}" if f.target else "the job"


def _unused_protocol(f: Facts) -> tuple[str, ...]:
    """One line when a stop came and the script never asked for it."""
    if f.protocol_used or f.done:
        return ()
    what = [*f.received] + (["the preemption"] if _stamped(f.job.get("PreemptTime")) else [])
    if not what:
        return ()
    return (f"the script never called slurmddp.should_stop(), so {' and '.join(what)} reached "
            "it unannounced: it saved no checkpoint of slurmddp's (call should_stop() at every "
            "step to stop together, checkpoint and requeue)",)  # fmt: skip


def _stop_cause(f: Facts) -> str:
    left = seconds_left(f.job)
    if left is not None and 0 <= left <= f.lead_s + _LIMIT_SLACK_S:
        return "time limit"
    return "signal"


def _term_cause(f: Facts) -> str:
    left = seconds_left(f.job)
    if f.job.get("Reason") == "TimeLimit" or (left is not None and left <= 1):
        return "time limit reached"
    # scancel: the job is COMPLETING while its processes are being ended, then CANCELLED.
    if f.job.get("JobState") in ("CANCELLED", "COMPLETING"):
        return "cancelled"
    return "sent by hand"


def _requeued_already(f: Facts) -> bool:
    restarts = f.job.get("Restarts", "")
    return (restarts.isdigit() and int(restarts) > f.restart) or f.job.get("JobState") in (
        "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def _stamped(value: str | None) -> bool:
    return value not in (None, "", "None", "Unknown")


_DURATION = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)")


def seconds(text: str | None) -> int | None:
    """Slurm's [days-][hours:]minutes:seconds in seconds; None for UNLIMITED and the like."""
    m = _DURATION.fullmatch(text or "")
    if m is None:
        return None
    days, hours, minutes, secs = (int(x or 0) for x in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def seconds_left(job: Mapping[str, str]) -> int | None:
    """TimeLimit - RunTime, both from slurmctld (no clock of ours involved); None if unlimited."""
    limit, ran = seconds(job.get("TimeLimit")), seconds(job.get("RunTime"))
    return None if limit is None or ran is None else limit - ran


def partition_fields(lines: Sequence[str]) -> dict[str, str]:
    """The fields of the ``scontrol show partition -o`` line among `lines` (empty if none)."""
    return next((job_fields(line) for line in lines if line.startswith("PartitionName=")), {})


def job_fields(text: str) -> dict[str, str]:
    """The fields of ``scontrol show job -o`` (the first word of each value).

    Values may be free text with ``Key=`` inside: JobName, Comment, Command, WorkDir and, from
    Slurm 25.11, SubmitLine (the whole sbatch command line). JobName is read up to UserId=, which
    follows it in every version, and the other free-text fields come after every field read
    here, so the first value of a key is Slurm's own.
    """
    named = _JOB_NAME.match(text)
    if named:
        text = text[: named.start(1)] + text[named.end(1) :]
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(?:^|\s)(\w+)=(\S*)", text):
        fields.setdefault(key, value)
    return fields


_JOB_NAME = re.compile(r"\s*JobId=\S*\s+JobName=(.*?)\s+UserId=", re.DOTALL)


def requeue_target(environ: Mapping[str, str]) -> str:
    """The id `scontrol requeue` takes: ``<array job>_<task>`` for an array task, else the job."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return environ.get("SLURM_JOB_ID", "")


def requeue_budget(environ: Mapping[str, str]) -> tuple[int, int]:
    """(restarts so far, requeues allowed), from SLURM_RESTART_COUNT and $SLURMDDP_MAX_REQUEUES."""
    restarts = environ.get("SLURM_RESTART_COUNT") or "0"
    allowed = environ.get(MAX_REQUEUES_VAR) or str(DEFAULT_MAX_REQUEUES)
    if not (restarts.isascii() and restarts.isdigit() and allowed.isascii() and allowed.isdigit()):
        raise EnvError(
            f"SLURM_RESTART_COUNT={restarts!r} or {MAX_REQUEUES_VAR}={allowed!r} is not a count"
        )
    return int(restarts), int(allowed)


def facts_from(environ: Mapping[str, str], **known: Any) -> Facts:
    """`Facts` with the job's budget, target, stop signal and lead taken from `environ`."""
    from slurmddp.preemption.signals import stop_signal

    restart, allowed = requeue_budget(environ)
    lead = environ.get(SIGNAL_LEAD_VAR, "")
    return Facts(restart=restart, allowed=allowed, target=requeue_target(environ),
                 stop_signal=stop_signal(environ).name[3:],
                 lead_s=int(lead) if lead.isdigit() else DEFAULT_SIGNAL_LEAD_S,
                 leave_slow=environ.get(LEAVE_SLOW_NODES_VAR, "") == "1", **known)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """The batch script's decision (``-m slurmddp.preemption.decision``), facts as options.

    Prints the messages on stderr and ``ACTION STATUS TARGET EXCLUDE LEFT_BEHIND...`` on stdout
    (TARGET, EXCLUDE ``-``: none; LEFT_BEHIND, the rest of the line: the node and why).
    """
    p = argparse.ArgumentParser(prog="python -m slurmddp.preemption.decision")
    p.add_argument("--step-status", type=int, help="the step's exit status (absent: not started)")
    p.add_argument("--asked", help="the reason the ranks left in the requeue file")
    p.add_argument("--done", action="store_true", help="the ranks reached mark_done()")
    p.add_argument("--protocol-unused", action="store_true",
                   help="the script never called should_stop()")  # fmt: skip
    p.add_argument("--hung", action="store_true", help="the hang watchdog ended the run")
    p.add_argument("--elastic", action="store_true", help="the agents go on without a lost node")
    p.add_argument("--nodes-lost", help="an agent's line: too few nodes rejoined its rendezvous")
    p.add_argument("--suspect", action="append", default=[], metavar="RANK:NODE",
                   help="a rank the hang watchdog named, and its node")
    p.add_argument("--srun-error", help="srun's first error line of this run")
    p.add_argument("--rank-failure", help="the first failure a rank reported")
    p.add_argument("--preflight-status", type=int, help="the preflight's status, when it failed")
    p.add_argument("--received", action="append", default=[], help="a signal the shell got")
    p.add_argument("--requeue-failed", action="store_true",
                   help="the requeue of the last verdict failed (stdin: the job after it)")
    args = p.parse_args(argv)
    # stdin: ``scontrol show job -o``, then ``scontrol show partition -o`` of its partition.
    shown = sys.stdin.read().splitlines()
    job = "\n".join(line for line in shown if not line.startswith("PartitionName="))
    suspects = [s.partition(":") for s in args.suspect]
    try:
        facts = facts_from(os.environ, step_status=args.step_status, asked=args.asked or None,
                           done=args.done, protocol_used=not args.protocol_unused,
                           received=tuple(dict.fromkeys(args.received)),
                           job=job_fields(job), partition=partition_fields(shown),
                           requeue_error="" if args.requeue_failed else None,
                           hung=args.hung, elastic=args.elastic, seen=args.srun_error or None,
                           nodes_lost=args.nodes_lost or None,
                           reported=args.rank_failure or None,
                           preflight_status=args.preflight_status,
                           suspects=tuple((int(r), n) for r, _, n in suspects if r.isdigit()),
                           )  # fmt: skip
    except UserError as e:
        print(f"slurmddp: {one_line(e)}", file=sys.stderr)
        return USAGE_ERROR
    decision = decide(facts)
    for line in decision.lines:
        print(f"slurmddp: {line}", file=sys.stderr)
    # The shell reads ACTION STATUS TARGET EXCLUDE and the rest of the line as why.
    print(decision.action, decision.status, facts.target or "-", decision.exclude or "-",
          *[decision.left_behind] if decision.left_behind else [])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A job's story in numbers: its runs, and the summary a user asks first. Pure: events in.

Steps are the stop protocol's: the step a run resumed at (its ``resumed`` event), plus the calls
of ``should_stop()`` it made (one a step in the README's loop). A run's rate comes from its first
step to its last known count (the watchdog's progress, the agreed stop, the work done); the
steps a run made past the step the next one resumed at are lost, and so is the time they took.
Goodput is the time that made kept steps over the time the job held its nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slurmddp.story.events import FINAL_ACTIONS, Event

STARTUP = "startup"  # from a run's start to its first step (the rendezvous, the resume)
FINISHING = "finishing"  # from the last step of the last run to its end


@dataclasses.dataclass
class Run:
    """One run of the job (Slurm's restart count), as its events tell it."""

    run: int
    start: float | None = None
    end: float | None = None
    nodes: str = ""
    first_step_t: float | None = None
    resumed: int = 0  # the step it started from
    resumed_from: str = ""
    counts: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (t, calls)
    action: str | None = None  # the decision after it
    cause: str = ""
    left_behind: str = ""

    @property
    def reached(self) -> int:
        """The step it got to."""
        return self.resumed + max((c for _, c in self.counts), default=0)

    @property
    def rate(self) -> float | None:
        """Steps a second, from its first step to its last known count."""
        if self.first_step_t is None or not self.counts:
            return None
        t, c = max(self.counts, key=lambda tc: tc[1])
        return (c - 1) / (t - self.first_step_t) if c > 1 and t > self.first_step_t else None


@dataclasses.dataclass(frozen=True)
class Summary:
    """What happened to a job, in numbers (`summarize`)."""

    runs: int
    requeues: int
    ended: bool
    step: int  # the last step reached
    steps_lost: dict[str, int]  # by the cause of the run's end
    time_lost_s: dict[str, float]  # by cause, and startup and finishing
    held_s: float  # the runs' time on their nodes
    productive_s: float | None  # of that, the time that made the steps kept (None: no rate)
    elapsed_s: float  # from the first run's start to the last's end (or now): queue time too
    last_checkpoint: dict[str, Any] | None  # its step, path, time

    @property
    def goodput(self) -> float | None:
        """Productive time over the time the job held its nodes."""
        if self.productive_s is None or self.held_s <= 0:
            return None
        return min(1.0, self.productive_s / self.held_s)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["goodput"] = None if self.goodput is None else round(self.goodput, 4)
        for key in ("held_s", "productive_s", "elapsed_s"):
            if out[key] is not None:
                out[key] = round(out[key], 1)
        out["time_lost_s"] = {k: round(v, 1) for k, v in self.time_lost_s.items()}
        return out

    def lines(self) -> list[str]:
        """The summary in words: a line each (one, for a script that never counted a step: it
        does not use the stop protocol)."""
        runs = f"{self.runs} run{'s' * (self.runs != 1)}, {self.requeues} requeue" \
            f"{'s' * (self.requeues != 1)}"  # fmt: skip
        if not self.step:
            return [f"{runs}, {self.elapsed_s:.0f} s from start to end"]
        lost = ", ".join(f"{n} ({cause})" for cause, n in self.steps_lost.items() if n) or "none"
        waste = ", ".join(f"{s:.0f} s ({cause})" for cause, s in self.time_lost_s.items()
                          if s >= 0.5) or "none"  # fmt: skip
        good = "unknown (no step rate: no run counted two steps apart in time)" \
            if self.goodput is None else f"{self.goodput:.1%} of {self.held_s:.0f} s on the nodes"
        return [f"{runs}, {self.step} steps, {self.elapsed_s:.0f} s from start to end",
                f"steps lost: {lost}; time lost: {waste}", f"goodput: {good}"]  # fmt: skip


def runs(events: list[Event]) -> list[Run]:
    """The job's runs in order, each with what its events say."""
    by_run: dict[int, Run] = {}
    for e in events:
        r = by_run.setdefault(int(e.get("run", 0)), Run(int(e.get("run", 0))))
        kind, t = e["kind"], float(e["t"])
        if kind == "run":
            r.start, r.nodes = t, str(e.get("nodes", ""))
        elif kind == "training":
            r.first_step_t = t
            r.counts.append((t, 1))
        elif kind == "resumed":
            r.resumed, r.resumed_from = int(e.get("step", 0)), str(e.get("source", ""))
        elif kind in ("stop", "done") and "calls" in e:
            r.counts.append((t, int(e["calls"])))
        elif kind == "progress":
            counts = [int(c) for c in (e.get("counts") or {}).values()]
            if counts:
                r.counts.append((t, min(counts)))  # the job goes at its slowest rank's pace
        elif kind == "decision":
            r.end, r.action = t, e.get("action")
            r.cause, r.left_behind = str(e.get("cause", "")), str(e.get("left_behind", ""))
    for r in by_run.values():  # a run the supervisor did not record (an earlier template's)
        if r.start is None:
            r.start = min((t for t, _ in r.counts), default=r.end)
    return [by_run[k] for k in sorted(by_run)]


def _position(told: list[Run]) -> int:
    """The step training is at: the last run's, or where the runs before it got to when it has
    not trained yet (ended in its start-up, or starting)."""
    for r in reversed(told):
        if r.counts or r.resumed:
            return r.reached
    return 0


def summarize(events: list[Event], now: float) -> Summary:
    """The summary of `events`; a run still going counts up to `now`."""
    told = runs(events)
    steps_lost: dict[str, int] = {}
    lost_s: dict[str, float] = {}
    held = productive = 0.0
    for i, r in enumerate(told):
        start = r.start if r.start is not None else now
        end = r.end if r.end is not None else now
        held += max(0.0, end - start)
        following = told[i + 1] if i + 1 < len(told) else None
        kept = r.reached - r.resumed
        cause = r.cause or "unknown"
        if following is not None:
            lost = max(0, r.reached - following.resumed)
            kept -= lost
            if lost:
                steps_lost[cause] = steps_lost.get(cause, 0) + lost
        rate = r.rate
        # Its first step belongs to training: start-up ends where that step began.
        made = max(0, kept) / rate if rate else 0.0
        first = r.first_step_t - 1 / rate if rate and r.first_step_t else r.first_step_t
        startup = max(0.0, min(first if first is not None else end, end) - start)
        productive += made
        lost_s[STARTUP] = lost_s.get(STARTUP, 0.0) + startup
        if r.end is None:
            continue  # still running: nothing lost yet but its start
        key = FINISHING if following is None and r.action in ("done", "finished") else cause
        lost_s[key] = lost_s.get(key, 0.0) + max(0.0, end - start - startup - made)
    starts = [r.start for r in told if r.start is not None]
    last_end = told[-1].end if told and told[-1].end is not None else now
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    last = checkpoints[-1] if checkpoints else None
    return Summary(
        runs=len(told), requeues=sum(r.action == "requeue" for r in told),
        ended=bool(told) and told[-1].action in FINAL_ACTIONS,
        step=_position(told), steps_lost=steps_lost, time_lost_s=lost_s,
        held_s=held, productive_s=productive if any(r.rate for r in told) else None,
        elapsed_s=max(0.0, last_end - min(starts)) if starts else 0.0,
        last_checkpoint=None if last is None else
        {"step": last.get("step"), "path": last.get("path"), "t": last["t"]},
    )  # fmt: skip

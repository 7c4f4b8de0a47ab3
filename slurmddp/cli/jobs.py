"""``slurmddp status|logs|cancel|report|profiles``: the jobs this user submitted, their stories,
and the profiles."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from slurmddp import files
from slurmddp.batch import jobs
from slurmddp.errors import SubmissionError, fail
from slurmddp.protocol import EXCLUDED_FILE_VAR, STATE_FILES
from slurmddp.story import summary


def add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="*", help="job ids (default: the 20 most recent)")
    help_v = "also a line per array task: its state, own job id, log directory"
    p.add_argument("-v", "--verbose", action="store_true", help=help_v)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per job: its state, record and story's summary")


def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write the page (default: <job directory>/report.html)")


def add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument("--rank", type=int, default=0, help="whose log (default 0)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")


def add_cancel(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="+", help="job ids")


def add_profiles(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", help="also show the settings this profile gives, with sources")
    p.add_argument("--json", action="store_true", help="the same, as one JSON object")


def status(opts: argparse.Namespace) -> int:
    records = [_record(j, opts.prog) for j in opts.job] if opts.job else jobs.recorded()[-20:]
    if not records and not opts.json:
        print("no jobs submitted yet")
        return 0
    current = jobs.job_states(records)  # one call to Slurm for all of them
    now = time.time()
    told = {r.job_id: summary.summarize(r.events(), now) for r in records}
    if opts.json:
        print(json.dumps([_as_json(r, current[r.job_id], told[r.job_id]) for r in records],
                         indent=1))  # fmt: skip
        return 0
    # An array's counts ("RUNNING 2, COMPLETED 1, PENDING 1") widen the column.
    width = max([13, *(len(s.state) + 1 for s in current.values())])
    print(f"{'JOB':>10}  {'STATE':<{width}}{'RUNS':>4} {'REQ':>3} {'ELAPSED':>9} {'STEP':>7} "
          f"{'CKPT':>7}  {'NAME':<21}DIRECTORY")  # fmt: skip
    for r in records:
        state, s = current[r.job_id], told[r.job_id]
        ckpt = s.last_checkpoint["step"] if s.last_checkpoint else "-"
        print(f"{r.job_id:>10}  {state.state:<{width}}{s.runs or '-':>4} {s.requeues:>3} "
              f"{_clock(s.elapsed_s) if s.runs else '-':>9} {s.step if s.runs else '-':>7} "
              f"{ckpt:>7}  {r.name:<21}{r.folder}")  # fmt: skip
        _left_behind(Path(r.folder) / r.job_id)
        if opts.verbose:
            for t in state.tasks:
                own = f"job {t.job_id}" if t.job_id else "-"
                logs = str(Path(r.folder) / t.job_id) if t.job_id else "(not started)"
                print(f"{t.task:>10}  {t.state:<{width}}{'':<{_STORY_WIDTH}}{own:<21}{logs}")
                if t.job_id:
                    _left_behind(Path(logs))
    # sacct answers from slurmdbd even while slurmctld is down, with states that may be stale.
    down = any(r.engine == "slurm" for r in records) and jobs.controller_down()
    if down:
        sys.stdout.flush()
        if jobs.from_controller():
            stale = f"{down}; without accounting (sacct) no job's state can be read"
        else:
            stale = f"{down}; the states above come from accounting (sacct) and may be out of date"
        fail(jobs.controller_unreachable(stale), prog=opts.prog, status=1)
    return 0


# RUNS, REQ, ELAPSED, STEP and CKPT with their spaces.
_STORY_WIDTH = 4 + 1 + 3 + 1 + 9 + 1 + 7 + 1 + 7 + 2


def _as_json(r: jobs.JobRecord, state: jobs.JobState, told: summary.Summary) -> dict[str, object]:
    return {"job_id": r.job_id, "state": state.state, "name": r.name, "engine": r.engine,
            "tasks": r.tasks, "directory": r.folder, "submitted": r.submitted,
            "events": str(r.events_path),
            "array_tasks": [dataclasses.asdict(t) for t in state.tasks],
            **told.to_dict()}  # fmt: skip


def _clock(seconds: float) -> str:
    """H:MM:SS (D-HH:MM:SS past a day), as Slurm shows elapsed time."""
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}-{text:0>8}" if days else text


def report(opts: argparse.Namespace) -> int:
    from slurmddp.story import report as story_report

    record = _record(opts.job, opts.prog)
    told = record.events()
    if not told:
        fail(f"job {record.job_id} has no story yet at {record.events_path}: it has not started, "
             "or its batch script is not slurmddp's", prog=opts.prog, status=1)  # fmt: skip
    state = jobs.states([record])[record.job_id]
    page = story_report.page(record.job_id, record.name, state, told, time.time())
    out = Path(opts.output) if opts.output else record.job_dir / "report.html"
    try:
        files.write_atomically(out, page)
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}", prog=opts.prog, status=1)
    print(out)
    return 0


def _left_behind(job_dir: Path) -> None:
    """A line per node the job was requeued without, and why (the supervisor's record)."""
    try:
        lines = (job_dir / dict(STATE_FILES)[EXCLUDED_FILE_VAR]).read_text().splitlines()
    except OSError:
        return
    for line in filter(None, lines):
        print(f"{'':>12}left behind {line}")


def logs(opts: argparse.Namespace) -> int:
    record = _record(opts.job, opts.prog)
    if not 0 <= opts.rank < record.tasks:
        fail(f"job {record.job_id} has ranks 0..{record.tasks - 1}, not {opts.rank}",
             prog=opts.prog)  # fmt: skip
    path = record.log(opts.rank)
    if opts.follow:
        followed = jobs.JobRecord(**{**record.__dict__, "log_pattern": str(path)})
        jobs.follow(followed, lambda: jobs.states([record])[record.job_id], sys.stdout)
        return 0
    if not path.exists():
        fail(f"no log yet at {path}: the job may still be pending", prog=opts.prog, status=1)
    sys.stdout.write(path.read_text(encoding="utf-8", errors="replace"))
    return 0


def cancel(opts: argparse.Namespace) -> int:
    """Cancel the jobs still queued or running; a job that had already ended is named with its
    state, not called cancelled. Exit status 0 once none of them runs, 1 if scancel failed."""
    records = [_record(j, opts.prog) for j in opts.job]
    current = jobs.states(records)
    ended = [r for r in records if jobs.is_final(current[r.job_id])]
    live = [r for r in records if r not in ended]
    if live:
        try:
            jobs.cancel(live)
        except SubmissionError as e:
            fail(str(e), prog=opts.prog, status=1)
        print("cancelled " + " ".join(r.job_id for r in live))
    for r in ended:
        print(f"job {r.job_id} had already ended ({current[r.job_id]}): nothing to cancel")
    return 0


def profiles(opts: argparse.Namespace) -> int:
    from slurmddp.batch.spec import config, profiles

    files = config.load_sources(Path.cwd(), os.environ)
    settings = config.resolve_settings({}, opts.profile, files) if opts.profile else None
    found = profiles.list_profiles(files)
    if opts.json:
        print(json.dumps({
            "profiles": [{"name": p.name, "file": str(p.file), "extends": p.extends,
                          "hidden_by": None if p.shadowed_by is None else str(p.shadowed_by),
                          "values": dict(p.values)} for p in found],
            "settings": None if settings is None else [
                {"key": k, "value": v, "source": s} for k, v, s in settings.rows()],
        }, indent=1, default=str))  # fmt: skip
        return 0
    print(profiles.format_profiles(found, settings))
    return 0


def _record(job_id: str, prog: str) -> jobs.JobRecord:
    record = jobs.find(job_id)
    if record is None:
        fail(f"job {job_id!r} was not submitted with slurmddp here: see 'slurmddp status'",
             prog=prog)  # fmt: skip
    return record

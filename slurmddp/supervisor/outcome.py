"""How a run ended, read from what it left: the ranks' files, srun's lines, the watchdog's verdicts.

Everything here reads; nothing decides (`slurmddp.preemption.decision` does) and nothing is
changed but the requeue file, which is taken once read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

from slurmddp.errors import HostlistError
from slurmddp.preemption import nodes
from slurmddp.protocol import (
    ASKED_FILE_VAR,
    DONE_FILE_VAR,
    FAILURE_FILE_VAR,
    HANG_DIR_VAR,
    NODES_LOST_FILE_VAR,
    REQUEUE_FILE_VAR,
)
from slurmddp.rank import hostlist

# srun names the task and node it saw end first (tasks of one node that end together share a line).
_SRUN_ERROR = re.compile(r"^srun: error: [^ ]+: tasks? [0-9,-]+: .*$", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The facts of a run's end that its files hold, as `decision.Facts` takes them."""

    asked: str | None = None
    done: bool = False
    protocol_used: bool = True
    nodes_lost: str | None = None
    seen: str | None = None
    signalled: str | None = None
    aborted: str | None = None
    reported: str | None = None
    hung: bool = False
    suspects: tuple[tuple[int, str], ...] = ()
    slow: tuple[tuple[str, str], ...] = ()  # the nodes the watchdog named slow, and why
    verdicts: tuple[str, ...] = ()  # the watchdog's verdicts, as written: which ranks hung, where

    def facts(self) -> dict[str, object]:
        """The keyword arguments of `decision.Facts` this outcome gives."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "verdicts"}  # fmt: skip


def read(environ: Mapping[str, str], *, batch_log: Path | None, log_start: int,
         elastic: bool) -> Outcome:  # fmt: skip
    """The outcome of the run whose lines in `batch_log` begin at byte `log_start`."""
    requeue = _path(environ, REQUEUE_FILE_VAR)
    asked = _text(requeue)
    if requeue is not None and asked is not None:
        requeue.unlink(missing_ok=True)  # taken: a later run starts without it
    done, used = _path(environ, DONE_FILE_VAR), _path(environ, ASKED_FILE_VAR)
    verdicts, suspects = _hang(_path(environ, HANG_DIR_VAR))
    text = _run_text(batch_log, log_start)
    seen = _SRUN_ERROR.findall(text)
    try:  # the step spans the job's nodes, in their order
        step_nodes = hostlist.expand(environ.get("SLURM_JOB_NODELIST", ""))
    except HostlistError:
        step_nodes = []
    return Outcome(
        asked=(asked or "").strip() or None,
        done=done is not None and done.exists(),
        protocol_used=used is not None and used.exists(),
        nodes_lost=_first_line(_path(environ, NODES_LOST_FILE_VAR)) if elastic else None,
        seen=seen[0] if seen else None,
        signalled=nodes.signalled(seen),
        aborted=nodes.aborted(text, step_nodes),
        reported=_first_of_run(_path(environ, FAILURE_FILE_VAR),
                               environ.get("SLURM_RESTART_COUNT") or "0"),
        hung=bool(verdicts), suspects=suspects, verdicts=verdicts,
        slow=_slow(_path(environ, HANG_DIR_VAR)),
    )  # fmt: skip


def _run_text(log: Path | None, start: int) -> str:
    """The batch log from `start` on: this run's lines ("" where it cannot be read)."""
    if log is None:
        return ""
    try:
        with log.open("rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _hang(hang_dir: Path | None) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """The watchdog's verdicts of this run (one per agreement it ran) and their suspects."""
    if hang_dir is None:
        return (), ()
    verdicts: list[str] = []
    suspects: list[tuple[int, str]] = []
    for verdict in sorted((hang_dir / ".state").glob("*/verdict")):
        text = _text(verdict)
        if text is None:
            continue
        verdicts.append(text.rstrip("\n"))
        for line in (_text(verdict.parent / "suspects") or "").splitlines():
            rank, _, node = line.strip().partition(" ")
            if rank.isdigit():
                suspects.append((int(rank), node.strip()))
    return tuple(verdicts), tuple(suspects)


def _slow(hang_dir: Path | None) -> tuple[tuple[str, str], ...]:
    """The nodes the watchdog named slow in this run (each of torchrun's restarts included), and
    why, in the order named; each node once."""
    if hang_dir is None:
        return ()
    named: dict[str, str] = {}
    for path in sorted((hang_dir / ".state").glob("*/slow")):
        for line in (_text(path) or "").splitlines():
            node, _, why = line.strip().partition(" ")
            if node:
                named.setdefault(node, why.strip())
    return tuple(named.items())


def _path(environ: Mapping[str, str], name: str) -> Path | None:
    value = environ.get(name)
    return Path(value) if value else None


def _text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _first_line(path: Path | None) -> str | None:
    text = _text(path)
    return (text.splitlines() or [""])[0] or None if text else None


def _first_of_run(path: Path | None, run: str) -> str | None:
    """The first line of `path` that run `run` wrote (``RUN<tab>LINE``; an untagged line counts
    as this run's): an earlier run's rank may append to the file after this run began."""
    for line in (_text(path) or "").splitlines():
        tag, tab, rest = line.partition("\t")
        if not (tab and tag.isdigit()):
            return line or None
        if tag == run:
            return rest or None
    return None

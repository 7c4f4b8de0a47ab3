"""Where the watchdog's files lie, how often they are looked at, and its settings. Pure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

from slurmddp.errors import UserError
from slurmddp.protocol import DEFAULT_HANG_TIMEOUT_S, HANG_DIR_VAR, HANG_TIMEOUT_VAR

MIN_PERIOD_S = 1.0
# At the default timeout (600 s) each rank writes at most once in 30 s: a thousand ranks make
# about 33 small writes a second on the shared file system, and none while nothing progresses.
MAX_PERIOD_S = 30.0


def period_s(timeout_s: float) -> float:
    """How often a rank publishes its progress and the monitor looks: a tenth of the timeout."""
    return min(max(timeout_s / 10, MIN_PERIOD_S), MAX_PERIOD_S)


def dump_wait_s(timeout_s: float) -> float:
    """How long the monitor waits for the ranks' stacks: a rank that has not answered by then
    cannot (its process is stopped, or holds the interpreter lock)."""
    return 1.5 * period_s(timeout_s) + 2


def timeout_s(environ: Mapping[str, str]) -> float | None:
    """$SLURMDDP_HANG_TIMEOUT in seconds (default 600); None when 0 (no watchdog)."""
    text = environ.get(HANG_TIMEOUT_VAR, "").strip()
    if not text:
        return float(DEFAULT_HANG_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise UserError(f"{HANG_TIMEOUT_VAR}={text!r} is not a number of seconds: give one such as "
                        "600, or 0 for no hang watchdog")  # fmt: skip
    return value or None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files of one run's watchdog, under the hang directory.

    The stacks and the report stay where the user looks (the latest hang's); what the ranks and
    the monitor tell each other is per run (job restart and torchrun restart), so that nothing a
    run left behind is read by the next.
    """

    hang_dir: Path
    run: str

    @property
    def state(self) -> Path:
        return self.hang_dir / ".state" / self.run

    def progress(self, rank: int) -> Path:
        return self.state / "progress" / f"rank-{rank}"

    @property
    def request(self) -> Path:
        return self.state / "request"  # the monitor: write your stacks

    @property
    def end(self) -> Path:
        return self.state / "end"  # the monitor: the run is over, leave

    @property
    def verdict(self) -> Path:
        return self.state / "verdict"  # the monitor's lines for the batch log

    @property
    def suspects(self) -> Path:
        return self.state / "suspects"  # "RANK NODE" a line: the verdict's stuck ranks

    @property
    def slow(self) -> Path:
        return self.state / "slow"  # "NODE WHY" a line: the nodes the pace named slow

    @property
    def report(self) -> Path:
        return self.hang_dir / "report.txt"

    def stacks(self, rank: int) -> Path:
        return self.hang_dir / f"rank-{rank}.txt"

    def flight_record(self, rank: int) -> Path:
        return self.hang_dir / f"rank-{rank}.flight-recorder.json"


def run_name(environ: Mapping[str, str]) -> str:
    """This run's name, the same on every rank (`slurmddp.rank.coordination.attempt`)."""
    from slurmddp.rank.coordination import attempt

    return attempt(environ)


def from_env(environ: Mapping[str, str]) -> tuple[Layout, float] | None:
    """The run's layout and hang timeout; None when there is no watchdog."""
    directory = environ.get(HANG_DIR_VAR, "").strip()
    if not directory:
        return None
    limit = timeout_s(environ)
    if limit is None:
        return None
    return Layout(Path(directory), run_name(environ)), limit


@dataclasses.dataclass(frozen=True)
class Progress:
    """What one rank's progress file says: its count, its node, whether its work is done, and its
    busy and wall seconds a step (`slurmddp.watchdog.pace`; None until it has them)."""

    count: int
    node: str
    done: bool = False
    pace_s: float | None = None
    step_s: float | None = None

    def text(self) -> str:
        pace = "" if self.pace_s is None or self.step_s is None else \
            f" {self.pace_s:.6f} {self.step_s:.6f}"  # fmt: skip
        return f"{self.count} {self.node} {'done' if self.done else 'running'}{pace}\n"

    @classmethod
    def parse(cls, text: str) -> Progress | None:
        parts = text.split()
        if len(parts) not in (3, 5) or not parts[0].isdigit():
            return None
        pace = _seconds(parts[3]) if len(parts) == 5 else None
        step = _seconds(parts[4]) if len(parts) == 5 else None
        if pace is None or step is None:
            pace = step = None
        return cls(int(parts[0]), parts[1], parts[2] == "done", pace, step)


def _seconds(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < math.inf else None

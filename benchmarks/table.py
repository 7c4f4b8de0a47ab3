"""Rows of a benchmark table: two medians and their ratio, printed and written as JSON."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Row:
    """One comparison: `ours` against `baseline`, both medians in `unit`."""

    benchmark: str
    metric: str
    ours: float
    baseline: float | None
    unit: str
    baseline_label: str = ""
    target: str = ""

    @property
    def ratio(self) -> float | None:
        return None if not self.baseline else self.ours / self.baseline


def alternate(contenders: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Run each contender `repeats` times, interleaved; the median of what each returns."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, measure in contenders.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def render(rows: Sequence[Row]) -> str:
    """The rows as an aligned text table."""
    head = ("benchmark", "metric", "ours", "baseline", "ratio", "target")
    body = [
        (
            r.benchmark,
            r.metric,
            f"{r.ours:.4g} {r.unit}",
            "-" if r.baseline is None else f"{r.baseline:.4g} {r.unit} ({r.baseline_label})",
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            r.target,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in (head, *body)
    )


def report(rows: Sequence[Row], path: Path | None) -> None:
    """Print the table, and write it as JSON to `path` when one is given."""
    print(render(rows))
    if path is not None:
        dump(rows, path)


def dump(rows: Sequence[Row], path: Path) -> None:
    """Write the rows and the machine they were taken on as JSON. The rows of the benchmarks not
    run this time stay, each with the time it was taken (`python -m benchmarks snapshot` adds its
    rows to the others')."""
    machine = {"python": platform.python_version(), "machine": platform.machine(),
               "system": platform.platform(), "cpus": _cpus()}  # fmt: skip
    taken = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run = {r.benchmark for r in rows}
    kept = []
    if path.exists():
        before = json.loads(path.read_text())
        kept = [r | {"taken": r.get("taken", before.get("taken"))} for r in before.get("rows", [])
                if r["benchmark"] not in run]  # fmt: skip
    payload = {
        "taken": taken,
        "machine": machine,
        "rows": kept + [dataclasses.asdict(r) | {"ratio": r.ratio, "taken": taken} for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))

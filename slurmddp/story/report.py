"""A job's story as one self-contained page: HTML with inline SVG, nothing fetched. Pure.

The page has the summary, the timeline (each run a lane on its nodes, from its start to its end:
start-up hatched, training solid, the stop and its cause, checkpoints and resumes marked, the
time between runs left empty), each rank's steps per second and busy time a step over the same
time axis (in data-parallel training every rank takes the steps of the slowest; a slow node's
ranks are busy longer a step), and every event in words.
"""

from __future__ import annotations

import html as _html
import time
from collections.abc import Iterable

from slurmddp.story import summary
from slurmddp.story.events import Event, describe

WIDTH, LEFT, RIGHT = 960, 150, 20  # the plots' width and margins, in pixels
LANE, TOP = 34, 24
RATE_HEIGHT = 180
# Colours by the cause of a run's end; anything else is grey.
COLOURS = {"finished": "#2e7d32", "preempted": "#ef6c00", "time limit": "#f9a825",
           "signal": "#f9a825", "hang": "#6a1b9a", "crash": "#c62828",
           "node failure": "#c62828", "nodes lost": "#c62828"}  # fmt: skip
RUNNING = "#1565c0"
RANK_COLOURS = ("#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#00838f", "#ad1457", "#5d4037",
                "#558b2f")  # fmt: skip


def page(job_id: str, name: str, state: str, events: list[Event], now: float) -> str:
    """The page (see the module's docstring)."""
    s = summary.summarize(events, now)
    runs = summary.runs(events)
    t0 = min([r.start for r in runs if r.start is not None] + [e["t"] for e in events])
    t1 = max([r.end or now for r in runs] + [e["t"] for e in events]) if runs else now
    span = max(t1 - t0, 1e-3)

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * (WIDTH - LEFT - RIGHT)

    title = f"job {job_id} ({name}): {state}"
    parts = [f"<h1>{_e(title)}</h1>", '<ul class="summary">',
             *(f"<li>{_e(line)}</li>" for line in s.lines()), "</ul>",
             "<h2>Timeline</h2>", _timeline(runs, events, x, t0, span, now),
             "<h2>Steps per second, per rank</h2>", _rates(events, x, t0, span),
             "<h2>Busy time a step, per rank (a slow node's ranks lie above)</h2>",
             _busy(events, x, t0, span),
             "<h2>Events</h2>", _table(events, t0)]  # fmt: skip
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")  # fmt: skip


def _e(text: str) -> str:
    return _html.escape(str(text))


def _axis(x, t0: float, span: float, y: float) -> list[str]:
    """Ticks every round number of seconds or minutes along the time axis at height `y`."""
    step = next(s for s in (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
                if span / s <= 10)  # fmt: skip
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" class="axis"/>']
    k = 0
    while k * step <= span:
        px = x(t0 + k * step)
        label = f"{k * step // 60:.0f} min" if step >= 60 else f"{k * step:.0f} s"
        out += [f'<line x1="{px:.1f}" y1="{y}" x2="{px:.1f}" y2="{y + 4}" class="axis"/>',
                f'<text x="{px:.1f}" y="{y + 16}" class="tick">{label}</text>']  # fmt: skip
        k += 1
    return out


def _timeline(runs: list[summary.Run], events: list[Event], x, t0: float, span: float,
              now: float) -> str:  # fmt: skip
    height = TOP + LANE * max(1, len(runs)) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'class="timeline" role="img" aria-label="the runs of the job over time">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#eee"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#999" stroke-width="2"/></pattern></defs>']
    for i, r in enumerate(runs):
        y = TOP + i * LANE
        start, end = r.start if r.start is not None else t0, r.end if r.end is not None else now
        colour = COLOURS.get(r.cause, "#757575") if r.end is not None else RUNNING
        label = f"run {r.run + 1}" + (f" ({r.nodes})" if r.nodes else "")
        out.append(f'<text x="4" y="{y + 17}" class="lane">{_e(label[:24])}</text>')
        first = r.first_step_t if r.first_step_t is not None else end
        out.append(_bar(x(start), x(first), y, 'fill="url(#hatch)" class="startup"',
                        f"start-up: {first - start:.1f} s"))
        if first < end:
            why = r.cause or "running"
            out.append(_bar(x(first), x(end), y, f'fill="{colour}" class="run" '
                            f'data-cause="{_e(why)}"', f"{label}: steps {r.resumed} to "
                            f"{r.reached}, ended: {why}"))  # fmt: skip
        if r.end is not None and r.cause:
            # After the bar where there is room, else inside its end.
            inside = x(end) + 8 * len(r.cause) > WIDTH - RIGHT
            where = f'x="{x(end) - 3:.1f}" text-anchor="end" fill="#fff"' if inside \
                else f'x="{x(end) + 3:.1f}"'  # fmt: skip
            out.append(f'<text {where} y="{y + 17}" class="cause">{_e(r.cause)}</text>')
    for e in events:
        lane = next((i for i, r in enumerate(runs) if r.run == e.get("run", 0)), 0)
        y, px = TOP + lane * LANE, x(e["t"])
        marker = {"checkpoint": ("checkpoint", "#000", "M{x},{a} l4,6 l-4,6 l-4,-6 z"),
                  "stop": ("stop", "#c62828", "M{x},{a} l5,10 l-10,0 z"),
                  "resumed": ("resumed", "#fff", "M{x},{a} m-4,0 l8,6 l-8,6 z"),
                  "slow": ("slow", "#ad1457", "M{x},{a} m-4,2 l8,0 l0,8 l-8,0 z")}.get(e["kind"])
        if marker is None:
            continue
        cls, fill, path = marker
        out.append(f'<path d="{path.format(x=f"{px:.1f}", a=y + 8)}" fill="{fill}" '
                   f'stroke="#000" stroke-width="0.6" class="{cls}">'
                   f"<title>{_e(describe(e) or cls)}</title></path>")
    out += _axis(x, t0, span, TOP + LANE * max(1, len(runs)) + 4)
    out.append("</svg>")
    return "\n".join(out) + _LEGEND


def _bar(x0: float, x1: float, y: float, attributes: str, title: str) -> str:
    return (f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(1.0, x1 - x0):.1f}" '
            f'height="{LANE - 10}" {attributes}><title>{_e(title)}</title></rect>')


def _rates(events: list[Event], x, t0: float, span: float) -> str:
    """Each rank's steps per second between two of the watchdog's counts, over time."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (rank, run): a line each
    last: dict[tuple[int, str], tuple[float, int]] = {}
    for e in (e for e in events if e["kind"] == "progress"):
        for rank, count in (e.get("counts") or {}).items():
            key = (int(e.get("run", 0)), rank)
            if key in last and e["t"] > last[key][0] and count >= last[key][1]:
                t, c = last[key]
                series.setdefault((rank, key[0]), []).append(
                    ((t + e["t"]) / 2, (count - c) / (e["t"] - t)))
            last[key] = (e["t"], int(count))
    if not series:
        return ('<p class="none">No rates: the hang watchdog, which counts each rank\'s steps, was '
                "off or no run lasted two of its periods.</p>")
    return _plot(series, _nodes(events), x, t0, span, "rates", "/s",
                 "steps per second of each rank over time")  # fmt: skip


def _busy(events: list[Event], x, t0: float, span: float) -> str:
    """Each rank's busy seconds a step (`slurmddp.watchdog.pace`) over time: in step with the
    others, a slow node's ranks are busy longer."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in (e for e in events if e["kind"] == "progress"):
        for rank, seconds in (e.get("busy") or {}).items():
            series.setdefault((rank, int(e.get("run", 0))), []).append((e["t"], seconds * 1000))
    if not series:
        return ('<p class="none">No busy times: the hang watchdog, which measures them, was off, '
                "or the kernel does not report them.</p>")
    return _plot(series, _nodes(events), x, t0, span, "busy", " ms",
                 "busy milliseconds a step of each rank over time")  # fmt: skip


def _nodes(events: list[Event]) -> dict[str, str]:
    nodes: dict[str, str] = {}
    for e in (e for e in events if e["kind"] == "progress"):
        nodes.update(e.get("nodes") or {})
    return nodes


def _plot(series: dict[tuple[str, int], list[tuple[float, float]]], nodes: dict[str, str], x,
          t0: float, span: float, css: str, unit: str, label: str) -> str:  # fmt: skip
    """A line per (rank, run) over the time axis."""
    top = max(v for points in series.values() for _, v in points) * 1.1 or 1.0
    height = RATE_HEIGHT + 40

    def y(value: float) -> float:
        return 10 + RATE_HEIGHT - value / top * RATE_HEIGHT

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'class="{css}" role="img" aria-label="{_e(label)}">',
           f'<text x="4" y="{y(top / 1.1) + 4:.1f}" class="tick">{top / 1.1:.3g}{unit}</text>',
           f'<text x="4" y="{y(0):.1f}" class="tick">0</text>']
    ranks = sorted({rank for rank, _ in series}, key=int)
    for (rank, _), points in sorted(series.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        colour = RANK_COLOURS[ranks.index(rank) % len(RANK_COLOURS)]
        coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        where = f"rank {rank}" + (f" on {nodes[rank]}" if rank in nodes else "")
        out.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.5"'
                   f' class="rank" data-rank="{_e(rank)}"><title>{_e(where)}</title></polyline>')
    out += _axis(x, t0, span, 10 + RATE_HEIGHT)
    out.append("</svg>")
    return "\n".join(out)


def _table(events: Iterable[Event], t0: float) -> str:
    rows = []
    for e in events:
        said = describe(e)
        if said is None:
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["t"]))
        rows.append(f"<tr><td>{when}</td><td>+{e['t'] - t0:.1f} s</td>"
                    f"<td>{e.get('run', 0) + 1}</td><td>{_e(said)}</td></tr>")
    return ('<table class="events"><tr><th>time</th><th>since start</th><th>run</th>'
            "<th>what happened</th></tr>" + "".join(rows) + "</table>")


_LEGEND = ('<p class="legend">hatched: start-up (to the first step); solid: training, coloured '
           'by why the run ended; ▲ stop agreed, ◆ checkpoint written, ▷ resumed, ■ a slow node '
           'named</p>')
_STYLE = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}"
          "h1{font-size:20px}h2{font-size:16px;margin-top:24px}"
          ".lane,.cause{font-size:12px}.tick{font-size:10px;fill:#555}"
          ".axis{stroke:#555}table{border-collapse:collapse;font-size:12px}"
          "td,th{border-bottom:1px solid #ddd;padding:2px 8px;text-align:left}"
          ".legend{font-size:12px;color:#555}")

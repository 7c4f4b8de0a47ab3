"""`slurmddp report`'s page, as a person sees it: drawn by headless Chromium, its elements
checked, nothing fetched from the network."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

from slurmddp.story import report
from tests.story.test_summary import STORY, ev

SVG = "{http://www.w3.org/2000/svg}"

# STORY with each rank's counts: rank 1, on n2, goes at half rank 0's pace in run 2.
PROGRESS = [ev(12, "progress", counts={"0": 21, "1": 21}, nodes={"0": "n1", "1": "n2"}),
            ev(18, "progress", counts={"0": 81, "1": 81}),
            ev(50, "progress", 1, counts={"0": 51, "1": 51}, nodes={"0": "n1", "1": "n2"}),
            ev(58, "progress", 1, counts={"0": 131, "1": 91})]  # fmt: skip
TOLD = sorted([e for e in STORY if e["kind"] != "progress"] + PROGRESS, key=lambda e: e["t"])


def svgs(page: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(r"<svg .*?</svg>", page, re.S)]


def test_the_page_draws_each_run_its_stops_checkpoints_and_each_ranks_pace():
    page = report.page("7", "train", "COMPLETED", TOLD, now=1000)
    timeline, rates = svgs(page)
    bars = timeline.findall(f"{SVG}rect[@class='run']")
    assert [b.get("data-cause") for b in bars] == ["preempted", "crash", "finished"]
    assert len(timeline.findall(f"{SVG}rect[@class='startup']")) == 3
    assert [len(timeline.findall(f"{SVG}path[@class='{c}']")) for c in
            ("stop", "checkpoint", "resumed")] == [1, 2, 2]  # fmt: skip
    # Bars follow time: run 2 starts right of run 1's end, the 15 s in the queue between.
    x = [float(b.get("x")) for b in bars]
    assert x == sorted(x)
    lines = rates.findall(f"{SVG}polyline")  # a line per rank and run: none across a requeue
    assert [p.get("data-rank") for p in lines] == ["0", "0", "1", "1"]
    assert lines[3].find(f"{SVG}title").text == "rank 1 on n2"

    def lowest(rank: str) -> float:  # SVG's y grows downwards: the slowest point is the largest
        return max(float(xy.split(",")[1]) for p in lines if p.get("data-rank") == rank
                   for xy in p.get("points").split())  # fmt: skip

    assert lowest("1") > lowest("0")  # the slow rank stands out
    assert "<li>3 runs, 2 requeues, 302 steps, 86 s from start to end</li>" in page
    # Self-contained: nothing to fetch, nothing to run.
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"] * 2
    assert not re.search(r"<(script|link|img|iframe)\b|\bsrc=|url\((?!#)", page)


def test_a_slow_nodes_ranks_are_drawn_busier_and_its_naming_marked():
    told = [ev(0, "run", nodes="n[1-2]"),
            ev(10, "progress", counts={"0": 20, "1": 20}, nodes={"0": "n1", "1": "n2"},
               busy={"0": 0.05, "1": 0.05}),
            ev(20, "progress", counts={"0": 30, "1": 30}, busy={"0": 0.05, "1": 0.2}),
            ev(30, "progress", counts={"0": 40, "1": 40}, busy={"0": 0.05, "1": 0.2}),
            ev(31, "slow", node="n2", ranks=[1], factor=4.0, line="n2 is slow: rank 1 ...")]
    page = report.page("7", "train", "RUNNING", told, now=40)
    timeline, _, busy = svgs(page)
    marker = timeline.find(f"{SVG}path[@class='slow']")
    assert marker.find(f"{SVG}title").text == "slow node: n2 is slow: rank 1 ..."
    lines = {p.get("data-rank"): p for p in busy.findall(f"{SVG}polyline")}
    assert lines["1"].find(f"{SVG}title").text == "rank 1 on n2"

    def highest(rank: str) -> float:  # SVG's y grows downwards: the busiest point is the least
        return min(float(xy.split(",")[1]) for xy in lines[rank].get("points").split())

    assert highest("1") < highest("0")  # the slow node's rank stands out, above
    assert "<td>slow node: n2 is slow: rank 1 ...</td>" in page


def test_a_users_text_is_escaped_not_markup():
    told = [ev(0, "run", nodes="<b>n1</b>"), ev(1, "agent", line="<script>x</script>")]
    page = report.page("7", "<i>name</i>", "RUNNING", told, now=5)
    assert "<script>" not in page and "<b>" not in page and "&lt;i&gt;name" in page
    assert report.page("8", "t", "RUNNING", [ev(0, "run")], now=5).count("<svg") == 1


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB(A) rows of an 8-bit RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, rows, prev = zlib.decompress(idat), [], bytes(width * bpp)
    stride = width * bpp
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]) & 0xFF
        rows.append(bytes(line))
        prev = bytes(line)
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def test_chromium_draws_the_runs_in_their_colours(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(report.page("7", "train", "COMPLETED", TOLD, now=1000))
    browser = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    assert browser, "scripts/slurm-cluster install puts chromium-headless-shell here"
    shot = tmp_path / "report.png"
    done = subprocess.run([browser, "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and shot.exists(), done.stderr
    _, _, pixels = png_pixels(shot.read_bytes())
    seen = set(pixels)
    for cause in ("preempted", "crash", "finished"):  # each run's bar, in its cause's colour
        assert bytes.fromhex(report.COLOURS[cause][1:]) in seen, cause

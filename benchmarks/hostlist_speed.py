"""Hostlist expand and compress against ``scontrol show hostnames|hostlist`` and python-hostlist.

    python -m benchmarks.hostlist_speed [--repeats 5]

For 10, 1,000 and 100,000 hosts (racks of 40 named ``gpu-r0001n01`` or ``cpu-r0002n01``, with
some nodes missing so that each rack compresses to several ranges), `expand` and `compress` run
in-process. The scontrol baselines are whole processes, as a shell script would run them
(``$(scontrol show hostnames "$SLURM_JOB_NODELIST")``), given a three-line slurm.conf whose
controller is an unroutable address: scontrol parses hostlists locally and needs no slurmctld.
python-hostlist's `expand_hostlist` / `collect_hostlist`, when importable, is the in-process
baseline; its `collect_hostlist` also sorts and groups on every number in a name, so it does more
work than Slurm's rule. Before timing, the outputs are checked to agree (a mismatch raises).
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from benchmarks.table import Row, alternate, report, timed
from slurmddp.rank.hostlist import compress, expand

SIZES = (10, 1_000, 100_000)
RACK = 40
# Enough to run scontrol; 192.0.2.1 (TEST-NET-1) makes sure no controller answers.
SLURM_CONF = """\
ClusterName=bench
SlurmctldHost=nowhere(192.0.2.1)
NodeName=n1 CPUs=1
"""


def cluster(count: int) -> list[str]:
    """`count` node names, rack by rack, with about one node in 17 missing."""
    hosts: list[str] = []
    rack = 0
    while len(hosts) < count:
        rack += 1
        kind = "gpu" if rack % 4 == 1 else "cpu"
        # Out-of-service nodes: gaps at a different slot in each rack (slot 6 in the first).
        hosts += [f"{kind}-r{rack:04d}n{slot:02d}" for slot in range(1, RACK + 1)
                  if (rack * RACK + slot) % 17 != 12]  # fmt: skip
    return hosts[:count]


def run(sizes: Sequence[int] = SIZES, repeats: int = 5) -> list[Row]:
    try:
        import hostlist as python_hostlist
    except ImportError:
        python_hostlist = None
    scontrol = shutil.which("scontrol")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
        conf = Path(work) / "slurm.conf"
        conf.write_text(SLURM_CONF)
        env = os.environ | {"SLURM_CONF": str(conf)}

        def show(what: str, arg: str) -> str:
            assert scontrol is not None
            r = subprocess.run([scontrol, "show", what, arg], env=env, capture_output=True,
                               text=True, check=True)  # fmt: skip
            # scontrol exits 0 on an invalid hostlist; only stderr tells.
            if r.stderr:
                raise RuntimeError(f"scontrol show {what}: {r.stderr.strip()}")
            return r.stdout

        for count in sizes:
            rows += _compare(count, repeats, show if scontrol else None, python_hostlist)
    return rows


def _compare(
    count: int, repeats: int, show: Callable[[str, str], str] | None,
    python_hostlist: ModuleType | None,
) -> list[Row]:  # fmt: skip
    """The four rows of one size; `show` runs scontrol (None: not installed)."""
    hosts = cluster(count)
    names = ",".join(hosts)
    nodelist = compress(hosts)
    _agree("expand(compress(hosts))", expand(nodelist), hosts)
    # In-process calls this fast are timed in batches, so that one sample is a millisecond or so.
    loops = max(1, 1_000 // count)

    def batch(fn: Callable[[], object]) -> Callable[[], float]:
        return lambda: timed(lambda: [fn() for _ in range(loops)]) / loops

    contenders = {"expand": batch(lambda: expand(nodelist)),
                  "compress": batch(lambda: compress(hosts))}  # fmt: skip
    why: dict[str, str] = {}  # baselines not run, and why
    if show is None:
        why["hostnames"] = why["hostlist"] = "skipped: scontrol not installed"
    else:
        _agree("scontrol show hostnames", show("hostnames", nodelist).splitlines(), hosts)
        contenders["hostnames"] = lambda: timed(lambda: show("hostnames", nodelist))
        try:
            _agree("scontrol show hostlist", show("hostlist", names).rstrip("\n"), nodelist)
        except OSError as e:
            if e.errno != errno.E2BIG:
                raise
            why["hostlist"] = f"skipped: {len(names) >> 10} KiB of names, over 128 KiB per argument"
        else:
            contenders["hostlist"] = lambda: timed(lambda: show("hostlist", names))
    if python_hostlist is None:
        why["expand_hostlist"] = why["collect_hostlist"] = "skipped: python-hostlist not installed"
    else:
        # allow_duplicates=True: keep duplicates as Slurm and `expand` do, and skip a pass.
        theirs = python_hostlist.expand_hostlist(nodelist, allow_duplicates=True)
        _agree("python-hostlist expand_hostlist", theirs, hosts)
        collected = python_hostlist.collect_hostlist(hosts)
        # It sorts and may join racks too (cpu-r[0002,0019]n01), so compare what it expands to.
        _agree("expand(collect_hostlist(hosts))", sorted(expand(collected)), sorted(hosts))
        contenders["expand_hostlist"] = batch(
            lambda: python_hostlist.expand_hostlist(nodelist, allow_duplicates=True)
        )
        contenders["collect_hostlist"] = batch(lambda: python_hostlist.collect_hostlist(hosts))
    ms = {name: seconds * 1e3 for name, seconds in alternate(contenders, repeats).items()}

    def row(op: str, baseline: str, label: str) -> Row:
        return Row("hostlist", f"{op} {count} hosts", ms[op], ms.get(baseline), "ms", label,
                   why.get(baseline, ""))  # fmt: skip

    return [
        row("expand", "hostnames", "scontrol show hostnames, a process"),
        row("expand", "expand_hostlist", "python-hostlist expand_hostlist"),
        row("compress", "hostlist", "scontrol show hostlist, a process"),
        row("compress", "collect_hostlist", "python-hostlist collect_hostlist"),
    ]


def _agree(what: str, theirs: object, ours: object) -> None:
    if theirs != ours:
        raise RuntimeError(f"hostlist benchmark: {what} disagrees with slurmddp.rank.hostlist")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hostlist_speed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    report(run(repeats=opts.repeats), opts.json)


if __name__ == "__main__":
    main()

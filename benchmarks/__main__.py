"""``python -m benchmarks [NAME...]``: run benchmarks, print one table, write it as JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import (
    checkpoint_write,
    cli_latency,
    cpu_threads,
    data_loading,
    elastic_recovery,
    first_collective,
    goodput,
    hostlist_speed,
    preemption_turnaround,
    rendezvous_scale,
    snapshot,
    training_overhead,
)
from benchmarks.table import dump, render

BENCHMARKS = {
    "startup": lambda o: first_collective.run(o.repeats),
    "cli": lambda o: cli_latency.run(max(o.repeats, 5)),
    "training": lambda o: training_overhead.run(2000, o.repeats),
    "threads": lambda o: cpu_threads.run(300, o.repeats),
    "checkpoint": lambda o: checkpoint_write.run(o.size_mib, o.repeats, device=o.device),
    "preemption": lambda o: preemption_turnaround.run(o.repeats),
    "elastic": lambda o: elastic_recovery.run(o.repeats),
    "hostlist": lambda o: hostlist_speed.run(repeats=o.repeats),
    "data": lambda o: data_loading.run(repeats=o.repeats),
    "scale": lambda o: rendezvous_scale.run(repeats=o.repeats),
    "snapshot": lambda o: snapshot.run(o.repeats, device=o.device),
    # About an hour of the local cluster: run when asked by name, not with the others.
    "goodput": lambda o: goodput.run(steps=o.steps),
}
ASKED_ONLY = ("goodput",)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], metavar="NAME",
                   help=f"which to run: {', '.join(BENCHMARKS)} (default: all but "
                        f"{', '.join(ASKED_ONLY)})")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size")
    p.add_argument("--device", default="cpu",
                   help="checkpoint, snapshot: where the state lives, cpu or cuda")  # fmt: skip
    p.add_argument("--steps", type=int, default=1500, help="goodput: the training's steps")
    p.add_argument("--json", type=Path, default=Path("benchmarks/results.json"))
    opts = p.parse_args()
    names = opts.names or [n for n in BENCHMARKS if n not in ASKED_ONLY]
    rows = [row for name in names for row in BENCHMARKS[name](opts)]
    print(render(rows))
    dump(rows, opts.json)
    print(f"\nwritten to {opts.json}")


if __name__ == "__main__":
    main()

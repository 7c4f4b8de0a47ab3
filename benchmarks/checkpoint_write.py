"""Checkpoint write throughput against ``dd conv=fsync``, and the stall of an asynchronous save.

    python -m benchmarks.checkpoint_write [--size-mib 1024] [--repeats 3] [--dir DIR]
                                          [--device cuda]

`Checkpointer.save` (one process, replicated mode) writes, fsyncs, checksums (crc32) and publishes
a state of the given size; the baseline is ``dd if=/dev/zero bs=16M conv=fsync`` of as many bytes
into the same directory. Throughput is bytes over the whole call, so the ratio is ours / dd. The
removal of the checkpoint it replaces, which `save` leaves to a background thread, is waited for
outside the timing, so that it never overlaps the next measurement; two untimed rounds come
first. The stall is how long training waits in `save` when it is asynchronous, against a
synchronous save.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.table import Row, alternate, report, timed

MIB = 1 << 20


def run(size_mib: int = 1024, repeats: int = 3, directory: str | None = None,
        device: str = "cpu") -> list[Row]:
    """`device` "cuda" keeps the state in GPU memory, as a model's is: each save copies it out."""
    import torch

    from slurmddp.checkpoint import Checkpointer

    root = Path(tempfile.mkdtemp(prefix="slurmddp-bench-", dir=directory))
    try:
        # Several tensors, as a model's state has; random so that nothing compresses it.
        chunks = 8
        state = {f"layer{i}": torch.rand(size_mib * MIB // 4 // chunks, device=device)
                 for i in range(chunks)}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        sync = Checkpointer(root / "sync", keep=1)
        asynchronous = Checkpointer(root / "async", keep=1, async_save=True)
        steps = iter(range(1, 1_000_000))

        def dd() -> float:
            target = root / "dd.bin"
            seconds = timed(lambda: subprocess.run(
                ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={nbytes // (16 * MIB)}",
                 "conv=fsync", "status=none"], check=True))  # fmt: skip
            target.unlink()
            return seconds

        def save() -> float:
            seconds = timed(lambda: sync.save(next(steps), state))
            sync.wait()  # the old checkpoint's removal, untimed
            return seconds

        stalls: list[float] = []

        def async_save() -> float:
            stalls.append(timed(lambda: asynchronous.save(next(steps), state)))
            asynchronous.wait()
            return stalls[-1]

        contenders = {"save": save, "dd": dd, "async": async_save}
        # Two untimed rounds first: from then on every contender starts just after a file of the
        # same size was deleted, as in a run's steady state. Where freed memory goes back to a
        # VM's host (virtio-balloon page reporting), filling the page cache costs 2-4x more when
        # nothing was freed just before, so the first samples would depend on their place.
        for _ in range(2):
            for measure in contenders.values():
                measure()
        medians = alternate(contenders, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gib = nbytes / (1 << 30)
    source, work = ("", "") if device == "cpu" else (" from GPU memory", "copy, ")
    return [
        Row("checkpoint", f"write throughput{source}, {gib:.2f} GiB ({work}write, fsync, crc32, "
            f"publish)", gib / medians["save"], gib / medians["dd"], "GiB/s",
            "dd bs=16M conv=fsync", ">= 0.8"),
        Row("checkpoint", f"training stall of a save{source}", medians["async"], medians["save"],
            "s", "synchronous save", "< 1"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_write")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="where to write (default: the temporary directory)")
    p.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    p.add_argument("--json", type=Path)
    opts = p.parse_args()
    rows = run(opts.size_mib, opts.repeats, opts.dir, opts.device)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

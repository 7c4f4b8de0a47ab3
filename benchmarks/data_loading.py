"""Data loading under slurmddp's seeding (`slurmddp.training.loader`) against torch's own: batches
per second of a DataLoader with 2 forked workers over an ImageNet-like dataset with random
augmentation (a 224-pixel crop of a 256-pixel image, a flip, noise), and of one without workers
over samples that cost nothing (batches of 64 integers: what slurmddp adds per batch and per
sample, alone), the time a resumed
epoch takes to its first batch, its consumed batches skipped in the sampler against fetched and
dropped (what a loop that skips by iterating does), and the time an epoch takes to its first batch
with its 4 forked workers started as a rank starts them (`slurmddp.preemption.workers`: shielded,
each checked alive) against multiprocessing's own start. Each contender runs in a process of its
own (``SLURMDDP_EXACT_DATA=0``: torch's own DataLoader, nothing installed).

    python -m benchmarks.data_loading [--batches 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.table import Row, alternate, report

SKIPPED = 40  # batches consumed before the resume
STARTS = 10  # epochs started per measurement


def _child(mode: str, batches: int, skipped: int = SKIPPED, starts: int = STARTS) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from slurmddp.training import loader as exact

    if exact.enabled():
        exact.install()

    class Images(Dataset):
        def __len__(self) -> int:
            return 100_000

        def __getitem__(self, i: int) -> torch.Tensor:
            image = torch.full((3, 256, 256), float(i % 255))
            top, left = torch.randint(0, 33, (2,)).tolist()
            crop = image[:, top : top + 224, left : left + 224]
            if torch.rand(()) < 0.5:
                crop = crop.flip(-1)
            return crop + 0.05 * torch.randn_like(crop)

    torch.manual_seed(0)
    if mode.startswith("start"):
        from slurmddp.preemption import workers

        if mode == "start-rank":
            workers.shield()
        small = DataLoader(list(range(256)), batch_size=8, num_workers=4,
                           multiprocessing_context="fork")  # fmt: skip
        start = time.perf_counter()
        for _ in range(starts):
            next(iter(small))
        print(json.dumps({"value": (time.perf_counter() - start) / starts}))
        return
    if mode == "cheap":
        cheap = DataLoader(list(range(1_000_000)), batch_size=64, shuffle=True)
        it = iter(cheap)
        count = batches * 30
        start = time.perf_counter()
        for _ in range(count):
            next(it)
        print(json.dumps({"value": count / (time.perf_counter() - start)}))
        return
    loader = DataLoader(Images(), batch_size=32, shuffle=True, num_workers=2,
                        multiprocessing_context="fork")  # fmt: skip
    if mode == "throughput":
        it = iter(loader)
        next(it)  # workers started
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        print(json.dumps({"value": batches / (time.perf_counter() - start)}))
        return
    start = time.perf_counter()
    if mode == "resume-skip":
        exact.load(loader, {"seed": 0, "epoch": 0, "consumed": skipped})
        next(iter(loader))
    else:  # resume by iterating: the consumed batches fetched and dropped
        it = iter(loader)
        for _ in range(skipped + 1):
            next(it)
    print(json.dumps({"value": time.perf_counter() - start}))


def _measure(mode: str, batches: int, exact_data: bool, skipped: int = SKIPPED,
             starts: int = STARTS) -> float:  # fmt: skip
    env = dict(os.environ, SLURMDDP_EXACT_DATA="1" if exact_data else "0", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.data_loading", "--child", mode,
                           "--batches", str(batches), "--skipped", str(skipped), "--starts",
                           str(starts)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"data_loading {mode} failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["value"])


def run(batches: int = 100, repeats: int = 3, skipped: int = SKIPPED,
        starts: int = STARTS) -> list[Row]:  # fmt: skip
    """The rows; `skipped`: the batches consumed before the resume, `starts`: the epochs started
    per measurement (the test's are a few, for the same code)."""
    throughput = alternate({"ours": lambda: _measure("throughput", batches, True),
                            "torch": lambda: _measure("throughput", batches, False)}, repeats)
    cheap = alternate({"ours": lambda: _measure("cheap", batches, True),
                       "torch": lambda: _measure("cheap", batches, False)}, repeats)
    resume = alternate({"ours": lambda: _measure("resume-skip", batches, True, skipped),
                        "iterating": lambda: _measure("resume-iterate", batches, True, skipped)},
                       repeats)  # fmt: skip
    started = alternate({"ours": lambda: _measure("start-rank", batches, True, starts=starts),
                         "plain": lambda: _measure("start-plain", batches, True, starts=starts)},
                        repeats)  # fmt: skip
    return [
        Row("data", "batches/s, 2 fork workers, 32 x 3x224x224 crops with flip and noise",
            throughput["ours"], throughput["torch"], "batches/s", "torch's own seeding",
            ">= 0.97"),
        Row("data", "batches/s, no workers, 64 integers a batch (samples that cost nothing)",
            cheap["ours"], cheap["torch"], "batches/s", "torch's own DataLoader", ">= 0.97"),
        Row("data", f"to the first batch of an epoch resumed after {skipped} batches",
            resume["ours"], resume["iterating"], "s", "the consumed batches fetched and dropped",
            "< 1, no consumed sample fetched"),
        Row("data", "to the first batch of an epoch, 4 fork workers started as a rank starts them",
            started["ours"], started["plain"], "s", "multiprocessing's own Process.start",
            "<= 1.1"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_loading")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--skipped", type=int, default=SKIPPED, help=argparse.SUPPRESS)
    p.add_argument("--starts", type=int, default=STARTS, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        _child(opts.child, opts.batches, opts.skipped, opts.starts)
        return
    report(run(opts.batches, opts.repeats), opts.json)


if __name__ == "__main__":
    main()

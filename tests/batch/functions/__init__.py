"""Functions the executor tests submit: imported by name on every rank (from the job's snapshot).

Kept apart from the test modules so that a rank imports only this, not pytest's fixtures.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path

from submitit.helpers import Checkpointable

import slurmddp


def rank() -> int:
    return int(os.environ["RANK"])


def all_reduce(x: float) -> dict:
    """Every rank's place, and a gloo all_reduce of x + rank over them."""
    import torch
    import torch.distributed as dist

    slurmddp.init(backend="gloo")
    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "host": host, "sum": t.item(),
           "local_rank": int(os.environ["LOCAL_RANK"])}  # fmt: skip
    dist.destroy_process_group()
    return out


def fail_on(bad: int, after_s: float = 2.0) -> int:
    """Rank `bad` raises at once; the others return later (their collective would wait)."""
    if rank() == bad:
        raise ValueError(f"rank {bad} broke")
    time.sleep(after_s)
    return rank()


def times(x: int, y: int = 1) -> tuple[int, int, str]:
    return x * y, rank(), os.environ.get("SLURM_ARRAY_TASK_ID", "")


def unpicklable() -> object:
    return (i for i in range(3))  # a generator cannot be pickled


class Unloadable(Exception):
    """Pickles, but cannot be rebuilt: its __init__ needs two arguments."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}+{b}")


def raise_unloadable() -> None:
    raise Unloadable(1, 2)


def version() -> str:
    """Replaced by the snapshot test with the code as it was when submitted."""
    return "v1"


class Trainer(Checkpointable):
    """submitit's pattern: the callable's state (the model's parameters, the step) is what
    `checkpoint` hands to the next run. Deterministic: each step's data comes from (step, rank).
    Each rank's `checkpoint` call leaves a marker in `marks` (the test counts them)."""

    def __init__(self, steps: int, step_time: float, marks: str) -> None:
        self.steps, self.step_time, self.marks = steps, step_time, marks
        self.step = 0
        self.params: dict | None = None
        self.runs: list[int] = []  # the step each run started at
        self.model = None

    def __call__(self) -> dict | None:
        import torch
        import torch.distributed as dist

        self.runs.append(self.step)
        slurmddp.init(backend="gloo")
        world, me = dist.get_world_size(), dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        if self.params is not None:
            model.load_state_dict(self.params)
        self.model = model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        while self.step < self.steps:
            g = torch.Generator().manual_seed(self.step * world + me)
            x = torch.randn(16, 8, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            self.step += 1
            if self.step % 10 == 0 and me == 0:
                print(f"step {self.step} ", flush=True)
            time.sleep(self.step_time)
            if slurmddp.should_stop():
                return None  # checkpoint() is called next, on every rank
        dist.destroy_process_group()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                         for p in model.parameters())).hexdigest()  # fmt: skip
        return {"steps": self.step, "digest": digest, "runs": self.runs}

    def checkpoint(self, *args, **kwargs):
        assert self.model is not None
        self.params = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.model = None
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        Path(self.marks, f"rank-{rank()}-restart-{restart}-step-{self.step}").touch()
        return super().checkpoint(*args, **kwargs)


def uninterrupted_digest(steps: int, world: int) -> str:
    """What `Trainer(steps, ...)` returns as its digest on `world` ranks run without a stop,
    computed here in one process: each rank's gradient in turn, summed as gloo's all_reduce sums
    them, and averaged. Bit for bit only for 1 or 2 ranks, where the sum has one order (a + b ==
    b + a); on more, the all_reduce's order of additions is gloo's."""
    import torch

    assert world in (1, 2), world
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        grads = []
        for me in range(world):
            g = torch.Generator().manual_seed(step * world + me)
            x = torch.randn(16, 8, generator=g)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *each in zip(model.parameters(), *grads, strict=True):
            total = each[0].clone()
            for other in each[1:]:
                total += other
            total /= world
            p.grad = total
        opt.step()
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()  # fmt: skip


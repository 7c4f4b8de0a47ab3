"""train_state: what capture returns loads under weights_only, RNGs come back exactly, and a run
resumed in a fresh process ends bitwise where the uninterrupted run ends."""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from slurmddp.checkpoint import CheckpointError, _check_state
from slurmddp.training import train_state
from slurmddp.training.sampler import ResumableDistributedSampler
from tests.conftest import PROGRAMS, free_port, launcher_free_env, tagged_json


def components():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    sched.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    sampler = ResumableDistributedSampler(range(12), 1, 0, seed=3)
    sampler.set_epoch(2)
    return model, opt, sched, scaler, sampler


def weights_only_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def draws() -> tuple:
    return (random.random(), random.gauss(0, 1), random.getrandbits(70),
            np.random.rand(3).tolist(), np.random.standard_normal(), torch.rand(3).tolist(),
            torch.randint(0, 9, (2,)).tolist())  # fmt: skip


def test_capture_is_plain_and_restore_brings_every_component_back():
    model, opt, sched, scaler, sampler = components()
    state = train_state.capture(model=torch.nn.DataParallel(model), optimizer=opt,
                                scheduler=sched, scaler=scaler, sampler=sampler, step=7, epoch=2,
                                position=4, note="hello", best=0.25)  # fmt: skip
    assert _check_state(state, sharded=False) is None
    loaded = weights_only_round_trip(state)
    assert sorted(loaded) == ["epoch", "extra", "model", "optimizer", "position", "rng",
                              "sampler", "scaler", "scheduler", "step"]  # fmt: skip
    assert list(loaded["model"]) == list(model.state_dict())  # DataParallel's "module." is gone
    assert loaded["sampler"] == {"epoch": 2, "start": 4, "seed": 3, "shuffle": True,
                                 "dataset_len": 12}  # fmt: skip

    model2, opt2, sched2, scaler2, _ = components()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    opt2.param_groups[0]["lr"] = 9.0
    sampler2 = ResumableDistributedSampler(range(12), 1, 0)
    counters = train_state.restore(loaded, model=model2, optimizer=opt2, scheduler=sched2,
                                   scaler=scaler2, sampler=sampler2)  # fmt: skip
    assert counters == {"step": 7, "epoch": 2, "position": 4, "note": "hello", "best": 0.25}
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for i, buf in opt.state_dict()["state"].items():
        assert torch.equal(opt2.state_dict()["state"][i]["momentum_buffer"], buf["momentum_buffer"])
    assert sched2.state_dict() == sched.state_dict()
    sampler2.set_epoch(2)
    assert (sampler2.epoch, sampler2.start, sampler2.seed) == (2, 4, 3)


def test_restore_names_a_missing_component():
    model, *_ = components()
    with pytest.raises(CheckpointError, match="the checkpoint holds no optimizer state"):
        train_state.restore(train_state.capture(model=model), model=model,
                            optimizer=torch.optim.SGD(model.parameters(), lr=1))  # fmt: skip


def test_rng_state_comes_back_exactly_through_weights_only_loading():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and in numpy's (the pair's second value)
    saved = weights_only_round_trip(train_state.capture_rng())
    assert _check_state(saved, sharded=False) is None
    expected = draws()
    draws()
    train_state.restore_rng(saved)
    assert draws() == expected


def test_cuda_generators_are_captured_and_restored_when_cuda_is_there(monkeypatch):
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((s, i)))
    saved = train_state.capture_rng()
    assert saved["cuda"] == states
    train_state.restore_rng(saved)
    assert restored == [(states[0], 0)]  # only as many devices as this process has

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cuda" not in train_state.capture_rng()
    train_state.restore_rng(saved)  # saved on GPUs, restored without: CUDA states skipped
    assert len(restored) == 1


TRAIN = """
import hashlib, random, sys
import numpy as np, torch
from slurmddp.training import train_state
from slurmddp.checkpoint import Checkpointer
from slurmddp.training.sampler import ResumableDistributedSampler

mode, directory, save_at, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0); random.seed(0); np.random.seed(0)
inputs, targets = torch.randn(40, 6), torch.randn(40, 1)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Tanh(),
                            torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
scaler = torch.amp.GradScaler("cpu", enabled=False)
sampler = ResumableDistributedSampler(range(40), num_replicas=1, rank=0, seed=7)
ckpt = Checkpointer(directory)
step = epoch = position = 0
if mode != "full":
    got = train_state.restore(ckpt.load_latest().state, model=model, optimizer=opt,
                              scheduler=sched, scaler=scaler, sampler=sampler,
                              rng=mode == "resume")
    step, epoch, position = got["step"], got["epoch"], got["position"]
batch = 4
while step < stop_at:
    sampler.set_epoch(epoch)
    order = list(sampler)
    for b in range(0, len(order), batch):
        ix = order[b:b + batch]
        x = inputs[ix] + 0.01 * torch.randn(len(ix), 6)                 # torch RNG
        x = x * float(1 + 0.01 * np.random.randn())                      # numpy RNG
        scale = 1 + 0.1 * random.random()                                # python RNG
        loss = ((model(x) - targets[ix]) ** 2).mean() * scale            # dropout: torch RNG
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        step += 1
        position += len(ix)
        if mode == "full" and step == save_at:
            ckpt.save(step, train_state.capture(model=model, optimizer=opt, scheduler=sched,
                                                scaler=scaler, sampler=sampler, step=step,
                                                epoch=epoch, position=position))
        if step == stop_at:
            break
    else:
        epoch, position = epoch + 1, 0
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
print("HASH", digest.hexdigest(), step, epoch)
"""


def train(*args) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAIN), *map(str, args)],
                       env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.split("HASH ", 1)[1].strip()


@pytest.mark.ranks
@pytest.mark.floor
def test_resumed_in_a_fresh_process_the_run_ends_bitwise_equal(tmp_path):
    # 10 steps per epoch: the checkpoint is mid-epoch 1, the run ends in epoch 2.
    full = train("full", tmp_path, 13, 27)
    resumed = train("resume", tmp_path, 13, 27)
    assert resumed == full
    assert full.endswith(" 27 2")
    # The same resume without the RNG state drifts: the comparison above can see a difference.
    assert train("resume-without-rng", tmp_path, 13, 27) != full


@pytest.mark.parametrize("numpy", [True, False], ids=["with numpy", "without numpy"])
def test_every_rank_gets_its_own_generators_back(tmp_path, numpy):
    from tests.checkpoint.test_checkpoint import PRELUDE, run_ranks

    # numpy is optional: without it the gathered RNG states still come back.
    hide_numpy = "" if numpy else "import sys; sys.modules['numpy'] = None\n"
    results = run_ranks(
        """
        from slurmddp.training import train_state
        torch.manual_seed(100 + rank)  # ranks draw differently, e.g. dropout masks
        c = Checkpointer(D, keep=1)
        c.save(1, train_state.capture())  # collective: rank 0 writes every rank's RNG
        first = torch.rand(3).tolist()
        torch.manual_seed(0)
        train_state.restore(c.load_latest().state)
        rngs = c.load_latest().state["rng"]
        out = {"first": first, "again": torch.rand(3).tolist(), "numpy": "numpy" in rngs[1]}
        """,
        tmp_path, prelude=hide_numpy + PRELUDE,
    )  # fmt: skip
    assert [r["numpy"] for r in results] == [numpy, numpy]
    assert [r["first"] == r["again"] for r in results] == [True, True]
    assert results[0]["first"] != results[1]["first"]


def test_prime_ddp_changes_nothing_the_training_sees():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))

    class Wrapper(torch.nn.Module):  # stands in for DDP: prime_ddp only calls it
        def __init__(self):
            super().__init__()
            self.module = model

        def forward(self, x):
            return {"out": self.module(x)}

    wrapper = Wrapper()
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    train_state.prime_ddp(wrapper, torch.ones(2, 4))
    assert wrapper.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


README_LOOP = str(PROGRAMS / "readme_loop.py")


def run_readme_loop(checkpoints, *args: str, world: int = 3) -> list[dict]:
    """The guide's loop at `world` ranks (gloo, local processes under the runner)."""
    return run_ranks(README_LOOP, checkpoints, *args, world=world)


def run_ranks(program: str, checkpoints, *args: str, world: int, timeout: float = 300,
              **env: str) -> list[dict]:
    """`program --checkpoint-dir checkpoints ARGS` at `world` local ranks under the runner; the
    RESULT lines of those that ended (none of those that stopped and checkpointed).

    Each rank writes to files, not pipes: a rank is done when it exits, whatever its forked
    DataLoader workers still hold open, and no rank can block on a pipe nobody reads yet. A rank
    still running after `timeout` s is a hang: every process of every rank then writes its Python
    stacks (faulthandler, on SIGABRT), and the test fails with them.
    """
    port = str(free_port())
    logs = Path(tempfile.mkdtemp(prefix="slurmddp-ranks-"))
    procs = []
    for r in range(world):
        out, err = (open(logs / f"{r}.{kind}", "w+") for kind in ("out", "err"))  # noqa: SIM115
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "slurmddp.run", program, "--checkpoint-dir", str(checkpoints),
             *args], stdout=out, stderr=err, text=True,
            env=launcher_free_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
                                  **env)), out, err))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = [p for p, _, _ in procs if p.poll() is None]
        if hung:
            for p, _, _ in procs:
                _abort_tree(p.pid)
            time.sleep(2)
        texts = []
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            with out, err:
                out.seek(0)
                err.seek(0)
                texts.append((p.returncode, out.read(), err.read()))
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    assert not hung, "ranks hung; their stacks:\n" + "\n".join(
        f"--- rank {r} ({code}):\n{err}" for r, (code, _, err) in enumerate(texts))
    results = []
    for code, stdout, stderr in texts:
        results += tagged_json(stdout, "RESULT ")
        assert code in (0, 75), stderr  # 75: stopped and checkpointed, outside Slurm
    return results


def _abort_tree(pid: int) -> None:
    """SIGABRT to `pid` and every process under it (DataLoader workers), children first."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                              text=True).stdout.split()  # fmt: skip
    for child in children:
        _abort_tree(int(child))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGABRT)


@pytest.mark.ranks
def test_ranks_that_hang_fail_the_test_with_every_process_stack(tmp_path):
    program = tmp_path / "hang.py"
    program.write_text("import os, time\n"
                       "if os.environ['RANK'] == '1':\n"
                       "    time.sleep(600)\n")  # fmt: skip
    with pytest.raises(AssertionError, match=r"(?s)ranks hung.*rank 1 .*in <module>"):
        run_ranks(str(program), tmp_path, world=2, timeout=5)


@pytest.mark.ranks
@pytest.mark.floor
def test_the_readme_loop_resumes_bitwise_without_a_call_to_prime_ddp(tmp_path):
    # Three ranks: with more than two, DDP's bucket layout decides the order of the sums (two
    # ranks add a + b in any layout): the smallest world in which the control below can differ.
    reference = {r["digest"] for r in run_readme_loop(tmp_path / "a")}
    assert len(reference) == 1
    assert run_readme_loop(tmp_path / "b", "--stop-at", "25") == []  # stopped, checkpointed
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    resumed = run_readme_loop(tmp_path / "b")
    starts = {r["start"] for r in resumed}
    assert len(starts) == 1 and 26 <= starts.pop() <= 30  # within two steps or so of the signal
    assert {r["digest"] for r in resumed} == reference
    # The control: the same without restore's priming ends in other bits, so the test can fail.
    # It resumes from the same stop (a copy made before the resume: only restore primes, so the
    # stopped run is the same with or without --no-prime).
    unprimed = {r["digest"] for r in run_readme_loop(tmp_path / "c", "--no-prime")}
    assert len(unprimed) == 1 and unprimed != reference

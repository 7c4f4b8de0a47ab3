"""The GPU path on a real CUDA GPU: ``python -m pytest -m gpu`` on a machine with one.

Each test runs one rank in a fresh process that joins through `slurmddp.init()`, so the backend
is NCCL and the rank's device is its GPU, as on a GPU node. One GPU allows one NCCL rank (two
ranks on one GPU are refused by NCCL), so the collectives here run at world size 1: still NCCL's
communicator, CUDA tensors and the device binding. Without a CUDA GPU every test skips and says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, free_port, launcher_free_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

# Bitwise comparisons need cuBLAS and cuDNN to pick the same kernels in every process.
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

PRELUDE = """
import json, os, sys, warnings
import torch, torch.distributed as td
warnings.simplefilter("ignore")
torch.use_deterministic_algorithms(True)
import slurmddp
dist = slurmddp.init(timeout=120)
D = os.environ["WORK_DIR"]
out = {}
"""


def run_rank(code: str, directory: Path, *args: str, prelude: str = PRELUDE) -> dict:
    """Run `code` as rank 0 of 1 after `slurmddp.init()`; the `out` dict it fills."""
    program = (prelude + textwrap.dedent(code) + "\nprint('RESULT', json.dumps(out), flush=True)"
               "\ntd.destroy_process_group()\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=rank_env(WORK_DIR=str(directory)))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def rank_env(**extra: str) -> dict[str, str]:
    return launcher_free_env(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                             MASTER_PORT=str(free_port()), **DETERMINISTIC, **extra)  # fmt: skip


def test_init_joins_nccl_with_the_device_bound(tmp_path):
    out = run_rank(
        """
        from slurmddp.launch.process_group import device
        group = td.distributed_c10d._get_default_group()
        t = torch.ones(4, device=device())
        td.all_reduce(t)
        out.update(backend=td.get_backend(), device=device(), current=torch.cuda.current_device(),
                   bound=str(group.bound_device_id), sum=t.sum().item())
        """,
        tmp_path,
    )
    assert out == {"backend": "nccl", "device": "cuda:0", "current": 0, "bound": "cuda:0",
                   "sum": 4.0}  # fmt: skip


def test_the_agreement_tensor_lives_on_the_gpu_and_carries_the_stop(tmp_path):
    # At world size 1 should_stop() needs no collective; the agreement's all_reduce is called
    # directly, as it runs at every larger size.
    out = run_rank(
        """
        from slurmddp.preemption.agreement import Agreement
        from slurmddp.preemption.signals import STOP, TERM
        a = Agreement()
        quiet = a._reduce(td, 0, None, paced=True)
        stop = a._reduce(td, STOP, None, paced=True)
        both = a._reduce(td, STOP | TERM, None, paced=False)
        out.update(device=str(a._flag.device), quiet=quiet, stop=stop, both=both,
                   expect=[[0, 0], [STOP, 0], [STOP | TERM, 0]], gap=a._pace.gap)
        """,
        tmp_path,
    )
    assert out["device"] == "cuda:0"
    assert [out["quiet"], out["stop"], out["both"]] == out["expect"]
    assert out["gap"] >= 1


def test_cuda_generators_come_back_bitwise_through_a_checkpoint(tmp_path):
    out = run_rank(
        """
        from slurmddp.training import train_state
        from slurmddp.checkpoint import Checkpointer
        torch.cuda.manual_seed(1234)
        torch.randn(100, device="cuda")  # move the generator off its seed
        c = Checkpointer(D + "/rng")
        c.save(1, train_state.capture())
        drop = torch.nn.Dropout(0.5)
        def draws():
            x = torch.randn(1000, device="cuda")
            return torch.cat([x, drop(torch.ones(1000, device="cuda")),
                              torch.rand(10, device="cuda")]).cpu()
        first = draws()
        torch.cuda.manual_seed(99)
        train_state.restore(c.load_latest().state)
        again = draws()
        torch.cuda.manual_seed(99)
        out.update(equal=torch.equal(first, again), other=torch.equal(first, draws()),
                   saved=len(c.load_latest().state["rng"]["cuda"]))  # world 1: not gathered
        """,
        tmp_path,
    )
    assert out == {"equal": True, "other": False, "saved": torch.cuda.device_count()}


def test_an_asynchronous_save_snapshots_gpu_tensors_before_it_returns(tmp_path):
    out = run_rank(
        """
        from slurmddp.checkpoint import Checkpointer, wait_for_saves
        c = Checkpointer(D + "/async", async_save=True, keep=2)
        w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        tied = {"a": w, "b": w}
        c.save(1, {"w": w, "tied": tied, "step": 1})
        w.add_(1)  # training goes on at once: the checkpoint must hold the values at save()
        c.save(2, {"w": w, "tied": tied, "step": 2})
        w.mul_(0)
        wait_for_saves()
        first = torch.load(D + "/async/step-00000001/state.pt", weights_only=True)
        on_gpu = c.load_latest(map_location="cuda")
        out.update(first=first["w"][:3].tolist(), first_device=str(first["w"].device),
                   tied=first["tied"]["a"].data_ptr() == first["tied"]["b"].data_ptr(),
                   latest=on_gpu.step, latest_w=on_gpu.state["w"][:3].tolist(),
                   latest_device=str(on_gpu.state["w"].device), live=w[:3].tolist())
        """,
        tmp_path,
    )
    assert out == {"first": [0.0, 1.0, 2.0], "first_device": "cpu", "tied": True, "latest": 2,
                   "latest_w": [1.0, 2.0, 3.0], "latest_device": "cuda:0",
                   "live": [0.0, 0.0, 0.0]}  # fmt: skip


def test_a_sharded_fsdp2_checkpoint_on_the_gpu_comes_back(tmp_path):
    out = run_rank(
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from slurmddp.checkpoint import Checkpointer
        torch.manual_seed(0)
        mesh = init_device_mesh("cuda", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 8)).cuda()
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        def step():
            opt.zero_grad()
            model(torch.randn(16, 64, device="cuda")).square().mean().backward()
            opt.step()
        step()
        f = Checkpointer(D + "/fsdp", sharded=True)
        msd, osd = get_state_dict(model, opt)
        f.save(1, {"model": msd, "optim": osd})
        want = [p.full_tensor().clone() for p in model.parameters()]
        moments = [s["exp_avg"].full_tensor().clone() for s in opt.state.values()]
        step(); step()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        loaded = f.load_latest(into=state)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        got = [p.full_tensor() for p in model.parameters()]
        out.update(step=loaded.step, params=all(torch.equal(a, b) for a, b in zip(want, got)),
                   moments=all(torch.equal(a, s["exp_avg"].full_tensor())
                               for a, s in zip(moments, opt.state.values())),
                   device=str(got[0].device), files=sorted(os.listdir(loaded.path)))
        """,
        tmp_path,
    )
    assert out == {"step": 1, "params": True, "moments": True, "device": "cuda:0",
                   "files": [".metadata", "__0_0.distcp", "manifest.json"]}  # fmt: skip


def test_an_asynchronous_sharded_fsdp2_checkpoint_on_the_gpu_comes_back(tmp_path):
    # The training's group is NCCL; DCP's background collectives run on the Checkpointer's own
    # gloo group, and each rank's shards are copied to CPU memory before save returns.
    out = run_rank(
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from slurmddp.checkpoint import Checkpointer, wait_for_saves
        torch.manual_seed(0)
        mesh = init_device_mesh("cuda", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 8)).cuda()
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        def step():
            opt.zero_grad()
            model(torch.randn(16, 64, device="cuda")).square().mean().backward()
            opt.step()
        step()
        f = Checkpointer(D + "/fsdp", sharded=True, async_save=True)
        msd, osd = get_state_dict(model, opt)
        f.save(1, {"model": msd, "optim": osd})
        want = [p.full_tensor().clone() for p in model.parameters()]
        step(); step()  # while the save may still be in flight: it holds its own copy
        wait_for_saves()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        loaded = f.load_latest(into=state)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        got = [p.full_tensor() for p in model.parameters()]
        out.update(step=loaded.step, params=all(torch.equal(a, b) for a, b in zip(want, got)),
                   device=str(got[0].device), files=sorted(os.listdir(loaded.path)))
        """,
        tmp_path,
    )
    assert out == {"step": 1, "params": True, "device": "cuda:0",
                   "files": [".metadata", "__0_0.distcp", "manifest.json"]}  # fmt: skip


# DDP on the GPU with fp16 autocast and a GradScaler that starts too high (its first steps
# overflow and are skipped), dropout drawing from the CUDA generator.
AMP_TRAIN = """
import hashlib
from torch.nn.parallel import DistributedDataParallel
from slurmddp.training import train_state
from slurmddp.checkpoint import Checkpointer
mode, save_at, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(256, 1)).cuda()
ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda", init_scale=2.0**30, growth_interval=5)
ckpt = Checkpointer(D + "/amp")
step, skipped = 0, 0
if mode != "full":
    got = train_state.restore(ckpt.load_latest().state, model=ddp, optimizer=opt, scaler=scaler,
                              rng=mode == "resume")
    step = got["step"]
while step < stop_at:
    x = torch.randn(64, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = ddp(x).float().pow(2).mean()
    opt.zero_grad()
    before = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    skipped += scaler.get_scale() < before
    step += 1
    if mode == "full" and step == save_at:
        ckpt.save(step, train_state.capture(model=ddp, optimizer=opt, scaler=scaler, step=step))
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
out.update(digest=digest.hexdigest(), step=step, scale=scaler.get_scale(), skipped=skipped)
"""


def test_amp_fp16_with_a_grad_scaler_resumes_bitwise(tmp_path):
    full = run_rank(AMP_TRAIN, tmp_path, "full", "12", "30")
    resumed = run_rank(AMP_TRAIN, tmp_path, "resume", "12", "30")
    assert resumed == full | {"skipped": resumed["skipped"]}  # skips counted since the resume
    assert full["skipped"] > resumed["skipped"] >= 0 and full["step"] == 30
    # The control: the same resume without the generators (dropout) drifts.
    assert run_rank(AMP_TRAIN, tmp_path, "resume-without-rng", "12", "30")["digest"] != (
        full["digest"])


# Issue 28: dropout on CUDA under bf16 autocast, a DataLoader with 2 persistent workers adding
# random noise to every sample, shuffled; saved mid-epoch with the loader, resumed.
CUDA_DATA_LOOP = """
import hashlib
from torch.utils.data import DataLoader, Dataset
from slurmddp.training import train_state
from slurmddp.checkpoint import Checkpointer
mode, save_at = sys.argv[1], int(sys.argv[2])

class Noisy(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        x = torch.randn(32, generator=torch.Generator().manual_seed(i))
        return x + 0.1 * torch.randn(32), x.sum(0, keepdim=True)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(256, 1)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True,
                    multiprocessing_context="fork")  # the workers never touch CUDA
ckpt = Checkpointer(D + "/data", async_save=False,
                    snapshot_every=int(os.environ.get("SNAPSHOT_EVERY", "0")), snapshot_budget=None)
crash_at = int(os.environ.get("CRASH_AT", "0"))
step, first = 0, 0
if mode == "resume":
    loaded = ckpt.load_latest()
    got = train_state.restore(loaded.state, model=model, optimizer=opt, loader=loader)
    step, first = got["step"], got["epoch"]
    out["resumed"] = str(loaded.path)

def state():
    return train_state.capture(model=model, optimizer=opt, loader=loader, step=step, epoch=epoch)

for epoch in range(first, 3):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x.cuda()).float(), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        ckpt.snapshot(step, state)
        if mode == "full" and step == save_at:
            ckpt.save(step, state())
        if mode == "full" and step == crash_at:
            os.kill(os.getpid(), 9)
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
out.update(digest=digest.hexdigest(), step=step)
"""


def run_data_loop(directory: Path, mode: str, killed: bool = False, **env: str) -> dict:
    program = (PRELUDE + textwrap.dedent(CUDA_DATA_LOOP)
               + "\nprint('RESULT', json.dumps(out), flush=True)\ntd.destroy_process_group()\n")
    r = subprocess.run([sys.executable, "-c", program, mode, "17"], capture_output=True,
                       text=True, timeout=300,
                       env=rank_env(WORK_DIR=str(directory), **env))  # fmt: skip
    assert r.returncode == (-9 if killed else 0), r.stdout + r.stderr
    return {} if killed else {**json.loads(r.stdout.split("RESULT ", 1)[1]), "said": r.stderr}


def same_run(result: dict) -> dict:
    return {k: result[k] for k in ("digest", "step")}


def test_a_resumed_cuda_loop_with_dropout_and_augmenting_workers_is_bitwise(tmp_path):
    full = run_data_loop(tmp_path / "a", "full")
    assert full["step"] == 36 and same_run(run_data_loop(tmp_path / "a", "resume")) == same_run(
        full)  # fmt: skip
    # The control: torch's own loader seeding drifts.
    control = run_data_loop(tmp_path / "b", "full", SLURMDDP_EXACT_DATA="0")
    assert run_data_loop(tmp_path / "b", "resume", SLURMDDP_EXACT_DATA="0")["digest"] != (
        control["digest"])


def test_a_rank_killed_resumes_from_its_cuda_snapshot_bitwise(tmp_path):
    # Issue 30 on a GPU: the same loop with a snapshot every step (its GPU tensors queued into
    # pinned memory behind the step), killed at step 27, ten after its durable checkpoint; a fresh
    # process on the same node resumes from a snapshot, not the checkpoint, and ends bitwise.
    full = run_data_loop(tmp_path / "full", "full")
    node = {"SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "shm"), "SLURM_JOB_ID": "91",
            "SLURMD_NODENAME": "g1", "SNAPSHOT_EVERY": "1"}  # fmt: skip
    run_data_loop(tmp_path / "a", "full", killed=True, CRASH_AT="27", **node)
    resumed = run_data_loop(tmp_path / "a", "resume", **node)
    # Killed as step 27's snapshot was being written: it, or step 26's, is whole.
    assert re.search(r"resuming from the snapshot of step 2[67] ", resumed["said"]), (
        resumed["said"])
    assert "g1" in resumed["resumed"] and same_run(resumed) == same_run(full)


def test_doctor_check_passes_on_nccl():
    r = subprocess.run([sys.executable, "-m", "slurmddp", "doctor", "--check"], cwd=ROOT,
                       env=rank_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend nccl" in r.stdout and "all checks passed" in r.stdout, r.stdout


def test_the_preflight_passes_a_healthy_gpu_and_fails_a_wrong_product(monkeypatch):
    from slurmddp.errors import NodeCheckError
    from slurmddp.launch import preflight

    assert preflight.check_gpus() == torch.cuda.device_count()
    # A GPU that computes wrong: its products come back changed.
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: real(t) + (1.0 if t.is_cuda else 0.0))
    with pytest.raises(NodeCheckError, match=r"GPU 0 .* computed a wrong matrix product"):
        preflight.check_gpus()


def test_the_preflight_runs_under_the_runner_on_nccl():
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", "-m", "slurmddp.launch.preflight"],
                       cwd=ROOT, env=rank_env(), capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend nccl" in r.stdout and "all checks passed" in r.stdout, r.stdout


def test_the_checkpoint_benchmark_runs_from_gpu_memory():
    from benchmarks import checkpoint_write

    rows = checkpoint_write.run(size_mib=64, repeats=1, device="cuda")
    assert [row.metric for row in rows] == [
        "write throughput from GPU memory, 0.06 GiB (copy, write, fsync, crc32, publish)",
        "training stall of a save from GPU memory",
    ]
    assert all(row.ours > 0 and row.baseline > 0 for row in rows)


def test_two_ranks_on_one_gpu_are_told_in_one_line_before_nccl_starts(tmp_path):
    # --gpus-per-node=1 --ntasks-per-node=2: both tasks see GPU 0. NCCL would refuse it later
    # ("Duplicate GPU detected") or hang; every rank says why at the rendezvous instead.
    script = tmp_path / "train.py"
    script.write_text("import slurmddp\nslurmddp.init()\nprint('joined')\n")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "slurmddp.run", str(script)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=launcher_free_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                    LOCAL_WORLD_SIZE="2", MASTER_PORT=port,
                                                    MASTER_ADDR="127.0.0.1",
                                                    CUDA_VISIBLE_DEVICES="0"))
             for r in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 1, (out, err)
        assert "joined" not in out
        assert f"share one GPU ({uuid}) and NCCL needs a GPU per rank" in err, err
        assert "Traceback" not in err and "Duplicate GPU" not in err, err


def test_the_rank_runs_on_the_cpus_the_kernel_lists_near_its_gpu(tmp_path):
    out = run_rank(
        """
        from slurmddp.rank import placement
        from slurmddp.launch import process_group
        listed = process_group.gpu_cpulist(torch, 0)
        near = placement.parse_cpulist(listed.read_text())
        out.update(path=str(listed), near=sorted(near), mine=sorted(os.sched_getaffinity(0)),
                   node=os.cpu_count())
        """,
        tmp_path,
    )
    near, mine = set(out["near"]), set(out["mine"])
    # Moved to the GPU's NUMA node where that is a part of the node, else left on every CPU.
    assert mine == (near if len(near) < out["node"] else set(range(out["node"]))), out

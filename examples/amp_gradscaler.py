"""Mixed precision with torch.amp, and a GradScaler whose state is checkpointed.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/amp_gradscaler.py --steps 200
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/amp_gradscaler.py --steps 200

What NVIDIA apex once did is in torch itself: `apex.amp.initialize(model, opt, opt_level="O1")`
becomes `torch.autocast` around the forward (each op runs in float16 or bfloat16 where that is
safe), and `with amp.scale_loss(loss, opt) as scaled: scaled.backward()` becomes
`scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`. The scaler multiplies the
loss so that float16 gradients do not underflow, skips a step whose gradients overflowed, halves
the scale then, and doubles it after `growth_interval` clean steps.

The scale and its growth tracker are training state: a resumed run that started again from the
initial scale would skip steps the uninterrupted one took. So the scaler goes into the checkpoint
(`train_state.capture(scaler=...)`) and comes back with `train_state.restore(scaler=...)`.

On a GPU: float16 with GradScaler("cuda"). On CPU: bfloat16, whose range is float32's, so it needs
no scaling; GradScaler("cpu") works all the same (a power-of-two scale changes no bit), so the
same code, scaler checkpoint included, runs and is tested anywhere.
Rank 0 ends with one line ``RESULT {...}`` (JSON): the scaler's state and a parameter digest.
"""

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import slurmddp
from slurmddp.training import train_state


def digest(flat: torch.Tensor) -> str:
    """The parameters' bits, hashed (no numpy: the example needs only torch)."""
    return hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()[:16]


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A function of (step, rank): a resume needs only the step counter. With a DataLoader, see
    # ddp_sampler_eval.py for the sampler that resumes mid-epoch.
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x.to(device), torch.tanh(x @ torch.linspace(-1, 1, 16)).unsqueeze(1).to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--growth-interval", type=int, default=10, help="the scaler's (torch: 2000)")
    p.add_argument("--checkpoint-dir", default="checkpoints/amp_gradscaler")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.0, help="pretend each step is slower")
    args = p.parse_args()

    env = slurmddp.init()
    rank = env.rank
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.bfloat16

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    ddp = DistributedDataParallel(model.to(device))  # parameters stay float32: autocast casts
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, growth_interval=args.growth_interval)
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2)

    step, resumed_scale = 0, None
    loaded = ckpt.load_latest()
    if loaded is not None:
        step = train_state.restore(loaded.state, model=ddp, optimizer=optimizer,
                                   scaler=scaler)["step"]  # fmt: skip
        resumed_scale = scaler.get_scale()
        if rank == 0:
            print(f"resumed at step {step}: loss scale {resumed_scale}, growth tracker "
                  f"{scaler.state_dict()['_growth_tracker']}", flush=True)  # fmt: skip

    while step < args.steps:
        x, y = batch(step, rank, device)
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.mse_loss(ddp(x), y)  # mse_loss itself runs in float32
        optimizer.zero_grad()
        scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients
        scaler.step(optimizer)  # unscales; skips the step if any gradient is inf or NaN
        scaler.update()
        step += 1
        time.sleep(args.step_time)
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.5f} scale {scaler.get_scale()}", flush=True)
        if step < args.steps and slurmddp.should_stop():
            ckpt.save(step, train_state.capture(model=ddp, optimizer=optimizer, scaler=scaler,
                                                step=step))  # fmt: skip
            if rank == 0:
                print(f"stopped at step {step}: loss scale {scaler.get_scale()}, growth tracker "
                      f"{scaler.state_dict()['_growth_tracker']}", flush=True)  # fmt: skip
            slurmddp.requeue()
    slurmddp.mark_done()

    if rank == 0:
        flat = torch.cat([q.detach().float().cpu().flatten() for q in model.parameters()])
        result = {"device": device.type, "dtype": str(dtype).removeprefix("torch."),
                  "steps": step, "scale": scaler.get_scale(),
                  "growth_tracker": scaler.state_dict()["_growth_tracker"],
                  "resumed_scale": resumed_scale, "loss": round(loss.item(), 6),
                  "finite": bool(flat.isfinite().all()),
                  "digest": digest(flat)}  # fmt: skip
        print(f"RESULT {json.dumps(result)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""FSDP (fully_shard) training with sharded checkpoints: each rank saves and loads only its part.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/fsdp_sharded.py --steps 100
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/fsdp_sharded.py --steps 100

`fully_shard` (FSDP2) splits every parameter, gradient and optimizer state across the ranks, so
no rank holds the whole model outside a layer's forward and backward. It runs on CPU with gloo
too (this script does, without a GPU), which is slow but makes the pattern testable anywhere.

The checkpoint is sharded the same way: `Checkpointer(dir, sharded=True)` has every rank write
its own shards through torch.distributed.checkpoint (DCP), and `load_latest(into=state)` loads
each rank's shards in place, at the same or another world size. With `async_save=True` a save
returns once each rank has copied its shards to CPU memory, and DCP writes them while training
goes on (`--save-every N` saves so every N steps); `requeue()` waits for the write.
`get_state_dict` and `set_state_dict` translate between the sharded model and optimizer and
those state dicts.
On the stop signal the ranks save together and requeue, as in ddp_sampler_eval.py; the
resumed run ends with the same parameters as one that was never interrupted.
Rank 0 ends with one line ``RESULT {...}`` (JSON) with a digest of the full parameters.
"""

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import slurmddp


def digest(flat: torch.Tensor) -> str:
    """The parameters' bits, hashed (no numpy: the example needs only torch)."""
    return hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()[:16]


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # A function of (step, rank): a resume needs only the step counter.
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).cos().to(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-dir", default="checkpoints/fsdp_sharded")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: never)")
    p.add_argument("--step-time", type=float, default=0.0, help="pretend each step is slower")
    args = p.parse_args()

    env = slurmddp.init()
    rank, world = env.rank, env.world_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # fully_shard keeps this rank's slice of the same full initial weights
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1)).to(device)  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # each layer gathers its weights just in time...
    fully_shard(model, mesh=mesh)  # ...and the root takes whatever is left
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # created after sharding
    ckpt = slurmddp.Checkpointer(args.checkpoint_dir, keep=2, sharded=True, async_save=True)

    step = 0
    # Only when there is something to load: get_state_dict gives a fresh optimizer its state by
    # a step with zero gradients, which would count as a step for AdamW's bias correction.
    if os.path.isdir(args.checkpoint_dir):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        loaded = ckpt.load_latest(into=state)  # collective: each rank reads its own shards
        if loaded is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])  # fmt: skip
            step = loaded.step
            if rank == 0:
                print(f"resumed from {loaded.path.name} at step {step}", flush=True)

    while step < args.steps:
        x, y = batch(step, rank, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # reduce-scatter: each rank keeps the averaged gradient of its shard
        optimizer.step()
        step += 1
        time.sleep(args.step_time)
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        stop = step < args.steps and slurmddp.should_stop()
        if stop or (args.save_every and step % args.save_every == 0):
            model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: this rank's shards
            ckpt.save(step, {"model": model_sd, "optim": optim_sd})  # returns once copied
        if stop:
            if rank == 0:
                print(f"stopped at step {step}", flush=True)
            slurmddp.requeue()  # waits until the checkpoint is published
    slurmddp.mark_done()

    # full_tensor() gathers a parameter from all ranks: a collective, so every rank calls it.
    flat = torch.cat([q.full_tensor().detach().cpu().flatten() for q in model.parameters()])
    if rank == 0:
        local = sum(q.to_local().numel() for q in model.parameters())
        result = {"world_size": world, "steps": step, "loss": round(loss.item(), 6),
                  "parameters": flat.numel(), "parameters_on_rank0": local,
                  "finite": bool(flat.isfinite().all()),
                  "digest": digest(flat)}  # fmt: skip
        print(f"RESULT {json.dumps(result)}", flush=True)
    ckpt.wait()  # an asynchronous sharded save needs the process group until it is written
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

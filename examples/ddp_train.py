"""A small DDP training written for torchrun: nothing in it knows about Slurm or slurmddp.

    torchrun --nproc-per-node=2 examples/ddp_train.py --steps 20
    srun -N4 -n8 python -m slurmddp.run examples/ddp_train.py --steps 20

Every rank trains on its own data shard; DDP averages the gradients, so all ranks must end with
bitwise identical parameters. Each rank prints one ``RESULT {...}`` line with a digest of its
parameters, and rank 0 says whether all digests agree.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)  # a different shard on every rank
    w_true = torch.linspace(-1, 1, 16)

    loss = torch.tensor(0.0)
    for _ in range(args.steps):
        x = torch.randn(64, 16, generator=data)
        y = (x @ w_true).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()[:16]
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(gathered[0], g) for g in gathered)
    result = {
        "rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
        "steps": args.steps, "loss": round(loss.item(), 6), "digest": digest,
        "finite": bool(flat.isfinite().all()),
    }  # fmt: skip
    # One write per line, so ranks sharing a pipe (torchrun's workers) cannot interleave.
    sys.stdout.write(f"RESULT {json.dumps(result)}\n")
    sys.stdout.flush()
    if rank == 0:
        print(f"trained {args.steps} steps on {world} ranks, final loss {loss.item():.4f}, "
              f"parameters identical on all ranks: {identical}", flush=True)  # fmt: skip
    # Leave together: a rank that tears its connections down while another is still finishing
    # the last collective makes that one abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 1


if __name__ == "__main__":
    # Exit after main() returns, so that its model and process group are freed first.
    raise SystemExit(main())

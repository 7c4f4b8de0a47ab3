"""Gradient accumulation with DDP: one all-reduce per optimizer step, not one per micro-batch.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/grad_accumulation.py --accum 4
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/grad_accumulation.py --accum 4

Every DDP backward all-reduces the gradients. To accumulate K micro-batches into one optimizer
step, run the first K-1 backwards inside `ddp.no_sync()`: their gradients only add up in each
rank's `.grad`, and the K-th backward, outside it, all-reduces the sum once. Dividing each
micro-batch's loss by K makes the result the gradient of the whole global batch (K micro-batches
on each of W ranks), as if it had been one large batch on one process.

The script proves both: a communication hook counts DDP's all-reduces per micro-batch (the
printout shows 0 for all but the last), and at the first step the accumulated gradient is
compared with the gradient of the large batch computed in one piece on a copy of the model.
Rank 0 ends with one line ``RESULT {...}`` (JSON).
"""

import argparse
import copy
import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import slurmddp


def digest(flat: torch.Tensor) -> str:
    """The parameters' bits, hashed (no numpy: the example needs only torch)."""
    return hashlib.sha256(bytes(flat.view(torch.uint8).tolist())).hexdigest()[:16]


def micro_batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_000 * step + 1000 * rank + micro)
    x = torch.randn(16, 8, generator=g)
    return x, (x @ torch.linspace(-1, 1, 8)).unsqueeze(1) ** 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    args = p.parse_args()

    env = slurmddp.init("gloo")  # CPU tensors throughout: a short example, not a fast one
    rank, world, k = env.rank, env.world_size, args.accum

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(model)  # the same initial weights, never wrapped
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    # Count DDP's all-reduces (one per gradient bucket) for each micro-batch position.
    per_micro = [0] * k
    current = 0

    def counting_allreduce(group, bucket):
        per_micro[current] += 1
        return default_hooks.allreduce_hook(group, bucket)  # what DDP does without a hook

    ddp.register_comm_hook(None, counting_allreduce)

    grad_diff = None
    for step in range(args.steps):
        optimizer.zero_grad()
        for current in range(k):
            x, y = micro_batch(step, rank, current)
            if current < k - 1:
                with ddp.no_sync():  # no communication: gradients add up locally
                    (torch.nn.functional.mse_loss(ddp(x), y) / k).backward()
            else:  # the last micro-batch: this backward all-reduces the accumulated sum
                (torch.nn.functional.mse_loss(ddp(x), y) / k).backward()
        if step == 0:
            # The same step as one large batch: every rank's micro-batches, in one forward.
            xs, ys = zip(*(micro_batch(0, r, m) for r in range(world) for m in range(k)),
                         strict=True)  # fmt: skip
            torch.nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
            pairs = zip(model.parameters(), reference.parameters(), strict=True)
            grad_diff = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
        optimizer.step()

    if rank == 0:
        print(f"all-reduces per micro-batch position over {args.steps} steps: {per_micro} "
              f"(without no_sync: {[per_micro[-1]] * k})", flush=True)  # fmt: skip
        print(f"accumulated vs large-batch gradient, largest difference: {grad_diff:.2e}",
              flush=True)  # fmt: skip
        flat = torch.cat([q.detach().flatten() for q in model.parameters()])
        result = {"world_size": world, "steps": args.steps, "accum": k,
                  "allreduces_per_micro_step": per_micro, "grad_max_diff": grad_diff,
                  "finite": bool(flat.isfinite().all()),
                  "digest": digest(flat)}  # fmt: skip
        print(f"RESULT {json.dumps(result)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DataParallel vs DistributedDataParallel: the same training, and why DDP is the one to use.

    slurmddp submit --nodes 2 --ntasks-per-node 1 examples/dp_vs_ddp.py
    srun -N2 --ntasks-per-node=1 python -m slurmddp.run examples/dp_vs_ddp.py

`torch.nn.DataParallel` (DP) is one process driving every GPU of one machine from threads. At
each forward it splits the batch, copies the whole model from GPU 0 to every other GPU, runs the
copies in threads (which take turns at Python's GIL), and gathers all outputs back on GPU 0,
where the loss is computed and the gradients are summed. So GPU 0 does more work and holds more
memory than the others, the model crosses the bus at every step, and it cannot span machines.

`DistributedDataParallel` (DDP) is one process per GPU, which is what srun, torchrun and mpirun
start anyway. The model is built once in each process; only gradients travel, all-reduced in
buckets while the backward pass is still running, so communication overlaps computation; no
rank is special; and it works across nodes. The PyTorch documentation recommends DDP even on a
single machine. Moving from DP to DDP means: start one process per GPU (`slurmddp submit`),
call `slurmddp.init()` (or `init_process_group`), give each rank its share of the data (a
DistributedSampler, see ddp_sampler_eval.py) and wrap the model in DDP instead of DP.

Both compute the same thing, which this script shows: every rank trains DDP on its share of each
global batch, and rank 0 also trains a DP copy of the same model on the whole global batch
(on CPU, DataParallel has no GPUs to spread over and simply runs the module). After every step
the parameters of both agree to float rounding (the sums are taken in another order).
Rank 0 ends with one line ``RESULT {...}`` (JSON): the largest parameter difference.
"""

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch.nn import DataParallel
from torch.nn.parallel import DistributedDataParallel

import slurmddp


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 10, generator=g)
    return x, (x[:, :5].sum(dim=1, keepdim=True) - x[:, 5:].prod(dim=1, keepdim=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    args = p.parse_args()

    env = slurmddp.init()
    rank, world = env.rank, env.world_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.to(device)
    dp_model = copy.deepcopy(model)  # the same starting point
    ddp = DistributedDataParallel(model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    dp = DataParallel(dp_model)  # every GPU this process sees; on CPU, just the module
    dp_opt = torch.optim.SGD(dp.parameters(), lr=0.05)

    worst = 0.0
    for step in range(args.steps):
        x, y = global_batch(step, args.batch_size * world)
        x, y = x.to(device), y.to(device)
        # DDP: this rank's equal share; the mean of the ranks' mean losses is the global mean.
        share = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
        ddp_loss = torch.nn.functional.mse_loss(ddp(x[share]), y[share])
        ddp_opt.zero_grad()
        ddp_loss.backward()
        ddp_opt.step()
        if rank == 0:  # DP: the whole global batch, in this one process
            dp_loss = torch.nn.functional.mse_loss(dp(x), y)
            dp_opt.zero_grad()
            dp_loss.backward()
            dp_opt.step()
            pairs = zip(model.parameters(), dp_model.parameters(), strict=True)
            worst = max(worst, *((a - b).abs().max().item() for a, b in pairs))
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step}: DDP loss (rank 0's share) {ddp_loss.item():.5f}, "
                      f"DP loss (whole batch) {dp_loss.item():.5f}, "
                      f"parameters differ by at most {worst:.1e}", flush=True)  # fmt: skip

    if rank == 0:
        result = {"world_size": world, "steps": args.steps, "max_param_diff": worst,
                  "same": worst < 1e-5, "dp_loss": round(dp_loss.item(), 6)}  # fmt: skip
        print(f"RESULT {json.dumps(result)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

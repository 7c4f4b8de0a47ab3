"""A tour of torch.distributed's point-to-point and collective operations, and what each gives.

    slurmddp submit --nodes 2 --ntasks-per-node 2 examples/collectives_tour.py
    srun -N2 --ntasks-per-node=2 python -m slurmddp.run examples/collectives_tour.py
    srun -N2 --ntasks-per-node=2 python examples/collectives_tour.py    # slurmddp.init() resolves
    mpirun -np 4 python examples/collectives_tour.py                    # the rank under any
    torchrun --nproc-per-node=4 examples/collectives_tour.py            # launcher

Every rank starts from values made of its own rank r, runs each operation and reports what it
holds afterwards; rank 0 prints one line per operation with every rank's value, e.g. at 2 ranks:

    send/recv   ring: r sends r+1 to r+1, gets r-1's      rank 0: 2.0  rank 1: 1.0
    broadcast   rank 0's 42 to every rank                 rank 0: 42.0  rank 1: 42.0
    scatter     rank 0's [0, 10, ...]: piece r to rank r  rank 0: 0.0  rank 1: 10.0
    gather      every rank's r*r, listed on rank 0        rank 0: [0.0, 1.0]  rank 1: -
    reduce      sum of r+1, on rank 0 only                rank 0: 3.0  rank 1: -
    all_reduce  sum of r+1, on every rank                 rank 0: 3.0  rank 1: 3.0
    all_gather  every rank's 2r, listed on every rank     rank 0: [0.0, 2.0]  rank 1: [0.0, 2.0]

Rank 0 ends with one line ``RESULT {...}`` (JSON): each operation's value on every rank.
"""

import json

import torch
import torch.distributed as dist

import slurmddp


def main() -> None:
    env = slurmddp.init()  # gloo on CPU; nccl (CUDA tensors) on GPUs
    rank, world = env.rank, env.world_size
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, list] = {}

    def report(name: str, what: str, value) -> None:
        """Collect every rank's `value` on rank 0 (a collective itself) and print them."""
        if isinstance(value, torch.Tensor):
            value = value.tolist() if value.numel() > 1 else value.item()
        elif isinstance(value, list):
            value = [t.item() for t in value]
        values = [None] * world
        dist.all_gather_object(values, value)
        if rank == 0:
            results[name] = values
            shown = "  ".join(f"rank {r}: {'-' if v is None else v}" for r, v in enumerate(values))
            print(f"{name:<11} {what:<41} {shown}", flush=True)

    def mine(value: float) -> torch.Tensor:
        return torch.tensor([value], device=device)

    # Point to point: a ring. isend/irecv do not block, so no rank waits for a partner that is
    # itself waiting to send (blocking send and recv would need an even/odd order instead).
    if world > 1:
        received = mine(-1.0)
        requests = [dist.isend(mine(rank + 1.0), dst=(rank + 1) % world),
                    dist.irecv(received, src=(rank - 1) % world)]  # fmt: skip
        for request in requests:
            request.wait()
        report("send/recv", "ring: r sends r+1 to r+1, gets r-1's", received)

    t = mine(42.0 if rank == 0 else 0.0)
    dist.broadcast(t, src=0)
    report("broadcast", "rank 0's 42 to every rank", t)

    t = mine(-1.0)
    pieces = [mine(10.0 * r) for r in range(world)] if rank == 0 else None
    dist.scatter(t, scatter_list=pieces, src=0)  # only the source gives a list
    report("scatter", "rank 0's [0, 10, ...]: piece r to rank r", t)

    gathered = [mine(0.0) for _ in range(world)] if rank == 0 else None
    dist.gather(mine(float(rank * rank)), gather_list=gathered, dst=0)
    report("gather", "every rank's r*r, listed on rank 0", gathered)

    t = mine(rank + 1.0)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # other ranks' tensors are left unspecified
    report("reduce", "sum of r+1, on rank 0 only", t if rank == 0 else None)

    t = mine(rank + 1.0)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    report("all_reduce", "sum of r+1, on every rank", t)

    everyone = [mine(0.0) for _ in range(world)]
    dist.all_gather(everyone, mine(2.0 * rank))
    report("all_gather", "every rank's 2r, listed on every rank", everyone)

    if rank == 0:
        print(f"RESULT {json.dumps({'world_size': world, **results})}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""``slurmddp doctor``: show what this rank resolved, and (``--check``) prove the group works."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

from slurmddp.errors import fail
from slurmddp.launch import network
from slurmddp.rank.bootstrap import bootstrap
from slurmddp.rank.env import DistEnv, EnvError

PROG = "slurmddp doctor"
SHM = "/dev/shm"
# NCCL's transport between the GPUs of a node keeps its buffers there, and fails ("unhandled
# system error", "Error while creating shared memory segment") when it cannot grow them; so do
# DataLoader workers passing batches ("bus error"). Docker's default is 64 MiB; NVIDIA's
# containers ask for 1 GiB or more.
SHM_ENOUGH = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check",
        action="store_true",
        help="initialise the process group and run all_reduce, broadcast, all_gather and a "
        "send/recv ring across all ranks; exit 1 if any fails",
    )
    p.add_argument("--backend", default="auto", help="auto, nccl, gloo or mpi (default: auto)")
    p.add_argument(
        "--timeout", type=float, default=120.0, metavar="S", help="seconds (default: 120)"
    )
    p.add_argument("--master-host-format", metavar="FMT", help="see python -m slurmddp.run -h")
    p.add_argument("--json", action="store_true",
                   help="this rank's values and their sources as one JSON object (no --check)")


def main(opts: argparse.Namespace) -> int:
    try:
        dist = bootstrap(master_host_format=opts.master_host_format)
    except EnvError as e:
        fail(f"cannot resolve this rank: {e}", prog=PROG)
    problem = shm_problem(SHM, _space(SHM))
    if problem is not None:
        print(f"{PROG}: warning: {problem}", file=sys.stderr, flush=True)
    if opts.json and opts.check:
        fail("--json shows this rank's values; run --check without it", prog=PROG)
    host = socket.gethostname()
    net = network.report(os.environ, host, dist.master_addr)
    if opts.json:
        print(json.dumps(as_json(dist, host, problem) | {"network": net}), flush=True)
        return 0
    if not opts.check:
        print(format_env(dist, host), format_network(net), sep="\n", flush=True)
        for line in net["concerns"]:  # type: ignore[attr-defined]
            print(f"{PROG}: note: rank {dist.rank} on {host}: {line}", file=sys.stderr,
                  flush=True)  # fmt: skip
        return 0
    return run_checks(dist, opts.backend, opts.timeout)


def _space(path: str) -> tuple[int, int] | None:
    """(size, available) of the file system at `path` in bytes; None if there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def shm_problem(path: str, space: tuple[int, int] | None) -> str | None:
    """What is wrong with the shared memory at `path` for NCCL and DataLoader workers, given its
    (size, available) bytes or None when it is missing; None when it is enough."""
    advice = ("NCCL between the GPUs of a node and DataLoader workers need 1 GiB or more: in a "
              "container, give it a larger one (docker run --shm-size=8g; Apptainer and pyxis "
              "use the node's)")  # fmt: skip
    if space is None:
        return f"{path} does not exist; {advice}"
    size, free = space
    if free >= SHM_ENOUGH:
        return None
    mib = 1 << 20
    return f"{path} has {free // mib} MiB free of {size // mib} MiB; {advice}"


def format_env(dist: DistEnv, host: str) -> str:
    """The resolved values with their sources, as a small table."""
    lines = [f"rank {dist.rank}/{dist.world_size} on {host} (launcher {dist.launcher})"]
    lines += [f"  {name:<17}{value:<22}{source}" for name, value, source in dist.rows()]
    return "\n".join(lines)


def format_network(net: dict[str, object]) -> str:
    """`network.report`'s picks and the route to MASTER_ADDR, as rows under `format_env`'s."""
    master = net["master"]
    lines = [f"  {'route to master':<17}{master['through'] or '-':<22}"  # type: ignore[index]
             f"MASTER_ADDR {master['name']} ({master['address'] or 'no address'})"]  # type: ignore[index]
    for pick in net["picks"]:  # type: ignore[attr-defined]
        where = f"{pick['interface']} {pick['address']}" if pick["interface"] else "-"
        lines.append(f"  {pick['library'] + ' interface':<17}{where:<22}{pick['source']}")
    return "\n".join(lines)


def as_json(dist: DistEnv, host: str, shm: str | None) -> dict[str, object]:
    """What `format_env` shows, as one object: a line of JSON per rank under srun."""
    return {"rank": dist.rank, "world_size": dist.world_size, "host": host,
            "launcher": str(dist.launcher), "shm_problem": shm,
            "values": [{"name": name, "value": value, "source": source}
                       for name, value, source in dist.rows()]}  # fmt: skip


def run_checks(dist: DistEnv, backend: str, timeout: float) -> int:
    """Run every collective check on every rank; rank 0 prints one table. 0 when all pass."""
    import torch
    import torch.distributed as td

    from slurmddp.launch.process_group import device, init
    from slurmddp.rank.placement import PlacementError

    t0 = time.perf_counter()
    try:
        init(backend, timeout=timeout)
    except PlacementError as e:
        fail(str(e), prog=PROG)
    init_s = time.perf_counter() - t0
    dev = torch.device(device())
    rank, world = dist.rank, dist.world_size

    results: list[tuple[str, bool, float]] = [("init_process_group", True, init_s)]
    for name, check in _checks(torch, td, dev, rank, world):
        t = time.perf_counter()
        try:
            ok = bool(check())
        except Exception as e:  # a failed collective is a result to report, not a crash
            print(f"rank {rank}: {name} raised {type(e).__name__}: {e}", file=sys.stderr)
            ok = False
        results.append((name, ok, time.perf_counter() - t))

    # Every rank's verdicts and timings travel to every rank in one all_gather.
    mine = torch.tensor([[float(ok), secs] for _, ok, secs in results], device=dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    td.all_gather(gathered, mine)
    table = torch.stack(gathered).cpu()  # ranks x checks x (ok, seconds)
    all_ok = bool(table[:, :, 0].min() == 1.0)
    if rank == 0:
        print(
            f"slurmddp doctor --check: {world} ranks, {dist.num_nodes} nodes, "
            f"backend {td.get_backend()}, launcher {dist.launcher}"
        )
        print(f"  {'check':<20}{'result':<8}{'max s':>9}{'median s':>10}  failing ranks")
        for i, (name, _, _) in enumerate(results):
            oks, secs = table[:, i, 0], table[:, i, 1]
            bad = [r for r in range(world) if oks[r] != 1.0]
            verdict = "pass" if not bad else "FAIL"
            print(
                f"  {name:<20}{verdict:<8}{secs.max():>9.4f}{secs.median():>10.4f}  "
                f"{','.join(map(str, bad)) or '-'}"
            )
        print("all checks passed" if all_ok else "some checks FAILED", flush=True)
    td.barrier()
    td.destroy_process_group()
    return 0 if all_ok else 1


def _checks(torch, td, dev, rank: int, world: int) -> Sequence[tuple[str, Callable[[], bool]]]:
    def all_reduce() -> bool:
        t = torch.tensor([float(rank + 1)], device=dev)
        td.all_reduce(t)
        return t.item() == world * (world + 1) / 2

    def broadcast() -> bool:
        t = torch.arange(4, dtype=torch.float32, device=dev) * (7 if rank == 0 else 0)
        td.broadcast(t, src=0)
        return bool(torch.equal(t.cpu(), torch.arange(4, dtype=torch.float32) * 7))

    def all_gather() -> bool:
        out = [torch.zeros(1, device=dev) for _ in range(world)]
        td.all_gather(out, torch.tensor([float(rank)], device=dev))
        return [int(x.item()) for x in out] == list(range(world))

    def ring() -> bool:
        if world == 1:
            return True
        send = torch.tensor([float(rank)], device=dev)
        recv = torch.zeros(1, device=dev)
        ops = [
            td.P2POp(td.isend, send, (rank + 1) % world),
            td.P2POp(td.irecv, recv, (rank - 1) % world),
        ]
        for req in td.batch_isend_irecv(ops):
            req.wait()
        return recv.item() == (rank - 1) % world

    return [("all_reduce", all_reduce), ("broadcast", broadcast),
            ("all_gather", all_gather), ("send_recv_ring", ring)]  # fmt: skip

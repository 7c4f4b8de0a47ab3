"""Start-up at scale: the env:// rendezvous of N ranks on one TCPStore, and per-rank pure costs.

    python -m benchmarks.rendezvous_scale [--sizes 64,256,1024,4096,16384] [--repeats 1]
                                          [--gloo-max 256] [--no-pair-ids] [--workers 2]
                                          [--json FILE]

Rank 0 (a thread of the coordinator process) does what ``init_process_group(init_method="env://")``
does there in torch 2.13: ``TCPStore(is_master=True, world_size=N)`` starts the libuv server,
adds 1 to ``init/`` and polls it every 10 ms until N ranks have. Ranks 1..N-1 are TCPStore clients
spread over a few worker processes, which connect them one after another: each connects
(``world_size=N``: the client adds 1 to ``init/``), sets its own key and checks in at
`_store_based_barrier` (add to a counter; the last rank sets ``:last_worker``); then 64 threads
per worker wait for that key and read rank 0's key (as NCCL reads its unique id) for their share
of the clients. Times run from a common start: until the last rank checked in, and until every
rank is through. "Store CPU" is the CPU time of the server's own threads (the process's time less
that of the rank-0 and main threads): what rank 0 spends per rank on its one event loop, the part
that stays serial on a real cluster, where the clients' work is spread over N processes.

For N up to ``--gloo-max`` it then runs gloo's own exchange (torch 2.13, default settings): every
rank sets a record of 154 + 8·N bytes (host, address, one pair id per peer; measured here) and
reads all N records with ``multi_get`` in batches of 128, i.e. N²·(154 + 8·N) bytes out of rank 0.

Torch's TCPStore looks up the peer's address in reverse DNS on every connection, on the client
and on the server's loop (seen with strace). This machine's resolver drops about one query in 50
and glibc then waits 5 s, so the simulation runs where it can in a private mount namespace whose
/etc/hosts answers those lookups (``unshare --mount``); the lookup through the system resolver
is measured on its own row. Without ``unshare`` the rows say "system resolver".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.table import Row, alternate, report, timed

HOST = "127.0.0.1"
DEFAULT_SIZES = (64, 256, 1024, 4096, 16384)
BASE = 64  # the size every per-rank cost is compared with
GLOO_RECORD = 154  # gloo's per-rank record without pair ids, hostname "vm" (grows with the name)
GLOO_BATCH = 128  # gloo's multi_get batch (gloo/transport/tcp/context.cc, kDefaultBatchSize)
STORE_TIMEOUT = timedelta(seconds=300)
WAITERS = 64  # threads per worker process with a pending barrier wait
NODES, TASKS_PER_NODE = 2048, 8


# ---- per-rank pure costs --------------------------------------------------------------------


def slurm_environ(nodes: int, tasks_per_node: int, rank: int) -> dict[str, str]:
    """The SLURM_* variables a task of ``srun -N nodes --ntasks-per-node tasks`` sees."""
    nodelist = f"n[0001-{nodes:04d}]" if nodes > 1 else "n0001"
    ntasks = nodes * tasks_per_node
    per_node = f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)
    job = {
        "SLURM_JOB_ID": "4242424", "SLURM_JOBID": "4242424", "SLURM_JOB_NAME": "train",
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": per_node, "SLURM_JOB_CPUS_PER_NODE": f"64(x{nodes})",
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node), "SLURM_CPUS_ON_NODE": "64",
        "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_ACCOUNT": "proj", "SLURM_JOB_QOS": "normal",
        "SLURM_CLUSTER_NAME": "big", "SLURM_SUBMIT_DIR": "/home/u/run",
        "SLURM_SUBMIT_HOST": "login1", "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURM_JOB_UID": "1000", "SLURM_JOB_USER": "u", "SLURM_JOB_GID": "1000",
        "SLURM_GPUS_PER_NODE": str(tasks_per_node), "SLURM_MEM_PER_NODE": "512000",
        "SLURM_RESTART_COUNT": "0", "SLURM_PRIO_PROCESS": "0",
    }  # fmt: skip
    step = {
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_STEP_LAUNCHER_PORT": "41234",
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % tasks_per_node),
        "SLURM_NODEID": str(rank // tasks_per_node), "SLURM_TASK_PID": "12345",
        "SLURM_NODENAME": f"n{rank // tasks_per_node + 1:04d}", "SLURM_TOPOLOGY_ADDR": "n0001",
        "SLURM_CPU_BIND": "quiet,mask_cpu:0xFF", "SLURM_DISTRIBUTION": "block",
        "SLURM_SRUN_COMM_HOST": "10.0.0.1", "SLURM_SRUN_COMM_PORT": "41235",
        "SLURM_UMASK": "0022", "SLURM_WORKING_CLUSTER": "big:ctl:6817:9984:109",
    }  # fmt: skip
    plain = {"HOME": "/home/u", "PATH": "/usr/bin:/bin", "USER": "u", "LANG": "C.UTF-8"}
    return plain | job | step


def _per_call(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    """A measurement: the mean seconds of one of `calls` back-to-back calls of `fn`."""
    return lambda: timed(lambda: [fn() for _ in range(calls)]) / calls


def pure_costs(calls: int, repeats: int) -> list[Row]:
    """`env.resolve` and `hostlist.expand` of a 2048-node job against a 1-node one."""
    from slurmddp.rank import env, hostlist

    rank = NODES * TASKS_PER_NODE - 1  # the last rank: its node's entry is the farthest
    big, one = slurm_environ(NODES, TASKS_PER_NODE, rank), slurm_environ(1, TASKS_PER_NODE, 7)
    assert env.resolve(big).world_size == NODES * TASKS_PER_NODE
    nodelist = big["SLURM_STEP_NODELIST"]
    m = alternate(
        {
            "resolve big": _per_call(lambda: env.resolve(big), calls),
            "resolve one": _per_call(lambda: env.resolve(one), calls),
            "expand big": _per_call(lambda: hostlist.expand(nodelist), calls),
            "expand one": _per_call(lambda: hostlist.expand("n0001"), calls),
        },
        repeats,
    )
    us = 1e6
    return [
        Row("scale", f"env.resolve, {NODES} nodes x {TASKS_PER_NODE} tasks (once per rank)",
            m["resolve big"] * us, m["resolve one"] * us, "us", "1 node x 8"),
        Row("scale", f"hostlist.expand('{nodelist}')", m["expand big"] * us,
            m["expand one"] * us, "us", "'n0001'"),
    ]  # fmt: skip


def reverse_lookup_seconds(lookups: int) -> float:
    """Median seconds of the reverse DNS lookup TCPStore does per connection, system resolver."""
    peer = ("::ffff:127.0.0.1", 0, 0, 0)  # what a dual-stack listener sees for 127.0.0.1
    return statistics.median(timed(lambda: socket.getnameinfo(peer, 0)) for _ in range(lookups))


# ---- the rendezvous simulation (runs in its own process) ------------------------------------


def _raise_fd_limit(needed: int) -> bool:
    """Raise the soft limit on open files to `needed` if the hard one allows; False if not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return True
    if hard != resource.RLIM_INFINITY and hard < needed:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError):
        return False
    return True


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def _wait_all(clients: list[Any]) -> None:
    for c in clients:
        c.wait(["barrier:last_worker"])
        c.get("rank/0")  # rank 0's key, as NCCL reads its unique id


class WorkerError(RuntimeError):
    """A worker of the simulation failed; the message says how."""


def _worker(conn: Any) -> None:
    """Ranks of one worker process: jobs come over `conn`, one rendezvous after another."""
    import torch.distributed as td

    while (job := conn.recv()) is not None:
        try:
            _job(td, conn, job)  # its clients are closed when it returns
        except Exception as e:
            conn.send(WorkerError(f"{type(e).__name__}: {e}"))
            return
        conn.recv()  # "close": the server outlives its clients
        conn.send(True)


def _job(td: Any, conn: Any, job: dict[str, Any]) -> None:
    """The ranks job["lo"] to job["hi"] - 1 of one rendezvous, and gloo's exchange if asked."""
    n, ranks = job["n"], range(job["lo"], job["hi"])
    _raise_fd_limit(len(ranks) + 64)
    clients, last_in = [], 0.0
    _sleep_until(job["t_go"])
    for r in ranks:
        # The client's constructor connects and, since world_size is given, adds to init/.
        c = td.TCPStore(HOST, job["port"], world_size=n, is_master=False,
                        wait_for_workers=True, timeout=STORE_TIMEOUT)  # fmt: skip
        c.set(f"rank/{r}", b"a" * GLOO_RECORD)
        if c.add("barrier", 1) == n:
            c.set("barrier:last_worker", b"1")
            last_in = time.monotonic()
        clients.append(c)
    # WAITERS threads each wait on their clients in turn: the server answers every wait,
    # WAITERS of them pending per worker. A thread per rank would measure this machine's
    # scheduler instead: 16384 threads woken at once took 11 to 236 s here.
    waiters = [threading.Thread(target=_wait_all, args=(clients[i::WAITERS],))
               for i in range(min(WAITERS, len(clients)))]  # fmt: skip
    for w in waiters:
        w.start()
    for w in waiters:
        w.join()
    conn.send((time.monotonic() if clients else 0.0, last_in))

    if job["gloo"]:
        record = b"g" * job["gloo"]
        _sleep_until(conn.recv())
        for r, c in zip(ranks, clients, strict=True):
            c.set(f"gloo/{r}", record)
        for c in clients:
            for lo in range(0, n, GLOO_BATCH):
                c.multi_get([f"gloo/{i}" for i in range(lo, min(lo + GLOO_BATCH, n))])
        conn.send(time.monotonic())


def _other_threads_cpu(start: tuple[float, dict[str, float]], times: dict[str, float]) -> float:
    """CPU seconds of the process since `start` less the named threads' own (server threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime - start[0]
    return total - sum(times[k] - start[1].get(k, 0.0) for k in times)


def gloo_record(n: int, pair_ids: bool = True) -> int:
    """Bytes of the record each rank sets for gloo's exchange among `n` ranks."""
    return GLOO_RECORD + (8 * n if pair_ids else 0)


def _rendezvous(pipes: list[Any], n: int, gloo: int) -> dict[str, float]:
    """One rendezvous of `n` ranks, then gloo's exchange of `gloo`-byte records unless 0.

    Rank 0 runs on a thread here, the other ranks in the workers behind `pipes`.
    """
    import torch.distributed as td

    with socket.socket(socket.AF_INET6) as s:  # the server listens dual-stack
        s.bind(("::", 0))
        port = s.getsockname()[1]
    bounds = [1 + (n - 1) * i // len(pipes) for i in range(len(pipes) + 1)]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    threads = {"main": time.thread_time(), "rank0": 0.0}
    start = (usage.ru_utime + usage.ru_stime, dict(threads))
    t_go = time.monotonic() + 0.5  # every worker and the server are ready by then
    box: dict[str, Any] = {}

    def rank0() -> None:
        t0 = time.thread_time()
        try:
            # Starts the server, then blocks until all n ranks have added to init/ (10 ms polls).
            store = td.TCPStore(HOST, port, world_size=n, is_master=True, wait_for_workers=True,
                                timeout=STORE_TIMEOUT)  # fmt: skip
            store.set("rank/0", b"a" * GLOO_RECORD)
            if store.add("barrier", 1) == n:
                store.set("barrier:last_worker", b"1")
                box["last_in"] = time.monotonic()
            store.wait(["barrier:last_worker"])
            store.get("rank/0")
        except BaseException as e:  # handed to the main thread
            box["error"] = e
            return
        box["done"], box["store"], box["cpu"] = time.monotonic(), store, time.thread_time() - t0

    for pipe, lo, hi in zip(pipes, bounds, bounds[1:], strict=False):
        pipe.send({"n": n, "lo": lo, "hi": hi, "port": port, "t_go": t_go, "gloo": gloo})
    thread = threading.Thread(target=rank0)
    thread.start()
    done = [_receive(pipe) for pipe in pipes]
    thread.join()
    if "error" in box:
        raise box["error"]
    threads = {"main": time.thread_time(), "rank0": box["cpu"]}
    last_in = max(box.get("last_in", 0.0), *(arrived for _, arrived in done))
    result = {
        "checked_in": last_in - t_go,
        "wall": max(box["done"], *(through for through, _ in done)) - t_go,
        "cpu": _other_threads_cpu(start, threads),
    }

    if gloo:
        store, record = box["store"], b"g" * gloo
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = (usage.ru_utime + usage.ru_stime, {"main": time.thread_time()})
        t_go = time.monotonic() + 0.2
        for pipe in pipes:
            pipe.send(t_go)
        _sleep_until(t_go)
        store.set("gloo/0", record)
        for lo in range(0, n, GLOO_BATCH):
            store.multi_get([f"gloo/{i}" for i in range(lo, min(lo + GLOO_BATCH, n))])
        mine = time.monotonic()
        done = [_receive(pipe) for pipe in pipes]
        result["gloo_wall"] = max(*done, mine) - t_go
        result["gloo_cpu"] = _other_threads_cpu(start, {"main": time.thread_time()})
        result["gloo_record"] = gloo
    for pipe in pipes:
        pipe.send("close")
    for pipe in pipes:
        _receive(pipe)
    del box["store"]  # stops the server
    return result


def _receive(pipe: Any) -> Any:
    if not pipe.poll(STORE_TIMEOUT.total_seconds()):
        raise TimeoutError("a worker of the rendezvous simulation did not answer")
    message = pipe.recv()
    if isinstance(message, WorkerError):
        raise message
    return message


def simulate(
    sizes: list[int], repeats: int, gloo_max: int, workers: int, pair_ids: bool = True
) -> dict[str, Any]:
    """Every size `repeats` times in this process and `workers` helpers: medians per size."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds store threads
    pipes, procs = [], []
    for _ in range(workers):
        here, there = ctx.Pipe()
        procs.append(ctx.Process(target=_worker, args=(there,), daemon=True))
        procs[-1].start()
        pipes.append(here)
    out: dict[str, Any] = {"sizes": {}, "skipped": {}}
    try:
        for n in sizes:
            if not _raise_fd_limit(n + 256):
                out["skipped"][n] = f"needs {n + 256} file descriptors (ulimit -n is lower)"
                continue
            gloo = gloo_record(n, pair_ids) if n <= gloo_max else 0
            runs = [_rendezvous(pipes, n, gloo) for _ in range(repeats)]
            out["sizes"][n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    finally:
        for pipe in pipes:
            pipe.send(None)
        for p in procs:
            p.join(30)
    return out


# ---- orchestration --------------------------------------------------------------------------


def private_hosts_prefix(hosts: Path) -> list[str] | None:
    """argv prefix running a command with `hosts` as its /etc/hosts, or None where impossible."""
    unshare = shutil.which("unshare")
    if unshare is None or not Path("/etc/hosts").is_file():
        return None
    extra = "\n::1 localhost\n::ffff:127.0.0.1 localhost\n"  # the peers TCPStore looks up
    hosts.write_text(Path("/etc/hosts").read_text() + extra)
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    for flags in (["--mount"], ["--user", "--map-root-user", "--mount"]):
        prefix = [unshare, *flags, "sh", "-c", script, str(hosts)]
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


def run(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 1,
    gloo_max: int = 256,
    pair_ids: bool = True,
    workers: int | None = None,
    calls: int = 200,
    lookups: int = 10,
) -> list[Row]:
    cpus = len(os.sched_getaffinity(0))
    workers = workers or min(4, max(2, cpus))
    rows = pure_costs(calls, max(repeats, 3))
    rows.append(Row("scale", "reverse DNS lookup of a store peer (system resolver)",
                    reverse_lookup_seconds(lookups) * 1e3, None, "ms"))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slurmddp-bench-") as work:
        prefix = private_hosts_prefix(Path(work) / "hosts")
        args = {"sizes": list(sizes), "repeats": repeats, "gloo_max": gloo_max,
                "workers": workers, "pair_ids": pair_ids}  # fmt: skip
        command = [sys.executable, "-m", "benchmarks.rendezvous_scale", "--simulate",
                   json.dumps(args)]  # fmt: skip
        done = subprocess.run([*(prefix or []), *command], capture_output=True,
                              text=True, timeout=3600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the rendezvous simulation failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for n, why in result["skipped"].items():
        print(f"rendezvous_scale: N={n} skipped: {why}", file=sys.stderr)
    rows += _rendezvous_rows(result["sizes"], "" if prefix else ", system resolver")
    return rows


def _rendezvous_rows(sizes: Mapping[str, Mapping[str, float]], note: str) -> list[Row]:
    us, rows = 1e6, []
    base_n = str(BASE) if str(BASE) in sizes else min(sizes, key=int)
    label = f"N={base_n}"
    for key, m in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        n = int(key)
        ref = None if key == base_n else sizes[base_n]  # the baseline's own rows have none
        rows += [
            Row("scale", f"rendezvous N={n}: all checked in{note}", m["checked_in"], None, "s"),
            Row("scale", f"rendezvous N={n}: all through the barrier", m["wall"], None, "s"),
            Row("scale", f"rendezvous N={n}: wall per rank", m["wall"] / n * us,
                ref and ref["wall"] / int(base_n) * us, "us", label),
            Row("scale", f"rendezvous N={n}: rank 0 store CPU per rank", m["cpu"] / n * us,
                ref and ref["cpu"] / int(base_n) * us, "us", label),
        ]  # fmt: skip
        if "gloo_wall" in m:
            record = int(m["gloo_record"])
            what = f"gloo exchange N={n} ({record} B records, {n * n * record / 2**20:.4g} MiB)"
            rows += [
                Row("scale", f"{what}: all through",
                    m["gloo_wall"], ref and ref.get("gloo_wall"), "s", label),
                Row("scale", f"gloo exchange N={n}: rank 0 store CPU", m["gloo_cpu"],
                    ref and ref.get("gloo_cpu"), "s", label),
            ]  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rendezvous_scale")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="rank counts, comma-separated")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gloo-max", type=int, default=256, help="largest N for gloo's exchange")
    p.add_argument(
        "--no-pair-ids",
        action="store_true",
        help="gloo records without pair ids (GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1)",
    )
    p.add_argument("--workers", type=int, help="client processes (default: 2 to 4, by CPUs)")
    p.add_argument("--json", type=Path)
    p.add_argument("--simulate", help=argparse.SUPPRESS)  # the child process's entry point
    opts = p.parse_args()
    if opts.simulate:
        print(json.dumps(simulate(**json.loads(opts.simulate))))
        return
    sizes = tuple(int(s) for s in opts.sizes.split(","))
    rows = run(sizes, opts.repeats, opts.gloo_max, not opts.no_pair_ids, opts.workers)
    report(rows, opts.json)


if __name__ == "__main__":
    main()

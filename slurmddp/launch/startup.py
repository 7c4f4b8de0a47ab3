"""Start-up of the process group: a bounded rendezvous that says who is missing.

torch's ``env://`` rendezvous waits as long as the collective timeout (30 minutes by default) for
a rank that never arrives, then fails with a message about store keys. Here the rendezvous is
bounded by its own start-up timeout (``$SLURMDDP_STARTUP_TIMEOUT``, default 300 s, counted from
this rank's arrival) and its failures are one clear `StartupError`:

- fewer ranks than the world size arrived in time: how many, which ones, and the timeout;
- rank 0 cannot listen on MASTER_PORT: the port is taken on its host (it fails at once, and
  ``srun --kill-on-bad-exit`` ends the other ranks);
- rank 0's rendezvous does not answer in time: where it was looked for.

`slurmddp.init` uses it as the ``slurmddp://`` rendezvous, registered through torch's public
``register_rendezvous_handler`` (`register`); it reads the variables ``env://`` reads. Under
``python -m slurmddp.run`` a script's own ``torch.distributed.init_process_group()``
(``env://``, the default) gets it too: the runner replaces torch's ``env://`` handler when torch
is imported (`install_hook`: the patch `ENV_HANDLER`, on torch's one private API used here).
Once every rank has arrived, the store takes the process group's timeout again, as torch's own
handler leaves it, and `slurmddp.rank.coordination` keeps it for what collectives should not do
(stop, long waits).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import itertools
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from slurmddp import patches
from slurmddp.errors import StartupError, UserError, warn
from slurmddp.launch import network
from slurmddp.protocol import STARTUP_TIMEOUT_VAR as TIMEOUT_VARIABLE
from slurmddp.protocol import STORE_SERVER_VAR
from slurmddp.rank import coordination
from slurmddp.watchdog import progress as watchdog

DEFAULT_TIMEOUT_S = 300.0
_RENDEZVOUS_MODULE = "torch.distributed.rendezvous"

# What `slurmddp.init` gives its one rendezvous (`limited`): (startup_timeout=..., the UUID of
# the GPU it gave this rank, the backend).
_limits: contextvars.ContextVar[tuple[float | None, str | None, str | None]] = (
    contextvars.ContextVar("slurmddp_startup_limits", default=(None, None, None)))
_generations = itertools.count(1)  # each rendezvous of this process joins under its own keys


def startup_timeout(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds a rank waits at the rendezvous for all others: $SLURMDDP_STARTUP_TIMEOUT or 300."""
    override, _, _ = _limits.get()
    if override is not None:
        return override
    text = environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UserError(f"{TIMEOUT_VARIABLE}={text!r} is not a number of seconds above 0")
    return value


@contextlib.contextmanager
def limited(seconds: float | None, gpu: str | None = None,
            backend: str | None = None) -> Iterator[None]:  # fmt: skip
    """Within the block, `startup_timeout` is `seconds` (None: as the environment says), the
    rendezvous refuses to start NCCL where another rank holds this rank's GPU (UUID `gpu`), and
    it checks the network of `backend` (None: NCCL's where there is a GPU, else gloo's)."""
    token = _limits.set((seconds, gpu, backend))
    try:
        yield
    finally:
        _limits.reset(token)


def host_name() -> str:
    """This node's name as Slurm calls it (several slurmd may share one host), else the host's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _ranks(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def join(store: Any, rank: int, world_size: int, timeout_s: float, where: str,
         gpu: str | None = None, serving: bool | None = None) -> None:  # fmt: skip
    """Wait until all `world_size` ranks have joined through `store`, or raise `StartupError`.

    One counter and one "all here" key: each rank waits on a single key whatever the world size.
    With `gpu` (a GPU's UUID, unique across nodes) every rank claims its GPU first; if two claim
    the same one, all of them raise the same `StartupError` once everyone has arrived, before
    NCCL refuses it with "Duplicate GPU detected" (or hangs). `serving`: this process serves
    the store (`serves_store`; None: rank 0 does).
    """
    serving = rank == 0 if serving is None else serving
    prefix = f"slurmddp/startup/{next(_generations)}/"
    limit = datetime.timedelta(seconds=timeout_s)
    try:
        _check_owner(store, serving, limit, where)
        store.set(f"{prefix}{rank}", host_name())  # only read to name the missing ranks
        if gpu is not None:
            _claim(store, prefix, rank, gpu)
        if store.add(f"{prefix}count", 1) == world_size:
            store.set(f"{prefix}all", "1")
        store.wait([f"{prefix}all"], limit)
        if gpu is not None and store.check([f"{prefix}shared-gpu"]):
            raise StartupError(store.get(f"{prefix}shared-gpu").decode("utf-8", "replace"))
        return
    except RuntimeError as e:  # torch's DistError (a timeout) or a lost connection
        if isinstance(e, StartupError):
            raise
        try:
            joined = store.add(f"{prefix}count", 0)
            # Only the store's server (in its own process) names the missing: N checks from every
            # rank would be N² requests to the store exactly when start-up is failing.
            missing = (
                [r for r in range(world_size) if not store.check([f"{prefix}{r}"])]
                if serving
                else None
            )
        except RuntimeError:
            raise StartupError(
                f"the rendezvous at {where} went away while rank {rank} waited for the others: "
                "the rank that served it (rank 0, or the first on that host) has failed (see its "
                "log)"
            ) from e
    who = (f"missing: rank {_ranks(missing)}" if missing is not None
           else f"the log of the rank serving {where} names them")  # fmt: skip
    raise StartupError(
        f"only {joined} of {world_size} ranks joined the rendezvous at {where} within "
        f"{timeout_s:g} s ({TIMEOUT_VARIABLE}); {who}. A rank is stuck before it starts the "
        f"process group (see its log), or its node is slow: raise {TIMEOUT_VARIABLE} if start-up "
        "takes longer"
    )


def _reach_master(addr: str, port: int, rank: int) -> None:
    """Fail at once where MASTER_ADDR has no address or no route from here, and within
    `network.SILENCE_S` where its host does not answer: not after the start-up timeout."""
    address = network.resolve(addr)
    if address is None:
        raise StartupError(f"rank {rank} ({host_name()}): MASTER_ADDR {addr} has no address "
                           "here: check the name, or --master-host-format")  # fmt: skip
    try:
        network.reach(address, port)
    except network.Unreachable as e:
        raise StartupError(
            f"rank {rank} ({host_name()}) cannot reach MASTER_ADDR {addr} ({address}): {e}. "
            "It must name the first node on a network every node reaches: see slurmddp doctor "
            "(route to master), or give --master-host-format (e.g. '{host}-ib0')") from None


def _check_network(store: Any, rank: int, world_size: int, limit: datetime.timedelta,
                   backend: str | None) -> None:  # fmt: skip
    """Before the process group connects its ranks, each rank connects to the next on another
    node where `backend`'s library will (`network.probe`); MPI is left to itself."""
    if world_size < 2 or os.environ.get("LOCAL_WORLD_SIZE") == str(world_size):
        return  # one node: nothing to cross
    import torch

    library = network.library_of(backend, torch.cuda.is_available())
    if library is None:
        return
    try:
        network.probe(store, f"slurmddp/net/{next(_generations)}/", rank, world_size,
                      host_name(), library, limit, os.environ.get("MASTER_ADDR", ""))  # fmt: skip
    except RuntimeError as e:  # torch's DistError (a timeout) or a lost connection
        if isinstance(e, StartupError):
            raise
        raise StartupError(
            f"rank {rank}: the ranks did not all check their network within "
            f"{limit.total_seconds():g} s ({TIMEOUT_VARIABLE}): a rank failed during start-up "
            "(see its log)") from e


def _claim(store: Any, prefix: str, rank: int, gpu: str) -> None:
    """Take GPU `gpu` for `rank`; where another rank holds it, leave the message for all."""
    me = f"{rank} on {socket.gethostname()}"
    holder = store.compare_set(f"{prefix}gpu/{gpu}", "", me).decode("utf-8", "replace")
    if holder != me:
        other, _, host = holder.partition(" on ")
        store.set(f"{prefix}shared-gpu", (
            f"ranks {other} and {rank} on {host} share one GPU ({gpu}) and NCCL needs a GPU per "
            "rank: give each task its own (--gpus-per-task=1, or --gpus-per-node equal to "
            "--ntasks-per-node) or use --backend gloo"))  # fmt: skip


def _owner() -> str:
    """Which job this rank belongs to: the same on all its ranks, "" outside Slurm and torchrun.

    The job id only: mpirun's local ranks have no step id while its remote ones do.
    """
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def _check_owner(store: Any, serving: bool, limit: datetime.timedelta, where: str) -> None:
    """The store's server marks it with its job; the others refuse the store of another job.

    Two jobs on one node whose derived ports collide: the second job's server cannot listen
    (`open_store` says so), but its other ranks would reach the first job's store and join it.
    """
    key = "slurmddp/owner"
    if serving:
        store.set(key, _owner())
        return
    store.wait([key], limit)
    owner = store.get(key).decode("utf-8", "replace")
    if owner != _owner():
        raise StartupError(
            f"the rendezvous at {where} belongs to another job ({owner or 'outside Slurm'}): "
            "this job's MASTER_PORT is taken there; give it a free port below 32768 "
            "(slurmddp submit --env MASTER_PORT=N)"
        )


def open_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float,
               use_libuv: bool, serving: bool | None = None) -> Any:  # fmt: skip
    """torch's TCPStore as its ``env://`` handler opens it, errors explained. `serving`: this
    process serves it (None: rank 0 does, as in torch's handler).

    The server does not wait for the others here (`join` does, naming who is missing).
    """
    from torch.distributed import TCPStore

    serving = rank == 0 if serving is None else serving
    try:
        return TCPStore(addr, port, world_size, serving, datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False, multi_tenant=True,
                        use_libuv=use_libuv)  # fmt: skip
    except RuntimeError as e:
        text = str(e)
        if serving and ("EADDRINUSE" in text or "address already in use" in text.lower()):
            raise StartupError(
                f"rank {rank} cannot open the rendezvous: port {port} (MASTER_PORT) on "
                f"{host_name()} is already in use by another process. Give the job a free port "
                "below 32768 (slurmddp submit --env MASTER_PORT=N), or see what holds it: "
                f"ss -ltnp 'sport = :{port}'"
            ) from e
        if not serving and "timed out" in text:
            raise StartupError(
                f"rank {rank} found no rendezvous at {addr}:{port} within {timeout_s:g} s "
                f"({TIMEOUT_VARIABLE}): the rank that serves it (rank 0, or the first on {addr}) "
                f"is stuck before it starts the process group (see its log), or {addr} cannot be "
                f"reached from {host_name()}"
            ) from e
        raise


def _bounded(url: str, timeout: datetime.timedelta | None, kwargs: dict[str, Any],
             torch_env: Callable[[str, datetime.timedelta], tuple[Any, int, int]],
             ) -> Iterator[tuple[Any, int, int]]:  # fmt: skip
    """The bounded ``env://`` rendezvous of `url`: what `register` and `patch` install.

    `torch_env(url, timeout)` is torch's own, for what this one leaves to it.
    """
    from torch.distributed.constants import default_pg_timeout

    timeout = default_pg_timeout if timeout is None else timeout
    limit = min(startup_timeout(), timeout.total_seconds())
    query = dict(parse_qsl(urlparse(url).query))
    try:
        rank = int(query.get("rank") or os.environ["RANK"])
        world_size = int(query.get("world_size") or os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        rank = world_size = -1
    if rank < 0 or world_size < 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch's own: its errors for a missing variable; torchrun's agent hosting the store.
        store, rank, world_size = torch_env(url, timeout)
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        serving = rank == 0  # of the ranks, the one that marks and watches the store
    else:
        libuv = query.get("use_libuv", os.environ.get("USE_LIBUV", "1")) == "1"
        served = os.environ.get(STORE_SERVER_VAR)
        serving = rank == 0 if served not in ("0", "1") else served == "1"
        if not serving:
            _reach_master(addr, port, rank)
        store = open_store(addr, port, rank, world_size, limit, libuv, serving)
        where = f"{addr}:{port}"
    _, gpu, backend = _limits.get()
    join(store, rank, world_size, limit, where, gpu=gpu, serving=serving)
    _check_network(store, rank, world_size, datetime.timedelta(seconds=limit), backend)
    store.set_timeout(timeout)
    coordination.record(store, rank, world_size)
    watchdog.arm(rank, world_size)
    yield store, rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


# --- slurmddp.init: a scheme of our own, through torch's public registry ---------------------

SCHEME = "slurmddp"


@functools.cache
def register() -> str:
    """Register the bounded rendezvous as ``slurmddp://`` (once); the init_method to give.

    It reads what ``env://`` reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the URL's query).
    """
    from torch.distributed.rendezvous import register_rendezvous_handler

    with contextlib.suppress(RuntimeError):  # registered by an earlier copy of this module
        register_rendezvous_handler(SCHEME, _scheme_handler)
    return f"{SCHEME}://"


def _scheme_handler(url: str, timeout: datetime.timedelta | None = None,
                    **kwargs: Any) -> Iterator[tuple[Any, int, int]]:  # fmt: skip
    return _bounded(url, timeout, kwargs, lambda u, t: _torch_env(u, t, kwargs))


def _torch_env(url: str, timeout: datetime.timedelta,
               kwargs: dict[str, Any]) -> tuple[Any, int, int]:  # fmt: skip
    """torch's own ``env://`` rendezvous for a ``slurmddp://`` `url`."""
    parts = urlparse(url)
    if ENV_HANDLER.target in patches.applied():  # env:// is ours: not through it a second time
        return next(patches.original(ENV_HANDLER)(urlunparse(parts._replace(scheme="env")),
                                                  timeout=timeout, **kwargs))  # fmt: skip
    from torch.distributed.rendezvous import rendezvous

    # torch's public entry puts rank and world size into the query itself.
    query = dict(parse_qsl(parts.query))
    rank, world_size = int(query.pop("rank", -1)), int(query.pop("world_size", -1))
    env_url = urlunparse(parts._replace(scheme="env", query=urlencode(query)))
    return next(rendezvous(env_url, rank, world_size, timeout=timeout, **kwargs))


# --- the runner: a script's own init_process_group() ------------------------------------------
#
# A script's plain ``init_process_group()`` asks for env://, and torch has no public way to
# replace a registered handler (register_rendezvous_handler refuses a scheme twice). So the patch
# swaps the entry in torch's private ``_rendezvous_handlers`` dict, pinned by
# tests/test_dependencies.py. Where a torch lacks it, the script keeps torch's own env://
# (unbounded, torch's messages) and a warning says so; `slurmddp.init` is unaffected (`register`).

_PRIVATE_HANDLERS = "_rendezvous_handlers"


def _wrap(original: Any) -> Any:
    def env_handler(url: str, timeout: datetime.timedelta | None = None,
                    **kwargs: Any) -> Iterator[tuple[Any, int, int]]:  # fmt: skip
        return _bounded(url, timeout, kwargs,
                        lambda u, t: next(original(u, timeout=t, **kwargs)))  # fmt: skip

    return env_handler


ENV_HANDLER = patches.Patch(
    f"{_RENDEZVOUS_MODULE}:{_PRIVATE_HANDLERS}[env]",
    why="a script's own init_process_group() (env://) gets the bounded rendezvous that names "
    "the missing ranks, as slurmddp.init()'s does",
    by="python -m slurmddp.run, as the script imports torch",
    make=_wrap,
)


def patch(_module: object = None) -> bool:
    """Replace torch's ``env://`` rendezvous handler with the bounded one (idempotent).

    False, with a warning, where this torch keeps its handlers elsewhere (the script's env://
    stays torch's own).
    """
    if patches.apply(ENV_HANDLER):
        return True
    warn(f"this torch has no {_RENDEZVOUS_MODULE}.{_PRIVATE_HANDLERS}['env']: a script's own "
         "init_process_group() waits as torch's env:// does, not as "
         f"{TIMEOUT_VARIABLE} says (slurmddp.init() is bounded)")  # fmt: skip
    return False


def install_hook() -> None:
    """Bound the rendezvous of any ``env://`` process group this process starts (the runner's).

    torch is not imported here: the rendezvous module is patched when the script imports torch.
    """
    patches.when_imported(_RENDEZVOUS_MODULE, patch)

"""Which network interface gloo and NCCL would use on this node, and whether it is the one that
reaches the job's rendezvous.

A node often has several interfaces: a management Ethernet that does not route between nodes,
a data network (Ethernet, IPoIB) that does. gloo and NCCL each pick one by rules of their own,
and a wrong pick shows up only as the first collective hanging until its timeout:

- gloo: the first interface of ``GLOO_SOCKET_IFNAME``; else the address this host's name
  resolves to (``hostname`` in ``/etc/hosts`` or DNS);
- NCCL: ``NCCL_SOCKET_IFNAME`` (prefixes; ``^`` excludes, ``=`` matches a whole name); else an
  ``ib*`` interface, else the first that is neither ``lo`` nor ``docker*``.

`picks` says what each would take and why (pure: the interfaces and addresses are given);
`route` asks the kernel which interface it sends to MASTER_ADDR through, the one every rank
reaches the rendezvous on; `concern` turns a pick that differs from it into one line naming the
variable to set. ``slurmddp doctor`` shows all three for each rank. Without the other ranks'
picks this is a hint, not a proof: a pick off that route may still reach every node.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slurmddp.errors import StartupError

GLOO_VAR = "GLOO_SOCKET_IFNAME"
NCCL_VAR = "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


@dataclasses.dataclass(frozen=True)
class Interface:
    """A network interface of this node with an IPv4 address."""

    name: str
    address: str


@dataclasses.dataclass(frozen=True)
class Pick:
    """The interface a library would use (None: none matches), its address, and why."""

    library: str
    variable: str  # the variable that decides it
    interface: str | None
    address: str | None
    source: str


def interfaces() -> list[Interface]:
    """This node's interfaces with an IPv4 address, in the kernel's order (lo first)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            found.append(Interface(name, socket.inet_ntoa(packed[20:24])))
    return found


def resolve(host: str) -> str | None:
    """`host`'s IPv4 address, as gloo and torch's store look it up; None if it has none."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def route(address: str) -> str | None:
    """The source address the kernel would send to `address` from (no packet is sent); None
    when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError:
            return None
        return str(s.getsockname()[0])


def _holder(found: Sequence[Interface], address: str | None) -> str | None:
    """The interface with `address`; the loopback one for any 127.x (Debian's 127.0.1.1)."""
    if address and address.startswith("127."):
        return next((i.name for i in found if i.address.startswith("127.")), None)
    return next((i.name for i in found if i.address == address), None)


def _nccl_matches(spec: str, name: str) -> bool:
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    prefixes = [p for p in spec.lstrip("^").lstrip("=").split(",") if p]
    hit = any(name == p if exact else name.startswith(p) for p in prefixes)
    return hit != exclude


def picks(environ: Mapping[str, str], found: Sequence[Interface],
          host_address: str | None) -> list[Pick]:  # fmt: skip
    """What gloo and NCCL would use, given this node's interfaces and the address its host name
    resolves to."""
    by_name = {i.name: i.address for i in found}
    gloo_spec = environ.get(GLOO_VAR, "").strip()
    if gloo_spec:
        named = gloo_spec.split(",")[0]
        gloo = Pick("gloo", GLOO_VAR, named if named in by_name else None, by_name.get(named),
                    f"{GLOO_VAR}={gloo_spec}")  # fmt: skip
    else:
        gloo = Pick("gloo", GLOO_VAR, _holder(found, host_address), host_address,
                    "the address of this host's name")  # fmt: skip
    nccl_spec = environ.get(NCCL_VAR, "").strip()
    if nccl_spec:
        chosen = [i for i in found if _nccl_matches(nccl_spec, i.name)]
        source = f"{NCCL_VAR}={nccl_spec}"
    else:
        chosen = [i for i in found if i.name.startswith("ib")] or [
            i for i in found if i.name != "lo" and not i.name.startswith("docker")]
        source = "NCCL's default: ib*, else the first but lo and docker*"
    first = chosen[0] if chosen else None
    nccl = Pick("NCCL", NCCL_VAR, first.name if first else None, first.address if first else None,
                source)  # fmt: skip
    return [gloo, nccl]


def concern(pick: Pick, master: str, towards: Interface | None) -> str | None:
    """One line when `pick` is not the interface `towards` MASTER_ADDR (`master`) is reached
    through; None when it is, when no route to it is known, when that is this node's loopback
    (one node: nothing crosses a network), or when the pick is IPoIB (``ib*``), which spans the
    fabric by design: NCCL prefers it for that."""
    if (towards is None or towards.address.startswith("127.") or pick.interface == towards.name
            or (pick.interface or "").startswith("ib")):  # fmt: skip
        return None
    what = f"{pick.interface} ({pick.address}" if pick.interface else "no interface (none matches"
    return (f"{pick.library} would use {what}; {pick.source}), but MASTER_ADDR {master} is "
            f"reached through {towards.name} ({towards.address}): if its collectives hang, set "
            f"{pick.variable}={towards.name} (submit --env, or a profile's env)")


def report(environ: Mapping[str, str], host: str, master: str | None) -> dict[str, object]:
    """This rank's interfaces, each library's pick and the route to `master`, with the concerns;
    for ``slurmddp doctor``."""
    found = interfaces()
    chosen = picks(environ, found, resolve(host))
    towards = _route_interface(found, master) if master else None
    concerns = [c for p in chosen if (c := concern(p, master or "", towards))]
    return {"interfaces": [dataclasses.asdict(i) for i in found],
            "picks": [dataclasses.asdict(p) for p in chosen],
            "master": {"name": master, "address": resolve(master) if master else None,
                       "through": towards and towards.name},
            "concerns": concerns}  # fmt: skip


# --- before the process group: can the ranks reach each other where the library will look? ----

# A host that is up answers a connection at once, accepting or refusing it; one that stays silent
# this long is down or cut off, and waiting longer only delays the same failure.
SILENCE_S = 10.0
PROBE_TIMEOUT_S = 5.0
_NO_ROUTE = {errno.ENETUNREACH: "no route to it", errno.EHOSTUNREACH: "its host is unreachable"}


class Unreachable(Exception):
    """An address this rank cannot reach: why, in words."""


def reach(address: str, port: int, silence_s: float = SILENCE_S,
          clock: Callable[[], float] = time.monotonic,
          dial: Callable[[str, int, float], None] | None = None,
          listening: bool = False) -> None:  # fmt: skip
    """Return once `address` answers on `port` (accepting, or refusing: nothing listens yet);
    raise `Unreachable` at once where there is no route, or once it stayed silent `silence_s`.
    `listening`: something is known to listen there, so a refusal is another host's."""
    dial = dial or _dial
    start = clock()
    while True:
        try:
            dial(address, port, min(PROBE_TIMEOUT_S, silence_s))
            return
        except ConnectionRefusedError:
            if listening:
                raise Unreachable("refused: the address is another host's here") from None
            return  # its host answered
        except TimeoutError:
            if clock() - start >= silence_s:
                raise Unreachable(f"it did not answer within {silence_s:g} s (its host is down, "
                                  "or cut off from this one)") from None  # fmt: skip
        except OSError as e:
            raise Unreachable(_NO_ROUTE.get(e.errno or 0, os.strerror(e.errno or 0)
                                            if e.errno else str(e))) from None  # fmt: skip


def _dial(address: str, port: int, timeout: float) -> None:
    with socket.create_connection((address, port), timeout=timeout):
        pass


def library_of(backend: str | None, cuda: bool) -> str | None:
    """Whose interface the process group will use: "gloo", "NCCL", or None (MPI: its own)."""
    backend = (backend or ("nccl" if cuda else "gloo")).lower()
    return {"gloo": "gloo", "nccl": "NCCL"}.get(backend)


def probe(store: Any, prefix: str, rank: int, world_size: int, node: str, library: str,
          limit: datetime.timedelta, master: str) -> None:  # fmt: skip
    """Every rank listens where `library` will, says where through `store`, and connects to the
    next rank when that one is on another node; all of them then raise the same `StartupError`
    if any could not. One connection a node boundary, one key a rank."""
    found = interfaces()
    pick = next(p for p in picks(os.environ, found, resolve(node_host())) if p.library == library)
    mine = _listen(pick)
    line: str | None = None
    try:
        if isinstance(mine, str):
            line = f"rank {rank} ({node}): {library} {mine}"
            store.set(f"{prefix}net/{rank}", json.dumps([node, None, None, 0]))
        else:
            store.set(f"{prefix}net/{rank}", json.dumps([node, pick.interface, pick.address,
                                                         mine.getsockname()[1]]))  # fmt: skip
            line = _probe_next(store, prefix, rank, world_size, node, pick, limit)
        if line is not None:
            towards = _route_interface(found, master)
            store.set(f"{prefix}net-failed", (
                f"{line}; set {pick.variable} to an interface every node reaches the others on"
                + (f" (MASTER_ADDR {master} is reached through {towards.name} here)"
                   if towards else "")))  # fmt: skip
        if store.add(f"{prefix}net-count", 1) == world_size:
            store.set(f"{prefix}net-all", "1")
        store.wait([f"{prefix}net-all"], limit)
        if store.check([f"{prefix}net-failed"]):
            raise StartupError(store.get(f"{prefix}net-failed").decode("utf-8", "replace"))
    finally:
        if not isinstance(mine, str):
            mine.close()


def node_host() -> str:
    """This host's own name, as gloo resolves it (not Slurm's node name)."""
    return socket.gethostname()


def _listen(pick: Pick) -> socket.socket | str:
    """A socket listening on `pick`'s address, or why there is none."""
    if pick.interface is None or pick.address is None:
        return f"would use no interface: {pick.source} names none of this node's"
    s = socket.socket()
    try:
        s.bind((pick.address, 0))
        s.listen()
    except OSError as e:
        s.close()
        return (f"cannot listen on {pick.address} ({pick.interface}; {pick.source}): "
                f"{e.strerror or e}")  # fmt: skip
    return s


def _probe_next(store: Any, prefix: str, rank: int, world_size: int, node: str, pick: Pick,
                limit: datetime.timedelta) -> str | None:  # fmt: skip
    """Connect to the next rank where it listens, if it is on another node (and listens: one that
    cannot says so itself); why it cannot be reached, or None."""
    peer = (rank + 1) % world_size
    store.wait([f"{prefix}net/{peer}"], limit)
    peer_node, interface, address, port = json.loads(store.get(f"{prefix}net/{peer}"))
    if peer_node == node or address is None:
        return None
    try:
        # A loopback address is dialled too: ranks of one machine under several node names (a
        # test, a rehearsal) reach each other there; on another node it refuses.
        reach(address, port, listening=True)
    except Unreachable as e:
        why = ("a loopback address: no other node reaches it" if address.startswith("127.")
               else str(e))  # fmt: skip
        return (f"rank {rank} ({node}) cannot reach rank {peer} ({peer_node}) at {address}, its "
                f"{interface}, where {pick.library} will connect to it ({pick.source}): {why}")
    return None


def _route_interface(found: Sequence[Interface], master: str) -> Interface | None:
    """The interface of `found` the kernel sends to `master` through; None without a route."""
    address = resolve(master)
    source = route(address) if address else None
    return next((i for i in found if i.address == source), None)

"""slurmddp.launch.network: which interface gloo and NCCL take, and the line when it is not the
one that reaches MASTER_ADDR (on the cluster, where it matters: test_run_cluster's doctor test)."""

from __future__ import annotations

import datetime
import errno
import os
import re
import socket
import threading
from unittest import mock

import pytest

from slurmddp.errors import StartupError
from slurmddp.launch import network
from slurmddp.launch.network import Interface, Pick, Unreachable, concern, picks, probe, reach

LO = Interface("lo", "127.0.0.1")
MGMT = Interface("eth0", "10.78.1.1")  # first, reaches no other node
DATA = Interface("eth1", "10.77.0.1")
IB = Interface("ib0", "10.79.0.1")
DOCKER = Interface("docker0", "172.17.0.1")


@pytest.mark.parametrize(
    ("environ", "found", "host_address", "gloo", "nccl"),
    [
        ({}, [LO, MGMT, DATA], DATA.address, "eth1", "eth0"),  # NCCL's default: the first
        ({}, [LO, MGMT, DATA, IB], DATA.address, "eth1", "ib0"),  # ib* before any other
        ({}, [LO, DOCKER, DATA], DATA.address, "eth1", "eth1"),  # docker* passed over
        ({}, [LO, MGMT], "127.0.1.1", "lo", "eth0"),  # Debian's "127.0.1.1 hostname"
        ({}, [LO], None, None, None),  # a host name that resolves nowhere, no network
        ({"NCCL_SOCKET_IFNAME": "eth1"}, [LO, MGMT, DATA], DATA.address, "eth1", "eth1"),
        ({"NCCL_SOCKET_IFNAME": "^eth0,lo"}, [LO, MGMT, DATA], DATA.address, "eth1", "eth1"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, [LO, MGMT, DATA], DATA.address, "eth1", None),
        ({"NCCL_SOCKET_IFNAME": "eth"}, [LO, MGMT, DATA], DATA.address, "eth1", "eth0"),
        ({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, [LO, MGMT, DATA], DATA.address, "eth0", "eth0"),
        ({"GLOO_SOCKET_IFNAME": "ib9"}, [LO, MGMT, DATA], DATA.address, None, "eth0"),
    ],
)  # fmt: skip
def test_each_library_takes_the_interface_its_own_rules_give(environ, found, host_address, gloo,
                                                              nccl):  # fmt: skip
    got = picks(environ, found, host_address)
    assert [(p.library, p.interface) for p in got] == [("gloo", gloo), ("NCCL", nccl)]
    by_name = {i.name: i.address for i in found}
    assert all(p.address == by_name.get(p.interface) for p in got if p.interface != "lo")


def test_a_pick_the_variable_made_says_so_and_the_default_says_whose_rule():
    gloo, nccl = picks({"GLOO_SOCKET_IFNAME": "eth0"}, [LO, MGMT, DATA], DATA.address)
    assert gloo.source == "GLOO_SOCKET_IFNAME=eth0"
    assert nccl.source == "NCCL's default: ib*, else the first but lo and docker*"
    assert picks({}, [LO, DATA], DATA.address)[0].source == "the address of this host's name"


NCCL_ON_MGMT = Pick("NCCL", "NCCL_SOCKET_IFNAME", "eth0", MGMT.address, "NCCL's default: ib*, "
                    "else the first but lo and docker*")  # fmt: skip


def test_a_pick_off_the_route_to_master_is_one_line_naming_the_variable_to_set():
    assert concern(NCCL_ON_MGMT, "n1", DATA) == (
        "NCCL would use eth0 (10.78.1.1; NCCL's default: ib*, else the first but lo and docker*), "
        "but MASTER_ADDR n1 is reached through eth1 (10.77.0.1): if its collectives hang, set "
        "NCCL_SOCKET_IFNAME=eth1 (submit --env, or a profile's env)")
    none = Pick("gloo", "GLOO_SOCKET_IFNAME", None, None, "GLOO_SOCKET_IFNAME=ib9")
    assert concern(none, "n1", DATA).startswith(  # type: ignore[union-attr]
        "gloo would use no interface (none matches; GLOO_SOCKET_IFNAME=ib9), but ")


@pytest.mark.parametrize("towards", [MGMT, None, LO])
def test_no_line_on_the_route_without_a_route_or_on_one_node(towards):
    # The pick is the route's interface; no route known; MASTER_ADDR on this node's loopback.
    assert concern(NCCL_ON_MGMT, "n1", towards) is None


def test_no_line_for_ipoib_off_the_route_nccl_prefers_it_as_it_spans_the_fabric():
    nccl_on_ib = Pick("NCCL", "NCCL_SOCKET_IFNAME", "ib0", IB.address, "NCCL's default")
    assert concern(nccl_on_ib, "gpu001", Interface("eth0", "10.1.0.11")) is None


def test_this_machine_has_a_loopback_and_routes_to_it_from_itself():
    assert Interface("lo", "127.0.0.1") in network.interfaces()
    assert network.route("127.0.0.1") == "127.0.0.1"


# ---- reach: an answer, a refusal, no route, silence -------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def dialing(*outcomes, clock: Clock | None = None):
    """A dial that meets `outcomes` in turn (an exception to raise, or None: connected), each
    taking its timeout on `clock` when it is a timeout."""
    left = list(outcomes)

    def dial(address, port, timeout):
        outcome = left.pop(0)
        if outcome is None:
            return
        if isinstance(outcome, TimeoutError) and clock is not None:
            clock.now += timeout
        raise outcome

    return dial


@pytest.mark.parametrize("outcome", [None, ConnectionRefusedError()])
def test_a_host_that_accepts_or_refuses_is_reached(outcome):
    reach("10.0.0.1", 1, dial=dialing(outcome))


@pytest.mark.parametrize(("code", "says"), [(errno.ENETUNREACH, "no route to it"),
                                            (errno.EHOSTUNREACH, "its host is unreachable")])
def test_no_route_fails_at_once(code, says):
    with pytest.raises(Unreachable, match=f"^{says}$"):
        reach("10.0.0.1", 1, dial=dialing(OSError(code, os.strerror(code))))


def test_silence_fails_after_the_silence_bound_not_before():
    clock = Clock()
    with pytest.raises(Unreachable, match=r"^it did not answer within 10 s \(its host is down"):
        reach("10.0.0.1", 1, silence_s=10, clock=clock,
              dial=dialing(*[TimeoutError()] * 3, clock=clock))  # fmt: skip
    assert clock.now == 10
    clock = Clock()  # silent, then up: reached
    reach("10.0.0.1", 1, silence_s=10, clock=clock,
          dial=dialing(TimeoutError(), ConnectionRefusedError(), clock=clock))  # fmt: skip


def test_a_refusal_where_a_listener_is_known_is_another_hosts_answer():
    with pytest.raises(Unreachable, match=r"^refused: the address is another host's here$"):
        reach("10.0.0.1", 1, dial=dialing(ConnectionRefusedError()), listening=True)


def test_a_real_port_nobody_serves_on_this_machine_is_reached_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        reach("127.0.0.1", port)


@pytest.mark.parametrize(("backend", "cuda", "library"), [
    ("gloo", True, "gloo"), ("nccl", False, "NCCL"), ("mpi", True, None), (None, True, "NCCL"),
    (None, False, "gloo"), ("GLOO", False, "gloo")])  # fmt: skip
def test_the_library_checked_is_the_backends(backend, cuda, library):
    assert network.library_of(backend, cuda) == library


# ---- probe: every rank listens where its library will; the next on another node connects ---


class Store:
    """The TCPStore calls probe makes, in one process (threads for ranks)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key, value):
        with self.changed:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.changed.notify_all()

    def get(self, key):
        return self.values[key]

    def add(self, key, n):
        with self.changed:
            self.values[key] = str(int(self.values.get(key, b"0")) + n).encode()
            self.changed.notify_all()
            return int(self.values[key])

    def check(self, keys):
        return all(k in self.values for k in keys)

    def wait(self, keys, timeout):
        with self.changed:
            if not self.changed.wait_for(lambda: self.check(keys), timeout.total_seconds()):
                raise RuntimeError(f"timed out waiting for {keys}")


def probed(nodes: list[str], environ: dict[str, str]) -> list[BaseException | None]:
    """probe() on one rank a node (threads), under `environ`; what each raised."""
    store, raised = Store(), [None] * len(nodes)

    def rank(r: int) -> None:
        try:
            probe(store, "t/", r, len(nodes), nodes[r], "gloo", datetime.timedelta(seconds=30),
                  "n1")  # fmt: skip
        except BaseException as e:  # the test reports it
            raised[r] = e

    with mock.patch.dict(os.environ, environ):
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(nodes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    return raised


def outside() -> str:
    """An interface of this machine that is not loopback: three "nodes" of it reach each other
    there as nodes would."""
    name = next((i.name for i in network.interfaces() if i.name != "lo"), None)
    if name is None:
        pytest.skip("this machine has no interface but loopback")
    return name


def test_ranks_that_reach_each_other_pass():
    assert probed(["n1", "n2", "n3"], {"GLOO_SOCKET_IFNAME": outside()}) == [None] * 3


def test_a_rank_that_cannot_be_reached_fails_every_rank_with_the_same_line():
    def no_route(address, port, listening):
        raise Unreachable("no route to it")

    name = outside()
    with mock.patch("slurmddp.launch.network.reach", no_route):
        raised = probed(["n1", "n2"], {"GLOO_SOCKET_IFNAME": name})
    assert all(isinstance(e, StartupError) for e in raised), raised
    assert len({str(e) for e in raised}) == 1
    # Either rank's line: both found it, the last to say it is heard.
    assert re.match(rf"rank ([01]) \(n[12]\) cannot reach rank [01] \(n[12]\) at [0-9.]+, its "
                    rf"{name}, where gloo will connect to it \(GLOO_SOCKET_IFNAME={name}\): no "
                    "route to it; set GLOO_SOCKET_IFNAME to an interface every node reaches the "
                    "others on", str(raised[0])), raised[0]  # fmt: skip


def test_a_loopback_pick_passes_on_one_machine_and_fails_where_it_is_another():
    # Two node names of this one machine reach each other on its loopback...
    assert probed(["n1", "n2"], {"GLOO_SOCKET_IFNAME": "lo"}) == [None, None]

    # ...while on two machines, each reaches its own loopback, where nothing listens.
    def own_loopback(address, port, listening):
        raise Unreachable("refused: the address is another host's here")

    with mock.patch("slurmddp.launch.network.reach", own_loopback):
        raised = probed(["n1", "n2"], {"GLOO_SOCKET_IFNAME": "lo"})
    assert re.match(r"rank [01] \(n[12]\) cannot reach rank [01] \(n[12]\) at 127\.0\.0\.1, its "
                    r"lo, where gloo will connect to it \(GLOO_SOCKET_IFNAME=lo\): a loopback "
                    "address: no other node reaches it; set GLOO_SOCKET_IFNAME to an interface",
                    str(raised[0])), raised  # fmt: skip


def test_ranks_of_one_node_connect_to_nobody():
    with mock.patch("slurmddp.launch.network.reach", side_effect=AssertionError("dialled")):
        assert probed(["n1", "n1"], {"GLOO_SOCKET_IFNAME": "lo"}) == [None, None]


def test_an_interface_no_node_has_is_named_by_the_rank_that_lacks_it():
    raised = probed(["n1", "n2"], {"GLOO_SOCKET_IFNAME": "nope0"})
    assert all(isinstance(e, StartupError) for e in raised), raised
    assert str(raised[0]).startswith("rank ") and (
        ": gloo would use no interface: GLOO_SOCKET_IFNAME=nope0 names none of this node's; "
        "set GLOO_SOCKET_IFNAME to an interface") in str(raised[0]), raised[0]  # fmt: skip

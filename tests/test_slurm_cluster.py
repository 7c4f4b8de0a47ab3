"""The local cluster itself (scripts/slurm-cluster): what its nodes are, seen from their tasks."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import EVERY_SLURM

pytestmark = [pytest.mark.cluster, EVERY_SLURM]

# Run by one task on each node: its names and addresses, and what it can reach. A connection to a
# port nobody serves is refused by a host that can be reached, and fails at once (no route) where
# the network does not go: no listener, no wait.
PROBE = r"""
import errno, fcntl, json, os, socket, struct

def address(interface):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = struct.pack("256s", interface.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR

def dial(addr):
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect((addr, 9))
        except ConnectionRefusedError:
            return "refused"
        except OSError as e:
            return errno.errorcode.get(e.errno, str(e))
        return "connected"

interfaces = [name for _, name in socket.if_nameindex() if name != "lo"]
others = [n for n in ("n1", "n2", "n3", "n4") if n != os.environ["SLURMD_NODENAME"]]
print(json.dumps({
    "node": os.environ["SLURMD_NODENAME"], "hostname": socket.gethostname(),
    "resolved": socket.gethostbyname(socket.gethostname()), "interfaces": interfaces,
    "addresses": {name: address(name) for name in interfaces},
    "data": {n: dial(socket.gethostbyname(n)) for n in others},
    "management": {n: dial(socket.gethostbyname(n + "-mgmt")) for n in others},
}))
"""


def test_each_node_is_a_host_with_its_own_address_and_a_network_that_only_one_interface_routes(
        slurm_cluster):  # fmt: skip
    """Issue 48's bar: seen from a task on each node, the nodes' names and addresses differ and
    none is loopback. Each node's first interface (eth0, a management network) does not reach
    the other nodes; the second (eth1, whose address the node's name resolves to) reaches them."""
    r = slurm_cluster.srun(["-N4", "--ntasks-per-node=1"], [sys.executable, "-c", PROBE])
    assert r.returncode == 0, r.stderr
    seen = {s["node"]: s for s in map(json.loads, r.stdout.splitlines())}
    assert sorted(seen) == ["n1", "n2", "n3", "n4"], r.stdout
    for node, s in seen.items():
        assert s["hostname"] == node and s["interfaces"] == ["eth0", "eth1"], s
        assert s["resolved"] == s["addresses"]["eth1"] == slurm_cluster.address(node), s
        assert s["addresses"]["eth0"] == slurm_cluster.address(f"{node}-mgmt"), s
        assert set(s["data"].values()) == {"refused"}, s  # reached: the host answered
        assert set(s["management"].values()) == {"ENETUNREACH"}, s
    assert len({s["resolved"] for s in seen.values()}) == 4
    assert not any(s["resolved"].startswith("127.") for s in seen.values())

"""slurmddp.agent: the rendezvous port it derives, and the stop signal it relays to workers."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any
from unittest import mock

import pytest

from slurmddp.launch import agent, network
from slurmddp.launch.agent import with_rdzv_conf, with_rdzv_port
from slurmddp.rank.env import derive_port
from tests.conftest import launcher_free_env

JOB = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rdzv-endpoint=n1", "-m", "x"], [f"--rdzv-endpoint=n1:{derive_port(4242)}", "-m", "x"]),
        (["--rdzv_endpoint", "n1", "t.py"], ["--rdzv_endpoint", f"n1:{derive_port(4242)}", "t.py"]),
        (["--rdzv-endpoint=n1:29500", "t.py"], ["--rdzv-endpoint=n1:29500", "t.py"]),
        (["--rdzv-endpoint=[fe80::1]", "t.py"], [f"--rdzv-endpoint=[fe80::1]:{derive_port(4242)}",
                                                  "t.py"]),
        (["t.py", "--", "--rdzv-endpoint=n1"], ["t.py", "--", "--rdzv-endpoint=n1"]),
    ],
    ids=["equals", "separate", "port-given", "ipv6", "script-argument"],
)  # fmt: skip
def test_a_rendezvous_endpoint_without_a_port_gets_the_jobs_own(argv, expected):
    assert with_rdzv_port(argv, JOB) == expected


def test_two_jobs_sharing_a_node_rendezvous_on_different_ports():
    first = with_rdzv_port(["--rdzv-endpoint=n1"], JOB)
    second = with_rdzv_port(["--rdzv-endpoint=n1"], JOB | {"SLURM_JOB_ID": "4243"})
    assert first != second


def test_the_rendezvous_port_comes_from_the_centres_range():
    env = JOB | {"SLURMDDP_PORT_RANGE": "5000-5999"}
    port = derive_port(4242, 0, range(5000, 6000))
    assert with_rdzv_port(["--rdzv-endpoint=n1"], env) == [f"--rdzv-endpoint=n1:{port}"]
    assert 5000 <= port < 6000


def test_outside_a_slurm_job_the_endpoint_is_left_to_torchrun():
    assert with_rdzv_port(["--rdzv-endpoint=n1"], {}) == ["--rdzv-endpoint=n1"]


BASE = "join_timeout=300,last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=3"


@pytest.mark.parametrize(("argv", "node", "conf"), [
    (["--rdzv-backend=c10d", "--rdzv-endpoint=n1:29400", "t.py"], "n1", f"{BASE},is_host=true"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "t.py"], "n2",
     f"{BASE},is_host=false"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=n1:29400", "t.py"], None, BASE),
    (["--rdzv-backend=etcd-v2", "--rdzv-endpoint=etcd:2379", "t.py"], "n1", BASE),
    (["--nnodes=2:3", "t.py"], "n1", BASE),
])  # fmt: skip
def test_the_rdzv_conf_bounds_the_join_and_names_the_store_host(argv, node, conf):
    environ = {"SLURMD_NODENAME": node} if node else {}
    assert with_rdzv_conf(argv, environ, 300.0) == [f"--rdzv-conf={conf}", *argv]


@pytest.mark.parametrize(("nodeid", "host"), [("0", "true"), ("1", "false")])
def test_of_nodes_that_share_a_name_the_first_hosts_the_store(nodeid, host):
    # --local: every emulated node is localhost, the rendezvous endpoint too.
    argv = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29400", "t.py"]
    environ = {"SLURMD_NODENAME": "localhost", "SLURM_STEP_NODELIST": "localhost,localhost",
               "SLURM_NODEID": nodeid}  # fmt: skip
    assert with_rdzv_conf(argv, environ, 300.0)[0] == f"--rdzv-conf={BASE},is_host={host}"


@pytest.mark.parametrize("argv", [
    ["--rdzv-conf=join_timeout=9", "t.py"],
    ["--rdzv_conf", "read_timeout=5", "t.py"],
    ["--nnodes", "2", "--rdzv-conf", "x=1", "t.py"],
])  # fmt: skip
def test_a_rdzv_conf_given_is_left_as_it_is(argv):
    assert with_rdzv_conf(argv, {"SLURMD_NODENAME": "n1"}, 300.0) == argv


def _state(participants: int, *, complete: bool = True, closed: bool = False) -> Any:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    state = _RendezvousState()
    state.participants = {_NodeDesc(f"n{i}", 1, 1): i for i in range(participants)}
    state.complete, state.closed = complete, closed
    return state


@pytest.mark.parametrize(("state", "size", "lost"), [
    (_state(2), 3, True),  # a node's beats stopped: torch dropped it
    (_state(3), 3, False),
    (_state(2), 2, False),  # the round completed with two
    (_state(2, closed=True), 3, False),  # the work is done: the agents leave
    (_state(2, complete=False), 3, False),  # a new round forms
    (_state(1), 0, False),  # no round joined yet
])  # fmt: skip
def test_a_round_that_lost_a_node_counts_as_a_change_of_membership(state, size, lost):
    assert agent.lost_a_node(state, size) is lost


@pytest.mark.parametrize(("state", "max_nodes", "is_full"), [
    (_state(2), 2, True),  # a spare left waiting: no room before a loss
    (_state(1), 2, False),  # room: a waiting node joins the next round
    (_state(2, complete=False), 2, False),  # the round still forms
    (_state(2), 3, False),  # an elastic range with room to grow
])  # fmt: skip
def test_a_node_waiting_for_a_full_round_is_no_reason_to_restart(state, max_nodes, is_full):
    assert agent.full(state, max_nodes) is is_full


def test_empty_log_directories_are_removed_and_logs_kept(tmp_path):
    (tmp_path / "run_1" / "attempt_0" / "0").mkdir(parents=True)
    (tmp_path / "run_1" / "attempt_0" / "1").mkdir()
    (tmp_path / "run_1" / "attempt_0" / "1" / "stderr.log").write_text("kept")
    empty = tmp_path / "empty"
    (empty / "run_2" / "attempt_0" / "0").mkdir(parents=True)
    agent.remove_empty_dirs(str(tmp_path))
    agent.remove_empty_dirs(str(empty))
    assert not empty.exists()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "run_1", "run_1/attempt_0", "run_1/attempt_0/1", "run_1/attempt_0/1/stderr.log"]


@pytest.mark.parametrize(("options", "left"), [
    pytest.param((), [], marks=pytest.mark.floor),
    (("--redirects", "2"), ["stderr.log", "stderr.log"]),  # the workers' output: the user's
    (("--log-dir", "{mine}", "--redirects", "2"), []),  # their own directory: left as it is
], ids=["plain", "redirects", "log-dir"])  # fmt: skip
@pytest.mark.ranks
def test_the_agent_leaves_in_tmp_only_what_the_user_asked_torchrun_to_keep(tmp_path, options, left):
    # torchrun makes /tmp/torchelastic_* per agent and run and never removes it.
    tmp, mine = tmp_path / "tmp", tmp_path / "mine"
    tmp.mkdir()
    script = tmp_path / "worker.py"
    script.write_text("import os, sys; print('rank', os.environ['RANK'], file=sys.stderr)\n")
    options = tuple(o.format(mine=mine) for o in options)
    r = subprocess.run([sys.executable, "-m", "slurmddp.agent", "--standalone", "--nnodes", "1",
                        "--nproc-per-node", "2", *options, str(script)],
                       env=launcher_free_env(TMPDIR=str(tmp)), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp.rglob("*") if p.is_file()) == left
    assert all(p.name.startswith("torchelastic_") for p in tmp.iterdir())
    assert bool(left) == any(tmp.iterdir())
    if "--log-dir" in options:
        assert len(list(mine.rglob("stderr.log"))) == 2


# ---- an endpoint the agent cannot reach: one line at once, not the join timeout -------------


def _rdzv(endpoint: str, backend: str = "c10d") -> list[str]:
    return [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", "train.py"]


@pytest.mark.parametrize(("args", "node"), [
    (_rdzv("n1:29400"), "n1"),  # this agent hosts the store
    (_rdzv("n1:29400", backend="static"), "n2"),  # not c10d's store
    (_rdzv("n1"), "n2"),  # no port (one is derived inside a job)
    (_rdzv("n1:29400"), None),  # outside a Slurm step
])  # fmt: skip
def test_an_agent_that_hosts_no_c10d_store_elsewhere_checks_nothing(args, node):
    environ = {"SLURMD_NODENAME": node} if node else {}
    with mock.patch("slurmddp.launch.network.reach", side_effect=AssertionError("dialled")):
        agent.reach_rendezvous(args, environ)


def test_an_endpoint_without_a_route_ends_the_agent_in_one_line():
    def no_route(address, port):
        raise network.Unreachable("no route to it")

    with mock.patch("slurmddp.launch.network.reach", no_route), \
            mock.patch("slurmddp.launch.network.resolve", {"n1-mgmt": "10.78.1.1"}.get), \
            pytest.raises(SystemExit) as ended:  # fmt: skip
        agent.reach_rendezvous(_rdzv("n1-mgmt:29400"), {"SLURMD_NODENAME": "n2"})
    assert str(ended.value) == (
        "slurmddp: agent (host n2): cannot reach torchrun's rendezvous at n1-mgmt:29400 "
        "(10.78.1.1): no route to it; give --rdzv-endpoint a name of the first node on a "
        "network every node reaches")
    with mock.patch("slurmddp.launch.network.resolve", return_value=None), \
            pytest.raises(SystemExit, match="at nowhere:29400: it has no address here; give"):
        agent.reach_rendezvous(_rdzv("nowhere:29400"), {"SLURMD_NODENAME": "n2"})


def test_a_failed_rendezvous_asks_whether_the_batch_host_is_lost_then_fails_as_torchrun(
        tmp_path):  # fmt: skip
    # A process of its own: the agent's main routes signals and patches torch's agent.
    events = tmp_path / "events.jsonl"
    code = """if True:
        import sys
        import torch.distributed.run
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
        from slurmddp.launch import agent, stranded

        def torchrun(args):
            raise RendezvousConnectionError("the store at n1:29400 is gone")

        def lost(environ, say):
            say("the batch host n1 is lost (DOWN): requeued", True)

        torch.distributed.run.main = torchrun
        stranded.after_lost_rendezvous = lost
        stranded.start = lambda environ, endpoint, say: print("watching", endpoint)
        agent.reach_rendezvous = lambda args, environ: None
        try:
            agent.main(["--rdzv-backend=c10d", "--rdzv-endpoint", "n1:29400", "train.py"])
        except RendezvousConnectionError as e:
            print("raised:", e)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=launcher_free_env(SLURMDDP_EVENTS_FILE=str(events),
                                             SLURMD_NODENAME="n2"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    # The watcher of a silent rendezvous started first (slurmddp.launch.stranded).
    assert r.stdout == "watching n1:29400\nraised: the store at n1:29400 is gone\n"
    assert "slurmddp: agent (host n2): the batch host n1 is lost (DOWN): requeued\n" in r.stderr
    (told,) = [json.loads(line) for line in events.read_text().splitlines()]
    assert {k: told[k] for k in ("kind", "host", "requeued", "line")} == {
        "kind": "agent", "host": "n2", "requeued": True,
        "line": "agent (host n2): the batch host n1 is lost (DOWN): requeued"}

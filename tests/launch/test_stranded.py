"""An elastic job whose batch host is lost: requeued by an agent that survived it."""

from __future__ import annotations

import socket

from slurmddp.launch import stranded

ENV = {"SLURM_JOB_ID": "68", "SLURM_NODEID": "1"}
RUNNING = {"JobState": "RUNNING", "BatchHost": "n1"}


class Slurm:
    """Stand-ins of the agent's Slurm calls, counting them."""

    def __init__(self, job, states, refuse=None):
        self.job, self.states, self.refuse = job, states, refuse
        self.calls: list[str] = []

    def show_job(self, job_id):
        self.calls.append(f"show job {job_id}")
        return self.job

    def show_nodes(self, node):
        self.calls.append(f"show node {node}")
        return {node: self.states.pop(0)} if self.states else {}

    def requeue(self, target):
        self.calls.append(f"requeue {target}")
        return self.refuse


def watch(slurm, answers, environ=ENV, rounds=5):
    said = iter(answers)
    return stranded.watch(environ, "n1", 5536, answering=lambda h, p: next(said, False),
                          show_job=slurm.show_job, show_nodes=slurm.show_nodes,
                          requeuing=slurm.requeue, sleep=lambda s: None, rounds=rounds)  # fmt: skip


def test_a_batch_host_lost_with_the_job_kept_running_gets_it_requeued():
    slurm = Slurm(RUNNING, ["ALLOCATED", "DOWN+NOT_RESPONDING"])
    line = watch(slurm, [False, False])
    assert line == ("the batch host n1 is lost (DOWN+NOT_RESPONDING), and with it torchrun's "
                    "rendezvous; Slurm keeps the job without its batch script (--no-kill): "
                    "requeued, to resume from its checkpoint on other nodes")
    assert slurm.calls == ["show job 68", "show node n1", "show job 68", "show node n1",
                           "requeue 68"]  # fmt: skip
    # An array task is requeued by its own id; a refused requeue says why.
    slurm = Slurm(RUNNING, ["DOWN"], refuse="Requested operation is presently disabled")
    line = watch(slurm, [False], ENV | {"SLURM_ARRAY_JOB_ID": "60", "SLURM_ARRAY_TASK_ID": "3"})
    assert line.endswith("(--no-kill): scontrol requeue 60_3 failed: Requested operation is "
                         "presently disabled")  # fmt: skip


def test_while_the_rendezvous_answers_slurm_is_never_asked():
    slurm = Slurm(RUNNING, ["DOWN"])
    assert watch(slurm, [True] * 5) is None and slurm.calls == []


def test_a_job_slurm_ended_or_requeued_itself_is_left_to_slurm():
    for state in ("PENDING", "COMPLETING", "CANCELLED"):
        slurm = Slurm(RUNNING | {"JobState": state}, ["DOWN"])
        assert watch(slurm, [False]) is None and "requeue 68" not in slurm.calls
    # Slurm does not answer (this node may be the one cut off): nothing done, asked again later.
    slurm = Slurm({}, [])
    assert watch(slurm, [False] * 3, rounds=3) is None
    assert slurm.calls == ["show job 68"] * 3


def test_only_the_second_and_third_nodes_agents_watch_a_c10d_rendezvous(monkeypatch, capsys,
                                                                       tmp_path):  # fmt: skip
    monkeypatch.setattr(stranded, "watch", lambda environ, host, port: f"{host} {port}: lost")
    events = tmp_path / "events.jsonl"
    started = stranded.start(ENV | {"SLURMDDP_EVENTS_FILE": str(events)}, "n1:5536", "c10d", "n2")
    assert started is not None and started.daemon
    started.join(5)
    assert capsys.readouterr().err == "slurmddp: agent (host n2): n1 5536: lost\n"
    assert '"line":"agent (host n2): n1 5536: lost"' in events.read_text()
    for environ, endpoint, backend in ((ENV | {"SLURM_NODEID": "0"}, "n1:5536", "c10d"),
                                       (ENV | {"SLURM_NODEID": "3"}, "n1:5536", "c10d"),
                                       (ENV, "etcd:2379", "etcd-v2"), (ENV, "n1", "c10d"),
                                       ({"SLURM_NODEID": "1"}, "n1:5536", "c10d")):  # fmt: skip
        assert stranded.start(environ, endpoint, backend, "n2") is None


def test_only_a_store_that_accepts_is_there():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not stranded.accepting("127.0.0.1", port)  # bound, not listening: refused
        s.listen()
        assert stranded.accepting("127.0.0.1", port)
    assert not stranded.accepting("no-such-host.invalid", 5536)


def test_an_agent_whose_torchrun_failed_stays_twice_slurmd_timeout_for_its_watcher():
    class Thread:
        def join(self, timeout):
            self.timeout = timeout

    for config, waited in (("SlurmdTimeout           = 60 sec\n", 120),
                           ("SlurmdTimeout           = 0 sec\n", 600), ("", 600)):  # fmt: skip
        watcher = Thread()
        stranded.linger(watcher, lambda c=config: c)
        assert watcher.timeout == waited

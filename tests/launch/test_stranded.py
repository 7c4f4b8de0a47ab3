"""An elastic job whose batch host is lost: requeued by an agent that survived it."""

from __future__ import annotations

import socket
import threading

import pytest

from slurmddp.launch import network, stranded

ENV = {"SLURM_JOB_ID": "68", "SLURM_NODEID": "1"}
RUNNING = {"JobState": "RUNNING", "BatchHost": "n1", "Restarts": "0"}
CONFIG = "SlurmdPort              = 6818\nSlurmdTimeout           = 60 sec\n"


def shown(state: str, port: str = " Port=12901") -> str:
    return (f"NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.77.0.1 NodeHostName=n1{port} "
            f"Version=24.11.5 State={state} ThreadsPerCore=1\n")


class Fake(stranded.Slurm):
    """Stand-ins of the agent's Slurm calls and dials, counting them; each list is what the
    next calls return (its last item from then on)."""

    def __init__(self, jobs, states, answers, refuse=None):
        self.jobs, self.states, self.answers, self.refuse = jobs, states, answers, refuse
        self.calls: list[str] = []
        self.now = 0.0
        super().__init__(show_job=self._job, show_node=self._node, show_config=lambda: CONFIG,
                         answering=self._dial, requeue=self._requeue, sleep=self._sleep,
                         clock=lambda: self.now)  # fmt: skip

    @staticmethod
    def _next(items):
        return items.pop(0) if len(items) > 1 else items[0]

    def _job(self, job_id):
        self.calls.append(f"show job {job_id}")
        return self._next(self.jobs)

    def _node(self, node):
        self.calls.append(f"show node {node}")
        return shown(self._next(self.states))

    def _dial(self, address, port):
        self.calls.append(f"dial {address}:{port}")
        return self._next(self.answers)

    def _requeue(self, target):
        self.calls.append(f"requeue {target}")
        return self.refuse

    def _sleep(self, seconds):
        self.now += seconds


LOST_LINE = ("the batch host n1 is lost (DOWN+NOT_RESPONDING), and with it torchrun's rendezvous; "
             "Slurm keeps the job without its batch script (--no-kill): requeued, to resume from "
             "its checkpoint on other nodes")  # fmt: skip


def lines(fake: Fake, environ=ENV, done: bool | None = None) -> list[tuple[str, bool]]:
    """What the agent says, after the Slurm calls of `fake`; `done`: what it returns (whether
    there is nothing more to watch)."""
    said: list[tuple[str, bool]] = []
    over = stranded.after_lost_rendezvous(
        environ, lambda line, requeued: said.append((line, requeued)), fake)
    assert done is None or over is done
    return said


def test_a_silent_batch_host_gets_the_job_requeued_once_slurm_marks_it_lost():
    fake = Fake([RUNNING], ["ALLOCATED", "ALLOCATED+NOT_RESPONDING"], [False])
    assert lines(fake, done=True) == [(LOST_LINE.replace("DOWN+", "ALLOCATED+"), True)]
    assert fake.calls == ["show job 68", "show node n1", "dial 10.77.0.1:12901",
                          "show job 68", "show node n1", "requeue 68"]  # fmt: skip
    assert fake.now == stranded.PERIOD_S
    # Slurm has already marked it: requeued at once, the host not dialled.
    fake = Fake([RUNNING], ["DOWN+NOT_RESPONDING"], [True])
    assert lines(fake) == [(LOST_LINE, True)]
    assert fake.calls == ["show job 68", "show node n1", "requeue 68"] and fake.now == 0
    # The third node's agent acts a period later, where the second's did not.
    fake = Fake([RUNNING], ["DOWN+NOT_RESPONDING"], [False])
    assert lines(fake, {**ENV, "SLURM_NODEID": "2"}) == [(LOST_LINE, True)]
    assert fake.calls[-3:] == ["show job 68", "show node n1", "requeue 68"]
    assert fake.now == stranded.PERIOD_S
    fake = Fake([RUNNING, {**RUNNING, "JobState": "PENDING", "Restarts": "1"}], ["DOWN"], [False])
    assert lines(fake, {**ENV, "SLURM_NODEID": "2"}) == [] and "requeue 68" not in fake.calls
    # An array task is requeued by its own id.
    fake = Fake([RUNNING], ["DOWN"], [False])
    assert lines(fake, ENV | {"SLURM_ARRAY_JOB_ID": "60", "SLURM_ARRAY_TASK_ID": "3"})
    assert fake.calls[-1] == "requeue 60_3"


def test_a_batch_host_whose_slurmd_answers_is_left_to_its_batch_script_at_once():
    # The common case: the rendezvous closed at the job's end, or its agent there failed.
    fake = Fake([RUNNING], ["MIXED"], [True])
    assert lines(fake, done=False) == []  # (a watcher goes on watching)
    assert fake.calls == ["show job 68", "show node n1", "dial 10.77.0.1:12901"]
    assert fake.now == 0
    # Its slurmd answers again while the agent waits (a link back, a restarted slurmd).
    fake = Fake([RUNNING], ["MIXED"], [False, False, True])
    assert lines(fake, done=False) == []
    assert "requeue 68" not in fake.calls and fake.now == 2 * stranded.PERIOD_S


def test_a_job_slurm_ended_or_requeued_itself_is_left_to_slurm():
    for job in ({**RUNNING, "JobState": "COMPLETING"}, {**RUNNING, "JobState": "PENDING"}):
        fake = Fake([job], ["DOWN"], [False])
        assert lines(fake, done=True) == [] and fake.calls == ["show job 68"]
    # Slurm does not answer (this node may be the one cut off): nothing done, watched on.
    fake = Fake([{}], ["DOWN"], [False])
    assert lines(fake, done=False) == [] and fake.calls == ["show job 68"]
    # Meanwhile: requeued (Restarts counts it, the job may run again already), or cancelled.
    for later in ({**RUNNING, "Restarts": "1"}, {**RUNNING, "JobState": "CANCELLED"}):
        fake = Fake([RUNNING, later], ["ALLOCATED"], [False])
        assert lines(fake) == [] and "requeue 68" not in fake.calls


def test_a_refused_requeue_is_said_unless_the_other_agent_requeued_it_first():
    fake = Fake([RUNNING, {**RUNNING, "JobState": "PENDING", "Restarts": "1"}],
                ["DOWN+NOT_RESPONDING"], [False], refuse="Job is pending execution")  # fmt: skip
    assert lines(fake) == [(LOST_LINE, True)]
    fake = Fake([RUNNING], ["DOWN+NOT_RESPONDING"], [False],
                refuse="Requested operation is presently disabled")  # fmt: skip
    assert lines(fake) == [(LOST_LINE, True), (
        "scontrol requeue 68 failed: Requested operation is presently disabled; the job is left "
        "to Slurm", False)]  # fmt: skip


def test_a_host_slurm_never_marks_is_given_up_after_twice_slurmd_timeout():
    fake = Fake([RUNNING], ["ALLOCATED"], [False])
    assert lines(fake, done=True) == [("the batch host n1 does not answer, but Slurm still has it "
                            "(ALLOCATED) after twice its SlurmdTimeout: the job is left to Slurm",
                            False)]  # fmt: skip
    assert "requeue 68" not in fake.calls and fake.now == 2 * 60 + stranded.PERIOD_S


def test_only_the_second_and_third_nodes_agents_act_and_only_in_a_slurm_job():
    for environ in ({**ENV, "SLURM_NODEID": "0"}, {**ENV, "SLURM_NODEID": "3"},
                    {"SLURM_NODEID": "1"}, {**ENV, "SLURM_JOB_ID": "68; rm"}):  # fmt: skip
        fake = Fake([RUNNING], ["DOWN"], [False])
        assert lines(fake, environ, done=True) == [] and fake.calls == []
    # Slurm does not show the host (this node may be the one cut off): nothing done, watched on.
    fake = Fake([RUNNING], ["DOWN"], [False])
    fake.show_node = lambda node: ""
    assert lines(fake, done=False) == [] and "requeue 68" not in fake.calls


def test_the_slurmd_of_a_node_is_where_slurm_says():
    assert stranded.host("n1", shown("IDLE"), CONFIG) == stranded.Host("n1", "IDLE", "10.77.0.1",
                                                                        12901)  # fmt: skip
    # No Port= of its own: the config's SlurmdPort, else Slurm's default; no NodeAddr: its name.
    assert stranded.host("n1", shown("IDLE", port=""), "SlurmdPort = 7000\n").port == 7000
    assert stranded.host("n1", shown("IDLE", port=""), "").port == 6818
    assert stranded.host("n1", "NodeName=n1 State=DOWN\n", "").address == "n1"
    assert stranded.host("n1", "NodeName=n10 State=IDLE\n", "") is None
    assert stranded.slurmd_timeout_s(CONFIG) == 60 and stranded.slurmd_timeout_s("") == 300
    assert stranded.host("n1", shown("DOWN+NOT_RESPONDING"), "").lost
    assert not stranded.host("n1", shown("MIXED"), "").lost


def test_only_a_listener_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not stranded.answering("127.0.0.1", port)  # bound, not listening: refused
        s.listen()
        assert stranded.answering("127.0.0.1", port)
    assert not stranded.answering("no-such-host.invalid", 6818)


def dials(*outcomes: str):
    """A stand-in of `network.reach`: each call's outcome in turn ("answers" or "silent"), the
    last one from then on; the calls counted."""
    made: list[tuple[str, int, float]] = []

    def reach(address: str, port: int, silence_s: float) -> None:
        made.append((address, port, silence_s))
        if outcomes[min(len(made), len(outcomes)) - 1] == "silent":
            raise network.Unreachable("it did not answer")

    return reach, made


def watched(fake: Fake, reach, rounds: int) -> list[tuple[str, bool]]:
    said: list[tuple[str, bool]] = []
    stranded.watch(ENV, "10.77.0.1", 29400, lambda line, requeued: said.append((line, requeued)),
                   fake, reach, rounds=rounds)  # fmt: skip
    return said


def test_the_watcher_asks_slurm_only_of_a_silent_rendezvous():
    # Answering (accepting, or refusing: its host is there, and torch's own failure follows): a
    # dial a period, no Slurm call.
    fake = Fake([RUNNING], ["DOWN+NOT_RESPONDING"], [False])
    reach, made = dials("answers")
    assert watched(fake, reach, rounds=3) == [] and fake.calls == []
    assert made == [("10.77.0.1", 29400, stranded.DIAL_TIMEOUT_S)] * 3
    assert fake.now == 3 * stranded.PERIOD_S
    # Silent at the second dial: Slurm asked, the host lost, the job requeued; watching ends.
    fake = Fake([RUNNING], ["DOWN+NOT_RESPONDING"], [False])
    reach, made = dials("answers", "silent")
    assert watched(fake, reach, rounds=5) == [(LOST_LINE, True)] and len(made) == 2
    assert fake.calls == ["show job 68", "show node n1", "requeue 68"]


def test_a_silent_rendezvous_whose_host_or_slurm_answers_is_watched_on():
    # The host's slurmd answers (the store's silence passed): watched on, asked again only when
    # the store is silent again.
    fake = Fake([RUNNING], ["MIXED"], [True])
    reach, made = dials("silent", "answers", "silent")
    assert watched(fake, reach, rounds=3) == [] and len(made) == 3
    assert fake.calls == ["show job 68", "show node n1", "dial 10.77.0.1:12901"] * 2
    # Slurm does not answer (this node is the one cut off): watched on.
    fake = Fake([{}], ["DOWN"], [False])
    reach, made = dials("silent")
    assert watched(fake, reach, rounds=2) == [] and fake.calls == ["show job 68"] * 2


def test_one_agents_watcher_and_failed_rendezvous_take_turns_and_requeue_once():
    # The watcher waits for Slurm to mark the host lost while torch's rendezvous fails too: the
    # main thread's turn comes after, finds the job requeued, and leaves it.
    requeued = threading.Event()
    inside = threading.Event()
    go_on = threading.Event()

    class Shared(Fake):
        def _job(self, job_id):
            self.calls.append(f"show job {job_id}")
            return {**RUNNING, "JobState": "PENDING", "Restarts": "1"} if requeued.is_set() \
                else RUNNING

        def _requeue(self, target):
            self.calls.append(f"requeue {target}")
            requeued.set()

    watcher, main = Shared([], ["ALLOCATED", "DOWN"], [False]), Shared([], ["DOWN"], [False])

    def wait_for_slurm(seconds: float) -> None:  # the watcher's period, held open by the test
        inside.set()
        assert go_on.wait(60)

    watcher.sleep = wait_for_slurm
    said: list[tuple[str, bool]] = []
    first = threading.Thread(target=stranded.after_lost_rendezvous,
                             args=(ENV, lambda *a: said.append(a), watcher))  # fmt: skip
    first.start()
    assert inside.wait(60)
    second = threading.Thread(target=stranded.after_lost_rendezvous,
                              args=(ENV, lambda *a: said.append(a), main))  # fmt: skip
    second.start()
    second.join(1)
    assert second.is_alive() and main.calls == []  # its turn has not come
    go_on.set()
    first.join(60)
    second.join(60)
    assert said == [(LOST_LINE.replace("DOWN+NOT_RESPONDING", "DOWN"), True)]
    assert watcher.calls[-1] == "requeue 68" and main.calls == ["show job 68"]


def test_the_watcher_starts_only_for_a_watchers_agent_in_a_slurm_job(monkeypatch):
    started: list[tuple] = []
    monkeypatch.setattr(stranded, "watch", lambda *args: started.append(args))
    monkeypatch.setattr(network, "resolve", lambda name: {"n1": "10.77.0.1"}.get(name))

    def say(line: str, requeued: bool) -> None:
        pass

    for environ, endpoint in (({**ENV, "SLURM_NODEID": "0"}, "n1:29400"),
                              ({"SLURM_NODEID": "1"}, "n1:29400"),
                              (ENV, "n1"), (ENV, "nowhere:29400")):  # fmt: skip
        assert stranded.start(environ, endpoint, say) is None
    thread = stranded.start(ENV, "n1:29400", say)
    assert thread is not None and thread.daemon
    thread.join(60)
    assert started == [(ENV, "10.77.0.1", 29400, say)]


def test_a_watch_that_fails_says_so_in_a_line_and_ends(monkeypatch):
    def broken(*args):
        raise RuntimeError("no scontrol here")

    monkeypatch.setattr(stranded, "watch", broken)
    monkeypatch.setattr(network, "resolve", lambda name: "10.77.0.1")
    said: list[tuple[str, bool]] = []
    thread = stranded.start(ENV, "n1:29400", lambda line, requeued: said.append((line, requeued)))
    assert thread is not None
    thread.join(60)
    assert said == [("the watch of torchrun's rendezvous ended (RuntimeError: no scontrol here)",
                     False)]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_turn_left_taken():
    yield
    assert not stranded._ACTING.locked()

"""The supervisor's parts: how a run ended read from its files, a plan it cannot read, its imports,
the words for a run Slurm took the job from.

Its whole run, signals included, is tested through the rendered batch script with stand-ins of
srun and scontrol (tests/batch/script/test_sbatch.py) and on the clusters.
"""

from __future__ import annotations

import json
import subprocess
import sys

from slurmddp import protocol
from slurmddp.preemption import decision
from slurmddp.supervisor import outcome
from tests.conftest import launcher_free_env


def files(tmp_path, **contents: str) -> dict[str, str]:
    """The run's files with `contents` (by protocol name, without SLURMDDP_), and the environ."""
    names = {"REQUEUE_FILE": "requeue", "DONE_FILE": "done", "ASKED_FILE": "asked",
             "FAILURE_FILE": "failures", "NODES_LOST_FILE": "nodes-lost", "HANG_DIR": "hang"}
    environ = {f"SLURMDDP_{k}": str(tmp_path / v) for k, v in names.items()}
    for key, text in contents.items():
        (tmp_path / names[key]).write_text(text)
    return environ


def test_a_run_that_asked_for_a_requeue(tmp_path):
    environ = files(tmp_path, REQUEUE_FILE="USR2\n", ASKED_FILE="")
    ended = outcome.read(environ, batch_log=None, log_start=0, elastic=False)
    assert (ended.asked, ended.done, ended.protocol_used, ended.hung) == ("USR2", False, True,
                                                                          False)  # fmt: skip
    assert not (tmp_path / "requeue").exists()  # taken: the next run starts without it


def test_a_run_that_never_asked_and_failed_on_a_node(tmp_path):
    environ = files(tmp_path, FAILURE_FILE="slurmddp: rank 3 (host n2) failed: boom\nlater\n",
                    NODES_LOST_FILE="slurmddp: too few nodes\n")  # fmt: skip
    log = tmp_path / "7.batch.log"
    log.write_text("srun: error: n9: task 9: Exited with exit code 9\n")  # an earlier run's
    start = log.stat().st_size
    with log.open("a") as f:
        f.write("other\nsrun: error: n2: tasks 2-3: Killed\nsrun: error: n1: task 0: Killed\n")
    ended = outcome.read(environ, batch_log=log, log_start=start, elastic=True)
    assert ended.seen == "srun: error: n2: tasks 2-3: Killed"
    assert ended.signalled is None  # killed: any node's fate
    assert ended.reported == "slurmddp: rank 3 (host n2) failed: boom"
    # A node's signal srun saw after a peer's exit it caused (the peer lost its connection).
    with log.open("a") as f:
        f.write("srun: error: n3: task 5: Bus error\nsrun: error: n4: task 7: Bus error\n")
    ended = outcome.read(environ, batch_log=log, log_start=start, elastic=True)
    assert (ended.seen, ended.signalled) == ("srun: error: n2: tasks 2-3: Killed",
                                             "srun: error: n3: task 5: Bus error")
    assert (ended.protocol_used, ended.nodes_lost) == (False, "slurmddp: too few nodes")
    assert ended.aborted is None
    # srun aborted the step for its second node (its step daemon lost): named from the job's list.
    with log.open("a") as f:
        f.write("srun: error: Aborting, io error and missing step on node 1\n")
    ended = outcome.read(environ | {"SLURM_JOB_NODELIST": "n[1-3]"}, batch_log=log,
                         log_start=start, elastic=True)  # fmt: skip
    assert ended.aborted == "n2"
    assert outcome.read(environ, batch_log=log, log_start=start, elastic=False).nodes_lost is None


def test_only_this_runs_failures_count(tmp_path):
    # A rank of run 0 on a node whose link came back writes after run 1 began; run 1's own
    # first failure is its second line. A line without a run is this run's (a user's script).
    environ = files(tmp_path, FAILURE_FILE="0\tslurmddp: rank 1 (host n2) failed: reset\n"
                    "1\tslurmddp: rank 0 (host n3) failed: boom\n")  # fmt: skip
    for restart, first in (("1", "slurmddp: rank 0 (host n3) failed: boom"), ("2", None),
                           (None, "slurmddp: rank 1 (host n2) failed: reset")):  # fmt: skip
        run = {"SLURM_RESTART_COUNT": restart} if restart else {}
        ended = outcome.read(environ | run, batch_log=None, log_start=0, elastic=False)
        assert ended.reported == first, restart
    (tmp_path / "failures").write_text("slurmddp: rank 3 (host n2) failed: own words\n")
    assert outcome.read(environ | {"SLURM_RESTART_COUNT": "4"}, batch_log=None, log_start=0,
                        elastic=False).reported == "slurmddp: rank 3 (host n2) failed: own words"


def test_a_hung_run_names_its_suspects(tmp_path):
    environ = files(tmp_path)
    for run, suspects in (("a", "1 n2\n2 n2\n"), ("b", "junk\n")):
        state = tmp_path / "hang" / ".state" / run
        state.mkdir(parents=True)
        (state / "verdict").write_text(f"hung: ranks of {run}\n")
        (state / "suspects").write_text(suspects)
    ended = outcome.read(environ, batch_log=None, log_start=0, elastic=False)
    assert ended.hung and ended.suspects == ((1, "n2"), (2, "n2"))
    assert ended.verdicts == ("hung: ranks of a", "hung: ranks of b")
    assert set(ended.facts()) == {"asked", "done", "protocol_used", "nodes_lost", "seen",
                                  "signalled", "aborted", "reported", "hung", "suspects",
                                  "slow"}  # fmt: skip


def test_the_nodes_named_slow_in_the_run_reach_its_decision(tmp_path):
    environ = files(tmp_path)
    assert outcome.read(environ, batch_log=None, log_start=0, elastic=False).slow == ()
    # Two of torchrun's restarts in the run, each its own watchdog state.
    for run, named in (("0.0", "n2 busy 3.0 times\nn4 busy 2.5 times\n"), ("0.1", "n2 later\n")):
        state = tmp_path / "hang" / ".state" / run
        state.mkdir(parents=True)
        (state / "slow").write_text(named)
    ended = outcome.read(environ, batch_log=None, log_start=0, elastic=False)
    assert ended.slow == (("n2", "busy 3.0 times"), ("n4", "busy 2.5 times"))
    assert decision.facts_from(environ, step_status=0, **ended.facts()).slow == ended.slow


def test_a_plan_it_cannot_read_is_one_line_and_status_2():
    for plan in ("{", '{"launcher": "srun", "python": "p", "target": [], "log_root": "/x", '
                      '"gpus": 1}', '{"launcher": "slurm", "python": "p", "target": [], '
                      '"log_root": "/x", "signal": "NOPE"}'):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "slurmddp.supervisor", "--plan", plan],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("slurmddp: the batch script's plan cannot be read")


def test_a_job_directory_it_cannot_make_is_one_line_and_no_step(tmp_path):
    (tmp_path / "afile").touch()
    plan = json.dumps({"launcher": "srun", "python": sys.executable, "target": ["t.py"],
                       "log_root": str(tmp_path / "afile" / "out")})  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "slurmddp.supervisor", "--plan", plan],
                       env={**launcher_free_env(), "SLURM_JOB_ID": "7"}, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == protocol.INTERNAL_ERROR and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("slurmddp: cannot make the job's directory "), r.stderr
    assert "Not a directory" in r.stderr and "--output" in r.stderr


def test_the_supervisor_imports_no_torch():
    # It runs on the host's python, also when the ranks run in an image that has the torch.
    code = ("import sys; import slurmddp.supervisor.supervise, slurmddp.supervisor.outcome, "
            "slurmddp.preemption.decision, slurmddp.preemption.slurm; "
            "assert 'torch' not in sys.modules")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_a_run_slurm_took_the_job_from_is_named_by_the_next(tmp_path, monkeypatch, capsys):
    from slurmddp.preemption import slurm
    from slurmddp.supervisor.launchers import Run
    from slurmddp.supervisor.plan import Plan
    from slurmddp.supervisor.supervise import Supervisor

    told = tmp_path / "events.jsonl"
    told.write_text('{"t": 1, "kind": "run", "run": 0, "nodes": "n[1-2]"}\n'
                    '{"t": 2, "kind": "training", "run": 0, "step": 1}\n')  # and nothing more
    asked = []

    def scontrol(*args: str) -> subprocess.CompletedProcess[str]:
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, "NodeName=n1 Arch=x State=DOWN+NOT_RESPONDING "
                                           "Reason=Not responding\nNodeName=n2 State=IDLE x=y\n")
    monkeypatch.setattr(slurm, "scontrol", scontrol)
    environ = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "SLURMDDP_MAX_REQUEUES": "3",
               protocol.EVENTS_FILE_VAR: str(told)}  # fmt: skip
    supervisor = Supervisor(Plan(launcher="srun", python="python", target=("t.py",),
                                 log_root=str(tmp_path)), environ)  # fmt: skip
    supervisor._explain_the_last_run(Run.of(environ))
    assert asked == [("show", "node", "-o", "n[1-2]")]  # one call, for the last run's nodes
    said = ("slurmddp: run 1 on n[1-2] ended without a decision: Slurm lost n1 (not responding: "
            "the machine, its slurmd or its link); requeued by Slurm")
    empty = ("slurmddp: n1 may report the end of run 1's step once back, which Slurm would take "
             "for this run's step of the same id: 1 empty step first")
    assert capsys.readouterr().err.splitlines() == [said, empty]
    assert supervisor._spacers == 1
    decision = json.loads(told.read_text().splitlines()[-1])
    want = {"kind": "decision", "run": 0, "action": "requeue", "cause": "node lost: n1",
            "left_behind": "n1", "requeue": 1, "allowed": 3}
    assert {k: decision[k] for k in want} == want
    supervisor._explain_the_last_run(Run.of(environ))  # it decided now: nothing more is asked
    assert len(asked) == 1 and capsys.readouterr().err == ""
    # An elastic job whose batch host was lost: another node's agent requeued it (launch.stranded).
    told.write_text('{"t": 1, "kind": "run", "run": 0, "nodes": "n[1-2]"}\n'
                    '{"t": 3, "kind": "agent", "run": 0, "host": "n2", "requeued": true}\n')
    supervisor._explain_the_last_run(Run.of(environ))
    assert capsys.readouterr().err.splitlines() == [
        said.replace("requeued by Slurm", "requeued by the agent on n2"), empty]
    # With a preflight, the last run had two steps of the supervisor's: two empty steps.
    told.write_text('{"t": 1, "kind": "run", "run": 0, "nodes": "n[1-2]"}\n')
    supervisor = Supervisor(Plan(launcher="srun", python="python", target=("t.py",),
                                 log_root=str(tmp_path), preflight=True), environ)  # fmt: skip
    supervisor._explain_the_last_run(Run.of(environ))
    assert supervisor._spacers == 2 and capsys.readouterr().err.splitlines()[-1] == (
        empty.replace("1 empty step", "2 empty steps"))
    # A node lost again: the last run had its own empty steps first (a node lost before it),
    # and so its steps' ids came after theirs.
    told.write_text('{"t": 1, "kind": "run", "run": 0, "nodes": "n[1-2]", "spacers": 2}\n')
    supervisor._explain_the_last_run(Run.of(environ))
    assert supervisor._spacers == 4 and capsys.readouterr().err.splitlines()[-1] == (
        empty.replace("1 empty step", "4 empty steps"))
    for spacers in ('"x"', "-1", "true", "1000"):  # not ours: as none
        told.write_text('{"t": 1, "kind": "run", "run": 0, "nodes": "n1", "spacers": '
                        f"{spacers}}}\n")  # fmt: skip
        supervisor._explain_the_last_run(Run.of(environ))
        assert supervisor._spacers == 2, spacers


def test_an_empty_step_takes_a_step_id_on_one_node():
    from slurmddp.supervisor.launchers import spacer
    from slurmddp.supervisor.plan import Plan

    plan = Plan(launcher="srun", python="python", target=("t.py",), log_root="/x", cpus_per_task=4)
    assert spacer(plan).argv == ("srun", "--nodes=1", "--ntasks=1", "--quiet",
                                 "--cpus-per-task=4", "true")  # fmt: skip

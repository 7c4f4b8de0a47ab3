"""The integrations' ways of running a framework's example with a fault: locally (a stop, a rank
killed, a stuck fork), and on the cluster a 2-node job of it preempted mid-training, which resumes
where it stopped and ends bitwise equal to an uninterrupted run (Lightning's: the Trainer handles
Slurm's signals itself)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS, free_port, launcher_free_env, tagged_json
from tests.preemption.test_preemption_cluster import Job

# How the cluster signals a preemption: our configuration (USR2 first, then TERM), and Slurm's
# default (TERM alone), as most centres run it; what the batch log then names.
SIGNALLING = [("standard", "USR2"), ("default-signal", "TERM")]


def faulted(script: str, out_flag: str, out: Path, steps: int, *more: str, ranks: int = 1,
            timeout: float = 600, **env: str) -> tuple[list[dict], str]:  # fmt: skip
    """A framework's example through tests/programs/faults.py (`env`: STOP_AT, CRASH_AT,
    STUCK_FORK), in one process, or `ranks` under slurmddp.agent (torchrun) on this host,
    restarted once if a worker dies. Its RESULT lines by rank (none when it stopped or was
    killed), and its stderr."""
    args = [str(PROGRAMS / "faults.py"), script, "--steps", str(steps), out_flag, str(out), *more]
    if ranks > 1:
        port = free_port()
        args = ["-m", "slurmddp.agent", "--nnodes", "1", "--nproc-per-node", str(ranks),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--max-restarts", "1", *args]  # fmt: skip
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                       env=launcher_free_env(OMP_NUM_THREADS="1", **env))  # fmt: skip
    assert r.returncode == (-9 if ranks == 1 and "CRASH_AT" in env else 0), r.stderr[-3000:]
    return sorted(tagged_json(r.stdout, "RESULT "), key=lambda x: x["rank"]), r.stderr


class Uninterrupted:
    """A framework's example run uninterrupted through `faulted` (no fault), once per module for
    each set of steps, options and ranks, for every test that compares a run to it: the same
    program, options, ranks and environment, only the output directory differs (each a folder of
    `tmp_path_factory`'s). Each start of an example costs seconds of CPU (imports)."""

    def __init__(self, script: str, out_flag: str, tmp_path_factory: pytest.TempPathFactory):
        self.script, self.out_flag, self._tmp = script, out_flag, tmp_path_factory
        self._runs: dict[tuple, list[dict]] = {}

    def __call__(self, steps: int, *more: str, ranks: int = 1) -> list[dict]:
        key = (steps, more, ranks)
        if key not in self._runs:
            out = self._tmp.mktemp("uninterrupted") / "out"
            self._runs[key] = faulted(self.script, self.out_flag, out, steps, *more,
                                      ranks=ranks)[0]  # fmt: skip
        return self._runs[key]


def forked_again(flag: Path, stderr: str) -> None:
    """The run given STUCK_FORK=`flag` (faults.py: its first fork never returns, as CPython's
    gh-112275 leaves one on a loaded Python 3.10.13) said its DataLoader worker, stuck before the
    first step asks should_stop, was killed and forked again (unshielded, the loader waits for
    that worker forever); the caller compares the run's end to an uninterrupted one's."""
    stuck = flag.read_text()
    assert f"a DataLoader worker (pid {stuck}) was stuck in its fork for 2 s; it was killed and " \
           "forked again" in stderr, stderr[-3000:]  # fmt: skip


def resumed_from_snapshot(stderr: str) -> int:
    """The step the one recovery said on stderr resumed at, from the nodes' snapshots."""
    found = re.findall(r"resuming from the snapshot of step (\d+) in the nodes' memory", stderr)
    assert len(found) == 1, stderr[-3000:]
    return int(found[0])


# A snapshot every step, whatever it costs (the budget would space them wider on a loaded machine).
EVERY_STEP = ("--snapshot-every", "1", "--snapshot-budget", "none")


def killed_then_resumed(uninterrupted: Uninterrupted, tmp_path: Path, ranks: int, steps: int,
                        *more: str) -> tuple[list[dict], list[dict], int]:  # fmt: skip
    """A framework's example (`steps` steps; `more`: its options) uninterrupted (`uninterrupted`'s
    run, shared with the module's other tests), and with a snapshot every step (no budget: on a
    loaded machine it spaces them wider, to before the first epoch's end at several ranks) and
    rank 1 (alone: 0) killed at step 24: at several ranks torchrun restarts them all, alone it is
    run again.
    Each run's RESULT lines, and the step the killed run resumed at from a snapshot. Nothing
    durable is written before."""
    script, out_flag = uninterrupted.script, uninterrupted.out_flag
    shm = {"SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "shm")}
    every = EVERY_STEP
    out = tmp_path / "killed"
    killed = faulted(script, out_flag, out, steps, *every, *more, ranks=ranks, CRASH_AT="24",
                     CRASH_RANK="1" if ranks > 1 else "0", **shm)  # fmt: skip
    if ranks == 1:
        assert killed[0] == []
        killed = faulted(script, out_flag, out, steps, *every, *more, **shm)
    assert not list(out.glob("*step-*")) and not list(out.glob("checkpoint-*"))
    return uninterrupted(steps, *more, ranks=ranks), killed[0], resumed_from_snapshot(killed[1])


def killed_stopped_resumed(uninterrupted: Uninterrupted, tmp_path: Path, steps: int,
                           stop_after: int, *more: str, ranks: int = 1,
                           snapshots: tuple[str, ...] = EVERY_STEP, control: dict | None = None,
                           **last: str) -> tuple[int, list[str], list[dict], str]:  # fmt: skip
    """A framework's example (`steps` steps; `more`: its options; `snapshots`: its options for a
    snapshot every step), as `uninterrupted` runs it, in three lives: rank 1 (alone: 0) killed
    at step 24 (SIGKILL, nothing durable written), which at several ranks torchrun restarts
    (all of them), alone it is run again; resumed from the nodes' snapshots, it stops at the
    `stop_after`-th step of its life (its checkpoint saved); then run again (no snapshots:
    `last`, its environment besides) from that checkpoint to its end. The step it resumed at
    from a snapshot, the checkpoints saved, the last run's RESULT lines and its stderr.
    `control`: an environment the last life is also run with, from a copy of the checkpoints;
    its RESULT lines are put in `control["results"]`."""
    script, out_flag = uninterrupted.script, uninterrupted.out_flag
    shm = {"SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "shm")}
    out = tmp_path / "out"
    if ranks == 1:
        assert faulted(script, out_flag, out, steps, *snapshots, *more, CRASH_AT="24",
                       CRASH_RANK="0", **shm)[0] == []  # fmt: skip
        assert not list(out.glob("*step-*")) and not list(out.glob("checkpoint-*"))
        kill = {}
    else:  # the first life's workers ask should_stop fewer times than stop_after: no stop
        assert stop_after > 24
        kill = {"CRASH_AT": "24", "CRASH_RANK": "1"}
    stopped, said = faulted(script, out_flag, out, steps, *snapshots, *more, ranks=ranks,
                            STOP_AT=str(stop_after), **kill, **shm)  # fmt: skip
    assert stopped == []
    saved = sorted(p.name for p in out.iterdir() if "step-" in p.name or "checkpoint-" in p.name)
    if control is not None:
        shutil.copytree(out, tmp_path / "control")
        control["results"] = faulted(script, out_flag, tmp_path / "control", steps, *more,
                                     ranks=ranks, **control)[0]  # fmt: skip
    results, stderr = faulted(script, out_flag, out, steps, *more, ranks=ranks, **last)
    return resumed_from_snapshot(said), saved, results, stderr


def args(script: str, out: Path, out_flag: str, steps: int, step_time: float,
         more: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    return ["--nodes", "2", "--ntasks-per-node", "1", "--env", "OMP_NUM_THREADS=1", script,
            "--steps", str(steps), out_flag, str(out), "--step-time", str(step_time), *more]


def preempted_once(cluster, tmp_path: Path, script: str, out_flag: str, steps: int = 120,
                   submit: tuple[str, ...] = (), signal: str = "USR2",
                   preempt_at: int = 30, more: tuple[str, ...] = (),
                   references: dict | None = None) -> Job:  # fmt: skip
    """Run `script` uninterrupted and preempted once, once it logged step `preempt_at`
    (`submit`: more options, `more`: the script's, `signal`: what the batch log says stopped
    it); check the second against the first, parameters bit for bit, and return it (its output:
    tmp_path / "out"). `references`: the uninterrupted runs' RESULT lines by script, steps and
    options, shared by the tests that give the same dict (no signal reaches an uninterrupted
    run: `submit`'s signal options change nothing in it), each run once."""
    key = (script, steps, more)
    reference = None
    if references is None or key not in references:
        reference = Job(cluster, tmp_path, [*submit, *args(script, tmp_path / "ref", out_flag,
                                                           steps, 0, more)])  # fmt: skip
    job = Job(cluster, tmp_path, [*submit, *args(script, tmp_path / "out", out_flag, steps, 0.1,
                                                 more)])  # fmt: skip
    if reference is not None:
        end = reference.wait_end()
        assert end["JobState"] == "COMPLETED", reference.batch_log
        expected = [x for r in range(2) for x in tagged_json(reference.log(r), "RESULT ")]
        if references is not None:
            references[key] = expected
    else:
        expected = references[key]
    job.wait_for_log(rf"step {preempt_at} ")
    job.preempt()
    end = job.wait_end()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", job.batch_log
    assert re.search(rf"stopped \(preempted, {signal}\) at restart 0 after its checkpoint: "
                     r"requeued", job.batch_log), job.batch_log  # fmt: skip
    logged = [int(s) for s in re.findall(r"^step (\d+) ", job.log(), re.M)]
    # The second run went on from the checkpoint: no step logged twice, none missing.
    assert logged == list(range(10, steps + 1, 10)), job.log()
    results = [x for r in range(2) for x in tagged_json(job.log(r), "RESULT ")]
    assert len(results) == 2 and {x["steps"] for x in results} == {steps}
    assert len({x["digest"] for x in results}) == 1, results  # every rank the same model
    assert {x["digest"] for x in results} == {x["digest"] for x in expected}, (results, expected)
    return job

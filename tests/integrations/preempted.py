"""The proof every integration gives on the cluster: a 2-node job of a framework's script,
preempted mid-training, resumes where it stopped and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROGRAMS, free_port, launcher_free_env, tagged_json
from tests.preemption.test_preemption_cluster import Job

# How the cluster signals a preemption: our configuration (USR2 first, then TERM), and Slurm's
# default (TERM alone), as most centres run it; what the batch log then names.
SIGNALLING = [("standard", "USR2"), ("default-signal", "TERM")]


def run_locally(script: str, out_flag: str, out: Path, steps: int, stop_at: int | None = None,
                *more: str, **env: str) -> list[dict]:  # fmt: skip
    """A framework's example in one local process; `stop_at`: an agreed stop comes at that call
    of should_stop, and stays (the requeue only ends the process: nothing requeues it here).
    Its RESULT lines (none when it stopped)."""
    code = ("import runpy, sys\nfrom slurmddp.preemption import api\n"
            f"calls = []\nstop_at = {stop_at!r}\n"
            "api.should_stop = lambda *a, **k: calls.append(1) or len(calls) >= (stop_at or 1e9)\n"
            "def requeue(): raise SystemExit(0)\n"
            "api.requeue = requeue\n"
            f"sys.argv = [{script!r}, '--steps', '{steps}', {out_flag!r}, {str(out)!r}, "
            f"*{list(more)!r}]\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1", **env})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return tagged_json(r.stdout, "RESULT ")


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


def through_a_stuck_fork(uninterrupted: Uninterrupted, tmp_path: Path, steps: int,
                         *more: str) -> None:  # fmt: skip
    """A framework's example, started as a script under torchrun is (no slurmddp.run), with
    `more` (2 DataLoader workers augmenting at random among them), whose first fork never returns
    (CPython's gh-112275 on a loaded Python 3.10.13: faults.py's STUCK_FORK), before the first
    step asks should_stop: the worker is killed and forked again, and the run ends as an
    uninterrupted one does (`uninterrupted`'s, shared with the module's other tests)."""
    script, out_flag = uninterrupted.script, uninterrupted.out_flag
    flag = tmp_path / "stuck"
    # Unshielded, the loader waits for that worker forever.
    results, stderr = faulted(script, out_flag, tmp_path / "stuck-run", steps, *more, timeout=240,
                              STUCK_FORK=str(flag))  # fmt: skip
    stuck = flag.read_text()
    assert f"a DataLoader worker (pid {stuck}) was stuck in its fork for 2 s; it was killed and " \
           "forked again" in stderr, stderr[-3000:]  # fmt: skip
    reference = uninterrupted(steps, *more)
    assert len(reference) == 1 and results == reference


def resumed_from_snapshot(stderr: str) -> int:
    """The step the one recovery said on stderr resumed at, from the nodes' snapshots."""
    found = re.findall(r"resuming from the snapshot of step (\d+) in the nodes' memory", stderr)
    assert len(found) == 1, stderr[-3000:]
    return int(found[0])


def killed_then_resumed(uninterrupted: Uninterrupted, tmp_path: Path, ranks: int, steps: int,
                        *more: str) -> tuple[list[dict], list[dict], int]:  # fmt: skip
    """A framework's example (`steps` steps; `more`: its options) uninterrupted (`uninterrupted`'s
    run, shared with the module's other tests), and with a snapshot every step (no budget: on a
    loaded machine it spaces them wider, to before the first epoch's end at 4 ranks) and rank 1
    (alone: 0) killed at step 24: at 4 ranks torchrun restarts them all, alone it is run again.
    Each run's RESULT lines, and the step the killed run resumed at from a snapshot. Nothing
    durable is written before."""
    script, out_flag = uninterrupted.script, uninterrupted.out_flag
    shm = {"SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "shm")}
    every = ("--snapshot-every", "1", "--snapshot-budget", "none")
    out = tmp_path / "killed"
    killed = faulted(script, out_flag, out, steps, *every, *more, ranks=ranks, CRASH_AT="24",
                     CRASH_RANK="1" if ranks > 1 else "0", **shm)  # fmt: skip
    if ranks == 1:
        assert killed[0] == []
        killed = faulted(script, out_flag, out, steps, *every, *more, **shm)
    assert not list(out.glob("*step-*")) and not list(out.glob("checkpoint-*"))
    return uninterrupted(steps, *more, ranks=ranks), killed[0], resumed_from_snapshot(killed[1])


def stopped_then_resumed(uninterrupted: Uninterrupted, out: Path, steps: int, stop_at: int,
                         *more: str, **env: str) -> list[dict]:  # fmt: skip
    """The example stopped at `stop_at` (saving its checkpoint), then run again to its end, as
    `uninterrupted` runs it (with `env` besides)."""
    script, out_flag = uninterrupted.script, uninterrupted.out_flag
    assert faulted(script, out_flag, out, steps, *more, STOP_AT=str(stop_at), **env)[0] == []
    return faulted(script, out_flag, out, steps, *more, **env)[0]


def args(script: str, out: Path, out_flag: str, steps: int, step_time: float,
         more: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    return ["--nodes", "2", "--ntasks-per-node", "1", "--env", "OMP_NUM_THREADS=1", script,
            "--steps", str(steps), out_flag, str(out), "--step-time", str(step_time), *more]


def preempted_once(cluster, tmp_path: Path, script: str, out_flag: str, steps: int = 120,
                   submit: tuple[str, ...] = (), signal: str = "USR2",
                   preempt_at: int = 30, more: tuple[str, ...] = ()) -> Job:
    """Run `script` uninterrupted and preempted once, once it logged step `preempt_at`
    (`submit`: more options, `more`: the script's, `signal`: what the batch log says stopped
    it); check the second against the first, parameters bit for bit, and return it (its output:
    tmp_path / "out")."""
    reference = Job(cluster, tmp_path, [*submit, *args(script, tmp_path / "ref", out_flag, steps,
                                                       0, more)])  # fmt: skip
    job = Job(cluster, tmp_path, [*submit, *args(script, tmp_path / "out", out_flag, steps, 0.1,
                                                 more)])  # fmt: skip
    end = reference.wait_end()
    assert end["JobState"] == "COMPLETED", reference.batch_log
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
    expected = [x for r in range(2) for x in tagged_json(reference.log(r), "RESULT ")]
    assert len(results) == 2 and {x["steps"] for x in results} == {steps}
    assert len({x["digest"] for x in results}) == 1, results  # every rank the same model
    assert {x["digest"] for x in results} == {x["digest"] for x in expected}, (results, expected)
    return job

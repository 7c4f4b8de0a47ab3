"""The hang watchdog end to end on this machine: two ranks under torchrun, real gloo.

The cluster tests (tests/watchdog/test_watchdog_cluster.py) run the same program under
`slurmddp submit`; here each way of hanging is judged, and runs that do not hang are left alone.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, launcher_free_env

HANG = str(ROOT / "tests" / "programs" / "hang.py")
TIMEOUT_S = 6


def torchrun(tmp_path: Path, *args: str, timeout_s: float = TIMEOUT_S, **extra: str) -> tuple[
        subprocess.CompletedProcess, float]:  # fmt: skip
    env = launcher_free_env(SLURMDDP_HANG_DIR=str(tmp_path / "hang"),
                            SLURMDDP_HANG_TIMEOUT=f"{timeout_s:g}", **extra)  # fmt: skip
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        "--standalone", "-m", "slurmddp.run", HANG, *args,
                        "--checkpoints", str(tmp_path / "ckpt")],
                       env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    return r, time.monotonic() - start


# A stopped rank is judged on the cluster (test_watchdog_cluster.py): torchrun waits 30 s before
# it kills a stopped worker.
@pytest.mark.parametrize("mode, suspect, why", [
    pytest.param("sleep", 1, "it is not waiting for another rank: it is in ",
                 marks=pytest.mark.floor),
    ("startup", 1, "it is not waiting for another rank: it is in "),
])  # fmt: skip
@pytest.mark.ranks
def test_a_hung_rank_is_named_its_stacks_written_and_the_run_ended(tmp_path, mode, suspect, why):
    # torch's flight recorder (on by default in torch 2.13; set here all the same) is dumped too.
    r, _ = torchrun(tmp_path, mode, "--rank", str(suspect), "--at", "3",
                       TORCH_FR_BUFFER_SIZE="100")  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    report = (tmp_path / "hang" / "report.txt").read_text()
    assert report in out  # printed where rank 0 writes, too
    assert f"slurmddp: rank {suspect} on " in report and why in report, report
    assert "slurmddp: rank 0 merely waits for it" in report
    waiting = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert '"waiting": "a torch.distributed call"' in waiting and "Thread 'MainThread'" in waiting
    assert "Thread 'slurmddp-hang-watchdog'" in waiting
    stuck = (tmp_path / "hang" / f"rank-{suspect}.txt").read_text()
    assert 'hang.py", line' in stuck and '"waiting": null' in stuck
    assert '"last_enqueued_collective"' in (tmp_path / "hang" / "rank-0.flight-recorder.json"
                                            ).read_text()  # torch's flight recorder, under gloo
    # The watchdog ended it (its status), not torchrun or the test's own timeout: no clock needed.
    assert "exitcode  : 124" in out  # HANG_STATUS


@pytest.mark.ranks
def test_a_run_that_does_not_hang_is_left_alone_and_its_work_marks_the_end(tmp_path):
    # Steps of 0.4 s with a timeout of 2 s: progress keeps coming; after mark_done() the ranks
    # linger past the timeout (destroy, exit) and are not judged.
    r, _ = torchrun(tmp_path, "none", "--steps", "12", "--step-time", "0.4", timeout_s=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("finished") == 2
    assert not (tmp_path / "hang" / "report.txt").exists()


@pytest.mark.ranks
def test_a_script_that_never_reports_progress_is_never_judged(tmp_path):
    r, took = torchrun(tmp_path, "silent", "--steps", "20", "--step-time", "0.3", timeout_s=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert took > 6 and r.stdout.count("finished") == 2
    assert not (tmp_path / "hang" / "report.txt").exists()


@pytest.mark.ranks
def test_no_watchdog_without_its_directory(tmp_path):
    env = launcher_free_env(SLURMDDP_HANG_TIMEOUT="1")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                          "--standalone", "-m", "slurmddp.run", HANG, "startup", "--rank",
                          "0", "--checkpoints", str(tmp_path / "ckpt")], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    # Started (importing torch takes seconds, many on a loaded machine) before the clock runs.
    late = threading.Timer(180, p.kill)
    late.start()
    assert p.stdout is not None
    out = ""
    try:
        while "rank 0 stuck in start-up" not in out and (line := p.stdout.readline()):
            out += line
        time.sleep(8)  # well past the timeout: nothing judges the sleeping rank
        assert p.poll() is None
    finally:
        late.cancel()
        p.terminate()  # torchrun ends its workers (each in a session of its own)
        out += p.communicate(timeout=60)[0]
    assert "rank 0 stuck in start-up" in out and "hang watchdog" not in out
    assert [x.name for x in tmp_path.iterdir()] == []

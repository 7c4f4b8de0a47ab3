"""slurmddp.integrations.lightning: a Lightning Trainer under the stop protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, launcher_free_env, tagged_json
from tests.integrations.preempted import preempted_once

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

SCRIPT = str(ROOT / "examples" / "lightning_train.py")
ENV = {**launcher_free_env(), "OMP_NUM_THREADS": "1"}


def run(ckpt, steps: int, stop_at: int | None = None, *more: str) -> list[dict]:
    """The example under slurmddp.run; `stop_at`: an agreed stop comes at that call, and stays
    (the requeue only ends the process, as outside Slurm nothing requeues)."""
    code = ("import runpy, sys\nfrom slurmddp.preemption import api\n"
            f"calls = []\nstop_at = {stop_at!r}\n"
            "api.should_stop = lambda *a, **k: calls.append(1) or len(calls) >= (stop_at or 1e9)\n"
            "def requeue(): raise SystemExit(0)\n"
            "api.requeue = requeue\n"
            f"sys.argv = [{SCRIPT!r}, '--steps', '{steps}', '--checkpoint-dir', {str(ckpt)!r}, "
            f"*{list(more)!r}]\n"
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    return tagged_json(r.stdout, "RESULT ")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("reference"), 100)


# At 1 rank an epoch is 64 steps: a stop in the first epoch; at its last batch (put off to the
# next, the first of the second epoch); and in the second epoch (whose order a resumed
# DistributedSampler drew as epoch 0's until the callback set its epoch).
@pytest.mark.parametrize(("stop_at", "saved"), [(25, 25), (64, 65), (90, 90)])
def test_a_stop_saves_a_checkpoint_the_next_run_resumes_from_bitwise(tmp_path, reference,
                                                                     stop_at, saved):  # fmt: skip
    assert run(tmp_path, 100, stop_at=stop_at) == []  # stopped: no result
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{saved:08d}.ckpt"]
    assert run(tmp_path, 100) == reference


def test_a_loader_with_worker_processes_resumes_in_its_epoch_too(tmp_path, reference):
    # Lightning's issue #21938 is about exactly this: workers prefetch as the iterator is made.
    assert run(tmp_path, 100, 90, "--workers", "2") == []
    assert run(tmp_path, 100, None, "--workers", "2") == reference


def test_a_datamodules_loader_resumes_in_its_epoch_too(tmp_path, reference):
    assert run(tmp_path, 100, 90, "--datamodule") == []
    assert run(tmp_path, 100, None, "--datamodule") == reference


# Lightning picks its SLURMEnvironment under srun. USR1 is also its auto-requeue signal; with
# Slurm's default signalling the stop is TERM, on which Lightning would end fit by itself.
CASES = {
    "usr2": ("standard", (), "USR2"),
    "usr1-with-lightnings-auto-requeue": ("standard", ("--signal", "USR1"), "USR1"),
    "term-default-signalling": ("default-signal", (), "TERM"),
}


@pytest.mark.cluster
@pytest.mark.parametrize("case", list(CASES))
def test_a_preempted_lightning_fit_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                                      case):  # fmt: skip
    variant, submit, stop = CASES[case]
    with slurm_cluster.variant(variant):
        # At 2 ranks an epoch is 32 steps: preempted at step 40, the run resumes mid-way through
        # the second epoch, where the samplers' epoch matters.
        job = preempted_once(slurm_cluster, tmp_path, SCRIPT, "--checkpoint-dir", submit=submit,
                             signal=stop, preempt_at=40)  # fmt: skip
    saved = [p.name for p in (tmp_path / "out").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    said = "which Lightning's SLURM auto-requeue also takes: slurmddp's stop protocol handles it"
    assert (said in job.log()) == (stop == "USR1"), job.log()

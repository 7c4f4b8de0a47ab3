"""slurmddp.integrations.accelerate: an Accelerate loop under the stop protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, launcher_free_env, tagged_json
from tests.integrations.preempted import SIGNALLING, preempted_once, run_locally

pytest.importorskip("accelerate")

SCRIPT = str(ROOT / "examples" / "accelerate_train.py")


def run(tmp_path, steps: int):
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", str(steps),
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True,
                       text=True, env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return tagged_json(r.stdout, "RESULT ")


def test_a_saved_step_resumes_to_the_same_parameters(tmp_path):
    reference = run(tmp_path / "a", 40)
    # Save at step 25 through `Preemptible.save`, as a stop would, then resume to 40.
    code = (
        "import sys, runpy; from slurmddp.integrations import accelerate as a\n"
        "def step(self, n):\n"
        "    if n == 25: self.save(n); raise SystemExit(0)\n"
        "a.Preemptible.step = step\n"
        f"sys.argv = [{SCRIPT!r}, '--steps', '40', '--checkpoint-dir', {str(tmp_path / 'b')!r}]\n"
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000025"]
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", "40",
                        "--checkpoint-dir", str(tmp_path / "b")], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert tagged_json(r.stdout, "RESULT ") == reference


def test_random_augmentation_in_workers_resumes_bitwise(tmp_path):
    # Issue 28: the example's dropout, noise on every sample in 2 worker processes; stopped in
    # the second epoch (64 steps an epoch) through Preemptible.save, as a stop would.
    more = ("--augment", "--workers", "2")
    reference = run_locally(SCRIPT, "--checkpoint-dir", tmp_path / "ref", 100, None, *more)
    assert run_locally(SCRIPT, "--checkpoint-dir", tmp_path / "a", 100, 90, *more) == []
    assert run_locally(SCRIPT, "--checkpoint-dir", tmp_path / "a", 100, None, *more) == reference


@pytest.mark.cluster
@pytest.mark.parametrize(("variant", "signal"), SIGNALLING)
def test_a_preempted_accelerate_loop_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                                        variant, signal):
    # Under Slurm's default signalling, also as users train: random augmentation in workers.
    more = ("--augment", "--workers", "2") if variant == "default-signal" else ()
    with slurm_cluster.variant(variant):
        preempted_once(slurm_cluster, tmp_path, SCRIPT, "--checkpoint-dir", signal=signal,
                       more=more)
    out = tmp_path / "out"
    saved = [p.name for p in out.iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved

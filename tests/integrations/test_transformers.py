"""slurmddp.integrations.transformers: the Hugging Face Trainer under the stop protocol."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, launcher_free_env, tagged_json
from tests.integrations.preempted import SIGNALLING, preempted_once

pytest.importorskip("transformers")

SCRIPT = str(ROOT / "examples" / "hf_trainer.py")


def test_importing_slurmddp_does_not_import_a_framework():
    code = ("import sys, slurmddp, slurmddp.integrations; "
            "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=launcher_free_env())  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_an_uninterrupted_run_ends_at_its_last_step(tmp_path):
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", "5",
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [x["steps"] for x in tagged_json(r.stdout, "RESULT ")] == [5]


@pytest.mark.cluster
@pytest.mark.parametrize(("variant", "signal"), SIGNALLING)
def test_a_preempted_trainer_resumes_at_its_stop_and_ends_bitwise_identical(slurm_cluster,
                                                                            tmp_path, variant,
                                                                            signal):  # fmt: skip
    with slurm_cluster.variant(variant):
        preempted_once(slurm_cluster, tmp_path, SCRIPT, "--output-dir", signal=signal)
    out = tmp_path / "out"
    saved = [int(m[1]) for p in out.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    assert len(saved) == 1 and 30 <= saved[0] < 120, saved  # the stop's checkpoint, only

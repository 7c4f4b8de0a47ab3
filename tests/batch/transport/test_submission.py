"""slurmddp.batch.transport.submission: what reaches sbatch (a stand-in that keeps the script it
gets)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, launcher_free_env

TRAIN = str(ROOT / "examples" / "ddp_train.py")


def submit(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    sbatch = bin_dir / "sbatch"
    kept = tmp_path / "submitted.sh"
    sbatch.write_text(f'#!/bin/bash\ncp "$1" {kept}\necho "Submitted batch job 4242"\n')
    sbatch.chmod(0o755)
    path = f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"
    env = launcher_free_env(XDG_STATE_HOME=str(tmp_path / "state"),
                            XDG_CONFIG_HOME=str(tmp_path / "config"), PATH=path)  # fmt: skip
    env.pop("SLURMDDP_PROFILES", None)
    argv = [sys.executable, "-m", "slurmddp", "submit", "--no-snapshot", *args, TRAIN]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r, kept


def test_submit_sends_the_script_dry_run_prints(tmp_path):
    r, kept = submit(tmp_path, "--nodes", "2")
    assert r.returncode == 0, r.stderr
    dry, _ = submit(tmp_path, "--nodes", "2", "--dry-run")
    assert kept.read_text() == dry.stdout


def test_submit_sends_the_users_template_from_the_command_line_or_a_profile(tmp_path):
    (tmp_path / "mine.j2").write_text("#!/bin/bash\n# centre template\nexec {{ python | sh }}\n")
    r, kept = submit(tmp_path, "--template", "mine.j2")
    assert r.returncode == 0, r.stderr
    assert "# centre template" in kept.read_text()
    kept.unlink()
    (tmp_path / "slurmddp.toml").write_text('template = "mine.j2"\n')
    r, kept = submit(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "# centre template" in kept.read_text()

"""A non-editable install (a built wheel, in a clean venv, away from the source tree) works:
the templates ship inside it and the CLI runs without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from tests.conftest import ROOT, launcher_free_env


def test_wheel_ships_the_templates_and_runs_from_a_clean_venv(tmp_path: Path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("slurmddp-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("slurmddp/templates/")}
    in_repo = {f"slurmddp/templates/{p.name}" for p in (ROOT / "templates").glob("*.j2")}
    assert in_repo, "templates/ holds no template"
    assert in_repo <= shipped

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    clean = launcher_free_env()
    clean.pop("PYTHONPATH", None)
    found = subprocess.run(
        [py, "-c", "import importlib.resources as r, json, slurmddp; print(slurmddp.__file__); "
         "print(json.dumps([p.name for p in r.files('slurmddp.templates').iterdir()]))"],
        cwd=tmp_path, env=clean, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert found[0].startswith(str(env_dir)), "imported the source tree, not the install"
    assert {Path(n).name for n in in_repo} <= set(json.loads(found[1]))
    # The console script runs with only the package installed: no torch, no jinja2 needed.
    helped = subprocess.run([str(env_dir / "bin" / "slurmddp"), "--help"], cwd=tmp_path,
                            env=clean, capture_output=True, text=True)  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "doctor" in helped.stdout

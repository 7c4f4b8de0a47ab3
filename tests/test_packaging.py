"""What users install: the wheel holds every file of the package, works from a clean venv without
the source tree, and is what this suite itself imports (scripts/install puts it in the venv)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import slurmddp
from tests.conftest import ROOT, launcher_free_env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (built,) = dist.glob("slurmddp-*.whl")
    return built


def source_files() -> set[str]:
    """The package's files as the wheel names them: slurmddp/ as it is, templates/ (data at the
    repository root) as slurmddp/templates/."""
    out = set()
    for top, name in (("slurmddp", "slurmddp"), ("templates", "slurmddp/templates")):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                out.add(f"{name}/{path.relative_to(ROOT / top).as_posix()}")
    return out


def test_the_wheel_holds_every_file_of_the_package_and_no_other(wheel: Path):
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("slurmddp-")}
    in_tree = source_files()
    assert {"slurmddp/watchdog/__init__.py", "slurmddp/templates/sbatch.sh.j2",
            "slurmddp/py.typed"} <= in_tree  # fmt: skip
    assert shipped == in_tree, (
        f"missing from the wheel: {sorted(in_tree - shipped)}; "
        f"in the wheel, not in the tree: {sorted(shipped - in_tree)}"
    )


@pytest.mark.ranks
def test_wheel_runs_from_a_clean_venv_without_torch(wheel: Path, tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = str(env_dir / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    clean = launcher_free_env()
    clean.pop("PYTHONPATH", None)
    # Every package importable from the install, found as the import system finds them but
    # without importing them (walk_packages would, and a package that needs torch hides its
    # subpackages here, where torch is not installed).
    found = subprocess.run(
        [py, "-c", "import importlib.resources as r, json, os, pkgutil, slurmddp\n"
         "def walk(path, prefix):\n"
         "    for m in pkgutil.iter_modules([path], prefix):\n"
         "        if m.ispkg:\n"
         "            yield m.name\n"
         "            yield from walk(os.path.join(path, m.name.rsplit('.', 1)[1]), m.name + '.')\n"
         "print(slurmddp.__file__)\n"
         "print(json.dumps([p.name for p in r.files('slurmddp.templates').iterdir()]))\n"
         "print(json.dumps(sorted(walk(slurmddp.__path__[0], 'slurmddp.'))))"],
        cwd=tmp_path, env=clean, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert found[0].startswith(str(env_dir)), "imported the source tree, not the install"
    assert "sbatch.sh.j2" in json.loads(found[1])
    packages = {".".join(("slurmddp", *p.parent.relative_to(ROOT / "slurmddp").parts))
                for p in (ROOT / "slurmddp").rglob("__init__.py")}
    assert set(json.loads(found[2])) == packages - {"slurmddp"} | {"slurmddp.templates"}
    # The console script runs with only the package installed: no torch, no jinja2 needed.
    helped = subprocess.run([str(env_dir / "bin" / "slurmddp"), "--help"], cwd=tmp_path,
                            env=clean, capture_output=True, text=True)  # fmt: skip
    assert helped.returncode == 0, helped.stderr
    assert "doctor" in helped.stdout


def _editable() -> bool:
    text = importlib.metadata.distribution("slurmddp").read_text("direct_url.json") or "{}"
    return bool(json.loads(text).get("dir_info", {}).get("editable"))


@pytest.mark.skipif(_editable(), reason="an editable install (scripts/install --editable): "
                    "scripts/test runs the suite on the built wheel")  # fmt: skip
def test_the_suite_runs_the_installed_package_not_the_source_tree():
    here = Path(slurmddp.__file__).resolve()
    assert not here.is_relative_to(ROOT / "slurmddp"), (
        f"this suite imported slurmddp from the checkout ({here}): run it through scripts/test, "
        "or from a directory outside the checkout with the wheel installed")
    assert here.is_relative_to(Path(sys.prefix).resolve()), here
    # So do the processes the tests start, from the suite's working directory.
    child = subprocess.run([sys.executable, "-c", "import slurmddp; print(slurmddp.__file__)"],
                           capture_output=True, text=True, check=True, env=dict(os.environ))
    assert Path(child.stdout.strip()).resolve() == here, (
        f"a process started from {os.getcwd()} imports {child.stdout.strip()}")

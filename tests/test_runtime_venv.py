"""What `pip install torch slurmddp` brings is enough (issue 44, D): in a venv of torch, the wheel
and its declared dependencies and nothing more (`scripts/install --runtime`, as scripts/demo
makes it; .venv-runtime), every module imports but the framework integrations, the README's loop
runs with snapshots through a stop and its resume, the main job runs as scripts/demo submits it;
every example that needs nothing but torch runs in it too (tests/test_examples.py).

The test extra brings numpy, Lightning and the rest into every other venv of the suite: there,
a need of theirs that the package does not declare would go unseen (torch's object collectives
and DCP's plans need numpy, which torch does not install).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import ROOT, launcher_free_env, tagged_json
from tests.test_examples import EXAMPLES, NOT_REQUEUED, launch

README_LOOP = ROOT / "tests" / "programs" / "readme_snapshots.py"
# What scripts/install leaves beside the packages: pip (the venv's), setuptools (the wheel is
# built in the venv) and uv (which installs the dependencies).
INSTALLER = {"pip", "setuptools", "uv"}
# The frameworks users install themselves: an integration of one may import it at import.
FRAMEWORKS = {"lightning", "transformers", "accelerate"}

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def python(runtime_python: str) -> str:
    return runtime_python


def runtime_env(**extra: str) -> dict[str, str]:
    env = launcher_free_env(**extra)
    env.pop("PYTHONPATH", None)  # nothing of the suite's venv or checkout
    return env


def run_in(python: str, code: str, cwd: Path) -> str:
    r = subprocess.run([python, "-c", code], cwd=cwd, env=runtime_env(), capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_it_holds_the_declared_dependencies_and_nothing_more(python, tmp_path):
    found = json.loads(run_in(python, "import importlib.metadata as m, json, platform, sys\n"
                              "print(json.dumps({'dists': {d.metadata['Name']: d.requires or []\n"
                              "                            for d in m.distributions()},\n"
                              "                  'python': platform.python_version()}))",
                              tmp_path))  # fmt: skip
    installed = {canonicalize_name(n): r for n, r in found["dists"].items()}
    marker_env = default_environment() | {"python_full_version": found["python"],
                                          "python_version": found["python"].rsplit(".", 1)[0]}
    # The closure of slurmddp's and torch's requirements (no extras), as pip resolves it.
    wanted, todo = set(), ["slurmddp", "torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in wanted:
            continue
        wanted.add(name)
        assert name in installed, f"{name} is required but not installed"
        for line in installed[name]:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(marker_env | {"extra": ""}):
                todo.append(req.name)
    assert "numpy" in wanted  # declared: torch's object collectives need it, torch omits it
    assert set(installed) - wanted <= INSTALLER, "more than the declared dependencies"


def test_every_module_imports_but_those_of_the_frameworks(python, tmp_path):
    failed = json.loads(run_in(python, "import importlib, json, pkgutil, slurmddp\n"
                               "failed = {}\n"
                               "for m in pkgutil.walk_packages(slurmddp.__path__, 'slurmddp.',\n"
                               "                               onerror=lambda name: None):\n"
                               "    if m.name.endswith('__main__'):\n"
                               "        continue  # the CLI, run when imported\n"
                               "    try:\n"
                               "        importlib.import_module(m.name)\n"
                               "    except ImportError as e:\n"
                               "        failed[m.name] = getattr(e, 'name', None) or str(e)\n"
                               "print(json.dumps(failed))", tmp_path))  # fmt: skip
    assert "slurmddp.integrations.lightning" in failed  # the check sees a missing package
    assert all(m.startswith("slurmddp.integrations.") and (n or "").split(".")[0] in FRAMEWORKS
               for m, n in failed.items()), failed  # fmt: skip


def test_the_readme_loop_with_snapshots_stops_and_resumes(python, tmp_path):
    args = ("--checkpoint-dir", str(tmp_path / "run"))
    cut = launch(tmp_path, README_LOOP, *args, "--stop-at", "3", python=python)
    cut.check(NOT_REQUEUED, NOT_REQUEUED)
    assert "outside a Slurm job: nothing requeues it" in cut.text
    saved = [int(p.name.removeprefix("step-")) for p in (tmp_path / "run").rglob("step-*")]
    again = launch(tmp_path, README_LOOP, *args, python=python).check()
    assert saved and again.result["start"] == max(saved) > 0, (saved, again.text)
    assert again.result["finite"] is True


def test_the_main_job_runs_as_scripts_demo_submits_it(python, tmp_path):
    # scripts/demo's command, at 2 ranks rather than 4 (each costs its torch import), with its
    # own state and logs here.
    state = tmp_path / "state"
    r = subprocess.run([str(Path(python).parent / "slurmddp"), "submit", "--local", "--follow",
                        "--nodes", "2", "--ntasks-per-node", "1", "--output",
                        str(tmp_path / "jobs"), str(EXAMPLES / "ddp_train.py"), "--steps", "20"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=runtime_env(XDG_STATE_HOME=str(state),
                                       XDG_CONFIG_HOME=str(state / "config")))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parameters identical on all ranks: True" in r.stdout, r.stdout
    (result,) = tagged_json(r.stdout, "RESULT ")
    assert result["world_size"] == 2 and result["finite"] is True


# Every example that needs torch alone runs in this venv in tests/test_examples.py (its
# `runtime_python`), where what each claims is checked. The others need the framework they
# show: users install it with them.
TORCH_ONLY = {"collectives_tour.py", "dp_vs_ddp.py", "grad_accumulation.py", "amp_gradscaler.py",
              "ddp_sampler_eval.py", "fsdp_sharded.py", "torchrun_tutorial.py"}
FRAMEWORK_EXAMPLES = {"accelerate_train.py", "hf_trainer.py", "lightning_train.py"}
ELSEWHERE = {"ddp_train.py": "the main job's, above",
             "resumable_train.py": "the cluster's tests; its snapshots' exchange: the README "
                                   "loop's, above",
             "lightning_or_accelerate.py": "below: it says neither is installed"}  # fmt: skip


def test_every_example_runs_in_this_venv_or_needs_a_framework():
    shipped = {p.name for p in EXAMPLES.glob("*.py")}
    assert shipped == TORCH_ONLY | FRAMEWORK_EXAMPLES | set(ELSEWHERE)
    source = (ROOT / "tests" / "test_examples.py").read_text()
    for name in TORCH_ONLY:
        test = source.split(f'"{name}"', 1)[0].rsplit("\ndef ", 1)[1]
        assert "runtime_python" in test.split("\n", 1)[0] + test, name


def test_lightning_or_accelerate_says_neither_is_installed(python, tmp_path):
    r = subprocess.run([python, str(EXAMPLES / "lightning_or_accelerate.py")], cwd=tmp_path,
                       env=runtime_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("neither Lightning nor Accelerate is installed")

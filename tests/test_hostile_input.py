"""Hostile input through the real command line: values reach the program verbatim and run nothing
but the setup lines; checkpoints live anywhere; files follow the umask and stay where they belong.

Elsewhere: the rendered script executed with hostile JobSpec values
(tests/batch/script/test_sbatch.py), user templates sandboxed and strict, crafted checkpoints
refused (tests/test_bad_input.py, tests/checkpoint/test_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from slurmddp import Checkpointer
from tests.batch.script.test_sbatch import RECORDER, one_line, stand_ins, text
from tests.conftest import launcher_free_env, umask

HOSTILE_DIR = "dir $(touch pwned) 'q' \"d\" `id` ;x 日本"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    """bin/ with srun and scontrol stand-ins, and a recording 'python' in a hostile directory."""
    root = tmp_path_factory.mktemp("fakes")
    stand_ins(root)
    (root / HOSTILE_DIR).mkdir()
    (root / HOSTILE_DIR / "python").write_text(RECORDER.format(python=sys.executable))
    (root / HOSTILE_DIR / "python").chmod(0o755)
    return root


def file_name(*, newlines: bool) -> st.SearchStrategy[str]:
    # Any name a file can have (an output directory's is on an #SBATCH line: one line).
    names = text(newlines=True) if newlines else one_line()
    return names.filter(lambda s: s not in ("", ".", "..") and "/" not in s
                        and len(s.encode()) < 200)  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=file_name(newlines=True),
    args=st.lists(text(newlines=True), max_size=4),
    env=st.dictionaries(st.sampled_from(["SDDP_A", "SDDP_B"]), text(newlines=True), max_size=2),
    job_name=one_line(),
    # Slurm's filename patterns (%j) are refused in --output, in one line (test_options.py).
    output=file_name(newlines=False).filter(lambda s: "\\" not in s and "%" not in s),
)
@pytest.mark.ranks
def test_command_line_values_reach_the_program_verbatim(fakes, script, args, env, job_name,
                                                        output):  # fmt: skip
    """`slurmddp template` from argv and a profile, then the script run with stand-ins: only the
    setup lines run; the script path, its arguments and the environment values arrive intact."""
    assume(output != script)
    with tempfile.TemporaryDirectory(dir=fakes) as work_dir:
        work = Path(work_dir)
        (work / HOSTILE_DIR).mkdir()
        target = work / HOSTILE_DIR / script
        target.write_text("")
        (work / "slurmddp.toml").write_text('setup = ["export FROM_PROFILE=\\"$(echo yes)\\""]\n')
        out = work / HOSTILE_DIR / output
        argv = [
            "template", "-o", "job.sh", "--job-name", job_name, "--output", str(out),
            "--python", str(fakes / HOSTILE_DIR / "python"),
            "--setup", "export FROM_SETUP=$(echo ran)",
            *[f"--env={k}={v}" for k, v in env.items()], str(target), *args,
        ]  # fmt: skip
        clean = launcher_free_env(HOME=str(work), XDG_CONFIG_HOME=str(work / "config"))
        clean.pop("SLURMDDP_PROFILES", None)
        r = subprocess.run([sys.executable, "-m", "slurmddp", *argv], cwd=work, env=clean,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        run_env = {"PATH": f"{fakes / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
                   "SLURM_JOB_NODELIST": "n1", "RECORD": str(work / "record.json"),
                   "SRUN_RECORD": str(work / "srun.argv")}  # fmt: skip
        r = subprocess.run(["bash", "job.sh"], cwd=work, env=run_env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr

        record = json.loads((work / "record.json").read_text(encoding="utf-8"))
        assert record["argv"] == ["-m", "slurmddp.run", str(target), *args]
        assert {k: record["env"][k] for k in env} == env
        assert (record["env"]["FROM_SETUP"], record["env"]["FROM_PROFILE"]) == ("ran", "yes")
        assert (out / "4242").is_dir()
        assert not list(fakes.rglob("pwned")), "an injected command ran"


def test_checkpoints_live_in_a_directory_with_any_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / HOSTILE_DIR / "ck\n2"
    ckpt = Checkpointer(directory)
    ckpt.save(1, {"w": torch.ones(3)})
    ckpt.save(2, {"w": torch.full((3,), 2.0)})
    loaded = Checkpointer(directory).load_latest()
    assert loaded is not None and loaded.step == 2 and loaded.path.parent == directory
    assert torch.equal(loaded.state["w"], torch.full((3,), 2.0))
    assert not list(tmp_path.rglob("pwned"))


# --- what is written, where, with which modes --------------------------------------------------

FAKE_SBATCH = '#!/bin/bash\necho "Submitted batch job 4242"\n'
# A rank's work as the README shows it: a checkpoint, then done (one rank: one writer).
SAVE = """\
import sys
import torch
import slurmddp

slurmddp.Checkpointer(sys.argv[1]).save(1, {"w": torch.ones(4)})
slurmddp.mark_done()
"""


def entries(root: Path) -> dict[Path, int]:
    """Every path under `root` (not following links) and its mode."""
    return {p: p.lstat().st_mode for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("mask", [0o027, 0o077])
@pytest.mark.ranks
def test_submit_and_checkpoints_follow_the_umask_and_write_only_their_directories(tmp_path,
                                                                                 mask):  # fmt: skip
    """A submission to Slurm (stand-in sbatch) and a --local job that saves a checkpoint, with
    HOME, the XDG directories and TMPDIR under one root: what appears there is the job
    directory, the checkpoint directory and the job registry, each within the umask and never
    world-writable."""
    home, work, tmp, bin_dir = (tmp_path / name for name in ("home", "work", "tmp", "bin"))
    for path in (home, work, tmp, bin_dir):
        path.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    (work / "save.py").write_text(SAVE)
    env = launcher_free_env(
        HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
        XDG_STATE_HOME=str(home / ".local/state"), XDG_DATA_HOME=str(home / ".local/share"),
        TMPDIR=str(tmp), PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONDONTWRITEBYTECODE="1",
    )  # fmt: skip
    env.pop("SLURMDDP_PROFILES", None)
    before = entries(tmp_path)
    with umask(mask):
        for argv in (["--nodes", "2", "save.py", str(work / "ck")],
                     ["--local", "--follow", "save.py", str(work / "ck")]):  # fmt: skip
            r = subprocess.run([sys.executable, "-m", "slurmddp", "submit", *argv], cwd=work,
                               env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
            assert r.returncode == 0, r.stdout + r.stderr
    created = {p: mode for p, mode in entries(tmp_path).items() if p not in before}

    allowed = (work / "slurmddp-jobs", work / "ck", home / ".local/state/slurmddp")
    outside = [p for p in created if not any(p == a or a in p.parents or p in a.parents
                                             for a in allowed)]  # fmt: skip
    assert not outside, "written outside the job, checkpoint and state directories"
    assert (work / "ck" / "latest").is_file()
    assert (home / ".local/state/slurmddp/jobs.jsonl").is_file()
    for path, mode in created.items():
        if stat.S_ISLNK(mode):
            continue  # a link's own mode means nothing
        assert not mode & mask, f"{path} is {oct(mode)} under umask {oct(mask)}"
        assert not mode & 0o002, f"{path} is world-writable"

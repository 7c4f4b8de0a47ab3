"""`python -m slurmddp.run` as a user runs it: a real subprocess, a fake Slurm step environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fake_env import srun_env

SHOW = textwrap.dedent(
    """
    import json, os, sys
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURMDDP_RUN_ID"]
    print(json.dumps({"env": {n: os.environ.get(n) for n in names}, "argv": sys.argv,
                      "name": __name__, "torch_imported": "torch" in sys.modules,
                      "path0": sys.path[0]}))
    """
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher variable, plus `extra`."""
    drop = ("SLURM", "OMPI_", "PMI", "MV2_", "TORCHELASTIC", "MPI_LOCAL")
    keep = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_RANK"):  # fmt: skip
        keep.pop(k, None)
    return keep | extra


def run(args: list[str], env: dict[str, str], cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "slurmddp.run", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def show(tmp_path: Path) -> Path:
    p = tmp_path / "show.py"
    p.write_text(SHOW)
    return p


def test_exports_torchrun_names_and_runs_the_script_as_main(show):
    r = run([str(show), "--lr", "0.1"], clean_env(**srun_env(3, [2, 2], nodes=["a1", "a2"])))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["env"] == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "a1",
        "MASTER_PORT": out["env"]["MASTER_PORT"], "SLURMDDP_RUN_ID": "4242",
    }  # fmt: skip
    assert out["argv"] == [str(show), "--lr", "0.1"]
    assert out["name"] == "__main__"
    assert out["path0"] == str(show.parent)
    assert out["torch_imported"] is False, "the runner must not import torch for the script"


@pytest.mark.parametrize(("extra", "expected"), [
    ({"SLURM_CLUSTER_NAME": "linux", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3",
      "SLURM_RESTART_COUNT": "2"}, "linux-40_3"),
    ({"SLURMDDP_RUN_ID": "exp 1"}, "exp-1"),  # the user's, sanitised for every child to see
])  # fmt: skip
def test_exports_the_run_id(show, extra, expected):
    r = run([str(show)], clean_env(**srun_env(0, [2]), **extra))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["SLURMDDP_RUN_ID"] == expected


def test_no_run_id_is_exported_without_one(show):
    mpirun = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
              "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}  # fmt: skip
    r = run([str(show)], clean_env(**mpirun))  # no Slurm, no torchrun: no run id
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["SLURMDDP_RUN_ID"] is None


THREADS = 'import os, torch; print(os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())\n'


@pytest.mark.parametrize(("extra", "expected"), [
    ({}, "1 1"),  # this machine's CPUs shared by the node's 2 (or more) ranks
    ({"SLURM_CPUS_PER_TASK": "2"}, "2 2"),  # what srun --cpus-per-task gave the task
    ({"OMP_NUM_THREADS": "2"}, "2 2"),  # the user's own setting stays
])  # fmt: skip
@pytest.mark.ranks
def test_each_rank_runs_the_threads_it_was_given(tmp_path, extra, expected):
    p = tmp_path / "threads.py"
    p.write_text(THREADS)
    tasks = [os.cpu_count() or 1, 1]  # as many ranks on this node as it has CPUs
    r = run([str(p)], clean_env(**srun_env(0, tasks), **extra))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


HOSTILE = ["a b", "it's", '"q"', "$(touch pwned)", "`id`", "x;y", "new\nline", "é✓", "", "--"]


def test_script_arguments_arrive_verbatim(show, tmp_path):
    r = run([str(show), *HOSTILE], clean_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"][1:] == HOSTILE
    assert not (tmp_path / "pwned").exists()


def test_module_form(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "train.py").write_text(SHOW)
    env = clean_env(PYTHONPATH=str(tmp_path), RANK="1", WORLD_SIZE="2", MASTER_ADDR="h")
    r = run(["-m", "mypkg.train", "--epochs", "2"], env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["name"] == "__main__"
    assert out["argv"][1:] == ["--epochs", "2"]
    assert out["env"]["RANK"] == "1"


@pytest.mark.parametrize(("body", "status"), [("raise SystemExit(7)", 7), ("pass", 0),
                                              ("raise ValueError('boom')", 1)])  # fmt: skip
def test_exit_status_is_the_scripts(tmp_path, body, status):
    p = tmp_path / "s.py"
    p.write_text(body + "\n")
    r = run([str(p)], clean_env())
    assert r.returncode == status
    if status == 1:
        assert "ValueError: boom" in r.stderr  # the user's own traceback is kept


# Bad input (a missing script, contradicting variables): tests/test_bad_input.py.


def test_a_stop_signal_that_is_no_signal_is_one_line_and_status_2(show):
    r = run([str(show)], clean_env(SLURMDDP_SIGNAL="USR9"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == ("python -m slurmddp.run: error: SLURMDDP_SIGNAL='USR9' is not a signal "
                        "name: use e.g. USR2\n")  # fmt: skip


def test_tag_output_prefixes_each_line(tmp_path):
    p = tmp_path / "p.py"
    p.write_text("import sys\nprint('one')\nprint('two')\nprint('err', file=sys.stderr)\n")
    r = run(["--tag-output", str(p)], clean_env(**srun_env(5, [4, 4])))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "[5/8] one\n[5/8] two\n"
    assert r.stderr == "[5/8] err\n"


def test_runner_options_before_the_script_only(show):
    # An option after SCRIPT is the script's even when the runner has one of that name.
    r = run([str(show), "--tag-output", "-m", "x"], clean_env())
    assert json.loads(r.stdout)["argv"][1:] == ["--tag-output", "-m", "x"]


def test_no_slurm_command_is_called_per_rank(show, tmp_path):
    """Bootstrap never calls scontrol (or any slurmctld client): decoys on PATH record calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("scontrol", "squeue", "sinfo", "sacct", "srun", "sbatch", "sstat"):
        decoy = bin_dir / tool
        decoy.write_text(f'#!/bin/sh\necho {tool} "$@" >> {calls}\nexit 1\n')
        decoy.chmod(0o755)
    env = clean_env(**srun_env(1, [2, 2])) | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = run(["--print-env", str(show)], env)
    assert r.returncode == 0, r.stderr
    assert not calls.exists(), calls.read_text()


def test_slurmddp_run_subcommand_is_the_same_runner(show):
    r = subprocess.run(
        [sys.executable, "-m", "slurmddp", "run", str(show), "x"],
        env=clean_env(RANK="0", WORLD_SIZE="1"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"][1:] == ["x"]


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"], ["run", "--help"], ["doctor"]])
def test_cli_never_imports_torch(argv):
    code = (
        "import sys\nfrom slurmddp.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert "TORCH False" in r.stdout, r.stdout + r.stderr


def test_a_torch_distributed_script_runs_atexit_and_flushes_before_its_fast_exit(tmp_path):
    p = tmp_path / "s.py"
    p.write_text(
        "import atexit, sys, torch.distributed\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "sys.stdout.write('no newline, still flushed')\n"
        "raise SystemExit(4)\n"
    )
    r = run([str(p)], clean_env())
    assert r.returncode == 4
    assert r.stdout == "no newline, still flushedatexit ran\n"


@pytest.mark.parametrize("torch_distributed", [False, True])
def test_a_stop_signal_as_the_script_ends_never_fails_the_rank(tmp_path, torch_distributed):
    # The time limit's warning, passed on by srun a little late, reaching a rank whose script is
    # over: by then its own handler is given up (a framework's teardown, Python's finalization).
    p = tmp_path / "s.py"
    p.write_text(
        f"import atexit, os, signal{', torch.distributed' if torch_distributed else ''}\n"
        "signal.signal(signal.SIGUSR2, lambda *a: None)\n"
        "signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # given up, as at teardown\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGUSR2))\n"
        "print('done', flush=True)\n"
    )
    r = run([str(p)], clean_env())
    assert (r.returncode, r.stdout) == (0, "done\n"), r.stderr


# --- a failing rank names itself (issue 7) -------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "line"),
    [
        ("raise ValueError('boom\\nsecond line')", 1, "failed: ValueError: boom second line"),
        ("raise SystemExit(3)", 3, "exited with status 3"),
        ("raise SystemExit('gave up')", 1, "exited with status 1"),
        ("raise SystemExit(75)", 75, None),  # stopped for good after a checkpoint: not a failure
        ("raise SystemExit(0)", 0, None),
    ],
)  # fmt: skip
def test_a_failing_script_names_its_rank_and_node_first(tmp_path, body, status, line):
    p = tmp_path / "s.py"
    p.write_text(body + "\n")
    failures = tmp_path / "failures"
    # srun_env sets SLURMD_NODENAME=a2 for rank 3: the node's name as Slurm knows it.
    env = clean_env(**srun_env(3, [2, 2], nodes=["a1", "a2"]),
                    SLURMDDP_FAILURE_FILE=str(failures))  # fmt: skip
    r = run([str(p)], env)
    assert r.returncode == status, r.stderr
    if line is None:
        assert "slurmddp: rank" not in r.stderr and not failures.exists()
        return
    said = f"slurmddp: rank 3 (host a2) {line}"
    assert said in r.stderr.splitlines(), r.stderr
    # The supervisor reads it, taking the lines of its own run (srun_env: restart 0) only.
    assert failures.read_text() == f"0\t{said}\n"
    if status == 1 and "ValueError" in line:  # then the traceback, as Python prints it
        assert r.stderr.index(said) < r.stderr.index("Traceback (most recent call last)")

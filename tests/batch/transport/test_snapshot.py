"""The code snapshot of ``slurmddp submit`` (slurmddp.batch.transport.snapshot): what it holds in
and out of git, its bounds, modes and links, and that a job runs the code as it was submitted."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmddp.batch.spec import config
from slurmddp.batch.spec.jobspec import build_spec
from slurmddp.batch.transport import snapshot, submission
from slurmddp.cli import build_parser
from slurmddp.cli.submit import split_target
from slurmddp.errors import SubmissionError
from tests.conftest import handed_plan, launcher_free_env, tagged_json, wait_until


def write(path: Path, text: str = "", mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mode is not None:
        path.chmod(mode)
    return path


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def spec_for(project: Path, *target: str, **kw):
    kw.setdefault("output_dir", str(project / "slurmddp-jobs"))
    return build_spec(list(target), cwd=str(project), **kw)


def take(spec, cwd: Path) -> snapshot.Taken:
    Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
    return snapshot.take(spec, cwd)


def tree(root: Path) -> dict[str, str]:
    """Every file and link under `root`: its content, or ``-> target`` for a link."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_text()
    return out


def slurmddp(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = launcher_free_env(XDG_STATE_HOME=str(cwd / "state"), XDG_CONFIG_HOME=str(cwd / "cfg"))
    env.pop("SLURMDDP_PROFILES", None)
    return subprocess.run([sys.executable, "-m", "slurmddp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git checkout: tracked, modified, untracked, ignored and deleted files."""
    root = tmp_path / "repo"
    write(root / "src" / "train.py", "import helper\n")
    write(root / "src" / "helper.py", "V = 'indexed'\n")
    write(root / "lib" / "util.py", "U = 1\n")
    write(root / "gone.py", "x\n")
    write(root / ".gitignore", "data/\n*.log\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    write(root / "src" / "helper.py", "V = 'work tree'\n")  # modified after git add
    (root / "gone.py").unlink()  # tracked, deleted
    write(root / "notes.py", "N = 1\n")  # untracked, not ignored
    write(root / "data" / "big.bin", "x" * 1000)  # ignored
    write(root / "run.log", "log\n")  # ignored
    write(root / "src" / "__pycache__" / "helper.cpython-311.pyc", "pyc")
    return root


def test_a_git_checkout_gives_its_files_as_the_work_tree_has_them(repo):
    spec = spec_for(repo, "src/train.py", "--lr", "0.1")
    write(repo / "slurmddp-jobs" / "1" / "rank-0.log", "an earlier job's log\n")
    taken = take(spec, repo)
    snap = Path(taken.spec.code_dir).parent
    assert snap.parent == repo / "slurmddp-jobs" / "snapshots"
    assert tree(snap) == {
        ".gitignore": "data/\n*.log\n",
        "lib/util.py": "U = 1\n",
        "notes.py": "N = 1\n",
        "src/helper.py": "V = 'work tree'\n",
        "src/train.py": "import helper\n",
    }
    # The whole work tree, so that code the script reaches from its checkout is there too; run
    # from the script's place in it.
    assert taken.spec.target == (str(snap / "src" / "train.py"), "--lr", "0.1")
    assert taken.spec.code_dir == str(snap / "src")
    assert taken.spec.job_name == "train"


def test_outside_git_the_scripts_directory_is_copied_whole(tmp_path):
    project = tmp_path / "project"
    write(project / "train.py", "print(1)\n")
    write(project / "models" / "net.py", "N = 1\n")
    write(project / ".hidden" / "conf.py", "C = 1\n")
    write(project / "cache" / "CACHEDIR.TAG", snapshot.CACHEDIR_SIGNATURE + "\n")
    write(project / "cache" / "blob", "cached\n")
    write(project / "__pycache__" / "train.cpython-311.pyc", "pyc")
    taken = take(spec_for(project, "train.py"), project)
    snap = Path(taken.spec.code_dir)
    assert tree(snap) == {".hidden/conf.py": "C = 1\n", "models/net.py": "N = 1\n",
                          "train.py": "print(1)\n"}  # fmt: skip
    assert taken.spec.target == (str(snap / "train.py"),)
    # The snapshots directory is a tagged cache: a later snapshot never holds an earlier one.
    write(project / "train.py", "print(2)\n")
    again = take(spec_for(project, "train.py", output_dir=str(project / "other-jobs")), project)
    assert "slurmddp-jobs" not in str(tree(Path(again.spec.code_dir)))


def test_the_same_code_gives_the_same_snapshot_and_other_code_another(tmp_path):
    project = tmp_path / "p"
    write(project / "train.py", "print(1)\n")
    first = take(spec_for(project, "train.py"), project)
    assert first.created  # the snapshot, and the snapshots directory it is in
    second = take(spec_for(project, "train.py"), project)
    assert second.spec.code_dir == first.spec.code_dir and second.created == ()
    write(project / "train.py", "print(2)\n")
    third = take(spec_for(project, "train.py"), project)
    assert third.spec.code_dir != first.spec.code_dir
    snapshots = project / "slurmddp-jobs" / "snapshots"
    assert not [p for p in snapshots.iterdir() if p.name.startswith(".tmp")]  # nothing half-done


def test_modes_are_kept_read_only_and_never_world_writable(tmp_path):
    old = os.umask(0)  # the most permissive umask: nothing may come out world-writable
    try:
        project = tmp_path / "p"
        write(project / "train.py", "print(1)\n", 0o666)
        write(project / "tool.sh", "#!/bin/sh\n", 0o777)
        write(project / "sub" / "x.py", "", 0o644)
        snap = Path(take(spec_for(project, "train.py"), project).spec.code_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE((snap / "train.py").stat().st_mode) == 0o444
    assert stat.S_IMODE((snap / "tool.sh").stat().st_mode) == 0o555
    for path in [snap, snap.parent, *snap.rglob("*")]:
        assert not path.stat().st_mode & stat.S_IWOTH, path
    old = os.umask(0o027)  # a stricter umask is kept
    try:
        write(project / "train.py", "print(2)\n")
        snap = Path(take(spec_for(project, "train.py"), project).spec.code_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE((snap / "train.py").stat().st_mode) == 0o440
    assert stat.S_IMODE((snap / "tool.sh").stat().st_mode) == 0o550


def test_links_stay_links_and_are_never_followed_out_of_the_tree(tmp_path):
    project, outside = tmp_path / "p", tmp_path / "outside"
    write(outside / "secret.txt", "not code\n")
    write(outside / "lots" / "f.bin", "x")
    write(project / "train.py", "print(1)\n")
    write(project / "pkg" / "mod.py", "M = 1\n")
    (project / "rel_link.py").symlink_to("pkg/mod.py")  # into the tree, relative
    (project / "pkg" / "abs_link.py").symlink_to(project / "train.py")  # into the tree, absolute
    (project / "data").symlink_to(outside / "lots")  # a directory out of the tree
    (project / "secret.txt").symlink_to("../outside/secret.txt")  # out of the tree, relative
    (project / "dangling").symlink_to(tmp_path / "nothing")
    write(project / ".venv" / "pyvenv.cfg", "home = /usr/bin\n")  # an environment: left out
    write(project / ".venv" / "lib" / "site.py")
    (project / "py").symlink_to(".venv/lib/site.py")  # at something left out: where it was
    (project / "hidden_link").symlink_to(".hidden/h.py")
    write(project / ".hidden" / "h.py", "H = 1\n")
    snap = Path(take(spec_for(project, "train.py"), project).spec.code_dir)
    assert os.readlink(snap / "rel_link.py") == "pkg/mod.py"
    assert os.readlink(snap / "pkg" / "abs_link.py") == "../train.py"  # into the snapshot
    assert (snap / "pkg" / "abs_link.py").read_text() == "print(1)\n"
    assert os.readlink(snap / "data") == str(outside / "lots")  # where it pointed
    assert os.readlink(snap / "secret.txt") == str(outside / "secret.txt")
    assert os.readlink(snap / "dangling") == str(tmp_path / "nothing")
    assert os.readlink(snap / "py") == str(project / ".venv" / "lib" / "site.py")
    assert os.readlink(snap / "hidden_link") == ".hidden/h.py"
    real = {p.relative_to(snap).as_posix() for p in snap.rglob("*") if not p.is_symlink()}
    # Nothing from outside was copied, nor the environment.
    assert real == {"train.py", "pkg", "pkg/mod.py", ".hidden", ".hidden/h.py"}


@pytest.mark.parametrize(("bound", "says"), [
    ({"snapshot_max_files": 2}, "would hold more than 2 files (the largest: a.py 1 file, "
                                "data.bin 1 file, train.py 1 file): move what is not code (data, "
                                "environments) out of it, raise --snapshot-max-files, or submit "
                                "with --no-snapshot"),
    ({"snapshot_max_mib": 1}, "would be larger than 1 MiB (the largest: data.bin 1.0 MiB, a.py "
                              "0 B): move what is not code (data, environments) out of it, raise "
                              "--snapshot-max-mib, or submit with --no-snapshot"),
])  # fmt: skip
def test_a_snapshot_over_its_bounds_is_refused_and_leaves_nothing(tmp_path, bound, says):
    project = tmp_path / "p"
    write(project / "train.py")
    write(project / "a.py")
    write(project / "data.bin", "x" * (1024 * 1024 + 1))
    spec = spec_for(project, "train.py", **bound)
    with pytest.raises(snapshot.SnapshotError) as info:
        take(spec, project)
    assert str(info.value) == f"the snapshot of the code in {str(project)!r} {says}"
    assert not (project / "slurmddp-jobs" / "snapshots").exists()


def test_in_a_checkout_the_bound_says_gitignore(repo):
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.plan(spec_for(repo, "src/train.py", snapshot_max_files=3), repo)
    assert re.search(r"would hold more than 3 files \(the largest: [^)]+ 1 file\): list what is "
                     r"not code in its \.gitignore, raise --snapshot-max-files, or submit with "
                     r"--no-snapshot$", str(info.value))  # fmt: skip


def checkpoints(directory: Path, step: int = 1, size: int = 10) -> Path:
    """A Checkpointer's directory as it lays it out (slurmddp.checkpoint.layout)."""
    name = f"step-{step:08d}"
    write(directory / name / "state.pt", "x" * size)
    write(directory / name / "manifest.json", json.dumps({"format": 2, "step": step}))
    write(directory / "latest", name + "\n")
    return directory


@pytest.mark.parametrize("in_git", [False, True])
def test_checkpoint_directories_stay_out_of_the_snapshot(tmp_path, in_git):
    # Issue 44: checkpoints/ beside train.py went into the next job's snapshot, over its bound.
    project = tmp_path / "p"
    write(project / "train.py", "print(1)\n")
    checkpoints(project / "checkpoints", size=2 * 1024 * 1024)
    checkpoints(project / "runs" / "a" / "ckpt", step=3)
    write(project / "runs" / "notes.py")
    write(project / "docs" / "latest", "step-00000001\n")  # names no checkpoint: code, kept
    write(project / "docs" / "step-00000001" / "index.md")
    if in_git:
        git(project, "init", "-q")
        git(project, "add", "train.py")  # the rest untracked, not ignored
    p = snapshot.plan(spec_for(project, "train.py", snapshot_max_mib=1), project)
    assert [e.rel for e in p.entries] == ["docs/latest", "docs/step-00000001/index.md",
                                          "runs/notes.py", "train.py"]  # fmt: skip


def test_over_the_bound_the_largest_entries_are_named(tmp_path):
    project = tmp_path / "p"
    write(project / "train.py", "print(1)\n")
    write(project / "data" / "a.bin", "x" * (3 * 1024 * 1024))
    write(project / "data" / "b.bin", "x" * (1024 * 1024))
    write(project / "weights.pt", "x" * (2 * 1024 * 1024 + 512 * 1024))
    write(project / "z.py", "x" * 2048)
    with pytest.raises(snapshot.SnapshotError) as info:
        snapshot.plan(spec_for(project, "train.py", snapshot_max_mib=6), project)
    assert "would be larger than 6 MiB (the largest: data/ 4.0 MiB, weights.pt 2.5 MiB, z.py " \
           "2.0 KiB):" in str(info.value)  # fmt: skip


def test_too_big_is_one_line_and_nothing_is_submitted(tmp_path):
    write(tmp_path / "train.py", "print('ran')\n")
    write(tmp_path / "other.py")
    r = slurmddp("submit", "--local", "--snapshot-max-files", "1", "train.py", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("slurmddp submit: error: the snapshot of the code in ")
    assert r.stderr.count("\n") == 1 and r.stdout == ""
    assert not (tmp_path / "slurmddp-jobs").exists()
    assert slurmddp("status", cwd=tmp_path).stdout.count("\n") <= 1  # no job in the registry
    # Opting out submits it.
    r = slurmddp("submit", "--local", "--follow", "--snapshot-max-files", "1", "--no-snapshot",
                 "train.py", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and "ran" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "slurmddp-jobs" / "snapshots").exists()


def test_a_failed_submission_takes_its_snapshot_away(tmp_path, monkeypatch):
    write(tmp_path / "train.py")
    monkeypatch.chdir(tmp_path)  # the Python API finds the script as the job will: from here

    def refused(ctx, script, signal_after):
        assert Path(ctx.spec.code_dir).is_dir()  # taken before the job is submitted
        raise SubmissionError("sbatch refused the job: no")

    monkeypatch.setattr(submission, "_submit_local", refused)
    with pytest.raises(SubmissionError):
        submission.submit(spec_for(tmp_path, "train.py"), local=True)
    assert not (tmp_path / "slurmddp-jobs").exists()


def test_dry_run_names_the_snapshot_submit_takes_and_writes_nothing(tmp_path):
    write(tmp_path / "train.py", "print(1)\n")
    dry = slurmddp("submit", "--dry-run", "train.py", "--x", "it's", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert not (tmp_path / "slurmddp-jobs").exists()
    planned = snapshot.preview(spec_for(tmp_path, "train.py"), tmp_path)
    taken = take(spec_for(tmp_path, "train.py"), tmp_path)
    assert planned == taken.spec
    assert f"export SLURMDDP_CODE_DIR={taken.spec.code_dir}\n" in dry.stdout
    assert handed_plan(dry.stdout).target == (taken.spec.target[0], "--x", "it's")
    # The script `template` writes is rendered only: it runs the files as they are then.
    template = slurmddp("template", "train.py", "--x", "it's", cwd=tmp_path).stdout
    off = slurmddp("submit", "--dry-run", "--no-snapshot", "train.py", "--x", "it's", cwd=tmp_path)
    assert template == off.stdout
    assert "(no snapshot of it was taken)" in template and "SLURMDDP_CODE_DIR" not in template
    assert handed_plan(template).target == ("train.py", "--x", "it's")


def test_snapshot_is_an_option_of_the_files_and_of_the_command_line(tmp_path):
    settings = config.resolve_settings({}, None, config.ConfigFiles(tmp_path))
    assert settings["snapshot"] is True
    parsed = config.parse_config("snapshot = false\nsnapshot_max_mib = 200\n",
                                 tmp_path / "slurmddp.toml", "project")  # fmt: skip
    assert dict(parsed.options) == {"snapshot": False, "snapshot_max_mib": 200}
    with pytest.raises(config.ConfigError, match='snapshot = "no" must be true or false'):
        config.parse_config('snapshot = "no"\n', tmp_path / "slurmddp.toml", "project")
    # A flag without a value: the script after it is the script.
    assert split_target(["--no-snapshot", "t.py", "--no-snapshot"], command="submit") == (
        ["--no-snapshot"], ["t.py", "--no-snapshot"])  # fmt: skip
    assert split_target(["--snapshot", "t.py"], command="submit") == (["--snapshot"], ["t.py"])
    parser = build_parser()[1]["submit"]
    assert parser.parse_args(["--no-snapshot"]).snapshot is False
    assert parser.parse_args([]).snapshot is None  # not typed: the files decide
    assert build_spec(["t.py"], cwd="/x", snapshot=False).snapshot is False


# --- jobs that run the code as it was submitted ------------------------------------------------

PROGRAM = """\
import json, os, time
deadline = time.time() + 60
while not os.path.exists({go!r}) and time.time() < deadline:  # until the test has edited us
    time.sleep(0.1)
import helper
seen = {{"script": "submitted", "helper": helper.V, "file": __file__, "cwd": os.getcwd()}}
print("RESULT", json.dumps(seen), flush=True)
"""


@pytest.mark.parametrize("target", [["train.py"], ["-m", "pkg.train"]])
@pytest.mark.parametrize("snapshotted", [True, False])
@pytest.mark.ranks
def test_a_local_job_runs_the_code_as_it_was_submitted(tmp_path, target, snapshotted):
    go = tmp_path / "go"
    script = tmp_path / ("pkg/train.py" if target[0] == "-m" else "train.py")
    write(script, PROGRAM.format(go=str(go)))
    write(tmp_path / "helper.py", "V = 'submitted'\n")
    argv = ["submit", "--local", "--json", *([] if snapshotted else ["--no-snapshot"]), *target]
    # Not a pipe: the local job started in the background keeps it open until it ends.
    with open(tmp_path / "submit.out", "w+") as out:
        env = launcher_free_env(XDG_STATE_HOME=str(tmp_path / "state"))
        r = subprocess.run([sys.executable, "-m", "slurmddp", *argv], cwd=tmp_path, stdout=out,
                           stderr=subprocess.STDOUT, env=env, timeout=120)  # fmt: skip
        out.seek(0)
        said = out.read()
    assert r.returncode == 0, said
    job = json.loads(said.splitlines()[0])
    # Edited while the job runs, before it has imported its module.
    write(script, PROGRAM.format(go=str(go)).replace('"submitted"', '"edited"'))
    write(tmp_path / "helper.py", "V = 'edited'\n")
    go.touch()
    log = Path(job["logs"].replace("<rank>", "0"))
    deadline = time.time() + 90
    while time.time() < deadline and "RESULT" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    result = json.loads(log.read_text().split("RESULT ", 1)[1].splitlines()[0])
    assert result["cwd"] == str(tmp_path)  # the user's working directory, snapshot or not
    if snapshotted:
        assert result["script"] == "submitted" and result["helper"] == "submitted"
        assert "/slurmddp-jobs/snapshots/" in result["file"]
    else:  # the control: the files as they are (the script may have been read before the edit)
        assert result["helper"] == "edited"


def test_runner_imports_a_module_from_the_code_directory_first(tmp_path):
    code, here = tmp_path / "code", tmp_path / "here"
    write(code / "mod.py", "print('from the snapshot')\n")
    write(here / "mod.py", "print('from the working directory')\n")
    env = launcher_free_env(SLURMDDP_CODE_DIR=str(code))
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", "-m", "mod"], cwd=here, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.stdout == "from the snapshot\n", r.stderr
    del env["SLURMDDP_CODE_DIR"]
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", "-m", "mod"], cwd=here, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.stdout == "from the working directory\n", r.stderr


def test_a_module_not_under_the_working_directory_is_not_snapshotted(tmp_path, capsys):
    spec = spec_for(tmp_path, "-m", "json.tool")
    taken = take(spec, tmp_path)
    assert taken.spec == spec and taken.created == ()
    assert "-m json.tool is not under the working directory" in capsys.readouterr().err


def test_a_requeued_local_run_runs_the_same_snapshot(tmp_path):
    from tests.batch.transport.test_submit_cluster import write_code  # the cluster test's program

    write_code(tmp_path, "submitted")
    go = tmp_path / "go"
    with open(tmp_path / "submit.out", "w+") as out:  # not a pipe: see above
        env = launcher_free_env(XDG_STATE_HOME=str(tmp_path / "state"))
        r = subprocess.run([sys.executable, "-m", "slurmddp", "submit", "--local", "--json",
                            "train.py", str(go)], cwd=tmp_path, stdout=out,
                           stderr=subprocess.STDOUT, env=env, timeout=120)  # fmt: skip
        out.seek(0)
        said = out.read()
    assert r.returncode == 0, said
    log = Path(json.loads(said.splitlines()[0])["logs"].replace("<rank>", "0"))

    def results() -> list[dict]:
        return tagged_json(log.read_text(), "RESULT ") if log.exists() else []

    wait_until(lambda: results(), 90, "the first run's line")
    write_code(tmp_path, "edited before the requeue")
    go.touch()
    wait_until(lambda: len(results()) >= 2, 90, "the requeued run's line")
    first, second = results()[:2]
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["file"] == second["file"] and "/snapshots/" in first["file"]
    assert {run["script"] for run in (first, second)} == {"submitted"}
    assert {run["helper"] for run in (first, second)} == {"submitted"}

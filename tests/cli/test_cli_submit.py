"""`slurmddp submit` and `slurmddp template` as a user types them: bad input, dry runs, --local."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmddp.cli.submit import split_target
from tests.conftest import ROOT, handed_plan, handed_step, launcher_free_env, tagged_json

TRAIN = str(ROOT / "examples" / "ddp_train.py")


def slurmddp(*args: str, cwd: Path, state: Path, timeout: float = 120):
    env = launcher_free_env(XDG_STATE_HOME=str(state), XDG_CONFIG_HOME=str(state / "config"))
    env.pop("SLURMDDP_PROFILES", None)
    return subprocess.run([sys.executable, "-m", "slurmddp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


# Bad input (options, profiles, templates): tests/test_bad_input.py.


def test_dry_run_prints_a_valid_script_and_submits_nothing(tmp_path):
    r = slurmddp("submit", "--dry-run", "--nodes", "2", "--ntasks-per-node", "2", TRAIN,
                 "--lr", "it's $(x)", cwd=tmp_path, state=tmp_path / "state")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash\n")
    assert "#SBATCH --nodes=2" in r.stdout
    assert """"--lr","it'"'"'s $(x)"]""" in r.stdout  # in the plan the supervisor runs
    assert subprocess.run(["bash", "-n"], input=r.stdout, text=True).returncode == 0
    assert not (tmp_path / "state" / "slurmddp").exists()


def test_template_writes_the_same_script_as_a_file(tmp_path):
    state = tmp_path / "state"
    # (--dry-run alone names the code snapshot submit would take:
    # tests/batch/transport/test_snapshot.py)
    dry = slurmddp("submit", "--dry-run", "--no-snapshot", TRAIN, cwd=tmp_path, state=state).stdout
    r = slurmddp("template", "-o", "job.sh", TRAIN, cwd=tmp_path, state=state)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "job.sh").read_text() == dry
    assert (tmp_path / "job.sh").stat().st_mode & 0o100


def test_profiles_come_from_the_project_file(tmp_path):
    (tmp_path / "slurmddp.toml").write_text(
        'profile = "site"\n[profiles.site]\npartition = "gpu"\nsetup = ["module load torch"]\n'
    )
    state = tmp_path / "state"
    listed = slurmddp("profiles", "--profile", "site", cwd=tmp_path, state=state)
    assert listed.returncode == 0, listed.stderr
    assert "site" in listed.stdout and "partition" in listed.stdout
    as_json = json.loads(slurmddp("profiles", "--profile", "site", "--json", cwd=tmp_path,
                                  state=state).stdout)  # fmt: skip
    assert as_json["profiles"] == [{"name": "site", "file": str(tmp_path / "slurmddp.toml"),
                                    "extends": None, "hidden_by": None,
                                    "values": {"partition": "gpu",
                                               "setup": ["module load torch"]}}]  # fmt: skip
    assert {"key": "partition", "value": '"gpu"', "source": f"profile 'site' "
            f"({tmp_path / 'slurmddp.toml'})"} in as_json["settings"]  # fmt: skip
    dry = slurmddp("submit", "--dry-run", TRAIN, cwd=tmp_path, state=state).stdout
    assert "#SBATCH --partition=gpu" in dry
    assert "\nmodule load torch\n" in dry
    typed = slurmddp("submit", "--dry-run", "--partition", "cpu", TRAIN, cwd=tmp_path,
                     state=state).stdout  # fmt: skip
    assert "#SBATCH --partition=cpu" in typed  # the command line beats the profile


@pytest.mark.parametrize(
    ("argv", "own", "rest"),
    [
        (["--nodes", "2", "t.py", "--nodes", "3"], ["--nodes=2"], ["t.py", "--nodes", "3"]),
        (["--dry-run", "-m", "pkg.train", "--x"], ["--dry-run", "-m", "pkg.train"], ["--x"]),
        (["--sbatch-arg", "--exclusive", "t.py"], ["--sbatch-arg=--exclusive"], ["t.py"]),
        (["--env=A=1", "t.py"], ["--env=A=1"], ["t.py"]),
        (["--", "-weird.py"], [], ["-weird.py"]),
        (["-N", "2", "t.py", "-N", "3"], ["-N=2"], ["t.py", "-N", "3"]),
        (["-t", "-5", "-J", "--x", "t.py"], ["-t=-5", "-J=--x"], ["t.py"]),
    ],
)
def test_arguments_after_the_script_are_the_scripts(argv, own, rest):
    assert split_target(argv, command="submit") == (own, rest)


@pytest.mark.parametrize("argv", [["--help"], ["submit", "--help"], ["submit", "--dry-run", TRAIN]])
def test_submit_path_never_imports_torch(argv, tmp_path):
    code = (
        "import sys\nfrom slurmddp.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env=launcher_free_env(XDG_STATE_HOME=str(tmp_path)))  # fmt: skip
    assert "TORCH False" in r.stderr, r.stderr


@pytest.mark.ranks
def test_local_runs_the_training_and_status_reports_it(tmp_path):
    state = tmp_path / "state"
    # 2 nodes x 1 rank, half the rank processes of 2 x 2: rank 1 logs from the second node as
    # rank 3 did; the log patterns of other shapes are test_emulation.py's (output_path).
    argv = ["--local", "--follow", "--json", "--nodes", "2", "--ntasks-per-node", "1", TRAIN]
    r = slurmddp("submit", *argv, "--steps", "4", cwd=tmp_path, state=state)
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first["engine"] == "local"
    assert "[slurmddp] job" in r.stdout and "COMPLETED" in r.stdout
    logs = [Path(first["logs"].replace("<rank>", str(rank))).read_text() for rank in range(2)]
    results = [x for text in logs for x in tagged_json(text, "RESULT ")]
    assert sorted(x["rank"] for x in results) == [0, 1]
    assert len({x["digest"] for x in results}) == 1
    status = slurmddp("status", first["job_id"], cwd=tmp_path, state=state)
    assert "COMPLETED" in status.stdout
    logs = slurmddp("logs", first["job_id"], "--rank", "1", cwd=tmp_path, state=state)
    assert '"rank": 1' in logs.stdout


def test_python_api_returns_the_jobs_record_as_its_handle(tmp_path, monkeypatch):
    import slurmddp
    from slurmddp.batch import jobs

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    spec = slurmddp.build_spec([str(script)], nodes=1, ntasks_per_node=2,
                               output_dir=str(tmp_path / "jobs"))  # fmt: skip
    job = slurmddp.submit(spec, local=True)
    assert job == jobs.find(job.job_id)  # what the registry keeps, not a handle of submitit's
    assert job.wait(timeout=60) == "COMPLETED" and job.done() and job.state == "COMPLETED"
    # Where a Slurm job's ranks log: a local job runs the same batch script.
    assert [job.log(rank).read_text() for rank in (0, 1)] == ["hello from 0\n", "hello from 1\n"]


@pytest.mark.parametrize("sig", ["USR2", "USR1"])
@pytest.mark.ranks
def test_local_delivers_the_stop_signal_after_the_given_steps(tmp_path, sig):
    # The rehearsal counts from training's first step (slurmddp.preemption.rehearsal): rank 0
    # sends the signal at its 5th should_stop() to the emulated batch job, which hands it to the
    # batch script, the supervisor, srun's stand-in and each rank, as Slurm's would go. The
    # ranks agree to stop at the same call, from step 5 on, on the chosen signal.
    script = tmp_path / "steps.py"
    script.write_text(
        "import time, slurmddp\n"
        "from slurmddp.preemption.api import received\n"
        "for step in range(1, 3001):\n"
        "    time.sleep(0.01)\n"
        "    if slurmddp.should_stop():\n"
        "        print('stopped at', step, received().name, flush=True)\n"
        "        break\n"
        "slurmddp.mark_done()\n"
    )
    argv = ["--local", "--follow", "--json", "--local-signal-after", "5steps", "--signal", sig]
    r = slurmddp("submit", *argv, str(script), cwd=tmp_path, state=tmp_path / "state")
    assert r.returncode == 0, r.stdout + r.stderr
    step, name = re.search(r"stopped at (\d+) (\w+)", r.stdout).groups()
    assert name == f"SIG{sig}" and 5 <= int(step) < 3000, r.stdout
    assert f"stop requested ({sig} received)" in r.stdout


@pytest.mark.ranks
def test_local_time_limit_warns_with_the_chosen_signal(tmp_path):
    # submitit's controller sends it signal_lead before its time-out, as Slurm does.
    script = tmp_path / "wait.py"
    # Short sleeps: the handler runs in the main thread, which a long C call would hold.
    script.write_text(
        "import signal, time\n"
        "start = time.monotonic()\n"
        "signal.signal(signal.SIGUSR1, lambda *a: print(f'USR1 after "
        "{time.monotonic() - start:.0f} s', flush=True) or exit(0))\n"
        "while time.monotonic() - start < 60: time.sleep(0.1)\n"
    )
    argv = ["--local", "--follow", "--time", "1", "--signal-lead", "40", "--signal", "USR1"]
    r = slurmddp("submit", *argv, str(script), cwd=tmp_path, state=tmp_path / "state")
    assert r.returncode == 0, r.stdout + r.stderr
    after = int(re.search(r"USR1 after (\d+) s", r.stdout)[1])
    # 60 - 40 s into the job, which the script's clock starts a moment after: the margins (10 s
    # each way) tell a signal at the lead from one at the start or at the limit, whatever the
    # machine's load does to the script's start.
    assert 10 <= after <= 30, r.stdout


def test_a_user_template_renders_with_the_same_variables_and_filters(tmp_path):
    # Its errors (syntax, undefined names, the sandbox): tests/test_bad_input.py.
    (tmp_path / "mytemplate.j2").write_text(
        "#!/bin/bash\n#SBATCH --job-name={{ job_name | directive }}\necho {{ python | sh }}\n"
    )
    r = slurmddp("submit", "--dry-run", "--template", "mytemplate.j2", TRAIN, cwd=tmp_path,
                 state=tmp_path / "state")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --job-name=ddp_train" in r.stdout


def test_the_etcd_rendezvous_reaches_torchrun_from_the_command_line_or_a_profile(tmp_path):
    state = tmp_path / "state"
    r = slurmddp("template", "--launcher", "torchrun", "--rdzv-backend", "etcd-v2",
                 "--rdzv-endpoint", "etcd.hpc:2379", TRAIN, cwd=tmp_path, state=state)  # fmt: skip
    assert r.returncode == 0, r.stderr
    step = handed_step(r.stdout, SLURM_JOB_NODELIST="")  # the first node is no part of it
    assert "--rdzv-backend=etcd-v2" in step and "--rdzv-endpoint=etcd.hpc:2379" in step
    (tmp_path / "slurmddp.toml").write_text(
        'launcher = "torchrun"\nrdzv_backend = "etcd-v2"\nrdzv_endpoint = "etcd.hpc:2379"\n')
    r = slurmddp("template", TRAIN, cwd=tmp_path, state=state)
    assert "--rdzv-endpoint=etcd.hpc:2379" in handed_step(r.stdout), r.stderr
    r = slurmddp("template", "--rdzv-endpoint", "", TRAIN, cwd=tmp_path, state=state)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    # The default stays torchrun's c10d store on the first node.
    r = slurmddp("template", "--launcher", "torchrun", TRAIN, cwd=tmp_path / "..", state=state)
    assert "--rdzv-endpoint=n1" in handed_step(r.stdout), r.stderr


def test_max_restarts_reaches_torchrun_from_the_command_line_or_a_profile(tmp_path):
    state = tmp_path / "state"
    r = slurmddp("template", "--launcher", "torchrun", "--max-restarts", "2", TRAIN, cwd=tmp_path,
                 state=state)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--max-restarts=2" in handed_step(r.stdout)
    (tmp_path / "slurmddp.toml").write_text('launcher = "torchrun"\nmax_restarts = 3\n')
    r = slurmddp("template", TRAIN, cwd=tmp_path, state=state)
    assert "--max-restarts=3" in handed_step(r.stdout)
    # srun does not restart ranks: refused before anything is queued.
    r = slurmddp("template", "--launcher", "srun", "--max-restarts", "1", TRAIN, cwd=tmp_path,
                 state=state)  # fmt: skip
    assert r.returncode == 2
    assert "max_restarts=1 needs launcher torchrun" in r.stderr


# ---- sbatch's names (issue 44): each means what it means in sbatch, or is refused ----------------


def in_process(argv: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[object, str, str]:
    """``slurmddp ARGV`` run here, in `tmp_path` with a train.py: (status, stdout, stderr)."""
    from slurmddp.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("SLURMDDP_PROFILES", raising=False)
    (tmp_path / "train.py").write_text("print('hi')\n")
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


SHORT = [  # sbatch's short options, as users type them by habit: sbatch's meaning
    (["-N", "2"], "#SBATCH --nodes=2\n"),
    (["-N2"], "#SBATCH --nodes=2\n"),
    (["-t", "1:00:00"], "#SBATCH --time=60\n"),
    (["-t30"], "#SBATCH --time=30\n"),
    (["-p", "gpu"], "#SBATCH --partition=gpu\n"),
    (["-A", "proj-42"], "#SBATCH --account=proj-42\n"),
    (["-J", "my-run"], "#SBATCH --job-name=my-run\n"),
    (["-c", "8"], "#SBATCH --cpus-per-task=8\n"),
    (["-q", "high"], "#SBATCH --qos=high\n"),
    (["-C", "a100"], "#SBATCH --constraint=a100\n"),
]


@pytest.mark.parametrize(("argv", "line"), SHORT, ids=[" ".join(a) for a, _ in SHORT])
def test_sbatchs_short_options_mean_what_they_mean_in_sbatch(argv, line, tmp_path, monkeypatch,
                                                             capsys):  # fmt: skip
    status, out, err = in_process(["submit", "--dry-run", *argv, "train.py"], tmp_path,
                                  monkeypatch, capsys)  # fmt: skip
    assert status == 0, err
    assert line in out


REFUSED = [  # (argv, what stderr says): one line, exit status 2, nothing rendered or queued
    # sbatch's name for another quantity, which prefix matching once read as a per-node one
    (["--nodes", "2", "--ntasks=8"], r"--ntasks is sbatch's total of tasks, and slurmddp places "
                                     r"ranks per node: use --ntasks-per-node N with --nodes"),
    (["--ntasks", "8"], r"--ntasks is sbatch's total of tasks"),
    (["-n", "8"], r"-n is sbatch's total of tasks.*--ntasks-per-node"),
    (["--gpus=4"], r"--gpus is sbatch's total of GPUs.*use --gpus-per-node N with --nodes"),
    (["-G", "4"], r"-G is sbatch's total of GPUs"),
    (["--gpus-per-task=1"], r"--gpus-per-task does not apply: slurmddp runs one rank per GPU"),
    (["--sbatch-arg=--ntasks=8"], r"sets --ntasks, which slurmddp writes itself from "
                                  r"ntasks_per_node"),
    # the logs: slurmddp's --output is their directory
    (["--output=%j.out"], r"""--output = "%j.out" must be a directory, and '%j' is Slurm's """
                          r"filename pattern"),
    (["--output", "logs/%x-%3a"], r"'%x' is Slurm's filename pattern"),
    (["-o", "%j.out"], r"-o is sbatch's file for the batch log.*--output DIR"),
    (["--error=%j.err"], r"--error is not needed.*--output DIR"),
    # slurmddp's own business, with the option that does it
    (["--no-requeue"], r"--max-requeues N says how often \(0: never\)"),
    (["--signal=USR1@60"], r"must be the signal alone, e.g. 'USR1' and the lead time as "
                           r"signal_lead \(--signal-lead 60\)"),
    (["--wait"], r"--wait is slurmddp submit --follow here"),
    # sbatch's others go through --sbatch-arg
    (["--exclusive"], r"--exclusive is an sbatch option slurmddp does not set: pass it on as "
                      r"--sbatch-arg=--exclusive$"),
    (["--array=0-3"], r"pass it on as --sbatch-arg=--array=0-3$"),
    (["-w", "node1"], r"-w \(sbatch's --nodelist\) is an sbatch option .*"
                      r"--sbatch-arg=--nodelist=VALUE$"),
    # near misses: no abbreviation, "did you mean" instead
    (["--node", "2"], r"unrecognized arguments: --node; did you mean --nodes\?"),
    (["--part", "gpu"], r"unrecognized arguments: --part; did you mean --partition\?"),
    (["--partiton", "gpu"], r"unrecognized arguments: --partiton; did you mean --partition\?"),
    (["--gpus-per-nod=2"], r"--gpus-per-nod; did you mean --gpus-per-node\?"),
    (["--ntask=8"], r"--ntask; did you mean --ntasks\? --ntasks is sbatch's total of tasks"),
    (["--snap"], r"--snap; did you mean --snapshot, --snapshot-max-files or --snapshot-max-mib\?"),
]


@pytest.mark.parametrize(("argv", "says"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
@pytest.mark.parametrize("command", ["submit", "template"])
def test_an_sbatch_name_of_other_meaning_or_a_near_miss_is_refused(argv, says, command,
                                                                   tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    if command == "template" and argv[0] == "-o":
        pytest.skip("template's own -o: the file to write the script to")
    status, out, err = in_process([command, *argv, "train.py"], tmp_path, monkeypatch, capsys)
    assert status == 2 and out == "", err
    assert err.startswith(f"slurmddp {command}: error: ") and err.count("\n") == 1, err
    assert re.search(says, err.removesuffix(f" (see slurmddp {command} --help)\n").rstrip()), err
    assert not (tmp_path / "state" / "slurmddp").exists()  # nothing submitted


def test_the_scripts_own_arguments_stay_the_scripts(tmp_path, monkeypatch, capsys):
    mine = ["--nodes", "3", "-N", "4", "--ntasks=8", "--node", "-o", "x"]
    status, out, err = in_process(["submit", "--dry-run", "--no-snapshot", "-N", "2", "train.py",
                                   *mine], tmp_path, monkeypatch, capsys)  # fmt: skip
    assert status == 0, err
    assert "#SBATCH --nodes=2\n" in out
    assert handed_plan(out).target == ("train.py", *mine)


def test_the_template_takes_the_short_options_too(tmp_path, monkeypatch, capsys):
    status, _, err = in_process(["template", "-N", "2", "-t", "5", "-o", "job.sh", "train.py"],
                                tmp_path, monkeypatch, capsys)  # fmt: skip
    assert status == 0, err
    assert "#SBATCH --nodes=2\n#SBATCH" in (tmp_path / "job.sh").read_text()
    assert "#SBATCH --time=5\n" in (tmp_path / "job.sh").read_text()

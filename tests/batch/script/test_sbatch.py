"""The ``slurmddp submit`` batch script: golden files, bash syntax, quoting that survives hostile
values when the script really runs, and real jobs on the local cluster.

Regenerate the golden files after an intended change with
``SLURMDDP_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/batch/script/test_sbatch.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmddp.batch.script.sbatch import context, plan, render_script
from slurmddp.batch.script.templating import directive_quote
from slurmddp.batch.spec.jobspec import JobSpec, SpecError, build_spec
from tests.conftest import EVERY_SLURM, ROOT, tagged_json

GOLDEN = ROOT / "tests" / "golden"
UPDATE_GOLDEN = os.environ.get("SLURMDDP_UPDATE_GOLDEN") == "1"
PYTHON = "/opt/venv/bin/python"  # fixed, so the golden files do not depend on this machine

BASE = JobSpec(target=("train.py",), job_name="train", output_dir="/scratch/runs", python=PYTHON,
               host_python=PYTHON, workdir="/home/alice/project")  # fmt: skip

CASES = {
    "srun_cpu": dataclasses.replace(
        BASE, target=("train.py", "--epochs", "3"), nodes_min=2, nodes_max=2,
        ntasks_per_node=4, cpus_per_task=2,
    ),
    "srun_4x8gpu": dataclasses.replace(
        BASE, nodes_min=4, nodes_max=4, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=12,
        mem="480G", time_minutes=24 * 60 + 30, partition="gpu", account="proj-42", qos="high",
        constraint="a100&ib", backend="nccl", max_requeues=5,
    ),
    "torchrun_nodes_1-4": dataclasses.replace(
        BASE, target=("-m", "pkg.train", "--config", "conf/big run.yaml"), job_name="pkg.train",
        nodes_min=1, nodes_max=4, ntasks_per_node=4, gpus_per_node=4, launcher="torchrun",
        max_restarts=2, time_minutes=120, signal_lead=300, rdzv_port=29500,
    ),
    "setup_env_args": dataclasses.replace(
        BASE, target=("train.py", "--name", "it's $(not) run", "--note", "a\nb"),
        job_name="my 'run' #1", output_dir="/scratch/my runs/100%",
        setup=("module load cuda/12.1", "source /opt/venv/bin/activate"),
        env=(("NCCL_DEBUG", "INFO"), ("GREETING", 'say "hi"; echo `id` $(id) $HOME'),
             ("MULTILINE", "one\ntwo")),
        sbatch_args=("--mail-type=END,FAIL", "--comment=a # b 'c' \"d\"", "--exclusive"),
        srun_args=("--mpi=pmix", "--label", "--comment=x y"),
    ),
    "torchrun_cpu_no_requeue": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=3, launcher="torchrun", requeue=False,
        backend="gloo",
    ),
    "mpirun_cpu": dataclasses.replace(
        BASE, target=("train.py", "--lr", "0.1"), nodes_min=2, nodes_max=2, ntasks_per_node=4,
        launcher="mpirun", signal="USR1",
    ),
    "srun_mpi_pmix": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=2, mpi="pmix", cpus_per_task=1,
    ),
    # As slurmddp.batch.transport.snapshot leaves a spec: the script's copy in the snapshot is run.
    "srun_code_snapshot": dataclasses.replace(
        BASE, target=("/scratch/runs/snapshots/0123456789abcdef/src/train.py", "--lr", "0.1"),
        code_dir="/scratch/runs/snapshots/0123456789abcdef/src", nodes_min=2, nodes_max=2,
    ),
    "torchrun_etcd": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=2, launcher="torchrun",
        rdzv_backend="etcd-v2", rdzv_endpoint="etcd.cluster:2379",
    ),
    "srun_preflight": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=4, gpus_per_node=4, cpus_per_task=8,
        preflight=True, srun_args=("--mpi=pmix",),
    ),
    # The ranks in an image; the decision in the batch shell with the host's Python.
    "apptainer_2x4gpu": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=4, gpus_per_node=4, backend="nccl",
        python="python3", container="/scratch/images/pytorch.sif", preflight=True,
        container_binds=("/scratch/ckpt",), env=(("NCCL_DEBUG", "INFO"),),
    ),
    "singularity_amd_torchrun": dataclasses.replace(
        BASE, nodes_min=2, nodes_max=2, ntasks_per_node=8, gpus_per_node=8, launcher="torchrun",
        python="python3", container="/scratch/images/rocm.sif", container_runtime="singularity",
        gpu_vendor="amd", container_args=("--writable-tmpfs",),
    ),
    "pyxis_torchrun": dataclasses.replace(
        BASE, nodes_min=4, nodes_max=4, ntasks_per_node=8, gpus_per_node=8, launcher="torchrun",
        python="python", container="/scratch/images/pytorch-24.05.sqsh",
        container_runtime="pyxis", env=(("NCCL_DEBUG", "INFO"),),
        container_binds=("/scratch/ckpt",),
    ),
}  # fmt: skip


def check_golden(name: str, text: str) -> None:
    """`text` equals tests/golden/<name>.sh; with SLURMDDP_UPDATE_GOLDEN=1, (re)write it."""
    path = GOLDEN / f"{name}.sh"
    if UPDATE_GOLDEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.is_file(), f"{path} is missing: run with SLURMDDP_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(encoding="utf-8"), (
        f"{path.name} differs; if the change is intended, rerun with SLURMDDP_UPDATE_GOLDEN=1"
    )


def bash_syntax_error(script: str) -> str | None:
    r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    return None if r.returncode == 0 else r.stderr


# The whole script, for a few cases that between them reach every part of the template: every
# directive, hostile values with setup lines, torchrun's layout, an image with the host's python.
# The step's command line of every launcher is a table in tests/supervisor/test_launchers.py.
GOLDEN_CASES = ("srun_4x8gpu", "setup_env_args", "torchrun_nodes_1-4", "apptainer_2x4gpu")


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden(name):
    check_golden(name, render_script(CASES[name]))


def test_no_golden_file_is_left_over():
    assert sorted(p.stem for p in GOLDEN.glob("*.sh")) == sorted(GOLDEN_CASES)


def test_every_case_hands_its_plan_over():
    # What the supervisor runs, from the spec: the ranks' python in the image, the host's for the
    # supervisor, the image's srun options after the user's.
    for name, spec in CASES.items():
        script, handed = render_script(spec), plan(spec)
        assert f"--plan {shlex.quote(handed.to_json())} " in script, name
        assert (handed.python, handed.target, handed.signal) == (spec.python, spec.target,
                                                                 spec.signal)  # fmt: skip
        assert handed.srun_args[: len(spec.srun_args)] == spec.srun_args
    pyxis = plan(CASES["pyxis_torchrun"])
    assert pyxis.srun_args[0] == "--container-image=/scratch/images/pytorch-24.05.sqsh"
    pyxis_script = render_script(CASES["pyxis_torchrun"])
    assert "exec /opt/venv/bin/python -m slurmddp.supervisor" in pyxis_script
    assert "#SBATCH --no-requeue\n" in render_script(CASES["torchrun_cpu_no_requeue"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_script_parses_as_bash(name):
    assert bash_syntax_error(render_script(CASES[name])) is None


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_directive_comes_before_the_first_command(name):
    # sbatch stops reading #SBATCH lines at the first line that is neither blank nor a comment.
    lines = render_script(CASES[name]).splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert not [ln for ln in lines[first_command:] if ln.startswith("#SBATCH")]
    assert lines[0] == "#!/bin/bash"


def test_rendering_imports_no_torch():
    # `slurmddp submit` runs on login nodes, where importing torch is slow or impossible.
    code = (
        "import sys; from slurmddp.batch.spec.jobspec import build_spec; "
        "from slurmddp.batch.script.sbatch import render_script; "
        "render_script(build_spec(['t.py'], cwd='/x')); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_bad_spec_is_refused_before_rendering():
    with pytest.raises(SpecError, match="signal='TERM'"):
        render_script(dataclasses.replace(BASE, signal="TERM"))


def test_usr1_may_be_the_stop_signal():
    spec = dataclasses.replace(BASE, signal="USR1")
    script = render_script(spec)
    assert "#SBATCH --signal=B:USR1@120" in script and "export SLURMDDP_SIGNAL=USR1" in script
    assert "kill -s USR1 \"$supervisor\" 2>/dev/null' USR1\n" in script
    assert "(trap '' USR1 TERM; exec " in script
    assert plan(spec).signal == "USR1" and 'trap "" USR1; exec "$@"' in plan(spec).rank_prefix


def test_torchrun_asks_for_one_task_per_node_with_all_its_cpus():
    # A job of ntasks_per_node tasks would make `srun --ntasks-per-node=1` start that many
    # torchruns per node: srun inherits SLURM_NTASKS and ignores the per-node count.
    spec = dataclasses.replace(CASES["torchrun_nodes_1-4"], cpus_per_task=6)
    ctx = context(spec).variables()
    assert (ctx["tasks_per_node"], ctx["cpus_per_task"], ctx["nproc_per_node"]) == (1, 24, 4)
    assert ctx["rank_log"] == "/scratch/runs/%j/node-%n.log"
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=4\n#SBATCH --cpus-per-task=24" in (
        render_script(spec))
    assert (plan(spec).cpus_per_task, plan(spec).nproc_per_node) == (24, 4)
    # A node range is elastic (slurmddp.supervisor.launchers has the step's --nnodes).
    assert "#SBATCH --no-kill" in render_script(spec) and plan(spec).elastic
    spare = dataclasses.replace(CASES["torchrun_cpu_no_requeue"], spare_nodes=1, max_restarts=2)
    assert "#SBATCH --nodes=3\n" in render_script(spare)
    assert (plan(spare).nodes_min, plan(spare).spare_nodes, plan(spare).elastic) == (2, 1, True)


def test_the_context_is_a_typed_value_and_every_variable_the_template_reads_is_documented():
    import ast
    import inspect

    from jinja2 import meta

    from slurmddp.batch.script import sbatch, templating

    tree = ast.parse(inspect.getsource(sbatch.Context))
    body = tree.body[0].body  # type: ignore[attr-defined]
    documented = {a.target.id for a, b in itertools.pairwise(body)
                  if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
                  and isinstance(b.value, ast.Constant)}  # fmt: skip
    own = {f.name for f in dataclasses.fields(sbatch.Context)} - {"spec"}
    assert own == documented, "a field of Context without its docstring"
    fields = {f.name for f in dataclasses.fields(JobSpec)}
    shipped = ROOT / "templates" / sbatch.DEFAULT_TEMPLATE
    read = meta.find_undeclared_variables(templating.environment().parse(shipped.read_text()))
    assert read <= own | fields and {"plan", "directives", "p"} <= read
    variables = context(CASES["srun_cpu"]).variables()
    assert set(variables) == own | fields and variables["nodes"] == "2"  # Context's win


def test_log_paths_escape_percent_for_slurm_but_not_for_mkdir():
    ctx = context(CASES["setup_env_args"]).variables()
    assert ctx["batch_log"] == "/scratch/my runs/100%%/%j.batch.log"
    assert ctx["rank_log"] == "/scratch/my runs/100%%/%j/rank-%t.log"
    assert "job_dir='/scratch/my runs/100%'/\"$SLURM_JOB_ID\"" in render_script(
        CASES["setup_env_args"]
    )


@pytest.mark.parametrize(
    ("value", "word"),
    [("plain-name_1.0", "plain-name_1.0"), ("B:USR2@120", "B:USR2@120"), ("a,b", "a,b"),
     ("/x/%j.log", "/x/%j.log"), ("a b", '"a b"'), ("a#b", '"a#b"'), ("it's", '"it\'s"'),
     ('say "hi"', '"say \\"hi\\""'), ("back\\slash", '"back\\\\slash"'), ("", '""'),
     ("日本", '"日本"'), (42, "42")],
)  # fmt: skip
def test_directive_quote(value, word):
    assert directive_quote(value) == word


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\0b"])
def test_directive_quote_refuses_line_breaks(value):
    with pytest.raises(ValueError, match="#SBATCH"):
        directive_quote(value)


# --- hostile values, executed -------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# Records its argv, drops its own options (every leading -word), and runs the rest.
printf '%s\\0' "$@" > "$SRUN_RECORD"
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = "#!/bin/bash\necho n1\necho n2\n"
RECORDER = """#!{python}
import json, os, sys
if sys.argv[1:3] == ["-m", "slurmddp.supervisor"]:  # the job's supervisor
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
with open(os.environ["RECORD"], "w", encoding="utf-8") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


def stand_in(path: Path, body: str) -> Path:
    """An executable at `path` that the script runs as its python: `body` (bash) for the step,
    the real interpreter for the job's supervisor."""
    body = body.removeprefix("#!/bin/bash\n")
    path.write_text(f"#!/bin/bash\nif [[ $1 == -m && $2 == slurmddp.supervisor ]]; "
                    f"then exec "
                    f"{sys.executable} \"$@\"; fi\n{body}")  # fmt: skip
    path.chmod(0o755)
    return path

# Pieces that break naive quoting: shell syntax, command substitutions that would leave a
# `pwned` file, quotes, escapes, globs, non-ASCII.
PIECES = ["a", "Z9", " ", "'", '"', "\\", "$", "$(touch pwned)", "`touch pwned`", "; touch pwned",
          "&& touch pwned", "|", ">pwned", "<", "*", "?", "~", "!", "#", "%", "%j", "{a,b}", "[x]",
          "=", "-", "--x", "$HOME", "${IFS}", "\\n", "é", "日本", "🙂", "\t"]  # fmt: skip


def text(*, newlines: bool, extra: str = "") -> st.SearchStrategy[str]:
    pieces = st.sampled_from(PIECES + (["\n", "\r\n"] if newlines else []))
    chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\0" + extra)
    return st.one_of(st.lists(pieces, max_size=8).map("".join), st.text(chars, max_size=12))


def one_line(extra: str = "") -> st.SearchStrategy[str]:
    # Values on #SBATCH lines: no control characters (validate refuses them).
    return text(newlines=False).filter(
        lambda s: s and not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 or c in extra for c in s)
    )


@st.composite
def hostile_specs(draw) -> dict:
    """A JobSpec's values; output_dir and code_dir relative, made absolute per example."""
    script = draw(text(newlines=True).filter(lambda s: s and not s.startswith("-")))
    args = draw(st.lists(text(newlines=True), max_size=5))
    module = draw(st.booleans())
    target = ("-m", "pkg.mod", *args) if module else (script, *args)
    env = draw(st.lists(st.tuples(st.sampled_from(["SDDP_A", "SDDP_B", "SDDP_C"]),
                                  text(newlines=True)), max_size=4))  # fmt: skip
    srun_args = draw(st.lists(text(newlines=True).map(lambda v: "--comment=" + v), max_size=2))
    return dict(
        target=target,
        job_name=draw(one_line()),
        output_dir="OUT/" + draw(one_line(extra="\\/")),
        launcher=draw(st.sampled_from(["srun", "torchrun"])),
        env=tuple(env),
        srun_args=tuple(srun_args),
        setup=("export FROM_SETUP=ran",),
        code_dir=draw(st.none() | one_line(extra="\\/").map(lambda v: "CODE/" + v)),
    )


def stand_ins(root: Path) -> None:
    """root/bin/ with the stand-ins of srun and scontrol."""
    (root / "bin").mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (root / "bin" / name).write_text(body)
        (root / "bin" / name).chmod(0o755)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory) -> Path:
    """bin/ with a fake srun and scontrol, and a recording 'python' in a hostile directory."""
    root = tmp_path_factory.mktemp("fakes")
    stand_ins(root)
    py_dir = root / "py $(touch pwned) 'q' `id`"
    py_dir.mkdir()
    (py_dir / "python").write_text(RECORDER.format(python=sys.executable))
    (py_dir / "python").chmod(0o755)
    return root


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=hostile_specs())
@pytest.mark.ranks
def test_hostile_values_reach_the_program_verbatim_and_run_nothing(fakes, spec):
    with tempfile.TemporaryDirectory(dir=fakes) as work_dir:
        work = Path(work_dir)
        code_dir = spec["code_dir"]
        spec = JobSpec(**{
            **spec, "output_dir": str(work / spec["output_dir"]),
            "python": str(fakes / "py $(touch pwned) 'q' `id`" / "python"),
            "code_dir": None if code_dir is None else str(work / code_dir)})  # fmt: skip
        script = work / "job.sh"
        script.write_text(render_script(spec), encoding="utf-8")
        env = {
            "PATH": f"{fakes / 'bin'}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_JOB_NUM_NODES": "2",
            "RECORD": str(work / "record.json"),
            "SRUN_RECORD": str(work / "srun.argv"),
        }
        r = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr

        record = json.loads((work / "record.json").read_text(encoding="utf-8"))
        argv = record["argv"]
        if spec.launcher == "srun":
            assert argv == ["-m", "slurmddp.run", *spec.target]
        else:
            tail = ["-m", "slurmddp.run", "--tag-output", *spec.target]
            assert argv[:2] == ["-m", "slurmddp.agent"] and argv[-len(tail) :] == tail
            # The agent adds the port, derived from the job (slurmddp.agent).
            # One rendezvous id per run of the job: a requeued run meets no earlier state.
            assert "--rdzv-endpoint=n1" in argv and "--rdzv-id=4242.0" in argv
        for key, value in dict(spec.env).items():
            assert record["env"][key] == value
        assert record["env"]["FROM_SETUP"] == "ran"
        assert record["env"].get("SLURMDDP_CODE_DIR") == spec.code_dir
        srun_argv = (work / "srun.argv").read_bytes().decode().split("\0")[:-1]
        assert srun_argv[-len(argv) - 1 :] == [spec.python, *argv]
        for arg in spec.srun_args:
            assert arg in srun_argv
        assert Path(spec.output_dir, "4242").is_dir()
        assert not list(fakes.rglob("pwned")), "an injected command ran"


def test_launcher_variables_of_the_submitting_shell_never_reach_the_ranks(fakes, tmp_path):
    # sbatch passes the submitting shell's environment on; a torchrun tried by hand left these.
    spec = dataclasses.replace(BASE, output_dir=str(tmp_path / "out"), env=(("MASTER_PORT",
                               "23456"),), python=str(fakes / "py $(touch pwned) 'q' `id`" /
                               "python"))  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    leftovers = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
                 "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
                 "TORCHELASTIC_RESTART_COUNT": "2", "OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "1"}
    env = {"PATH": f"{fakes / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n1", "RECORD": str(tmp_path / "record.json"),
           "SRUN_RECORD": str(tmp_path / "srun.argv"), **leftovers}  # fmt: skip
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    seen = json.loads((tmp_path / "record.json").read_text())["env"]
    assert not (set(leftovers) - {"MASTER_PORT"}) & set(seen), seen
    assert seen["MASTER_PORT"] == "23456"  # --env is the way to set one


def test_a_step_that_fails_at_once_fails_the_job(fakes, tmp_path):
    # The step may be gone (and reaped by bash) before the shell first checks on it; its status
    # must still count. BASH_ENV holds the shell back just after it starts the step.
    failing = stand_in(tmp_path / "fail", "exit 3\n")
    slow = tmp_path / "slow.bash"
    slow.write_text("trap '[[ $BASH_COMMAND == \"step=\\$!\" ]] && sleep 0.5' DEBUG\n")
    spec = dataclasses.replace(BASE, output_dir=str(tmp_path / "out"), python=str(failing))
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    env = {"PATH": f"{fakes / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n1", "SRUN_RECORD": str(tmp_path / "srun.argv"),
           "BASH_ENV": str(slow)}  # fmt: skip
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr


STEP_TAKING_USR2 = f"""#!{sys.executable}
import os, signal, sys, time
if sys.argv[1:3] == ["-m", "slurmddp.supervisor"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
def got(signum, frame):
    print("got-usr2", file=open(os.environ["OUT"], "a"))
    sys.exit(5)
signal.signal(signal.SIGUSR2, got)  # started with USR2 ignored: a handler takes it still
print("started", file=open(os.environ["OUT"], "a"))
while True:
    time.sleep(0.05)
"""


def test_the_signal_reaches_the_step_and_its_status_is_the_jobs(fakes, tmp_path):
    # The trapped signal interrupts `wait`; the shell passes it on and still waits for the step.
    step = tmp_path / "step"
    step.write_text(STEP_TAKING_USR2)
    step.chmod(0o755)
    spec = dataclasses.replace(BASE, output_dir=str(tmp_path / "out"), python=str(step))
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    out = tmp_path / "events"
    env = {"PATH": f"{fakes / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n1", "SRUN_RECORD": str(tmp_path / "srun.argv"),
           "OUT": str(out)}  # fmt: skip
    with subprocess.Popen(["bash", str(script)], env=env) as shell:
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        shell.send_signal(signal.SIGTERM)  # only noted: the shell keeps waiting for the step
        time.sleep(0.3)
        assert shell.poll() is None
        shell.send_signal(signal.SIGUSR2)  # passed on to the step, once srun has settled
        assert shell.wait(timeout=10) == 5
    assert out.read_text().split() == ["started", "got-usr2"]
    assert (tmp_path / "out" / "7" / "stop").read_text() == "USR2\n"  # for ranks still starting


# --- the requeue decision, with stand-ins for Slurm's clients --------------------------------

DECISION_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
shown=$RESTARTS_SHOWN
if [[ -e $CALLS.requeued ]]; then shown=${RESTARTS_AFTER_REQUEUE:-$shown}; fi
case $1 in
    show) if [[ $2 == partition ]]; then echo "PartitionName=$3 TotalNodes=4"
          elif [[ $2 == node ]]; then echo "${SHOW_NODE:-}"
          else echo "JobId=$SLURM_JOB_ID JobState=RUNNING Restarts=$shown $SHOW_JOB"; fi ;;
    requeue) : >"$CALLS.requeued"
             kill -TERM "$PPID"  # as Slurm's requeue does, to the batch shell and all it runs
             exit "${REQUEUE_STATUS:-0}" ;;
    update) ignored=$(awk '/^SigIgn/ {print $2}' "/proc/$PPID/status")
            if ((0x$ignored & 0x4000)); then echo "TERM ignored by the shell" >>"$CALLS.term"; fi ;;
esac
"""
# The step: rank 0 leaving the requeue file (or not), then the step's status.
DECISION_STEP = """#!/bin/bash
echo step >> "$CALLS"
if [[ -n ${LEAVE:-} ]]; then printf '%s\\n' "$LEAVE" > "$SLURMDDP_REQUEUE_FILE"; fi
if [[ -n ${REPORT:-} ]]; then echo "$REPORT" >> "$SLURMDDP_FAILURE_FILE"; fi
exit "${STEP_STATUS:-0}"
"""


@pytest.mark.parametrize(
    ("case", "env", "status", "says", "calls"),
    [
        ("preempted", {"SHOW_JOB": "PreemptTime=2026-11-22T01:20:58"}, 0,
         "job 7 stopped (preempted, USR2) at restart 0 after its checkpoint: requeued (1 of 3)",
         ["scontrol requeue 7"]),
        ("time-limit", {"SHOW_JOB": "TimeLimit=00:10:00 RunTime=00:08:10"}, 0,
         "job 7 stopped (time limit, USR2) at restart 0", ["scontrol requeue 7"]),
        ("signal-by-hand", {"SHOW_JOB": "TimeLimit=1-02:03:04 RunTime=00:08:10"}, 0,
         "job 7 stopped (signal, USR2) at restart 0", ["scontrol requeue 7"]),
        ("array-task", {"SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "2",
                        "SLURM_RESTART_COUNT": "1", "RESTARTS_SHOWN": "1"}, 0,
         "job 6_2 stopped (signal, USR2) at restart 1 after its checkpoint: requeued (2 of 3)",
         ["scontrol requeue 6_2"]),
        ("at-the-limit", {"SLURM_RESTART_COUNT": "3", "RESTARTS_SHOWN": "3"}, 75,
         "at restart 3 after its checkpoint: not requeued, the limit of 3 requeues "
         "(--max-requeues) is reached; submit again to resume",
         ["scontrol update JobId=7 Requeue=0"]),
        ("requeue-refused", {"REQUEUE_STATUS": "1"}, 75,
         "scontrol requeue 7 failed: status 1: the job ends here; submit again to resume",
         ["scontrol requeue 7"]),
        # The requeue's own TERM can end scontrol before it answers: Slurm's count says.
        ("requeue-answer-lost", {"REQUEUE_STATUS": "143", "RESTARTS_AFTER_REQUEUE": "1"}, 0,
         "requeued (1 of 3)", ["scontrol requeue 7"]),
    ],
)  # fmt: skip
def test_the_batch_shell_requeues_when_rank_0_asks(tmp_path, case, env, status, says, calls):
    r, out, recorded = run_decision(tmp_path, {"LEAVE": "USR2", **env})
    assert r.returncode == status, r.stdout + r.stderr
    assert says in r.stdout + r.stderr
    assert recorded[0] == "step" and recorded[-1] == calls[-1], recorded
    assert not (out / "7" / "requeue").exists() and not (out / "7" / "done").exists()


@pytest.mark.parametrize("command", ["trap 'slurmddp_signals+=\" TERM", "supervisor= ready=0",
                                     "unset ", "export SLURMDDP_BACKEND",
                                     "[[ -e $SLURMDDP_DONE_FILE"])
def test_a_stop_signal_at_any_command_before_the_step_requeues_without_starting_it(tmp_path,
                                                                                  command):
    # Slurm may signal the batch shell at any instant of its start (a preemption, a --signal time
    # of a short limit): at the first command it runs, the trap must already be set. BASH_ENV's
    # DEBUG trap sends the signal just before the named command runs.
    (tmp_path / "early.bash").write_text(
        "trap '[[ -z ${sent:-} && $BASH_COMMAND == \"$AT\"* ]] && sent=1 && kill -USR2 $$' DEBUG\n")
    r, _, recorded = run_decision(tmp_path, {"BASH_ENV": str(tmp_path / "early.bash"),
                                             "AT": command, "LEAVE": "USR2"})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "USR2 came before the step started: not starting it" in r.stderr
    assert "stopped (signal, USR2, before the step started) at restart 0" in r.stderr
    assert recorded == ["scontrol requeue 7"]  # no step


def test_a_stop_signal_as_the_supervisor_starts_reaches_it(tmp_path):
    # After the shell started the supervisor and before the supervisor listens: the shell passes
    # it on again once told (URG), and the job is requeued, the step stopped or never started.
    (tmp_path / "early.bash").write_text(
        "trap '[[ -z ${sent:-} && $BASH_COMMAND == supervisor=* ]] && sent=1 && kill -USR2 $$' "
        "DEBUG\n")  # fmt: skip
    r, out, recorded = run_decision(tmp_path, {"BASH_ENV": str(tmp_path / "early.bash"),
                                               "LEAVE": "USR2"})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert recorded[-1] == "scontrol requeue 7" and "requeued (1 of 3)" in r.stderr
    assert (out / "7" / "stop").read_text() == "USR2\n"


def test_the_shells_own_variables_are_set_before_use(tmp_path):
    # sbatch passes the submitting shell's environment on, with any name the script uses.
    r, out, recorded = run_decision(tmp_path, {"ready": "1", "supervisor": "1",
                                               "interrupted": "1"})  # fmt: skip
    assert (r.returncode, recorded) == (0, ["step"]), r.stderr
    assert (out / "7" / "done").exists()


def test_a_failure_laid_on_a_node_requeues_the_job_without_it(tmp_path):
    ecc = ("slurmddp: rank 5 (host n2) failed: RuntimeError: CUDA error: uncorrectable ECC error "
           "encountered")  # fmt: skip
    r, out, recorded = run_decision(tmp_path, {
        "STEP_STATUS": "1", "REPORT": ecc, "SLURM_JOB_PARTITION": "debug",
        "SHOW_JOB": "NumNodes=2 ExcNodeList=n4 Requeue=1 PreemptTime=None"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    # Slurm takes a new ExcNodeList only from a pending job: after the requeue.
    assert recorded == ["step", "scontrol requeue 7", "scontrol update JobId=7 ExcNodeList=n[2,4]"]
    # The requeue's TERM reaches the shell and whatever it runs next; ignored by the shell itself,
    # so that no command it starts has an instant in which TERM would still end it.
    assert (tmp_path / "calls.term").read_text() == "TERM ignored by the shell\n"
    assert "because of node n2 (rank 5 on it failed: RuntimeError: CUDA error: uncorrectable" in (
        r.stderr)
    assert (out / "7" / "excluded").read_text() == (
        "n2: rank 5 on it failed: RuntimeError: CUDA error: uncorrectable ECC error encountered\n")


def test_a_step_that_ends_without_asking_is_done_and_never_runs_again(tmp_path):
    r, out, recorded = run_decision(tmp_path, {})
    assert (r.returncode, recorded) == (0, ["step"]), r.stderr
    assert (out / "7" / "done").exists()
    # Requeued anyway (Slurm requeues a job preempted while it exits): nothing runs again.
    r, out, recorded = run_decision(tmp_path, {"SLURM_RESTART_COUNT": "1"})
    assert (r.returncode, recorded) == (0, []), r.stderr
    assert "finished its work in an earlier run: not run again" in r.stdout


def test_after_a_run_whose_node_slurm_lost_empty_steps_take_its_step_ids_first(tmp_path):
    # Run 1 of the job left no decision: Slurm lost its node n1 and requeued it. n1's step daemon
    # may report the end of run 1's step 0 once back, which Slurm would take for this run's step
    # 0: an empty step takes that id first.
    (tmp_path / "out" / "7").mkdir(parents=True)
    (tmp_path / "out" / "7" / "events.jsonl").write_text(
        '{"t": 1, "kind": "run", "run": 0, "nodes": "n1"}\n')
    r, _, recorded = run_decision(tmp_path, {
        "SLURM_RESTART_COUNT": "1", "SHOW_NODE": "NodeName=n1 State=DOWN+NOT_RESPONDING x=y"})
    assert (r.returncode, recorded) == (0, ["empty step", "step"]), r.stderr
    assert ("slurmddp: n1 may report the end of run 1's step once back, which Slurm would take "
            "for this run's step of the same id: 1 empty step first") in r.stderr, r.stderr
    # A node that answers: nothing to take.
    tmp_path = tmp_path / "answering"
    (tmp_path / "out" / "7").mkdir(parents=True)
    (tmp_path / "out" / "7" / "events.jsonl").write_text(
        '{"t": 1, "kind": "run", "run": 0, "nodes": "n1"}\n')
    r, _, recorded = run_decision(tmp_path, {
        "SLURM_RESTART_COUNT": "1", "SHOW_NODE": "NodeName=n1 State=IDLE x=y"})
    assert (r.returncode, recorded) == (0, ["step"]), r.stderr


def test_a_failed_step_is_not_requeued_and_keeps_its_status(tmp_path):
    r, out, recorded = run_decision(tmp_path, {"STEP_STATUS": "3"})
    assert (r.returncode, recorded) == (3, ["step"]), r.stderr
    assert not (out / "7" / "done").exists()


# A step that fails as srun reports it: srun's own line on the batch shell's stderr, the ranks'
# reports in the failures file (slurmddp.run).
FAILING_STEP = """#!/bin/bash
echo "srun: error: $FIRST" >&2
echo "srun: error: n1: task 0: Exited with exit code 1" >&2
if [[ -n $REPORT ]]; then echo "slurmddp: $REPORT" >> "$SLURMDDP_FAILURE_FILE"; fi
echo "slurmddp: rank 0 (host n1) failed: RuntimeError: Connection closed by peer" \\
    >> "$SLURMDDP_FAILURE_FILE"
exit "$STATUS"
"""


@pytest.mark.parametrize(
    ("first", "report", "status", "says"),
    [
        ("n2: tasks 2-3: Exited with exit code 1", "rank 2 (host n2) failed: RuntimeError: boom", 1,
         ["the step failed with status 1; the first to end, as srun saw it: tasks 2-3 on n2 "
          "(Exited with exit code 1)",
          "the first failure a rank reported: rank 2 (host n2) failed: RuntimeError: boom"]),
        ("n2: task 2: Killed", "", 137,
         ["the step failed with status 137; the first to end, as srun saw it: task 2 on n2 "
          "(Killed)",
          "task 2 on n2 was ended by a signal and could not report; failures after it followed "
          "from losing it"]),
    ],
)  # fmt: skip
def test_a_failed_step_is_summarised_naming_the_rank_and_node(tmp_path, first, report, status,
                                                             says):  # fmt: skip
    step = stand_in(tmp_path / "step", FAILING_STEP)
    (tmp_path / "bin").mkdir()
    # Slurm's clients too: a real scontrol would read the record of whatever job 7 is on the
    # cluster this machine runs.
    for name, body in (("srun", FAKE_SRUN), ("scontrol", DECISION_SCONTROL)):
        (tmp_path / "bin" / name).write_text(body)
        (tmp_path / "bin" / name).chmod(0o755)
    out = tmp_path / "out"
    (out / "7").mkdir(parents=True)
    (out / "7" / "failures").write_text("slurmddp: rank 9 (host n9) failed: an earlier run's\n")
    log = tmp_path / "7.batch.log"  # as sbatch --output gives it, appended to by each run
    log.write_text("srun: error: n9: task 9: Exited with exit code 9\n")
    script = tmp_path / "job.sh"
    script.write_text(render_script(dataclasses.replace(BASE, output_dir=str(out),
                                                        python=str(step))))  # fmt: skip
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": "n[1-2]", "SRUN_RECORD": str(tmp_path / "srun.argv"),
           "FIRST": first, "REPORT": report, "STATUS": str(status),
           "CALLS": str(tmp_path / "calls"), "RESTARTS_SHOWN": "0",
           "SHOW_JOB": "PreemptTime=None TimeLimit=UNLIMITED"}  # fmt: skip
    with log.open("a") as f:
        r = subprocess.run(["bash", str(script)], env=env, stdout=f, stderr=subprocess.STDOUT,
                           timeout=30)  # fmt: skip
    assert r.returncode == status
    text = log.read_text()
    summary = [line.removeprefix("slurmddp: ") for line in text.splitlines()
               if line.startswith("slurmddp: ") and "job 7" not in line]  # fmt: skip
    if not report:  # nothing from the killed rank: the first report is of losing it
        says = [says[0], "the first failure a rank reported: rank 0 (host n1) failed: "
                "RuntimeError: Connection closed by peer", says[1]]  # fmt: skip
    assert summary == says, text
    assert "scontrol requeue" not in (tmp_path / "calls").read_text()


def run_decision(tmp_path: Path, env: dict[str, str]):
    """Run the rendered script with stand-in srun, scontrol and squeue; (result, out, calls)."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, body in (("srun", FAKE_SRUN), ("scontrol", DECISION_SCONTROL)):
            (bin_dir / name).write_text(body)
            (bin_dir / name).chmod(0o755)
        stand_in(bin_dir / "step", DECISION_STEP)
        # An empty step's task (srun's stand-in runs what follows its options).
        (bin_dir / "true").write_text('#!/bin/bash\necho "empty step" >> "$CALLS"\n')
        (bin_dir / "true").chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    Path(f"{calls}.requeued").unlink(missing_ok=True)
    Path(f"{calls}.term").unlink(missing_ok=True)
    out = tmp_path / "out"
    spec = dataclasses.replace(BASE, output_dir=str(out), python=str(bin_dir / "step"))
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "n1", "SRUN_RECORD": str(tmp_path / "srun.argv"),
            "CALLS": str(calls), "SHOW_JOB": "PreemptTime=None TimeLimit=UNLIMITED",
            "RESTARTS_SHOWN": env.get("SLURM_RESTART_COUNT", "0"), **env}  # fmt: skip
    r = subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True,
                       timeout=30)  # fmt: skip
    recorded = calls.read_text().splitlines() if calls.exists() else []
    # The stand-in's show queries only inform the decision; keep the actions.
    return r, out, [c for c in recorded if not c.startswith("scontrol show")]


# --- the real cluster ---------------------------------------------------------------------------

SHOW_RANK = """import json, os, sys
print("SHOW " + json.dumps({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
      "argv": sys.argv[1:], "value": os.environ["SDDP_VALUE"]}), flush=True)
"""
HOSTILE_ARGS = ["it's", "a b", "$(touch pwned)", "`touch pwned`", 'q"uote', "日本", "%j"]
HOSTILE_VALUE = "x 'y' \"z\" $HOME $(touch pwned)\nsecond line"


@pytest.mark.cluster
@EVERY_SLURM
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_rendered_script_runs_on_the_cluster(slurm_cluster, tmp_path, launcher):
    """2 nodes x 2 ranks with plain `sbatch --wait`; every rank's log is where the layout says."""
    target = tmp_path / "show rank.py"
    target.write_text(SHOW_RANK)
    jobs = tmp_path / "jobs 100%"  # Slurm log paths need the % escaped, mkdir must not
    jobs.mkdir()
    spec = build_spec(
        [str(target), *HOSTILE_ARGS], nodes="2", ntasks_per_node=2, launcher=launcher,
        output_dir=str(jobs), job_name=f"slurmddp 'test' {launcher}", time="5",
        env=[f"SDDP_VALUE={HOSTILE_VALUE}", "OMP_NUM_THREADS=1"], python=sys.executable,
    )  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text(render_script(spec))
    r = slurm_cluster.run(["sbatch", "--wait", "--parsable", str(script)], cwd=tmp_path)
    job_id = r.stdout.strip().split(";")[0]
    batch_log = jobs / f"{job_id}.batch.log"
    assert r.returncode == 0, r.stderr + (batch_log.read_text() if batch_log.exists() else "")
    assert f"slurmddp: job {job_id}" in batch_log.read_text()

    job_dir = jobs / job_id
    if launcher == "srun":
        names = [f"rank-{r}.log" for r in range(4)]
        per_file = [[r] for r in range(4)]
    else:  # one torchrun per node, its two workers' lines tagged with their rank
        names = ["node-0.log", "node-1.log"]
        per_file = [[0, 1], [2, 3]]
    assert sorted(p.name for p in job_dir.iterdir()) == sorted([*names, "done", "events.jsonl"])
    # The job's story: one run, started on both nodes, finished.
    told = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
    run, ended = [e for e in told if e["kind"] in ("run", "decision")]
    assert run["kind"] == "run" and run["nodes"] and ended["action"] == "finished"
    shown = [tagged_json((job_dir / name).read_text(), "SHOW ") for name in names]
    # torchrun's rendezvous, not Slurm's node order, decides which node runs ranks 0 and 1.
    assert sorted(sorted(s["rank"] for s in file) for file in shown) == per_file
    for s in (s for file in shown for s in file):
        assert (s["world"], s["argv"], s["value"]) == (4, HOSTILE_ARGS, HOSTILE_VALUE)
    assert not list(tmp_path.rglob("pwned"))


NASTY_NAMES = ["a b", "it's", 'say "hi"', "a#b # c", "back\\slash\\", "$(touch pwned)`id`;x",
               "日本 ünï", "%j %x", "--", "x hetjob y", "'", "=a=b="]  # fmt: skip


@pytest.mark.cluster
@EVERY_SLURM
def test_sbatch_reads_directive_values_back_verbatim(slurm_cluster, tmp_path):
    """Job names and a --comment sbatch argument survive sbatch's own #SBATCH parsing."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    seen = {}
    ids = []
    try:
        for i, name in enumerate(NASTY_NAMES):
            spec = dataclasses.replace(BASE, job_name=name, output_dir=str(jobs),
                                       sbatch_args=(f"--comment={name}",))  # fmt: skip
            script = tmp_path / f"job{i}.sh"
            script.write_text(render_script(spec))
            r = slurm_cluster.run(["sbatch", "--hold", "--parsable", str(script)])
            assert r.returncode == 0, (name, r.stderr)
            job_id = r.stdout.strip().split(";")[0]
            ids.append(job_id)
            q = slurm_cluster.run(["squeue", "-h", "-j", job_id, "-o", "%j\x1f%k"])
            seen[name] = tuple(q.stdout.rstrip("\n").split("\x1f"))
    finally:
        if ids:
            slurm_cluster.run(["scancel", *ids])
    assert seen == {name: (name, name) for name in NASTY_NAMES}
    assert not list(tmp_path.rglob("pwned"))

"""Bad input, as a user gives it, through the real entry points: one table.

Every case runs ``python -m slurmddp ...`` or ``python -m slurmddp.run ...`` with a stand-in
``sbatch`` first on PATH that records any call, and asserts: the exit status (2 for bad input),
exactly one line on stderr that names the fault, no traceback, nothing on stdout, sbatch never
called, and the working and home directories (config files, checkpoints) exactly as they were.
A representative set (`AS_PROCESS`: each entry point, each kind of fault) runs as a subprocess of
its own; the others run the same entry point's `main` in a child forked from this process (its
own exit status, stdout and stderr, environment and working directory), as ``python -m`` would
(slurmddp/__main__.py, slurmddp/run.py: the exit of main's value): the same claim, without
starting an interpreter for each. The checkpoint cases, which load with torch, all run as
subprocesses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from tests.conftest import launcher_free_env
from tests.fake_env import srun_env

FAKE_SBATCH = """#!/bin/bash
printf '%s\\n' "$*" >> "$SBATCH_CALLS"
echo "Submitted batch job 4242"
"""
TRAIN = "print('training')\n"
# A training script's resume, as the README shows it; `width` picks the model.
RESUME = """\
import sys
import torch
import slurmddp
from slurmddp.training import train_state

width = int(sys.argv[2]) if len(sys.argv) > 2 else 4
model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loaded = slurmddp.Checkpointer(sys.argv[1]).load_latest()
if loaded is not None:
    train_state.restore(loaded.state, model=model, optimizer=opt)
print("resumed" if loaded else "fresh")
"""


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: `argv` after ``python -m``, run in the working directory."""

    id: str
    argv: tuple[str, ...]
    status: int
    says: str  # a regex the one stderr line must match after its "PROG: error: " prefix
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Written before the run: relative to the working directory, or to HOME with "~/".
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    prepare: Callable[[Path], None] | None = None  # given the working directory
    prog: str = ""  # the error line's prefix; by default the command's

    def __post_init__(self) -> None:
        if not self.prog:
            prog = "python -m slurmddp.run" if self.argv[0] == "slurmddp.run" else (
                f"slurmddp {self.argv[1]}")  # fmt: skip
            object.__setattr__(self, "prog", prog)


def submit(id: str, *args: str, says: str, status: int = 2, **kw) -> Case:
    return Case(id, ("slurmddp", "submit", *args), status, says, **kw)


def command(id: str, *args: str, says: str, status: int = 2, **kw) -> Case:
    return Case(id, ("slurmddp", *args), status, says, **kw)


def run(id: str, env: Mapping[str, str], says: str, *args: str, **kw) -> Case:
    return Case(id, ("slurmddp.run", *(args or ("train.py",))), 2, says, env=env, **kw)


def resume(id: str, prepare: Callable[[Path], None], says: str, *args: str) -> Case:
    return Case(id, ("slurmddp.run", "resume.py", "ck", *args), 2, says, prepare=prepare)


def without(env: Mapping[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


# --- checkpoints, damaged in the ways a user meets them --------------------------------------


def saved(work: Path, width: int = 4, **state) -> Path:
    """A good checkpoint of RESUME's model at step 1 in work/ck; its step directory."""
    import torch

    from slurmddp import Checkpointer
    from slurmddp.training import train_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(work / "ck")
    ckpt.save(1, state or train_state.capture(model=model, optimizer=opt, step=1))
    ckpt.wait()
    return work / "ck" / "step-00000001"


def rewrite_state(step_dir: Path, data: bytes) -> None:
    """Replace state.pt and write a manifest that matches it: only the loader stands guard.

    Format 1 (sha256 sums), which every version loads.
    """
    (step_dir / "state.pt").write_bytes(data)
    files = {"state.pt": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    (step_dir / "manifest.json").write_text(
        json.dumps({"format": 1, "step": 1, "mode": "replicated", "files": files})
    )


def torch_saved(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def truncated(work: Path) -> None:
    path = saved(work) / "state.pt"
    path.write_bytes(path.read_bytes()[:100])


def not_a_checkpoint(work: Path) -> None:
    rewrite_state(saved(work), b"this is not a checkpoint\n")


def a_list(work: Path) -> None:
    import torch

    rewrite_state(saved(work), torch_saved([torch.ones(2)]))


class Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def crafted(work: Path) -> None:
    rewrite_state(saved(work), torch_saved({"model": Evil()}))


def unknown_format(work: Path) -> None:
    step_dir = saved(work)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    (step_dir / "manifest.json").write_text(json.dumps(manifest | {"format": 99}))


def other_architecture(work: Path) -> None:
    import torch

    saved(work, model=torch.nn.Linear(4, 2).state_dict())


def without_model(work: Path) -> None:
    import torch

    saved(work, step=1, w=torch.ones(1))


def bad_pointer(work: Path) -> None:
    (work / "ck").mkdir()
    (work / "ck" / "latest").write_text("../../etc\n")


def a_file(work: Path) -> None:
    (work / "ck").write_text("not a directory\n")


# --- the table ---------------------------------------------------------------------------------

STEP = srun_env(0, [2, 2])
MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
       "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
PROFILE = 'profile = "site"\n[profiles.site]\npartition = "gpu"\n'

CASES = [
    # CLI options
    submit("nodes-zero", "--nodes", "0", "train.py", says=r'--nodes = "0" must be an integer >= 1'),
    submit("nodes-reversed", "--nodes", "4-2", "train.py", says=r"'4-2' has MIN above MAX"),
    submit("nodes-word", "--nodes", "x", "train.py", says=r'--nodes = "x" must be'),
    submit("time-garbage", "--time", "1:xx", "train.py", says=r"time '1:xx' is not a Slurm time"),
    submit("time-negative", "--time", "-5", "train.py", says=r"time '-5' is not a Slurm time"),
    submit("time-fields", "--time", "1:2:3:4", "train.py", says=r"'1:2:3:4' has too many fields"),
    submit("gpus-word", "--gpus-per-node", "four", "train.py", says=r'--gpus-per-node = "four"'),
    submit("gpus-negative", "--gpus-per-node", "-1", "train.py", says=r'--gpus-per-node = "-1"'),
    submit("gpus-vs-ntasks", "--gpus-per-node", "4", "--ntasks-per-node", "3", "train.py",
           says=r"ntasks_per_node=3 with gpus_per_node=4.*set ntasks_per_node to 4"),
    submit("ntasks-zero", "--ntasks-per-node", "0", "train.py", says=r'--ntasks-per-node = "0"'),
    submit("cpus-zero", "--cpus-per-task", "0", "train.py", says=r'--cpus-per-task = "0"'),
    submit("mem-fraction", "--mem", "1.5G", "train.py", says=r"mem='1.5G' is not a memory size"),
    submit("mem-unit", "--mem", "10GiB", "train.py", says=r"mem='10GiB' is not a memory size"),
    submit("signal-hup", "--signal", "HUP", "train.py",
           says=r'--signal = "HUP" cannot warn the ranks.*use USR2 or USR1'),
    submit("signal-sig-prefix", "--signal", "SIGUSR2", "train.py", says=r"without SIG.*'USR2'"),
    submit("signal-unknown", "--signal", "FOO", "train.py", says=r'"FOO" is not a signal name'),
    submit("signal-lead-zero", "--signal-lead", "0", "train.py", says=r'"0" .*from 1 to 65535'),
    submit("signal-lead-long", "--signal-lead", "70000", "train.py", says=r'"70000" .*from 1 to'),
    submit("signal-lead-over-time", "--time", "2", "--signal-lead", "150", "train.py",
           says=r"signal_lead=150 is not below the time limit of 2 min \(120 s\)"),
    submit("requeues-negative", "--max-requeues", "-1", "train.py", says=r'--max-requeues = "-1"'),
    submit("launcher-unknown", "--launcher", "mpiexec", "train.py",
           says=r'--launcher = "mpiexec" must be one of srun, torchrun, mpirun'),
    submit("backend-unknown", "--backend", "tcp", "train.py", says=r'--backend = "tcp" must be'),
    submit("nccl-without-gpus", "--backend", "nccl", "train.py", says=r"nccl.*needs GPUs"),
    submit("gres-gpu-beside-gpus-per-node", "--gpus-per-node", "2", "--ntasks-per-node", "2",
           "--sbatch-arg=--gres=gpu:2", "train.py",
           says=r"'--gres=gpu:2' asks for GPUs beside gpus_per_node=2, which newer Slurm "
                r"\(26.05\) refuses"),
    submit("mpi-with-torchrun", "--mpi", "pmix", "--launcher", "torchrun", "train.py",
           says=r"mpi='pmix' is srun's MPI plugin.*use it with launcher srun"),
    submit("mpi-bad-name", "--mpi", "PMIx!", "train.py", says=r"mpi='PMIx!' is not an MPI plugin"),
    submit("env-no-equals", "--env", "NOEQUALS", "train.py", says=r'"NOEQUALS".*NAME=VALUE'),
    submit("env-bad-name", "--env", "1BAD=x", "train.py", says=r"'1BAD' is not a variable name"),
    submit("job-name-newline", "--job-name", "a\ntouch pwned", "train.py",
           says=r"job_name='a\\ntouch pwned' contains a newline"),
    submit("partition-space", "--partition", "gpu a100", "train.py",
           says=r"partition='gpu a100' contains a space"),
    submit("sbatch-arg-managed", "--sbatch-arg", "--time=5", "train.py",
           says=r"'--time=5' sets --time, which slurmddp writes itself.*set time instead"),
    submit("sbatch-arg-not-option", "--sbatch-arg", "exclusive", "train.py",
           says=r"sbatch argument 'exclusive' is not an option"),
    submit("output-backslash", "--output", "a\\b", "train.py", says=r"contains a backslash"),
    submit("output-is-a-file", "--output", "train.py", "train.py",
           says=r"output directory '.*/work/train\.py' is not a directory: give --output a"),
    submit("python-empty", "--python", "", "train.py", says=r'--python = "" must be'),
    submit("container-bind-alone", "--container-bind", "/scratch", "train.py",
           says=r"container_binds given without a container: name the image \(container\)"),
    submit("container-runtime-unknown", "--container", "t.sif", "--container-runtime", "docker",
           "train.py", says=r'--container-runtime = "docker" must be one of apptainer, '),
    submit("container-bind-comma", "--container", "t.sif", "--container-bind", "/a,b",
           "train.py", says=r"container_binds='/a,b' cannot be bound into the container"),
    submit("container-pyxis-mpirun", "--container", "t.sqsh", "--container-runtime", "pyxis",
           "--launcher", "mpirun", "train.py", says=r"pyxis' starts the ranks through srun"),
    submit("unknown-option", "--bogus", "train.py", says=r"unrecognized arguments: --bogus"),
    submit("option-without-value", "--nodes", says=r"--nodes.* expected one argument"),
    submit("script-missing", "nope.py", says=r"script 'nope.py' not found"),
    submit("no-script", "--nodes", "2", says=r"give the SCRIPT to run"),
    submit("module-bad-name", "-m", "not a module", says=r"'not a module' is not a Python module"),
    submit("local-signal-after-word", "--local", "--local-signal-after", "soon", "train.py",
           says=r"'soon' is not a list of seconds"),
    command("unknown-command", "sbumit", "train.py", says=r"invalid choice: 'sbumit'",
            prog="slurmddp"),
    command("template-output-nowhere", "template", "-o", "no/such/dir/job.sh", "train.py",
            says=r"cannot write 'no/such/dir/job.sh': No such file or directory; give -o a file"),
    command("logs-unknown-job", "logs", "999", says=r"job '999' was not submitted with slurmddp"),
    command("logs-rank-word", "logs", "1", "--rank", "x", says=r"--rank: invalid int value: 'x'"),
    command("cancel-no-job", "cancel", says=r"the following arguments are required: job"),
    # profiles and configuration files
    submit("config-toml-syntax", "train.py", files={"slurmddp.toml": "nodes = = 2\n"},
           says=r"slurmddp.toml: invalid TOML: .*line 1"),
    submit("config-unknown-key", "train.py", files={"slurmddp.toml": "gpus = 4\n"},
           says=r"unknown key 'gpus'; did you mean 'gpus_per_node'"),
    submit("config-wrong-type", "train.py", files={"slurmddp.toml": 'nodes = "two"\n'},
           says=r'slurmddp.toml: nodes = "two" must be an integer >= 1'),
    submit("config-env-list", "train.py", files={"slurmddp.toml": 'env = ["A=1"]\n'},
           says=r"env = \[\"A=1\"\] must be a table of variables"),
    submit("pyproject-not-table", "train.py", files={"pyproject.toml": "[tool]\nslurmddp = 3\n"},
           says=r"tool.slurmddp must be a table"),
    submit("config-template-missing", "train.py", files={"slurmddp.toml": 'template = "x.j2"\n'},
           says=r"template '.*x.j2' cannot be read: No such file"),
    submit("profile-unknown", "--profile", "nosuch", "train.py", files={"slurmddp.toml": PROFILE},
           says=r"unknown profile 'nosuch' \(named on the command line\); available: site"),
    submit("profile-default-unknown", "train.py", files={"slurmddp.toml": 'profile = "gone"\n'},
           says=r"unknown profile 'gone' \(named as the default by"),
    submit("profile-unknown-key", "train.py",
           files={"slurmddp.toml": PROFILE + 'partiton = "x"\n'},
           says=r"\[profiles.site\]: unknown key 'partiton'; did you mean 'partition'"),
    submit("profile-cycle", "--profile", "a", "train.py",
           files={"slurmddp.toml": '[profiles.a]\nextends = "b"\n[profiles.b]\nextends = "a"\n'},
           says=r"profile cycle: .*remove one 'extends'"),
    submit("user-profiles-syntax", "train.py",
           files={"~/.config/slurmddp/profiles.toml": "[profiles.x\n"},
           says=r"profiles.toml: invalid TOML"),
    submit("centre-profiles-missing", "train.py",
           env={"SLURMDDP_PROFILES": "/nonexistent/profiles.toml"},
           says=r"\$SLURMDDP_PROFILES='/nonexistent/profiles.toml': no such file; fix or unset"),
    command("profiles-bad-config", "profiles", files={"slurmddp.toml": "nodes = 0\n"},
            says=r"nodes = 0 must be an integer >= 1"),
    # user templates
    submit("template-missing", "--template", "missing.j2", "train.py",
           says=r"template '.*/work/missing.j2' cannot be read: No such file or directory"),
    submit("template-directory", "--template", ".", "train.py",
           says=r"template '.*/work' cannot be read: Is a directory"),
    submit("template-syntax", "--template", "t.j2", "train.py", files={"t.j2": "{% if %}\n"},
           says=r"template '.*/t.j2' line 1: Expected an expression"),
    submit("template-undefined", "--template", "t.j2", "train.py",
           files={"t.j2": "#!/bin/bash\n{{ no_such_variable }}\n"},
           says=r"template '.*/t.j2' line 2: 'no_such_variable' is undefined"),
    submit("template-sandbox", "--template", "t.j2", "train.py",
           files={"t.j2": "{{ cycler.__init__.__globals__.os.system('touch pwned') }}"},
           says=r"template '.*/t.j2' line 1: access to attribute '__init__' .* is unsafe"),
    submit("template-sandbox-mro", "--template", "t.j2", "train.py",
           files={"t.j2": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
           says=r"line 1: access to attribute '__class__' of 'str' object is unsafe"),
    submit("template-not-utf8", "--template", "t.j2", "train.py", files={"t.j2": b"\xff\xfe"},
           says=r"template '.*/t.j2' cannot be read: it is not UTF-8 text"),
    submit("template-runtime-error", "--template", "t.j2", "train.py",
           files={"t.j2": "#!/bin/bash\n\n{{ 'a\\nb' | directive }}\n"},
           says=r"template '.*/t.j2' line 3: ValueError: 'a\\nb' cannot be written on an #SBATCH"),
    # the environment python -m slurmddp.run sees
    run("procid-word", STEP | {"SLURM_PROCID": "abc"}, r"SLURM_PROCID='abc' is not an integer"),
    run("slurm-ntasks-zero", without(STEP, "SLURM_STEP_NUM_TASKS") | {"SLURM_NTASKS": "0"},
        r"SLURM_NTASKS='0' must be at least 1"),
    run("rank-not-below-size", STEP | {"SLURM_PROCID": "4"},
        r"SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
    run("torchrun-rank-not-below-size", {"RANK": "4", "WORLD_SIZE": "4"},
        r"RANK=4 is not below WORLD_SIZE=4"),
    run("mpi-half-pair", {"OMPI_COMM_WORLD_RANK": "1"},
        r"OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not: set both or neither"),
    run("hydra-half-pair", {"PMI_SIZE": "4"}, r"PMI_SIZE is set but PMI_RANK is not"),
    run("mpi-no-local-size", without(MPI, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        r"OMPI_COMM_WORLD_LOCAL_SIZE is not"),
    run("local-rank-alone", {"LOCAL_RANK": "0"}, r"LOCAL_RANK is set but RANK and WORLD_SIZE"),
    run("torchrun-without-rank", {"TORCHELASTIC_RUN_ID": "x"}, r"TORCHELASTIC_RUN_ID is set but"),
    run("step-incomplete", without(STEP, "SLURM_LOCALID"), r"SLURM_LOCALID unset"),
    run("nodelist-reversed", STEP | {"SLURM_STEP_NODELIST": "n[3-1]"},
        r"SLURM_STEP_NODELIST: .*'n\[3-1\]'"),
    run("nodelist-unclosed", STEP | {"SLURM_STEP_NODELIST": "n[1-"}, r"SLURM_STEP_NODELIST: "),
    run("nodelist-count", STEP | {"SLURM_STEP_NODELIST": "n[1-3]"},
        r"SLURM_STEP_NODELIST='n\[1-3\]' names 3 nodes but SLURM_STEP_NUM_NODES=2"),
    run("mpirun-job-nodelist", MPI | {"SLURM_JOB_NODELIST": "n[1-"},
        r"SLURM_JOB_NODELIST='n\[1-' is not a usable node list"),
    run("tasks-per-node-garbage", STEP | {"SLURM_STEP_TASKS_PER_NODE": "two"},
        r"SLURM_STEP_TASKS_PER_NODE: invalid tasks per node 'two'"),
    run("tasks-per-node-disagrees", STEP | {"SLURM_STEP_TASKS_PER_NODE": "3,2"},
        r"SLURM_STEP_TASKS_PER_NODE='3,2' disagrees with"),
    run("master-port-high", STEP | {"MASTER_PORT": "99999"},
        r"MASTER_PORT=99999 is not a TCP port: give 1 to 65535, or unset it"),
    run("master-port-word", STEP | {"MASTER_PORT": "http"},
        r"MASTER_PORT='http' is not an integer: give a whole number, or unset it"),
    run("job-id-word", STEP | {"SLURM_JOB_ID": "12_3"}, r"SLURM_JOB_ID='12_3' is not a numeric"),
    run("master-host-format", STEP, r"master host format '\{hots\}' is invalid",
        "--master-host-format", "{hots}", "train.py"),
    run("init-unknown-backend", {}, r"unknown backend 'tcp': use one of auto, nccl, gloo, mpi",
        "init.py", files={"init.py": "import slurmddp\nslurmddp.init(backend='tcp')\n"}),
    run("run-script-missing", {}, r"script 'nope.py' not found", "nope.py"),
    run("run-no-script", {}, r"give a SCRIPT to run, or -m MODULE", "--tag-output"),
    run("run-unknown-option", {}, r"unrecognized arguments: --bogus", "--bogus", "train.py"),
    # checkpoints, through a training script's resume under the runner
    resume("ckpt-truncated", truncated,
           r"no valid checkpoint in .*ck: .*step-00000001 is truncated \(state.pt has 100 bytes"),
    resume("ckpt-not-a-checkpoint", not_a_checkpoint, r"is unreadable by torch.load"),
    resume("ckpt-other-object", a_list, r"is not a state dict \(it holds a list\)"),
    resume("ckpt-crafted-pickle", crafted,
           r"holds something other than tensors and plain containers; refusing to load it"),
    resume("ckpt-unknown-format", unknown_format, r"in an unknown format \(version 99\)"),
    resume("ckpt-bad-pointer", bad_pointer, r"ck/latest is unreadable"),
    resume("ckpt-not-a-directory", a_file,
           r"cannot read checkpoint directory .*/ck: Not a directory; give Checkpointer a dir"),
    resume("ckpt-other-model", saved, r"model state does not fit this model: shapes differ for "
           r"'0.weight' \(checkpoint \[4, 4\], model \[8, 4\]\)", "8"),
    resume("ckpt-other-architecture", other_architecture, r"does not fit this model: missing keys "
           r"'0.weight', '0.bias', '1.weight', '1.bias'; unexpected keys 'weight', 'bias'"),
    resume("ckpt-without-model", without_model, r"holds no model state \(it has step, w\)"),
]  # fmt: skip


def test_there_are_enough_cases_and_ids_are_unique():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.id for c in CASES} >= AS_PROCESS


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    """A working directory, a HOME with its XDG directories, and the stand-in sbatch."""
    paths = {"work": tmp_path / "work", "home": tmp_path / "home", "bin": tmp_path / "bin",
             "calls": tmp_path / "sbatch-calls"}  # fmt: skip
    for name in ("work", "home", "bin"):
        paths[name].mkdir()
    (paths["bin"] / "sbatch").write_text(FAKE_SBATCH)
    (paths["bin"] / "sbatch").chmod(0o755)
    (paths["work"] / "train.py").write_text(TRAIN)
    (paths["work"] / "resume.py").write_text(RESUME)
    return paths


def case_env(case: Case, world: dict[str, Path]) -> dict[str, str]:
    """The environment a case runs in: the world's HOME, XDG directories and stand-in sbatch,
    no launcher's variables, then the case's own."""
    home = world["home"]
    env = launcher_free_env(
        HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
        XDG_STATE_HOME=str(home / ".local" / "state"), SBATCH_CALLS=str(world["calls"]),
        PATH=f"{world['bin']}:{os.environ['PATH']}", PYTHONDONTWRITEBYTECODE="1",
    )  # fmt: skip
    for name in ("SLURMDDP_PROFILES", "SLURMDDP_DEBUG", "SLURMDDP_MASTER_HOST_FORMAT"):
        env.pop(name, None)
    return env | dict(case.env)


def invoke(case: Case, world: dict[str, Path], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *case.argv], cwd=world["work"],
                          env=case_env(case, world) | extra, capture_output=True,
                          timeout=120)  # fmt: skip


# Run as `python -m ...` subprocesses: each entry point (slurmddp submit, another command,
# python -m slurmddp.run) and each kind of fault (an option, a configuration file, the launcher's
# environment, the script, a checkpoint through a training script, which imports torch).
# test_the_debug_variable_shows_the_traceback runs ckpt-truncated as one too.
AS_PROCESS = {"nodes-zero", "config-toml-syntax", "template-sandbox", "unknown-command",
              "logs-unknown-job", "procid-word", "run-script-missing", "init-unknown-backend",
              "ckpt-other-model"}  # fmt: skip


def invoke_forked(case: Case, world: dict[str, Path]) -> subprocess.CompletedProcess:
    """`invoke`'s run of `case`, by the entry point's `main` in a child forked from this process:
    its environment and working directory as `invoke` gives them, its stdout and stderr files,
    its exit status main's value as sys.exit makes it."""
    env = case_env(case, world)
    module, *args = case.argv
    if module == "slurmddp.run":
        from slurmddp.launch import runner as entry
    else:
        from slurmddp import cli as entry
    out, err = world["bin"].parent / "child.stdout", world["bin"].parent / "child.stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.chdir(world["work"])
            os.environ.clear()
            os.environ.update(env)
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.argv = [str(Path(entry.__file__)), *args]
            try:
                status = entry.main(args)
            except SystemExit as e:
                status = e.code
            if isinstance(status, str):
                print(status, file=sys.stderr)
            code = 0 if status is None else status if isinstance(status, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)
    deadline = time.monotonic() + 120  # invoke's timeout
    while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"{case.id}: the forked run did not end in 120 s")
        time.sleep(0.01)
    wait_status = waited[1]
    return subprocess.CompletedProcess(case.argv, os.waitstatus_to_exitcode(wait_status),
                                       out.read_bytes(), err.read_bytes())  # fmt: skip


def prepare(case: Case, world: dict[str, Path]) -> None:
    for name, content in case.files.items():
        path = world["home"] / name[2:] if name.startswith("~/") else world["work"] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if case.prepare is not None:
        case.prepare(world["work"])


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry under `roots`: its kind, mode and content hash."""
    out = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            out[str(path)] = (st.st_mode, digest)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.ranks
def test_bad_input_is_one_line_exit_2_and_nothing_happens(case, world):
    prepare(case, world)
    before = snapshot(world["work"], world["home"])
    # A resume loads its checkpoint with torch: not in a child forked from a process whose torch
    # may have started OpenMP's threads (a forked child's parallel region can hang on them).
    own_process = case.id in AS_PROCESS or case.argv[:2] == ("slurmddp.run", "resume.py")
    r = invoke(case, world) if own_process else invoke_forked(case, world)
    stderr = r.stderr.decode("utf-8", "replace")
    # A resume says what it resumes (its step, run and path) before the state is found not to
    # fit: the error is the one line after it.
    lines = [line for line in stderr.splitlines()
             if line.strip() and not line.startswith("slurmddp: resuming from step ")]
    assert r.returncode == case.status, stderr
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    prefix = f"{case.prog}: error: "
    assert lines[0].startswith(prefix), lines[0]
    assert re.search(case.says, lines[0][len(prefix) :]), lines[0]
    assert r.stdout == b""
    assert not world["calls"].exists(), "sbatch was called"
    assert snapshot(world["work"], world["home"]) == before, "a file was created or changed"


def test_the_stand_in_sbatch_records_a_good_submission(world):
    # The check above means something: the same set-up does reach sbatch with good input.
    r = invoke(submit("good", "--nodes", "2", "train.py", says=""), world)
    assert r.returncode == 0, r.stderr
    assert world["calls"].read_text().count("\n") == 1
    assert "submitted job 4242" in r.stdout.decode()


def test_the_debug_variable_shows_the_traceback(world):
    case = next(c for c in CASES if c.id == "ckpt-truncated")
    prepare(case, world)
    r = invoke(case, world, SLURMDDP_DEBUG="1")
    stderr = r.stderr.decode()
    assert r.returncode == 2
    assert stderr.startswith("Traceback (most recent call last):")
    assert "slurmddp/checkpoint/" in stderr and "resume.py" in stderr
    assert stderr.splitlines()[-1].startswith("python -m slurmddp.run: error: no valid checkpoint")


@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_error_is_one_line_naming_its_type(monkeypatch, capsys, tmp_path, debug):
    from slurmddp import cli
    from slurmddp.batch.spec import config

    def broken(*args, **kwargs):
        raise OSError("disk on fire\nsecond line")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.setattr(config, "load_sources", broken)
    monkeypatch.setenv("SLURMDDP_DEBUG", "1" if debug else "0")
    with pytest.raises(SystemExit) as info:
        cli.main(["submit", "--dry-run", "train.py"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    last = ("slurmddp submit: error: OSError: disk on fire second line (set SLURMDDP_DEBUG=1 for "
            "the traceback)")  # fmt: skip
    assert err.splitlines()[-1] == last
    assert ("Traceback" in err) == debug
    assert err.count("\n") > 1 if debug else err.count("\n") == 1

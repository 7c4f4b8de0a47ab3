"""What ``slurmddp submit`` asks Slurm for: a frozen `JobSpec`, its parsers and its checks.

Everything here is pure: the parsers turn option text into values, `validate` refuses a spec the
sbatch script could not carry faithfully, and `build_spec` applies the option table's defaults
(`slurmddp.batch.spec.options`, which also holds the rules shared with the configuration files).
Every error is a one-line `SpecError` naming the option, the value and what to do instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

from slurmddp.batch.script import container
from slurmddp.batch.spec import options
from slurmddp.batch.spec.options import (
    BACKENDS,
    CONTAINER_RUNTIMES,
    DEFAULTS,
    GPU_VENDORS,
    LAUNCHERS,
    SIGNALS,
)
from slurmddp.errors import SpecError
from slurmddp.supervisor.launchers import LAUNCHERS as LAUNCHER_TYPES

__all__ = [
    "BACKENDS",
    "LAUNCHERS",
    "MANAGED_SBATCH_OPTIONS",
    "SIGNALS",
    "JobSpec",
    "SpecError",
    "build_spec",
    "parse_env_pair",
    "parse_nodes",
    "parse_time",
    "validate",
]

# srun's --mpi plugin names (pmix, pmi2, pmix_v4, cray_shasta, none...).
_MPI_PLUGIN = re.compile(r"[a-z][a-z0-9_]*")

# sbatch options the script writes itself from JobSpec fields; repeating one through
# sbatch_args would silently override the script's own (and break its log layout or traps).
MANAGED_SBATCH_OPTIONS = {
    "--job-name": "job_name", "-J": "job_name",
    "--nodes": "nodes", "-N": "nodes",
    "--ntasks-per-node": "ntasks_per_node", "--ntasks": "ntasks_per_node", "-n": "ntasks_per_node",
    "--ntasks-per-gpu": "ntasks_per_node",
    "--gpus-per-node": "gpus_per_node", "--gpus": "gpus_per_node", "-G": "gpus_per_node",
    "--gpus-per-task": "gpus_per_node",
    "--cpus-per-task": "cpus_per_task", "-c": "cpus_per_task",
    "--mem": "mem",
    "--time": "time", "-t": "time",
    "--partition": "partition", "-p": "partition",
    "--account": "account", "-A": "account",
    "--qos": "qos", "-q": "qos",
    "--constraint": "constraint", "-C": "constraint",
    "--output": "output_dir", "-o": "output_dir",
    "--error": "output_dir", "-e": "output_dir",
    "--open-mode": "output_dir",
    "--requeue": "requeue", "--no-requeue": "requeue",
    "--signal": "signal",
}  # fmt: skip

# --gres naming GPUs (gpu, gpu:a100:4, shard:2,gpu:1): newer Slurm (26.05 here) refuses it beside
# --gpus-per-node.
_GPU_GRES = re.compile(r"--gres=(?:.*,)?gpu(?:[:,]|$)")
_INTEGER = re.compile(r"[0-9]+")
_ENDPOINT = re.compile(r"[A-Za-z0-9_.-]+:[0-9]{1,5}")
_NODES = re.compile(r"([0-9]+)(?:-([0-9]+))?")
# sbatch --mem: megabytes, or a K, M, G or T suffix with an optional B (sbatch 22.05 takes 1GB
# but refuses 1GiB and 1.5G).
_MEM = re.compile(r"[0-9]+(?:[KMGTkmgt][Bb]?)?")
_UNLIMITED = ("UNLIMITED", "INFINITE")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One ``slurmddp submit`` job: the program, the resources, and how it is launched.

    `target` is the script path then its arguments, or ``("-m", module, *args)``, verbatim.
    `setup` holds raw shell lines (module loads, venv activation): the only user text the batch
    script executes as written. `time_minutes` None means no ``--time`` line, so the
    partition's default limit applies. `snapshot` asks submission for a code snapshot, within
    `snapshot_max_mib` and `snapshot_max_files`; `code_dir` is set once it is taken (or previewed):
    the snapshot's copy of the directory the code came from, and `target` then names the script's
    copy in the snapshot (`slurmddp.batch.transport.snapshot`). None: the files as they are at each
    run.

    A JobSpec is valid by construction (`validate` runs as it is made, ``dataclasses.replace``
    too): what holds one never checks it again.
    """

    target: tuple[str, ...]
    job_name: str
    output_dir: str
    nodes_min: int = DEFAULTS["nodes"]
    nodes_max: int = DEFAULTS["nodes"]
    ntasks_per_node: int = 1
    gpus_per_node: int = DEFAULTS["gpus_per_node"]
    cpus_per_task: int | None = None
    mem: str | None = None
    time_minutes: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    launcher: str = DEFAULTS["launcher"]
    backend: str = DEFAULTS["backend"]
    setup: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    sbatch_args: tuple[str, ...] = ()
    srun_args: tuple[str, ...] = ()
    mpi: str | None = None
    max_requeues: int = DEFAULTS["max_requeues"]
    signal: str = DEFAULTS["signal"]
    signal_lead: int = DEFAULTS["signal_lead"]
    requeue: bool = True
    max_restarts: int = DEFAULTS["max_restarts"]
    hang_timeout: int = DEFAULTS["hang_timeout"]
    leave_slow_nodes: bool = DEFAULTS["leave_slow_nodes"]
    preflight: bool = DEFAULTS["preflight"]
    python: str = dataclasses.field(default_factory=lambda: sys.executable)
    rdzv_port: int | None = None  # None: derived from the job id (slurmddp.agent)
    rdzv_backend: str = DEFAULTS["rdzv_backend"]
    spare_nodes: int = DEFAULTS["spare_nodes"]
    rdzv_endpoint: str | None = None  # None: the first node (c10d only)
    snapshot: bool = DEFAULTS["snapshot"]
    snapshot_max_mib: int = DEFAULTS["snapshot_max_mib"]
    snapshot_max_files: int = DEFAULTS["snapshot_max_files"]
    code_dir: str | None = None
    container: str | None = None
    container_runtime: str = DEFAULTS["container_runtime"]
    container_binds: tuple[str, ...] = ()
    container_args: tuple[str, ...] = ()
    gpu_vendor: str = DEFAULTS["gpu_vendor"]
    workdir: str | None = None  # the submit directory (bound into a container)
    host_python: str = dataclasses.field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def nodes(self) -> str:
        """The node count as sbatch writes it: ``N`` or ``MIN-MAX``."""
        if self.nodes_min == self.nodes_max:
            return str(self.nodes_min)
        return f"{self.nodes_min}-{self.nodes_max}"

    @property
    def allocated_nodes(self) -> str:
        """The nodes the job asks Slurm for: `nodes`, plus the spares."""
        low, high = self.nodes_min + self.spare_nodes, self.nodes_max + self.spare_nodes
        return str(low) if low == high else f"{low}-{high}"

    @property
    def elastic(self) -> bool:
        """torchrun's agents go on in place when a node is lost: a node range, or spares."""
        kind = LAUNCHER_TYPES.get(self.launcher)
        return kind is not None and kind.agents and (
            self.nodes_min < self.nodes_max or self.spare_nodes > 0)


# --- parsers ------------------------------------------------------------------------------------


def parse_time(text: str) -> int | None:
    """Minutes for a Slurm ``--time`` value, or None for no limit.

    Takes every form sbatch does: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``,
    and ``UNLIMITED``/``INFINITE`` (as does 0, which Slurm also reads as no limit). Seconds round
    up to a whole minute, as Slurm does.
    """
    raw = text.strip()
    if raw.upper() in _UNLIMITED:
        return None
    hint = "use M, M:S, H:M:S, D-H, D-H:M, D-H:M:S or UNLIMITED"
    days_part, dash, clock = raw.partition("-")
    if not dash:
        days_part, clock = "", raw
    parts = clock.split(":")
    if not all(_INTEGER.fullmatch(p) for p in [*parts, *([days_part] if dash else [])]):
        raise SpecError(f"time {text!r} is not a Slurm time limit: {hint}")
    numbers = [int(p) for p in parts]
    if dash:
        if len(numbers) > 3:
            raise SpecError(f"time {text!r} has too many fields after the day: {hint}")
        hours, minutes, seconds = [*numbers, 0, 0][:3]
        days = int(days_part)
    else:
        if len(numbers) > 3:
            raise SpecError(f"time {text!r} has too many fields: {hint}")
        # Without days Slurm reads M, M:S and H:M:S: a lone pair is minutes and seconds.
        days = 0
        hours, minutes, seconds = {1: (0, numbers[0], 0), 2: (0, *numbers)}.get(
            len(numbers), tuple(numbers)
        )
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return -(-total // 60) or None


def parse_nodes(text: str) -> tuple[int, int]:
    """``"4"`` gives (4, 4), ``"1-4"`` gives (1, 4): the node counts sbatch ``--nodes`` takes."""
    m = _NODES.fullmatch(text.strip())
    if m is None:
        raise SpecError(f"nodes {text!r} is not a node count: write N or MIN-MAX, e.g. 4 or 2-4")
    lo = int(m[1])
    hi = int(m[2]) if m[2] is not None else lo
    if lo < 1:
        raise SpecError(f"nodes {text!r} asks for no node: the job needs at least 1")
    if lo > hi:
        raise SpecError(f"nodes {text!r} has MIN above MAX: write MIN-MAX with MIN <= MAX")
    return lo, hi


def parse_env_pair(text: str) -> tuple[str, str]:
    """``"KEY=VALUE"`` as (key, value); the value is everything after the first ``=``."""
    key, eq, value = text.partition("=")
    if not eq:
        raise SpecError(f"environment variable {text!r} has no '=': write KEY=VALUE")
    _check_env(key, value)
    return key, value


def _env_pairs(env: Mapping[str, str] | Iterable[str]) -> tuple[tuple[str, str], ...]:
    """A mapping's items, or ``"KEY=VALUE"`` strings parsed (the Python API's older form)."""
    if isinstance(env, Mapping):
        return tuple((str(k), str(v)) for k, v in env.items())
    return tuple(parse_env_pair(pair) for pair in env)


# --- validation ---------------------------------------------------------------------------------


def validate(spec: JobSpec) -> None:
    """Raise `SpecError` for the first value of `spec` that sbatch, srun or bash would refuse or
    misread; return None when the whole spec can be rendered faithfully.

    GPUs: one task per GPU. With GPUs, ntasks_per_node (torchrun's processes per node) must equal
    gpus_per_node; `build_spec` defaults it so.
    """
    _check_target(spec.target)
    _check_line("job_name", spec.job_name)
    _check_resources(spec)
    _check_output_dir(spec.output_dir)
    _check_launch(spec)
    _check_stop(spec)
    if not spec.python:
        raise SpecError("python='' names no interpreter: give the path of python on the nodes")
    _check_no_nul("python", spec.python)
    if spec.rdzv_port is not None and not 1 <= spec.rdzv_port <= 65535:
        raise SpecError(f"rdzv_port={spec.rdzv_port} is not a TCP port: give 1 to 65535")
    _check_container(spec)
    _check_count("snapshot_max_mib", spec.snapshot_max_mib)
    _check_count("snapshot_max_files", spec.snapshot_max_files)
    if spec.code_dir is not None:
        _check_no_nul("code_dir", spec.code_dir)
        if not os.path.isabs(spec.code_dir):
            raise SpecError(f"code_dir={spec.code_dir!r} is relative: give an absolute path")


def _check_container(spec: JobSpec) -> None:
    """The image the ranks run in, and what runs them there."""
    _check_choice("container_runtime", spec.container_runtime, CONTAINER_RUNTIMES)
    _check_choice("gpu_vendor", spec.gpu_vendor, GPU_VENDORS)
    _check_no_nul("host_python", spec.host_python)
    if spec.container is None:
        if spec.container_binds or spec.container_args:
            given = "container_binds" if spec.container_binds else "container_args"
            raise SpecError(f"{given} given without a container: name the image (container)")
        return
    _check_line("container", spec.container)
    if not spec.container.strip():
        raise SpecError(
            f"container={spec.container!r} names no image: give a SIF file or an image URI"
        )
    for name, path in (("output_dir", spec.output_dir), ("workdir", spec.workdir),
                       *(("container_binds", b) for b in spec.container_binds)):  # fmt: skip
        if path is None:
            continue
        _check_line(name, path)
        # The runtimes split their bind lists at commas, and SRC:DST at the colon.
        bad = "," if name == "container_binds" else ",:"
        if any(c in path for c in bad):
            raise SpecError(
                f"{name}={path!r} cannot be bound into the container: the runtime splits its "
                f"list of binds at {' and '.join(repr(c) for c in bad)}; choose a directory "
                "without one"
            )
    for arg in spec.container_args:
        _check_no_nul("container argument", arg)
    if spec.container_runtime == "pyxis":
        if not LAUNCHER_TYPES[spec.launcher].through_srun:
            raise SpecError(
                "container_runtime='pyxis' starts the ranks through srun, but launcher is "
                f"{spec.launcher!r}: use launcher srun or torchrun, or the runtime apptainer"
            )
        for arg in spec.srun_args:
            if arg.startswith("--container-image"):
                raise SpecError(
                    f"srun argument {arg!r} names an image beside container={spec.container!r}: "
                    "give the image once, as container"
                )


def _check_resources(spec: JobSpec) -> None:
    """What the job asks Slurm for: nodes, tasks, GPUs, CPUs, memory, time, names."""
    if spec.nodes_min < 1 or spec.nodes_max < spec.nodes_min:
        raise SpecError(
            f"nodes {spec.nodes_min}-{spec.nodes_max}: need 1 <= MIN <= MAX, e.g. 4 or 2-4"
        )
    _check_count("ntasks_per_node", spec.ntasks_per_node)
    _check_count("gpus_per_node", spec.gpus_per_node)
    if spec.gpus_per_node and spec.ntasks_per_node != spec.gpus_per_node:
        raise SpecError(
            f"ntasks_per_node={spec.ntasks_per_node} with gpus_per_node={spec.gpus_per_node}: "
            f"slurmddp runs one process per GPU; set ntasks_per_node to {spec.gpus_per_node} "
            "or leave it out"
        )
    if spec.cpus_per_task is not None:
        _check_count("cpus_per_task", spec.cpus_per_task)
    if spec.mem is not None and not _MEM.fullmatch(spec.mem):
        raise SpecError(f"mem={spec.mem!r} is not a memory size: write e.g. 64G, 500M or 0")
    if spec.time_minutes is not None:
        _check_count("time_minutes", spec.time_minutes, 1)
    for name in ("partition", "account", "qos", "constraint"):
        value = getattr(spec, name)
        if value is not None:
            _check_name(name, value)


def _check_launch(spec: JobSpec) -> None:
    """How the ranks start: launcher, backend, the user's shell lines, variables and arguments."""
    _check_choice("launcher", spec.launcher, LAUNCHERS)
    _check_choice("backend", spec.backend, BACKENDS)
    if spec.backend == "nccl" and not spec.gpus_per_node:
        raise SpecError("backend='nccl' needs GPUs: set gpus_per_node, or use backend gloo")
    for line in spec.setup:
        _check_no_nul("setup line", line)
    for key, value in spec.env:
        _check_env(key, value)
    for arg in spec.sbatch_args:
        _check_sbatch_arg(arg)
        if spec.gpus_per_node and _GPU_GRES.match(arg):
            raise SpecError(
                f"sbatch argument {arg!r} asks for GPUs beside gpus_per_node="
                f"{spec.gpus_per_node}, which newer Slurm (26.05) refuses: give the GPUs once, "
                "as gpus_per_node"
            )
    for arg in spec.srun_args:
        _check_no_nul("srun argument", arg)
    if spec.mpi is not None:
        if not _MPI_PLUGIN.fullmatch(spec.mpi):
            raise SpecError(f"mpi={spec.mpi!r} is not an MPI plugin name: see `srun --mpi=list`")
        if not LAUNCHER_TYPES[spec.launcher].mpi_plugin:
            raise SpecError(
                f"mpi={spec.mpi!r} is srun's MPI plugin, but launcher is {spec.launcher!r}: use "
                "it with launcher srun"
            )
    _check_count("max_restarts", spec.max_restarts)
    _check_count("hang_timeout", spec.hang_timeout)
    _check_rdzv(spec)
    _check_count("spare_nodes", spec.spare_nodes)
    if spec.spare_nodes and not LAUNCHER_TYPES[spec.launcher].agents:
        raise SpecError(f"spare_nodes={spec.spare_nodes} needs launcher torchrun (its agents take "
                        "a spare into the rendezvous): use launcher torchrun")  # fmt: skip
    if spec.elastic and not spec.max_restarts:
        raise SpecError(f"nodes {spec.nodes} with {spec.spare_nodes} spare under torchrun go on "
                        "when a node is lost by restarting the workers: give max_restarts, the "
                        "losses to survive (e.g. --max-restarts 3)")  # fmt: skip
    if spec.max_restarts and not LAUNCHER_TYPES[spec.launcher].agents:
        raise SpecError(
            f"max_restarts={spec.max_restarts} needs launcher torchrun (srun does not restart "
            "ranks): use launcher torchrun, or leave max_restarts at 0"
        )


def _check_rdzv(spec: JobSpec) -> None:
    """torchrun's rendezvous: a backend it knows, and the endpoint an external one needs."""
    if spec.rdzv_backend not in options.RDZV_BACKENDS:
        raise SpecError(f"rdzv_backend={spec.rdzv_backend!r} is not one of "
                        f"{', '.join(options.RDZV_BACKENDS)}")  # fmt: skip
    given = spec.rdzv_endpoint is not None or spec.rdzv_backend != "c10d"
    if given and not LAUNCHER_TYPES[spec.launcher].agents:
        raise SpecError(f"rdzv_backend/rdzv_endpoint are torchrun's, but launcher is "
                        f"{spec.launcher!r}: use launcher torchrun")  # fmt: skip
    if spec.rdzv_backend != "c10d" and spec.rdzv_endpoint is None:
        raise SpecError(f"rdzv_backend={spec.rdzv_backend} needs rdzv_endpoint, the server's "
                        "HOST:PORT (e.g. etcd.cluster:2379)")  # fmt: skip
    if spec.rdzv_endpoint is not None and not _ENDPOINT.fullmatch(spec.rdzv_endpoint):
        raise SpecError(f"rdzv_endpoint={spec.rdzv_endpoint!r} is not HOST:PORT: give e.g. "
                        "etcd.cluster:2379")  # fmt: skip


def _check_stop(spec: JobSpec) -> None:
    """The stop protocol: the warning signal, its lead time, the requeues."""
    _check_count("max_requeues", spec.max_requeues)
    problem = options.signal_problem(spec.signal)
    if problem is not None:
        raise SpecError(f"signal={spec.signal!r} {problem}")
    lead = options.by_key("signal_lead")
    if not lead.minimum <= spec.signal_lead <= (lead.maximum or spec.signal_lead):
        raise SpecError(
            f"signal_lead={spec.signal_lead} is not a lead time in seconds: "
            f"give {lead.minimum} to {lead.maximum}"
        )
    limit_s = None if spec.time_minutes is None else spec.time_minutes * 60
    if spec.requeue and limit_s is not None and spec.signal_lead >= limit_s:
        raise SpecError(
            f"signal_lead={spec.signal_lead} is not below the time limit of {spec.time_minutes} "
            f"min ({limit_s} s): the warning would come as the job starts; give a "
            "lead shorter than the time, or more time"
        )


def _check_target(target: tuple[str, ...]) -> None:
    if not target:
        raise SpecError("no target: give a script path (and its arguments) or -m MODULE")
    for arg in target:
        _check_no_nul("target argument", arg)
    if target[0] == "-m":
        module = target[1] if len(target) > 1 else ""
        if not all(part.isidentifier() for part in module.split(".")):
            raise SpecError(f"module {module!r} is not a Python module name: write -m pkg.module")
    elif not target[0]:
        raise SpecError("script '' is empty: give the path of a Python file")
    elif target[0].startswith("-"):
        raise SpecError(
            f"script {target[0]!r} starts with '-' and would read as an option: "
            f"write ./{target[0]}, or -m MODULE"
        )


def _check_line(name: str, value: str) -> None:
    """A value written on an #SBATCH line: sbatch reads directives line by line."""
    if not value:
        raise SpecError(f"{name} is empty: give a non-empty value")
    if any(_is_control(c) for c in value):
        raise SpecError(
            f"{name}={value!r} contains a newline or control character, which an #SBATCH line "
            "cannot carry: remove it"
        )


def _check_name(name: str, value: str) -> None:
    _check_line(name, value)
    if any(c.isspace() for c in value):
        raise SpecError(f"{name}={value!r} contains a space: Slurm names have none; remove it")


def _check_output_dir(path: str) -> None:
    _check_line("output_dir", path)
    if not os.path.isabs(path):
        raise SpecError(
            f"output_dir={path!r} is relative, so it would depend on the job's working "
            "directory: give an absolute path"
        )
    if "\\" in path:
        # Slurm drops the backslash and stops expanding %j, so the log would land elsewhere.
        raise SpecError(
            f"output_dir={path!r} contains a backslash, which Slurm log paths drop: choose a "
            "directory without one"
        )


def _check_count(name: str, value: int, minimum: int | None = None) -> None:
    """`value` a whole number of at least `minimum`, by default the option table's."""
    if minimum is None:
        minimum = options.by_key(name).minimum
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{name}={value!r} must be a whole number of at least {minimum}")


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise SpecError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _check_env(key: str, value: str) -> None:
    if not options.ENV_NAME.fullmatch(key):
        raise SpecError(
            f"environment variable name {key!r} is not a shell identifier: use letters, "
            "digits and _, not starting with a digit"
        )
    _check_no_nul(f"environment variable {key}", value)


def _check_sbatch_arg(arg: str) -> None:
    _check_line("sbatch argument", arg)
    if not arg.startswith("-"):
        raise SpecError(
            f"sbatch argument {arg!r} is not an option: give each as one --option=value word"
        )
    option = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
    field = MANAGED_SBATCH_OPTIONS.get(option)
    if field is not None:
        raise SpecError(
            f"sbatch argument {arg!r} sets {option}, which slurmddp writes itself from "
            f"{field}: set {field} instead"
        )


def _check_no_nul(name: str, value: str) -> None:
    if "\0" in value:
        raise SpecError(f"{name} {value!r} contains a NUL byte, which no command line can carry")


def _is_control(c: str) -> bool:
    return unicodedata.category(c) == "Cc"


# --- building -----------------------------------------------------------------------------------


def build_spec(
    target: Sequence[str],
    *,
    cwd: str | None = None,
    requeue: bool = True,
    rdzv_port: int | None = None,
    **values: Any,
) -> JobSpec:
    """A validated `JobSpec` from option values as a command line or configuration has them.

    `values` are keyed by the `build_spec` keywords of `slurmddp.batch.spec.options.OPTIONS` (nodes,
    time, env, output_dir...); a value left out or None takes the table's default. Text is
    parsed: nodes ``"2-4"``, time ``"1:00:00"``; env is a mapping, or ``"KEY=VALUE"`` strings.
    Computed defaults: ntasks_per_node is gpus_per_node (one process per GPU), or 1 without
    GPUs; job_name is the script's stem (or the module name); output_dir is made absolute
    against `cwd` (default: the current directory); python is this interpreter. A keyword no
    option has raises TypeError.
    """
    v = options.spec_defaults(values)
    target = tuple(target)
    nodes_min, nodes_max = parse_nodes(str(v["nodes"]))
    ntasks = v["ntasks_per_node"]
    as_given = ("gpus_per_node", "cpus_per_task", "partition", "account", "qos", "constraint",
                "launcher", "backend", "mpi", "max_requeues", "max_restarts", "signal",
                "signal_lead", "hang_timeout", "leave_slow_nodes", "preflight", "snapshot",
                "snapshot_max_mib", "snapshot_max_files", "rdzv_backend", "rdzv_endpoint",
                "spare_nodes", "container_runtime", "gpu_vendor")  # fmt: skip
    return JobSpec(
        target=target,
        job_name=_default_job_name(target) if v["job_name"] is None else v["job_name"],
        nodes_min=nodes_min,
        nodes_max=nodes_max,
        ntasks_per_node=v["gpus_per_node"] or 1 if ntasks is None else ntasks,
        mem=None if v["mem"] is None else str(v["mem"]),
        time_minutes=None if v["time"] is None else parse_time(str(v["time"])),
        output_dir=os.path.normpath(os.path.join(cwd or os.getcwd(), str(v["output_dir"]))),
        setup=tuple(v["setup"] or ()),
        env=_env_pairs(v["env"] or ()),
        sbatch_args=tuple(v["sbatch_args"] or ()),
        srun_args=tuple(v["srun_args"] or ()),
        python=(
            str(v["python"]) if v["python"] is not None
            else container.DEFAULT_PYTHON if v["container"] is not None else sys.executable
        ),
        container=_image(v["container"], cwd),
        container_binds=tuple(v["container_binds"] or ()),
        container_args=tuple(v["container_args"] or ()),
        workdir=os.path.abspath(cwd or os.getcwd()),
        requeue=requeue,
        rdzv_port=rdzv_port,
        **{name: v[name] for name in as_given},
    )


def _image(value: object, cwd: str | None) -> str | None:
    """The image as the nodes find it: a path made absolute against `cwd`, a URI as given."""
    if value is None:
        return None
    image = str(value)
    if "://" in image or not image.strip():
        return image
    return os.path.normpath(os.path.join(cwd or os.getcwd(), image))


def _default_job_name(target: tuple[str, ...]) -> str:
    if not target:
        return "slurmddp"
    if target[0] == "-m":
        return target[1] if len(target) > 1 else "slurmddp"
    return PurePath(target[0]).stem or "slurmddp"

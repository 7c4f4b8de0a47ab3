"""The options of ``slurmddp submit``, each declared once: flag, key, kind, default, help, rule.

One table, `OPTIONS`, feeds the three places that take these options:

- the command line of ``slurmddp submit`` and ``slurmddp template`` (`add_arguments`): flags and
  help, the defaults shown from the table; argparse keeps every value as typed, None when absent,
  so that the configuration layers can tell typed from not typed;
- the configuration files and profiles (`slurmddp.batch.config`): which keys exist, their types
  and checks (`Option.check`) and the messages naming what was expected;
- `slurmddp.batch.jobspec.build_spec`: its keywords and their defaults (`spec_defaults`).

The value rules that more than one of them apply live here too (the stop signals Slurm can
deliver, environment variable names), so that they cannot disagree; the stop protocol's defaults
come from `slurmddp.protocol`, which the ranks read too. Pure and cheap to import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from slurmddp.protocol import (
    DEFAULT_HANG_TIMEOUT_S,
    DEFAULT_MAX_REQUEUES,
    DEFAULT_SIGNAL,
    DEFAULT_SIGNAL_LEAD_S,
)
from slurmddp.rank.placement import BACKENDS

__all__ = [
    "BACKENDS", "CONTAINER_RUNTIMES", "DEFAULTS", "ENV_NAME", "GPU_VENDORS", "LAUNCHERS", "OPTIONS",
    "SIGNALS", "Invalid", "Option", "add_arguments", "by_key", "format_value", "nonempty",
    "signal_problem", "spec_defaults", "spec_keywords", "toml_key",
]  # fmt: skip

LAUNCHERS = ("srun", "torchrun", "mpirun")
RDZV_BACKENDS = ("c10d", "etcd-v2")  # torchrun's, as slurmddp sets them up
CONTAINER_RUNTIMES = ("apptainer", "singularity", "pyxis")  # slurmddp.batch.container
GPU_VENDORS = ("nvidia", "amd")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Slurm keeps the --signal lead time in 16 bits.
MAX_SIGNAL_LEAD = 0xFFFF

# Signals the batch shell may pass on to the step with `kill -s SIG <srun pid>`: only those srun
# forwards to every task. What srun 22.05 does with the others, checked on the local cluster:
_SIGNAL_PROBLEMS = {
    "TERM": "srun answers it by killing the step at once (SIGKILL), so no rank could checkpoint",
    "HUP": "srun answers it by killing the step at once (SIGKILL), so no rank could checkpoint",
    "QUIT": "srun answers it by killing the step at once (SIGKILL), so no rank could checkpoint",
    "INT": "srun only prints the step's status, it does not pass SIGINT on",
    "ALRM": "srun does not pass it on to the tasks",
    "URG": "srun does not pass it on to the tasks",
    "CONT": "srun does not pass it on to the tasks",
    "TTIN": "srun does not pass it on to the tasks",
    "ABRT": "srun aborts itself on it",
    "TSTP": "srun stops itself on it",
    "TTOU": "srun stops itself on it",
    "KILL": "it cannot be trapped",
    "STOP": "it cannot be trapped",
}
SIGNALS = ("USR2", "USR1")  # the stop signals a job may ask for
_SIGNAL_NAMES = frozenset(SIGNALS) | _SIGNAL_PROBLEMS.keys()


def signal_problem(name: object) -> str | None:
    """What is wrong with `name` as the stop signal, worded to follow it; None if nothing."""
    if not isinstance(name, str):
        return "must be USR2 or USR1"
    if name.upper().startswith("SIG"):
        return f"must be written without SIG, e.g. {name[3:]!r}"
    if name not in _SIGNAL_NAMES:
        return "is not a signal name Slurm knows: use USR2 or USR1"
    if name in _SIGNAL_PROBLEMS:
        return f"cannot warn the ranks: {_SIGNAL_PROBLEMS[name]}; use USR2 or USR1"
    return None


class Invalid(Exception):
    """A value an option refuses; the message follows ``KEY = VALUE`` (``must be ...``)."""


# How an option's value is checked (`Option.check`): see _CHECKS.
Kind = Literal["count", "nodes", "slurm", "choice", "signal", "text", "path", "lines", "env",
               "bool"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of ``slurmddp submit``: its flag, configuration key and `build_spec` keyword."""

    key: str  # the configuration key, and the argparse dest
    kind: Kind
    help: str  # without the default: `help_text` adds it from `default` or `default_help`
    default: Any = None  # None: unset (Slurm's default, or one computed: see default_help)
    default_help: str = ""  # the default in words, when it is computed as the job is built
    minimum: int = 0  # counts
    maximum: int | None = None  # counts
    choices: tuple[str, ...] = ()
    flag: str = ""  # default: --key-with-dashes
    param: str = ""  # the build_spec keyword; default: the key
    config: bool = True  # settable in configuration files and profiles
    spec: bool = True  # a build_spec keyword

    def __post_init__(self) -> None:
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.key.replace("_", "-"))
        if not self.param:
            object.__setattr__(self, "param", self.key)

    @property
    def repeated(self) -> bool:
        """A flag given once per value, whose values every configuration layer adds to."""
        return self.kind in ("lines", "env")

    @property
    def takes_value(self) -> bool:
        """Whether the flag is followed by a value (a bool is ``--flag`` or ``--no-flag``)."""
        return self.kind != "bool"

    def help_text(self) -> str:
        """The ``--help`` line: the help, the choices and the default, all from the table."""
        text = self.help
        if self.choices:
            text += f": one of {', '.join(self.choices)}"
        shown = self.default_help or ("" if self.default is None else str(self.default))
        return f"{text} (default: {shown})" if shown else text

    def check(self, value: object, *, typed: bool = False) -> object:
        """`value` checked and normalised (lists → tuples, env → read-only mapping).

        `typed`: the value was typed on a command line, so numbers come as text and env as
        ``["NAME=VALUE", ...]``. Raises `Invalid`.
        """
        return _CHECKS[self.kind](self, value, typed)


def _count(opt: Option, value: object, typed: bool) -> object:
    # Command lines carry text; in a file, a quoted number is a mistake worth naming.
    if typed and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        value = int(value)
    if _within(value, opt.minimum, opt.maximum):
        return value
    if opt.maximum is not None:
        raise Invalid(f"must be an integer from {opt.minimum} to {opt.maximum}")
    hint = ' or a range "MIN-MAX"' if opt.kind == "nodes" else ""
    raise Invalid(f"must be an integer >= {opt.minimum}{hint}")


def _within(value: object, minimum: int, maximum: int | None) -> bool:
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return minimum <= value and (maximum is None or value <= maximum)


def _nodes(opt: Option, value: object, typed: bool) -> object:
    if isinstance(value, str) and re.fullmatch(r"[0-9]+-[0-9]+", value):
        return value  # a MIN-MAX range; slurmddp.batch.jobspec.parse_nodes checks its bounds
    return _count(opt, value, typed)


def _slurm(opt: Option, value: object, typed: bool) -> object:
    # Slurm reads a bare number as minutes (--time) or megabytes (--mem), so integers are fine
    # too; 0 means no limit (--time) or all of the node's memory (--mem).
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if not nonempty(value):
        raise Invalid('must be a Slurm value such as "64G" or "02:00:00", or an integer >= 0')
    return value


def _choice(opt: Option, value: object, typed: bool) -> object:
    if value not in opt.choices:
        raise Invalid(f"must be one of {', '.join(opt.choices)}")
    return value


def _signal(opt: Option, value: object, typed: bool) -> object:
    problem = signal_problem(value)
    if problem is not None:
        raise Invalid(problem)
    return value


def _text(opt: Option, value: object, typed: bool) -> object:
    if not nonempty(value):
        raise Invalid("must be a path (a non-empty string)" if opt.kind == "path" else
                      "must be a non-empty string")  # fmt: skip
    return value


def _bool(opt: Option, value: object, typed: bool) -> object:
    if not isinstance(value, bool):
        raise Invalid("must be true or false")
    return value


def _lines(opt: Option, value: object, typed: bool) -> object:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise Invalid("must be a list of strings")
    if not all(isinstance(item, str) for item in value):
        raise Invalid("must be a list of strings (quote every item)")
    return tuple(value)


def _env(opt: Option, value: object, typed: bool) -> object:
    if typed and isinstance(value, (list, tuple)):
        pairs = {}
        for item in value:
            if not isinstance(item, str) or "=" not in item:
                raise Invalid("must be NAME=VALUE")
            name, _, text = item.partition("=")
            pairs[name] = text
        value = pairs
    if not isinstance(value, Mapping):
        raise Invalid('must be a table of variables such as { NCCL_DEBUG = "INFO" }')
    out = {}
    for name, text in value.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise Invalid(f"must be a table of variables, and {name!r} is not a variable name")
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)  # OMP_NUM_THREADS = 8 means what it says
        if not isinstance(text, str):
            shown = f"{name} = {format_value(text)}"
            raise Invalid(f"must be a table of strings, and {shown} is not one")
        out[name] = text
    return types.MappingProxyType(out)


def nonempty(value: object) -> bool:
    """Whether `value` is a string with more than white space."""
    return isinstance(value, str) and bool(value.strip())


def format_value(value: object) -> str:
    """A value as it would be written in TOML (for messages and listings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, Mapping):
        inner = ", ".join(f"{toml_key(str(k))} = {format_value(v)}" for k, v in value.items())
        return f"{{ {inner} }}" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def toml_key(name: str) -> str:
    """`name` as a TOML key: bare when it may be, else quoted."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)


_CHECKS = {
    "count": _count, "nodes": _nodes, "slurm": _slurm, "choice": _choice, "signal": _signal,
    "text": _text, "path": _text, "lines": _lines, "env": _env, "bool": _bool,
}  # fmt: skip

# In the order `slurmddp profiles` shows settings and `--help` lists flags.
OPTIONS: tuple[Option, ...] = (
    Option("job_name", "text", "job name", default_help="the script's name", config=False),
    Option("partition", "text", "Slurm partition"),
    Option("account", "text", "Slurm account"),
    Option("qos", "text", "Slurm QOS"),
    Option("constraint", "text", "node features"),
    Option("nodes", "nodes", "N or MIN-MAX", default=1, minimum=1),
    Option("ntasks_per_node", "count", "ranks per node", minimum=1,
           default_help="one per GPU, else 1"),
    Option("gpus_per_node", "count", "GPUs per node", default=0),
    Option("cpus_per_task", "count", "CPUs per rank", minimum=1),
    Option("mem", "slurm", "memory per node, as sbatch --mem"),
    Option("time", "slurm", "time limit in any Slurm form (M, H:M:S, D-H:M...)"),
    Option("signal", "signal", "the signal that warns of preemption or the time limit",
           default=DEFAULT_SIGNAL, choices=SIGNALS),
    Option("signal_lead", "count", "seconds of warning before the time limit",
           default=DEFAULT_SIGNAL_LEAD_S, minimum=1, maximum=MAX_SIGNAL_LEAD),
    Option("max_requeues", "count", "requeues allowed after preemption",
           default=DEFAULT_MAX_REQUEUES),
    Option("max_restarts", "count", "torchrun's restarts of failed workers", default=0),
    Option("spare_nodes", "count", "nodes held in reserve under torchrun: one takes a lost "
           "node's place in the same world size, without a requeue", default=0),
    Option("hang_timeout", "count", "seconds in which no rank made progress (should_stop, "
           "heartbeat) before the job is judged hung, its stacks written and the job ended; "
           "0: no hang watchdog", default=DEFAULT_HANG_TIMEOUT_S),
    Option("preflight", "bool", "before training, prove every node (its GPUs, the collectives "
           "across nodes); a node that fails is left behind and the job requeued at once",
           default=False),
    Option("rdzv_backend", "choice", "torchrun's rendezvous: c10d (a store on the first node) or "
           "etcd-v2 (an etcd server's v2 API, which outlives any node of the job)",
           default="c10d", choices=RDZV_BACKENDS),
    Option("rdzv_endpoint", "text", "HOST:PORT of torchrun's rendezvous (etcd-v2: the etcd "
           "server); unset under c10d: the first node, on a port derived from the job id"),
    Option("launcher", "choice", "what starts the ranks (torchrun: one per node)",
           default="srun", choices=LAUNCHERS),
    Option("backend", "choice", "the process group's backend", default="auto", choices=BACKENDS),
    Option("python", "text", "the interpreter on the nodes", default_help="this one; python3 "
           "in a container"),
    Option("container", "text", "an image every rank runs in: a SIF file, or any image "
           "`apptainer exec` takes; under pyxis an enroot image (a .sqsh file or docker://...)"),
    Option("container_runtime", "choice", "what runs the ranks in the image: apptainer or "
           "singularity (exec per rank), or pyxis (srun --container-image)",
           default="apptainer", choices=CONTAINER_RUNTIMES),
    Option("container_binds", "lines", "one more directory the container sees, as PATH or "
           "SRC:DST (the output and submit directories are bound already); repeatable",
           flag="--container-bind"),
    Option("container_args", "lines", "one more option of apptainer exec, as --writable-tmpfs "
           "(under pyxis: of srun, as --container-remap-root); repeatable",
           flag="--container-arg"),
    Option("gpu_vendor", "choice", "whose GPUs the nodes have: the container's --nv or --rocm",
           default="nvidia", choices=GPU_VENDORS),
    Option("template", "path", "a Jinja sbatch template of your own", spec=False),
    Option("output", "path", "directory for job logs", default="slurmddp-jobs",
           param="output_dir"),
    Option("snapshot", "bool", "run a snapshot of the code taken at submission, so that an edit "
           "after it changes no run of the job, requeued ones included (submit only)",
           default=True),
    Option("snapshot_max_mib", "count", "the largest code snapshot, in MiB", default=50,
           minimum=1),
    Option("snapshot_max_files", "count", "the most files a code snapshot may hold",
           default=10_000, minimum=1),
    Option("setup", "lines", "a shell line run before the job (module load...); repeatable"),
    Option("env", "env", "NAME=VALUE exported to every rank; repeatable"),
    Option("sbatch_args", "lines", "one more sbatch option, as --exclusive; repeatable",
           flag="--sbatch-arg"),
    Option("srun_args", "lines", "one more srun option, as --container-image=...; repeatable",
           flag="--srun-arg"),
    Option("mpi", "text", "srun's MPI plugin for the ranks, as pmix or pmi2 (srun --mpi)"),
)  # fmt: skip

_BY_KEY = types.MappingProxyType({o.key: o for o in OPTIONS})
_BY_PARAM = types.MappingProxyType({o.param: o for o in OPTIONS if o.spec})

# The built-in layer of the configuration: every default that does not depend on the job.
DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {o.key: o.default for o in OPTIONS if o.config and o.default is not None}
)


def by_key(key: str) -> Option:
    """The option of configuration key `key` (KeyError if none)."""
    return _BY_KEY[key]


def spec_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every `build_spec` keyword: `given`, else the table's default (None: computed or unset).

    A None in `given` counts as not given. Raises TypeError for a keyword no option has, as a
    call with a misspelt keyword would.
    """
    unknown = sorted(set(given) - _BY_PARAM.keys())
    if unknown:
        raise TypeError(
            f"build_spec() got unexpected keyword arguments {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_BY_PARAM))}"
        )
    out = {}
    for param, opt in _BY_PARAM.items():
        value = given.get(param)
        out[param] = opt.default if value is None else value
    return out


def spec_keywords(settings: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`build_spec` keywords from resolved configuration ``(key, value)`` pairs."""
    return {_BY_KEY[k].param: v for k, v in settings if k in _BY_KEY and _BY_KEY[k].spec}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The table's flags on `p`: values kept as typed, absent ones None (dest = the key)."""
    for o in OPTIONS:
        if not o.takes_value:  # --flag / --no-flag, None when neither is typed
            p.add_argument(o.flag, dest=o.key, action=argparse.BooleanOptionalAction,
                           default=None, help=o.help_text())  # fmt: skip
        elif o.repeated:
            metavar = "NAME=VALUE" if o.kind == "env" else "VALUE"
            p.add_argument(o.flag, dest=o.key, action="append", metavar=metavar,
                           help=o.help_text())  # fmt: skip
        else:
            p.add_argument(o.flag, dest=o.key, help=o.help_text())

"""The options of ``slurmddp submit``, each declared once: flag, key, kind, default, help, rule.

One table, `OPTIONS`, feeds the three places that take these options:

- the command line of ``slurmddp submit`` and ``slurmddp template`` (`add_arguments`): flags and
  help, the defaults shown from the table; argparse keeps every value as typed, None when absent,
  so that the configuration layers can tell typed from not typed;
- the configuration files and profiles (`slurmddp.batch.spec.config`): which keys exist, their types
  and checks (`Option.check`) and the messages naming what was expected;
- `slurmddp.batch.spec.jobspec.build_spec`: its keywords and their defaults (`spec_defaults`).

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
from slurmddp.supervisor import launchers

__all__ = [
    "BACKENDS", "CONTAINER_RUNTIMES", "DEFAULTS", "ENV_NAME", "GPU_VENDORS", "LAUNCHERS", "OPTIONS",
    "SBATCH_REFUSED", "SIGNALS", "Invalid", "Option", "add_arguments", "by_key", "format_value",
    "nonempty", "sbatch_instead", "signal_problem", "spec_defaults", "spec_keywords", "toml_key",
]  # fmt: skip

LAUNCHERS = tuple(launchers.LAUNCHERS)
RDZV_BACKENDS = ("c10d", "etcd-v2")  # torchrun's, as slurmddp sets them up
CONTAINER_RUNTIMES = ("apptainer", "singularity", "pyxis")  # slurmddp.batch.script.container
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
    if "@" in name or name[:2].upper() in ("B:", "R:"):
        # sbatch's own form, [B:|R:]SIG[@LEAD]: slurmddp writes --signal=B:SIG@LEAD itself.
        sig, _, lead = name.rpartition(":")[2].partition("@")
        lead_part = f" and the lead time as signal_lead (--signal-lead {lead})" if lead else ""
        return (f"must be the signal alone, e.g. {sig!r}{lead_part}: slurmddp writes sbatch's "
                "--signal=B:SIG@LEAD itself")
    if name.isdigit():
        return "must be a signal name, USR2 or USR1 (signal numbers differ between systems)"
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
    short: str = ""  # sbatch's one-letter name for it (-N), where sbatch has one
    log_dir: bool = False  # the logs' directory, whose files slurmddp names: no Slurm %-patterns
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
        return value  # a MIN-MAX range; slurmddp.batch.spec.jobspec.parse_nodes checks its bounds
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
    pattern = _SLURM_PATTERN.search(str(value)) if opt.log_dir else None
    if pattern:
        # sbatch's --output is a file pattern; slurmddp's a directory, which a user of sbatch's
        # "%j.out" would have got literally (a directory named "%j.out").
        raise Invalid(f"must be a directory, and {pattern[0]!r} is Slurm's filename pattern: "
                      "slurmddp names the logs in it itself (<job id>.batch.log, "
                      "<job id>/rank-<rank>.log)")  # fmt: skip
    return value


# Slurm's filename patterns (sbatch --output): %j, %x, %A, %a, %N, %u..., zero-padded as %3a, and
# %% for a percent sign; a % before anything else is a percent sign to Slurm as to slurmddp.
_SLURM_PATTERN = re.compile(r"%[0-9]*[AabJjNnstux%]")


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
    Option("job_name", "text", "job name", default_help="the script's name", config=False,
           short="-J"),
    Option("partition", "text", "Slurm partition", short="-p"),
    Option("account", "text", "Slurm account", short="-A"),
    Option("qos", "text", "Slurm QOS", short="-q"),
    Option("constraint", "text", "node features", short="-C"),
    Option("nodes", "nodes", "N or MIN-MAX", default=1, minimum=1, short="-N"),
    Option("ntasks_per_node", "count", "ranks per node", minimum=1,
           default_help="one per GPU, else 1"),
    Option("gpus_per_node", "count", "GPUs per node", default=0),
    Option("cpus_per_task", "count", "CPUs per rank", minimum=1, short="-c"),
    Option("mem", "slurm", "memory per node, as sbatch --mem"),
    Option("time", "slurm", "time limit in any Slurm form (M, H:M:S, D-H:M...)", short="-t"),
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
    Option("leave_slow_nodes", "bool", "at the next requeue, leave out a node the watchdog named "
           "slow in the run (its ranks busy at least twice as long a step as the median rank)",
           default=False),
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
    Option("output", "path", "directory for job logs (not a file pattern, as sbatch's)",
           default="slurmddp-jobs", param="output_dir", log_dir=True),
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
        flags = (o.short, o.flag) if o.short else (o.flag,)
        if not o.takes_value:  # --flag / --no-flag, None when neither is typed
            p.add_argument(*flags, dest=o.key, action=argparse.BooleanOptionalAction,
                           default=None, help=o.help_text())  # fmt: skip
        elif o.repeated:
            metavar = "NAME=VALUE" if o.kind == "env" else "VALUE"
            p.add_argument(*flags, dest=o.key, action="append", metavar=metavar,
                           help=o.help_text())  # fmt: skip
        else:
            p.add_argument(*flags, dest=o.key, help=o.help_text())


# -- sbatch's names --------------------------------------------------------------------------------
# A name sbatch has means what sbatch means, or is refused with what to use instead: argparse's
# prefix matching once read --ntasks=8 as --ntasks-per-node=8 and --gpus=4 as --gpus-per-node=4
# (issue 44). The table's own flags and their `short` names are sbatch's, with sbatch's meaning;
# SBATCH_REFUSED are those slurmddp does otherwise; the others pass on as --sbatch-arg.

_NTASKS = ("is sbatch's total of tasks, and slurmddp places ranks per node: use --ntasks-per-node "
           "N with --nodes (8 ranks: --nodes 2 --ntasks-per-node 4)")
_GPUS = ("is sbatch's total of GPUs, and slurmddp asks for them per node, one rank each: use "
         "--gpus-per-node N with --nodes (8 GPUs: --nodes 2 --gpus-per-node 4)")
_PER_GPU = "does not apply: slurmddp runs one rank per GPU; use --gpus-per-node N"
_ERROR = ("is not needed: the batch shell's output and errors go to DIR/<job id>.batch.log, the "
          "ranks' to DIR/<job id>/; choose DIR with --output DIR")
_REQUEUE = ("is slurmddp's to set: it requeues a preempted job itself; --max-requeues N says how "
            "often (0: never)")
_WAIT = "is slurmddp submit --follow here: it ends with the job, with the job's exit status"

SBATCH_REFUSED: Mapping[str, str] = types.MappingProxyType({
    "--ntasks": _NTASKS, "-n": _NTASKS,
    "--gpus": _GPUS, "-G": _GPUS,
    "--gpus-per-task": _PER_GPU, "--ntasks-per-gpu": _PER_GPU,
    "--gres": ("is not taken here: GPUs are --gpus-per-node N; pass any other resource on as "
               "--sbatch-arg=--gres=NAME:COUNT"),
    "-o": ("is sbatch's file for the batch log; slurmddp names its logs itself, in the directory "
           "given by --output DIR (DIR/<job id>.batch.log, DIR/<job id>/rank-<rank>.log)"),
    "--error": _ERROR, "-e": _ERROR,
    "--open-mode": "is slurmddp's to set: every run of the job appends to its logs",
    "--requeue": _REQUEUE, "--no-requeue": _REQUEUE,
    "--export": "is --env NAME=VALUE here (repeatable), for every rank",
    "--wrap": ("does not apply: slurmddp runs SCRIPT or -m MODULE on every rank; shell lines to "
               "run before them go in --setup LINE"),
    "--wait": _WAIT, "-W": _WAIT,
    "--parsable": "is slurmddp submit --json here",
    "--test-only": "is slurmddp submit --dry-run here: it prints the batch script, submits nothing",
})  # fmt: skip

# sbatch's other options (22.05 to 26.05), passed on untouched by --sbatch-arg: "name/x" has the
# one-letter name -x, "name?" takes no value or an optional one. Not sbatch's -m (--distribution):
# slurmddp's -m is Python's, a module to run.
_SBATCH_OTHER = """
    acctg-freq array/a batch bb bbf begin/b chdir/D cluster-constraint clusters/M comment
    container-id contiguous? core-spec/S cores-per-socket cpu-freq cpus-per-gpu deadline delay-boot
    dependency/d distribution exclude/x exclusive? export-file extra-node-info/B get-user-env?
    gid gpu-bind gpu-freq gpus-per-socket gres-flags hint hold/H? ignore-pbs? input/i
    kill-on-invalid-dep licenses/L mail-type mail-user mcs-label mem-bind mem-per-cpu mem-per-gpu
    mincpus network nice? no-kill/k? nodefile/F nodelist/w ntasks-per-core ntasks-per-socket
    overcommit/O? oversubscribe/s? power prefer priority propagate? reboot? reservation
    sockets-per-node spread-job? switches thread-spec threads-per-core time-min tmp tres-bind
    tres-per-task uid use-min-nodes? wait-all-nodes wckey
"""
_SBATCH_LONG: dict[str, bool | str] = {}  # "--array": takes a value; "-a": "--array"
for _word in _SBATCH_OTHER.split():
    _name, _, _letter = _word.rstrip("?").partition("/")
    _SBATCH_LONG["--" + _name] = not _word.endswith("?")
    if _letter:
        _SBATCH_LONG["-" + _letter] = "--" + _name


def sbatch_instead(arg: str) -> str | None:
    """What to type instead of `arg` (``--ntasks=8``, ``-n8``, ``--exclusive``), an sbatch option
    that is none of the table's, in one line; None when sbatch has no such name."""
    name, eq, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
    if name in SBATCH_REFUSED:
        return f"{name} {SBATCH_REFUSED[name]}"
    long = _SBATCH_LONG.get(name)
    if isinstance(long, str):  # a one-letter name
        shown, name = f"{name} (sbatch's {long})", long
    elif long is None:
        return None
    else:
        shown = name
    if value or eq:
        name += f"={value}"
    elif _SBATCH_LONG[name]:
        name += "=VALUE"
    return f"{shown} is an sbatch option slurmddp does not set: pass it on as --sbatch-arg={name}"

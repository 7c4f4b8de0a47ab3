"""``slurmddp submit`` and ``slurmddp template``: options → settings → `JobSpec` → script → job.

Nothing here imports torch; validation happens before anything is queued, and every bad input
is a one-line error with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from slurmddp.errors import fail

# Options whose values feed the configuration layers (dest = config key).
_SPEC_OPTIONS = (
    ("--nodes", "nodes", "N or MIN-MAX (default 1)", str),
    ("--gpus-per-node", "gpus_per_node", "GPUs per node (default 0)", str),
    ("--ntasks-per-node", "ntasks_per_node", "ranks per node (default: one per GPU, else 1)", str),
    ("--cpus-per-task", "cpus_per_task", "CPUs per rank", str),
    ("--mem", "mem", "memory per node, as sbatch --mem", str),
    ("--time", "time", "time limit in any Slurm form (M, H:M:S, D-H:M...)", str),
    ("--partition", "partition", "Slurm partition", str),
    ("--account", "account", "Slurm account", str),
    ("--qos", "qos", "Slurm QOS", str),
    ("--constraint", "constraint", "node features", str),
    ("--output", "output", "directory for job logs (default slurmddp-jobs)", str),
    ("--launcher", "launcher", "srun (a task per rank), torchrun (one per node) or mpirun", str),
    ("--mpi", "mpi", "srun's MPI plugin for the ranks, as pmix or pmi2 (srun --mpi)", str),
    ("--backend", "backend", "auto, nccl, gloo or mpi (default auto)", str),
    ("--template", "template", "a Jinja sbatch template of your own", str),
    ("--max-requeues", "max_requeues", "requeues allowed after preemption (default 3)", str),
    ("--max-restarts", "max_restarts", "torchrun's restarts of failed workers (default 0)", str),
    ("--signal-lead", "signal_lead", "seconds of warning before the time limit (default 120)", str),
    ("--signal", "signal", "the warning signal (default USR2)", str),
    ("--python", "python", "the interpreter on the nodes (default: this one)", str),
)
_LIST_OPTIONS = (
    ("--setup", "setup", "a shell line run before the job (module load...); repeatable"),
    ("--env", "env", "KEY=VALUE exported to every rank; repeatable"),
    ("--sbatch-arg", "sbatch_args", "one more sbatch option, as --exclusive; repeatable"),
    ("--srun-arg", "srun_args", "one more srun option, as --container-image=...; repeatable"),
)


def add_arguments(p: argparse.ArgumentParser, *, submitting: bool) -> None:
    """The options of `submit` (and, without the submission ones, of `template`)."""
    p.add_argument("--job-name", dest="job_name", help="job name (default: the script's name)")
    for flag, dest, help_text, kind in _SPEC_OPTIONS:
        p.add_argument(flag, dest=dest, type=kind, help=help_text)
    for flag, dest, help_text in _LIST_OPTIONS:
        p.add_argument(flag, dest=dest, action="append", metavar="VALUE", help=help_text)
    p.add_argument("--profile", help="a cluster profile from the configuration files")
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module instead of a script")
    if submitting:
        p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
        p.add_argument("--follow", action="store_true",
                       help="show state changes and rank 0's log until the job ends")  # fmt: skip
        p.add_argument("--json", action="store_true", help="print the submission as JSON")
        p.add_argument("--local", action="store_true",
                       help="run here without Slurm: nodes x tasks processes")  # fmt: skip
        p.add_argument("--local-signal-after", type=_seconds_list, metavar="S[,S...]",
                       help="with --local: send the stop signal S seconds into each run, one "
                       "value per run (preempting it that often)")  # fmt: skip
    else:
        p.add_argument("-o", "--output-file", dest="output_file", metavar="FILE",
                       help="write the script here (default: standard output)")  # fmt: skip


def split_target(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list, list]:
    """Split at SCRIPT (or after -m MODULE): our options before, the script's argv after.

    An option's value is glued to it (``--sbatch-arg=--exclusive``) so that argparse takes a
    value that starts with a dash as a value, not as an unknown option.
    """
    takes_value = {
        flag for action in parser._actions if action.nargs != 0 for flag in action.option_strings
    }
    own: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return own + list(argv[i : i + 2]), list(argv[i + 2 :])
        if arg == "--":
            return own, list(argv[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            return own, list(argv[i:])
        if arg in takes_value and i + 1 < len(argv):
            own.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            own.append(arg)
            i += 1
    return own, []


def build(opts: argparse.Namespace, rest: list[str], prog: str):
    """(spec, script text) from parsed options; bad input raises `slurmddp.errors.UserError`."""
    from slurmddp.batch import config, jobspec, sbatch, templating

    target = ["-m", opts.module, *rest] if opts.module else rest
    if not target:
        fail("give the SCRIPT to run (or -m MODULE)", prog=prog)
    if not opts.module and not os.path.isfile(target[0]):
        fail(f"script {target[0]!r} not found: give the path of a Python file", prog=prog)

    typed = {dest: getattr(opts, dest) for _, dest, _, _ in _SPEC_OPTIONS}
    typed |= {dest: getattr(opts, dest) for _, dest, _ in _LIST_OPTIONS}
    files = config.load_sources(Path.cwd(), os.environ)
    settings = config.resolve_settings(typed, opts.profile, files)
    values = dict(settings.items())
    spec = jobspec.build_spec(
        target,
        job_name=opts.job_name,
        nodes=values.get("nodes", 1),
        ntasks_per_node=values.get("ntasks_per_node"),
        gpus_per_node=values.get("gpus_per_node", 0),
        cpus_per_task=values.get("cpus_per_task"),
        mem=_text(values.get("mem")),
        time=_text(values.get("time")),
        partition=values.get("partition"),
        account=values.get("account"),
        qos=values.get("qos"),
        constraint=values.get("constraint"),
        output_dir=str(values.get("output", jobspec.DEFAULT_OUTPUT_DIR)),
        launcher=values.get("launcher", "srun"),
        backend=values.get("backend", "auto"),
        setup=values.get("setup", ()),
        env=[f"{k}={v}" for k, v in values.get("env", {}).items()],
        sbatch_args=values.get("sbatch_args", ()),
        srun_args=values.get("srun_args", ()),
        mpi=values.get("mpi"),
        max_requeues=values.get("max_requeues", jobspec.DEFAULT_MAX_REQUEUES),
        max_restarts=values.get("max_restarts", 0),
        signal=values.get("signal", jobspec.DEFAULT_SIGNAL),
        signal_lead=values.get("signal_lead", jobspec.DEFAULT_SIGNAL_LEAD),
        python=_text(values.get("python")),
    )
    template = values.get("template")
    if template is None:
        script = sbatch.render_script(spec)
    else:
        script = templating.render_file(Path(str(template)), **sbatch.context(spec))
    return spec, script


def main_submit(argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    prog = parser.prog
    own, rest = split_target(parser, argv)
    opts = parser.parse_args(own)
    spec, script = build(opts, rest, prog)
    if opts.dry_run:
        sys.stdout.write(script)
        return 0

    from slurmddp.batch import jobs, submission

    try:
        job = submission.submit(spec, local=opts.local, signal_after=opts.local_signal_after or ())
    except submission.SubmissionError as e:
        fail(str(e), prog=prog, status=1)
    record = jobs.find(str(job.job_id))
    assert record is not None
    summary = {
        "job_id": record.job_id,
        "name": record.name,
        "engine": record.engine,
        "job_dir": record.folder,
        "logs": str(record.log("<rank>")),
    }
    if opts.json:
        print(json.dumps(summary))
    else:
        print(f"submitted job {record.job_id} ({record.name}, {record.engine})")
        print(f"  job directory: {record.folder}")
        print(f"  logs:          {summary['logs']}")
    if not opts.follow:
        return 0
    final = jobs.follow(record, lambda: jobs.states([record])[record.job_id])
    return 0 if final == "COMPLETED" else jobs.exit_code(record) or 1


def main_template(argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    own, rest = split_target(parser, argv)
    opts = parser.parse_args(own)
    _, script = build(opts, rest, parser.prog)
    if opts.output_file:
        try:
            Path(opts.output_file).write_text(script, encoding="utf-8")
            Path(opts.output_file).chmod(0o755 & ~_umask())
        except OSError as e:
            fail(f"cannot write {opts.output_file!r}: {e.strerror}; give -o a file in a directory "
                 "you may write to", prog=parser.prog)  # fmt: skip
    else:
        sys.stdout.write(script)
    return 0


def _seconds_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of seconds: give e.g. 5 or 5,8 (one value per run)"
        )
    return values


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

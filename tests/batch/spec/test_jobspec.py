"""Unit tables for slurmddp.batch.spec.jobspec: the option parsers, `validate` and `build_spec`."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from slurmddp.batch.spec.jobspec import (
    JobSpec,
    SpecError,
    build_spec,
    parse_env_pair,
    parse_nodes,
    parse_time,
    validate,
)

# --- parse_time ---------------------------------------------------------------------------------

# Every expected value was checked against `sbatch --time=X` + `scontrol show job` (Slurm 22.05).
TIMES = [
    ("10", 10),  # M
    ("90", 90),
    ("0:30", 1),  # M:S, seconds round up
    ("10:00", 10),
    ("10:01", 11),
    ("90:90", 92),
    ("1:00:00", 60),  # H:M:S
    ("1:30:01", 91),
    ("1:90:00", 150),  # Slurm does not range-check the fields
    ("2-0", 2880),  # D-H
    ("1-2", 1560),
    ("1-2:30", 1590),  # D-H:M
    ("1-2:30:01", 1591),  # D-H:M:S
    ("0-0:0:1", 1),
    ("007", 7),
    (" 15 ", 15),
    ("UNLIMITED", None),
    ("INFINITE", None),
    ("unlimited", None),
    ("Infinite", None),
    ("0", None),  # Slurm reads a zero limit as no limit
    ("0:0", None),
    ("0-0:0:0", None),
]


@pytest.mark.parametrize(("text", "minutes"), TIMES)
def test_parse_time_takes_every_slurm_form(text, minutes):
    assert parse_time(text) == minutes


BAD_TIMES = ["", "  ", "abc", "-5", "-1", "1:2:3:4", "1-2:3:4:5", "1-", "-1-2", ":5", "5:",
             "1::2", "1.5", "1h", "+5", "1 2", "1--2", "1-2-3", "x-1", "1-x", "٣", "1-2:3:x",
             "never"]  # fmt: skip


@pytest.mark.parametrize("text", BAD_TIMES)
def test_parse_time_refuses_garbage_naming_it(text):
    with pytest.raises(SpecError) as e:
        parse_time(text)
    assert repr(text) in str(e.value) and "\n" not in str(e.value)


# --- parse_nodes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "nodes"),
    [("4", (4, 4)), ("1", (1, 1)), ("1-4", (1, 4)), ("2-2", (2, 2)), (" 3 ", (3, 3)),
     ("016", (16, 16)), ("10-100", (10, 100))],
)  # fmt: skip
def test_parse_nodes(text, nodes):
    assert parse_nodes(text) == nodes


@pytest.mark.parametrize(
    ("text", "why"),
    [("0", "no node"), ("0-4", "no node"), ("4-1", "MIN above MAX"), ("", "not a node count"),
     ("a", "not a node count"), ("1-", "not a node count"), ("-1", "not a node count"),
     ("1-2-3", "not a node count"), ("1,2", "not a node count"), ("1.5", "not a node count"),
     ("1:4", "not a node count"), ("²", "not a node count")],
)  # fmt: skip
def test_parse_nodes_refuses(text, why):
    with pytest.raises(SpecError, match=why) as e:
        parse_nodes(text)
    assert repr(text) in str(e.value)


# --- parse_env_pair -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("A=b", ("A", "b")),
        ("A=", ("A", "")),
        ("_X1=a=b=c", ("_X1", "a=b=c")),
        ("NCCL_DEBUG=INFO", ("NCCL_DEBUG", "INFO")),
        ("PATH=/opt/bin:$PATH", ("PATH", "/opt/bin:$PATH")),  # literal: nothing is expanded
        ('Q=it\'s "quoted" `x` $(y)', ("Q", 'it\'s "quoted" `x` $(y)')),
        ("ML=line one\nline two\n", ("ML", "line one\nline two\n")),
        ("U=ünïcødé 日本", ("U", "ünïcødé 日本")),
        ("S= spaces ", ("S", " spaces ")),
    ],
)
def test_parse_env_pair_keeps_the_value_verbatim(text, pair):
    assert parse_env_pair(text) == pair


@pytest.mark.parametrize(
    "text", ["noequals", "=value", "1A=v", "A-B=v", "A B=v", "A.B=v", "é=v", " A=v", "A\n=v",
             "A=v\0w"],
)  # fmt: skip
def test_parse_env_pair_refuses(text):
    with pytest.raises(SpecError) as e:
        parse_env_pair(text)
    assert "\n" not in str(e.value).replace("\\n", "")


# --- validate -----------------------------------------------------------------------------------

GOOD = JobSpec(target=("train.py", "--lr", "0.1"), job_name="train", output_dir="/scratch/runs",
               python="/opt/venv/bin/python")  # fmt: skip

# (field changes, a piece of the message that names the bad value)
BAD_SPECS = [
    ({"target": ()}, "no target"),
    ({"target": ("-m",)}, "module ''"),
    ({"target": ("-m", "my-pkg.train")}, "'my-pkg.train'"),
    ({"target": ("-m", "pkg..train")}, "'pkg..train'"),
    ({"target": ("--help",)}, "'--help'"),
    ({"target": ("",)}, "script ''"),
    ({"target": ("train.py", "a\0b")}, "'a\\x00b'"),
    ({"job_name": ""}, "job_name is empty"),
    ({"job_name": "two\nlines"}, "'two\\nlines'"),
    ({"job_name": "tab\there"}, "'tab\\there'"),
    ({"job_name": "bell\x07"}, "'bell\\x07'"),
    ({"nodes_min": 0, "nodes_max": 0}, "nodes 0-0"),
    ({"nodes_min": 4, "nodes_max": 2}, "nodes 4-2"),
    ({"ntasks_per_node": 0}, "ntasks_per_node=0"),
    ({"gpus_per_node": -1}, "gpus_per_node=-1"),
    ({"gpus_per_node": 8, "ntasks_per_node": 4}, "ntasks_per_node=4 with gpus_per_node=8"),
    ({"gpus_per_node": 4, "ntasks_per_node": 1}, "ntasks_per_node=1 with gpus_per_node=4"),
    ({"cpus_per_task": 0}, "cpus_per_task=0"),
    ({"cpus_per_task": True}, "cpus_per_task=True"),
    ({"mem": "lots"}, "mem='lots'"),
    ({"mem": "64 G"}, "mem='64 G'"),
    ({"mem": "64GiB"}, "mem='64GiB'"),
    ({"mem": "1.5G"}, "mem='1.5G'"),
    ({"time_minutes": 0}, "time_minutes=0"),
    ({"time_minutes": -5}, "time_minutes=-5"),
    ({"partition": "gpu large"}, "partition='gpu large'"),
    ({"partition": ""}, "partition is empty"),
    ({"account": "a\nb"}, "account='a\\nb'"),
    ({"qos": "high\r"}, "qos='high\\r'"),
    ({"constraint": "a100 & ib"}, "constraint='a100 & ib'"),
    ({"output_dir": "runs"}, "output_dir='runs'"),
    ({"output_dir": "/scratch/a\\b"}, "output_dir='/scratch/a\\\\b'"),
    ({"output_dir": "/scratch/a\nb"}, "output_dir='/scratch/a\\nb'"),
    ({"launcher": "mpiexec"}, "launcher='mpiexec'"),
    ({"mpi": "PMIx!"}, "mpi='PMIx!'"),
    ({"mpi": "pmix", "launcher": "torchrun"}, "srun's MPI plugin"),
    ({"backend": "NCCL"}, "backend='NCCL'"),
    ({"backend": "nccl"}, "backend='nccl' needs GPUs"),
    ({"setup": ("module load cuda\0",)}, "setup line"),
    ({"env": (("1BAD", "x"),)}, "'1BAD'"),
    ({"env": (("OK", "a\0b"),)}, "environment variable OK"),
    ({"sbatch_args": ("mail-type=END",)}, "'mail-type=END'"),
    ({"sbatch_args": ("--comment=a\nb",)}, "'--comment=a\\nb'"),
    ({"sbatch_args": ("--time=10",)}, "'--time=10' sets --time"),
    ({"sbatch_args": ("-N2",)}, "'-N2' sets -N"),
    ({"sbatch_args": ("--output=/tmp/x.log",)}, "'--output=/tmp/x.log'"),
    ({"sbatch_args": ("--signal=B:USR1@60",)}, "'--signal=B:USR1@60'"),
    ({"sbatch_args": ("--gres=gpu:4",), "gpus_per_node": 4, "ntasks_per_node": 4},
     "'--gres=gpu:4' asks for GPUs beside gpus_per_node=4"),
    ({"sbatch_args": ("--gres=shard:2,gpu:a100:1",), "gpus_per_node": 1, "ntasks_per_node": 1},
     "'--gres=shard:2,gpu:a100:1' asks for GPUs"),
    ({"srun_args": ("--x=\0",)}, "srun argument"),
    ({"max_requeues": -1}, "max_requeues=-1"),
    ({"signal": "SIGUSR2"}, "signal='SIGUSR2'"),
    ({"signal": "HUP"}, "signal='HUP'"),
    ({"signal": "TERM"}, "signal='TERM'"),
    ({"signal": "KILL"}, "signal='KILL'"),
    ({"signal": "BOGUS"}, "signal='BOGUS'"),
    ({"signal": "usr2"}, "signal='usr2'"),
    ({"signal_lead": 0}, "signal_lead=0"),
    ({"signal_lead": 70000}, "signal_lead=70000"),
    ({"signal_lead": 60, "time_minutes": 1}, "signal_lead=60 is not below the time limit of 1 min"),
    ({"max_restarts": -1, "launcher": "torchrun"}, "max_restarts=-1"),
    ({"max_restarts": 2}, "max_restarts=2 needs launcher torchrun"),
    ({"python": ""}, "python=''"),
    ({"rdzv_port": 0}, "rdzv_port=0"),
    ({"rdzv_port": 65536}, "rdzv_port=65536"),
    ({"rdzv_backend": "etcd", "launcher": "torchrun"}, "rdzv_backend='etcd' is not one of"),
    ({"rdzv_backend": "etcd-v2", "launcher": "torchrun"},
     "rdzv_backend=etcd-v2 needs rdzv_endpoint"),
    ({"rdzv_endpoint": "etcd:2379"}, "rdzv_backend/rdzv_endpoint are torchrun's"),
    ({"rdzv_endpoint": "etcd", "launcher": "torchrun"}, "rdzv_endpoint='etcd' is not HOST:PORT"),
    ({"rdzv_endpoint": "a b:1; x", "launcher": "torchrun"}, "is not HOST:PORT"),
]


def test_the_good_spec_is_valid():
    validate(GOOD)
    validate(dataclasses.replace(GOOD, gpus_per_node=8, ntasks_per_node=8, backend="nccl"))
    validate(dataclasses.replace(GOOD, launcher="torchrun", max_restarts=3, nodes_max=4))
    validate(dataclasses.replace(GOOD, launcher="torchrun", rdzv_backend="etcd-v2",
                                 rdzv_endpoint="etcd-1.hpc.example:2379"))
    validate(dataclasses.replace(GOOD, target=("-m", "pkg.train", "--x"), partition="a,b"))
    validate(dataclasses.replace(GOOD, sbatch_args=("--mail-type=END", "--comment=a # b 'c'")))
    # GPUs by --gres alone, or other generic resources beside gpus_per_node, are Slurm's to judge.
    validate(dataclasses.replace(GOOD, sbatch_args=("--gres=gpu:a100:4",)))
    validate(dataclasses.replace(GOOD, gpus_per_node=2, ntasks_per_node=2,
                                 sbatch_args=("--gres=gpumem:8G,nvme:1",)))


@pytest.mark.parametrize(("changes", "names"), BAD_SPECS, ids=[n for _, n in BAD_SPECS])
def test_validate_refuses_naming_the_value(changes, names):
    with pytest.raises(SpecError) as e:
        validate(dataclasses.replace(GOOD, **changes))
    message = str(e.value)
    assert names in message
    assert "\n" not in message, "errors are one line"


def test_there_are_enough_bad_cases():
    assert len(BAD_SPECS) >= 20


def test_the_signal_error_says_what_to_use_instead():
    with pytest.raises(SpecError, match=r"killing the step at once.*use USR2 or USR1"):
        validate(dataclasses.replace(GOOD, signal="TERM"))
    with pytest.raises(SpecError, match=re.escape("without SIG, e.g. 'USR2'")):
        validate(dataclasses.replace(GOOD, signal="SIGUSR2"))


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GOOD.job_name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(("lo", "hi", "text"), [(4, 4, "4"), (1, 4, "1-4")])
def test_nodes_reads_as_sbatch_writes_it(lo, hi, text):
    assert dataclasses.replace(GOOD, nodes_min=lo, nodes_max=hi).nodes == text


# --- build_spec ---------------------------------------------------------------------------------


def test_build_spec_defaults():
    s = build_spec(["dir/train.py", "--lr", "0.1"], cwd="/home/me/proj")
    assert s.target == ("dir/train.py", "--lr", "0.1")
    assert s.job_name == "train"
    assert (s.nodes_min, s.nodes_max, s.ntasks_per_node, s.gpus_per_node) == (1, 1, 1, 0)
    assert s.output_dir == "/home/me/proj/slurmddp-jobs"
    assert s.python == sys.executable
    assert (s.launcher, s.backend, s.signal, s.signal_lead, s.requeue) == (
        "srun", "auto", "USR2", 120, True)  # fmt: skip
    assert (s.max_restarts, s.rdzv_port, s.time_minutes) == (0, None, None)  # port: the job's


def test_build_spec_one_task_per_gpu_by_default():
    assert build_spec(["t.py"], gpus_per_node=4, cwd="/x").ntasks_per_node == 4
    assert build_spec(["t.py"], gpus_per_node=4, ntasks_per_node=4, cwd="/x").ntasks_per_node == 4
    with pytest.raises(SpecError, match="ntasks_per_node=2 with gpus_per_node=4"):
        build_spec(["t.py"], gpus_per_node=4, ntasks_per_node=2, cwd="/x")


def test_build_spec_parses_option_text():
    s = build_spec(["-m", "pkg.train", "--epochs", "3"], nodes="2-4", time="1-00:00:01",
                   env=["A=1", "B=x=y z"], output_dir="../runs/", cwd="/home/me/proj",
                   setup=["module load cuda"], sbatch_args=["--mail-type=END"])  # fmt: skip
    assert s.job_name == "pkg.train"
    assert (s.nodes_min, s.nodes_max, s.nodes) == (2, 4, "2-4")
    assert s.time_minutes == 24 * 60 + 1
    assert s.env == (("A", "1"), ("B", "x=y z"))
    assert s.output_dir == "/home/me/runs"
    assert s.setup == ("module load cuda",) and s.sbatch_args == ("--mail-type=END",)


def test_build_spec_keeps_an_absolute_output_dir_and_explicit_name():
    s = build_spec(["t.py"], output_dir="/scratch/r", job_name="my run", cwd="/elsewhere")
    assert (s.output_dir, s.job_name) == ("/scratch/r", "my run")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"nodes": "0"}, "nodes '0'"), ({"time": "soon"}, "time 'soon'"),
     ({"env": ["NOPE"]}, "'NOPE'"), ({"launcher": "mpiexec"}, "launcher='mpiexec'")],
)  # fmt: skip
def test_build_spec_reports_bad_options(kwargs, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        build_spec(["t.py"], cwd="/x", **kwargs)

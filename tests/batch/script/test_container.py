"""slurmddp.batch.script.container: how a rank is started in an image, and what reaches it there.

The rank prefix is run for real here, by bash, with a stand-in ``apptainer`` that reports its
arguments, the variables it was handed for the container and its signal dispositions; the real
Apptainer runs in tests/batch/script/test_container_cluster.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurmddp.batch.script import container
from slurmddp.batch.spec.jobspec import JobSpec, build_spec, validate
from slurmddp.errors import SpecError

BASE = JobSpec(target=("train.py",), job_name="train", output_dir="/scratch/runs",
               python="python3", container="/images/torch.sif", workdir="/home/alice/project",
               host_python="/opt/venv/bin/python")  # fmt: skip

STAND_IN = textwrap.dedent("""\
    #!{python}
    import json, os, signal, sys
    handed = {{k: v for k, v in os.environ.items() if k.startswith(("APPTAINERENV_",
                                                                      "SINGULARITYENV_"))}}
    ignored = signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    print(json.dumps({{"argv": sys.argv[1:], "handed": handed, "usr2_ignored": ignored}}))
""")


def run_prefix(tmp_path: Path, spec: JobSpec, env: dict[str, str]) -> dict:
    """Run `spec`'s rank prefix with a stand-in runtime; what the stand-in saw."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    runtime = bin_dir / spec.container_runtime
    runtime.write_text(STAND_IN.format(python=sys.executable))
    runtime.chmod(0o755)
    argv = [*container.rank_prefix(spec), spec.python, "-m", "slurmddp.run", "train.py"]
    r = subprocess.run(argv, env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_rank_is_apptainer_exec_of_the_image_with_the_directories_bound(tmp_path):
    seen = run_prefix(tmp_path, BASE, {})
    assert seen["argv"] == [
        "exec", "--bind", "/scratch/runs,/home/alice/project", "/images/torch.sif",
        "sh", "-c", 'trap "" USR2; exec "$@"', "slurmddp-rank",
        "python3", "-m", "slurmddp.run", "train.py",
    ]  # fmt: skip
    # Ignored on the way in too: a stop signal before the runner takes it ends no rank.
    assert seen["usr2_ignored"]


def test_the_jobs_variables_are_handed_in_to_win_over_the_images(tmp_path):
    spec = dataclasses.replace(BASE, env=(("NCCL_DEBUG", "INFO"), ("GREETING", "a 'b' $c\nd")))
    env = {"SLURM_PROCID": "3", "SLURMD_NODENAME": "n2", "SLURMDDP_SIGNAL": "USR2",
           "PMIX_RANK": "3", "OMPI_COMM_WORLD_RANK": "3", "CUDA_VISIBLE_DEVICES": "1",
           "NCCL_DEBUG": "INFO", "GREETING": "a 'b' $c\nd",
           "HOME_OF_IMAGE": "kept out"}  # fmt: skip
    seen = run_prefix(tmp_path, spec, env)
    assert seen["handed"] == {f"APPTAINERENV_{k}": v for k, v in env.items()
                              if k != "HOME_OF_IMAGE"}  # fmt: skip


def test_singularity_gets_its_own_prefix_and_gpus_their_vendors_flag(tmp_path):
    spec = dataclasses.replace(BASE, container_runtime="singularity", gpus_per_node=4,
                               ntasks_per_node=4, gpu_vendor="amd",
                               container_binds=("/scratch/ckpt", "/data:/mnt/data"),
                               container_args=("--writable-tmpfs",))  # fmt: skip
    seen = run_prefix(tmp_path, spec, {"SLURM_PROCID": "0"})
    assert seen["argv"][:6] == ["exec", "--rocm", "--bind",
                                "/scratch/runs,/home/alice/project,/scratch/ckpt,/data:/mnt/data",
                                "--writable-tmpfs", "/images/torch.sif"]  # fmt: skip
    assert seen["handed"] == {"SINGULARITYENV_SLURM_PROCID": "0"}
    nvidia = dataclasses.replace(spec, gpu_vendor="nvidia")
    assert "--nv" in container.rank_prefix(nvidia)


def test_an_output_directory_in_the_submit_directory_is_bound_with_it():
    inside = dataclasses.replace(BASE, output_dir="/home/alice/project/slurmddp-jobs")
    assert container.binds(inside) == ("/home/alice/project",)
    beside = dataclasses.replace(BASE, output_dir="/home/alice/project-runs")  # a prefix only
    assert container.binds(beside) == ("/home/alice/project-runs", "/home/alice/project")


def test_without_a_container_a_rank_only_ignores_the_stop_signal():
    plain = dataclasses.replace(BASE, container=None)
    assert container.rank_prefix(plain) == ("sh", "-c", 'trap "" USR2; exec "$@"',
                                            "slurmddp-rank")  # fmt: skip
    assert container.srun_args(plain) == ()


def test_pyxis_starts_the_task_in_the_image_through_srun():
    spec = dataclasses.replace(BASE, container="/images/torch.sqsh", container_runtime="pyxis",
                               env=(("NCCL_DEBUG", "INFO"), ("WANDB_MODE", "offline")),
                               container_binds=("/scratch/ckpt",),
                               container_args=("--container-remap-root",))  # fmt: skip
    assert container.srun_args(spec) == (
        "--container-image=/images/torch.sqsh",
        "--container-mounts=/scratch/runs:/scratch/runs,/home/alice/project:/home/alice/project,"
        "/scratch/ckpt:/scratch/ckpt",
        "--container-workdir=/home/alice/project",
        "--container-env=NCCL_DEBUG,WANDB_MODE",
        "--container-remap-root",
    )
    assert container.rank_prefix(spec) == ("sh", "-c", 'trap "" USR2; exec "$@"',
                                           "slurmddp-rank")  # fmt: skip


def test_build_spec_takes_the_images_python_and_an_absolute_image(tmp_path):
    spec = build_spec(["train.py"], cwd=str(tmp_path), container="images/torch.sif")
    assert spec.container == str(tmp_path / "images" / "torch.sif")
    assert spec.python == "python3" and spec.workdir == str(tmp_path)
    assert spec.host_python == sys.executable  # the batch shell's decision stays on the host
    uri = build_spec(["train.py"], cwd=str(tmp_path), container="docker://nvcr.io/nvidia/pytorch")
    assert uri.container == "docker://nvcr.io/nvidia/pytorch"
    own = build_spec(["train.py"], cwd=str(tmp_path), container="x.sif", python="/opt/py/bin/py")
    assert own.python == "/opt/py/bin/py"
    assert build_spec(["train.py"], cwd=str(tmp_path)).python == sys.executable


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"container": None, "container_binds": ("/x",)},
         "container_binds given without a container: name the image"),
        ({"container": None, "container_args": ("--nv",)},
         "container_args given without a container"),
        ({"container_binds": ("/a,b",)}, "container_binds='/a,b' cannot be bound into the "
         "container: the runtime splits its list of binds at ','"),
        ({"output_dir": "/scratch/a:b"}, "output_dir='/scratch/a:b' cannot be bound"),
        ({"container": " "}, "container=' ' names no image"),
        ({"container_runtime": "docker"}, "container_runtime='docker' is not one of apptainer, "
         "singularity, pyxis"),
        ({"gpu_vendor": "intel"}, "gpu_vendor='intel' is not one of nvidia, amd"),
        ({"container_runtime": "pyxis", "launcher": "mpirun"},
         "container_runtime='pyxis' starts the ranks through srun, but launcher is 'mpirun'"),
        ({"container_runtime": "pyxis", "srun_args": ("--container-image=/i.sqsh",)},
         "names an image beside container='/images/torch.sif': give the image once"),
    ],
)  # fmt: skip
def test_what_no_runtime_could_do_is_refused(change, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        validate(dataclasses.replace(BASE, **change))

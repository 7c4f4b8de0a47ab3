"""Ranks inside a container image (``slurmddp submit --container IMAGE``).

Only the ranks run in the image. The batch shell stays on the host: it alone runs Slurm's
commands (``scontrol`` for the requeue decision), so the image needs Python, torch and slurmddp,
and no Slurm, munge or ``/etc/slurm``.

- ``apptainer`` (or ``singularity``): every rank, or torchrun's agent on each node, is
  ``apptainer exec [--nv | --rocm] --bind DIRS IMAGE python3 ...``. Bound at their own paths:
  the output directory (logs, the job's state files, the code snapshot) and the submit directory
  (the script and its relative paths), whatever the centre's defaults; more with
  ``--container-bind``. The job's variables (Slurm's, the MPI launchers', GPU visibility,
  ``--env``) reach the rank as ``APPTAINERENV_NAME``: the image's ``%environment`` would
  otherwise override them (seen with Apptainer 1.4.5). Apptainer starts the container's process
  with every signal at its default, so the rank ignores the stop signal again inside the image
  until its runner takes it; Apptainer's runtime passes the signals it gets on to it.
- ``pyxis`` (enroot): srun starts each task in the image (``--container-image``,
  ``--container-mounts`` for the same directories, ``--container-workdir`` the submit directory,
  ``--container-env`` naming ``--env``'s variables, which the image's would override).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from slurmddp.preemption import signals

if TYPE_CHECKING:
    from slurmddp.batch.spec.jobspec import JobSpec

__all__ = ["DEFAULT_PYTHON", "FORWARDED_NAMES", "FORWARDED_PREFIXES", "binds", "rank_prefix",
           "srun_args"]  # fmt: skip

# The interpreter in the image when --python is not given: every Python image has python3.
DEFAULT_PYTHON = "python3"
# The job's variables that must win over the image's (apptainer): names with these prefixes
# (SLURM covers SLURM_, SLURMD_ and SLURMDDP_; PMI covers PMI_ and PMIX_), and these names.
FORWARDED_PREFIXES = ("SLURM", "PMI", "OMPI_", "MV2_")
FORWARDED_NAMES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                   "GPU_DEVICE_ORDINAL")  # fmt: skip
_GPU_FLAGS = {"nvidia": "--nv", "amd": "--rocm"}
_ENV_PREFIX = {"apptainer": "APPTAINERENV_", "singularity": "SINGULARITYENV_"}


def binds(spec: JobSpec) -> tuple[str, ...]:
    """The directories the container sees at their host paths (the output directory, unless it
    lies in the submit directory, and the submit directory), then the user's binds."""
    own = [spec.output_dir]
    if spec.workdir is not None:
        if os.path.commonpath([spec.workdir, spec.output_dir]) == spec.workdir:
            own = []
        own.append(spec.workdir)
    return (*own, *spec.container_binds)


def rank_prefix(spec: JobSpec) -> tuple[str, ...]:
    """The words that start every rank before its Python: the stop signal ignored (see
    `signals.ignoring`), and under apptainer the image around it."""
    ignoring = signals.ignoring(spec.signal)
    if spec.container is None or spec.container_runtime == "pyxis":
        return ignoring  # pyxis: srun itself starts the task in the image
    runtime = spec.container_runtime
    env = _ENV_PREFIX[runtime]
    names = " ".join([*(f"${{!{p}@}}" for p in FORWARDED_PREFIXES), *FORWARDED_NAMES,
                      *dict.fromkeys(k for k, _ in spec.env)])  # fmt: skip
    handing = (f'trap "" {spec.signal}; for n in {names}; do '
               f'if [[ -v $n ]]; then export "{env}$n=${{!n}}"; fi; done; exec "$@"')  # fmt: skip
    gpus = (_GPU_FLAGS[spec.gpu_vendor],) if spec.gpus_per_node else ()
    return ("bash", "-c", handing, "slurmddp-rank", runtime, "exec", *gpus,
            "--bind", ",".join(binds(spec)), *spec.container_args, spec.container,
            *ignoring)  # fmt: skip


def srun_args(spec: JobSpec) -> tuple[str, ...]:
    """srun's options that start each task in the image (pyxis); none otherwise."""
    if spec.container is None or spec.container_runtime != "pyxis":
        return ()
    args = [f"--container-image={spec.container}",
            "--container-mounts=" + ",".join(_mount(b) for b in binds(spec))]  # fmt: skip
    if spec.workdir is not None:
        args.append(f"--container-workdir={spec.workdir}")
    names = ",".join(dict.fromkeys(k for k, _ in spec.env))
    if names:
        args.append(f"--container-env={names}")
    return (*args, *spec.container_args)


def _mount(bind: str) -> str:
    """A bind as pyxis writes it: SRC:DST (a bare path is mounted at its own path)."""
    return bind if ":" in bind else f"{bind}:{bind}"

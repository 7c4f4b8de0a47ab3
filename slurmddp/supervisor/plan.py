"""What the supervisor runs, fixed at submission: a `Plan`, handed over in the batch script as JSON.

Pure: `slurmddp.batch.script.sbatch` builds it from the job's spec, the supervisor reads it back;
what only the running job knows (its id, its nodes, the restart) comes from the environment Slurm
gives the batch script.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from slurmddp.protocol import DEFAULT_SIGNAL


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The step (and the preflight) of one job, whatever run of it this is."""

    launcher: str  # a name of `slurmddp.supervisor.launchers.LAUNCHERS`
    python: str  # the ranks' interpreter (in the image, under a container)
    target: tuple[str, ...]  # the script and its arguments, or ("-m", module, *args)
    log_root: str  # the output directory, with Slurm's % escaped (srun --output patterns)
    rank_prefix: tuple[str, ...] = ()  # words before each rank's python (the image, signals)
    srun_args: tuple[str, ...] = ()  # the user's, then those that start a task in an image
    cpus_per_task: int | None = None  # each Slurm task's CPUs (torchrun: all of its node's)
    mpi: str | None = None  # srun's MPI plugin
    signal: str = DEFAULT_SIGNAL  # the stop signal's name
    preflight: bool = False  # a task per node checks it before the step (--preflight)
    # torchrun's agents: the nodes (a fixed count, or MIN and the spares when elastic), the
    # workers per node, the rendezvous (None: the allocation's first node) and the restarts.
    nodes: int = 1
    nodes_min: int = 1
    spare_nodes: int = 0
    elastic: bool = False
    nproc_per_node: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str | None = None
    rdzv_port: int | None = None
    max_restarts: int = 0

    def job_dir(self, job_id: str) -> Path:
        """Where the job's ranks log and its runs leave their files: <output dir>/<job id>."""
        return Path(self.log_root.replace("%%", "%")) / job_id

    def to_json(self) -> str:
        """One line of JSON (newlines in values escaped), the defaults left out: what the batch
        script hands over."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.default is dataclasses.MISSING or getattr(self, f.name) != f.default}
        return json.dumps(given, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan `to_json` wrote; ValueError when it is not one (a hand-edited script)."""
        raw = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict):
            raise ValueError("not a plan: a JSON object was expected")
        if set(raw) - fields:
            raise ValueError(f"not a plan of this slurmddp: unknown {sorted(set(raw) - fields)}")
        for name in ("target", "rank_prefix", "srun_args"):
            if name in raw:
                raw[name] = tuple(raw[name])
        return cls(**raw)

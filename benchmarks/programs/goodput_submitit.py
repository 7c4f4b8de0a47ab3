"""The goodput benchmark's submitit peer: a Checkpointable that saves with torch.save every N steps.

    python goodput_submitit.py FOLDER --nodes 2 --time-min 15 --signal-lead 60 -- TRAIN ARGS...

Submits the training of goodput_train.py (its plain loop) as submitit's documentation has it: a
`submitit.helpers.Checkpointable` whose `checkpoint` requeues it (submitit calls it on the time
limit's or a preemption's signal), the process group from
`submitit.helpers.TorchDistributedEnvironment`, the state saved every --save-every steps and
loaded at the start. Prints the job id.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import submitit

sys.path.insert(0, str(Path(__file__).parent))
import goodput_train


class Training(submitit.helpers.Checkpointable):
    """One call trains to the end, resuming from the newest torch.save; requeued on a signal."""

    def __call__(self, argv: list[str]) -> int:
        import torch.distributed as dist

        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int, default=1500)
        p.add_argument("--step-time", type=float, default=0.1)
        p.add_argument("--save-every", type=int, default=100)
        p.add_argument("--log-every", type=int, default=10)
        p.add_argument("--checkpoint-dir", required=True)
        args, _ = p.parse_known_args(argv)
        goodput_train.plain(args)
        dist.destroy_process_group()
        return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--partition", default="debug")
    p.add_argument("--time-min", type=int, default=15)
    p.add_argument("--signal-lead", type=int, default=60)
    p.add_argument("train", nargs=argparse.REMAINDER)
    opts = p.parse_args()
    executor = submitit.AutoExecutor(folder=opts.folder, cluster="slurm")
    executor.update_parameters(nodes=opts.nodes, tasks_per_node=1, timeout_min=opts.time_min,
                               slurm_partition=opts.partition,
                               slurm_signal_delay_s=opts.signal_lead)  # fmt: skip
    job = executor.submit(Training(), [a for a in opts.train if a != "--"])
    print(job.job_id, flush=True)


if __name__ == "__main__":
    main()

"""``python -m slurmddp.emulation batch|srun|scontrol``: ``--local``'s stand-ins of slurmd, srun and
scontrol (`slurmddp.batch.local.emulation`)."""

from slurmddp.batch.local.emulation import main
from slurmddp.launch.runner import exit_process

if __name__ == "__main__":
    exit_process(main())

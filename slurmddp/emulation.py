"""``python -m slurmddp.emulation``: one emulated Slurm task of a ``--local`` job
(`slurmddp.batch.emulation`)."""

from slurmddp.batch.emulation import main
from slurmddp.rank.runner import exit_process

if __name__ == "__main__":
    exit_process(main())

"""Handing a job to Slurm: `snapshot` copies its code first, `submission` renders its script
once and submits it through submitit (on Slurm, or ``--local``), returning its record."""

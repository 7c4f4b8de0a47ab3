"""How a job is submitted: options → settings → `JobSpec` → batch script → job.

`config` reads configuration files and cluster profiles; `jobspec` is the frozen `JobSpec`
with its parsers and checks (pure); `templating` renders the shipped Jinja templates, quoting
everything that reaches a shell; `sbatch` turns a `JobSpec` into the batch script;
`submission` hands it to submitit (Slurm, or ``--local``, whose tasks `emulation` plays);
`jobs` tracks submitted jobs: their files, states, logs, cancel and follow.
"""

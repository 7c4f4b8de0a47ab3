"""How a job is submitted: options → settings → `JobSpec` → batch script → job.

`options` declares every ``slurmddp submit`` option once (flag, config key, type, default, help,
check): the command line, the configuration files and `JobSpec` are all built from it. `config`
reads configuration files and cluster profiles, with the source of every value; `profiles`
lists them. `jobspec` is the frozen `JobSpec` with its checks (pure); `templating` renders the
shipped Jinja templates, quoting everything that reaches a shell; `sbatch` turns a `JobSpec`
into the batch script (the protocol's names come from `slurmddp.protocol`), with `container`'s
words when the ranks run in an image (Apptainer, pyxis); `snapshot` copies
the job's code into its output directory, so that every run runs what was submitted;
`submission` hands it to submitit (Slurm, or ``--local``, whose srun and scontrol `emulation`
stands in for);
`jobs` tracks submitted jobs: their files, states, logs, cancel and follow. `executor` submits a
Python function as a job, in submitit's style (results, arrays, `Checkpointable`); `call` is what
each of its ranks does with the function.
"""

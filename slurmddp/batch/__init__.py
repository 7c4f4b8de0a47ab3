"""How a job is submitted and followed: options → `JobSpec` → batch script → job → its record.

One subpackage per concern, each pointing only at those before it:

- `spec`: what the job is. `options` declares every ``slurmddp submit`` option once (flag,
  config key, type, default, help, check): the command line, the configuration files and
  `JobSpec` are all built from it. `config` reads configuration files and cluster profiles,
  with the source of every value; `profiles` lists them. `jobspec` is the frozen `JobSpec`,
  valid by construction (pure).
- `script`: its batch script. `templating` renders the shipped Jinja templates, quoting
  everything that reaches a shell; `sbatch` turns a `JobSpec` into the script through one typed
  context (`sbatch.Context`, what a template of the user's gets too), with `container`'s words
  when the ranks run in an image (Apptainer, pyxis).
- `jobs`: jobs after submission. `registry` keeps one `JobRecord` per job (the job's handle),
  `states` asks Slurm (one call for many jobs), `follow` streams a job's log to its end.
- `transport`: handing it over. `snapshot` copies the job's code into its output directory, so
  that every run runs what was submitted; `submission` renders the script once and gives it to
  submitit (Slurm, or ``--local``), and returns the job's record.
- `functions`: a Python function as a job, in submitit's style (`executor`: results, arrays,
  `Checkpointable`); `call` is what each of its ranks does with the function.
- `local`: ``--local``'s stand-ins of srun and scontrol (`emulation`), so that a local run is
  the cluster's in miniature.
"""

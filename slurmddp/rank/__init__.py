"""Where a rank is: its place in the job, worked out once from the launcher's variables.

The core is pure: `env.resolve` maps an environment (Slurm's ``SLURM_*``, MPI's, torchrun's)
to a frozen `env.DistEnv` that says where every value came from, reading variables through
`variables` and a Slurm step's task layout through `slurm_step`; `hostlist` expands Slurm's
host lists without ``scontrol``; `placement` chooses backend, device and CPU threads;
`identity` names the run, the same in every requeue (`slurmddp.run_id`). The side effects sit
at the edges: `bootstrap` exports torchrun's variables and the run id, `coordination` keeps the
rendezvous store at hand for waits that no collective timeout bounds, `mpi` asks MPI what only
MPI knows, `output` prefixes a rank's lines. What starts and runs the ranks on top of these is
`slurmddp.launch`; nothing here imports it.
"""

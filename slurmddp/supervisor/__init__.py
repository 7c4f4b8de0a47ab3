"""The job's supervisor: one Python process that runs each run of a ``slurmddp submit`` job.

The batch script holds only what must be shell: the #SBATCH directives, the environment, the
user's setup lines, and the stop signal and TERM noted from its first command on. Then it hands
the job over, with its `plan.Plan` (fixed at submission) as JSON, to
``python -m slurmddp.supervisor`` on the host's Python (no torch imported), which, in one place:

1. listens for the stop signal and TERM, and asks the shell for those that came before;
2. prepares the job's directory and removes what an earlier run left; names what ended the last
   run where it left no decision (Slurm requeued the job: a node of it stopped answering); and
   watches the route to slurmctld (`fence`): cut off past SlurmdTimeout, it ends its own run;
3. runs the preflight and the step (`launchers`: one type per launcher builds its command line),
   passing the stop signal on to it once srun can take it;
4. reads how the run ended (`outcome`), asks the requeue policy (`slurmddp.preemption.decision`)
   with Slurm's record of the job, and carries the verdict out (`slurmddp.preemption.slurm`);
5. ends with the job's exit status.

``slurmddp submit --local`` runs the same batch script, with stand-ins of srun and scontrol
(`slurmddp.batch.local.emulation`): the local run is the cluster's in miniature, supervisor
included.

Modules: `plan` (what the job runs, pure), `launchers` (srun, torchrun, mpirun; pure),
`outcome` (the run's files read), `fence` (a batch host cut off), `supervise` (the process).
"""

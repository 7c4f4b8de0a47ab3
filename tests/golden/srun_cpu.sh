#!/bin/bash
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=2
#SBATCH --output=/scratch/runs/%j.batch.log
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR2@120

# Written by slurmddp submit. Logs, appended to when the job is requeued:
#   <output dir>/<job id>.batch.log        this shell: setup, srun's own messages
#   <output dir>/<job id>/rank-<rank>.log   each rank's output

set -u  # from here on every variable is ours, and every status is handled by hand

export SLURMDDP_MAX_REQUEUES=3
export SLURMDDP_BACKEND=auto

echo "slurmddp: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"
mkdir -p -- /scratch/runs/"$SLURM_JOB_ID" || exit 1

# The step runs in the background so that this shell takes signals while it waits (bash runs a
# trap only between commands). srun passes USR2 on to every task. TERM is only noted: Slurm
# sends it to every step itself, and srun would answer a forwarded TERM by killing the step.
step=
received=  # the last signal trapped, for the requeue decision
interrupted=0
forward() {
    received=$1
    interrupted=1
    if [[ -n $step ]]; then kill -s "$1" "$step" 2>/dev/null; fi
}
note() {
    received=$1
    interrupted=1
}
trap 'forward USR2' USR2
trap 'note TERM' TERM

# srun 22.05 no longer takes --cpus-per-task from the job: the step asks for it again.
srun --kill-on-bad-exit=1 --open-mode=append --output=/scratch/runs/%j/rank-%t.log \
    --cpus-per-task=2 \
    /opt/venv/bin/python -m slurmddp.run train.py --epochs 3 &
step=$!

wait "$step"
status=$?
# A trapped signal ends `wait` early (128+n) while the step runs on: wait again. Bash keeps a
# background job's status until it is collected, so a wait after the step ended still gets it.
while ((interrupted)); do
    interrupted=0
    wait "$step"
    rc=$?
    ((rc == 127)) || status=$rc  # 127: an earlier wait had already collected the status
done

# ---- requeue decision --------------------------------------------------------------------------
# Not made yet: the job ends with the step's status. The decision belongs here, reading $received
# (the signal trapped, if any), $status, ${SLURM_RESTART_COUNT:-0} and $SLURMDDP_MAX_REQUEUES.
# ------------------------------------------------------------------------------------------------
exit "$status"

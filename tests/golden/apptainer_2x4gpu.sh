#!/bin/bash
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --output=/scratch/runs/%j.batch.log
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR2@120

# Written by slurmddp submit. Logs, appended to when the job is requeued:
#   <output dir>/<job id>.batch.log  this shell and the supervisor: setup, srun's own messages
#   <output dir>/<job id>/rank-<rank>.log  each rank's output

# From the first command on, the stop signal and TERM are noted (a preemption, or the --signal
# time of a short limit, can come at any instant) and passed on to the supervisor once it listens:
# it says so with URG, and the shell passes on again what came before. A trap ends `wait` early:
# the shell then waits again. Never trap CONT: Slurm sends it along with both, and bash then
# loses the other trap.
trap 'slurmddp_signals+=" USR2" interrupted=1; ((ready)) && kill -s USR2 "$supervisor" 2>/dev/null' USR2
trap 'slurmddp_signals+=" TERM" interrupted=1; ((ready)) && kill -s TERM "$supervisor" 2>/dev/null' TERM
trap 'ready=1 interrupted=1; for s in $slurmddp_signals; do kill -s "$s" "$supervisor" 2>/dev/null; done' URG
supervisor= ready=0 interrupted=0

# sbatch passes the submitting shell's environment on: launcher variables left there (a torchrun
# tried by hand) must not decide the ranks, nor the run id of a job that submitted this one name
# this one's run. --env values (a run id given there included) are exported after the setup lines.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT PMIX_RANK OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE MV2_COMM_WORLD_RANK MV2_COMM_WORLD_SIZE MV2_COMM_WORLD_LOCAL_RANK MV2_COMM_WORLD_LOCAL_SIZE PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS SLURMDDP_RUN_ID
for name in ${!TORCHELASTIC_@}; do unset "$name"; done
export SLURMDDP_BACKEND=nccl
export SLURMDDP_SIGNAL=USR2
export SLURMDDP_SIGNAL_LEAD=120
export SLURMDDP_MAX_REQUEUES=3
export SLURMDDP_HANG_TIMEOUT=600
export SLURMDDP_LEAVE_SLOW_NODES=0
job_dir=/scratch/runs/"$SLURM_JOB_ID"
export SLURMDDP_REQUEUE_FILE="$job_dir"/requeue
export SLURMDDP_DONE_FILE="$job_dir"/done
export SLURMDDP_ASKED_FILE="$job_dir"/asked
export SLURMDDP_STOP_FILE="$job_dir"/stop
export SLURMDDP_FAILURE_FILE="$job_dir"/failures
export SLURMDDP_EXCLUDED_FILE="$job_dir"/excluded
export SLURMDDP_NODES_LOST_FILE="$job_dir"/nodes-lost
export SLURMDDP_EVENTS_FILE="$job_dir"/events.jsonl
export SLURMDDP_HANG_DIR="$job_dir"/hang
# The code: its files as they are when each run starts (no snapshot of it was taken).
echo "slurmddp: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"
# Checked before the setup lines, which may be what makes the job's python work.
if [[ -e $SLURMDDP_DONE_FILE ]]; then
    # Requeued after its work was done (preempted while exiting): nothing is left to run.
    echo "slurmddp: job $SLURM_JOB_ID finished its work in an earlier run: not run again"
    exit 0
fi

export NCCL_DEBUG=INFO
# The supervisor starts with both signals ignored, until it listens; it is told those taken so far.
(trap '' USR2 TERM; exec /opt/venv/bin/python -m slurmddp.supervisor \
    --plan '{"launcher":"srun","python":"python3","target":["train.py"],"log_root":"/scratch/runs","rank_prefix":["bash","-c","trap \"\" USR2; for n in ${!SLURM@} ${!PMI@} ${!OMPI_@} ${!MV2_@} CUDA_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES GPU_DEVICE_ORDINAL NCCL_DEBUG; do if [[ -v $n ]]; then export \"APPTAINERENV_$n=${!n}\"; fi; done; exec \"$@\"","slurmddp-rank","apptainer","exec","--nv","--bind","/scratch/runs,/home/alice/project,/scratch/ckpt","/scratch/images/pytorch.sif","sh","-c","trap \"\" USR2; exec \"$@\"","slurmddp-rank"],"preflight":true,"nodes":2,"nodes_min":2,"nproc_per_node":4}' --received "$slurmddp_signals" --notify $$) &
supervisor=$!
wait "$supervisor"
status=$?
while ((interrupted)); do
    interrupted=0
    wait "$supervisor"
    rc=$?
    ((rc == 127)) || status=$rc  # 127: an earlier wait had collected the status already
done
exit "$status"

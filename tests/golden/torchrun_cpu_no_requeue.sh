#!/bin/bash
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=3
#SBATCH --output=/scratch/runs/%j.batch.log
#SBATCH --open-mode=append
#SBATCH --no-requeue

# Written by slurmddp submit. Logs, appended to when the job is requeued:
#   <output dir>/<job id>.batch.log        this shell: setup, srun's own messages
#   <output dir>/<job id>/node-<node>.log   each node's torchrun, lines tagged [rank/world size]
#                                           (torchrun's rendezvous decides which ranks a node runs)

set -u  # from here on every variable is ours, and every status is handled by hand

export SLURMDDP_BACKEND=gloo
# The stop protocol (slurmddp.preemption): the ranks stop together on the signal, checkpoint, and
# rank 0 leaves the reason in the requeue file; this shell then requeues the job, so the ranks
# need no Slurm tools (they may run in a container).
export SLURMDDP_SIGNAL=USR2
export SLURMDDP_MAX_REQUEUES=0
job_dir=/scratch/runs/"$SLURM_JOB_ID"
export SLURMDDP_REQUEUE_FILE="$job_dir/requeue"
export SLURMDDP_DONE_FILE="$job_dir/done"
# A rank that fails appends one line naming itself, its node and its error (slurmddp.run).
export SLURMDDP_FAILURE_FILE="$job_dir/failures"
restart=${SLURM_RESTART_COUNT:-0}

echo "slurmddp: job $SLURM_JOB_ID (restart $restart) on $SLURM_JOB_NODELIST"
(umask o-w && mkdir -p -- "$job_dir") || exit 1  # never world-writable, whatever the umask
if [[ -e $SLURMDDP_DONE_FILE ]]; then
    # Requeued after its work was done (preempted while exiting): nothing is left to run.
    echo "slurmddp: job $SLURM_JOB_ID finished its work in an earlier run: not run again"
    exit 0
fi
rm -f -- "$SLURMDDP_REQUEUE_FILE"  # a stale one from a run killed before its decision
rm -f -- "$SLURMDDP_FAILURE_FILE"  # an earlier run's
# torchrun's rendezvous runs on the allocation's first node.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
if [[ -z $head_node ]]; then
    echo "slurmddp: cannot name the first node of $SLURM_JOB_NODELIST" >&2
    exit 1
fi

# srun's own messages land in this shell's log (appended to across runs): where this run's begin.
batch_log=$(readlink -- "/proc/$$/fd/1" 2>/dev/null) || batch_log=
log_start=0
if [[ -f $batch_log ]]; then log_start=$(stat -c %s -- "$batch_log" 2>/dev/null || echo 0); fi

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
srun --kill-on-bad-exit=1 --open-mode=append --output=/scratch/runs/%j/node-%n.log \
    --ntasks-per-node=1 --cpus-per-task=3 \
    /opt/venv/bin/python -m slurmddp.agent \
    --nnodes=2 --nproc-per-node=3 \
    --rdzv-backend=c10d --rdzv-endpoint="$head_node":29400 --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts=0 \
    -m slurmddp.run --tag-output train.py &
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

# Which rank failed: srun names the task and node it saw end first (tasks of one node that end
# together share a line); a rank that raised or exited non-zero appended its own line first.
summarise_failure() {
    local seen= first
    if [[ -f $batch_log ]]; then
        seen=$(tail -c +"$((log_start + 1))" -- "$batch_log" | grep -m 1 -E '^srun: error: [^ ]+: tasks? [0-9,-]+: ')
    fi
    first=$(head -n 1 -- "$SLURMDDP_FAILURE_FILE" 2>/dev/null)
    if [[ $seen =~ ^srun:\ error:\ ([^ ]+):\ (tasks?\ [0-9,-]+):\ (.*)$ ]]; then
        echo "slurmddp: the step failed with status $status; the first to end, as srun saw it: ${BASH_REMATCH[2]} on ${BASH_REMATCH[1]} (${BASH_REMATCH[3]})" >&2
    else
        echo "slurmddp: the step failed with status $status" >&2
    fi
    if [[ -n $first ]]; then
        echo "slurmddp: the first failure a rank reported: ${first#slurmddp: }" >&2
    fi
    if [[ -n $seen && $seen != *"Exited with exit code"* ]]; then
        echo "slurmddp: ${BASH_REMATCH[2]} on ${BASH_REMATCH[1]} was ended by a signal and could not report; failures after it followed from losing it" >&2
    fi
}

# ---- requeue decision --------------------------------------------------------------------------
if [[ ! -e $SLURMDDP_REQUEUE_FILE ]]; then
    if ((status == 0)); then
        : >"$SLURMDDP_DONE_FILE"  # finished: a requeue racing this exit must not run it again
    elif [[ -n $received ]]; then
        echo "slurmddp: the step ended with status $status after $received; no rank asked for a requeue" >&2
    else
        summarise_failure
    fi
    exit "$status"
fi
stopped_by=$(<"$SLURMDDP_REQUEUE_FILE")
rm -f -- "$SLURMDDP_REQUEUE_FILE"

# Why the ranks got the signal: Slurm stamps PreemptTime on a job it preempts; otherwise a signal
# within the lead of the time limit is the limit's warning; anything else was sent by hand.
seconds_left() {  # squeue's %L: [days-][hours:]minutes:seconds, or UNLIMITED
    [[ $1 =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || { echo -1; return; }
    echo $(((((10#${BASH_REMATCH[2]:-0} * 24 + 10#${BASH_REMATCH[4]:-0}) * 60 + 10#${BASH_REMATCH[5]}) * 60) + 10#${BASH_REMATCH[6]}))
}
info=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null)
left=$(seconds_left "$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null)")
if [[ $info == *" PreemptTime="* && $info != *" PreemptTime=None"* ]]; then
    why="preempted, $stopped_by"
elif ((left >= 0 && left <= 120 + 60)); then
    why="time limit, $stopped_by"
else
    why="signal $stopped_by"
fi
target=$SLURM_JOB_ID
if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
    target=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
fi
if ((restart >= SLURMDDP_MAX_REQUEUES)); then
    echo "slurmddp: job $target stopped ($why) at restart $restart after its checkpoint: not requeued, the limit of $SLURMDDP_MAX_REQUEUES requeues (--max-requeues) is reached; submit again to resume" >&2
    # A preempted job is requeued by Slurm itself unless it is told not to be.
    scontrol update JobId="$SLURM_JOB_ID" Requeue=0 >/dev/null 2>&1
    exit 75
fi
echo "slurmddp: job $target stopped ($why) at restart $restart after its checkpoint: requeued ($((restart + 1)) of $SLURMDDP_MAX_REQUEUES)"
if ! scontrol requeue "$target"; then
    echo "slurmddp: scontrol requeue $target failed: the job ends here; submit again to resume" >&2
    exit 75
fi
exit 0

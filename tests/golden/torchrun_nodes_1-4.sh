#!/bin/bash
#SBATCH --job-name=pkg.train
#SBATCH --nodes=1-4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=120
#SBATCH --output=/scratch/runs/%j.batch.log
#SBATCH --open-mode=append
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --signal=B:USR2@300

# Written by slurmddp submit. Logs, appended to when the job is requeued:
#   <output dir>/<job id>.batch.log        this shell: setup, srun's own messages
#   <output dir>/<job id>/node-<node>.log   each node's torchrun, lines tagged [rank/world size]
#                                           (torchrun's rendezvous decides which ranks a node runs)

# Signals are taken before this shell's first command: the stop signal would otherwise end it (a
# preemption, or the --signal time of a short limit, can come at any instant, setup included).
# The step runs in the background so that this shell takes them while it waits (bash runs a trap
# only between commands). The stop signal is left in the stop file for ranks not yet able to take
# it, then passed on to srun, which passes it on to every task; not in srun's first seconds,
# which it would kill or drop. TERM is only noted: Slurm sends it to every step itself, and srun
# would answer a forwarded TERM by killing the step. Never trap CONT: Slurm sends it along with
# both, and bash then loses the other trap.
step=
step_started=0
stop_file=  # set once an earlier run's is removed: a signal before then starts no step anyway
received=  # the signals trapped, for the decision
interrupted=0
on_stop() {
    received="$received $1"
    interrupted=1
    if [[ -n $stop_file ]]; then echo "$1" >"$stop_file" 2>/dev/null || true; fi
    if [[ -z $step ]]; then return; fi
    local early=$((step_started + 2 - SECONDS))
    if ((early > 0)); then
        (sleep "$early"; kill -s "$1" "$step" 2>/dev/null) &
    else
        kill -s "$1" "$step" 2>/dev/null || true
    fi
}
on_term() {
    received="$received TERM"
    interrupted=1
}
trap 'on_stop USR2' USR2
trap on_term TERM

# sbatch passes the submitting shell's environment on: launcher variables left there (a torchrun
# tried by hand) must not decide the ranks, nor the run id of a job that submitted this one name
# this one's run. --env values (a run id given there included) are exported after the setup lines.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT PMIX_RANK OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE MV2_COMM_WORLD_RANK MV2_COMM_WORLD_SIZE MV2_COMM_WORLD_LOCAL_RANK MV2_COMM_WORLD_LOCAL_SIZE PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS SLURMDDP_RUN_ID
for name in ${!TORCHELASTIC_@}; do unset "$name"; done

# The stop protocol (slurmddp.preemption): the ranks stop together on the signal and checkpoint,
# rank 0 leaves the reason in the requeue file, and after the step this shell asks
# slurmddp.preemption.decision, from what Slurm records about the job, whether to requeue it: the
# ranks need no Slurm tools (they may run in a container).
export SLURMDDP_BACKEND=auto
export SLURMDDP_SIGNAL=USR2
export SLURMDDP_SIGNAL_LEAD=300
export SLURMDDP_MAX_REQUEUES=3
export SLURMDDP_HANG_TIMEOUT=600
job_dir=/scratch/runs/"$SLURM_JOB_ID"
export SLURMDDP_REQUEUE_FILE="$job_dir"/requeue
export SLURMDDP_DONE_FILE="$job_dir"/done
export SLURMDDP_ASKED_FILE="$job_dir"/asked
export SLURMDDP_STOP_FILE="$job_dir"/stop
export SLURMDDP_FAILURE_FILE="$job_dir"/failures
export SLURMDDP_EXCLUDED_FILE="$job_dir"/excluded
export SLURMDDP_NODES_LOST_FILE="$job_dir"/nodes-lost
export SLURMDDP_HANG_DIR="$job_dir"/hang
# The code: its files as they are when each run starts (no snapshot of it was taken).
restart=${SLURM_RESTART_COUNT:-0}

echo "slurmddp: job $SLURM_JOB_ID (restart $restart) on $SLURM_JOB_NODELIST"
# Never world-writable, whatever the umask.
(umask o-w && mkdir -p -- "$job_dir") || exit 1
# Checked here, not asked of Python: the setup lines that may make the job's python work have not
# run yet.
if [[ -e $SLURMDDP_DONE_FILE ]]; then
    # Requeued after its work was done (preempted while exiting): nothing is left to run.
    echo "slurmddp: job $SLURM_JOB_ID finished its work in an earlier run: not run again"
    exit 0
fi
# An earlier run's (one killed before its decision leaves them behind); the hang watchdog's
# stacks and report of an earlier run stay, its working state goes.
rm -f -- "$SLURMDDP_REQUEUE_FILE" "$SLURMDDP_FAILURE_FILE" "$SLURMDDP_STOP_FILE" \
    "$SLURMDDP_NODES_LOST_FILE"
rm -rf -- "$SLURMDDP_HANG_DIR/.state"
stop_file=$SLURMDDP_STOP_FILE

set -u  # from here on every variable is ours, and every status is handled by hand

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

# Runs a step in the background, so that this shell takes the signals while it waits (bash runs
# a trap only between commands); its exit status lands in `status`.
run_step() {
    "$@" &
    step=$! step_started=$SECONDS
    # A stop signal trapped between the check before the step and here has not been passed on.
    if [[ $received == *USR2* ]]; then on_stop USR2; fi

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
}

status=  # the step's exit status; stays empty when a signal came before the step started
preflight_status=  # the preflight's, when it failed
if [[ -n $received ]]; then
    echo "slurmddp:${received} came before the step started: not starting it" >&2
else
    # srun 22.05 no longer takes --cpus-per-task from the job: the step asks for it again.
    # Elastic: a node's end ends neither the step nor the job; the other agents re-rendezvous.
    run_step srun --kill-on-bad-exit=0 --no-kill --open-mode=append --output=/scratch/runs/%j/node-%n.log \
        --ntasks-per-node=1 --cpus-per-task=4 \
        sh -c 'trap "" USR2; exec "$@"' slurmddp-rank /opt/venv/bin/python -m slurmddp.agent \
        --nnodes=1:"$SLURM_JOB_NUM_NODES" --nproc-per-node=4 \
        --rdzv-backend=c10d --rdzv-endpoint="$head_node":29500 --rdzv-id="$SLURM_JOB_ID.$restart" \
        --max-restarts=2 \
        -m slurmddp.run --tag-output -m pkg.train --config 'conf/big run.yaml'
fi

# ---- what happens to the job: decided by slurmddp.preemption.decision, carried out here -----
facts=()
if [[ -n $status ]]; then facts+=(--step-status "$status"); fi
if [[ -n $preflight_status ]]; then facts+=(--preflight-status "$preflight_status"); fi
# Which rank failed first: srun names the task and node it saw end first (tasks of one node that
# end together share a line); a rank that raised or exited non-zero appended its own line first.
if [[ -f $batch_log ]]; then
    seen=$(tail -c +"$((log_start + 1))" -- "$batch_log" | grep -m 1 -E '^srun: error: [^ ]+: tasks? [0-9,-]+: ')
    if [[ -n $seen ]]; then facts+=(--srun-error "$seen"); fi
fi
if [[ -s $SLURMDDP_FAILURE_FILE ]]; then
    facts+=(--rank-failure "$(head -n 1 -- "$SLURMDDP_FAILURE_FILE")")
fi
if [[ -e $SLURMDDP_REQUEUE_FILE ]]; then
    facts+=(--asked "$(<"$SLURMDDP_REQUEUE_FILE")")
    rm -f -- "$SLURMDDP_REQUEUE_FILE"
fi
if [[ -e $SLURMDDP_DONE_FILE ]]; then facts+=(--done); fi
if [[ ! -e $SLURMDDP_ASKED_FILE ]]; then facts+=(--protocol-unused); fi
facts+=(--elastic)
if [[ -s $SLURMDDP_NODES_LOST_FILE ]]; then
    facts+=(--nodes-lost "$(head -n 1 -- "$SLURMDDP_NODES_LOST_FILE")")
fi
for sig in $received; do facts+=(--received "$sig"); done
# The signals are in. A requeue (Slurm's, or the one below) sends TERM to this shell and what it
# runs, which must finish: ignored from here on, and so by every command started from here (a
# wrapper that ignored it for one command would take it, and die, in the instant before).
trap '' TERM
hung=0
for verdict in "$SLURMDDP_HANG_DIR"/.state/*/verdict; do
    if [[ -f $verdict ]]; then hung=1; cat -- "$verdict" >&2; fi  # which ranks hung, and where
    while read -r rank node; do
        facts+=(--suspect "$rank:$node")
    done < <(cat -- "${verdict%/verdict}/suspects" 2>/dev/null)
done
if ((hung)); then facts+=(--hung); fi
# The facts and Slurm's record of the job and its partition in; the verdict ACTION STATUS TARGET
# EXCLUDE LEFT_BEHIND out.
decide() {
    {
        scontrol show job -o "$SLURM_JOB_ID"
        scontrol show partition -o "${SLURM_JOB_PARTITION:-}"
    } 2>/dev/null | /opt/venv/bin/python -m slurmddp.preemption.decision "${facts[@]}" "$@"
}
read -r action code target exclude left_behind <<<"$(decide)"
case $action in
    finished)
        : >"$SLURMDDP_DONE_FILE"  # a requeue racing this exit must not run the job again
        exit "$code" ;;
    done|stop) exit "$code" ;;
    fail) exit "$code" ;;
    final)
        # A preempted job is requeued by Slurm itself unless it is told not to be.
        scontrol update JobId="$SLURM_JOB_ID" Requeue=0 >/dev/null 2>&1
        exit "$code" ;;
    requeue)
        if ! scontrol requeue "$target"; then
            # Its answer can be lost while the requeue went through: the decision looks again.
            read -r action code target exclude left_behind <<<"$(decide --requeue-failed)"
        elif [[ $exclude != - ]]; then
            # Slurm changes the nodes a job excludes only while it is pending: now, in the begin
            # time delay of a requeued job.
            if scontrol update JobId="$target" ExcNodeList="$exclude"; then
                echo "$left_behind" >>"$SLURMDDP_EXCLUDED_FILE"
            else
                echo "slurmddp: Slurm refused to exclude $exclude; the requeued job may land there again" >&2
            fi
        fi
        exit "${code:-75}" ;;
    *)
        echo "slurmddp: no decision from python -m slurmddp.preemption.decision; the job ends with the step's status" >&2
        exit "${status:-1}" ;;
esac

"""What slurmddp's processes tell each other: the batch script and its supervisor, the ranks, the
local emulation.

Every ``SLURMDDP_*`` environment variable, every exit status with a meaning of its own and the
stop protocol's defaults are named here, once. Python modules import them; the batch script
template gets them through its render context (`template_names`, as ``p``), so that no name or
status is spelled twice and the shell holds no rule of its own. Pure: nothing is imported.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

# -- environment variables a user may set -------------------------------------------------------

BACKEND_VAR: Final = "SLURMDDP_BACKEND"  # init()'s default backend (submit --backend)
STARTUP_TIMEOUT_VAR: Final = "SLURMDDP_STARTUP_TIMEOUT"  # seconds a rank waits for the others
MASTER_HOST_FORMAT_VAR: Final = "SLURMDDP_MASTER_HOST_FORMAT"  # rank 0's address, e.g. {host}-ib0
# 1 in the one process that serves the rendezvous store at MASTER_ADDR, 0 in the others: rank 0,
# unless a topology plugin laid the tasks out (then the first task on MASTER_ADDR's host).
STORE_SERVER_VAR: Final = "SLURMDDP_STORE_SERVER"
# LOW-HIGH: the ports a job's derived MASTER_PORT (and torchrun rendezvous port) are taken from,
# for a centre whose firewall opens a range of its own (slurmddp.rank.env.port_range).
PORT_RANGE_VAR: Final = "SLURMDDP_PORT_RANGE"
PROFILES_VAR: Final = "SLURMDDP_PROFILES"  # the centre's profiles file
DEBUG_VAR: Final = "SLURMDDP_DEBUG"  # set (not 0): errors come with their traceback
# 0: DataLoaders keep torch's own seeding (slurmddp.training.loader), and no resume of their
# random augmentation, shuffling or dropout after them is exact.
EXACT_DATA_VAR: Final = "SLURMDDP_EXACT_DATA"
# The run's id for trackers, the same in every requeue (slurmddp.rank.identity): exported by
# every rank's bootstrap; one the user set wins (to chain jobs into one run).
RUN_ID_VAR: Final = "SLURMDDP_RUN_ID"
# Where each node keeps the training snapshots of its ranks and the replicas it holds for
# another node (slurmddp.checkpoint.snapshots): a directory in the node's memory or on its own
# disk, never a shared file system. Default /dev/shm.
SNAPSHOT_DIR_VAR: Final = "SLURMDDP_SNAPSHOT_DIR"
# Seconds a snapshot's transfer waits for a peer (plus a second per 50 MiB of its shard) before
# that snapshot is given up on every rank; training goes on. Default 10.
SNAPSHOT_TIMEOUT_VAR: Final = "SLURMDDP_SNAPSHOT_TIMEOUT"
# The documentation site's root that --help links to, for a centre hosting its own copy.
DOCS_URL_VAR: Final = "SLURMDDP_DOCS_URL"

# -- the stop protocol's settings, exported by the batch script (or the local emulation) -------

SIGNAL_VAR: Final = "SLURMDDP_SIGNAL"  # the stop signal's name (USR2, USR1)
SIGNAL_LEAD_VAR: Final = "SLURMDDP_SIGNAL_LEAD"  # seconds before the time limit it comes
MAX_REQUEUES_VAR: Final = "SLURMDDP_MAX_REQUEUES"  # requeues the stop protocol may ask for
# The hang watchdog (slurmddp.watchdog): seconds without progress before the job is judged hung
# (0: no watchdog), and the directory of its files (set: the watchdog runs).
HANG_TIMEOUT_VAR: Final = "SLURMDDP_HANG_TIMEOUT"
HANG_DIR_VAR: Final = "SLURMDDP_HANG_DIR"
# "1": a requeue leaves out a node the watchdog named slow (slurmddp.watchdog.pace).
LEAVE_SLOW_NODES_VAR: Final = "SLURMDDP_LEAVE_SLOW_NODES"
# The job's code snapshot (slurmddp.batch.transport.snapshot): the runner imports `-m` targets from
# it first.
CODE_DIR_VAR: Final = "SLURMDDP_CODE_DIR"

# -- a checkpoint directory's names (slurmddp.checkpoint.layout), which code snapshots leave out --

CHECKPOINT_POINTER: Final = "latest"  # one line: the name of the newest checkpoint beside it
CHECKPOINT_MANIFEST: Final = "manifest.json"  # written last into every checkpoint

# -- the files through which the ranks and the supervisor talk, in <output dir>/<job id>/ -------

REQUEUE_FILE_VAR: Final = "SLURMDDP_REQUEUE_FILE"  # rank 0: the ranks stopped and checkpointed
DONE_FILE_VAR: Final = "SLURMDDP_DONE_FILE"  # rank 0: mark_done() reached
ASKED_FILE_VAR: Final = "SLURMDDP_ASKED_FILE"  # rank 0: the script called should_stop()
STOP_FILE_VAR: Final = "SLURMDDP_STOP_FILE"  # the shell: a stop signal came (for ranks starting)
FAILURE_FILE_VAR: Final = "SLURMDDP_FAILURE_FILE"  # every rank that fails: one line each
# torchrun's agents (slurmddp.agent): too few nodes came back to the rendezvous after a loss.
NODES_LOST_FILE_VAR: Final = "SLURMDDP_NODES_LOST_FILE"
# The shell: each node left behind when the job was requeued, and why (`slurmddp status`).
EXCLUDED_FILE_VAR: Final = "SLURMDDP_EXCLUDED_FILE"
# The job's story (slurmddp.story): one JSON line per event, appended by the supervisor, rank 0
# and the hang watchdog's monitor; `slurmddp status|logs -f|report` read it.
EVENTS_FILE_VAR: Final = "SLURMDDP_EVENTS_FILE"
# The local emulation's state directory (slurmddp.batch.local.emulation): its stand-ins of srun and
# scontrol find the job there.
LOCAL_STATE_VAR: Final = "SLURMDDP_LOCAL_STATE"
# The local emulation's rehearsed stop of this run (``--local-signal-after``): "S" seconds after the
# first step, or "Nsteps"; rank 0 sends the stop signal to the emulated batch job's process,
# $SLURMDDP_LOCAL_BATCH_PID, which hands it to the batch script as Slurm would.
LOCAL_REHEARSAL_VAR: Final = "SLURMDDP_LOCAL_REHEARSAL"
LOCAL_BATCH_PID_VAR: Final = "SLURMDDP_LOCAL_BATCH_PID"

# (variable, file name) of each file the batch script creates the variable for.
STATE_FILES: Final = (
    (REQUEUE_FILE_VAR, "requeue"),
    (DONE_FILE_VAR, "done"),
    (ASKED_FILE_VAR, "asked"),
    (STOP_FILE_VAR, "stop"),
    (FAILURE_FILE_VAR, "failures"),
    (EXCLUDED_FILE_VAR, "excluded"),
    (NODES_LOST_FILE_VAR, "nodes-lost"),
    (EVENTS_FILE_VAR, "events.jsonl"),
    (HANG_DIR_VAR, "hang"),  # a directory: the watchdog's stacks, report and per-run state
)

# -- exit statuses ------------------------------------------------------------------------------

SUCCESS: Final = 0
INTERNAL_ERROR: Final = 1  # something unexpected (the message names the exception)
USAGE_ERROR: Final = 2  # bad input: one line says what and what to do
# Stopped for good without finishing (no requeue left, or nothing requeues it): EX_TEMPFAIL,
# "try again later", which is what submitting again from the checkpoint does.
NOT_REQUEUED_STATUS: Final = 75
# A batch host cut off from slurmctld for SlurmdTimeout ended its own run
# (slurmddp.supervisor.fence): EX_UNAVAILABLE. Nobody reads it: Slurm has requeued the job by then.
FENCED_STATUS: Final = 69
# A rank the hang watchdog ended (coreutils' `timeout` status: no progress in time).
HANG_STATUS: Final = 124
# submitit's LocalExecutor starts the tasks again when one exits with this status.
LOCAL_REQUEUE_STATUS: Final = 144

# -- the stop protocol's defaults ---------------------------------------------------------------

DEFAULT_SIGNAL: Final = "USR2"
DEFAULT_SIGNAL_LEAD_S: Final = 120
DEFAULT_MAX_REQUEUES: Final = 3
DEFAULT_HANG_TIMEOUT_S: Final = 600
# A signal srun gets in its first moments kills it or is dropped (docs/slurm-behaviour.md, Q6):
# the supervisor passes the stop signal on no sooner than this many seconds after starting srun.
SRUN_SETTLE_S: Final = 2

# The preflight's check, run on every node (``--preflight``) by python -m slurmddp.run -m.
PREFLIGHT_MODULE: Final = "slurmddp.launch.preflight"

# The job's supervisor (slurmddp.supervisor): the batch script hands each run over to it.
SUPERVISOR_MODULE: Final = "slurmddp.supervisor"

# -- the decision after each run's step (slurmddp.preemption.decision) --------------------------

# Run as python -m, it prints a verdict: the batch scripts of earlier templates ask it.
DECISION_MODULE: Final = "slurmddp.preemption.decision"
# What a verdict says is done (slurmddp.preemption.slurm): end with STATUS (done: the work is
# finished; finished: the same, and the done marker is left for a later requeue to find), requeue
# the job (and set its ExcNodeList when a node is left behind), stop (final: and tell Slurm not to
# requeue it), or fail.
ACTIONS: Final = ("done", "finished", "requeue", "stop", "final", "fail")


def template_names() -> MappingProxyType[str, object]:
    """Every name above, for templates: ``{{ p.DONE_FILE_VAR }}`` renders SLURMDDP_DONE_FILE."""
    return MappingProxyType({k: v for k, v in globals().items() if k.isupper()})

"""Snapshots: a training's state every few steps in the memory of its nodes, so that an unplanned
failure (a node lost, a rank killed) costs the steps since the last snapshot, not everything
since the last durable checkpoint.

    ckpt = slurmddp.Checkpointer("ckpt", snapshot_every=1)
    loaded = ckpt.load_latest()           # the newest complete snapshot, else the checkpoint
    for ...:
        ...                               # one step
        ckpt.snapshot(step, state)        # state: a mapping, or a function returning one

Concepts:

- **Shard**: one rank's state at one step, in `flat`'s format (a JSON tree and the tensors'
  bytes; no pickle). Every rank keeps its own
  (its random generators, its data position), so that a rank put in another's place resumes
  exactly as that one would have.
- **Node store** (`store`): a directory on the node, in /dev/shm unless ``$SLURMDDP_SNAPSHOT_DIR``
  names another node-local place, keyed by the job, its restart, its step and the node
  (`store.run_key`): it outlives the worker processes that crashed (torchrun restarts them on
  the same node), not the node. Its user's alone: directories 0700, files 0600, and one found
  there already that is not a real directory of the user closed to others is refused
  (`store.StoreRefused`). A shard's name says its incarnation (a token of the set of processes
  that took it), so that the shards of two runs at one step never make one set.
- **Part** (`flat.make_part`): under DDP the ranks of a node hold one model and optimizer alike.
  The node's lead (its lowest rank) writes its whole shard and tells the node's other ranks
  (over the transfers' group, bounded); each of them compares its state with the lead's file
  block by block, exactly, and writes a part: its own header and the blocks that differ (its
  random generators, its data position). Its name says the rank whose shard it completes
  (`Shard.base`); its crc32 is the whole state's. A lead with no shard in the store says so, and
  the others write theirs whole, as does a rank whose part would be no smaller. A node keeps
  about one state a step, not one a rank.
- **Replica** (`plan.replica_keepers`): each shard (whole or part, as written) also goes to a
  rank of the next node, which keeps it in its own store; one node's ranks all send to the next
  node, so a part's base is kept beside it. Losing any one node leaves a complete set.
- **Taking** (`snapshotter.Snapshots.take`): the state's tensors are copied to CPU memory at the
  call (GPU ones into pinned buffers, queued on their streams behind the step that made them, so
  the call does not wait for the GPU); checksumming, writing and sending happen in a thread,
  on a gloo group of its own, while training goes on. A failure there is said and never fails
  the training: the failing rank still tells its peers it has no shard, every wait is bounded
  (``$SLURMDDP_SNAPSHOT_TIMEOUT``), and the group is rebuilt by every rank at the next
  snapshot. The `keep` newest steps stay, so a failure during a snapshot leaves the one before
  it complete; with `keep` >= 2 a new shard is written over the file of the oldest (a new file
  in memory costs its pages' zeroing).
- **Pace** (`pace.Pace`): snapshots every `every` steps, spaced wider (by multiples of it) when
  they would take more than the budget of the training's time, measured by each rank on its own
  steps (medians, so that an evaluation or a save between steps does not move it); the ranks
  agree on the widest need at each snapshot, so all take the same steps.
- **Recovery** (`plan.candidates`): at `load_latest`, the ranks pool what their nodes hold, take
  the newest step newer than the durable checkpoint for which every shard they need, of one
  incarnation (the processes that took it), is on some surviving node (a part with its base),
  fetch the files their own node lacks from a peer that has them, and check each state against
  its crc32 (a part read over its base in place, from the files' mappings); where one fails, the
  next older complete snapshot. None: the durable checkpoint, as without snapshots.
- **Bounds**: a store keeps at most `keep` steps (one incarnation each) of its ranks and of the
  ranks it keeps replicas of, pruned by listing it, so that a restarted worker removes what its
  predecessor left; it never takes the last 1 GiB (or tenth) of its file system nor, in memory,
  of the job's memory cgroup; a node short of room says so once and keeps none (its ranks'
  replicas are still kept by the next node).
- **Cleanup**: `mark_done()` and `requeue()` remove the run's snapshots from the nodes. A requeue
  starts a new run of the job, on whatever nodes, from the durable checkpoint (the stop protocol
  writes one at the stop step): its start removes the earlier runs' stores on its nodes. Each
  process records itself and its parent (torchrun's agent) as an owner of its store; any run's
  start removes the user's stores whose owners are all gone. A Slurm epilog can remove a job's
  stores at its end (docs/concepts/snapshots.md has the lines).

Modules: `store` (the node's files), `plan` (pure rules), `pace` (the interval: pure), `peers`
(point-to-point transfers), `flat` (the format), `snapshotter` (`Snapshots`, used by
`Checkpointer`).
"""

from slurmddp.checkpoint.snapshots.snapshotter import Snapshots, close_all

__all__ = ["Snapshots", "close_all"]

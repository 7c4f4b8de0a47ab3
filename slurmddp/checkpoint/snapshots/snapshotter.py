"""`Snapshots`: a rank's training state every N steps in its node's memory and a peer's, and the
recovery from the newest complete set."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import secrets
import sys
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from slurmddp import dist
from slurmddp.checkpoint import inflight, ranks
from slurmddp.checkpoint.background import Worker
from slurmddp.checkpoint.loading import Checkpoint
from slurmddp.checkpoint.snapshots import flat, pace, peers, plan
from slurmddp.checkpoint.snapshots.flat import Buffer, pack_async
from slurmddp.checkpoint.snapshots.store import NodeStore, Shard, node_directory, node_name
from slurmddp.checkpoint.state import check_state, check_step
from slurmddp.errors import CheckpointError, one_line
from slurmddp.protocol import SNAPSHOT_TIMEOUT_VAR

_live: weakref.WeakSet[Snapshots] = weakref.WeakSet()
MIB = 1 << 20
DEFAULT_TIMEOUT_S = 10.0
# The slowest pace assumed of a peer's checksum, write or link, per byte of a shard: a transfer
# waits DEFAULT_TIMEOUT_S plus this long for the peer (a second per 50 MiB).
SLOWEST_BYTES_PER_S = 50 * MIB
# At the interpreter's exit a snapshot in flight is waited for this long, then left: the durable
# checkpoints stand, and its transfers are bounded in any case.
EXIT_WAIT_S = 5.0
# Whether the ranks of a node keep one copy of what they hold alike (`Snapshots._write`); off,
# each keeps its whole state, as before parts (the snapshot benchmark's baseline).
SHARE = True


class _NoRoom(Exception):
    """This node's store has no room for a shard (said once); the durable checkpoints stand."""


class Snapshots:
    """Every `every` steps, this rank's state copied to CPU memory at once, then written to its
    node's store and sent to the rank on the next node that keeps its replica, in a thread; the
    `keep` newest steps stay. Collective: every rank takes the same snapshots. With a `budget`
    (a fraction of the training's time), they are spaced wider when they would cost more
    (`pace`)."""

    @staticmethod
    def check_options(every: object, keep: object, budget: object) -> None:
        """ValueError naming the first of `snapshot_every`, `snapshot_keep` and `snapshot_budget`
        (as the Checkpointer and the integrations take them) that is out of range."""
        for name, value, least in (("snapshot_every", every, 0), ("snapshot_keep", keep, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least else "an integer >= 0"
                raise ValueError(f"{name} must be {kind}, not {value!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float)
                                   or not 0 < budget < 1):  # fmt: skip
            raise ValueError(f"snapshot_budget must be a fraction of the training's time between 0 "
                             f"and 1 (0.02 is 2%), or None for no limit, not {budget!r}")

    @staticmethod
    def refuse_sharded(kind: str) -> ValueError:
        """The error for snapshots asked where each rank holds a part of the model's state
        (`kind`: FSDP, DeepSpeed...), as the framework integrations raise it."""
        return ValueError(f"snapshots keep replicated states only, and under {kind} each rank "
                          "holds a part of the model's: leave snapshot_every at 0 there (the "
                          "stop's checkpoint still works)")  # fmt: skip

    def __init__(self, every: int, keep: int, budget: float | None = None,
                 scope: str | os.PathLike[str] | None = None) -> None:  # fmt: skip
        self.every = every
        self.keep = keep
        # The directory of the durable checkpoints these snapshots stand beside: snapshots of two
        # directories never share a store (set before the first snapshot or recovery).
        self.scope = scope
        self._pace = pace.Pace(every, budget)
        self._called = 0.0  # when the current call began
        self._returned: float | None = None  # when the last call returned
        self._beside = False  # whether a snapshot was in flight then
        # Seconds of the current call that are not the snapshot's cost: the set-up (a group, a
        # collective check; paid once) and the wait for the snapshot before (the interval covers
        # it: `pace`).
        self._unpaid = 0.0
        self._ran: float | None = None  # the seconds the last snapshot's thread ran
        self._store: NodeStore | None = None
        self._control: Any = None  # the training thread's agreements
        self._transfer: Any = None  # the background thread's transfers; rebuilt after an error
        self._broken = False  # a transfer failed: the transfer group is rebuilt at the next take
        self._inc = 0  # this set of processes' incarnation: its shards are never mixed with others
        self._nodes: list[str] = []
        self._keeper: int | None = None  # the rank that keeps this rank's replica
        self._senders: list[int] = []  # the ranks whose replicas this rank keeps
        # The node's lead (its lowest rank) keeps its whole state, the others parts over it.
        self._lead: int | None = None  # on another rank of the node: that rank (the lead's)
        self._followers: list[int] = []  # on the lead: the node's other ranks
        self._buffer = Buffer()
        self._worker = Worker("slurmddp-snapshot")
        self._order: int | None = None  # the snapshot in flight, in `inflight`
        self._written: list[Shard] = []  # the files this rank wrote and keeps
        self._said: set[str] = set()
        self._checked = False  # the first snapshot's state was checked on every rank
        _live.add(self)
        from slurmddp.preemption.api import state  # the stop protocol's, imported late

        # The run ends (mark_done, requeue): the snapshots in the nodes' memory go (the work is
        # done, or the stop's checkpoint is durable).
        state().on_leave(close_all)

    @property
    def interval(self) -> int:
        """The steps between snapshots now: `every`, or more to keep within the budget."""
        return self._pace.interval

    def due(self, step: int) -> bool:
        """Whether a snapshot is due at `step`; called once per step, it also times the step."""
        self._called = time.perf_counter()
        if self._returned is not None:
            self._pace.stepped(self._called - self._returned, self._beside)
        if self._pace.due(step):
            return True
        self._returned, self._beside = time.perf_counter(), not self._worker.idle()
        return False

    def offer(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]
              ) -> bool:  # fmt: skip
        """Take `state` as step `step`'s snapshot when one is due; called after every step, on
        every rank. `state` may be a function returning it, called only then, with
        `train_state.own_rank_only` (this rank's random state, no gather). Whether it was taken."""
        refusal = check_step(step)
        if refusal is not None:
            raise CheckpointError(refusal)
        if not self.due(step):
            return False
        if callable(state):
            from slurmddp.training import train_state

            with train_state.own_rank_only():
                state = state()
        if not self._checked:
            # The first snapshot's state is checked on every rank; later ones have its shape (a
            # collective per step would cost more than the snapshot itself).
            checking = time.perf_counter()
            refusal = check_state(state, sharded=False)
            if not ranks.agree(refusal is None):
                raise CheckpointError(refusal or f"snapshot of step {step} was refused on "
                                      "another rank: see its error")  # fmt: skip
            self._checked = True
            self._unpaid += time.perf_counter() - checking
        self.take(step, state)
        return True

    def take(self, step: int, state: Mapping[str, Any]) -> None:
        """Lay `state` into this rank's buffer now (CPU tensors copied, GPU ones queued on their
        streams); write and replicate it in the background (the previous snapshot is finished
        first). Follows `due(step)`, which returned True."""
        began = time.perf_counter()
        self._setup()
        self.settle()
        self._unpaid += time.perf_counter() - began
        if self._ran is not None:
            self._pace.ran(self._ran)
        need = self._pace.needed()
        if self._control is not None:
            # Every rank takes the same snapshots: the widest need applies from this one. Also a
            # barrier: every rank has settled the snapshot before this one, so it is whole, here
            # and where its replicas are, and older files may be written over. And where a
            # transfer failed on any rank, every rank rebuilds the transfers' group, together.
            need, broken = peers.largest(self._control, [need, int(self._broken)])
            if broken:
                peers.drop(self._transfer)
                self._transfer = peers.side_group()
                self._broken = False
        self._pace.taken(step, need)
        packed, size, copied = pack_async(state, self._buffer)
        self._worker.submit(self._write, step, packed, size, copied)
        self._order = inflight.register(self)
        if self._pace.budget is not None and self._pace.interval > self.every:
            self._say("pace", f"snapshots every {self._pace.interval} steps rather than every "
                      f"{self.every}, to keep them within {self._pace.budget * 100:g}% of the "
                      "training's time (snapshot_budget): on rank 0 one takes "
                      f"{self._pace.snapshot_cost * 1e3:.2f} ms against steps of "
                      f"{self._pace.step_seconds * 1e3:.2f} ms; the ranks take the widest "
                      "need", lead=True)  # fmt: skip
        self._returned, self._beside = time.perf_counter(), True
        self._pace.took(self._returned - self._called - self._unpaid)
        self._unpaid = 0.0

    def settle(self) -> None:
        """Wait for the snapshot in flight; its failure has been said, training goes on."""
        if self._order is not None:
            self._worker.wait()
            inflight.unregister(self._order)
            self._order = None

    # inflight's protocol: a snapshot never fails the training, so there is no error to give.
    def wait(self) -> None:
        self.settle()

    def join_local(self) -> BaseException | None:
        # At exit: bounded, and never a collective (the peers may be gone).
        if self._order is not None and not self._worker.wait(EXIT_WAIT_S):
            self._say("exit", f"a snapshot was still being taken on {self._node()} at exit: "
                      "left unfinished; the durable checkpoints stand")  # fmt: skip
        return None

    def close(self) -> None:
        """The run ends here: finish the snapshot in flight and remove this rank's files and the
        replicas it keeps (the durable checkpoint, or the end of the work, supersedes them)."""
        self.settle()
        if self._store is not None:
            with contextlib.suppress(OSError):  # a refused store holds nothing of this run's
                self._store.remove([dist.rank(), *self._senders])

    # -- taking ---------------------------------------------------------------------------------

    def _setup(self) -> None:
        """At the first snapshot or recovery (collective): the store, the side groups, every
        rank's node, the incarnation (rank 0's draw: a restarted process draws a new one)."""
        if self._store is not None:
            return
        try:
            self._store = NodeStore.of_this_node(scope=self.scope)
        except OSError as e:  # every use of the store says so and keeps nothing
            self._say("store", f"{self._node()} keeps no snapshot: {one_line(e)}; the durable "
                      "checkpoints stand")  # fmt: skip
            self._store = NodeStore(node_directory(os.environ, self.scope))
        node = node_name(os.environ)
        draw = secrets.randbits(32)
        td = dist.group()
        if td is None:
            self._nodes, self._inc = [node], draw
            return
        self._control = peers.side_group()
        self._transfer = peers.side_group()
        reports = peers.all_gather_json(self._control, [node, draw])
        self._nodes = [str(n) for n, _ in reports]
        self._inc = int(reports[0][1])
        keepers = plan.replica_keepers(self._nodes)
        rank = td.get_rank()
        self._keeper = keepers.get(rank)
        self._senders = sorted(r for r, k in keepers.items() if k == rank)
        here = [r for r, n in enumerate(self._nodes) if n == node]
        if SHARE and len(here) > 1:
            self._lead = here[0] if here[0] != rank else None
            self._followers = here[1:] if here[0] == rank else []

    def _write(self, step: int, packed: torch.Tensor, size: int,
               copied: Callable[[], None]) -> None:  # fmt: skip
        """The background half of a snapshot: checksum, write (a part over the lead's shard on a
        rank that is not its node's lead), tell the node's other ranks (the lead), replicate.
        Every exchange runs whatever failed before it: the peers wait for it, bounded."""
        began = time.perf_counter()
        shard: Shard | None = None
        payload = packed[:size]
        try:
            try:
                copied()  # the GPU tensors' copies, queued behind the step that made them
                data = self._buffer.view(size)
                rank, world = dist.rank(), max(dist.group_size(), 1)
                shard = Shard(step, rank, world, self._inc, zlib.crc32(data), size)
            except Exception as e:  # said; the exchanges below still run, saying so
                self._failed(e)
            if self._lead is not None:
                base = self._hear_lead(step, self._timeout(size))
                if shard is not None and base is not None:
                    shard, payload = self._as_part(shard, payload, base)
            written = False
            if shard is not None:
                try:
                    written = self._keep(shard, payload)
                except Exception as e:  # said; the exchanges below still run, saying so
                    self._failed(e)
                    shard = None
            if self._followers:
                self._tell_followers(shard if written else None, self._timeout(size))
            if self._keeper is not None or self._senders:
                # Always, failed or not: the peers wait for this rank's header and send theirs.
                self._replicate(shard, payload, self._timeout(size))
            if shard is not None:
                self._prune()
                self._say_size_once(shard)
        except Exception as e:  # the durable checkpoints stand; training goes on
            self._failed(e)
        finally:
            self._ran = time.perf_counter() - began

    def _hear_lead(self, step: int, timeout: float) -> Shard | None:
        """The full shard of this step the node's lead wrote to the store, as it says; None when
        it has none (its snapshot failed, or its node's store keeps none) or did not say in
        time (the transfers' group is then rebuilt at the next snapshot)."""
        assert self._lead is not None
        head = torch.empty(peers.HEADER, dtype=torch.int64)
        try:
            peers.exchange(self._transfer, [], [(self._lead, head)], timeout)
        except Exception as e:
            self._broken = True
            self._failed(e)
            return None
        base = peers.shard_of(head)
        if base is None or base.part or (base.step, base.world, base.inc) != (
                step, max(dist.group_size(), 1), self._inc):  # fmt: skip
            return None
        return base

    def _tell_followers(self, shard: Shard | None, timeout: float) -> None:
        """Tell the node's other ranks whether this rank's `shard` is in the store (None: no),
        so that they keep their parts over it, or their whole states."""
        head = peers.header(shard)
        try:
            peers.exchange(self._transfer, [(r, head) for r in self._followers], [], timeout)
        except Exception as e:
            self._broken = True
            self._failed(e)

    def _as_part(self, shard: Shard, payload: torch.Tensor,
                 base: Shard) -> tuple[Shard, torch.Tensor]:  # fmt: skip
        """`shard` kept as a part over the lead's `base` (its file in this node's store), with
        the part's bytes; as it was when the part would be no smaller, or the base cannot be
        read."""
        try:
            with self._store_().mapped(base) as lead:
                part = flat.make_part(payload, lead, base.crc)
        except Exception as e:  # the whole state is kept instead
            self._say("part", f"{self._node()} keeps rank {shard.rank}'s whole state this time: "
                      f"the lead's could not be compared ({one_line(e)})")  # fmt: skip
            return shard, payload
        if part is None:
            return shard, payload
        return (dataclasses.replace(shard, size=len(part), base=base.rank),
                peers.as_tensor(part))  # fmt: skip

    def _failed(self, error: BaseException) -> None:
        self._say("failed", f"a snapshot failed on {self._node()} ({one_line(error)}): the "
                  "durable checkpoints stand")  # fmt: skip

    def _prune(self) -> None:
        with contextlib.suppress(OSError):
            self._written = self._store_().prune([dist.rank(), *self._senders], self.keep,
                                                 self._inc)  # fmt: skip

    @staticmethod
    def _timeout(size: int) -> float:
        """Seconds a transfer of a shard of `size` bytes waits for its peer."""
        try:
            base = float(os.environ.get(SNAPSHOT_TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)
        except ValueError:
            base = DEFAULT_TIMEOUT_S
        return max(base, 0.1) + size / SLOWEST_BYTES_PER_S

    def _replicate(self, shard: Shard | None, data: torch.Tensor, timeout: float) -> None:
        """Send `shard`'s file `data` (None: this rank has none this time, said in its header)
        to the rank that keeps its replica, and receive the replicas this rank keeps. A failed
        transfer (a peer gone, or slower than `timeout`) is given up, and its group rebuilt."""
        header = peers.header(shard)
        heads = [(s, torch.empty(peers.HEADER, dtype=torch.int64)) for s in self._senders]
        mine = [] if self._keeper is None else [(self._keeper, header)]
        payload = [] if self._keeper is None or shard is None else [(self._keeper, data)]
        try:
            peers.exchange(self._transfer, mine, heads, timeout)
            # Each replica arrives straight in its file: a buffer of its size would cost as much
            # to allocate as to receive. The files are kept once every byte is in.
            with contextlib.ExitStack() as files:
                receives = []
                for sender, head in heads:
                    replica = peers.shard_of(head)
                    if replica is not None:
                        receives.append((sender, peers.as_tensor(self._sink(replica, files))))
                peers.exchange(self._transfer, payload, receives, timeout)
                del receives  # the files' views are released before they close
        except Exception:
            self._broken = True
            raise

    def _sink(self, shard: Shard, files: contextlib.ExitStack) -> memoryview | bytearray:
        """Where a peer's `shard` arrives: its file in this node's store, closed and kept when
        `files` closes; bytes dropped when the store cannot keep it (no room, or an error: the
        sender sends anyway)."""
        try:
            with contextlib.ExitStack() as opening:
                reuse = opening.enter_context(self._storing(shard))
                sink = opening.enter_context(self._store_().receiving(shard, reuse))
                files.push(opening.pop_all())
                return sink
        except _NoRoom:
            return bytearray(shard.size)
        except Exception as e:  # said; the bytes are taken and dropped all the same
            self._failed(e)
            return bytearray(shard.size)

    def _keep(self, shard: Shard, data: torch.Tensor) -> bool:
        """Write `shard`'s file `data` to this node's store; whether it is there (no room: said
        once, and the replica is still sent)."""
        with contextlib.suppress(_NoRoom), self._storing(shard) as reuse:
            self._store_().put(shard, _bytes_view(data), reuse)
            return True
        return False

    @contextlib.contextmanager
    def _storing(self, shard: Shard) -> Iterator[Shard | None]:
        """Around a write of `shard` to this node's store: yields the old shard whose file it is
        written over (None: a new file), and counts `shard` as written when the block ends.
        _NoRoom (said once) when the store has no room for it or its write fails for want of
        it."""
        store = self._store_()
        reuse = self._oldest(shard.rank)
        try:
            room = store.room_for(shard.size - (reuse.size if reuse else 0))
        except OSError as e:  # the store cannot be made or sized here (refused, not writable)
            self._say("room", f"{self._node()} keeps no snapshot: {one_line(e)}; the durable "
                      "checkpoints stand")  # fmt: skip
            raise _NoRoom from e
        if not room.ok:
            self._say("room", f"{self._node()} keeps no snapshot: {room.where} has "
                      f"{_size(room.free)} free of {_size(room.total)}, a snapshot takes "
                      f"{_size(shard.size)} and the smaller of 1 GiB and a tenth stays "
                      f"free; the durable checkpoints stand (set $SLURMDDP_SNAPSHOT_DIR to a "
                      "larger node-local directory, or ask for more memory where the job's "
                      "memory limit bounds it)")  # fmt: skip
            raise _NoRoom
        if reuse is not None:
            self._written.remove(reuse)  # its file is written over, or gone
        try:
            yield reuse
        except OSError as e:
            self._say("room", f"{self._node()} keeps no snapshot: {one_line(e)}; the durable "
                      "checkpoints stand")  # fmt: skip
            raise _NoRoom from e
        self._written.append(shard)

    def _store_(self) -> NodeStore:
        assert self._store is not None  # set up at the first snapshot or recovery
        return self._store

    def _oldest(self, rank: int) -> Shard | None:
        """`rank`'s oldest shard here when the next one will have it pruned, and the one before
        stays (`keep` >= 2): its file may be written over."""
        held = sorted(s for s in self._written if s.rank == rank)
        return held[0] if self.keep >= 2 and len(held) >= self.keep else None

    def _say_size_once(self, shard: Shard) -> None:
        if dist.rank() != 0 or "size" in self._said:
            return
        every = f"snapshots every {self.every} step{'s' if self.every > 1 else ''} in " \
            f"{self._store.root if self._store else '?'}: {_size(shard.size)} a rank; "  # fmt: skip
        if self._followers:  # its node's lead: the others keep parts over its state
            whole = 1 + (1 if self._senders else 0)
            self._say("size", f"{every}a node keeps one copy of what its ranks hold alike and "
                      f"each rank's own part{', and as many replicas' if self._senders else ''}, "
                      f"{self.keep} steps: about {_size(self.keep * whole * shard.size)} and the "
                      "parts on this one")  # fmt: skip
            return
        here = self._nodes.count(self._nodes[0]) if self._nodes else 1
        kept = here + len(self._senders) * here
        self._say("size", f"{every}a node keeps its ranks' and as many replicas, {self.keep} "
                  f"steps: about {_size(self.keep * kept * shard.size)} on this one")

    def _say(self, key: str, line: str, lead: bool = False) -> None:
        if key in self._said or (lead and dist.rank() != 0):
            return
        self._said.add(key)
        print(f"slurmddp: {line}", file=sys.stderr, flush=True)

    def _node(self) -> str:
        return f"node {node_name(os.environ)}"

    # -- recovering -----------------------------------------------------------------------------

    def recover(self, newer_than: int | None, map_location: Any) -> Checkpoint | None:
        """The newest complete snapshot after step `newer_than` (the durable checkpoint's) that
        loads on every rank, fetched and loaded; an older complete one when it does not (a
        checksum failed); None when there is none (said, when one was lost). Collective."""
        self._setup()
        self.settle()
        assert self._store is not None
        # (node, its shards' fields, the durable step): JSON's lists, whichever the world.
        try:
            kept = [list(dataclasses.astuple(s)) for s in self._store.shards()]
        except OSError:  # a store refused or unreadable here holds nothing for this rank
            kept = []
        report = [node_name(os.environ), kept, newer_than]
        reports: list[Any] = [report]
        if self._control is not None:
            reports = peers.all_gather_json(self._control, report)
        with contextlib.suppress(OSError):
            self._store.drop_partial()  # every rank has settled its writes by now
        held: dict[str, set[Shard]] = {}
        for node, shards, _ in reports:
            held.setdefault(node, set()).update(Shard(*s) for s in shards)
        durable = reports[0][2]
        found, why = plan.candidates({n: sorted(s) for n, s in held.items()}, self._nodes,
                                     durable)  # fmt: skip
        lead = dist.rank() == 0
        if not found:
            if lead and why:
                print(f"slurmddp: {why}: resuming from the durable checkpoint"
                      f"{'' if durable is None else f' of step {durable}'}", file=sys.stderr,
                      flush=True)  # fmt: skip
            elif lead and not any(held.values()) and os.environ.get("SLURM_RESTART_COUNT",
                                                                   "0") != "0":  # fmt: skip
                print("slurmddp: no snapshot of this job is on its nodes (each run keeps its own; "
                      "the run before was requeued): resuming from the durable checkpoint",
                      file=sys.stderr, flush=True)  # fmt: skip
            return None
        for i, recovery in enumerate(found):
            loaded = self._load(recovery, durable, map_location)
            if loaded is not None:
                return loaded
            if lead:
                then = (f"trying the snapshot of step {found[i + 1].step}" if i + 1 < len(found)
                        else "resuming from the durable checkpoint")  # fmt: skip
                print(f"slurmddp: the snapshot of step {recovery.step} did not load on every "
                      f"rank (a checksum, the format or a transfer failed): {then}",
                      file=sys.stderr, flush=True)  # fmt: skip
        return None

    def _load(self, recovery: plan.Recovery, durable: int | None,
              map_location: Any) -> Checkpoint | None:  # fmt: skip
        """`recovery`'s shards fetched, checked and loaded on every rank, or None on every rank
        when any of them failed (collective)."""
        assert self._store is not None
        started = time.monotonic()
        rank = dist.rank()
        shard = recovery.shards[rank]
        state = None
        # A file gone, a transfer failed, a check failed: this rank fails, said below. The
        # mappings close once nothing holds a view of them (the error neither).
        with contextlib.ExitStack() as files, contextlib.suppress(Exception):
            state = self._read(recovery, files, map_location)
        fetched_s = time.monotonic() - started
        ok = isinstance(state, dict)
        if self._control is not None:
            failed, broken = peers.largest(self._control, [int(not ok), int(self._broken)])
            ok = not failed
            if broken:
                peers.drop(self._transfer)
                self._transfer = peers.side_group()
                self._broken = False
        if not ok:
            return None
        if rank == 0:
            moved = sum(f.shard.size for f in recovery.fetches)
            fetching = len({f.receiver for f in recovery.fetches})
            print(f"slurmddp: resuming from the snapshot of step {recovery.step} in the nodes' "
                  f"memory (durable checkpoint: {'none' if durable is None else f'step {durable}'}"
                  f"); {fetching} of {len(recovery.shards)} shards fetched from "
                  f"peers ({_size(moved)}) in {fetched_s:.3f} s", file=sys.stderr,
                  flush=True)  # fmt: skip
        assert isinstance(state, dict)
        fetch = next((f for f in recovery.fetches if f.receiver == rank and f.shard == shard),
                     None)  # fmt: skip
        node = self._nodes[fetch.sender] if fetch else self._nodes[rank]
        return Checkpoint(recovery.step, state, self._store.directory.parent / node / shard.name)

    def _read(self, recovery: plan.Recovery, files: contextlib.ExitStack,
              map_location: Any) -> dict | None:  # fmt: skip
        """This rank's state in `recovery`, its files fetched and checked (the crc32 of the
        whole state, rebuilt over its base for a part); None when a check fails."""
        rank = dist.rank()
        shard, base = recovery.shards[rank], recovery.bases[rank]
        got = self._fetch(recovery, files)
        data, under = got[shard], got[base] if base is not None else None
        if base is not None and flat.base_crc(data) != base.crc:  # not the base it was made over
            return None
        if flat.checksum(data, under) != shard.crc:
            return None
        return flat.unpack(data, map_location, under)

    def _fetch(self, recovery: plan.Recovery,
               files: contextlib.ExitStack) -> dict[Shard, memoryview | bytearray]:  # fmt: skip
        """The files this rank reads ({shard: its bytes}: its shard, and the base of a part):
        from its node's store, mapped in place until `files` closes, or received from the peer
        the plan names. This rank sends what the plan asks of it (zeros, failing the receiver's
        check, where its file cannot be read: the peer waits for the bytes either way)."""
        assert self._store is not None
        rank = dist.rank()
        sends = []
        for f in recovery.fetches:
            if f.sender == rank:
                try:
                    data: memoryview | bytearray = files.enter_context(self._store.mapped(f.shard))
                except OSError:  # gone, or another size: the receiver's buffer has this one
                    data = bytearray(f.shard.size)
                sends.append((f.receiver, peers.as_tensor(data)))
        got: dict[Shard, memoryview | bytearray] = {}
        receives = []
        for f in recovery.fetches:
            if f.receiver == rank:
                got[f.shard] = bytearray(f.shard.size)
                receives.append((f.sender, peers.as_tensor(got[f.shard])))
        if self._transfer is not None and recovery.fetches:
            size = max(f.shard.size for f in recovery.fetches)
            try:
                peers.exchange(self._transfer, sends, receives, self._timeout(size))
            except Exception:
                self._broken = True
                raise
            finally:
                del sends, receives
        for shard in recovery.files(rank):
            if shard not in got:
                got[shard] = files.enter_context(self._store.mapped(shard))
        return got


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous uint8 CPU tensor's bytes, without a copy (valid while it lives)."""
    if not tensor.numel():
        return memoryview(b"")
    array = (ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def _size(n: float) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB"


def close_all() -> None:
    """The run ends (`mark_done`, `requeue`): every Snapshots of this process closes."""
    for snapshots in list(_live):
        snapshots.close()

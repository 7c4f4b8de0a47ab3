"""Capture and restore everything a training loop needs to resume bitwise: model, optimizer,
scheduler, grad scaler, sampler position, counters and the random number generators.

    state = train_state.capture(model=model, optimizer=opt, scheduler=sched, loader=loader,
                                step=step, epoch=epoch, position=consumed)
    ckpt.save(step, state)
    ...
    loaded = ckpt.load_latest()
    if loaded is not None:
        counters = train_state.restore(loaded.state, model=model, optimizer=opt, ...)

A DataLoader given as `loader` resumes at its epoch and batch, with the same shuffling and the
same random augmentation as the uninterrupted run (`slurmddp.training.loader`); a script that
iterates one but gives none gets one line at its first save saying what will differ.

What `capture` returns holds only tensors and plain values, so it passes `Checkpointer.save`'s
check and loads under ``torch.load(weights_only=True)``.

With a process group, `capture` is a collective (every rank calls it, as every rank calls
`Checkpointer.save`): the RNG states of all ranks are gathered, since ranks may draw differently
(dropout, augmentation seeded by rank) and rank 0 alone writes a replicated checkpoint. `restore`
gives each rank its own again; resumed at more ranks, the new ones take rank 0's.

DDP lays its gradient buckets out anew after the first backward of a process, and with more
than two ranks the layout decides the order in which gloo and NCCL sum, so the last bits of every
gradient. `restore` given the DDP model therefore has its next training forward first run that
backward on the same inputs without touching the training state (`prime_ddp`), so a resumed run
reduces exactly as the uninterrupted one does, with no call the user can forget.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from slurmddp import dist, errors, protocol
from slurmddp.errors import CheckpointError


def capture(
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    loader: Any = None,
    step: int = 0,
    epoch: int = 0,
    position: int = 0,
    rng: bool = True,
    **extra: Any,
) -> dict:
    """The state of each component given, plus counters, RNG state and `extra` values.

    `position` is the number of samples (global, all ranks) consumed so far in this epoch; a
    ResumableDistributedSampler resumes from it. A DDP or DataParallel `model` is saved as the
    module it wraps, so the keys match an unwrapped model. `loader`, a DataLoader, is saved at
    its epoch and batch (`slurmddp.training.loader.state`; a Stateful loader, torchdata's, by its
    own state_dict); one whose position is not kept (an IterableDataset's) raises CheckpointError.
    """
    state: dict[str, Any] = {"step": int(step), "epoch": int(epoch), "position": int(position)}
    if model is not None:
        state["model"] = unwrap(model).state_dict()
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    if sampler is not None:
        from slurmddp.training.sampler import ResumableDistributedSampler

        if isinstance(sampler, ResumableDistributedSampler):
            state["sampler"] = sampler.state_dict(position)
        else:
            state["sampler"] = sampler.state_dict()
    if loader is not None:
        from slurmddp.training import loader as loading

        try:
            here = loading.state(loader)
        except loading.NotResumable as e:
            raise CheckpointError(f"train_state.capture(loader=...): {e}") from None
        # Per rank, as the generators: a script may seed each rank's torch differently.
        state["loader"] = per_rank(here)
    _note_data_once(loader)
    if rng:
        state["rng"] = per_rank(capture_rng())
    state["extra"] = dict(extra)
    return state


def _note_data_once(loader: Any) -> None:
    """One line, at the first capture, for what will not resume exactly: a DataLoader iterated
    but not given, or one whose resume cannot be bitwise (`loader.inexact`)."""
    if dist.rank() != 0 or not errors.first_time("train_state.data"):
        return
    from slurmddp.training import loader as loading

    if loader is None:
        from slurmddp.training.sampler import ResumableDistributedSampler

        # A ResumableDistributedSampler resumes its loader itself (set_epoch(epoch, start=...)),
        # and its epoch keys the loader's seeds.
        used = [
            d for d in loading.seen_loaders()
            if not isinstance(loading.sampler_of(d), ResumableDistributedSampler)
            and (loading.state(d)["epoch"], loading.state(d)["consumed"]) != (0, 0)
        ]  # fmt: skip
        if used:
            d = used[0]
            print(f"slurmddp: a DataLoader over {type(d.dataset).__name__} is in use but "
                  "train_state.capture was given no loader=: the resumed run will start its "
                  "epoch over and shuffle and augment differently; give it as loader= to "
                  "capture and restore", file=sys.stderr, flush=True)  # fmt: skip
        return
    reasons = loading.inexact(loader) if loading.enabled() else [
        f"{protocol.EXACT_DATA_VAR}=0 leaves the DataLoader's seeding to torch"]
    if reasons:
        print(f"slurmddp: the resumed run may not equal the uninterrupted one bit for bit: "
              f"{'; '.join(reasons)}", file=sys.stderr, flush=True)  # fmt: skip


def restore(
    state: Mapping,
    *,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    loader: Any = None,
    rng: bool = True,
) -> dict:
    """Load each component given from `state`; returns ``{"step", "epoch", "position", **extra}``.

    A `loader`'s next iterator is the saved epoch, its consumed batches skipped unfetched.

    Raises CheckpointError when a component is given but `state` has none for it, or one that
    does not fit it; the model's keys and shapes are compared before any of it is loaded.
    """

    def part(name: str) -> Any:
        if name not in state:
            raise CheckpointError(f"the checkpoint holds no {name} state (it has "
                                  f"{', '.join(map(str, state)) or 'nothing'}): was it "
                                  f"captured with {name}=...?")  # fmt: skip
        return state[name]

    if model is not None:
        module = unwrap(model)
        # Checked first: load_state_dict copies what fits before it complains about the rest.
        problem = _mismatch(module.state_dict(), part("model"))
        if problem:
            raise _misfit("model", problem)
        _load("model", module, part("model"))
        ddp = _ddp(model)
        if ddp is not None:
            prime_on_next_forward(ddp)
    if optimizer is not None:
        _load("optimizer", optimizer, part("optimizer"))
    if scheduler is not None:
        _load("scheduler", scheduler, part("scheduler"))
    if scaler is not None:
        saved = part("scaler")
        if saved:  # a disabled scaler saves {}, and refuses to load it
            _load("scaler", scaler, saved)
    if sampler is not None:
        _load("sampler", sampler, part("sampler"))
    if loader is not None:
        from slurmddp.training import loader as loading

        try:
            loading.load(loader, own(part("loader")))
        except loading.NotResumable as e:
            raise CheckpointError(f"train_state.restore(loader=...): {e}") from None
        except ValueError as e:
            raise _misfit("loader", str(e)) from e
    elif "loader" in state and dist.rank() == 0:
        print("slurmddp: the checkpoint holds a DataLoader's position but train_state.restore "
              "was given no loader=: its epoch starts over", file=sys.stderr, flush=True)
    if rng and "rng" in state:
        restore_rng(own(state["rng"]))
    counters = {k: state.get(k, 0) for k in ("step", "epoch", "position")}
    return counters | dict(state.get("extra", {}))


def own(saved: Any) -> Any:
    """This rank's part of a value captured per rank (rank 0's for a rank that was not there)."""
    if isinstance(saved, list):
        rank = dist.rank()
        return saved[rank] if rank < len(saved) else saved[0]
    return saved


def _load(name: str, component: Any, saved: Any) -> None:
    try:
        component.load_state_dict(saved)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _misfit(name, " ".join(str(e).split()) or type(e).__name__) from e


def _misfit(name: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint's {name} state does not fit this {name}: {problem}; was it saved by "
        f"another model or configuration? resume with the one it was saved by, or start afresh "
        "with another checkpoint directory"
    )


def _mismatch(expected: Mapping, saved: Any) -> str | None:
    """Which keys and shapes of a model's `saved` state differ from its `expected` one, or None."""
    if not isinstance(saved, Mapping):
        return f"it holds a {type(saved).__name__}, not a state dict"
    shapes = [
        f"{k!r} (checkpoint {list(saved[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in saved and isinstance(v, torch.Tensor) and isinstance(saved[k], torch.Tensor)
        and saved[k].shape != v.shape
    ]  # fmt: skip
    parts = [
        (what, names)
        for what, names in (
            ("missing keys", [repr(k) for k in expected if k not in saved]),
            ("unexpected keys", [repr(k) for k in saved if k not in expected]),
            ("shapes differ for", shapes),
        )
        if names
    ]
    return "; ".join(f"{what} {_some(names)}" for what, names in parts) or None


def _some(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel, DataParallel or torch.compile wrappers."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel | DataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            # torch.compile's wrapper exposes its module only as this private attribute (pinned
            # in tests/test_dependencies.py); without it the wrapper's own state_dict is used.
            model = model._orig_mod
        else:
            return model


def capture_rng() -> dict:
    """The state of python's `random`, numpy's global RNG, torch's CPU and every CUDA generator.

    Everything is a tensor or a plain value (numpy's key array becomes an int64 tensor).
    """
    version, internal, gauss = random.getstate()
    python = {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
              "gauss_next": gauss}  # fmt: skip
    state: dict[str, Any] = {"python": python, "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss),
                          "cached_gaussian": float(cached)}  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping) -> None:
    """Set every generator `capture_rng` saved. CUDA states go to as many devices as both have."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()),
                         py["gauss_next"]))  # fmt: skip
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    np = _numpy()
    if "numpy" in state and np is not None:
        saved = state["numpy"]
        key = saved["key"].numpy().astype(np.uint32)
        np.random.set_state((saved["kind"], key, int(saved["pos"]), int(saved["has_gauss"]),
                             float(saved["cached_gaussian"])))  # fmt: skip
    if state.get("cuda") and torch.cuda.is_available():
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[index], index)


def prime_ddp(ddp: Any, *inputs: Any, **kwargs: Any) -> None:
    """Run DDP's first backward on `inputs`, so its buckets take their lasting layout now.

    `restore` arranges it by itself (`prime_on_next_forward`); calling it on every rank after
    building the DDP model, fresh or resumed, does the same. The forward runs in eval mode (no
    dropout draw, no batch-norm statistics), the gradients are dropped and the RNG states put
    back: nothing the training sees changes.
    """
    prime_ddp_through(ddp, lambda: ddp(*inputs, **kwargs))


def prime_ddp_through(ddp: Any, forward: Callable[[], Any]) -> None:
    """`prime_ddp`, the forward being what `forward()` runs: a framework's own way through the
    DDP model (Lightning's training step)."""
    _mark_primed(ddp)
    rng = capture_rng()
    training = ddp.training
    ddp.eval()
    try:
        out = forward()
        leaves = [t for t in _tensors(out) if t.requires_grad]
        torch.stack([t.float().sum() for t in leaves]).sum().backward()
    finally:
        ddp.train(training)
        for p in ddp.parameters():
            p.grad = None
        restore_rng(rng)


_PRIMED = "_slurmddp_primed"


def _mark_primed(ddp: Any) -> None:
    object.__setattr__(ddp, _PRIMED, True)


def prime_on_next_forward(ddp: Any) -> None:
    """Make the next forward of `ddp` that computes gradients run `prime_ddp` on its inputs first.

    A resumed run's first backward would otherwise reduce with DDP's initial bucket layout where
    the uninterrupted run, past its own first step, used the rebuilt one: with more than two
    ranks the sums differ in their last bits. Every rank makes the same forwards, so every rank
    primes at the same one (the backward is a collective). Harmless when already primed.
    """
    if getattr(ddp, _PRIMED, False):
        return

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation under no_grad: wait for the first training forward
        handle.remove()
        if not getattr(module, _PRIMED, False):
            prime_ddp(module, *args, **kwargs)

    handle = ddp.register_forward_pre_hook(hook, with_kwargs=True)


def _ddp(model: Any) -> Any:
    """The DistributedDataParallel in `model`'s wrappers (torch.compile's included), or None."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            return model
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if inner is None or inner is model:
            return None
        model = inner


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


_own_only = contextvars.ContextVar("slurmddp_own_rank_only", default=False)


@contextlib.contextmanager
def own_rank_only() -> Iterator[None]:
    """Within it, `capture` keeps this rank's own random and loader state, not every rank's:
    for a state each rank keeps itself (a snapshot), no gather is needed."""
    token = _own_only.set(True)
    try:
        yield
    finally:
        _own_only.reset(token)


def per_rank(local: Any) -> Any:
    """Every rank's `local` (a list, one all_gather of their serialized bytes; a collective), or
    `local` alone without a process group or within `own_rank_only`; `own` takes this rank's
    back. `local` must not be a list itself (one process's value would read as per rank)."""
    world = dist.group_size()
    if world == 1 or _own_only.get():
        return local
    import io

    td = dist.group()
    buf = io.BytesIO()
    torch.save(local, buf)
    device = dist.collective_device()
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    td.all_gather(sizes, size)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    td.all_gather(gathered, padded)
    # bytes from the list of values: numpy is optional (a few KiB of RNG state per rank).
    return [
        torch.load(io.BytesIO(bytes(t[: int(n)].cpu().tolist())), weights_only=True)
        for t, n in zip(gathered, sizes, strict=True)
    ]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


__all__ = ["capture", "capture_rng", "own", "own_rank_only", "per_rank", "prime_ddp",
           "prime_on_next_forward", "restore", "restore_rng", "unwrap"]  # fmt: skip

"""What a checkpoint may hold (tensors and plain containers, as ``torch.load(weights_only=True)``
accepts), the check of a state before it is saved, its CPU snapshot, and its load."""

from __future__ import annotations

import operator
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slurmddp.errors import CheckpointError, one_line

_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def check_step(step: Any) -> str | None:
    """Why `step` is no checkpoint step (an integer >= 0), or None."""
    if isinstance(step, bool):
        return f"checkpoint step must be an integer >= 0, not {step!r}"
    try:
        value = operator.index(step)
    except TypeError:
        return f"checkpoint step must be an integer >= 0, not {step!r}"
    return None if value >= 0 else f"checkpoint step must be an integer >= 0, not {value}"


def check_state(state: Any, *, sharded: bool) -> str | None:
    """Why ``torch.load(weights_only=True)`` would refuse `state`, or None; walks it once."""
    if not isinstance(state, Mapping):
        return (f"checkpoint state must be a mapping (a dict of tensors and plain values), not "
                f"{type_name(state)}")  # fmt: skip
    leaves: tuple[type, ...] = _TENSOR_TYPES
    if sharded:
        from torch.distributed.tensor import DTensor

        leaves = (*_TENSOR_TYPES, DTensor)
    stack: list[tuple[str, Any]] = [("state", state)]
    seen: set[int] = set()
    while stack:
        where, value = stack.pop()
        kind = type(value)
        if kind in _PLAIN_TYPES or kind in leaves or kind in (torch.Size, torch.dtype,
                                                              torch.device):  # fmt: skip
            continue
        if id(value) in seen:
            continue
        if isinstance(value, Mapping) and (value is state or kind in (dict, OrderedDict)):
            seen.add(id(value))
            for key, item in value.items():
                stack.append((f"a key of {where}", key))
                stack.append((f"{where}[{key!r}]", item))
        elif kind in (list, tuple, set):
            seen.add(id(value))
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        else:
            return (f"{where} has type {type_name(value)}, which torch.load(weights_only=True) "
                    "refuses: keep only tensors, plain values and lists/tuples/dicts of them in a "
                    "checkpoint (e.g. save .state_dict(), convert arrays to tensors)")  # fmt: skip
    return None


def type_name(value: Any) -> str:
    """The qualified name of `value`'s type (no module for builtins)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}")  # fmt: skip


def load_state(path: Path, map_location: Any) -> tuple[dict | None, str | None]:
    """(state, None) by torch.load with weights_only, or (None, why it cannot be read).

    Raises CheckpointError when the file holds more than tensors and plain containers.
    """
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise not_plain(path) from None
    except Exception as e:  # damaged data fails in many ways (IndexError, KeyError...)
        return None, f"unreadable by torch.load ({one_line(e)})"
    if not isinstance(state, dict):
        return None, f"not a state dict (it holds a {type_name(state)})"
    return state, None


def not_plain(path: Path) -> CheckpointError:
    """The error for a checkpoint file that would need more than weights_only to load."""
    return CheckpointError(
        f"checkpoint file {path} holds something other than tensors and plain containers; "
        "refusing to load it (torch.load weights_only=True): remove it unless you trust and "
        "convert it"
    )


def snapshot(value: Any, staging: Staging, *, cpu: bool = True) -> Any:
    """A copy of `value` whose tensors live in CPU memory that nothing else references.

    GPU tensors go through `staging`'s pinned buffers; with ``cpu=False`` CPU tensors are kept
    as they are (a synchronous save writes them before anything can change them).
    """
    memo: dict[int, Any] = {}
    copy = _copy(value, staging, memo, cpu)
    staging.wait()
    return copy


def _copy(value: Any, staging: Staging, memo: dict[int, Any], cpu: bool) -> Any:
    if isinstance(value, torch.Tensor):
        copy = memo.get(id(value))
        if copy is None:  # a tensor reachable twice (tied weights) stays one tensor
            if value.device.type == "cpu":
                copy = value.detach().clone() if cpu else value
            else:
                copy = staging.copy(value.detach())
            memo[id(value)] = copy
        return copy
    kind = type(value)
    if kind in (dict, OrderedDict) or isinstance(value, Mapping):
        items = ((k, _copy(v, staging, memo, cpu)) for k, v in value.items())
        return OrderedDict(items) if kind is OrderedDict else dict(items)
    if kind is list:
        return [_copy(v, staging, memo, cpu) for v in value]
    if kind is tuple:
        return tuple(_copy(v, staging, memo, cpu) for v in value)
    if kind is set:
        return set(value)  # elements are hashable plain values
    return value  # immutable: plain values, torch.Size, dtype, device


class Staging:
    """Pinned CPU buffers that GPU tensors are copied into for a save, reused from save to save.

    A copy into pinned memory runs at the bus's speed and without blocking; a fresh pageable
    tensor each time costs its allocation and page faults (measured on an H100: a 1 GiB state
    took 0.72 s). The buffers are reused in the order the tensors come, so a state of the same
    layout as the last one allocates nothing; the previous save has been written (`save`
    settles it first) before they are overwritten.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._streams: list[Any] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values in the next buffer; the copy may still be running (see `wait`)."""
        if self._next < len(self._buffers) and _same_layout(self._buffers[self._next], tensor):
            buffer = self._buffers[self._next]
        else:
            buffer = _pinned_like(tensor)
            if self._next < len(self._buffers):
                self._buffers[self._next] = buffer
            else:
                self._buffers.append(buffer)
        self._next += 1
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        if tensor.device.type == "cuda":
            self._streams.append(torch.cuda.current_stream(tensor.device))
        return buffer

    def wait(self) -> None:
        """Until every copy is in its buffer; then the next save starts from the first buffer."""
        for stream in {id(s): s for s in self._streams}.values():
            stream.synchronize()
        self._streams.clear()
        del self._buffers[self._next :]  # a smaller state: free what it no longer needs
        self._next = 0


def _same_layout(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    return buffer.shape == tensor.shape and buffer.dtype == tensor.dtype


def _pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    except RuntimeError:  # no pinnable memory here (no driver, a memlock limit): pageable
        return torch.empty(tensor.shape, dtype=tensor.dtype)

"""The snapshot format: a state's tree as JSON and its tensors' bytes in one buffer, no pickle.

    b"SLURMDDP-SNAP-1\\n" | header length (8 bytes, little endian) | header (JSON) | padding |
    every tensor's bytes, each at a multiple of 64

One buffer, filled by one copy per tensor on the caller's thread (GPU tensors through pinned
memory, queued on their streams without waiting for them), is what the background thread
checksums, writes and sends as it is: no serializer runs beside the training and holds the
interpreter. Loading rebuilds plain values, containers and dense tensors from the header, so a
snapshot file, like a checkpoint, never runs code.
"""

from __future__ import annotations

import ctypes
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from slurmddp.errors import CheckpointError

MAGIC = b"SLURMDDP-SNAP-1\n"
ALIGN = 64
_PREFIX = len(MAGIC) + 8


class Buffer:
    """A reusable byte buffer a state is laid into (pinned when CUDA is there: GPU tensors copy
    into it without blocking), and its `view` as Python sees bytes."""

    def __init__(self) -> None:
        self._tensor = torch.empty(0, dtype=torch.uint8)

    def reserve(self, size: int) -> torch.Tensor:
        if self._tensor.numel() < size:
            size += size // 8  # room for a longer header next time
            try:
                self._tensor = torch.empty(size, dtype=torch.uint8,
                                           pin_memory=torch.cuda.is_available())  # fmt: skip
            except RuntimeError:  # no pinnable memory (no driver, a memlock limit)
                self._tensor = torch.empty(size, dtype=torch.uint8)
        return self._tensor

    def view(self, size: int) -> memoryview:
        """The first `size` bytes, without a copy (valid while this buffer lives)."""
        array = (ctypes.c_ubyte * size).from_address(self._tensor.data_ptr())
        return memoryview(array).cast("B")


def pack(state: Mapping[str, Any], buffer: Buffer) -> tuple[torch.Tensor, int]:
    """Lay `state` into `buffer`; (its tensor, the size used). The copies of GPU tensors have
    finished when it returns."""
    flat, size, copied = pack_async(state, buffer)
    copied()
    return flat, size


def pack_async(state: Mapping[str, Any],
               buffer: Buffer) -> tuple[torch.Tensor, int, Callable[[], None]]:  # fmt: skip
    """`pack`, with the copies of GPU tensors left running on their streams: the third value
    waits for them. Work the caller queues on those streams afterwards runs after the copies, so
    they take the state as it was at the call, and the training never waits for the GPU here."""
    tensors: list[torch.Tensor] = []
    offsets: dict[int, int] = {}
    end = 0

    def encode(value: Any) -> Any:
        nonlocal end
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized:
                raise CheckpointError(f"a snapshot holds dense tensors only, not a "
                                      f"{value.layout} one")  # fmt: skip
            offset = offsets.get(id(value))
            if offset is None:  # a tensor reachable twice (tied weights) is stored once
                offset = offsets[id(value)] = end
                tensors.append(value)
                # At least one block: an empty tensor keeps an offset of its own.
                end += max(1, -(-value.numel() * value.element_size() // ALIGN)) * ALIGN
            return {"A": [str(value.dtype).removeprefix("torch."), list(value.shape), offset,
                          value.device.type]}  # fmt: skip
        kind = type(value)
        if value is None or kind in (bool, int, float, str):
            return value
        if isinstance(value, Mapping):
            tag = "O" if kind is OrderedDict else "D"
            return {tag: [[encode(k), encode(v)] for k, v in value.items()]}
        if kind in (list, tuple, set):
            return {"LTS"[(list, tuple, set).index(kind)]: [encode(v) for v in value]}
        if kind is bytes:
            return {"B": value.hex()}
        if kind is complex:
            return {"C": [value.real, value.imag]}
        if kind is torch.Size:
            return {"Z": list(value)}
        if kind is torch.dtype:
            return {"Y": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"V": str(value)}
        raise CheckpointError(f"a snapshot cannot hold a {kind.__qualname__}")

    header = json.dumps(encode(dict(state)), separators=(",", ":")).encode()
    start = -(-(_PREFIX + len(header)) // ALIGN) * ALIGN
    flat = buffer.reserve(start + end)
    flat[: len(MAGIC)] = torch.frombuffer(bytearray(MAGIC), dtype=torch.uint8)
    flat[len(MAGIC) : _PREFIX] = torch.frombuffer(bytearray(len(header).to_bytes(8, "little")),
                                                  dtype=torch.uint8)  # fmt: skip
    flat[_PREFIX : _PREFIX + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    streams: dict[torch.device, Any] = {}
    for tensor in tensors:
        offset = start + offsets[id(tensor)]
        size = tensor.numel() * tensor.element_size()
        target = flat[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        gpu = tensor.device.type == "cuda"
        target.copy_(tensor.detach(), non_blocking=gpu)
        if gpu and tensor.device not in streams:
            streams[tensor.device] = torch.cuda.current_stream(tensor.device)
    events = [stream.record_event() for stream in streams.values()]

    def copied() -> None:
        for event in events:
            event.synchronize()

    return flat, start + end, copied


def unpack(data: bytes | bytearray | memoryview, map_location: Any = "cpu") -> dict:
    """The state `pack` laid out; CheckpointError when `data` is not one."""
    view = memoryview(data).cast("B")
    if view.readonly:  # torch.frombuffer wants memory it may write
        view = memoryview(bytearray(view))
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CheckpointError("not a slurmddp snapshot (its first bytes differ)")
    length = int.from_bytes(view[len(MAGIC) : _PREFIX], "little")
    start = -(-(_PREFIX + length) // ALIGN) * ALIGN
    try:
        tree = json.loads(bytes(view[_PREFIX : _PREFIX + length]))
    except ValueError as e:
        raise CheckpointError(f"a snapshot's header is damaged ({e})") from None
    # Read in place (`view` lives while this runs); each tensor is cloned out of it.
    flat = torch.frombuffer(view[start:], dtype=torch.uint8) if len(view) > start \
        else torch.empty(0, dtype=torch.uint8)  # fmt: skip
    memo: dict[int, torch.Tensor] = {}

    def decode(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        (tag, body), = node.items()
        if tag == "A":
            dtype_name, shape, offset, device = body
            tensor = memo.get(offset)
            if tensor is None:
                dtype = _dtype(dtype_name)
                count = 1
                for n in shape:
                    count *= n
                size = count * torch.empty(0, dtype=dtype).element_size()
                # A tensor of its own, not a view of the buffer: torch.set_rng_state, for one,
                # reads a generator's state from the start of its tensor's storage.
                tensor = flat[offset : offset + size].view(dtype).view(shape).clone()
                where = map_location if map_location is not None else device
                tensor = memo[offset] = tensor.to(where) if str(where) != "cpu" else tensor
            return tensor
        if tag in ("D", "O"):
            pairs = [(_key(decode(k)), decode(v)) for k, v in body]
            return OrderedDict(pairs) if tag == "O" else dict(pairs)
        if tag in ("L", "T", "S"):
            items = [decode(v) for v in body]
            return {"L": list, "T": tuple, "S": set}[tag](items)
        plain: dict[str, Callable[[Any], Any]] = {
            "B": bytes.fromhex, "C": lambda b: complex(*b), "Z": torch.Size, "Y": _dtype,
            "V": torch.device}  # fmt: skip
        if tag not in plain:
            raise CheckpointError(f"a snapshot's header has an unknown entry {tag!r}")
        return plain[tag](body)

    return decode(tree)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a snapshot names no torch dtype: {name!r}")
    return dtype


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value

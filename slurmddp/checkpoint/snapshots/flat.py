"""The snapshot format: a state's tree as JSON and its tensors' bytes in one buffer, no pickle.

    b"SLURMDDP-SNAP-1\\n" | header length (8 bytes, little endian) | header (JSON) | padding |
    every tensor's bytes, each at a multiple of 64 (padding zeroed)

One buffer, filled by one copy per tensor on the caller's thread (GPU tensors through pinned
memory, queued on their streams without waiting for them), is what the background thread
checksums, writes and sends as it is: no serializer runs beside the training and holds the
interpreter. Loading rebuilds plain values, containers and dense tensors from the header, so a
snapshot file, like a checkpoint, never runs code.

A part (`make_part`) is a state laid out as above, kept as what differs from another one, its
base: under DDP the ranks of a node hold one model and optimizer alike, and differ in their
random generators and data positions. The data after the header is cut in blocks of `BLOCK`
bytes; the part holds the state's own header and the blocks whose bytes are not the base's at
the same place (compared exactly, never by a hash):

    b"SLURMDDP-PART-1\\n" | table length (8 bytes) | table (JSON: the state's size, its
    header's length with padding, the base's crc32, the runs of blocks held) | padding |
    the state's own header and padding | the blocks held, run after run

`checksum` and `unpack` read a part over its base in place (the two files' mappings, or the bytes
received), never laying the whole state out a second time; the crc32 is the whole state's, so
that a damaged base or part, or a part over another base, fails it.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from slurmddp.errors import CheckpointError

MAGIC = b"SLURMDDP-SNAP-1\n"
PART_MAGIC = b"SLURMDDP-PART-1\n"
ALIGN = 64
# A part's unit: a differing tensor costs its own bytes and those of the blocks it shares.
BLOCK = ALIGN
_PREFIX = len(MAGIC) + 8
_COMPARED = 1 << 20  # bytes compared at once: a difference costs its stretch's blocks' mask


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
    # Padding zeroed (the buffer is reused): one state is always the same bytes, so the ranks'
    # common tensors compare equal to their last byte (`make_part`).
    flat[_PREFIX + len(header) : start] = 0
    streams: dict[torch.device, Any] = {}
    for i, tensor in enumerate(tensors):
        offset = start + offsets[id(tensor)]
        size = tensor.numel() * tensor.element_size()
        following = start + (offsets[id(tensors[i + 1])] if i + 1 < len(tensors) else end)
        if offset + size < following:
            flat[offset + size : following] = 0
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


Bytes = bytes | bytearray | memoryview


def make_part(own: torch.Tensor, base: Bytes, base_crc: int) -> bytearray | None:
    """`own` (a state `pack` laid out, as uint8) as a part over `base` (another, in writable
    memory: a copy-on-write mapping of its file will do; its crc32 is `base_crc`): its header
    and the blocks of its data whose bytes differ from `base`'s at the same place; None when
    that is no smaller than `own`. Exact: block by block, byte for byte."""
    own_start = _start(memoryview(bytes(own[:_PREFIX].tolist())), "the state")
    base_view = memoryview(base).cast("B")
    if bytes(base_view[: len(MAGIC)]) != MAGIC:
        raise CheckpointError("a part's base is no snapshot (its first bytes differ)")
    base_start = _start(base_view, "the base")
    own_data = own[own_start:]
    held = own_data.numel()
    if held % BLOCK or own_start % ALIGN:
        raise CheckpointError("a state not laid out by pack")
    blocks = held // BLOCK
    # Beyond the base's data every block differs.
    shared = min(blocks, max(len(base_view) - base_start, 0) // BLOCK)
    differs = torch.ones(blocks, dtype=torch.bool)
    if shared:
        base_data = torch.frombuffer(base_view, dtype=torch.uint8)[base_start:]  # in place
        step = _COMPARED // BLOCK
        for first in range(0, shared, step):
            last = min(shared, first + step)
            a = own_data[first * BLOCK : last * BLOCK].view(torch.int64)
            b = base_data[first * BLOCK : last * BLOCK].view(torch.int64)
            # Most of a DDP rank's state is its lead's: whole stretches compare equal at once,
            # faster than block by block.
            differs[first:last] = False if torch.equal(a, b) else \
                a.view(last - first, -1).ne(b.view(last - first, -1)).any(dim=1)  # fmt: skip
        del base_data  # the base's view is released before this returns
    edges = torch.diff(differs.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8))  # fmt: skip
    starts = edges.eq(1).nonzero().flatten().tolist()
    ends = edges.eq(-1).nonzero().flatten().tolist()
    runs = [v for a, b in zip(starts, ends, strict=True) for v in (a, b - a)]
    table = json.dumps({"size": own.numel(), "prefix": own_start, "block": BLOCK,
                        "base_crc": base_crc, "runs": runs}, separators=(",", ":")).encode()
    head = _aligned(_PREFIX + len(table))
    differing = sum(runs[1::2]) * BLOCK
    if head + own_start + differing >= own.numel():
        return None
    part = bytearray(head + own_start + differing)
    part[: len(PART_MAGIC)] = PART_MAGIC
    part[len(PART_MAGIC) : _PREFIX] = len(table).to_bytes(8, "little")
    part[_PREFIX : _PREFIX + len(table)] = table
    out = torch.frombuffer(part, dtype=torch.uint8)
    out[head : head + own_start] = own[:own_start]
    at = head + own_start
    for first, count in zip(runs[::2], runs[1::2], strict=True):
        out[at : at + count * BLOCK] = own_data[first * BLOCK : (first + count) * BLOCK]
        at += count * BLOCK
    return part


def base_crc(part: Bytes) -> int | None:
    """The crc32 of the base a part was made against; None when `part` is none (a whole state,
    or damaged)."""
    view = memoryview(part).cast("B")
    if bytes(view[: len(PART_MAGIC)]) != PART_MAGIC:
        return None
    length = int.from_bytes(view[len(MAGIC) : _PREFIX], "little")
    try:
        return int(json.loads(bytes(view[_PREFIX : _PREFIX + length]))["base_crc"])
    except (ValueError, KeyError, TypeError):
        return None


def checksum(data: Bytes, base: Bytes | None = None) -> int:
    """The crc32 of the state `data` holds: its bytes for a whole one, for a part those of the
    state it rebuilds over `base`. CheckpointError when it is neither, or a part's table does not
    fit it or its base."""
    return _Laid(data, base).checksum()


def unpack(data: Bytes, map_location: Any = "cpu", base: Bytes | None = None) -> dict:
    """The state `pack` laid out, from `data` (a part: over `base`, the state it was made
    against); CheckpointError when it is not one."""
    laid = _Laid(data, base)
    try:
        tree = json.loads(laid.header())
    except ValueError as e:
        raise CheckpointError(f"a snapshot's header is damaged ({e})") from None
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
                tensor = laid.read(offset, size).view(dtype).view(shape)
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


class _Laid:
    """A state's bytes as `pack` laid them out, read where they are: a whole one, or a part and
    its base. The data after the header is a list of segments: (start, end) in the data, the
    view that holds those bytes and where they begin in it."""

    def __init__(self, data: Bytes, base: Bytes | None) -> None:
        view = memoryview(data).cast("B")
        magic = bytes(view[: len(MAGIC)])
        self.segments: list[tuple[int, int, memoryview, int]] = []
        if magic == MAGIC:
            start = _start(view, "a snapshot")
            if len(view) < start:
                raise CheckpointError("a snapshot's header is damaged (longer than the file)")
            self.prefix = view[:start]
            if len(view) > start:
                self._add(0, len(view) - start, view, start)
            return
        if magic != PART_MAGIC:
            raise CheckpointError("not a slurmddp snapshot (its first bytes differ)")
        if base is None:
            raise CheckpointError("a part of a snapshot read without its base")
        length = int.from_bytes(view[len(MAGIC) : _PREFIX], "little")
        try:
            table = json.loads(bytes(view[_PREFIX : _PREFIX + length]))
            size, own_start, block = int(table["size"]), int(table["prefix"]), int(table["block"])
            runs = [int(v) for v in table["runs"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"a snapshot part's table is damaged ({e})") from None
        head = _aligned(_PREFIX + length)
        base_view = memoryview(base).cast("B")
        if bytes(base_view[: len(MAGIC)]) != MAGIC:
            raise CheckpointError("a part's base is no snapshot (its first bytes differ)")
        base_start = _start(base_view, "a part's base")
        self.prefix = view[head : head + own_start]
        if len(self.prefix) != own_start or bytes(self.prefix[: len(MAGIC)]) != MAGIC or \
                _start(self.prefix, "a part") != own_start:  # fmt: skip
            raise CheckpointError("a snapshot part's header is damaged")
        end, at, done = size - own_start, head + own_start, 0
        for first, count in zip(runs[::2], runs[1::2], strict=True):
            if first * block > done:  # the base's bytes, up to the run
                self._add(done, first * block, base_view, base_start + done)
            done = min(end, (first + count) * block)
            self._add(first * block, done, view, at)
            at += done - first * block
        if done < end:
            self._add(done, end, base_view, base_start + done)
        if at != len(view):
            raise CheckpointError("a snapshot part's length does not match its table")

    def _add(self, start: int, end: int, view: memoryview, at: int) -> None:
        """Data bytes [start, end) are `view`'s from `at`."""
        if (self.segments and start < self.segments[-1][1]) or end <= start or \
                at + end - start > len(view):  # fmt: skip
            raise CheckpointError("a snapshot part's table does not fit it or its base")
        self.segments.append((start, end, view, at))

    def header(self) -> bytes:
        length = int.from_bytes(self.prefix[len(MAGIC) : _PREFIX], "little")
        return bytes(self.prefix[_PREFIX : _PREFIX + length])

    def checksum(self) -> int:
        crc = zlib.crc32(self.prefix)
        for start, end, view, at in self.segments:
            crc = zlib.crc32(view[at : at + end - start], crc)
        return crc

    def read(self, offset: int, size: int) -> torch.Tensor:
        """Data bytes [offset, offset + size) as a tensor of their own."""
        out = torch.empty(size, dtype=torch.uint8)
        if not size:
            return out
        target = memoryview((ctypes.c_ubyte * size).from_address(out.data_ptr())).cast("B")
        i = max(bisect.bisect_right(self.segments, offset, key=lambda s: s[0]) - 1, 0)
        done = offset
        while done < offset + size:
            if i >= len(self.segments) or self.segments[i][0] > done:
                raise CheckpointError("a snapshot's tensor lies outside its data")
            start, end, view, at = self.segments[i]
            upto = min(end, offset + size)
            if upto > done:
                target[done - offset : upto - offset] = view[at + done - start : at + upto - start]
                done = upto
            i += 1
        return out


def _start(view: memoryview, what: str) -> int:
    """Where the data of a state laid out in `view` starts (its header's length, aligned)."""
    if len(view) < _PREFIX:
        raise CheckpointError(f"{what} is too short to be a snapshot")
    return _aligned(_PREFIX + int.from_bytes(view[len(MAGIC) : _PREFIX], "little"))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a snapshot names no torch dtype: {name!r}")
    return dtype


def _key(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value

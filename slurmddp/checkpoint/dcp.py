"""torch.distributed.checkpoint (DCP) without unrestricted unpickling, and its errors in one line.

DCP pickles its `.metadata` and loads non-tensor items with ``weights_only=False``: a crafted
checkpoint could run code. Here the metadata goes through an unpickler that builds DCP's own
dataclasses, dtypes, torch.Size and paths and nothing else, and non-tensor items must pass a
``weights_only=True`` load first. torch.distributed.checkpoint is imported on first use only.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import io
import pickle
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slurmddp.checkpoint.manifest import METADATA
from slurmddp.checkpoint.state import not_plain
from slurmddp.errors import one_line

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_EXTRA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}  # fmt: skip
# What DCP warns when it runs without a process group: a world of one is the intent here.
SINGLE_PROCESS_WARNING = "torch.distributed is disabled"


class Forbidden(pickle.UnpicklingError):
    """A pickle names a global that a checkpoint has no business naming."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's `.metadata` (its dataclasses, dtypes, torch.Size, paths) and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _EXTRA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name,
                          None)  # fmt: skip
            # Only classes defined there: dataclasses and enums, whose construction runs no code
            # chosen by the file.
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise Forbidden(f"global {module}.{name} is not allowed in DCP metadata")


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``getattr(cls, name)`` in a pickle may mean here: a member of one of DCP's enums.
    Some Python 3.11 releases (Debian 12's 3.11.2 among them) pickle an enum member that way,
    where the others pickle ``cls(value)``."""
    if (isinstance(cls, enum.EnumMeta) and cls.__module__ in _DCP_MODULES
            and isinstance(name, str) and name in cls.__members__):  # fmt: skip
        return cls[name]
    raise Forbidden(f"getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r}) is "
                    "not allowed in DCP metadata")  # fmt: skip


def metadata_problem(path: Path) -> str | None:
    """What is wrong with `path`/.metadata, or None; raises CheckpointError if it is crafted."""
    try:
        with open(path / METADATA, "rb") as f:
            MetadataUnpickler(f).load()
    except Forbidden:
        raise not_plain(path / METADATA) from None
    except Exception as e:  # unpickling damaged data can fail in many ways
        return f"damaged (its .metadata does not load: {one_line(e)})"
    return None


@functools.cache  # built on first use: DCP is a heavy import
def reader_class() -> type:
    """DCP's FileSystemReader with its metadata read by `MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # torch 2.9 added _get_metadata_path (and a rank's own metadata file); before, the
            # metadata is always the directory's .metadata.
            locate = getattr(self, "_get_metadata_path", None)
            path = Path(locate(kwargs.get("rank")) if locate else Path(self.path) / METADATA)
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


@functools.cache
def planner_class() -> type:
    """DCP's DefaultLoadPlanner that accepts non-tensor items only as weights_only does."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        # The default planner loads non-tensor items with weights_only=False; the same bytes
        # reach it only after a weights_only=True load has accepted them.
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            data = value.getvalue()
            torch.load(io.BytesIO(data), weights_only=True)
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeLoadPlanner


def no_dist_kwargs(no_dist: bool) -> dict[str, Any]:
    """``no_dist=`` for dcp.async_save where it takes it (torch 2.9 and later); an older torch's
    async_save decides it from whether a process group is initialised, as `save` does."""
    import torch.distributed.checkpoint as dcp

    return {"no_dist": no_dist} if _takes_no_dist(dcp.async_save) else {}


@functools.cache
def _takes_no_dist(async_save: Any) -> bool:
    return "no_dist" in inspect.signature(async_save).parameters


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def cause(e: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's CheckpointException, else `e`; the OS
    error behind it where there is one."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        e = first[0] if isinstance(first, tuple) else first
    # torch.save inside DCP turns a failed write into "unexpected pos ..."; the OSError it hit
    # (No space left on device...) is that error's context.
    seen: BaseException | None = e
    for _ in range(16):  # a chain may loop
        if seen is None or isinstance(seen, OSError):
            break
        seen = seen.__cause__ or seen.__context__
    return seen if isinstance(seen, OSError) else e

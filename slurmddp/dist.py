"""The process group as every module asks about it: is there one, which rank is this, and where
a collective's tensors must live.

One rule for all: without an initialised group, this process's rank is the launcher's ``$RANK``
(which `slurmddp.rank.bootstrap` exports), else 0; its group has one member. torch.distributed
is never imported here: if nobody imported it, no group can exist, and importing slurmddp stays
cheap.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def group() -> Any:
    """torch.distributed when a process group is initialised, else None."""
    td = sys.modules.get("torch.distributed")
    if td is not None and td.is_available() and td.is_initialized():
        return td
    return None


def rank() -> int:
    """This process's rank: the group's, else ``$RANK``, else 0."""
    td = group()
    if td is not None:
        return int(td.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def group_size() -> int:
    """How many ranks take part in a collective: the group's size, else 1."""
    td = group()
    return int(td.get_world_size()) if td is not None else 1


def flag_device(backend: str, cuda_index: int | None) -> str:
    """Where a collective's tensors live for `backend`: NCCL reduces only CUDA tensors; gloo and
    MPI CPU ones, and a mixed group ("cpu:gloo,cuda:nccl") takes CPU tensors through gloo."""
    if "nccl" in backend and not any(b in backend for b in ("gloo", "mpi")):
        if cuda_index is None:
            raise RuntimeError("an NCCL group needs a current CUDA device: call slurmddp.init()")
        return f"cuda:{cuda_index}"
    return "cpu"


def collective_device(group_: Any = None) -> Any:
    """The torch.device of the tensors a collective on `group_` (default: the default group)
    takes."""
    import torch
    import torch.distributed as td

    backend = str(td.get_backend(group_))
    nccl = "nccl" in backend
    return torch.device(flag_device(backend, torch.cuda.current_device() if nccl else None))

"""The import paths of the previous release that the re-layout into subpackages moved: each still
works for one more release, with a DeprecationWarning that names the new path.

An old module path is served by a finder at the end of ``sys.meta_path`` (installed by importing
slurmddp, so it needs no file at the old path and works from a wheel) that binds the old name to
the new module itself in ``sys.modules``: both paths give the very same objects, so isinstance
holds across them and a monkeypatch through either is seen by both. A path that is now a package
(``slurmddp.preemption``) keeps the old module's names through the package's ``__getattr__``.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader

# Old module path -> the module it became. Emptied once the old paths are dropped.
MODULES = {
    "slurmddp.agreement": "slurmddp.preemption.agreement",
    "slurmddp.bootstrap": "slurmddp.rank.bootstrap",
    "slurmddp.cli_jobs": "slurmddp.cli.jobs",
    "slurmddp.cli_submit": "slurmddp.cli.submit",
    "slurmddp.config": "slurmddp.batch.spec.config",
    "slurmddp.coordination": "slurmddp.rank.coordination",
    "slurmddp.decision": "slurmddp.preemption.decision",
    "slurmddp.doctor": "slurmddp.launch.doctor",
    "slurmddp.env": "slurmddp.rank.env",
    "slurmddp.hostlist": "slurmddp.rank.hostlist",
    "slurmddp.jobs": "slurmddp.batch.jobs",
    "slurmddp.jobspec": "slurmddp.batch.spec.jobspec",
    "slurmddp.mpi": "slurmddp.rank.mpi",
    "slurmddp.output": "slurmddp.rank.output",
    "slurmddp.placement": "slurmddp.rank.placement",
    "slurmddp.process_group": "slurmddp.launch.process_group",
    "slurmddp.sampler": "slurmddp.training.sampler",
    "slurmddp.sbatch": "slurmddp.batch.script.sbatch",
    "slurmddp.signals": "slurmddp.preemption.signals",
    "slurmddp.startup": "slurmddp.launch.startup",
    "slurmddp.submission": "slurmddp.batch.transport.submission",
    "slurmddp.templating": "slurmddp.batch.script.templating",
    "slurmddp.train_state": "slurmddp.training.train_state",
    # The launchers left the pure placement modules (slurmddp.rank) for slurmddp.launch.
    "slurmddp.cli.links": "slurmddp.links",
    "slurmddp.rank.agent": "slurmddp.launch.agent",
    "slurmddp.rank.doctor": "slurmddp.launch.doctor",
    "slurmddp.rank.preflight": "slurmddp.launch.preflight",
    "slurmddp.rank.process_group": "slurmddp.launch.process_group",
    "slurmddp.rank.runner": "slurmddp.launch.runner",
    "slurmddp.rank.startup": "slurmddp.launch.startup",
    # slurmddp.batch split by concern (spec, script, transport, functions, local).
    "slurmddp.batch.options": "slurmddp.batch.spec.options",
    "slurmddp.batch.config": "slurmddp.batch.spec.config",
    "slurmddp.batch.profiles": "slurmddp.batch.spec.profiles",
    "slurmddp.batch.jobspec": "slurmddp.batch.spec.jobspec",
    "slurmddp.batch.templating": "slurmddp.batch.script.templating",
    "slurmddp.batch.sbatch": "slurmddp.batch.script.sbatch",
    "slurmddp.batch.container": "slurmddp.batch.script.container",
    "slurmddp.batch.submission": "slurmddp.batch.transport.submission",
    "slurmddp.batch.snapshot": "slurmddp.batch.transport.snapshot",
    "slurmddp.batch.executor": "slurmddp.batch.functions.executor",
    "slurmddp.batch.call": "slurmddp.batch.functions.call",
    "slurmddp.batch.emulation": "slurmddp.batch.local.emulation",
}

# An old module that is now a package at the same path -> where the old names the package no
# longer offers went, and those names (the old module's __all__).
NAMES = {
    "slurmddp.preemption": ("slurmddp.preemption.api", frozenset({
        "LOCAL_REQUEUE_STATUS", "NOT_REQUEUED_STATUS", "install", "received", "requeue_route",
        "stop_signal",
    })),
}  # fmt: skip


def _deprecated(message: str, stacklevel: int) -> None:
    import warnings  # only when an old path is used: importing slurmddp stays quick

    # Frames of the import machinery (importlib._bootstrap) are skipped in the count, so the
    # warning points at the user's import line.
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


class _OldPaths:
    """Finder and loader of the old module paths."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in MODULES:
            return None
        return ModuleSpec(fullname, cast("Loader", self))

    def create_module(self, spec: ModuleSpec) -> None:
        return None  # a placeholder, replaced below: the new module keeps its own __spec__

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        _deprecated(f"{old} is deprecated: import {MODULES[old]}", stacklevel=2)
        # The import system returns what sys.modules holds under the name once this returns.
        sys.modules[old] = importlib.import_module(MODULES[old])


def install() -> None:
    """Serve the old module paths; last, so that a module really at a path is imported instead."""
    # By the class's module, not isinstance: a test that purges slurmddp from sys.modules and
    # imports it again makes a second _OldPaths class, and one finder is enough.
    if not any(type(finder).__module__ == __name__ for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def attribute(package: str, name: str) -> Any:
    """`name` of the old module `package` (now a package), from where it went, with a warning."""
    new, names = NAMES.get(package, ("", frozenset()))
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    # 3: this function, the package's __getattr__, the import (or attribute access) of the user.
    _deprecated(f"{package}.{name} is deprecated: import it from {new}", stacklevel=3)
    return getattr(importlib.import_module(new), name)

"""Every change slurmddp makes to code that is not its own, in one place.

A `Patch` names one attribute of torch, torch elastic, multiprocessing, torchdata or Accelerate
(or one entry of a dict of theirs), says why it is replaced, and makes the replacement from the
original. Patches are declared beside the code they serve and changed only here:

- nothing is changed on import: `apply` puts a patch in place when the documented start asks
  for it (``slurmddp.init()``, ``python -m slurmddp.run``, ``slurmddp.agent``, an integration's
  object); the runner, which leaves torch's import to the script, applies torch's as the script
  first imports it (`when_imported`);
- `remove` puts one original back, `remove_all` every one; `applied` says what is in force;
- a target this version of the library lacks is left alone (`apply` returns False) and the
  caller says what is lost. tests/test_dependencies.py pins every target across the declared
  versions.

docs/concepts/patches.md lists them all (a test keeps the page and `declared()` the same).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

from slurmddp.errors import warn

__all__ = ["Patch", "applied", "apply", "declared", "original", "remove", "remove_all",
           "when_imported"]

_ABSENT = object()


@dataclass(frozen=True)
class Patch:
    """One name of another library's, replaced by ``make(original)`` while applied.

    `target` is ``"module:Name.attribute"`` or ``"module:dict_name[key]"``; `why` is the
    one-line reason the concepts page gives; `by` says which start applies it. An attribute of a
    class is only patched where the class defines it itself (a subclass's own stays its own).
    """

    target: str
    why: str
    by: str
    make: Callable[[Any], Any] = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        _declared[self.target] = self

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]


# target -> (holder, attribute or None, key or None, original, ours); what `apply` replaced.
_declared: dict[str, Patch] = {}
_applied: dict[str, tuple[Any, str | None, str | None, Any, Any]] = {}


def declared() -> dict[str, Patch]:
    """Every patch declared by the modules imported so far, by target."""
    return dict(_declared)


def applied() -> list[str]:
    """The targets replaced now, in the order they were."""
    return list(_applied)


def _where(target: str) -> tuple[Any, str | None, str | None]:
    """(holder, attribute, key) of `target`; raises LookupError where it is not there."""
    module, _, path = target.partition(":")
    try:
        holder: Any = importlib.import_module(module)
    except ImportError as e:
        raise LookupError(target) from e
    key = None
    if path.endswith("]"):
        path, _, key = path[:-1].partition("[")
    *outer, name = path.split(".")
    for part in outer:
        holder = getattr(holder, part, _ABSENT)
        if holder is _ABSENT:
            raise LookupError(target)
    if key is not None:
        holder = getattr(holder, name, None)
        if not isinstance(holder, dict):
            raise LookupError(target)
        return holder, None, key
    return holder, name, None


def _current(holder: Any, attribute: str | None, key: str | None) -> Any:
    if key is not None:
        return holder.get(key, _ABSENT)
    if isinstance(holder, type):
        return holder.__dict__.get(attribute or "", _ABSENT)  # the descriptor, not a bound method
    return getattr(holder, attribute or "", _ABSENT)


def _put(holder: Any, attribute: str | None, key: str | None, value: Any) -> None:
    if key is not None:
        holder[key] = value
    else:
        setattr(holder, attribute or "", value)


def apply(patch: Patch) -> bool:
    """Put `patch` in place (importing its module); idempotent. False where the target is not
    there in this version of its library: then nothing is changed."""
    if patch.target in _applied:
        return True
    try:
        holder, attribute, key = _where(patch.target)
    except LookupError:
        return False
    before = _current(holder, attribute, key)
    if before is _ABSENT:
        return False
    ours = patch.make(before)
    _put(holder, attribute, key, ours)
    _applied[patch.target] = (holder, attribute, key, before, ours)
    return True


def original(patch: Patch) -> Any:
    """What `patch` replaced; raises LookupError while it is not applied."""
    if patch.target not in _applied:
        raise LookupError(f"{patch.target} is not patched")
    return _applied[patch.target][3]


def remove(patch: Patch) -> None:
    """Put the original of `patch` back (nothing where it is not applied). Where something else
    has replaced the name since (another library wrapping ours), it is left in place, with a
    warning: putting the original back would drop that library's change without a word."""
    entry = _applied.pop(patch.target, None)
    if entry is None:
        return
    holder, attribute, key, before, ours = entry
    if _current(holder, attribute, key) is not ours:
        warn(f"{patch.target} was replaced again after slurmddp's patch: left as it is now "
             "(slurmddp's patch may still run inside it)")  # fmt: skip
        return
    _put(holder, attribute, key, before)


def remove_all() -> None:
    """Put back every original, newest first, and forget what waits for an import."""
    for finder in _finders():
        sys.meta_path.remove(finder)
    for target in reversed(list(_applied)):
        remove(_declared[target])


# -- after an import ------------------------------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs its callbacks right after the module `name` is first executed, then leaves
    ``sys.meta_path``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.then: list[Callable[[ModuleType], Any]] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name or name in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.fire(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def fire(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for then in self.then:
            then(module)


def _finders() -> list[_AfterImport]:
    # By the class's module, not isinstance: a test that imports slurmddp afresh makes a second
    # class.
    return [cast("_AfterImport", f) for f in sys.meta_path if type(f).__module__ == __name__]


def when_imported(name: str, then: Callable[[ModuleType], Any]) -> None:
    """`then(module)` once the module `name` is imported: now if it is, else right after it is
    first executed (the runner's way of acting on torch without importing it)."""
    if name in sys.modules:
        then(sys.modules[name])
        return
    finder = next((f for f in _finders() if f.name == name), None)
    if finder is None:
        finder = _AfterImport(name)
        sys.meta_path.insert(0, finder)
    if then not in finder.then:
        finder.then.append(then)


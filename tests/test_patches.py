"""slurmddp.patches: what slurmddp changes in other libraries, in one place, undone on request;
and importing slurmddp changes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from slurmddp import patches
from tests.conftest import launcher_free_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def library(monkeypatch):
    """A stand-in library `fakelib` with a class, a module function and a dict of handlers."""
    module = types.ModuleType("fakelib")

    class Base:
        def run(self):
            return "base"

    class Child(Base):
        pass

    module.Base, module.Child = Base, Child  # type: ignore[attr-defined]
    module.handlers = {"env": "torch's"}  # type: ignore[attr-defined]
    module.helper = lambda: "helper"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakelib", module)
    made: list[patches.Patch] = []

    def patch(target: str, make=lambda original: (lambda *a: ("ours", original(*a)))):
        made.append(patches.Patch(target, why="a test", by="a test", make=make))
        return made[-1]

    yield module, patch
    for p in made:
        patches.remove(p)
        patches._declared.pop(p.target, None)


def test_apply_replaces_once_and_remove_puts_the_original_back(library):
    module, patch = library
    run = patch("fakelib:Base.run")
    original = module.Base.__dict__["run"]
    assert patches.apply(run) and patches.apply(run)  # idempotent: wrapped once
    assert module.Base().run() == ("ours", "base")
    assert patches.original(run) is original and "fakelib:Base.run" in patches.applied()
    patches.remove(run)
    assert module.Base.__dict__["run"] is original and "fakelib:Base.run" not in patches.applied()
    with pytest.raises(LookupError):
        patches.original(run)


def test_a_dict_entry_and_a_module_attribute_are_patched_and_put_back(library):
    module, patch = library
    entry = patch("fakelib:handlers[env]", make=lambda original: f"ours over {original}")
    helper = patch("fakelib:helper")
    assert patches.apply(entry) and patches.apply(helper)
    assert module.handlers == {"env": "ours over torch's"} and module.helper()[0] == "ours"
    patches.remove_all()
    assert module.handlers == {"env": "torch's"} and module.helper() == "helper"


def test_a_name_replaced_again_since_is_left_to_whoever_replaced_it(library, capsys):
    module, patch = library
    run = patch("fakelib:Base.run")
    original = module.Base.__dict__["run"]
    assert patches.apply(run)
    ours = module.Base.__dict__["run"]
    module.Base.run = lambda self: ("theirs", ours(self))  # another library wraps ours
    patches.remove(run)
    assert module.Base().run() == ("theirs", ("ours", "base"))  # their wrapper kept
    assert capsys.readouterr().err == ("slurmddp: fakelib:Base.run was replaced again after "
                                       "slurmddp's patch: left as it is now (slurmddp's patch "
                                       "may still run inside it)\n")  # fmt: skip
    assert "fakelib:Base.run" not in patches.applied()
    module.Base.run = original


@pytest.mark.parametrize("target", [
    "fakelib:Child.run",  # inherited: a subclass's attribute is not the class's own
    "fakelib:Base.gone", "fakelib:handlers[gone]", "fakelib:Gone.run", "fakelib:helper.x[y]",
    "not_a_module_anywhere:Thing.run",
])  # fmt: skip
def test_a_target_this_version_lacks_is_left_alone(library, target):
    module, patch = library
    assert patches.apply(patch(target)) is False
    assert target not in patches.applied()
    assert module.Child().run() == "base" and module.handlers == {"env": "torch's"}


def test_when_imported_runs_after_the_first_import_then_leaves_the_import_system(tmp_path,
                                                                                monkeypatch):
    (tmp_path / "later_lib.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "later_lib", raising=False)
    seen: list[int] = []
    before = list(sys.meta_path)
    patches.when_imported("later_lib", lambda m: seen.append(m.VALUE))
    patches.when_imported("later_lib", lambda m: seen.append(m.VALUE + 1))
    assert seen == [] and len(sys.meta_path) == len(before) + 1  # one finder for the module
    import later_lib  # noqa: F401

    assert seen == [1, 2] and sys.meta_path == before
    patches.when_imported("later_lib", lambda m: seen.append(3))  # imported: at once
    assert seen == [1, 2, 3]


def test_remove_all_forgets_what_waits_for_an_import():
    before = list(sys.meta_path)
    patches.when_imported("a_module_nobody_imports", print)
    patches.remove_all()
    assert sys.meta_path == before


# -- slurmddp's own patches ----------------------------------------------------------------------

PAGE = ROOT / "docs" / "concepts" / "patches.md"

# What changes nothing on import, what each documented start applies, and that remove_all puts
# every original back: in a process of its own, every module of slurmddp imported.
PROGRAM = r"""
import atexit, importlib, json, os, pkgutil, signal, sys, threading
import accelerate.data_loader, multiprocessing.process, torch, torch.distributed
import torch.distributed.elastic.rendezvous.dynamic_rendezvous, torch.utils.data
import torch.utils.data._utils.fetch
import torchdata.stateful_dataloader
# What slurmddp's modules import of other libraries, first: what those do on import is theirs.
import cloudpickle, jinja2.sandbox, lightning.pytorch.plugins.environments, submitit.helpers
import torch.nn.parallel, transformers.trainer, transformers.trainer_utils

targets = json.loads(sys.argv[1])

def value(target):
    module, _, path = target.partition(":")
    holder, key = sys.modules[module], None
    if path.endswith("]"):
        path, _, key = path[:-1].partition("[")
    for part in path.split("."):
        holder = holder.__dict__[part] if isinstance(holder, type) else getattr(holder, part)
    return holder[key] if key is not None else holder

def snapshot():
    return {
        "targets": {t: id(value(t)) for t in targets},
        "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                     if isinstance(s, signal.Signals)},
        "mask": sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "environ": dict(os.environ), "threads": threading.active_count(),
        "atexit": atexit._ncallbacks(), "meta_path": [repr(type(f)) for f in sys.meta_path],
        "path_hooks": len(sys.path_hooks), "excepthook": repr(sys.excepthook),
        "rendezvous": sorted(sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers),
    }

before = snapshot()
import slurmddp
for info in pkgutil.walk_packages(slurmddp.__path__, "slurmddp."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
after = snapshot()
changed = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
finders = [f for f in sys.meta_path if type(f).__module__ == "slurmddp._moved"]
names = ["torch", "json", "slurmddp", "slurmddp.nothing", "slurmddp.rank.nothing"]
print(json.dumps({"changed": changed,
                  "moved_answers": [n for n in names if finders[0].find_spec(n) is not None],
                  "declared": sorted(slurmddp.patches.declared())}))

from slurmddp import patches
from slurmddp.launch import agent, startup
from slurmddp.training import loader
slurmddp.init("gloo", timeout=30)
startup.patch()
loader.follow_accelerate_epochs()
agent.restart_when_a_peer_is_lost()
started = snapshot()
print(json.dumps({"applied": sorted(patches.applied()),
                  "replaced": sorted(t for t in targets
                                     if started["targets"][t] != before["targets"][t])}))
torch.distributed.destroy_process_group()
patches.remove_all()
print(json.dumps({"left": sorted(t for t in targets
                                 if snapshot()["targets"][t] != before["targets"][t]),
                  "installed": loader.installed()}))
"""


def test_the_concepts_page_lists_every_patch_and_importing_slurmddp_changes_nothing():
    import importlib
    import pkgutil

    import slurmddp

    for info in pkgutil.walk_packages(slurmddp.__path__, "slurmddp."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    declared = sorted(patches.declared())
    listed = sorted(re.findall(r"^\| `([^`]+:[^`]+)` \|", PAGE.read_text(), re.M))
    assert listed == declared, "docs/concepts/patches.md's table and the declared patches differ"

    # What an earlier version replaced and this one must leave alone, watched too.
    watched = [*declared, "torch.utils.data._utils.fetch:_MapDatasetFetcher.fetch"]
    r = subprocess.run([sys.executable, "-c", PROGRAM, json.dumps(watched)],
                       capture_output=True, text=True, timeout=300, env=launcher_free_env())
    assert r.returncode == 0, r.stderr
    imported, started, removed = (json.loads(line) for line in r.stdout.splitlines()[-3:])
    # Importing every module of slurmddp: no patch, no handler, no thread, no variable, no
    # exit hook; one finder, for slurmddp's own moved module names and nothing else.
    assert imported["declared"] == declared
    assert list(imported["changed"]) == ["meta_path"], imported["changed"]
    old, new = imported["changed"]["meta_path"]
    assert new == [*old, "<class 'slurmddp._moved._OldPaths'>"]
    assert imported["moved_answers"] == []
    # The documented starts apply every one; remove_all puts every original back.
    assert started["applied"] == started["replaced"] == declared
    assert removed == {"left": [], "installed": False}

"""The public API, pinned: `slurmddp.__all__` and that of every module the README, the docs and
the examples tell users to import, as literal lists, so that a name that moves or goes is a
decision taken here, not an accident. The previous release's module paths still import, for one
more release, with a DeprecationWarning naming the new path, and give the very same objects."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmddp import _moved
from tests.conftest import ROOT

PUBLIC = {
    "slurmddp": [
        "Checkpointer", "DistEnv", "EnvError", "Executor", "JobFailedError", "JobSpec",
        "ResumableDistributedSampler", "__version__", "bootstrap", "build_spec", "heartbeat",
        "init", "mark_done", "requeue", "resolve", "run_id", "should_stop", "submit",
    ],
    "slurmddp.checkpoint": ["Checkpoint", "CheckpointError", "Checkpointer", "wait_for_saves"],
    "slurmddp.checkpoint.snapshots": ["Snapshots", "close_all"],
    "slurmddp.integrations.accelerate": ["Preemptible"],
    "slurmddp.integrations.lightning": ["StopProtocol", "fit"],
    "slurmddp.integrations.transformers": ["StopProtocol", "train"],
    "slurmddp.preemption": ["mark_done", "requeue", "should_stop"],
    "slurmddp.rank.env": [
        "DEFAULT_PORT", "DEFAULT_PORTS", "DistEnv", "EnvError", "LAUNCHER_PREFIXES",
        "LAUNCHER_VARIABLES", "LOOPBACK", "Launcher", "MpiNodes", "NodesUnknown", "PORT_BASE",
        "PORT_SPAN", "derive_port", "hostfile_head", "launcher_variables", "port_range", "resolve",
    ],
    "slurmddp.rank.hostlist": ["compress", "expand", "expand_tasks_per_node"],
    "slurmddp.training": ["loader", "sampler", "train_state"],
    "slurmddp.training.loader": ["NotResumable", "enabled", "exclude", "expect", "fingerprint",
                                 "inexact", "install", "installed", "load", "mix", "sampler_of",
                                 "state", "tracked", "uninstall"],
    "slurmddp.training.train_state": [
        "capture", "capture_rng", "own", "own_rank_only", "per_rank", "prime_ddp",
        "prime_on_next_forward", "restore", "restore_rng", "unwrap",
    ],
}  # fmt: skip

# Optional frameworks: a module that imports one is checked where it is installed.
FRAMEWORK = {
    "slurmddp.integrations.accelerate": "accelerate",
    "slurmddp.integrations.lightning": "lightning",
    "slurmddp.integrations.transformers": "transformers",
}

# The previous release's module paths: the module each became, and names the old module offered
# (its whole __all__ where it declared one). Dropping an old path is a deliberate edit here.
OLD = {
    "slurmddp.agreement": ("slurmddp.preemption.agreement", ["Agreement"]),
    "slurmddp.bootstrap": ("slurmddp.rank.bootstrap", ["bootstrap", "current"]),
    "slurmddp.cli_jobs": ("slurmddp.cli.jobs", ["status"]),
    "slurmddp.cli_submit": ("slurmddp.cli.submit", ["main_submit"]),
    "slurmddp.config": ("slurmddp.batch.spec.config", ["Settings", "load_sources"]),
    "slurmddp.coordination": ("slurmddp.rank.coordination", ["wait_all"]),
    "slurmddp.decision": ("slurmddp.preemption.decision", ["decide"]),
    "slurmddp.doctor": ("slurmddp.launch.doctor", ["run_checks"]),
    "slurmddp.env": ("slurmddp.rank.env", ["DistEnv", "EnvError", "resolve"]),
    "slurmddp.hostlist": ("slurmddp.rank.hostlist", [
        "compress", "expand", "expand_tasks_per_node",
    ]),
    "slurmddp.jobs": ("slurmddp.batch.jobs", ["JobRecord"]),
    "slurmddp.jobspec": ("slurmddp.batch.spec.jobspec", [
        "BACKENDS", "JobSpec", "LAUNCHERS", "MANAGED_SBATCH_OPTIONS", "SIGNALS", "SpecError",
        "build_spec", "parse_env_pair", "parse_nodes", "parse_time", "validate",
    ]),
    "slurmddp.mpi": ("slurmddp.rank.mpi", ["survey"]),
    "slurmddp.output": ("slurmddp.rank.output", ["prefix_output"]),
    "slurmddp.placement": ("slurmddp.rank.placement", ["cpu_threads"]),
    "slurmddp.process_group": ("slurmddp.launch.process_group", ["init"]),
    "slurmddp.sampler": ("slurmddp.training.sampler", ["ResumableDistributedSampler"]),
    "slurmddp.sbatch": ("slurmddp.batch.script.sbatch", ["render_script"]),
    "slurmddp.signals": ("slurmddp.preemption.signals", ["Receiver"]),
    "slurmddp.startup": ("slurmddp.launch.startup", ["join"]),
    "slurmddp.submission": ("slurmddp.batch.transport.submission", ["submit"]),
    "slurmddp.templating": ("slurmddp.batch.script.templating", ["render"]),
    "slurmddp.train_state": ("slurmddp.training.train_state", [
        "capture", "capture_rng", "prime_ddp", "prime_on_next_forward", "restore", "restore_rng",
        "unwrap",
    ]),
    # The launchers left the pure placement modules (slurmddp.rank) for slurmddp.launch.
    "slurmddp.cli.links": ("slurmddp.links", ["docs_url", "help_link"]),
    "slurmddp.rank.agent": ("slurmddp.launch.agent", ["main"]),
    "slurmddp.rank.doctor": ("slurmddp.launch.doctor", ["run_checks"]),
    "slurmddp.rank.preflight": ("slurmddp.launch.preflight", ["main"]),
    "slurmddp.rank.process_group": ("slurmddp.launch.process_group", ["init"]),
    "slurmddp.rank.runner": ("slurmddp.launch.runner", ["main"]),
    "slurmddp.rank.startup": ("slurmddp.launch.startup", ["join"]),
    # slurmddp.batch split by concern (spec, script, transport, functions, local).
    "slurmddp.batch.options": ("slurmddp.batch.spec.options", ["OPTIONS"]),
    "slurmddp.batch.config": ("slurmddp.batch.spec.config", ["Settings", "load_sources"]),
    "slurmddp.batch.profiles": ("slurmddp.batch.spec.profiles", ["list_profiles"]),
    "slurmddp.batch.jobspec": ("slurmddp.batch.spec.jobspec", ["JobSpec", "build_spec"]),
    "slurmddp.batch.templating": ("slurmddp.batch.script.templating", ["render"]),
    "slurmddp.batch.sbatch": ("slurmddp.batch.script.sbatch", ["render_script"]),
    "slurmddp.batch.container": ("slurmddp.batch.script.container", ["rank_prefix"]),
    "slurmddp.batch.submission": ("slurmddp.batch.transport.submission", ["submit"]),
    "slurmddp.batch.snapshot": ("slurmddp.batch.transport.snapshot", ["take"]),
    "slurmddp.batch.executor": ("slurmddp.batch.functions.executor", ["Executor", "submit"]),
    "slurmddp.batch.call": ("slurmddp.batch.functions.call", ["main"]),
    "slurmddp.batch.emulation": ("slurmddp.batch.local.emulation", ["main"]),
}  # fmt: skip
NEEDS_TORCH = {"slurmddp.sampler", "slurmddp.train_state"}  # as their new modules do

# The old module slurmddp.preemption is now a package at the same path: the rest of its __all__.
OLD_PREEMPTION = [
    "LOCAL_REQUEUE_STATUS", "NOT_REQUEUED_STATUS", "install", "received", "requeue_route",
    "stop_signal",
]  # fmt: skip

USER = "<user code>"  # where the warnings must point: the user's import line, not ours


def _module(name: str) -> Any:
    if name in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[name])
    return importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_all_is_pinned(name: str) -> None:
    names = _module(name).__all__
    assert len(set(names)) == len(names), f"{name}.__all__ repeats a name"
    assert sorted(names) == sorted(PUBLIC[name])


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_resolves(name: str) -> None:
    module = _module(name)
    for attr in module.__all__:
        # A package's __all__ may name submodules, which `from package import name` imports.
        if not hasattr(module, attr):
            importlib.import_module(f"{name}.{attr}")
        assert getattr(module, attr) is not None, f"{name}.{attr}"


def _documented() -> Iterator[tuple[str, str, str | None]]:
    """(file, module, name) of every import of slurmddp in the README, the docs and the
    examples' code, and of every call `slurmddp.f(...)` / `train_state.f(...)` in it (name None
    for a bare ``import slurmddp...``)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").glob("*.py"))]  # fmt: skip
    for path in files:
        text = path.read_text()
        code = text if path.suffix == ".py" else "\n".join(re.findall(r"```python\n(.*?)```",
                                                                       text, re.S))
        modules = {"slurmddp": "slurmddp"}  # the name in the code -> the module
        imports = r"^ *from (slurmddp[\w.]*) import ([\w, ]+)$|^ *import (slurmddp[\w.]*)$"
        for m in re.finditer(imports, code, re.M):
            if m[3]:
                yield path.name, m[3], None
                continue
            for name in (n.strip() for n in m[2].split(",")):
                yield path.name, m[1], name
                if f"{m[1]}.{name}" in PUBLIC:
                    modules[name] = f"{m[1]}.{name}"
        for local, module in modules.items():
            for call in re.findall(rf"(?<![\w.]){local}\.(\w+)\(", code):
                yield path.name, module, call


def test_documented_names_are_pinned() -> None:
    """A module the documents tell users to import is pinned above, with every name they use."""
    missing = sorted({(file, module, name) for file, module, name in _documented()
                      if module not in PUBLIC or (name is not None and name not in PUBLIC[module])})
    assert not missing, f"documented, not in PUBLIC: {missing}"


@pytest.fixture
def first_import() -> Iterator[None]:
    """Each old path imported as for the first time (a module warns once, as it is first
    imported), then forgotten again."""

    def forget() -> None:
        for old in _moved.MODULES:
            sys.modules.pop(old, None)
            # The import system binds the module on its parent; a top-level name (bootstrap)
            # that shares the name is looked up lazily again.
            package, _, short = old.rpartition(".")
            if package in sys.modules:
                vars(sys.modules[package]).pop(short, None)

    forget()
    yield
    forget()


def _run(source: str) -> dict[str, Any]:
    """Runs `source` as the user's own code, checking that it warns of an old path, and at it."""
    namespace: dict[str, Any] = {}
    with pytest.warns(DeprecationWarning) as record:
        exec(compile(source, USER, "exec"), namespace)
    ours = [w for w in record if str(w.message).startswith("slurmddp.")]
    for warning in ours:
        assert (warning.filename, warning.lineno) == (USER, 1), str(warning.message)
    namespace["warned"] = [str(w.message) for w in ours]
    return namespace


def test_the_old_paths_are_the_ones_served() -> None:
    served = {old: new for old, (new, _) in OLD.items()}
    assert served == _moved.MODULES
    assert {"slurmddp.preemption": ("slurmddp.preemption.api", frozenset(OLD_PREEMPTION))} == (
        _moved.NAMES
    )


@pytest.mark.usefixtures("first_import")
@pytest.mark.parametrize("old", sorted(OLD))
def test_old_path_warns_and_is_the_new_module(old: str) -> None:
    new, names = OLD[old]
    message = f"{old} is deprecated: import {new}"
    package, _, short = old.rpartition(".")

    ran = _run(f"import {old}")
    assert message in ran["warned"]
    parent = importlib.import_module(package)
    assert sys.modules[old] is importlib.import_module(new) is getattr(parent, short)

    vars(parent).pop(short)
    del sys.modules[old]
    ran = _run(f"from {old} import {', '.join(names)}")
    assert message in ran["warned"]
    new_module = importlib.import_module(new)
    for name in names:
        assert ran[name] is getattr(new_module, name), name


@pytest.mark.usefixtures("first_import")
@pytest.mark.parametrize("old", sorted(set(OLD) - {"slurmddp.bootstrap"}))
def test_from_slurmddp_import_old_module(old: str) -> None:
    # Not slurmddp.bootstrap: `from slurmddp import bootstrap` is the function, in the previous
    # release as in this one.
    new, _ = OLD[old]
    package, _, short = old.rpartition(".")
    ran = _run(f"from {package} import {short}")
    assert f"{old} is deprecated: import {new}" in ran["warned"]
    assert ran[short] is importlib.import_module(new)


def test_the_old_module_moved_from_is_patched_through() -> None:
    """One module under two names: a monkeypatch through the old one is seen through the new."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("slurmddp.hostlist")
    new = importlib.import_module("slurmddp.rank.hostlist")
    original = new.expand
    try:
        old.expand = lambda nodelist: ["patched"]
        assert new.expand("n[1-2]") == ["patched"]
    finally:
        new.expand = original


@pytest.mark.parametrize("name", OLD_PREEMPTION)
def test_old_preemption_names_warn_and_are_the_api(name: str) -> None:
    api = importlib.import_module("slurmddp.preemption.api")
    message = f"slurmddp.preemption.{name} is deprecated: import it from slurmddp.preemption.api"
    ran = _run(f"from slurmddp.preemption import {name}")
    assert message in ran["warned"]
    assert ran[name] is getattr(api, name)
    with pytest.warns(DeprecationWarning, match=re.escape(message)):
        assert getattr(importlib.import_module("slurmddp.preemption"), name) is getattr(api, name)


def test_new_preemption_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from slurmddp.preemption import mark_done, requeue, should_stop  # noqa: F401
    with pytest.raises(AttributeError):
        _ = importlib.import_module("slurmddp.preemption").no_such_name


def _python(code: str, cwd: Path) -> str:
    # Not in the checkout: `python -c` would import its slurmddp/, not the installed one.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_importing_slurmddp_and_old_paths_leaves_torch_out(tmp_path: Path) -> None:
    old = sorted(set(OLD) - NEEDS_TORCH)
    code = f"""if True:
        import json, sys, warnings
        warnings.simplefilter("ignore", DeprecationWarning)
        import slurmddp
        torch = ["slurmddp"] if "torch" in sys.modules else []
        for name in {old!r}:
            __import__(name)
            if "torch" in sys.modules and not torch:
                torch.append(name)
        from slurmddp.preemption import install, should_stop
        torch += ["slurmddp.preemption"] if "torch" in sys.modules and not torch else []
        print(json.dumps(torch))
    """
    assert json.loads(_python(code, tmp_path)) == [], "these imported torch"


def test_the_entry_points_are_not_deprecated(tmp_path: Path) -> None:
    _python("import warnings; warnings.simplefilter('error', DeprecationWarning); "
            "import slurmddp.run, slurmddp.agent, slurmddp.emulation", tmp_path)  # fmt: skip

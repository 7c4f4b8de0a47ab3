"""The private APIs of dependencies that slurmddp relies on, pinned: a release that changes one
fails here, saying which, before a job does.

- submitit: ``_submit_command`` and ``_make_submission_file_text`` submit our own batch script
  (slurmddp.batch.transport.submission; submitit has no public way to). pyproject.toml bounds
  submitit.
- torch: ``torch.distributed.rendezvous._rendezvous_handlers`` lets the runner bound a script's
  own ``init_process_group()`` (slurmddp.launch.startup.patch); ``slurmddp.init`` takes the public
  route, a ``slurmddp://`` scheme registered with ``register_rendezvous_handler``.
- torch: a DataLoader worker is recognised by its target, ``torch.utils.data._utils.worker.
  _worker_loop`` (slurmddp.preemption.workers shields it from Slurm's TERM); torch.compile's
  wrapper holds the module as ``_orig_mod`` (slurmddp.training.train_state.unwrap).
- torch: the DataLoader's inside, which slurmddp.training.loader wraps once installed: the
  iterator reads the loader's ``_index_sampler`` property, draws its base seed from
  ``loader.generator`` and takes ``loader.worker_init_fn`` as it is made, counts ``_num_yielded``
  in ``_BaseDataLoaderIter.__next__``; a worker runs its init function before it makes its
  fetcher, and hands each index the sampler gives to ``_MapDatasetFetcher.fetch``.
"""

from __future__ import annotations

import datetime
import inspect
import json
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import submitit

from slurmddp import patches
from slurmddp.batch import jobs
from slurmddp.batch.jobs import status
from slurmddp.batch.spec.jobspec import build_spec
from slurmddp.batch.transport import submission
from slurmddp.launch import startup
from tests.conftest import launcher_free_env

# --- submitit ----------------------------------------------------------------------------------


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(
    ("owner", "name", "expected"),
    [(submitit.SlurmExecutor, "_submit_command", ["self", "command"]),
     (submitit.SlurmExecutor, "_make_submission_file_text", ["self", "command", "uid"]),
     (submitit.LocalExecutor, "_submit_command", ["self", "command"])],
)  # fmt: skip
def test_submitits_private_methods_take_what_we_pass(owner, name, expected):
    method = getattr(owner, name, None)
    assert method is not None, f"submitit {submitit.__version__}: {owner.__name__}.{name} is gone"
    assert parameters(method) == expected, (
        f"submitit {submitit.__version__}: {owner.__name__}.{name}{inspect.signature(method)} "
        f"changed; slurmddp.batch.transport.submission calls it as "
        f"{name}({', '.join(expected[1:])})"
    )


def test_submitit_sbatches_our_script_and_hands_back_its_job(tmp_path, monkeypatch):
    # A stand-in sbatch keeps the script it was given and answers as sbatch does.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/bash\ncp "$1" {tmp_path}/submitted.sh\n'
                      'echo "Submitted batch job 4242"\n')  # fmt: skip
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    spec = build_spec(["train.py"], output_dir=str(tmp_path / "out"), nodes=2,
                      ntasks_per_node=3)  # fmt: skip
    (tmp_path / "out").mkdir()  # as submission.submit does first
    executor = submission._TemplateExecutor(spec, "#!/bin/bash\necho ours\n")
    job = executor._submit_command("")
    assert (tmp_path / "submitted.sh").read_text() == "#!/bin/bash\necho ours\n", (
        f"submitit {submitit.__version__} no longer writes _make_submission_file_text's script")
    assert isinstance(job, submitit.SlurmJob) and job.job_id == "4242"
    assert job.num_tasks == 6  # its log paths per task, from update_parameters
    assert Path(job.paths.folder) == tmp_path / "out"


def test_submitits_local_controller_runs_our_command(tmp_path):
    executor = submitit.LocalExecutor(folder=str(tmp_path))
    executor.update_parameters(tasks_per_node=2, timeout_min=1)
    job = executor._submit_command(f"{sys.executable} -c \"print('ran')\"")
    assert isinstance(job, submitit.LocalJob) and job.num_tasks == 2
    deadline = time.monotonic() + 60
    while status._alive(int(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for rank in range(2):  # the layout jobs.LOCAL_LOG_PATTERN names
        log = Path(jobs.LOCAL_LOG_PATTERN.format(folder=tmp_path, job_id=job.job_id, rank=rank))
        assert "ran" in log.read_text(), f"submitit {submitit.__version__}: {log} lacks the output"


# --- torch -------------------------------------------------------------------------------------


def rendezvous_module():
    import torch.distributed  # noqa: F401  (loads the rendezvous module)

    return sys.modules["torch.distributed.rendezvous"]


def test_torch_refuses_to_register_a_scheme_twice():
    # Why the runner cannot replace env:// publicly; if this fails, `startup.patch` could.
    module = rendezvous_module()
    with pytest.raises(RuntimeError, match="already registered"):
        module.register_rendezvous_handler("env", lambda url, **kwargs: iter(()))


def test_torchs_rendezvous_reads_the_private_handlers_at_call_time(monkeypatch):
    module = rendezvous_module()
    handlers = getattr(module, "_rendezvous_handlers", None)
    assert isinstance(handlers, dict) and "env" in handlers, (
        "torch.distributed.rendezvous._rendezvous_handlers['env'] is gone: the runner can no "
        "longer bound a script's own init_process_group() (slurmddp.launch.startup.patch)")
    called: list[str] = []

    def handler(url: str, **kwargs):
        called.append(url)
        yield "store", 0, 1

    monkeypatch.setitem(handlers, "env", handler)
    assert next(module.rendezvous("env://", 0, 1)) == ("store", 0, 1)
    assert called and called[0].startswith("env:")


def test_patch_without_the_private_handlers_keeps_torchs_own_and_says_so(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.rendezvous",
                        types.ModuleType("torch.distributed.rendezvous"))  # fmt: skip
    assert startup.patch() is False
    assert "torch.distributed.rendezvous:_rendezvous_handlers[env]" not in patches.applied()
    err = capsys.readouterr().err
    assert err.startswith("slurmddp: this torch has no torch.distributed.rendezvous."
                          "_rendezvous_handlers['env']"), err  # fmt: skip
    assert "(slurmddp.init() is bounded)" in err


@pytest.fixture
def fake_rendezvous(monkeypatch):
    original = object()
    module = types.SimpleNamespace(_rendezvous_handlers={"env": original})
    monkeypatch.setitem(sys.modules, "torch.distributed.rendezvous", module)
    yield module, original
    patches.remove(startup.ENV_HANDLER)


def test_patch_replaces_env_once_and_its_removal_puts_torchs_back(fake_rendezvous):
    module, original = fake_rendezvous
    assert startup.patch() is True
    patched = module._rendezvous_handlers["env"]
    assert patched is not original and patches.original(startup.ENV_HANDLER) is original
    assert startup.patch() is True
    assert module._rendezvous_handlers["env"] is patched
    patches.remove(startup.ENV_HANDLER)
    assert module._rendezvous_handlers["env"] is original


def test_the_scheme_leaves_what_env_would_refuse_to_torchs_own(monkeypatch):
    # No RANK: torch's env:// error, reached through its public rendezvous().
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    from torch.distributed.rendezvous import rendezvous

    with pytest.raises(ValueError, match="environment variable RANK expected, but not set"):
        next(rendezvous(startup.register(), -1, -1, timeout=datetime.timedelta(seconds=5)))


def test_the_scheme_goes_to_torchs_env_handler_not_through_a_patched_env(fake_rendezvous):
    # Under the runner env:// is ours: through it, the rendezvous would join twice.
    module, _ = fake_rendezvous
    seen: list[str] = []

    def torchs(url: str, **kwargs):
        seen.append(url)
        raise LookupError("torch's own")
        yield

    module._rendezvous_handlers["env"] = torchs
    assert startup.patch() is True
    with pytest.raises(LookupError):
        startup._torch_env("slurmddp:?rank=0&world_size=2", datetime.timedelta(seconds=1), {})
    assert seen == ["env:?rank=0&world_size=2"]


def test_init_takes_the_public_route_and_leaves_env_alone():
    code = """
        import json, sys, slurmddp, torch.distributed as td
        slurmddp.init("gloo", timeout=30)
        module = sys.modules["torch.distributed.rendezvous"]
        handlers = module._rendezvous_handlers
        print(json.dumps({"scheme": "slurmddp" in handlers, "world": td.get_world_size(),
                          "env_patched": handlers["env"].__module__ != module.__name__}))
        td.destroy_process_group()
        """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120, env=launcher_free_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"scheme": True, "world": 1, "env_patched": False}


@pytest.mark.parametrize("kind", ["torch", "torchdata"])
def test_a_dataloader_worker_is_recognised_by_the_function_its_process_runs(monkeypatch, kind):
    import multiprocessing.process

    import torch

    from slurmddp.preemption import workers

    if kind == "torch":
        from torch.utils.data import DataLoader
    else:
        DataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    targets = []

    def record(self):
        targets.append(self._target)
        raise RuntimeError("recorded")  # the worker need not start

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", record)
    loader = DataLoader(torch.arange(4), num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(RuntimeError, match="recorded"):
        next(iter(loader))
    assert targets, f"{DataLoader.__name__} started no worker process"
    assert workers._is_dataloader_worker(targets[0]), (
        f"{kind}'s {DataLoader.__name__} worker now runs {targets[0].__module__}."
        f"{targets[0].__name__}: update slurmddp.preemption.workers._WORKER_LOOPS"
    )


def test_torch_compile_keeps_the_module_as_orig_mod():
    import torch

    from slurmddp.training.train_state import unwrap

    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model)  # nothing is compiled until it is called
    assert getattr(compiled, "_orig_mod", None) is model, (
        "torch.compile's wrapper no longer holds the module as _orig_mod: update "
        "slurmddp.training.train_state.unwrap"
    )
    assert unwrap(compiled) is model


# --- torch's DataLoader, as slurmddp.training.loader wraps it ---------------------------------


def test_the_dataloader_inside_is_what_exact_loading_wraps():
    from torch.utils.data import DataLoader, dataloader
    from torch.utils.data._utils import fetch, worker

    from slurmddp import patches

    # What install() replaces, as torch defines it (its originals where a test of this process
    # installed it).
    def torchs(owner: type, name: str) -> object:
        target = f"torch.utils.data.dataloader:{owner.__name__}.{name}"
        if target in patches.applied():
            return patches.original(patches.declared()[target])
        return owner.__dict__[name]

    assert isinstance(torchs(DataLoader, "_index_sampler"), property)
    assert callable(torchs(DataLoader, "__iter__"))
    assert "self._num_yielded += 1" in inspect.getsource(
        torchs(dataloader._BaseDataLoaderIter, "__next__"))
    # What an iterator reads from its loader as it is made: the index sampler (the skip and the
    # batches' seeds), the generator (its base seed) and, with workers, their init function.
    made = inspect.getsource(dataloader._BaseDataLoaderIter.__init__)
    for needed in ("loader._index_sampler", "random_(generator=loader.generator)",
                   "self._num_yielded = 0"):  # fmt: skip
        assert needed in made, f"torch's DataLoader iterator no longer has {needed!r}"
    workers = inspect.getsource(dataloader._MultiProcessingDataLoaderIter.__init__)
    assert "loader.worker_init_fn" in workers
    # In a worker: the init function runs before the fetcher is made, and the fetcher is handed
    # what the index sampler yields (a batch's keys with its seed), which the init function's
    # fetch unwraps.
    loop = inspect.getsource(worker._worker_loop)
    assert loop.index("init_fn(worker_id)") < loop.index("create_fetcher(")
    assert "fetcher.fetch(index)" in loop
    assert parameters(fetch._MapDatasetFetcher.fetch) == ["self", "possibly_batched_index"]

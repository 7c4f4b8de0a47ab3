"""slurmddp.integrations.accelerate: an Accelerate loop under the stop protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, launcher_free_env, tagged_json
from tests.integrations.preempted import (
    Uninterrupted,
    faulted,
    killed_then_resumed,
    preempted_once,
    through_a_stuck_fork,
)

pytest.importorskip("accelerate")

SCRIPT = str(ROOT / "examples" / "accelerate_train.py")
# As users train: the example's dropout, noise on every sample in 2 worker processes (issue 28).
AS_USERS_TRAIN = ("--augment", "--workers", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Uninterrupted:
    return Uninterrupted(SCRIPT, "--checkpoint-dir", tmp_path_factory)


def run(tmp_path, steps: int):
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", str(steps),
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True,
                       text=True, env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    return tagged_json(r.stdout, "RESULT ")


@pytest.mark.ranks
@pytest.mark.floor
def test_a_saved_step_resumes_to_the_same_parameters(tmp_path):
    reference = run(tmp_path / "a", 40)
    # Save at step 25 through `Preemptible.save`, as a stop would, then resume to 40.
    code = (
        "import sys, runpy; from slurmddp.integrations import accelerate as a\n"
        "def step(self, n):\n"
        "    if n == 25: self.save(n); raise SystemExit(0)\n"
        "a.Preemptible.step = step\n"
        f"sys.argv = [{SCRIPT!r}, '--steps', '40', '--checkpoint-dir', {str(tmp_path / 'b')!r}]\n"
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000025"]
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", "40",
                        "--checkpoint-dir", str(tmp_path / "b")], capture_output=True, text=True,
                       env={**launcher_free_env(), "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert tagged_json(r.stdout, "RESULT ") == reference


# This test, the stuck fork's and the killed loop's alone compare to one uninterrupted run (1 rank,
# 100 steps, 64 an epoch, as users train): each start of the example costs seconds of CPU.
@pytest.mark.ranks
def test_random_augmentation_in_workers_resumes_bitwise(tmp_path, uninterrupted):
    # Issue 28: stopped in the second epoch through Preemptible.save, as a stop would.
    assert faulted(SCRIPT, "--checkpoint-dir", tmp_path / "a", 100, *AS_USERS_TRAIN,
                   STOP_AT="90")[0] == []  # fmt: skip
    assert faulted(SCRIPT, "--checkpoint-dir", tmp_path / "a", 100,
                   *AS_USERS_TRAIN)[0] == uninterrupted(100, *AS_USERS_TRAIN)  # fmt: skip


@pytest.mark.ranks
def test_a_worker_stuck_in_its_fork_before_the_first_step_is_forked_again(
        tmp_path, uninterrupted):  # fmt: skip
    through_a_stuck_fork(uninterrupted, tmp_path, 100, *AS_USERS_TRAIN)


# Four ranks, 16 steps an epoch, stopped at step 20 of 40: the resumed epoch's loader is the
# one `skip_first_batches` rebuilds, whose RandomSampler has no epoch of its own (it drew epoch
# 0's order until Accelerate's epoch was written on it), and DDP's first backward after the
# restart is primed (the sums of 4 ranks differ in their last bits otherwise). Its uninterrupted
# run is the killed loop's at 4 ranks too.
@pytest.mark.ranks
def test_four_ranks_resume_bitwise_in_a_later_epoch(tmp_path, uninterrupted):
    more = AS_USERS_TRAIN
    reference = uninterrupted(40, *more, ranks=4)
    assert len(reference) == 4 and len({x["digest"] for x in reference}) == 1
    assert faulted(SCRIPT, "--checkpoint-dir", tmp_path / "a", 40, *more, ranks=4,
                   STOP_AT="20")[0] == []  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-00000020"]
    assert faulted(SCRIPT, "--checkpoint-dir", tmp_path / "a", 40, *more, ranks=4)[0] == reference


# Issue 30: snapshots every step of what save_state saves; a rank
# killed (SIGKILL, nothing durable written) resumes from the newest snapshot, and ends bitwise:
# alone, and at 4 ranks (torchrun restarts all of them) past the first epoch, as users train.
# Alone it runs the 100 steps of the uninterrupted run the tests above share (on past an epoch).
@pytest.mark.parametrize("ranks", [1, 4])
@pytest.mark.ranks
def test_a_killed_loop_resumes_from_its_snapshot_bitwise(tmp_path, uninterrupted, ranks):
    reference, resumed, at = killed_then_resumed(uninterrupted, tmp_path, ranks,
                                                 100 if ranks == 1 else 40,
                                                 *AS_USERS_TRAIN)  # fmt: skip
    assert 22 <= at <= 24, at  # the snapshot of 24, or one before if 24's was not complete
    assert len(resumed) == ranks and resumed == reference


def test_no_snapshot_is_offered_in_the_middle_of_gradient_accumulation(tmp_path, monkeypatch):
    import torch
    from accelerate import Accelerator

    from slurmddp.integrations.accelerate import Preemptible
    from slurmddp.preemption import api

    monkeypatch.setenv("SLURMDDP_SNAPSHOT_DIR", str(tmp_path / "shm"))
    # The stop protocol, installed in this process, would take the stop signals from the tests
    # that follow (they are its own tests' subject, not this one's).
    monkeypatch.setattr(api, "should_stop", lambda: False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    pre = Preemptible(accelerator, tmp_path / "ckpt", snapshot_every=1, snapshot_budget=None)
    offered = []
    offer = pre.snapshots.offer
    monkeypatch.setattr(pre.snapshots, "offer", lambda step, state: offered.append(step)
                        or offer(step, state))  # fmt: skip
    for batch in range(1, 7):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
        pre.step(batch)
    assert offered == [2, 4, 6]
    pre.snapshots.close()


def test_snapshots_refuse_sharded_models_and_stateful_loaders_and_check_options(tmp_path):
    from types import SimpleNamespace

    from slurmddp.integrations.accelerate import Preemptible

    for kind in ("FSDP", "DEEPSPEED"):
        fake = SimpleNamespace(distributed_type=SimpleNamespace(name=kind))
        with pytest.raises(ValueError, match=f"under {kind} each rank holds a part"):
            Preemptible(fake, tmp_path, snapshot_every=1)
        assert Preemptible(fake, tmp_path).snapshots is None  # the stop alone is fine
    stateful = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"),
                               dataloader_config=SimpleNamespace(use_stateful_dataloader=True))
    with pytest.raises(ValueError, match="snapshots do not keep a stateful loader's position"):
        Preemptible(stateful, tmp_path, snapshot_every=1)
    plain = SimpleNamespace(distributed_type=SimpleNamespace(name="MULTI_CPU"))
    with pytest.raises(ValueError, match="snapshot_keep must be a positive integer, not 0"):
        Preemptible(plain, tmp_path, snapshot_every=1, snapshot_keep=0)
    assert Preemptible(plain, tmp_path, snapshot_every=1).snapshots is not None


@pytest.mark.cluster
# Slurm's default signalling (TERM), as most centres run it: Accelerate handles no signal of its
# own, so how slurmddp's stop comes (USR2 or TERM) is the plain loops' and Lightning's to show.
@pytest.mark.parametrize(("variant", "signal"), [("default-signal", "TERM")])
def test_a_preempted_accelerate_loop_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                                        variant, signal):
    more = ("--augment", "--workers", "2")  # as users train: random augmentation in workers
    with slurm_cluster.variant(variant):
        preempted_once(slurm_cluster, tmp_path, SCRIPT, "--checkpoint-dir", signal=signal,
                       more=more)
    out = tmp_path / "out"
    saved = [p.name for p in out.iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved

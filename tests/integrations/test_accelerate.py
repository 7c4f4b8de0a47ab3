"""slurmddp.integrations.accelerate: an Accelerate loop under the stop protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, lone_rank_env, tagged_json
from tests.integrations.preempted import Uninterrupted, forked_again, killed_stopped_resumed

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
                       text=True, env=lone_rank_env())  # fmt: skip
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
                       env=lone_rank_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-00000025"]
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", "40",
                        "--checkpoint-dir", str(tmp_path / "b")], capture_output=True, text=True,
                       env=lone_rank_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert tagged_json(r.stdout, "RESULT ") == reference


# Issue 28 and 30, alone, as users train (1 rank, 100 steps, 64 an epoch): snapshots every step of
# what save_state saves; killed at step 24 (SIGKILL, nothing durable written), run again, the loop
# resumes from the newest snapshot; stopped in the second epoch through Preemptible.save, as a
# stop would, then run again from that checkpoint, whose first fork never returns before the
# first step asks should_stop (the worker is killed and forked again), it ends bitwise equal to
# the uninterrupted run. (This was test_random_augmentation_in_workers_resumes_bitwise, test_a_
# worker_stuck_in_its_fork_before_the_first_step_is_forked_again and test_a_killed_loop_resumes_
# from_its_snapshot_bitwise[1]: 6 starts of the example, 4 now.)
@pytest.mark.ranks
def test_random_augmentation_in_workers_resumes_bitwise_from_a_snapshot_and_from_a_stop(
        tmp_path, uninterrupted):  # fmt: skip
    at, saved, resumed, stderr = killed_stopped_resumed(
        uninterrupted, tmp_path, 100, 66, *AS_USERS_TRAIN, STUCK_FORK=str(tmp_path / "stuck"))
    # The snapshot of 24, or one before if 24's was not complete; stopped at the 66th step since.
    assert 22 <= at <= 24 and saved == [f"step-{at + 66:08d}"], (at, saved)
    forked_again(tmp_path / "stuck", stderr)
    assert len(resumed) == 1 and resumed == uninterrupted(100, *AS_USERS_TRAIN)


# Three ranks, 22 steps an epoch, as users train: DDP's first backward after a restart is primed
# (with more than two ranks the sums differ in their last bits otherwise: three do, as four).
# Rank 1 killed at step 24 (torchrun restarts all three) resumes from the newest snapshot, past
# the first epoch; stopped in the third through Preemptible.save, it resumes from that checkpoint:
# the resumed epoch's loader is the one `skip_first_batches` rebuilds, whose RandomSampler has no
# epoch of its own (it drew epoch 0's order until Accelerate's epoch was written on it); it ends
# past the third epoch's end, bitwise. (This was test_four_ranks_resume_bitwise_in_a_later_epoch
# and test_a_killed_loop_resumes_from_its_snapshot_bitwise[4]: 20 rank starts, 12 now.)
@pytest.mark.ranks
def test_three_ranks_resume_bitwise_from_snapshots_after_a_rank_is_killed_and_from_a_stop(
        tmp_path, uninterrupted):  # fmt: skip
    reference = uninterrupted(70, *AS_USERS_TRAIN, ranks=3)
    assert len(reference) == 3 and len({x["digest"] for x in reference}) == 1
    at, saved, resumed, _ = killed_stopped_resumed(uninterrupted, tmp_path, 70, 25,
                                                   *AS_USERS_TRAIN, ranks=3)  # fmt: skip
    assert 22 <= at <= 24 and saved == [f"step-{at + 25:08d}"], (at, saved)
    assert resumed == reference


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


# test_a_preempted_accelerate_loop_resumes_and_ends_bitwise_identical[default-signal-TERM] (a
# 2-node job preempted by Slurm's TERM) is proven by its parts: Accelerate handles no signal of its
# own, so slurmddp's stop on Slurm's TERM is a plain loop's (tests/preemption/test_preemption_
# cluster.py::test_preempted_resumes_and_ends_bitwise_identical[default-signal]); the loop's stop
# and resume, bitwise at several ranks, is the three ranks' test's above; the example on 2 nodes
# of the real cluster, bitwise, is tests/integrations/test_snapshots_cluster.py's [accelerate].

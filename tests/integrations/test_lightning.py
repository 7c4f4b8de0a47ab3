"""slurmddp.integrations.lightning: a Lightning Trainer under the stop protocol."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.integrations import preempted
from tests.integrations.preempted import Uninterrupted, preempted_once

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

SCRIPT = str(ROOT / "examples" / "lightning_train.py")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Uninterrupted:
    return Uninterrupted(SCRIPT, "--checkpoint-dir", tmp_path_factory)


# Issue 28: Dropout(0.2), noise added to every sample in 2 worker processes, torchdata's loader
# and torch's own DataLoader ("--plain", which Lightning alone would start its epoch again with).
TRAINING_AS_USERS_WRITE_IT = ("--dropout", "0.2", "--augment", "--workers", "2")


def faulted(ckpt, *more: str, steps: int = 100, **env: str) -> tuple[list[dict], str]:
    """The example as users train (`TRAINING_AS_USERS_WRITE_IT`; `more`: "--plain" for torch's
    DataLoader, and other options) with a fault (`preempted.faulted`), alone."""
    return preempted.faulted(SCRIPT, "--checkpoint-dir", ckpt, steps, *TRAINING_AS_USERS_WRITE_IT,
                             *more, **env)  # fmt: skip


# At 1 rank an epoch is 64 steps. One run stopped three times, each life resumed from the last
# one's checkpoint, the last to the end, bitwise equal to the uninterrupted run: a stop in the
# first epoch; at its last batch (put off to the next, the first of the second epoch); and in the
# second epoch (whose order a resumed DistributedSampler drew as epoch 0's until the callback set
# its epoch). As users train, with torchdata's loader (Lightning keeps its position): its 2
# workers resume in their epoch too (Lightning's issue #21938 is about exactly this: workers
# prefetch as the iterator is made). The last life's first fork never returns, before its first
# step asks should_stop (torchdata's workers' loop is its own, shielded apart from torch's): the
# worker is killed and forked again. (This was test_a_stop_saves_a_checkpoint_the_next_run_
# resumes_from_bitwise[25-25], [64-65] and [90-90], test_dropout_and_augmentation_in_workers_
# resume_bitwise[stateful-dataloader] and test_a_worker_stuck_in_its_fork_before_the_first_step_
# is_forked_again: one stopped run, one resumed and one uninterrupted each, 11 starts of the
# example; 5 now. The DataModule's stop is the three ranks' test's.)
@pytest.mark.ranks
@pytest.mark.floor
def test_stops_in_an_epoch_at_its_last_batch_and_in_the_next_resume_bitwise_one_after_another(
        tmp_path, uninterrupted):  # fmt: skip
    ckpt, saved = tmp_path / "ckpt", []
    # should_stop is asked after each batch: the n-th time in a life resumed at step s is at s + n.
    for stop_at, step in [(25, 25), (64 - 25, 65), (90 - 65, 90)]:
        assert faulted(ckpt, STOP_AT=str(stop_at))[0] == []  # stopped: no result
        saved.append(f"step-{step:08d}.ckpt")
        assert sorted(p.name for p in ckpt.iterdir()) == saved
    results, stderr = faulted(ckpt, STUCK_FORK=str(tmp_path / "stuck"))
    preempted.forked_again(tmp_path / "stuck", stderr)
    assert len(results) == 1 and results == uninterrupted(100, *TRAINING_AS_USERS_WRITE_IT)


# Issue 30: the Trainer's checkpoint kept in the node's memory (snapshot_every=1, within the
# default budget); the process killed mid-epoch (SIGKILL, no checkpoint written) resumes from the
# last snapshot, not from the start; stopped in the same epoch (torch's DataLoader, as users
# train: slurmddp keeps its position), and resumed from that stop, it ends bitwise (on past the
# epoch's end, at 64). (This was also test_dropout_and_augmentation_in_workers_resume_bitwise
# [plain-dataloader]: a stop at 25 of its own.)
@pytest.mark.ranks
@pytest.mark.floor
def test_a_killed_fit_resumes_from_its_snapshot_then_from_a_stop_bitwise(
        tmp_path, uninterrupted):  # fmt: skip
    more = (*TRAINING_AS_USERS_WRITE_IT, "--plain")
    at, saved, resumed, _ = preempted.killed_stopped_resumed(
        uninterrupted, tmp_path, 100, 25, *more, snapshots=("--snapshot-every", "1"))
    assert 0 < at <= 24 and saved == [f"step-{at + 25:08d}.ckpt"], (at, saved)
    assert len(resumed) == 1 and resumed == uninterrupted(100, *more)


# Three ranks (an epoch is 22 steps, the last batch 3 samples): DDP lays its buckets out anew
# after the first backward, and with more than two ranks the layout decides gloo's order of
# summing (three do: the sums of this model's gradients differ with the layout, as at four); the
# resumed run's first backward is primed, or its gradients differ from the uninterrupted run's in
# their last bits. Rank 1 killed at step 24 (torchrun restarts all three on the node) resumes
# from the snapshots; stopped in a later epoch, it resumes from its checkpoint. The data from a
# LightningDataModule (its loader made by train_dataloader(), torchdata's, in the checkpoint's
# epoch too), dropout drawn differently by each rank. (This was also test_a_datamodules_loader_
# resumes_in_its_epoch_too, a stop at 90 alone, and four ranks: 20 rank starts, 12 now.)
@pytest.mark.ranks
def test_three_ranks_resume_bitwise_from_snapshots_after_a_rank_is_killed_and_from_a_stop(
        tmp_path, uninterrupted):  # fmt: skip
    more = ("--datamodule", "--dropout", "0.2")
    reference = uninterrupted(70, *more, ranks=3)
    assert len(reference) == 3 and len({x["digest"] for x in reference}) == 1
    at, saved, resumed, _ = preempted.killed_stopped_resumed(
        uninterrupted, tmp_path, 70, 25, *more, ranks=3, snapshots=("--snapshot-every", "1"))
    stop = at + 25  # put off by a batch at an epoch's last
    assert 0 < at <= 24 and saved == [f"step-{stop + (stop % 22 == 0):08d}.ckpt"], (at, saved)
    assert resumed == reference


def test_snapshot_options_are_checked_as_the_checkpointers_are(tmp_path):
    from slurmddp.integrations.lightning import StopProtocol

    with pytest.raises(ValueError, match="snapshot_every must be an integer >= 0, not -1"):
        StopProtocol(tmp_path, snapshot_every=-1)
    with pytest.raises(ValueError, match="snapshot_budget must be a fraction"):
        StopProtocol(tmp_path, snapshot_every=1, snapshot_budget=2)


def test_snapshots_are_refused_under_a_sharded_strategy(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from slurmddp.integrations.lightning import StopProtocol

    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="under FSDPStrategy each rank holds a part"):
        StopProtocol(tmp_path, snapshot_every=1).setup(trainer, None, "fit")
    StopProtocol(tmp_path).setup(trainer, None, "fit")  # the stop alone is fine


# Lightning picks its SLURMEnvironment under srun. USR1 is also its auto-requeue signal; with
# Slurm's default signalling the stop is TERM, on which Lightning would end fit by itself. Both as
# users train (issue 28): dropout, augmentation in workers, a plain loader; their uninterrupted
# run is one, shared. ([usr2-dropout-augmenting-workers] is proven by [term-default-signalling]'s
# training and by tests/preemption/test_preemption_cluster.py::test_preempted_resumes_and_ends_
# bitwise_identical[standard]: Lightning handles no USR2, so slurmddp's stop on it is a plain
# loop's, and the resume from a stop the unit tests' above.)
CASES = {
    "usr1-with-lightnings-auto-requeue": ("standard", ("--signal", "USR1"), "USR1"),
    "term-default-signalling": ("default-signal", (), "TERM"),
}
REFERENCES: dict = {}  # the cases' uninterrupted run


@pytest.mark.cluster
@pytest.mark.parametrize("case", list(CASES))
def test_a_preempted_lightning_fit_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                                      case):  # fmt: skip
    variant, submit, stop = CASES[case]
    with slurm_cluster.variant(variant):
        # At 2 ranks an epoch is 32 steps: preempted at step 40, the run resumes mid-way through
        # the second epoch, where the samplers' epoch matters.
        job = preempted_once(slurm_cluster, tmp_path, SCRIPT, "--checkpoint-dir", submit=submit,
                             signal=stop, preempt_at=40,
                             more=(*TRAINING_AS_USERS_WRITE_IT, "--plain"),
                             references=REFERENCES)  # fmt: skip
    saved = [p.name for p in (tmp_path / "out").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    said = "which Lightning's SLURM auto-requeue also takes: slurmddp's stop protocol handles it"
    assert (said in job.log()) == (stop == "USR1"), job.log()

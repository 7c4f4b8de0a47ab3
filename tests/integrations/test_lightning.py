"""slurmddp.integrations.lightning: a Lightning Trainer under the stop protocol."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.integrations import preempted
from tests.integrations.preempted import (
    Uninterrupted,
    preempted_once,
    resumed_from_snapshot,
    run_locally,
)

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

SCRIPT = str(ROOT / "examples" / "lightning_train.py")


def run(ckpt, steps: int, stop_at: int | None = None, *more: str) -> list[dict]:
    return run_locally(SCRIPT, "--checkpoint-dir", ckpt, steps, stop_at, *more)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return run(tmp_path_factory.mktemp("reference"), 100)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Uninterrupted:
    return Uninterrupted(SCRIPT, "--checkpoint-dir", tmp_path_factory)


# At 1 rank an epoch is 64 steps: a stop in the first epoch; at its last batch (put off to the
# next, the first of the second epoch); and in the second epoch (whose order a resumed
# DistributedSampler drew as epoch 0's until the callback set its epoch).
@pytest.mark.parametrize(("stop_at", "saved"), [
    (25, 25), pytest.param(64, 65, marks=pytest.mark.floor), (90, 90)])  # fmt: skip
@pytest.mark.ranks
def test_a_stop_saves_a_checkpoint_the_next_run_resumes_from_bitwise(tmp_path, reference,
                                                                     stop_at, saved):  # fmt: skip
    assert run(tmp_path, 100, stop_at=stop_at) == []  # stopped: no result
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{saved:08d}.ckpt"]
    assert run(tmp_path, 100) == reference


@pytest.mark.ranks
def test_a_datamodules_loader_resumes_in_its_epoch_too(tmp_path, reference):
    assert run(tmp_path, 100, 90, "--datamodule") == []
    assert run(tmp_path, 100, None, "--datamodule") == reference


# Issue 28: Dropout(0.2), noise added to every sample in 2 worker processes, torch's own
# DataLoader (which Lightning alone would start its epoch again with) and torchdata's.
TRAINING_AS_USERS_WRITE_IT = ("--dropout", "0.2", "--augment", "--workers", "2")


def faulted(ckpt, *more: str, steps: int = 30, ranks: int = 1,
            **env: str) -> tuple[list[dict], str]:  # fmt: skip
    """The example as users train (`TRAINING_AS_USERS_WRITE_IT`; `more`: "--plain" for torch's
    DataLoader, and other options) with a fault (`preempted.faulted`)."""
    return preempted.faulted(SCRIPT, "--checkpoint-dir", ckpt, steps, *TRAINING_AS_USERS_WRITE_IT,
                             *more, ranks=ranks, **env)  # fmt: skip


# With torchdata's loader this also proves what a test of its 2 workers alone (stopped at 90 too,
# no dropout, no augmentation) did: workers resume in their epoch (Lightning's issue #21938 is
# about exactly this: workers prefetch as the iterator is made). The uninterrupted runs are
# shared, as each start of the example costs seconds of CPU: torchdata's with the stuck fork
# test, the plain one with the killed fit's.
@pytest.mark.parametrize(("loader", "stop_at"), [(("--plain",), 25), ((), 90)],
                         ids=["plain-dataloader", "stateful-dataloader"])  # fmt: skip
@pytest.mark.ranks
def test_dropout_and_augmentation_in_workers_resume_bitwise(tmp_path, uninterrupted, loader,
                                                            stop_at):  # fmt: skip
    reference = uninterrupted(100, *TRAINING_AS_USERS_WRITE_IT, *loader)
    assert faulted(tmp_path / "ckpt", *loader, steps=100, STOP_AT=str(stop_at))[0] == []
    assert faulted(tmp_path / "ckpt", *loader, steps=100)[0] == reference


@pytest.mark.ranks
def test_a_worker_stuck_in_its_fork_before_the_first_step_is_forked_again(
        tmp_path, uninterrupted):  # fmt: skip
    # torchdata's loader (its workers' loop is its own, shielded apart from torch's), as users
    # train: the dropout test's uninterrupted run.
    preempted.through_a_stuck_fork(uninterrupted, tmp_path, 100, *TRAINING_AS_USERS_WRITE_IT)


# Issue 30: the Trainer's checkpoint kept in the node's memory (snapshot_every=1, within the
# default budget); the process killed mid-epoch (SIGKILL, no checkpoint written) resumes from the
# last snapshot, not from the start, and ends bitwise (on past the epoch's end, at 64: the 100
# steps of the uninterrupted run it shares).
@pytest.mark.ranks
@pytest.mark.floor
def test_a_killed_fit_resumes_from_its_snapshot_bitwise(tmp_path, uninterrupted):
    node = {"SLURMDDP_SNAPSHOT_DIR": str(tmp_path / "shm"), "CRASH_RANK": "0"}
    snapshots = ("--plain", "--snapshot-every", "1")
    assert faulted(tmp_path / "ckpt", *snapshots, steps=100, CRASH_AT="25", **node)[0] == []
    assert not (tmp_path / "ckpt").exists()  # nothing durable was written
    resumed, said = faulted(tmp_path / "ckpt", *snapshots, steps=100, **node)
    reference = uninterrupted(100, *TRAINING_AS_USERS_WRITE_IT, "--plain")
    assert 0 < resumed_from_snapshot(said) <= 25 and resumed == reference


# Four ranks (an epoch is 16 steps): DDP lays its buckets out anew after the first backward, and
# with more than two ranks the layout decides gloo's order of summing; the resumed run's first
# backward is primed, or its gradients differ from the uninterrupted run's in their last bits.
# Then one rank killed (torchrun restarts all four on the node) resumes from the snapshots.
@pytest.mark.ranks
def test_four_ranks_resume_bitwise_from_a_stop_and_from_snapshots_after_a_rank_is_killed(
        tmp_path):  # fmt: skip
    reference, _ = faulted(tmp_path / "reference", "--plain", ranks=4)
    assert len(reference) == 4 and len({x["digest"] for x in reference}) == 1
    assert faulted(tmp_path / "stop", "--plain", ranks=4, STOP_AT="20")[0] == []
    assert faulted(tmp_path / "stop", "--plain", ranks=4)[0] == reference
    resumed, said = faulted(tmp_path / "killed", "--plain", "--snapshot-every", "1", ranks=4,
                            SLURMDDP_SNAPSHOT_DIR=str(tmp_path / "shm"), CRASH_AT="24")  # fmt: skip
    assert 0 < resumed_from_snapshot(said) <= 24 and resumed == reference


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
# Slurm's default signalling the stop is TERM, on which Lightning would end fit by itself.
# The first, also as users train (issue 28): dropout, augmentation in workers, a plain loader.
CASES = {
    "usr2-dropout-augmenting-workers": ("standard", (), "USR2"),
    "usr1-with-lightnings-auto-requeue": ("standard", ("--signal", "USR1"), "USR1"),
    "term-default-signalling": ("default-signal", (), "TERM"),
}


@pytest.mark.cluster
@pytest.mark.parametrize("case", list(CASES))
def test_a_preempted_lightning_fit_resumes_and_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                                      case):  # fmt: skip
    variant, submit, stop = CASES[case]
    with slurm_cluster.variant(variant):
        # At 2 ranks an epoch is 32 steps: preempted at step 40, the run resumes mid-way through
        # the second epoch, where the samplers' epoch matters.
        more = (*TRAINING_AS_USERS_WRITE_IT, "--plain") if case.startswith("usr2") else ()
        job = preempted_once(slurm_cluster, tmp_path, SCRIPT, "--checkpoint-dir", submit=submit,
                             signal=stop, preempt_at=40, more=more)  # fmt: skip
    saved = [p.name for p in (tmp_path / "out").iterdir()]
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    said = "which Lightning's SLURM auto-requeue also takes: slurmddp's stop protocol handles it"
    assert (said in job.log()) == (stop == "USR1"), job.log()

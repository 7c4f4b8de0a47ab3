"""slurmddp.integrations.transformers: the Hugging Face Trainer under the stop protocol."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, launcher_free_env, lone_rank_env, tagged_json
from tests.integrations.preempted import (
    Uninterrupted,
    forked_again,
    killed_stopped_resumed,
    killed_then_resumed,
)

pytest.importorskip("transformers")

SCRIPT = str(ROOT / "examples" / "hf_trainer.py")
# As users train: GPT-2's own dropout, a token in eight replaced at random as each sample is read,
# 2 worker processes (issue 28).
AS_USERS_TRAIN = ("--augment", "--workers", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Uninterrupted:
    return Uninterrupted(SCRIPT, "--output-dir", tmp_path_factory)


def test_importing_slurmddp_does_not_import_a_framework():
    code = ("import sys, slurmddp, slurmddp.integrations; "
            "print([m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=launcher_free_env())  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_an_uninterrupted_run_ends_at_its_last_step(tmp_path):
    r = subprocess.run([sys.executable, "-m", "slurmddp.run", SCRIPT, "--steps", "5",
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                       env=lone_rank_env())  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [x["steps"] for x in tagged_json(r.stdout, "RESULT ")] == [5]


# Issue 28 and 30, alone, as users train (1 rank, 100 steps, 64 an epoch): snapshots every step of
# what the Trainer's checkpoint holds; killed at step 24 (SIGKILL, nothing durable written), run
# again, the Trainer resumes from the newest snapshot, written out as the Trainer's checkpoint
# files (which go with the run); stopped in the second epoch, then run again from that checkpoint,
# whose first fork never returns before the first step asks should_stop (the worker is killed and
# forked again), it ends bitwise equal to the uninterrupted run; without slurmddp's seeding in
# that last life it does not. (This was also test_a_worker_stuck_in_its_fork_before_the_first_
# step_is_forked_again and test_a_killed_trainer_resumes_from_its_snapshot_bitwise[1], and the
# control's stop was a run of its own: 8 starts of the example, 5 now.)
@pytest.mark.ranks
@pytest.mark.floor
def test_random_augmentation_in_workers_resumes_bitwise_and_without_the_seeding_does_not(
        tmp_path, uninterrupted):  # fmt: skip
    more = AS_USERS_TRAIN
    reference = uninterrupted(100, *more)
    # The control, from the same stop: torch's own seeding in the last life (the Trainer restores
    # the generators, but the workers' seeds came from where the resumed run's generator stood as
    # the loader started).
    control = {"SLURMDDP_EXACT_DATA": "0"}
    at, saved, resumed, stderr = killed_stopped_resumed(
        uninterrupted, tmp_path, 100, 66, *more, control=control,
        STUCK_FORK=str(tmp_path / "stuck"))  # fmt: skip
    # The snapshot of 24, or one before if 24's was not complete; stopped at the 66th step since.
    assert 22 <= at <= 24 and saved == [f"checkpoint-{at + 66}"], (at, saved)
    assert not list((tmp_path / "shm").glob("*/slurmddp-resume-*"))
    forked_again(tmp_path / "stuck", stderr)
    assert len(resumed) == 1 and resumed == reference
    assert len(control["results"]) == 1 and control["results"] != reference


# Issue 30 at three ranks (torchrun restarts all of them; more than two: the sums of DDP's
# gradients depend on its bucket layout), past the first epoch (22 steps at 3 ranks), as users
# train: rank 1 killed (SIGKILL, nothing durable written) resumes from the newest snapshot,
# written out as the Trainer's checkpoint files, and ends bitwise. ([1], alone, is the test
# above's first two lives; four ranks: 12 rank starts, 9 now.)
@pytest.mark.ranks
def test_three_killed_trainers_resume_from_their_snapshots_bitwise(tmp_path, uninterrupted):
    reference, resumed, at = killed_then_resumed(uninterrupted, tmp_path, 3, 40, *AS_USERS_TRAIN)
    assert 22 <= at <= 24, at  # the snapshot of 24, or one before if 24's was not complete
    assert len(resumed) == 3 and resumed == reference
    # The checkpoint files it was written out as went with the run.
    assert not list((tmp_path / "shm").glob("*/slurmddp-resume-*"))


def test_snapshot_options_are_checked_and_sharded_models_refused():
    from types import SimpleNamespace

    from slurmddp.integrations.transformers import StopProtocol, train

    with pytest.raises(ValueError, match="snapshot_every must be an integer >= 0, not -1"):
        StopProtocol(snapshot_every=-1)
    assert StopProtocol().snapshots is None and StopProtocol(snapshot_every=1).snapshots

    def trainer(**kind):
        def never(*_, **__):
            raise AssertionError("nothing is half done on a refusal")

        return SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[]), train=never,
                               add_callback=never, **kind)  # fmt: skip

    for kind in ({"is_fsdp_enabled": True, "is_deepspeed_enabled": False},
                 {"is_fsdp_enabled": False, "is_deepspeed_enabled": True}):  # fmt: skip
        with pytest.raises(ValueError, match="under FSDP or DeepSpeed each rank holds a part"):
            train(trainer(**kind), snapshot_every=1)


# test_a_preempted_trainer_resumes_at_its_stop_and_ends_bitwise_identical[default-signal-TERM] (a
# 2-node job preempted by Slurm's TERM) is proven by its parts: the Trainer handles no signal of
# its own, so slurmddp's stop on Slurm's TERM is a plain loop's (tests/preemption/test_preemption_
# cluster.py::test_preempted_resumes_and_ends_bitwise_identical[default-signal]); the Trainer's
# stop and resume from its checkpoint-N, bitwise, is the augmentation test's above; the example on
# 2 nodes of the real cluster, bitwise, is tests/integrations/test_snapshots_cluster.py's
# [transformers].

"""Ranks in an Apptainer image on the real cluster (Slurm 26.05, whose root has Apptainer 1.4.5).

The image (conftest's `container_image`) holds Debian bookworm's Python 3.11, torch and
slurmddp's wheel, and an ``%environment`` that sets SLURM_PROCID, SLURM_NODEID,
SLURMDDP_HANG_TIMEOUT=1 and SLURMDDP_SIGNAL=USR1, as an image may: had one of them won over the
job's, ranks would take one another's place, the hang watchdog would end the job at once, or the
ranks would wait for a stop signal that never comes. The batch shell and its decision stay on the
host; the image has no Slurm.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, tagged_json
from tests.preemption.test_preemption_cluster import VARIANTS, Job, train_args
from tests.watchdog.test_watchdog_cluster import hang_job

pytestmark = [pytest.mark.cluster, pytest.mark.container, pytest.mark.slurm("26.05")]

WHERE = str(ROOT / "tests" / "programs" / "where.py")
IMAGE_SITE = "/usr/local/lib/python3.11/dist-packages/"  # where the image holds slurmddp


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_every_rank_runs_in_the_image_with_the_jobs_variables(slurm_cluster, tmp_path,
                                                              container_image, launcher):
    # 2 nodes x 1: each rank's SLURM_PROCID and SLURM_NODEID differ from the image's, as at
    # 2 x 2 (several ranks a node in the image: the preemption test below, 2 x 2).
    job = Job(slurm_cluster, tmp_path, [
        "--nodes", "2", "--ntasks-per-node", "1", "--launcher", launcher, "--container",
        container_image, "--env", "SDDP_VALUE=job", "--env", "OMP_NUM_THREADS=1",
        *(["--preflight"] if launcher == "srun" else []), WHERE,
    ])  # fmt: skip
    end = job.wait_end(timeout=240)
    assert end["JobState"] == "COMPLETED", job.batch_log
    if launcher == "srun":
        seen = [x for r in range(2) for x in tagged_json(job.log(r), "WHERE ")]
        assert "slurmddp: preflight passed" in job.batch_log, job.batch_log
    else:
        logs = "".join(p.read_text() for p in (job.folder / job.id).glob("node-*.log"))
        seen = tagged_json(logs, "WHERE ")
    assert sorted(s["rank"] for s in seen) == [0, 1], seen
    assert sorted(s["env"]["SLURMD_NODENAME"] for s in seen) == ["n1", "n2"], seen
    for s in seen:
        assert s["all_reduce"] == 3.0
        assert s["executable"] == "/usr/bin/python3"  # the image's Python, its slurmddp, its torch
        assert s["slurmddp"].startswith(IMAGE_SITE) and s["torch"].startswith(IMAGE_SITE), s
        env = s["env"]
        assert env["SLURMDDP_IMAGE"] == "1" and env["SDDP_VALUE"] == "job", env
        assert (env["SLURMDDP_HANG_TIMEOUT"], env["SLURMDDP_SIGNAL"]) == ("600", "USR2"), env
        assert env["SLURMD_NODENAME"] in ("n1", "n2") and env["SLURM_NODEID"] in ("0", "1"), env
        if launcher == "srun":  # a task per rank (torchrun: a task per node)
            assert env["SLURM_PROCID"] == env["RANK"] == str(s["rank"]), env


# Slurm's default signalling (TERM to every process of the job), and ours (the stop signal from
# the batch shell, passed on by srun, through Apptainer's runtime): one stop each. [Preempted
# twice in the image] is proven by one stop per signalling and, outside the image, by
# tests/preemption/test_preemption_cluster.py::test_preempted_resumes_and_ends_bitwise_identical
# [standard] and [default-signal], on every Slurm version: a resumed run is preempted again as
# the first was; the image changes how the signal reaches the ranks, the same in every run.
@pytest.mark.parametrize("variant", ["default-signal", "standard"])
def test_preempted_in_the_image_it_ends_bitwise_identical(slurm_cluster, tmp_path,
                                                          container_image, variant,
                                                          reference_digest):  # fmt: skip
    with slurm_cluster.variant(variant):
        job = Job(slurm_cluster, tmp_path, ["--container", container_image,
                                            *train_args(tmp_path / "ckpt", steps=300,
                                                        step_time=0.03)])  # fmt: skip
        job.wait_for_log(r"step 60 ")
        job.preempt()
        end = job.wait_end()
    assert end["JobState"] == "COMPLETED" and end["Restarts"] == "1", job.batch_log
    stops = [int(s) for s in re.findall(r"stopped at step (\d+)", job.log())]
    resumes = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", job.log())]
    assert len(stops) == 1 and resumes == stops, job.log()
    results = job.results()
    assert sorted(x["rank"] for x in results) == [0, 1, 2, 3]
    # The same bits as the uninterrupted run of the host's Python and torch wheel.
    assert {x["digest"] for x in results} == {reference_digest}
    assert re.search(VARIANTS[variant].format(r=0, n=1), job.batch_log), job.batch_log


def test_the_hang_watchdog_names_a_stuck_rank_in_the_image(slurm_cluster, tmp_path,
                                                           container_image):
    job = hang_job(slurm_cluster, tmp_path, "stop", 2,
                   submit_args=("--container", container_image))  # fmt: skip
    end = job.wait_end(timeout=240)
    batch = job.batch_log
    assert (end["JobState"], end["ExitCode"]) == ("FAILED", "124:0"), batch
    assert ("slurmddp: rank 2 on n2 stopped progressing: it did not answer: its process is "
            "stopped, or holds the interpreter lock") in batch, batch
    assert "slurmddp: ranks 0-1,3 merely wait for it" in batch, batch
    hang = job.folder / job.id / "hang"
    assert sorted(int(p.stem.split("-")[1]) for p in hang.glob("rank-*.txt")) == [0, 1, 3]
    assert IMAGE_SITE + "slurmddp/" in (hang / "rank-0.txt").read_text()  # stacks in the image

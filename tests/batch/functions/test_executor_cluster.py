"""Functions as jobs on the real cluster, submitted from this process as a user's Python (or
notebook) would: every rank, rank 0's value, a failing rank named, a Checkpointable preempted by
Slurm and resumed bit for bit, arrays, and the code as it was submitted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbclient
import nbformat
import pytest

import slurmddp
from tests.batch import functions
from tests.conftest import EVERY_SLURM, wait_until
from tests.preemption.test_preemption_cluster import URGENT, job_fields

pytestmark = pytest.mark.cluster


@pytest.fixture
def on_cluster(slurm_cluster, tmp_path, monkeypatch):
    """This process as a user's on a login node of the cluster; an Executor of 2 nodes x 2."""
    for name, value in slurm_cluster.env(XDG_STATE_HOME=str(tmp_path / "state"),
                                         OMP_NUM_THREADS="1").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    return slurmddp.Executor(tmp_path / "jobs", nodes=2, ntasks_per_node=2, partition="debug")


@EVERY_SLURM
def test_every_rank_of_two_nodes_runs_it_and_rank_0s_value_comes_back(on_cluster):
    job = on_cluster.submit(functions.all_reduce, 100.0)
    out = job.results(timeout=240)
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    assert {r["sum"] for r in out} == {406.0} and [r["local_rank"] for r in out] == [0, 1, 0, 1]
    assert out[0]["host"] == out[1]["host"] != out[2]["host"] == out[3]["host"]
    assert job.result() == out[0] and job.state == "COMPLETED"
    # The CLI knows it as any job.
    status = subprocess.run([sys.executable, "-m", "slurmddp", "status", job.job_id],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "COMPLETED" in status.stdout, status.stdout + status.stderr


def test_a_failing_rank_is_named_with_its_node_and_exception(on_cluster):
    job = on_cluster.submit(functions.fail_on, 3, 30.0)
    with pytest.raises(slurmddp.JobFailedError) as caught:
        job.result(timeout=240)
    e = caught.value
    host = job.outcomes()[3].host
    assert str(e) == (f"job {job.job_id}: rank 3 of 4 (on {host}) failed first: "
                      "ValueError: rank 3 broke"), str(e)  # fmt: skip
    assert e.rank == 3 and "rank 3 broke" in e.traceback
    assert job.state == "FAILED"
    batch_log = Path(job.record.folder, f"{job.job_id}.batch.log").read_text()
    assert (f"the first failure a rank reported: rank 3 (host {host}) failed: ValueError: rank 3 "
            "broke") in batch_log, batch_log  # fmt: skip


# 2 nodes x 1, not the module's 2 x 2: what is the executor's own (checkpoint() on every rank at
# the agreed step, rank 0's DelayedSubmission run next, bit for bit) does not depend on how many
# ranks a node has; the stop reaching each of 2 ranks a node is the batch script's and Slurm's,
# proven at 2 x 2 on every Slurm version in tests/preemption/test_preemption_cluster.py: Slurm's
# TERM to every task by test_preempted_resumes_and_ends_bitwise_identical[default-signal], the
# batch shell's USR2 through srun by test_time_limit_checkpoints_requeues_and_completes. The
# uninterrupted run it is compared with is computed in this process (functions.
# uninterrupted_digest, bit for bit at 2 ranks), not a job of its own.
@pytest.mark.parametrize(("variant", "signal"), [("standard", "USR2"), ("default-signal", "TERM")])
def test_a_preempted_checkpointable_is_checkpointed_on_every_rank_and_resumes_bitwise(
    on_cluster, slurm_cluster, tmp_path, variant, signal
):
    """Preempted under our cluster's signalling (USR2 first) and under Slurm's default (TERM
    alone), as most centres run it."""
    with slurm_cluster.variant(variant):
        preempted_checkpointable(on_cluster, slurm_cluster, tmp_path, signal)


def preempted_checkpointable(on_cluster, slurm_cluster, tmp_path: Path, signal: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    on_cluster.update_parameters(ntasks_per_node=1)
    job = on_cluster.submit(functions.Trainer(120, 0.1, str(marks)))
    wait_until(lambda: job.log(0).exists() and "step 30 " in job.log(0).read_text(), 120,
               "step 30 of the job to preempt")  # fmt: skip
    restarts = int(job_fields(slurm_cluster, job.job_id)["Restarts"])
    urgent = subprocess.run(URGENT, capture_output=True, text=True, timeout=60)
    assert urgent.returncode == 0, urgent.stderr
    wait_until(lambda: int(job_fields(slurm_cluster, job.job_id).get("Restarts", -1)) > restarts,
               120, "the requeue")  # fmt: skip
    out = job.result(timeout=300)
    reference = functions.uninterrupted_digest(120, 2)
    assert out["steps"] == 120 and out["digest"] == reference, (out, reference)  # bit for bit
    stop = out["runs"][1]
    assert out["runs"] == [0, stop] and 30 <= stop < 120, out
    # checkpoint() ran on both ranks, at the same agreed step, in the first run only.
    made = sorted(p.name for p in marks.iterdir())
    assert made == [f"rank-{r}-restart-0-step-{stop}" for r in range(2)], made
    batch_log = Path(job.record.folder, f"{job.job_id}.batch.log").read_text()
    assert re.search(rf"stopped \(preempted, {signal}\) at restart 0 after its checkpoint: "
                     r"requeued", batch_log), batch_log  # fmt: skip
    fields = job_fields(slurm_cluster, job.job_id)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1"


def test_map_array_is_one_slurm_array_with_its_states_counted(on_cluster):
    on_cluster.update_parameters(nodes=1, ntasks_per_node=2)
    array = on_cluster.map_array(functions.times, [1, 2, 3], [5, 5, 5], parallelism=2)
    assert len({j.record.job_id for j in array}) == 1  # one array job
    assert array.results(timeout=240) == [(5, 0, "0"), (10, 0, "1"), (15, 0, "2")]
    assert array.state == "COMPLETED 3" and [j.state for j in array] == ["COMPLETED"] * 3
    assert array[1].log(1).exists()  # each task's ranks log under the task's own job id


def test_the_job_runs_the_code_as_submitted_not_as_edited_while_it_waited(on_cluster, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "mymodel.py").write_text("def version():\n    return 'as submitted'\n")
    sys.path.insert(0, str(code))
    try:
        import mymodel

        on_cluster.update_parameters(nodes=1, ntasks_per_node=1, sbatch_args=["--hold"])
        job = on_cluster.submit(mymodel.version)
        (code / "mymodel.py").write_text("def version():\n    return 'edited later'\n")
        released = subprocess.run(["scontrol", "release", job.job_id], capture_output=True,
                                  text=True)  # fmt: skip
        assert released.returncode == 0, released.stderr
        assert job.result(timeout=240) == "as submitted"
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("mymodel", None)


NOTEBOOK_CELLS = [
    "import os, slurmddp",
    # A function of the notebook itself: pickled whole, nothing to import on the nodes.
    textwrap.dedent("""\
        def where(x):
            slurmddp.init(backend="gloo")
            import torch, torch.distributed as dist
            t = torch.tensor([float(x)])
            dist.all_reduce(t)
            return os.environ.get("SLURMD_NODENAME"), int(os.environ["RANK"]), t.item()
        """),
    "job = slurmddp.submit(where, 2, folder=FOLDER, nodes=2, partition='debug')",
    "print('RESULT', json.dumps(job.results(timeout=240)))",
]


@pytest.mark.parametrize("local", [False, True], ids=["cluster", "local"])
def test_from_a_notebook(on_cluster, tmp_path, local):
    """A real Jupyter kernel runs the cells, as a user's notebook does."""
    folder = tmp_path / "jobs"
    cells = [f"import json\nFOLDER = {str(folder)!r}", *NOTEBOOK_CELLS]
    if local:
        cells[3] = cells[3].replace("partition='debug'", "local=True")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    out = json.loads(printed.split("RESULT ", 1)[1])
    assert [rank for _, rank, _ in out] == [0, 1] and {s for _, _, s in out} == {4.0}, out
    assert len({h for h, _, _ in out}) == (1 if local else 2), out

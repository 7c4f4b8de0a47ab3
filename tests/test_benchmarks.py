"""Every benchmark runs once at a tiny size and yields its rows (no time is asserted here)."""

from __future__ import annotations

import json
import signal

import pytest

from benchmarks import (
    checkpoint_write,
    cli_latency,
    cluster,
    cpu_threads,
    data_loading,
    elastic_recovery,
    first_collective,
    hostlist_speed,
    preemption_turnaround,
    rendezvous_scale,
    snapshot,
    training_overhead,
)
from benchmarks.table import Row, dump, render
from tests.conftest import ELSEWHERE_SLURM


def check(rows: list[Row]) -> None:
    assert rows and all(r.ours > 0 and (r.baseline is None or r.baseline > 0) for r in rows)
    assert len(render(rows).splitlines()) == len(rows) + 1


def test_cli_latency():
    check(cli_latency.run(repeats=1))


@pytest.mark.ranks
def test_snapshot_cost():
    # 1 rank, not the benchmark's 2: the same rows, half the processes importing torch (a
    # snapshot's replica to a peer: tests/checkpoint/test_snapshots.py).
    check(snapshot.cost(1, steps=20, large=False, ranks=1))


def test_a_benchmark_run_alone_keeps_the_others_rows(tmp_path):
    path = tmp_path / "results.json"
    dump([Row("a", "m", 1.0, 2.0, "s"), Row("b", "m", 3.0, None, "s")], path)
    dump([Row("b", "m", 4.0, None, "s")], path)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["benchmark"], r["ours"]) for r in rows] == [("a", 1.0), ("b", 4.0)]
    assert all(r["taken"] for r in rows)


@pytest.mark.ranks
def test_training_overhead():
    check(training_overhead.run(steps=20, repeats=1))


def test_checkpoint_write(tmp_path):
    rows = checkpoint_write.run(size_mib=16, repeats=1, directory=str(tmp_path))
    check(rows)
    dump(rows, tmp_path / "out.json")
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [r["metric"] for r in saved["rows"]] == [r.metric for r in rows]
    assert saved["machine"]["cpus"] >= 1


@pytest.mark.ranks
def test_data_loading():
    # 2 batches skipped and 2 epochs started, not 40 and 10: the same code, a fraction of the
    # batches made.
    rows = data_loading.run(batches=5, repeats=1, skipped=2, starts=2)
    check(rows)
    assert [r.baseline_label for r in rows] == ["torch's own seeding", "torch's own DataLoader",
                                                "the consumed batches fetched and dropped",
                                                "multiprocessing's own Process.start"]


def test_hostlist_speed():
    rows = hostlist_speed.run(sizes=(10,), repeats=1)
    check(rows)
    assert [r.metric for r in rows] == ["expand 10 hosts"] * 2 + ["compress 10 hosts"] * 2


@pytest.mark.ranks
def test_rendezvous_scale():
    rows = rendezvous_scale.run(sizes=(8,), repeats=1, gloo_max=8, calls=5, lookups=1)
    check(rows)
    assert sum(r.metric.startswith("rendezvous N=8") for r in rows) == 4


@pytest.mark.cluster
@ELSEWHERE_SLURM
def test_preemption_turnaround(slurm_cluster):
    # 1 node x 1 rank, not the benchmark's 2 x 2: the same phases, a quarter of the processes
    # importing torch in each of the two runs. On 24.11: the passes share the cluster tests by
    # their length (its requeue waits as on every version).
    check(preemption_turnaround.run(repeats=1, nodes=1, per_node=1))


@pytest.mark.cluster
@pytest.mark.elastic
@pytest.mark.slurm("24.11")
def test_elastic_recovery(slurm_cluster):
    # The machine's row (its baseline waits for SlurmdTimeout) is left to the benchmark run; a
    # silent machine is tested in tests/test_elastic_cluster.py.
    # 1 worker a node, not the benchmark's 2: the same losses and restarts, half the workers.
    check(elastic_recovery.run(repeats=1, machine=False, per_node=1))


@pytest.mark.cluster
def test_first_collective(slurm_cluster):
    # 1 rank, not the benchmark's 8: the same code, an eighth of the processes importing torch.
    check(first_collective.run(repeats=1, nodes=1, per_node=1))


@pytest.mark.cluster
def test_cpu_threads(slurm_cluster):
    # 1 node x 1 rank, not the benchmark's 2 x 2: the same three contenders, a quarter of the
    # processes importing torch.
    check(cpu_threads.run(steps=20, repeats=1, nodes=1, per_node=1))


def test_goodput_reads_every_log_but_the_checkpoints(tmp_path):
    # The run itself takes an hour and a half (`python -m benchmarks goodput`): here, what it
    # reads of each submission's output (a full schedule's run died listing a checkpoint's
    # rotation), and the time limit of a stretched schedule.
    from benchmarks.goodput import Run

    (tmp_path / "jobs" / "7").mkdir(parents=True)
    (tmp_path / "jobs" / "7" / "rank-0.log").write_text("STEP 100 5.0\n")
    (tmp_path / "torchrun-8.out").write_text("[0]:STEP 200 9.0\nDONE 200\n")
    (tmp_path / "ckpt" / "step-100").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-100" / "x.log").write_text("STEP 999 1.0\n")  # not a log of the run
    run = Run("slurmddp", tmp_path, {}, 9000, True, spread=3.5)
    assert run.progress() == [(100, 5.0), (200, 9.0)] and run.done()
    assert run.limit_min == 30  # twice the 15 minutes of undisturbed training


def test_a_lost_machine_ends_at_once_and_a_silent_one_stops(monkeypatch):
    # Killed one by one, a process of the machine could act on another's end: srun's shepherd,
    # woken by srun's death, cancels the step on every node (fresh run 41's lost batch host).
    # Two made-up tasks (no slurmd serves a made-up SLURM_CONF); signals recorded, not sent.
    monkeypatch.setattr(cluster, "job_processes", lambda job, node, conf: {
        101: {"SLURM_JOB_ID": job}, 102: {"SLURM_JOB_ID": job}})  # fmt: skip
    ended: list[list[int]] = []
    monkeypatch.setattr(cluster.fence, "kill", ended.append)  # stopped, then killed: its test's
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(cluster.os, "kill", lambda pid, s: sent.append((pid, s)))
    assert cluster.lose_node("7", "n9", "/nonexistent/slurm.conf", machine=True) == [101, 102]
    assert ended == [[101, 102]] and sent == []
    hit = cluster.lose_node("7", "n9", "/nonexistent/slurm.conf", machine=True, sig=signal.SIGSTOP)
    assert hit == [101, 102] and sent == [(101, signal.SIGSTOP), (102, signal.SIGSTOP)]

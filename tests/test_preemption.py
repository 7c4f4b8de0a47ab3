"""The stop protocol in real processes: handlers, agreement over gloo, every requeue route."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurmddp import preemption
from tests.conftest import launcher_free_env
from tests.test_process_group import free_port


@pytest.mark.parametrize(
    ("environ", "expected"),
    [({}, signal.SIGUSR2), ({"SLURMDDP_SIGNAL": "USR1"}, signal.SIGUSR1),
     ({"SLURMDDP_SIGNAL": "SIGTERM"}, signal.SIGTERM)],
)  # fmt: skip
def test_stop_signal_comes_from_the_batch_script_or_defaults_to_usr2(environ, expected):
    assert preemption.stop_signal(environ) == expected


def test_an_unknown_stop_signal_is_named():
    with pytest.raises(ValueError, match="SLURMDDP_SIGNAL='USR9' is not a signal name"):
        preemption.stop_signal({"SLURMDDP_SIGNAL": "USR9"})


@pytest.mark.parametrize(
    ("environ", "route"),
    [
        ({"SLURMDDP_REQUEUE_FILE": "/j/requeue", "SLURM_JOB_ID": "7"}, "batch"),
        ({"SLURMDDP_LOCAL_RESTART_FILE": "/j/7_restarts"}, "local"),
        ({"SLURM_JOB_ID": "7"}, "scontrol"),
        ({}, "none"),
    ],
    ids=["our-batch-script", "local-emulation", "plain-srun-in-a-job", "no-scheduler"],
)
def test_requeue_route(environ, route):
    assert preemption.requeue_route(environ) == route


def test_requeue_target_names_the_array_task():
    assert preemption.requeue_target({"SLURM_JOB_ID": "41"}) == "41"
    array = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert preemption.requeue_target(array) == "40_3"


def test_requeue_budget():
    assert preemption.requeue_budget({}) == (0, 3)
    env = {"SLURM_RESTART_COUNT": "2", "SLURMDDP_MAX_REQUEUES": "5"}
    assert preemption.requeue_budget(env) == (2, 5)
    with pytest.raises(ValueError, match="is not a count"):
        preemption.requeue_budget({"SLURM_RESTART_COUNT": "-1"})


def test_the_agreement_tensor_lives_where_the_backend_reduces():
    assert preemption.flag_device("gloo", None) == "cpu"
    assert preemption.flag_device("mpi", None) == "cpu"
    assert preemption.flag_device("nccl", 3) == "cuda:3"
    with pytest.raises(RuntimeError, match="needs a current CUDA device"):
        preemption.flag_device("nccl", None)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          env=launcher_free_env(**env), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize("sig", ["SIGUSR2", "SIGTERM"])
def test_the_signal_only_sets_the_flag(sig):
    r = run_python(f"""
        import os, signal, slurmddp
        from slurmddp import preemption
        preemption.install()
        before = slurmddp.should_stop()
        os.kill(os.getpid(), signal.{sig})
        print(before, preemption.received().name, slurmddp.should_stop(), slurmddp.should_stop())
        """)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", sig, "True", "True"]
    assert f"{sig} received: every rank stops" in r.stderr


def test_every_n_calls_only_each_nth_looks():
    r = run_python("""
        import os, signal, slurmddp
        from slurmddp import preemption
        preemption.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        print([slurmddp.should_stop(every=3) for _ in range(4)])
        """)  # fmt: skip
    assert r.stdout.strip() == "[False, False, True, True]", r.stderr


def test_mark_done_ends_the_stop_protocol(tmp_path):
    done = tmp_path / "done"
    r = run_python("""
        import os, signal, slurmddp
        slurmddp.mark_done()
        os.kill(os.getpid(), signal.SIGUSR2)
        print(slurmddp.should_stop())
        slurmddp.requeue()
        """, SLURMDDP_DONE_FILE=str(done),
        SLURMDDP_REQUEUE_FILE=str(tmp_path / "requeue"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "the job is marked done: not requeued" in r.stderr
    assert done.exists() and not (tmp_path / "requeue").exists()


AGREE = """
    import json, os, signal, sys, slurmddp
    import torch.distributed as td
    d = slurmddp.init("gloo", timeout=60)
    stops = None
    for step in range(1, 50):
        if d.rank == 1 and step == 7:
            os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 is warned
        if slurmddp.should_stop(every=EVERY):
            stops = step
            break
    print(json.dumps({"rank": d.rank, "stops": stops}))
    td.barrier()
    td.destroy_process_group()
"""


@pytest.mark.parametrize("every", [1, 4])
def test_all_ranks_stop_at_the_same_step_when_one_is_signalled(every):
    port = str(free_port())
    code = textwrap.dedent(AGREE).replace("EVERY", str(every))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=launcher_free_env(RANK=str(r), WORLD_SIZE="3",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in range(3)
    ]  # fmt: skip
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    # Rank 1 got it before its 7th call; with every=4, the next call that looks is the 8th.
    expected = 7 if every == 1 else 8
    assert [r["stops"] for r in results] == [expected] * 3


PACED = """
    import json, os, signal, time, slurmddp
    import torch.distributed as td
    d = slurmddp.init("gloo", timeout=60)
    agreements, reduce = 0, td.all_reduce
    def counting(*args, **kwargs):
        global agreements
        agreements += 1
        return reduce(*args, **kwargs)
    td.all_reduce = counting
    stops = None
    for step in range(1, 3000):
        time.sleep(0.005)
        if d.rank == 1 and step == 300:
            os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 is warned
        if slurmddp.should_stop():
            stops = step
            break
    print(json.dumps({"rank": d.rank, "stops": stops, "agreements": agreements}))
    td.all_reduce = reduce
    td.barrier()
    td.destroy_process_group()
"""


def test_by_default_ranks_agree_about_once_a_second_and_stop_together():
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(PACED)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=launcher_free_env(RANK=str(r), WORLD_SIZE="3",
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for r in range(3)
    ]  # fmt: skip
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    stops = {r["stops"] for r in results}
    assert len(stops) == 1, results
    # Steps take at least 5 ms, so the gap between agreements never exceeds 200 calls.
    assert 300 <= stops.pop() <= 500, results
    # About one agreement per second (~2 s of steps) after the gap has grown, not one per step.
    assert {r["agreements"] for r in results} == {results[0]["agreements"]}
    assert results[0]["agreements"] < 30, results


@pytest.mark.parametrize(
    ("previous", "seconds_per_call", "expected"),
    [(1, 0.5, 2), (1, 0.001, 2), (64, 0.001, 128), (512, 0.001, 1000), (100, 2.0, 1),
     (8, 0.0, 16), (10_000, 1e-9, preemption.MAX_CALLS_BETWEEN)],
)  # fmt: skip
def test_the_gap_follows_the_pace_and_at_most_doubles(previous, seconds_per_call, expected):
    assert preemption.calls_between(previous, seconds_per_call) == expected


REQUEUE = """
    import os, signal, slurmddp
    from slurmddp import preemption
    preemption.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert slurmddp.should_stop()
    slurmddp.requeue()
"""


def test_under_the_batch_script_rank_0_leaves_the_reason_and_every_rank_exits_0(tmp_path):
    requeue = tmp_path / "requeue"
    for rank in ("1", "0"):
        r = run_python(REQUEUE, RANK=rank, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue))
        assert r.returncode == 0, r.stderr
        assert requeue.exists() == (rank == "0")
    assert requeue.read_text() == "USR2\n"


def test_local_emulation_counts_the_restart_and_asks_submitit_to_requeue(tmp_path):
    counter = tmp_path / "5_restarts"
    r = run_python(REQUEUE, SLURMDDP_LOCAL_RESTART_FILE=str(counter), SLURM_RESTART_COUNT="1")
    assert r.returncode == preemption.LOCAL_REQUEUE_STATUS, r.stderr
    assert counter.read_text() == "2\n"
    assert "stopped by USR2 at restart 1: requeued (2 of 3)" in r.stderr


def test_at_the_requeue_limit_the_job_ends_non_zero_with_the_reason(tmp_path):
    counter = tmp_path / "5_restarts"
    r = run_python(REQUEUE, SLURMDDP_LOCAL_RESTART_FILE=str(counter), SLURM_RESTART_COUNT="2",
                   SLURMDDP_MAX_REQUEUES="2")  # fmt: skip
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "the limit of 2 requeues is reached (--max-requeues)" in r.stderr
    assert not counter.exists()


def test_outside_slurm_nothing_requeues_and_the_status_says_so():
    r = run_python(REQUEUE)
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "outside a Slurm job: nothing requeues it" in r.stderr


def fake_scontrol(tmp_path: Path, status: int = 0) -> dict[str, str]:
    """A stand-in scontrol that records its arguments (the real one is used on the cluster)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\necho refused >&2\nexit {status}\n')
    tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_without_the_batch_script_rank_0_runs_scontrol_requeue_for_the_array_task(tmp_path):
    env = fake_scontrol(tmp_path)
    array = {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    r = run_python(REQUEUE, RANK="1", **array, **env)
    assert r.returncode == 0 and not (tmp_path / "calls").exists()
    r = run_python(REQUEUE, RANK="0", **array, **env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text() == "requeue 40_3\n"
    assert "job 40_3 requeued (1 of 3)" in r.stderr


def test_a_failing_scontrol_requeue_ends_the_job_non_zero(tmp_path):
    r = run_python(REQUEUE, SLURM_JOB_ID="41", **fake_scontrol(tmp_path, status=1))
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "scontrol requeue 41 failed: refused" in r.stderr


def test_term_stops_the_ranks_but_never_requeues(tmp_path):
    # scancel and the hard time limit send TERM: the ranks still stop together and checkpoint,
    # but a cancelled job must stay cancelled.
    requeue = tmp_path / "requeue"
    code = REQUEUE.replace("SIGUSR2", "SIGTERM")
    r = run_python(code, RANK="0", SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue))
    assert r.returncode == preemption.NOT_REQUEUED_STATUS
    assert "stopped by TERM after the checkpoint" in r.stderr and "only USR2 requeues" in r.stderr
    assert not requeue.exists()


def test_the_stop_signal_wins_over_term_seen_on_another_rank():
    r = run_python("""
        import os, signal
        from slurmddp import preemption
        preemption.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        print(preemption.received().name)
        """)  # fmt: skip
    assert r.stdout.strip() == "SIGUSR2", r.stderr


def test_requeue_waits_for_an_asynchronous_save_in_flight(tmp_path):
    requeue = tmp_path / "requeue"
    r = run_python(f"""
        import os, signal, torch, slurmddp
        from slurmddp import preemption
        preemption.install()
        ckpt = slurmddp.Checkpointer({str(tmp_path / "ckpt")!r}, async_save=True)
        ckpt.save(7, {{"w": torch.rand(64 << 20)}})  # 256 MiB: still being written on return
        os.kill(os.getpid(), signal.SIGUSR2)
        assert slurmddp.should_stop()
        slurmddp.requeue()
        """, SLURM_JOB_ID="7", SLURMDDP_REQUEUE_FILE=str(requeue))  # fmt: skip
    assert r.returncode == 0, r.stderr
    latest = tmp_path / "ckpt" / "latest"
    assert latest.read_text().strip() == "step-00000007"
    # The reason is left for the batch shell only once the checkpoint is published.
    assert requeue.stat().st_mtime_ns >= latest.stat().st_mtime_ns

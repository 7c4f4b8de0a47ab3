"""Every script in examples/ runs for real at a tiny size (2 ranks, a few steps) and its RESULT
line says what the example claims: values of the collectives, one all-reduce per accumulated
step, the scaler and the sharded model restored after a stop, DP equal to DDP, a torchrun
script unchanged under Slurm's variables. The DDP + sampler example also goes through
`slurmddp submit --local` with a preemption and comes back to the uninterrupted result.

Ranks are started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) under
`python -m slurmddp.run`: no cluster. The examples that need nothing but torch run in the venv
users get from `pip install torch slurmddp` (`runtime_python`: the wheel and its declared
dependencies alone), where a need the package does not declare shows. A stop is the real
signal, sent to rank 0 once it logs a step; outside a Slurm job nothing requeues, so the ranks
checkpoint and exit 75, and the test starts the next run itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmddp.batch.local.emulation import step_environment
from tests.cli.test_cli_submit import slurmddp
from tests.conftest import ROOT, free_port, launcher_free_env, tagged_json

EXAMPLES = ROOT / "examples"
NOT_REQUEUED = 75  # preemption.NOT_REQUEUED_STATUS: checkpointed, nothing to requeue the job


@dataclasses.dataclass
class Run:
    returncodes: list[int]
    outputs: list[str]  # stdout then stderr, per rank

    @property
    def result(self) -> dict:
        """Rank 0's RESULT line."""
        found = tagged_json(self.outputs[0], "RESULT ")
        assert len(found) == 1, self.outputs[0]
        return found[0]

    def check(self, *codes: int) -> Run:
        assert self.returncodes == list(codes or [0] * len(self.outputs)), self.text
        return self

    @property
    def text(self) -> str:
        return "\n".join(f"--- rank {r}\n{o}" for r, o in enumerate(self.outputs))


def launch(tmp_path: Path, script: str | Path, *args: str, world: int = 2,
           stop_at: str | None = None, rank_env=None, timeout: float = 120,
           python: str = sys.executable) -> Run:  # fmt: skip
    """Run examples/`script` (or the program at that path) on `world` ranks under slurmddp.run,
    by `python`, in `tmp_path`.

    `stop_at`: a regular expression; once rank 0's output matches it, rank 0 gets the stop
    signal. `rank_env(rank)`: the launcher variables of a rank (default: RANK, WORLD_SIZE...).
    """
    port = str(free_port())

    def by_hand(rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port}  # fmt: skip

    rank_env = rank_env or by_hand
    logs = [tmp_path / f"rank{r}-{time.monotonic_ns()}.log" for r in range(world)]
    procs = []
    for r, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [python, "-m", "slurmddp.run", str(EXAMPLES / script), *args],
                cwd=tmp_path, env=launcher_free_env(**rank_env(r)), stdout=out,
                stderr=subprocess.STDOUT))  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        if stop_at is not None:
            while not re.search(stop_at, logs[0].read_text(), re.M):
                assert procs[0].poll() is None, f"rank 0 ended first:\n{logs[0].read_text()}"
                assert time.monotonic() < deadline, logs[0].read_text()
                time.sleep(0.02)
            procs[0].send_signal(signal.SIGUSR2)
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return Run([p.returncode for p in procs], [log.read_text() for log in logs])


# -- no training state -----------------------------------------------------------------------


@pytest.mark.ranks  # in the venv users get (the floor's pass runs other collectives)
def test_collectives_tour_gives_each_operation_its_documented_values(tmp_path, runtime_python):
    run = launch(tmp_path, "collectives_tour.py", python=runtime_python).check()
    assert run.result == {
        "world_size": 2,
        "send/recv": [2.0, 1.0],  # rank r got r-1's r: rank 0 from rank 1, rank 1 from rank 0
        "broadcast": [42.0, 42.0],
        "scatter": [0.0, 10.0],
        "gather": [[0.0, 1.0], None],
        "reduce": [3.0, None],
        "all_reduce": [3.0, 3.0],
        "all_gather": [[0.0, 2.0], [0.0, 2.0]],
    }
    # One printed line per operation, from rank 0 only.
    assert re.search(r"^all_reduce .* rank 0: 3\.0  rank 1: 3\.0$", run.outputs[0], re.M)
    assert "rank 0:" not in run.outputs[1]


@pytest.mark.ranks
def test_grad_accumulation_all_reduces_once_per_step_and_matches_the_large_batch(
        tmp_path, runtime_python):  # fmt: skip
    run = launch(tmp_path, "grad_accumulation.py", "--steps", "3", "--accum", "4",
                 python=runtime_python).check()  # fmt: skip
    per_micro = run.result["allreduces_per_micro_step"]
    # no_sync: no all-reduce on the 3 first micro-batches of any step; on the last, one per
    # gradient bucket of each of the 3 steps.
    assert per_micro[:3] == [0, 0, 0] and per_micro[3] > 0 and per_micro[3] % 3 == 0
    assert run.result["grad_max_diff"] < 1e-5


@pytest.mark.ranks
def test_dp_and_ddp_train_to_the_same_parameters(tmp_path, runtime_python):
    run = launch(tmp_path, "dp_vs_ddp.py", "--steps", "10", python=runtime_python).check()
    assert run.result["same"] is True and run.result["max_param_diff"] < 1e-5


# -- stopped and resumed ---------------------------------------------------------------------


def stop_and_resume(tmp_path: Path, script: str, *args: str, stopped: str, resumed: str,
                    python: str, world: int = 2) -> tuple[Run, Run, Run]:  # fmt: skip
    """(uninterrupted, stopped by the signal, resumed) runs of `script` on `world` ranks by
    `python`, in their own dirs."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "cut").mkdir()
    ref = launch(tmp_path / "ref", script, *args, world=world, python=python).check()
    # Slow steps, so that the stop falls well before the end (the ranks agree once a second).
    cut = launch(tmp_path / "cut", script, *args, "--step-time", "0.05", "--log-every", "1",
                 world=world, stop_at=r"^step 2 ",
                 python=python).check(*[NOT_REQUEUED] * world)  # fmt: skip
    assert re.search(stopped, cut.outputs[0], re.M), cut.text
    assert "outside a Slurm job: nothing requeues it" in cut.text
    again = launch(tmp_path / "cut", script, *args, world=world, python=python).check()
    assert re.search(resumed, again.outputs[0], re.M), again.text
    return ref, cut, again


@pytest.mark.ranks
def test_amp_gradscaler_state_is_checkpointed_and_restored(tmp_path, runtime_python):
    # 1 rank: the scaler's state is each rank's own, saved and restored the same on any number
    # (2 ranks stopped at one agreed step and resumed bitwise: the FSDP test below, the DDP
    # sampler's under local emulation).
    ref, cut, again = stop_and_resume(
        tmp_path, "amp_gradscaler.py", "--steps", "40", "--growth-interval", "3",
        stopped=r"^stopped at step (\d+): loss scale (\S+), growth tracker (\d+)$",
        resumed=r"^resumed at step (\d+): loss scale (\S+), growth tracker (\d+)$", world=1,
        python=runtime_python,
    )  # fmt: skip
    at_stop = re.search(r"^stopped at step (\d+): loss scale (\S+), growth tracker (\d+)$",
                        cut.outputs[0], re.M).groups()  # fmt: skip
    at_resume = re.search(r"^resumed at step (\d+): loss scale (\S+), growth tracker (\d+)$",
                          again.outputs[0], re.M).groups()  # fmt: skip
    assert at_resume == at_stop
    assert 3 <= int(at_stop[0]) < 40
    # The scale had grown past its initial 65536: a scaler started afresh would not match.
    assert float(at_stop[1]) > 65536.0 and again.result["resumed_scale"] == float(at_stop[1])
    final = {k: ref.result[k] for k in ("scale", "growth_tracker", "digest", "steps")}
    assert {k: again.result[k] for k in final} == final
    assert ref.result["dtype"] == "bfloat16" and ref.result["resumed_scale"] is None


@pytest.mark.ranks
def test_fsdp_resumes_from_a_sharded_checkpoint_to_the_uninterrupted_result(tmp_path,
                                                                            runtime_python):
    # DCP's plans go through torch's object collectives, which need numpy (declared: torch
    # does not install it; without it the ranks hung).
    ref, cut, again = stop_and_resume(tmp_path, "fsdp_sharded.py", "--steps", "40",
                                      stopped=r"^stopped at step \d+$",
                                      resumed=r"^resumed from step-\d+ at step \d+$",
                                      python=runtime_python)  # fmt: skip
    step = re.search(r"^stopped at step (\d+)$", cut.outputs[0], re.M).group(1)
    assert f"resumed from step-{int(step):08d} at step {step}" in again.outputs[0]
    # Each rank wrote its own shard file.
    saved = tmp_path / "cut" / "checkpoints" / "fsdp_sharded" / f"step-{int(step):08d}"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(saved))
    assert again.result["digest"] == ref.result["digest"]
    assert ref.result["parameters_on_rank0"] < ref.result["parameters"]


# -- launchers -------------------------------------------------------------------------------


@pytest.mark.ranks
def test_torchrun_tutorial_runs_unchanged_on_the_variables_slurmddp_exports(tmp_path,
                                                                            runtime_python):
    source = (EXAMPLES / "torchrun_tutorial.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+slurmddp", source, re.M)
    # What srun gives two tasks on two nodes, and nothing torchrun would set.
    port = str(free_port())
    run = launch(tmp_path, "torchrun_tutorial.py", "2", "1",
                 rank_env=lambda r: step_environment(r, 2, 1, "4242") | {"MASTER_PORT": port},
                 python=runtime_python).check()  # fmt: skip
    ranks = run.result["ranks"]
    for r, seen in enumerate(ranks):
        assert seen | {"digest": None} == {
            "RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(r), "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
            "MASTER_PORT": port, "dist_rank": r, "dist_world_size": 2, "digest": None,
        }  # fmt: skip
    assert ranks[0]["digest"] == ranks[1]["digest"]  # DDP kept the replicas equal
    assert "Training snapshot saved at snapshot.pt" in run.outputs[0]


@pytest.mark.cluster
def test_torchrun_tutorial_under_a_plain_srun(slurm_cluster, python, tmp_path):
    r = slurm_cluster.srun(["-N2", "--ntasks-per-node=1"],
                           [python, "-m", "slurmddp.run", str(EXAMPLES / "torchrun_tutorial.py"),
                            "1", "1"], cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (result,) = tagged_json(r.stdout, "RESULT ")
    ranks = result["ranks"]
    assert [(s["RANK"], s["GROUP_RANK"], s["LOCAL_RANK"]) for s in ranks] == [
        ("0", "0", "0"), ("1", "1", "0")]  # fmt: skip
    assert {(s["WORLD_SIZE"], s["dist_world_size"]) for s in ranks} == {("2", 2)}
    # MASTER_ADDR: the step's first node, whichever Slurm picked; the same on both ranks.
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in ranks}) == 1
    assert re.fullmatch(r"n[1-4]", ranks[0]["MASTER_ADDR"])
    assert ranks[0]["digest"] == ranks[1]["digest"]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


LIBRARIES = [n for n in ("lightning", "pytorch_lightning", "accelerate") if _installed(n)]


@pytest.mark.skipif(not LIBRARIES, reason="neither Lightning nor Accelerate is installed "
                    "(the test extra installs Accelerate)")  # fmt: skip
def test_lightning_or_accelerate_sees_the_exported_variables(tmp_path):
    run = launch(tmp_path, "lightning_or_accelerate.py", "--steps", "4", timeout=300).check()
    for r, output in enumerate(run.outputs):
        (seen,) = tagged_json(output, "RESULT ")
        assert (seen["rank"], seen["world_size"], seen["local_rank"]) == (r, 2, r), run.text
        assert seen["environment"]["RANK"] == str(r)
        assert seen["environment"]["WORLD_SIZE"] == "2" and seen["steps"] == 4


def test_lightning_or_accelerate_says_why_it_does_nothing_without_them(tmp_path):
    # None in sys.modules makes find_spec (and import) see the libraries as absent.
    hide = ("import runpy, sys\n"
            "for name in ('lightning', 'pytorch_lightning', 'accelerate'):\n"
            "    sys.modules[name] = None\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", hide, str(EXAMPLES / "lightning_or_accelerate.py")],
                       cwd=tmp_path, env=launcher_free_env(), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("neither Lightning nor Accelerate is installed")


# -- end to end: slurmddp submit --local, preempted ------------------------------------------


@pytest.mark.ranks
def test_ddp_sampler_eval_is_preempted_under_local_emulation_and_resumes(tmp_path,
                                                                         runtime_python):
    # 40 steps an epoch at 0.1 s a step, the stop signal at the 10th step of the first run and
    # the 20th of the second (counted from each run's first step: slurmddp.preemption.rehearsal;
    # the ranks stop a few steps later, the time the signal takes through the batch script's
    # processes): the first stop falls inside the first epoch, and the resumed run starts
    # mid-epoch; the second comes before the last step. Preempted twice, this is also the local
    # emulation's proof of tests/batch/local/test_emulation.py's former preempted-twice test:
    # only a second stop shows the emulation's restart counter past 1 (requeued 2 of 3) and its
    # signal of each run. And
    # the job's story: what --follow said, `status --json` and `report` tell the same runs.
    args = ["--epochs", "3", "--samples", "1280", "--batch-size", "16"]
    ref = launch(tmp_path, "ddp_sampler_eval.py", *args,
                 "--checkpoint-dir", str(tmp_path / "ref-ckpt"),
                 python=runtime_python).check()  # fmt: skip
    # Evaluation and logging on rank 0 only: one line per epoch there, nothing on rank 1.
    assert len(re.findall(r"^epoch \d: train loss \S+, validation loss", ref.outputs[0],
                          re.M)) == 3  # fmt: skip
    assert "epoch" not in ref.outputs[1]

    r = slurmddp("submit", "--local", "--follow", "--json", "--nodes", "2",
                 "--ntasks-per-node", "1", "--output", "logs", "--local-signal-after",
                 "10steps,20steps", "--hang-timeout", "10",
                 str(EXAMPLES / "ddp_sampler_eval.py"), *args, "--step-time", "0.1",
                 "--checkpoint-dir", str(tmp_path / "ckpt"),
                 cwd=tmp_path, state=tmp_path / "state", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout.splitlines()[0])["job_id"]
    # The decision's lines are the batch log's, the training's rank 0's.
    rank0 = "\n".join((tmp_path / "logs" / name).read_text()
                       for name in (f"{job}.batch.log", f"{job}/rank-0.log"))  # fmt: skip
    assert "stopped (signal, USR2) at restart 0 after its checkpoint: requeued (1 of 3)" in rank0
    assert "stopped (signal, USR2) at restart 1 after its checkpoint: requeued (2 of 3)" in rank0
    stops = re.findall(r"^stopped at step (\d+) \(epoch (\d+), sample (\d+)\)$", rank0, re.M)
    assert len(stops) == 2, rank0
    (first, epoch, _), (second, _, _) = stops
    assert 10 <= int(first) < 40 and epoch == "0" and int(second) - int(first) >= 20, rank0
    # Each run resumed where the one before it stopped.
    assert re.findall(r"^resumed from step-(\d+): epoch (\d+), sample (\d+)$", rank0, re.M) == [
        (f"{int(s):08d}", e, n) for s, e, n in stops], rank0  # fmt: skip
    assert "epoch" not in (tmp_path / "logs" / job / "rank-1.log").read_text()
    result = tagged_json(rank0, "RESULT ")[-1]
    assert result["restart"] == 2
    print(f"uninterrupted: {ref.result['digest']}\npreempted x2:  {result['digest']}")
    assert {k: result[k] for k in ("digest", "val_loss", "steps")} == {
        k: ref.result[k] for k in ("digest", "val_loss", "steps")}  # fmt: skip

    # The story, as --follow told it as it happened...
    followed = r.stdout.replace(f"[slurmddp] job {job}: ", "")
    for said in (f"stop requested (USR2 received): every rank stops after step {first}",
                 "requeued (1 of 3): signal", "run 2 started on localhost",
                 f"resumed at step {first} from ", "requeued (2 of 3): signal",
                 "run 3 ended: finished (exit status 0)", "3 runs, 2 requeues, "):
        assert said in followed, followed
    assert followed.rstrip().endswith("COMPLETED")
    # ... as `status --json` keeps it...
    status = slurmddp("status", "--json", job, cwd=tmp_path, state=tmp_path / "state")
    [told] = json.loads(status.stdout)
    assert (told["state"], told["runs"], told["requeues"], told["steps_lost"]) == (
        "COMPLETED", 3, 2, {})
    assert told["last_checkpoint"]["step"] == 120 and 0 < told["goodput"] <= 1  # its last save
    assert told["step"] >= 115
    # ... and as the report draws it: three runs, two stops, one on each of the first two.
    page = slurmddp("report", job, cwd=tmp_path, state=tmp_path / "state")
    html = Path(page.stdout.strip()).read_text()
    assert html.count('class="run"') == 3 and html.count('class="stop"') == 2
    assert 'data-cause="signal"' in html and 'data-cause="finished"' in html

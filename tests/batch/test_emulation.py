"""Local emulation gives every process the variables a real srun step would."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from slurmddp.batch.emulation import step_environment
from slurmddp.rank.env import resolve
from tests.cli.test_cli_submit import slurmddp
from tests.conftest import ROOT, tagged_json


@pytest.mark.parametrize(("nodes", "tasks"), [(1, 1), (1, 3), (2, 2), (4, 2)])
def test_every_emulated_rank_resolves_to_its_place(nodes, tasks):
    world = nodes * tasks
    places = [resolve(step_environment(r, nodes, tasks, "4321")) for r in range(world)]
    assert [p.rank for p in places] == list(range(world))
    assert [p.node_rank for p in places] == [r // tasks for r in range(world)]
    assert [p.local_rank for p in places] == [r % tasks for r in range(world)]
    assert {(p.world_size, p.local_world_size, p.num_nodes, p.launcher) for p in places} == {
        (world, tasks, nodes, "slurm")
    }
    assert len({(p.master_addr, p.master_port) for p in places}) == 1


# ---- the preemption scenario of preemption/test_preemption_cluster.py, without Slurm ----

TRAIN = str(ROOT / "examples" / "resumable_train.py")


def local_train(tmp_path, name: str, *options: str, nodes: int = 2, steps: int = 200,
                step_time: float = 0.0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`slurmddp submit --local --follow` of the resumable example; (result, rank 0's log lines)."""
    r = slurmddp("submit", "--local", "--follow", "--json", "--nodes", str(nodes),
                 "--ntasks-per-node", "2", "--output", name, *options, TRAIN,
                 "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "ckpt" / name),
                 "--step-time", str(step_time), "--log-every", "1000",
                 cwd=tmp_path, state=tmp_path / "state", timeout=300)  # fmt: skip
    job = json.loads(r.stdout.splitlines()[0])
    return r, [line for p in sorted((tmp_path / name).glob(f"{job['job_id']}_*_log.*"))
               for line in p.read_text().splitlines()]  # fmt: skip


def digests(lines: list[str]) -> set[str]:
    return {x["digest"] for x in tagged_json("\n".join(lines), "RESULT ")}


def test_local_emulation_is_preempted_twice_and_ends_bitwise_identical(tmp_path):
    ref, ref_lines = local_train(tmp_path, "reference")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    # The signal comes 4 s into each of the first two runs (start-up takes about 3 s here).
    r, lines = local_train(tmp_path, "preempted", "--local-signal-after", "4,4", step_time=0.03)
    assert r.returncode == 0, r.stdout + r.stderr
    text = "\n".join(lines)
    assert "stopped (signal, USR2) at restart 0 after its checkpoint: requeued (1 of 3)" in text
    assert "stopped (signal, USR2) at restart 1 after its checkpoint: requeued (2 of 3)" in text
    stops = re.findall(r"stopped at step (\d+)", text)
    assert len(stops) == 2 and stops == re.findall(r"resumed from \S+ at step (\d+)", text)
    print(f"uninterrupted: {digests(ref_lines)}\npreempted x2:  {digests(lines)}")
    assert len(digests(ref_lines)) == 1 and digests(lines) == digests(ref_lines)


def test_resume_at_another_world_size_continues_at_the_same_global_sample(tmp_path):
    # 4 ranks, stopped once with no requeue allowed: the checkpoint is taken, the job ends 75.
    r, lines = local_train(tmp_path, "w", "--max-requeues", "0", "--local-signal-after", "4",
                           step_time=0.03)  # fmt: skip
    assert r.returncode == 75, r.stdout + r.stderr
    text = "\n".join(lines)
    assert "the limit of 0 requeues (--max-requeues) is reached" in text
    epoch, sample = re.search(r"stopped at step \d+ \(epoch (\d+), sample (\d+)\)", text).groups()
    # The same checkpoint directory, now 2 ranks.
    r, lines = local_train(tmp_path, "w", nodes=1)
    assert r.returncode == 0, r.stdout + r.stderr
    resumed = re.search(r"resumed from \S+ at step \d+ \(epoch (\d+), sample (\d+)\)",
                        "\n".join(lines))  # fmt: skip
    assert resumed and resumed.groups() == (epoch, sample)
    assert {x["world_size"] for x in tagged_json("\n".join(lines), "RESULT ")} == {2}

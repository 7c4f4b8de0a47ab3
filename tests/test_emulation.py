"""Local emulation gives every process the variables a real srun step would."""

from __future__ import annotations

import pytest

from slurmddp.emulation import step_environment
from slurmddp.env import resolve


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

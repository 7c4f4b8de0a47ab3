"""rank.coordination.attempt: one name for a start of the workers, the same on every rank."""

from __future__ import annotations

from slurmddp.rank.coordination import attempt

TORCHRUN = {"SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "41.2", "MASTER_PORT": "41234"}


def test_outside_torchrun_it_is_the_jobs_restart():
    assert attempt({"SLURM_RESTART_COUNT": "2", "TORCHELASTIC_RESTART_COUNT": "5"}) == "2"
    assert attempt({}) == "0"


def test_with_a_store_per_round_a_spare_and_a_survivor_agree():
    own = TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    survivor = own | {"TORCHELASTIC_RESTART_COUNT": "1"}
    spare = own | {"TORCHELASTIC_RESTART_COUNT": "0"}  # it joined late: it never restarted
    assert attempt(survivor) == attempt(spare) == "2.p41234"
    assert attempt(survivor | {"MASTER_PORT": "41999"}) != attempt(survivor)  # the next round


def test_with_the_agents_shared_store_it_is_torchruns_restart():
    shared = TORCHRUN | {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert attempt(shared) == "2.3"

"""slurmddp.rank.hostlist against the real Slurm tools: ``scontrol show hostnames|hostlist``.

Neither command talks to slurmctld (they only need a slurm.conf to start), and one run takes a
few milliseconds, so every hypothesis example calls scontrol directly instead of batching.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from slurmddp.rank.hostlist import compress, expand
from tests.conftest import EVERY_SLURM, SLURM_VERSION
from tests.rank.test_hostlist import COMPRESS_CASES, EXPAND_CASES, MALFORMED, host_lists, nodelists

pytestmark = [pytest.mark.cluster, EVERY_SLURM]

# About 6 ms per example (one scontrol run), and about 6 ms of CPU: 300 each on each of the three
# versions, new ones every run (600 before: 15 CPU-seconds of a version's pass on a loaded machine).
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Malformed input that Slurm does not refuse, with what it prints instead, by version;
# everything else in MALFORMED it refuses as we do.
_REPAIRED_BY_ALL = {
    "n1]": ["n1]"],
    "]n[1-2]": ["]n1", "]n2"],
    "n]": ["n]"],
    "n[1-]": ["n1"],
    "n[1a-3]": ["n01", "n02", "n03"],
    "n[+1]": ["n01"],
    "n[ 1]": ["n01"],
    "n[1, 2]": ["n1", "n02"],
    "n1\nn2": ["n1", "n2"],  # one host, printed with its newline
}
# Brackets inside or after a range: 24.11 and 26.05 keep them in the names, 22.05 refuses them.
_REPAIRED_SINCE_24 = {**_REPAIRED_BY_ALL, "n[1-2]]": ["n1]", "n2]"], "n[[1]]": ["n[1]"],
                      "n[1[2]]": ["n[12]"]}  # fmt: skip
SLURM_REPAIRS = {
    # An unclosed bracket: 22.05 prints a mangled name, 24.11 and 26.05 refuse it.
    "22.05": {**_REPAIRED_BY_ALL, "n[1-": ["n]"], "n[1-2": ["n]"], "a[1]b[2": ["a[1]b]"]},
    "24.11": _REPAIRED_SINCE_24,
    "26.05": _REPAIRED_SINCE_24,
}[SLURM_VERSION]


def hostnames(cluster, nodelist: str) -> list[str] | None:
    """`scontrol show hostnames`, or None when Slurm calls the list invalid."""
    # "--": a list that starts with "-" is otherwise taken for an scontrol option.
    r = cluster.run(["scontrol", "--", "show", "hostnames", nodelist], timeout=30)
    # It exits 0 even for an invalid list; only stderr tells.
    if "Invalid hostlist" in r.stderr:
        return None
    assert r.returncode == 0 and not r.stderr, r.stderr
    return r.stdout.splitlines()


def hostlist(cluster, hosts: list[str]) -> str:
    r = cluster.run(["scontrol", "--", "show", "hostlist", ",".join(hosts)], timeout=30)
    assert r.returncode == 0 and not r.stderr, r.stderr
    return r.stdout.rstrip("\n")


@pytest.mark.parametrize(("nodelist", "hosts"), EXPAND_CASES, ids=[c[0] for c in EXPAND_CASES])
def test_expand_table_is_slurms(slurm_cluster, nodelist, hosts):
    assert hostnames(slurm_cluster, nodelist) == hosts == expand(nodelist)


@pytest.mark.parametrize(("hosts", "hostlist_"), COMPRESS_CASES, ids=[c[0] for c in COMPRESS_CASES])
def test_compress_table_is_slurms(slurm_cluster, hosts, hostlist_):
    names = hosts.split(",") if hosts else []
    assert hostlist(slurm_cluster, names) == hostlist_ == compress(names)


@pytest.mark.parametrize(("nodelist", "reason"), MALFORMED, ids=[repr(c[0]) for c in MALFORMED])
def test_malformed_is_refused_or_repaired_by_slurm(slurm_cluster, nodelist, reason):
    slurm = hostnames(slurm_cluster, nodelist)
    if nodelist in SLURM_REPAIRS:
        assert slurm == SLURM_REPAIRS[nodelist]
    else:
        assert slurm is None, f"Slurm accepts {nodelist!r} as {slurm}"


def test_suffix_after_last_group(slurm_cluster):
    # Slurm 22.05 refuses a suffix; 23.02.5 and later (24.11, 26.05 here) expand it as we do.
    slurm = hostnames(slurm_cluster, "node[1-2]-ib")
    assert slurm == (None if SLURM_VERSION == "22.05" else expand("node[1-2]-ib"))


@FUZZ
@given(case=nodelists())
def test_expand_matches_scontrol_hostnames(slurm_cluster, case):
    nodelist, _ = case
    assert expand(nodelist) == hostnames(slurm_cluster, nodelist)


@FUZZ
@given(hosts=host_lists().filter(bool))
def test_compress_matches_scontrol_hostlist(slurm_cluster, hosts):
    assert compress(hosts) == hostlist(slurm_cluster, hosts)

"""slurmddp.rank.hostlist: Slurm hostlist expressions and SLURM_TASKS_PER_NODE.

Every expected value below was read off Slurm 22.05's ``scontrol show hostnames`` /
``scontrol show hostlist``; tests/rank/test_hostlist_cluster.py re-checks the tables against the
real tools and fuzzes with the strategies defined here.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmddp.errors import HostlistError, UserError
from slurmddp.rank.hostlist import MAX_RANGE, compress, expand, expand_tasks_per_node

# (nodelist, what `scontrol show hostnames` prints)
EXPAND_CASES = [
    ("", []),
    ("n1", ["n1"]),
    ("alpha,beta", ["alpha", "beta"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-3,7,10-12]", ["n1", "n2", "n3", "n7", "n10", "n11", "n12"]),
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("gpu[001-010]", [f"gpu{i:03d}" for i in range(1, 11)]),
    # The low bound sets the width; the high bound's padding is ignored.
    ("n[8-010]", ["n8", "n9", "n10"]),
    ("n[1-02]", ["n1", "n2"]),
    ("n[01-2]", ["n01", "n02"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n[0]", ["n0"]),
    ("n[00]", ["n00"]),
    ("n[5-5]", ["n5"]),
    ("jean-zay-ia[810-811]", ["jean-zay-ia810", "jean-zay-ia811"]),
    ("node.cluster[1-2]", ["node.cluster1", "node.cluster2"]),
    ("a_b[1-2],A[3]", ["a_b1", "a_b2", "A3"]),
    ("a-[1-2]", ["a-1", "a-2"]),
    ("[1-2]", ["1", "2"]),
    ("123,007", ["123", "007"]),
    # Commas inside brackets do not split the list.
    ("n[1,3],m[2-3]", ["n1", "n3", "m2", "m3"]),
    # Order and duplicates are kept, within and across groups.
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("n[2-3,1]", ["n2", "n3", "n1"]),
    ("n[1-2,2]", ["n1", "n2", "n2"]),
    ("n1,n1", ["n1", "n1"]),
    ("n[1],n[1]", ["n1", "n1"]),
    # Several groups: a cartesian product where the last group varies fastest, then the first,
    # ... and the next-to-last slowest.
    ("x[1-2]y[1-3]", ["x1y1", "x1y2", "x1y3", "x2y1", "x2y2", "x2y3"]),
    ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
    ("n[1]-[2]", ["n1-2"]),
    ("a[1,3]b[1-2],z", ["a1b1", "a1b2", "a3b1", "a3b2", "z"]),
    (
        "a[1-2]b[1-2]c[1-2]",
        ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"],
    ),
    ("r[01-02]n[8-9]", ["r01n8", "r01n9", "r02n8", "r02n9"]),
    # Spaces and tabs separate like commas; empty items vanish.
    ("n1 n2\tn3", ["n1", "n2", "n3"]),
    (",n1,,n2,", ["n1", "n2"]),
    (",", []),
    # Anything without brackets is a name as it stands.
    ("n(x),a.b.c", ["n(x)", "a.b.c"]),
]

# (hosts joined by ",", what `scontrol show hostlist` prints for them)
COMPRESS_CASES = [
    ("", ""),
    ("n1", "n1"),
    ("n1,n2,n3", "n[1-3]"),
    ("n1,n2,n4,n5", "n[1-2,4-5]"),
    # No sorting: only neighbours that count up by one join.
    ("n3,n1,n2", "n[3,1-2]"),
    ("n2,n1", "n[2,1]"),
    ("n1,n3,n2", "n[1,3,2]"),
    # No de-duplication.
    ("n1,n1", "n[1,1]"),
    ("n1,n2,n1", "n[1-2,1]"),
    # Only the digits at the end count; the rest is the prefix.
    ("a1b2,a1b3", "a1b[2-3]"),
    ("x1y1,x1y2,x2y1", "x1y[1-2],x2y1"),
    ("node-1,node-2", "node-[1-2]"),
    ("a.1,a.2", "a.[1-2]"),
    ("n1-2,n1-3", "n1-[2-3]"),
    ("1,2", "[1-2]"),
    ("01,2", "[01,2]"),
    # Names without a numeric suffix are never grouped, and split the groups around them.
    ("alpha,beta", "alpha,beta"),
    ("a,a,b", "a,a,b"),
    ("n1a,n2a", "n1a,n2a"),
    ("n1.x,n2.x", "n1.x,n2.x"),
    ("n,n1", "n,n1"),
    ("n1,alpha,n2", "n1,alpha,n2"),
    ("n1,m1,n2", "n1,m1,n2"),
    ("1,2,a", "[1-2],a"),
    # Widths: an unpadded number joins a range of any width ...
    ("n9,n10", "n[9-10]"),
    ("n8,n9,n10,n11", "n[8-11]"),
    ("n99,n100", "n[99-100]"),
    ("n0,n1", "n[0-1]"),
    # ... padded numbers join only numbers of their own width ...
    ("n09,n10", "n[09-10]"),
    ("n08,n09,n10", "n[08-10]"),
    ("n099,n100", "n[099-100]"),
    ("n008,n009,n010", "n[008-010]"),
    ("n007", "n007"),
    # ... and numbers that differ in padding share a bracket, not a range.
    ("n01,n1", "n[01,1]"),
    ("n1,n01", "n[1,01]"),
    ("n01,n2", "n[01,2]"),
    ("n08,n9", "n[08,9]"),
    ("n9,n010", "n[9,010]"),
    ("n00,n1", "n[00,1]"),
    ("n0,n00,n000", "n[0,00,000]"),
    ("n001,n02,n3", "n[001,02,3]"),
    ("n01,n02,n010", "n[01-02,010]"),
    ("n10,n11,n012", "n[10-11,012]"),
]

# (nodelist, part of the reason). Comments name what Slurm 22.05 does where it does not refuse.
MALFORMED = [
    ("n[1-", "unclosed '['"),  # Slurm: prints "n]"
    ("n[1-2", "unclosed '['"),  # Slurm: prints "n]"
    ("a[1]b[2", "unclosed '['"),  # Slurm: prints "a[1]b]"
    ("n1]", "']' without '['"),  # Slurm: the host "n1]"
    ("]n[1-2]", "']' without '['"),  # Slurm: ]n1,]n2
    ("n]", "']' without '['"),  # Slurm: the host "n]"
    ("n[1-2]]", "']' without '['"),
    ("a[1]]b[2]", "']' without '['"),
    ("n[[1]]", "nested '['"),
    ("n[1[2]]", "nested '['"),
    ("n[]", "empty '[]'"),
    ("[]", "empty '[]'"),
    ("n[1-2],m[]", "empty '[]'"),
    ("n[1,,2]", "empty range part"),
    ("n[,1]", "empty range part"),
    ("n[1,]", "empty range part"),
    ("n[1-]", "empty range part"),  # Slurm: n1
    ("n[2-1]", "ends below its start"),
    ("n[010-8]", "ends below its start"),
    ("n[-1]", "not a number or a range"),
    ("n[1--2]", "not a number or a range"),
    ("n[1-2-3]", "not a number or a range"),
    ("n[a]", "not a number or a range"),
    ("n[x]", "not a number or a range"),
    ("n[1a]", "not a number or a range"),
    ("n[1a-3]", "not a number or a range"),  # Slurm: n01,n02,n03
    ("n[1x2]", "not a number or a range"),
    ("n[+1]", "not a number or a range"),  # Slurm: n01
    ("n[ 1]", "not a number or a range"),  # Slurm: n01
    ("n[1, 2]", "not a number or a range"),  # Slurm: n1,n02
    ("n[\uff11]", "not a number or a range"),  # a full-width digit is no digit to Slurm
    ("n[0-65536]", f"more than {MAX_RANGE} hosts"),
    ("a[0-40000,40001-65536]b[1]", "more than 65536 values"),
    ("n1\nn2", "unprintable character"),  # Slurm: one host named "n1\nn2"
]


@pytest.mark.parametrize(("nodelist", "hosts"), EXPAND_CASES, ids=[c[0] for c in EXPAND_CASES])
def test_expand(nodelist, hosts):
    assert expand(nodelist) == hosts


@pytest.mark.parametrize(("hosts", "hostlist"), COMPRESS_CASES, ids=[c[0] for c in COMPRESS_CASES])
def test_compress(hosts, hostlist):
    names = hosts.split(",") if hosts else []
    assert compress(names) == hostlist
    assert compress(iter(names)) == hostlist  # any iterable
    assert expand(hostlist) == names


@pytest.mark.parametrize(("nodelist", "reason"), MALFORMED, ids=[repr(c[0]) for c in MALFORMED])
def test_expand_malformed(nodelist, reason):
    with pytest.raises(ValueError) as info:
        expand(nodelist)
    message = str(info.value)
    assert message.startswith(f"invalid hostlist {nodelist!r}: ")
    assert reason in message
    assert "\n" not in message


def test_expand_message_example():
    with pytest.raises(ValueError, match=r"^invalid hostlist 'n\[1-': unclosed '\['$"):
        expand("n[1-")


@pytest.mark.parametrize(
    "call",
    [lambda: expand("n[1-"), lambda: compress(["n[1]"]), lambda: expand_tasks_per_node("2(x0)")],
    ids=["expand", "compress", "tasks per node"],
)
def test_malformed_input_is_a_hostlist_error(call):
    # One user error for the CLI's one-line report; still a ValueError for older callers.
    with pytest.raises(HostlistError) as info:
        call()
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_suffix_after_last_group_is_accepted():
    # Slurm 22.05 refuses this; Slurm >= 23.02.5 reads it as a shared suffix, as here.
    assert expand("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert expand("r[1-2]n[1-2].x") == ["r1n1.x", "r1n2.x", "r2n1.x", "r2n2.x"]


def test_range_size_limits():
    assert len(expand("n[0-65535]")) == MAX_RANGE
    assert len(expand("a[0-65535]b[1]")) == MAX_RANGE


@pytest.mark.parametrize(
    ("host", "why"),
    [("", "empty"), ("n[1]", "'['"), ("n]", "']'"), ("a,b", "','"), ("a b", "' '"),
     ("a\tb", "'\\t'"), ("n1\n", "'\\n'")],
)  # fmt: skip
def test_compress_refuses_names_that_are_not_one_host(host, why):
    with pytest.raises(ValueError) as info:
        compress(["n1", host])
    assert str(info.value).startswith(f"invalid host name {host!r} for a hostlist: ")
    assert why in str(info.value)


def test_compress_refuses_a_bare_string():
    with pytest.raises(TypeError):
        compress("n1,n2")  # type: ignore[arg-type]


def test_compress_big_numbers():
    # Slurm keeps suffixes in an unsigned long and wraps past 2**64; Python ints do not.
    assert compress(["n99999999999999999999", "n100000000000000000000"]) == (
        "n[99999999999999999999-100000000000000000000]"
    )


# ---- SLURM_TASKS_PER_NODE ----

TASKS_CASES = [
    ("", []),
    ("1", [1]),
    ("4", [4]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("2,2,1", [2, 2, 1]),
    ("8(x2)", [8, 8]),
    ("1(x1)", [1]),
    ("3,2(x2),1(x3)", [3, 2, 2, 1, 1, 1]),
    ("16(x128)", [16] * 128),
]

TASKS_MALFORMED = [
    ("2(x0)", "repeats zero times"),
    (",", "empty item"),
    ("2,,1", "empty item"),
    ("2,", "empty item"),
    ("2(x3", "not N or N(xM)"),
    ("2(3)", "not N or N(xM)"),
    ("(x3)", "not N or N(xM)"),
    ("2(x)", "not N or N(xM)"),
    ("x", "not N or N(xM)"),
    ("-1", "not N or N(xM)"),
    ("2 (x3)", "not N or N(xM)"),
    (" 2", "not N or N(xM)"),
    ("2(x3)1", "not N or N(xM)"),
    ("2(x-1)", "not N or N(xM)"),
    ("\uff12", "not N or N(xM)"),
]


@pytest.mark.parametrize(("spec", "counts"), TASKS_CASES, ids=[c[0] for c in TASKS_CASES])
def test_expand_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize(("spec", "reason"), TASKS_MALFORMED, ids=[c[0] for c in TASKS_MALFORMED])
def test_expand_tasks_per_node_malformed(spec, reason):
    with pytest.raises(ValueError) as info:
        expand_tasks_per_node(spec)
    assert str(info.value).startswith(f"invalid tasks per node {spec!r}: ")
    assert reason in str(info.value)


def slurm_tasks_per_node(counts: list[int]) -> str:
    """What Slurm writes for per-node counts: equal neighbours become ``N(xM)``."""
    items = []
    for count, same in itertools.groupby(counts):
        reps = len(list(same))
        items.append(f"{count}(x{reps})" if reps > 1 else str(count))
    return ",".join(items)


@given(st.lists(st.integers(0, 5)))
def test_tasks_per_node_round_trip(counts):
    assert expand_tasks_per_node(slurm_tasks_per_node(counts)) == counts


# ---- strategies, shared with tests/rank/test_hostlist_cluster.py ----

# Name text: letters, hyphens, dots, underscores, and digits that a letter follows.
name_text = st.from_regex(r"[a-z][a-z._-]{0,3}([0-9]{1,2}[a-z.-]{1,2})?", fullmatch=True)
plain_name = st.from_regex(r"[a-z][a-z._-]{0,4}", fullmatch=True)


@st.composite
def ranges(draw: st.DrawFn, max_count: int = 12) -> tuple[str, list[str]]:
    """One range of a bracket group, as text and as the numbers Slurm makes of it."""
    lo = draw(st.integers(0, 120))
    count = draw(st.integers(1, max_count))
    width = len(str(lo)) + draw(st.integers(0, 2))
    lo_text = f"{lo:0{width}d}"
    values = [f"{n:0{width}d}" for n in range(lo, lo + count)]
    if count == 1 and draw(st.booleans()):
        return lo_text, values
    hi = lo + count - 1
    # The high bound's own padding does not matter to Slurm.
    hi_text = f"{hi:0{len(str(hi)) + draw(st.integers(0, 2))}d}"
    return f"{lo_text}-{hi_text}", values


@st.composite
def groups(draw: st.DrawFn, max_ranges: int = 3, max_count: int = 12) -> tuple[str, list[str]]:
    parts = draw(st.lists(ranges(max_count), min_size=1, max_size=max_ranges))
    return "[" + ",".join(p[0] for p in parts) + "]", [v for p in parts for v in p[1]]


def slurm_product(texts: list[str], values: list[list[str]]) -> list[str]:
    """Hosts of ``texts[0] [values[0]] texts[1] ... [values[-1]] texts[-1]`` in Slurm's order."""
    if not values:
        return [texts[0]]
    *heads, last = values

    def fill(chosen: dict[int, str], pending: list[int]) -> list[str]:
        if not pending:
            head = "".join(texts[i] + chosen[i] for i in range(len(heads))) + texts[len(heads)]
            return [head + v + texts[-1] for v in last]
        i, *rest = pending
        return [h for v in heads[i] for h in fill({**chosen, i: v}, rest)]

    # The next-to-last group varies slowest, down to the first; the last varies fastest.
    return fill({}, list(reversed(range(len(heads)))))


@st.composite
def tokens(draw: st.DrawFn, suffix: bool = False) -> tuple[str, list[str]]:
    """One top-level item of a hostlist and its hosts."""
    n_groups = draw(st.integers(0, 3))
    if n_groups == 0:
        name = draw(st.one_of(name_text, plain_name))
        return name, [name]
    # Keep products small: more groups, fewer values each.
    size = {1: (4, 12), 2: (2, 5), 3: (2, 3)}[n_groups]
    drawn = [draw(groups(*size)) for _ in range(n_groups)]
    texts = [draw(st.one_of(st.just(""), name_text))]
    texts += [draw(st.from_regex(r"[a-z._-]{0,2}", fullmatch=True)) for _ in range(n_groups - 1)]
    texts.append(draw(st.from_regex(r"[a-z.-]{1,3}", fullmatch=True)) if suffix else "")
    text = "".join(t + g[0] for t, g in zip(texts, drawn, strict=False)) + texts[-1]
    return text, slurm_product(texts, [g[1] for g in drawn])


@st.composite
def nodelists(draw: st.DrawFn, suffix: bool = False) -> tuple[str, list[str]]:
    """A hostlist expression and the hosts Slurm expands it to."""
    items = draw(st.lists(tokens(suffix), min_size=1, max_size=4))
    return ",".join(i[0] for i in items), [h for i in items for h in i[1]]


@st.composite
def host_lists(draw: st.DrawFn) -> list[str]:
    """Host names with a good share of neighbours that Slurm may join into ranges."""

    @st.composite
    def run(draw: st.DrawFn) -> list[str]:
        prefix = draw(st.one_of(st.just(""), name_text, st.sampled_from(["n", "gpu-", "a.b"])))
        start = draw(st.integers(0, 120))
        count = draw(st.integers(1, 6))
        pad = draw(st.sampled_from([0, 0, 1, 2, 3]))
        return [prefix + str(n).zfill(pad) for n in range(start, start + count)]

    single = st.one_of(plain_name, name_text).map(lambda name: [name])
    chunks = draw(st.lists(st.one_of(run(), single), max_size=8))
    hosts = [h for chunk in chunks for h in chunk if h]
    order = draw(st.sampled_from(["as drawn", "sorted", "shuffled"]))
    if order == "sorted":
        hosts.sort()
    elif order == "shuffled":
        hosts = draw(st.permutations(hosts))
    return hosts


# ---- properties ----


@given(nodelists(suffix=True))
def test_expand_generated(case):
    nodelist, hosts = case
    assert expand(nodelist) == hosts


@given(host_lists())
def test_expand_inverts_compress(hosts):
    # scontrol show hostlist keeps order and duplicates, so this holds for any list of names.
    hostlist = compress(hosts)
    assert expand(hostlist) == hosts
    assert compress(expand(hostlist)) == hostlist


@given(st.sets(st.integers(0, 300)), st.sampled_from(["n", "gpu-", "rack1.node"]))
def test_compress_sorted_unique_is_minimal(numbers, prefix):
    # What Slurm gives for a sorted set of unpadded numbers: one bracket of maximal runs.
    ordered = sorted(numbers)
    runs = []
    for _, run in itertools.groupby(enumerate(ordered), key=lambda p: p[1] - p[0]):
        nums = [n for _, n in run]
        runs.append(f"{nums[0]}-{nums[-1]}" if len(nums) > 1 else str(nums[0]))
    if not ordered:
        expected = ""
    elif len(ordered) == 1:
        expected = f"{prefix}{ordered[0]}"
    else:
        expected = f"{prefix}[{','.join(runs)}]"
    assert compress(f"{prefix}{n}" for n in ordered) == expected


@given(st.sets(st.integers(0, 999), min_size=1), st.integers(3, 5))
def test_compress_padded_width_is_kept(numbers, width):
    hosts = [f"gpu{n:0{width}d}" for n in sorted(numbers)]
    hostlist = compress(hosts)
    assert expand(hostlist) == hosts
    assert hostlist.count("[") <= 1


# ---- python-hostlist as an oracle ----

try:
    import hostlist as python_hostlist
except ImportError:
    python_hostlist = None

needs_python_hostlist = pytest.mark.skipif(
    python_hostlist is None, reason="python-hostlist is not installed (pip install -e '.[test]')"
)


@st.composite
def rack_hosts(draw: st.DrawFn) -> list[str]:
    """Distinct names with two numbers, which python-hostlist groups on both."""
    name = st.builds(
        "{}{:0{}d}n{:0{}d}{}".format,
        st.sampled_from(["r", "gpu-r", ""]), st.integers(0, 12), st.integers(1, 3),
        st.integers(0, 12), st.integers(1, 3), st.sampled_from(["", "", "-ib"]),
    )  # fmt: skip
    return draw(st.lists(name, unique=True, max_size=40))


@needs_python_hostlist
@given(nodelists(suffix=True))
def test_expand_matches_python_hostlist(case):
    nodelist, _ = case
    theirs = python_hostlist.expand_hostlist(nodelist, allow_duplicates=True)
    ours = expand(nodelist)
    # With three bracket groups or more in one item, Slurm's order is not python-hostlist's.
    if nodelist.count("[") <= 2:
        assert ours == theirs
    else:
        assert sorted(ours) == sorted(theirs)


@needs_python_hostlist
@given(st.one_of(host_lists().map(lambda hosts: list(dict.fromkeys(hosts))), rack_hosts()))
def test_round_trips_match_python_hostlist(hosts):
    # python-hostlist drops duplicates, hence distinct hosts. Its collect_hostlist sorts and
    # groups on every number in a name, so its text differs from Slurm's: compare expansions.
    ours = compress(hosts)
    theirs = python_hostlist.collect_hostlist(hosts)
    assert expand(ours) == python_hostlist.expand_hostlist(ours) == hosts
    assert sorted(expand(theirs)) == sorted(python_hostlist.expand_hostlist(theirs))
    assert sorted(expand(theirs)) == sorted(hosts)

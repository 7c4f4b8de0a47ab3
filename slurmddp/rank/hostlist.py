"""Slurm hostlist expressions (``gpu[001-004],login1``) without calling ``scontrol``.

`expand` matches ``scontrol show hostnames`` and `compress` matches ``scontrol show hostlist``
(Slurm 22.05), both checked by tests/rank/test_hostlist_cluster.py. Where Slurm silently repairs or
misreads malformed input, these functions raise `HostlistError` (a ValueError) instead.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from slurmddp.errors import HostlistError

__all__ = ["compress", "expand", "expand_tasks_per_node"]

# Slurm's own caps: one range ("0-65536" is refused), and the values of one bracket group that
# is not the last one, since every value there repeats the rest of the name.
MAX_RANGE = 64 * 1024
MAX_PREFIX_VALUES = 64 * 1024

# Slurm splits a hostlist on commas, spaces and tabs (hostlist_create's separators).
_SEPARATORS = frozenset(", \t")
_DIGITS = "0123456789"
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


@dataclass
class _Run:
    """Consecutive hosts ``prefix + lo .. prefix + hi``, or one host without a numeric suffix."""

    prefix: str
    lo: int = 0
    hi: int = 0
    width: int = 0
    single: bool = False


def expand(nodelist: str) -> list[str]:
    """Every host of a Slurm hostlist expression, in ``scontrol show hostnames`` order.

    ``"n[1-3,7],gpu[01-02]"`` gives ``n1 n2 n3 n7 gpu01 gpu02``; duplicates are kept. Raises
    `HostlistError`, naming `nodelist`, if it is malformed.
    """
    hosts: list[str] = []
    for token in _tokens(nodelist):
        hosts.extend(_expand_token(nodelist, token))
    return hosts


def compress(hosts: Iterable[str]) -> str:
    """The hostlist expression ``scontrol show hostlist`` prints for `hosts`.

    Like Slurm it neither sorts nor removes duplicates: only hosts that follow each other and
    count up by one share a range (``n3,n1,n2`` gives ``n[3,1-2]``), so ``expand(compress(h))``
    is ``h``. Raises `HostlistError` for a name that cannot appear in a hostlist.
    """
    if isinstance(hosts, str):
        raise TypeError("compress() takes an iterable of host names, not one str")
    runs: list[_Run] = []
    for host in hosts:
        new = _parse_host(host)
        tail = runs[-1] if runs else None
        if (
            tail is not None
            and not tail.single
            and not new.single
            and tail.prefix == new.prefix
            and tail.hi + 1 == new.lo
        ):
            width = _common_width(tail.lo, tail.width, new.lo, new.width)
            if width is not None:
                tail.hi, tail.width = new.hi, width
                continue
        runs.append(new)
    return ",".join(_format_group(group) for group in _bracket_groups(runs))


def expand_tasks_per_node(spec: str) -> list[int]:
    """Tasks on each node from SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE.

    ``"2(x3),1"`` gives ``[2, 2, 2, 1]``; ``""`` gives ``[]``. Raises `HostlistError`, naming
    `spec`, if it is malformed.
    """
    counts: list[int] = []
    if not spec:
        return counts
    for item in spec.split(","):
        match = _TASKS_ITEM.fullmatch(item)
        if match is None:
            raise HostlistError(
                f"invalid tasks per node {spec!r}: {item!r} is not N or N(xM)"
                if item
                else f"invalid tasks per node {spec!r}: empty item"
            )
        repeat = int(match[2]) if match[2] is not None else 1
        if repeat == 0:
            raise HostlistError(f"invalid tasks per node {spec!r}: {item!r} repeats zero times")
        counts.extend([int(match[1])] * repeat)
    return counts


# ---- expand ----


def _tokens(nodelist: str) -> list[str]:
    """Split at top-level separators, checking that brackets pair up and do not nest."""
    tokens: list[str] = []
    start = 0
    in_bracket = False
    for i, char in enumerate(nodelist):
        if char == "[":
            if in_bracket:
                raise _invalid(nodelist, "nested '['")
            in_bracket = True
        elif char == "]":
            if not in_bracket:
                raise _invalid(nodelist, "']' without '['")
            in_bracket = False
        elif char in _SEPARATORS and not in_bracket:
            tokens.append(nodelist[start:i])
            start = i + 1
        elif not char.isprintable() and char not in _SEPARATORS:
            raise _invalid(nodelist, f"unprintable character {char!r}")
    if in_bracket:
        raise _invalid(nodelist, "unclosed '['")
    tokens.append(nodelist[start:])
    # Slurm skips empty items: ",n1,,n2," is n1,n2.
    return [token for token in tokens if token]


def _expand_token(nodelist: str, token: str) -> list[str]:
    """Hosts of one top-level item such as ``rack[1-2]-n[01-04]``."""
    # re.split with a capturing group alternates text, group, text, ..., text.
    parts = re.split(r"\[([^\]]*)\]", token)
    texts, groups = parts[0::2], parts[1::2]
    if not groups:
        return [token]
    values = [_group_values(nodelist, group) for group in groups]
    for group, vals in zip(groups[:-1], values[:-1], strict=True):
        if len(vals) > MAX_PREFIX_VALUES:
            raise _invalid(nodelist, f"'[{group}]' has more than {MAX_PREFIX_VALUES} values")
    # Slurm resolves the bracket groups from the right: the last group varies fastest, then
    # the first, second, ... up to the next-to-last, which varies slowest. So a[1-2]b[1-2]c[1-2]
    # gives a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...
    head_order = list(reversed(range(len(groups) - 1)))
    hosts: list[str] = []
    for combo in itertools.product(*(values[i] for i in head_order)):
        picked = dict(zip(head_order, combo, strict=True))
        head = "".join(texts[i] + picked[i] for i in range(len(groups) - 1)) + texts[-2]
        # texts[-1], text after the last ']', is refused by Slurm 22.05 but is a shared suffix
        # since 23.02.5 (node[1-2]-ib); accepting it loses nothing.
        hosts.extend(head + value + texts[-1] for value in values[-1])
    return hosts


def _group_values(nodelist: str, group: str) -> list[str]:
    """The zero-padded numbers of one bracket group, e.g. ``"08-10,1"``."""
    if not group:
        raise _invalid(nodelist, "empty '[]'")
    values: list[str] = []
    for part in group.split(","):
        if not part or part.endswith("-"):
            raise _invalid(nodelist, f"empty range part in '[{group}]'")
        # Slurm's strtoul also takes "+1", " 1" or "1a" here and misreads them (n[1a-3] is
        # n01,n02,n03); anything but plain digits is refused instead.
        match = _RANGE.fullmatch(part)
        if match is None:
            raise _invalid(nodelist, f"{part!r} in '[{group}]' is not a number or a range")
        lo_text, hi_text = match[1], match[2]
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise _invalid(nodelist, f"range {part!r} ends below its start")
        if hi - lo + 1 > MAX_RANGE:
            raise _invalid(nodelist, f"range {part!r} has more than {MAX_RANGE} hosts")
        # The low bound fixes the width: n[08-10] is n08,n09,n10 and n[8-010] is n8,n9,n10.
        width = len(lo_text)
        values.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return values


def _invalid(nodelist: str, reason: str) -> HostlistError:
    return HostlistError(f"invalid hostlist {nodelist!r}: {reason}")


# ---- compress ----


def _parse_host(host: str) -> _Run:
    """Split a host name into prefix and numeric suffix, as Slurm does (digits at the end)."""
    bad = next((c for c in host if c in "[]" or c in _SEPARATORS or not c.isprintable()), None)
    if not host or bad is not None:
        why = "empty" if not host else f"contains {bad!r}"
        raise HostlistError(f"invalid host name {host!r} for a hostlist: {why}")
    prefix = host.rstrip(_DIGITS)
    if len(prefix) == len(host):
        return _Run(host, single=True)
    suffix = host[len(prefix) :]
    num = int(suffix)
    return _Run(prefix, num, num, len(suffix))


def _pad(num: int, width: int) -> int:
    """How many zeros printing `num` at `width` adds."""
    return max(width - len(str(num)), 0)


def _common_width(n: int, n_width: int, m: int, m_width: int) -> int | None:
    """A width that prints both `n` and `m` with their own zero padding, or None.

    This is Slurm's rule for joining numbers into one range: n9,n10 gives n[9-10] and
    n09,n10 gives n[09-10], but n01,n2 stays n[01,2] since no width prints both as given.
    """
    if n_width == m_width:
        return n_width
    if _pad(n, n_width) != _pad(n, m_width):
        # n needs its own width; m must print the same way at it.
        return n_width if _pad(m, m_width) == _pad(m, n_width) else None
    return m_width


def _bracket_groups(runs: list[_Run]) -> list[list[_Run]]:
    """Adjacent runs that share a prefix go in one bracket: n1,n3 gives n[1,3]."""
    groups: list[list[_Run]] = []
    for run in runs:
        last = groups[-1][-1] if groups else None
        if last is not None and not last.single and not run.single and last.prefix == run.prefix:
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _format_group(group: list[_Run]) -> str:
    first = group[0]
    if first.single:
        return first.prefix
    ranges = ",".join(
        f"{r.lo:0{r.width}d}" + (f"-{r.hi:0{r.width}d}" if r.hi > r.lo else "") for r in group
    )
    if len(group) == 1 and first.hi == first.lo:
        return first.prefix + ranges
    return f"{first.prefix}[{ranges}]"

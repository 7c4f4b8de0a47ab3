"""CRC-32 as a manifest records it: zlib's, behind hashlib's interface, and combinable in parts.

Why CRC-32 and not sha256: see the package docstring.
"""

from __future__ import annotations

import zlib
from typing import Any


class Crc32:
    """zlib.crc32 behind hashlib's update/hexdigest."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        """Add `data` (any buffer) to the checksum."""
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        """The checksum so far, as 8 hex digits."""
        return f"{self._value:08x}"


_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected as zlib computes it


def _multmodp(a: int, b: int) -> int:
    """a * b modulo _POLY, polynomials over GF(2) in reflected order; a is never 0."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers_of_x() -> list[int]:
    """x^(2^k) modulo _POLY for k = 0..31."""
    table = [1 << 30]
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _powers_of_x()


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc1 of A, crc2 of B and the length of B: zlib's crc32_combine
    (crc32.c), which Python's zlib module does not offer. crc1 is shifted by x^(8 * len2)."""
    p, k = 1 << 31, 3  # p = x^0; k = 3: the bits of len2 count bytes, 2^3 bits each
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2

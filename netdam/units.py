"""One parser for every byte-valued flag (BRIEF section 7).

An integer with an optional ``B``, ``KiB``, ``MiB`` or ``GiB`` suffix. Decimal ``KB``/``MB``/``GB``
are rejected with a hint, because a user who types ``64MB`` rarely means 64,000,000 bytes.
``A..B`` means the powers of two from A to B inclusive.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_DECIMAL = {"K", "KB", "M", "MB", "G", "GB", "T", "TB"}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Return the byte count written in *text* (``4000004B``, ``64MiB``, ``8192``).

    Raises ValueError with a message that names the fix.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(
            f"invalid size {text!r}: write an integer with an optional B, KiB, MiB or GiB suffix "
            "(for example 4096, 64KiB, 64MiB)"
        )
    number, unit = match.group(1), match.group(2).upper()
    if unit in _DECIMAL:
        binary = unit[0] + "iB"
        raise ValueError(
            f"invalid size {text!r}: decimal units are not accepted; write {number}{binary} "
            f"for {number}x{_UNITS[unit[0] + 'IB']} bytes or give plain bytes"
        )
    if unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: unknown unit {match.group(2)!r}; use B, KiB, MiB or GiB"
        )
    return int(number) * _UNITS[unit]


def parse_size_range(text: str) -> list[int]:
    """Parse ``A..B`` into the powers of two from A to B inclusive, or one size into ``[size]``."""
    if ".." not in text:
        return [parse_size(text)]
    low_text, high_text = text.split("..", 1)
    low, high = parse_size(low_text), parse_size(high_text)
    if low <= 0 or high < low:
        raise ValueError(
            f"invalid size range {text!r}: need 0 < A <= B in A..B (e.g. 1KiB..256MiB)"
        )
    if low & (low - 1) or high & (high - 1):
        raise ValueError(
            f"invalid size range {text!r}: both ends of A..B must be powers of two (e.g. 1KiB..64MiB)"
        )
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def format_size(nbytes: int) -> str:
    """Return *nbytes* in the largest binary unit that divides it exactly (``65536`` -> ``64KiB``)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"

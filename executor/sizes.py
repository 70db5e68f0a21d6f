"""Sizes as the settings and the nodes write them: Docker's units (b, k, m, g; powers of
1024). Standard library only, imported by the settings, the inputs' checks and the worker
groups alike (none of them imports another for a size)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(value: str) -> int:
    """'256m' -> 268435456, Docker's units (b, k, m, g; powers of 1024)."""
    m = _SIZE.match(value)
    if not m:
        raise ValueError("not a size")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_text(n: int) -> str:
    """``268435456`` -> ``256m``: a size in the largest unit it is a whole number of."""
    for unit, size in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}b"

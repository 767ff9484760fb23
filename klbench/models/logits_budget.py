"""model.logits_budget: a size as the config writes it, read into bytes, and bytes written back for a line.

    size_bytes("256MiB") -> 268435456      size_bytes(0) -> None (not a positive size)
    size_text(268435456) -> "256 MiB"

Pure Python (no torch): the config's schema reads it before anything heavy is imported (klbench.config.resources).
"""
from __future__ import annotations

import re
from typing import Any

SIZE = "a positive size in bytes: an integer, or a number with B, KB, MB, GB, KiB, MiB or GiB (e.g. 256MiB)"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def size_bytes(v: Any) -> int | None:
    """Bytes of a size (an int, or a number and a unit of _UNITS, case-insensitive); None where it is not a positive
    whole number of bytes (0, negative, a float, a bool, an unknown unit, text that is no number)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v > 0 else None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", v) if isinstance(v, str) else None
    if m is None or m.group(2).upper() not in _UNITS:
        return None
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    return n if n > 0 else None


def size_text(n: int) -> str:
    """Bytes in the largest binary unit they reach, to 4 significant digits: 256 MiB, 1.5 GiB, 600 B."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{n} B"

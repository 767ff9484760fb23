"""model.logits_budget: a size as the config writes it, read into bytes, and bytes written back for a line; and
model.scoring_path=auto's rule, which reads it.

    size_bytes("256MiB") -> 268435456      size_bytes(0) -> None (not a positive size)
    size_text(268435456) -> "256 MiB"
    logits_by_cost(896, 3 * 2**20, 2**28) -> True   (a wide head, logits within the budget)

Pure Python (no torch): the config's schema reads it before anything heavy is imported (klbench.config.resources).
"""
from __future__ import annotations

import re
from typing import Any

SIZE = "a positive size in bytes: an integer, or a number with B, KB, MB, GB, KiB, MiB or GiB (e.g. 256MiB)"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


# a head narrower than this scores from the hidden states under auto, whatever the budget: there a tile's product is
# cheap, and the logits path's passes over [rows, V] cost more than the hidden path's second product (a grid of
# V x H x rows, docs/scale.md "Choosing the scoring path by its cost")
NARROW_HEAD = 192


def logits_by_cost(width: int, logits_bytes: int, budget: int | None) -> bool:
    """model.scoring_path=auto: whether a micro-batch is scored through its logits. width: H, the LM head's input;
    logits_bytes: its float32 [m, L, V] logits; budget: model.logits_budget in bytes (None: the hidden states)."""
    return budget is not None and width >= NARROW_HEAD and logits_bytes <= budget


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

"""Argument checks shared by the data package's public functions (private)."""

from __future__ import annotations

import operator
from typing import Any

SEEDS = 2**63  # seeds lie in [0, 2**63), as a TrainState's


def check_index(where: str, name: str, value: Any, *, limit: int | None = None) -> int:
    """``value`` as a Python int if it is an integer (a Python or NumPy one, not a bool) in
    ``[0, limit)`` (``[0, inf)`` without ``limit``); else a ``ValueError`` naming the call and
    the argument."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is not None and number >= 0 and (limit is None or number < limit):
        return number
    bound = ">= 0" if limit is None else f"in [0, {'2**63' if limit == SEEDS else limit})"
    raise ValueError(f"{where}({name}={value!r}): {name} must be an int {bound}")

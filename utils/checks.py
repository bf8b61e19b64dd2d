"""Argument checks shared by the helpers: one message format for a wrong size, count or rate.

Every public helper of ``utils`` refuses bad input before doing any work, with a ``ValueError`` that
names the argument, says what was expected and shows what it got (a ``bool`` is never taken for an int).
"""

from __future__ import annotations

import math
from typing import Any


def positive_int(name: str, value: Any, unit: str = "") -> int:
    """Return ``value`` if it is an int > 0 (not a bool); a ValueError naming ``name`` otherwise.

    Args:
        name: the argument's name, as the caller spells it.
        value: what was passed.
        unit: what the number counts, added to the message (``"tokens per chunk"``).

    Example:
        >>> positive_int("batch_size", 0)
        Traceback (most recent call last):
        ValueError: batch_size must be a positive int, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int{f' ({unit})' if unit else ''}, got {value!r}")
    return value


def non_negative_int(name: str, value: Any, unit: str = "") -> int:
    """Return ``value`` if it is an int >= 0 (not a bool); a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0{f' ({unit})' if unit else ''}, got {value!r}")
    return value


def positive_number(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a finite number > 0 (not a bool); a ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)

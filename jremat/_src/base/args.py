"""Checks of plain keyword arguments shared by `jremat.plan`, `jremat.auto` and `PlanCache`."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np


def check_count(name: str, value: Any) -> int:
    """`value` as an int when it is an int >= 1 (Python or NumPy; not a bool).

    Raises:
      TypeError: not an int (a bool, float, string, None ...); the message names `name`.
      ValueError: an int below 1; the message names `name`.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool when it is one (Python or NumPy bool).

    Raises:
      TypeError: anything else (0/1, strings such as "yes", None ...); the message names `name`.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}"
        )
    return bool(value)

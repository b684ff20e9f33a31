"""Pareto frontiers of (cost, cost) points, both minimised: memory against recompute.

A point dominates another when it is no worse in both coordinates and strictly better in at
least one. The frontier is the set of points nothing dominates: the policies worth choosing
between, since every other policy costs more memory, more compute, or both, than one of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """True when point `a` is <= `b` in both coordinates and < in at least one."""
    return a[0] <= b[0] and a[1] <= b[1] and (a[0] < b[0] or a[1] < b[1])


def pareto_front(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the points on the Pareto frontier, both coordinates minimised.

    Args:
      points: (x, y) pairs, for example (extra FLOPs %, temp bytes). Points with a None or
        NaN coordinate take no part (they neither dominate nor are on the frontier).

    Returns:
      Indices into `points` of the non-dominated points, sorted by x then y. Identical points
      do not dominate one another, so duplicates on the frontier are all returned.

    Raises:
      ValueError: a point does not have exactly two coordinates.

    Examples:
      >>> pareto_front([(0, 10), (5, 4), (6, 4), (20, 1), (3, 12)])
      [0, 1, 3]
    """
    valid: list[int] = []
    for i, p in enumerate(points):
        if len(p) != 2:
            raise ValueError(f"points[{i}] must be an (x, y) pair, got {p!r}")
        if all(v is not None and not math.isnan(float(v)) for v in p):
            valid.append(i)
    # sweep by x ascending (y ascending on ties): a point is on the frontier when its y is
    # below every y seen so far, or equals the best y at the same x (an identical point).
    order = sorted(valid, key=lambda i: (float(points[i][0]), float(points[i][1])))
    front: list[int] = []
    best_y = math.inf
    best_pt: tuple[float, float] | None = None
    for i in order:
        x, y = float(points[i][0]), float(points[i][1])
        if y < best_y:
            front.append(i)
            best_y, best_pt = y, (x, y)
        elif best_pt is not None and (x, y) == best_pt:
            front.append(i)
    return front

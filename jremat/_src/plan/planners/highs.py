"""What the HiGHS-based planners share (`milp.py`, `milp_values.py`): a MIP solver set up to
give the same answer on every run and machine, and to end (`mip_solver`); HiGHS prints its
banner from C, past Python's `sys.stdout`."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np


@contextlib.contextmanager
def quiet_stdout():
    """Silence file descriptor 1 (HiGHS's C-level banner) for the duration of the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


#: HiGHS heuristics switched off because they can run forever. The root reduced-cost
#: heuristic solves a sub-MIP that ignores both the node and the time limit: on a 6-layer
#: MLP's segment MILP (1,191 rows, a MIP start given; HiGHS 1.16.0) it ran for over 10
#: minutes where the same solve without it takes 5 s (the class of HiGHS issue #2226).
#: Options a HiGHS version lacks are skipped.
HANGING_HEURISTICS = ("mip_heuristic_run_root_reduced_cost",)


#: HiGHS's presolve is off: its probing is bounded by neither the node nor the time limit.
#: On tests/test_explain.py's 3-layer BatchNorm net (1,797 rows, a MIP start given; HiGHS
#: 1.16.0) it took 23-33 s of each 24-33 s solve, so `jremat.explain` at 0.9 spent 99 s where
#: it spends 17 s without it (the class of HiGHS issue #2478). Over 36 solves of three test
#: models (a 4-layer residual MLP, a dropout chain, the BatchNorm net; 12 budgets each) the
#: plans were the same, in 3.8-5x less time (not every solve gains: the custom-VJP chain's
#: `"milp"` solve at 0.5 took 32 s against 8 s with presolve, the same plan; docs/design.md).
PRESOLVE = "off"


def mip_solver(max_nodes: int | None = None, time_limit: float | None = None):
    """A `highspy.Highs` for one deterministic MIP solve: quiet, one thread, seed 0,
    `max_nodes` branch-and-bound nodes and `time_limit` seconds at most (None: no limit),
    presolve `PRESOLVE` and the `HANGING_HEURISTICS` off."""
    import highspy

    with quiet_stdout():  # HiGHS prints a banner to fd 1 when constructed
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("presolve", PRESOLVE)
    known = highspy.HighsOptions()
    for name in HANGING_HEURISTICS:
        if hasattr(known, name):
            h.setOptionValue(name, False)
    if max_nodes is not None:
        h.setOptionValue("mip_max_nodes", int(max_nodes))
    if time_limit is not None and np.isfinite(time_limit):
        h.setOptionValue("time_limit", float(time_limit))
    return h

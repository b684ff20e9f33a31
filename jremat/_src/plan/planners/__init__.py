"""Planners: (graph, budget) -> Plan. Each module is one algorithm, on one shared model.

model   the segment model: cut candidates, segment costs, calibration, prediction, the
        min-memory and cheapest-within-budget DPs, segments -> Plan
chain   dynamic programming over cut points and save sets (Chen et al. 2016; Rotor; Rockmate)
greedy  cost-per-byte knapsack over save sets (PyTorch's activation memory budget)
dtr     simulated Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021)
milp    exact mixed-integer program on HiGHS (Checkmate, Jain et al., MLSys 2020)

Not solvers of `jremat.plan`, references for tests and benchmarks:
save_sets    one segment's costs under any set of saved values (the segment model's formula)
value_polish value-by-value local search after the chain DP (`ChainPlanner(polish=True)`)
milp_values  Checkmate's program value by value on that accounting: the per-value optimum

Every planner holds a `SegmentModel` (`planner.model`) and offers `name`, `offload`, `table`,
`no_remat_peak()`, `min_memory_plan()` and `plan(model_budget)`; none imports another.
"""

from __future__ import annotations

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.planners import greedy
from jremat._src.plan.planners.chain import ChainPlanner
from jremat._src.plan.planners.dtr import DTRPlanner
from jremat._src.plan.planners.greedy import GreedyPlanner
from jremat._src.plan.planners.milp import MILPPlanner
from jremat._src.plan.planners.model import SegmentModel
from jremat._src.trace.graph import Graph


def milp_planner(graph: Graph, **kw) -> MILPPlanner:
    """`MILPPlanner(graph, **kw)` warm-started with the greedy choice as well as the DP."""
    return MILPPlanner(graph, incumbents=(greedy.choose,), **kw)


#: Solver name -> constructor `(graph, max_cuts=..., offload=..., **options) -> planner`.
PLANNERS = {
    "chain": ChainPlanner,
    "greedy": GreedyPlanner,
    "dtr": DTRPlanner,
    "milp": milp_planner,
}

__all__ = [
    "PLANNERS",
    "ChainPlanner",
    "DTRPlanner",
    "GreedyPlanner",
    "MILPPlanner",
    "OffloadCost",
    "SegmentModel",
    "milp_planner",
]

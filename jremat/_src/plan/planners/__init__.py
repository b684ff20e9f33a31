"""Planners: (graph, budget) -> Plan. Each module is one algorithm.

chain   dynamic programming over cut points and save sets (Chen et al. 2016; Rotor; Rockmate)
greedy  cost-per-byte knapsack over save sets (PyTorch's activation memory budget)
dtr     simulated Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021)
milp    exact mixed-integer program on HiGHS (Checkmate, Jain et al., MLSys 2020)
"""

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.planners.chain import ChainPlanner
from jremat._src.plan.planners.dtr import DTRPlanner
from jremat._src.plan.planners.greedy import GreedyPlanner
from jremat._src.plan.planners.milp import MILPPlanner

PLANNERS = {
    "chain": ChainPlanner,
    "greedy": GreedyPlanner,
    "dtr": DTRPlanner,
    "milp": MILPPlanner,
}

__all__ = [
    "PLANNERS",
    "ChainPlanner",
    "DTRPlanner",
    "GreedyPlanner",
    "MILPPlanner",
    "OffloadCost",
]

"""Planners: (graph, budget) -> Plan. Each module is one algorithm.

chain   dynamic programming over cut points and save sets (Chen et al. 2016; Rotor; Rockmate)
greedy  cost-per-byte knapsack over save sets (PyTorch's activation memory budget)
dtr     simulated Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021)
milp    exact mixed-integer program on HiGHS (Checkmate, Jain et al., MLSys 2020)
"""

from ..offload import OffloadCost
from .chain import ChainPlanner
from .dtr import DTRPlanner
from .greedy import GreedyPlanner
from .milp import MILPPlanner

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

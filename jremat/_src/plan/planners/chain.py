"""Chain planner: dynamic programming over cut points and per-segment save sets.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016) cut a chain into sqrt(n)
segments and recompute each; Griewank & Walther's revolve (2000) and Rotor (Beaumont et al.,
"Optimal checkpointing for heterogeneous chains", 2019) solve the same chain problem optimally by
dynamic programming; Rockmate (Zhao et al., ICML 2023) adds per-block save sets. This planner is
that DP over the traced program's cut candidates: each segment is kept (no checkpoint) or
checkpointed with one of the save sets in `SAVE_OPTIONS` (nothing, dots without batch dims,
expensive results, all dots), under the segment model's peak (`model`). JAX's built-in
policies applied per layer and sqrt(n) segmentations are points of this space, so the DP never
recomputes more than they do at the same predicted memory.

The DP (`within_budget`, memory in GRID buckets, corrected for their rounding by
`SegmentModel.cheapest_segments`) is the segment model's own solver: the MILP's incumbent and
`jremat.plan`'s floor plans run it on any planner's model, so it lives in `model`.
"""

from __future__ import annotations

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.model import SegmentModel, within_budget
from jremat._src.plan.planners.segments import SAVE_OPTIONS, SegmentTable
from jremat._src.trace.graph import Graph

# `within_budget` (the DP, defined in `model`) stays importable from here as well
__all__ = ["ChainPlanner", "within_budget"]


class ChainPlanner:
    """The cheapest plan within a budget by the chain DP (see the module docstring).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the DP considers (O(max_cuts^2 x GRID) work).
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take.
      offload: an `OffloadCost` adds the offload options, charged their transfer time; None
        (default): no offload.
    """

    name = "chain"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=tuple(SAVE_OPTIONS),
        offload: OffloadCost | None = None,
    ):
        self.model = SegmentModel(graph, max_cuts, options, offload)
        self.offload = offload

    @property
    def table(self) -> SegmentTable:
        """The model's (calibrated) segment table."""
        return self.model.table

    def no_remat_peak(self) -> float:
        """Modelled peak in bytes without rematerialization."""
        return self.model.no_remat_peak()

    def min_memory_plan(self) -> Plan:
        """The model's plan with the smallest modelled peak."""
        return self.model.min_memory_plan(self.name)

    def plan(self, model_budget: float) -> Plan | None:
        """Lowest-cost plan (FLOPs, with offload transfers) whose modelled peak is <=
        `model_budget` bytes, or None."""
        return self.model.cheapest_plan(model_budget, self.name)

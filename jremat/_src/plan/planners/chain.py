"""Chain planner: dynamic programming over cut points and per-segment save sets.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016); Griewank & Walther,
revolve (2000); Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019); Rockmate (Zhao et al., ICML 2023) for per-block save sets. The model, its peak and the
DP's discretization: docs/design.md#planners.
"""

from __future__ import annotations

from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.model import OnSegmentModel, within_budget

# `within_budget` (the DP, defined in `model`) stays importable from here as well
__all__ = ["ChainPlanner", "within_budget"]


class ChainPlanner(OnSegmentModel):
    """The cheapest plan within a budget by the chain DP (see the module docstring).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the DP considers (O(max_cuts^2 x GRID) work).
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take
        (default `segments.DEFAULT_OPTIONS`).
      offload: an `OffloadCost` adds the offload options, charged their transfer time; None
        (default): no offload.
    """

    name = "chain"

    def plan(self, model_budget: float) -> Plan | None:
        """Lowest-cost plan (FLOPs, with offload transfers) whose modelled peak is <=
        `model_budget` bytes, or None."""
        return self.model.cheapest_plan(model_budget, self.name)

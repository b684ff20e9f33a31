"""Chain planner: dynamic programming over cut points and per-segment save sets.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016); Griewank & Walther,
revolve (2000); Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019); Rockmate (Zhao et al., ICML 2023) for per-block save sets. The model, its peak and the
DP's discretization: docs/design.md#planners. With `polish=True` the DP's plan is then polished
value by value (`value_polish`).
"""

from __future__ import annotations

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.model import OnSegmentModel, within_budget
from jremat._src.plan.planners.save_sets import SaveSetPricer, pieces_plan
from jremat._src.plan.planners.segments import DEFAULT_OPTIONS, option_pieces
from jremat._src.plan.planners.value_polish import polish
from jremat._src.trace.graph import Graph

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
      polish: True: the DP's plan is then polished value by value on the same cuts
        (`value_polish.polish`); its checkpointed segments save sets no option names. Off by
        default: what `jremat.plan`'s search does with such plans is not measured yet
        (docs/design.md#per-value-save-sets).

    Raises:
      ValueError: when `polish` is combined with `offload` (the polish prices no offload).
    """

    name = "chain"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=DEFAULT_OPTIONS,
        offload: OffloadCost | None = None,
        polish: bool = False,
    ):
        if polish and offload is not None:
            raise ValueError("polish=True prices no offload; pass offload=None or polish=False")
        super().__init__(graph, max_cuts, options, offload)
        self.polish = polish
        self._pricer: SaveSetPricer | None = None

    def plan(self, model_budget: float) -> Plan | None:
        """Lowest-cost plan (FLOPs, with offload transfers) whose modelled peak is <=
        `model_budget` bytes, or None; with `polish`, the DP's plan polished where that
        lowers its modelled FLOPs within the budget. Raises as `SegmentModel.checked_budget`."""
        model_budget = self.model.checked_budget(model_budget)
        found = self.model.cheapest_segments(model_budget)
        if found is None:
            return None
        plan = self.model.to_plan(found[1], self.name)
        return self._polished(plan, found[1], model_budget) if self.polish else plan

    def _polished(self, plan: Plan, segs, model_budget: float) -> Plan:
        """`plan` polished in the uncalibrated model's bytes, at the budget scaled by the DP
        plan's raw over calibrated peak; kept only where the (calibrated) model predicts it
        within `model_budget` and cheaper.

        Only the DP's plan at the budget is polished: polishing its plans at budgets 2-20%
        lower as well brought heldout's GPT-2 at 0.85 (32 cuts) from +32% to +5% over the
        per-value optimum in the model, but compiled (160 cuts, jax 0.10) those plans cost
        0.82% extra FLOPs at 0.85 and 1.28% at 0.55, against the DP's 0.31% and 1.18% and
        this polish's 0.31% and 1.11%."""
        model = self.model
        if self._pricer is None:
            self._pricer = SaveSetPricer(model.graph)
        scaled = model.predict(plan)
        # unpredictable, or over the budget as merged by `to_plan` (the DP's rounding)
        if not scaled or scaled > model_budget:
            return plan
        pieces = option_pieces(model.graph, model.cuts, segs)
        raw_peak, _ = self._pricer.path_cost(pieces)
        done = polish(self._pricer, pieces, model_budget * raw_peak / scaled, cuts=model.cuts)
        if done.moves == 0:
            return plan
        out = pieces_plan(self._pricer, done.pieces, self.name, done.flops)
        predicted, cost, before = model.predict(out), model.cost(out), model.cost(plan)
        if predicted is None or predicted > model_budget or cost is None or cost >= before:
            return plan
        out.predicted_temp_bytes = int(predicted)
        out.notes.append(
            f"value polish: {done.moves} moves, modelled recompute {before:.4g} -> {cost:.4g} FLOPs"
        )
        return out

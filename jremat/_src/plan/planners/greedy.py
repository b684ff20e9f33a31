"""Greedy planner: a cost-per-byte knapsack over save sets, on the model's layer segments.

The idea behind PyTorch's activation memory budget (`torch._functorch.config.
activation_memory_budget`, 2024): buy back recomputation where it saves the most FLOPs per
byte stored, until the budget is spent. Details: docs/design.md#planners.
"""

from __future__ import annotations

from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.model import (
    OnSegmentModel,
    SegmentModel,
    Segments,
    exact_peak,
    merge_kept,
)
from jremat._src.plan.planners.segments import KEEP_OPTION, LADDER_OPTIONS, SegmentTable
from jremat._src.trace.layers import layer_segments

#: Options from the least memory to the most; the greedy moves segments up this ladder.
LADDER = ("nothing", "offload_dots", "dots_no_batch", "expensive", "dots", KEEP_OPTION)

#: Relative difference under which two FLOPs-per-byte ratios are a tie (the earlier segment
#: wins): float rounding, not the model, must not decide between identical layers.
RATIO_TIE = 1e-9


def _segments(model: SegmentModel) -> list[tuple[int, int]]:
    """The segmentation the knapsack runs on, as cut-index pairs: the layers when every layer
    boundary is a cut candidate, else the model's min-memory cuts."""
    graph = model.graph
    index = {c: i for i, c in enumerate(model.table.cuts)}
    spans = layer_segments(graph)
    cuts = sorted({0, graph.num_nodes, *[s for s, _ in spans], *[e for _, e in spans]})
    if not all(c in index for c in cuts):
        return [(a, b) for a, b, _ in model.min_memory_segments()]
    ids = [index[c] for c in cuts]
    return list(zip(ids[:-1], ids[1:], strict=True))


def choose(model: SegmentModel, model_budget: float) -> Segments | None:
    """The greedy choice on `model` as `[(cut a, cut b, option)]` (adjacent kept segments
    merged, and priced so), or None when even the cheapest memory choice exceeds
    `model_budget` bytes."""
    t = model.table
    if model.no_remat_peak() <= model_budget:  # nothing recomputed: no plan is cheaper
        return [(0, len(t.cuts) - 1, KEEP_OPTION)]
    segs = _segments(model)
    ladders = [_ladder(t, a, b) for a, b in segs]
    level = [0] * len(segs)

    def peak(levels) -> float:
        # adjacent kept segments priced as the one segment the plan makes of them (`to_plan`)
        path = [(a, b, lad[lv]) for (a, b), lad, lv in zip(segs, ladders, levels, strict=True)]
        return exact_peak(t, merge_kept(path))

    if peak(level) > model_budget:
        return None
    while True:
        best, best_ratio = None, 0.0
        current = peak(level)
        for i, ((a, b), ladder) in enumerate(zip(segs, ladders, strict=True)):
            k0 = t.option_index(ladder[level[i]])
            for lv in range(level[i] + 1, len(ladder)):
                k1 = t.option_index(ladder[lv])
                saved_flops = t.cost[k0, a, b] - t.cost[k1, a, b]
                if saved_flops <= 0:
                    continue
                trial = level.copy()
                trial[i] = lv
                new_peak = peak(trial)
                if new_peak > model_budget:
                    continue
                ratio = saved_flops / max(new_peak - current, 1.0)
                # ratios equal but for rounding (identical layers, whose running sums round
                # differently by position) keep the earlier segment: the choice must not turn
                # on the last bit, which differs between tables built with other options
                if ratio > best_ratio * (1 + RATIO_TIE):
                    best, best_ratio = trial, ratio
        if best is None:
            break
        level = best
    return merge_kept(
        [(a, b, lad[lv]) for (a, b), lad, lv in zip(segs, ladders, level, strict=True)]
    )


def _ladder(t: SegmentTable, a: int, b: int) -> list[str]:
    """Segment (a, b)'s options from the least memory to the most: `LADDER`'s, with the
    per-value rungs (`segments.LADDER_OPTIONS`) the table holds placed by the bytes they
    store in this segment (fewer FLOPs first among equal bytes)."""
    ladder = [o for o in LADDER if o in t.options]
    for name in [o for o in t.options if o in LADDER_OPTIONS]:
        k = t.option_index(name)
        at = next(
            (
                i
                for i, o in enumerate(ladder)
                if o != "nothing"
                and (t.stored[t.option_index(o), a, b], -t.cost[t.option_index(o), a, b])
                > (t.stored[k, a, b], -t.cost[k, a, b])
            ),
            len(ladder) - 1,
        )
        ladder.insert(at, name)
    return ladder


class GreedyPlanner(OnSegmentModel):
    """Knapsack greedy over per-segment save options (docs/design.md#planners).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the segment model considers.
      options: the save options (`SAVE_OPTIONS` names) a checkpointed segment may take
        (default `segments.DEFAULT_OPTIONS`).
      offload: an `OffloadCost` adds `offload_dots` to the ladder; None (default): no offload.
    """

    name = "greedy"

    def choose(self, model_budget: float) -> Segments | None:
        """`choose` on this planner's model."""
        return choose(self.model, self.model.checked_budget(model_budget))

    def plan(self, model_budget: float) -> Plan | None:
        """The greedy choice within `model_budget` bytes as a `Plan`, or None. Raises as
        `SegmentModel.checked_budget`."""
        chosen = choose(self.model, self.model.checked_budget(model_budget))
        return None if chosen is None else self.model.to_plan(chosen, self.name)

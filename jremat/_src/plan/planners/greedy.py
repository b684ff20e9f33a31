"""Greedy planner: a cost-per-byte knapsack over save sets, on the model's layer segments.

The idea behind PyTorch's activation memory budget (`torch._functorch.config.
activation_memory_budget`, 2024): buy back recomputation where it saves the most FLOPs per
byte stored, until the budget is spent. Details: docs/design.md#planners.
"""

from __future__ import annotations

from jremat._src.plan.plan import Plan
from jremat._src.plan.planners.chain import ChainPlanner, to_plan
from jremat._src.plan.planners.segments import KEEP_OPTION


class GreedyPlanner(ChainPlanner):
    """Knapsack greedy over per-segment save options (docs/design.md#planners)."""

    name = "greedy"

    def _segments(self) -> list[tuple[int, int]]:
        from jremat._src.trace.layers import layer_segments

        index = {c: i for i, c in enumerate(self.table.cuts)}
        spans = layer_segments(self.graph)
        cuts = sorted({0, self.graph.num_nodes, *[s for s, _ in spans], *[e for _, e in spans]})
        if not all(c in index for c in cuts):
            _, segs = self._min_segs()
            return [(a, b) for a, b, _ in segs]
        ids = [index[c] for c in cuts]
        return list(zip(ids[:-1], ids[1:], strict=True))

    def _min_segs(self):
        from jremat._src.plan.planners.chain import min_memory

        return min_memory(self.table)

    def plan(self, model_budget: float) -> Plan | None:
        chosen = self.choose(model_budget)
        return None if chosen is None else to_plan(self.graph, self.table, chosen, self.name)

    def choose(self, model_budget: float) -> list[tuple[int, int, str]] | None:
        """The greedy choice as `[(cut a, cut b, option)]`, or None when even the cheapest
        memory choice exceeds `model_budget`."""
        t = self.table
        segs = self._segments()
        ladder = [
            o
            for o in ("nothing", "offload_dots", "dots_no_batch", "expensive", "dots", KEEP_OPTION)
            if o in t.options
        ]
        level = [0] * len(segs)

        def peak(levels) -> float:
            run, pk = 0.0, 0.0
            for (a, b), lv in zip(segs, levels, strict=True):
                k = t.option_index(ladder[lv])
                run += t.stored[k, a, b]
                pk = max(pk, run + t.transient[k, a, b])
            return pk

        if peak(level) > model_budget:
            return None
        while True:
            best, best_ratio = None, 0.0
            current = peak(level)
            for i, (a, b) in enumerate(segs):
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
                    if ratio > best_ratio:
                        best, best_ratio = trial, ratio
            if best is None:
                break
            level = best
        return [(a, b, ladder[lv]) for (a, b), lv in zip(segs, level, strict=True)]

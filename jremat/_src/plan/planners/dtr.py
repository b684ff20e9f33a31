"""Simulated Dynamic Tensor Rematerialization (DTR) turned into a static plan.

Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021: evict the resident tensor with
the smallest h(t) = cost(t) / (bytes(t) x staleness(t)), run at trace time over the forward
and backward schedule; the evictions become the plan, per value: the residuals DTR keeps are
saved by name, those it evicts are recomputed. The simulated budget is tightened until the
plan fits the budget in the segment model. Details: docs/design.md#planners.
"""

from __future__ import annotations

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan
from jremat._src.plan.planners.model import OnSegmentModel, SegmentModel
from jremat._src.plan.planners.segments import DEFAULT_OPTIONS
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import layer_segments

#: Simulations `plan` runs at most to bring the model's peak within its budget (bisection on
#: the simulated budget, after the simulated budget equal to the model's).
SIMULATIONS = 16
#: Simulated budgets below the roomy one (nothing evicted) halved this many times are not run.
MIN_SIM_HALVINGS = 4


class DTRPlanner(OnSegmentModel):
    """DTR simulation (docs/design.md#planners); the plan saves exactly the residuals the
    simulation keeps, one segment per pair of consecutive cut candidates of the model. DTR
    evicts or keeps; it never offloads to host memory, so an `offload` cost is ignored (its
    model, and so its min-memory plan, offloads nothing either).

    Args:
      graph: a traced program (`jremat.trace`).
      max_cuts: how many cut candidates the segment model considers.
      options: the save options (`SAVE_OPTIONS` names) of the model's segments.
      offload: ignored.
    """

    name = "dtr"

    def __init__(
        self,
        graph: Graph,
        max_cuts: int = 160,
        options=DEFAULT_OPTIONS,
        offload: OffloadCost | None = None,
    ):
        del offload  # DTR's decisions are evict/keep; its reference plans offload nothing too
        self.model = SegmentModel(graph, max_cuts, options)
        self.offload = None
        self._segmentations: list[list[tuple[int, int]]] | None = None

    def simulate(self, budget: float) -> tuple[set[int], float, float]:
        """Run DTR under `budget` bytes; returns (evicted value ids, recompute FLOPs, peak
        bytes)."""
        g = self.model.graph
        n = g.num_nodes
        res_users: dict[int, list[int]] = {}
        for node in g.nodes:
            for v in node.residuals:
                res_users.setdefault(v, []).append(node.index)
        last_fwd = {v.id: (g.consumers[v.id][-1] if g.consumers[v.id] else -1) for v in g.values}
        resident: dict[int, float] = {}  # value id -> last access time
        evicted: set[int] = set()
        ever_evicted: set[int] = set()
        mem, peak, recompute = 0.0, 0.0, 0.0
        clock = [0]

        def nbytes(v: int) -> int:
            return g.values[v].nbytes

        def cost(v: int, seen: set[int]) -> float:
            """Compute to rematerialize v: its producer plus evicted ancestors (h_DTR-eq)."""
            p = g.values[v].producer
            if p < 0 or v in seen:
                return 0.0
            seen.add(v)
            c = g.nodes[p].flops
            for x in g.nodes[p].inputs:
                if isinstance(x, int) and x in evicted:
                    c += cost(x, seen)
            return c

        def evict_until(limit: float, locked: set[int]) -> None:
            nonlocal mem
            while mem > limit:
                best, best_h = None, float("inf")
                for v, t in resident.items():
                    if v in locked:
                        continue
                    h = cost(v, set()) / (nbytes(v) * (clock[0] - t + 1))
                    if h < best_h:
                        best, best_h = v, h
                if best is None:
                    return
                del resident[best]
                mem -= nbytes(best)
                evicted.add(best)
                ever_evicted.add(best)

        def ensure(v: int, locked: set[int]) -> None:
            nonlocal mem, peak, recompute
            if g.values[v].producer < 0 or v in resident:
                if v in resident:
                    resident[v] = clock[0]
                return
            p = g.values[v].producer
            node = g.nodes[p]
            for x in node.inputs:
                if isinstance(x, int):
                    ensure(x, locked | {v})
            recompute += node.flops
            evicted.discard(v)
            resident[v] = clock[0]
            mem += nbytes(v)
            evict_until(budget, locked | {v} | {x for x in node.inputs if isinstance(x, int)})
            peak = max(peak, mem)

        def needed_later(v: int, i: int, backward: bool) -> bool:
            if not backward and last_fwd[v] > i:
                return True
            users = res_users.get(v, [])
            return bool(users) and (min(users) <= i if backward else True)

        for i, node in enumerate(g.nodes):  # forward
            clock[0] += 1
            ins = {x for x in node.inputs if isinstance(x, int)}
            for x in ins:
                ensure(x, ins)
            for o in node.outputs:
                resident[o] = clock[0]
                mem += nbytes(o)
            evict_until(budget, ins | set(node.outputs))
            peak = max(peak, mem)
            for v in list(resident):
                if not needed_later(v, i, backward=False):
                    mem -= nbytes(v)
                    del resident[v]
        for i in range(n - 1, -1, -1):  # backward, in reverse
            clock[0] += 1
            node = g.nodes[i]
            need = set(node.residuals)
            for v in need:
                if g.values[v].producer >= 0:
                    ensure(v, need)
            for v in need:
                if v in resident and min(res_users.get(v, [i])) >= i:
                    mem -= nbytes(v)
                    del resident[v]
        return ever_evicted, recompute, peak

    def segmentations(self) -> list[list[tuple[int, int]]]:
        """The node ranges a plan's segments may take: the layers (`layer_segments`, glue
        between them kept), and one segment per pair of consecutive cut candidates. Values
        crossing a boundary are a segment's inputs and stay stored whatever DTR did with
        them, so which fits better depends on the program: the layers on a decoder (its
        finest cuts store every boundary)."""
        if self._segmentations is None:
            cuts = self.model.cuts
            fine = list(zip(cuts[:-1], cuts[1:], strict=True))
            layers = layer_segments(self.model.graph)
            self._segmentations = [layers, fine] if layers and layers != fine else [fine]
        return self._segmentations

    def plan_from_evictions(
        self, evicted: set[int], spans: list[tuple[int, int]]
    ) -> tuple[Plan, float] | None:
        """(plan, modelled peak in bytes) of the plan that realizes DTR's evictions per value
        on the node ranges `spans` (nodes between them kept): a span is kept where none of
        the residuals it produces is in `evicted`, else checkpointed saving by name the
        residuals it produces that are not (JAX recomputes the rest in the backward pass).
        Predictions (per segment and the plan's) are the model's
        (`SegmentModel.segment_costs`); None when the model cannot price the plan (a span's
        end is no cut candidate)."""
        graph = self.model.graph
        policies, saved = [], []
        for s, e in spans:
            res = {
                v
                for node in graph.nodes[s:e]
                for v in node.residuals
                if s <= graph.values[v].producer < e
            }
            policies.append(SAVE_NAMES if res & evicted else KEEP)
            saved.append(sorted(res - evicted) if res & evicted else [])
        plan = Plan.from_spans(graph, spans, policies, self.name, saved)
        costs = self.model.segment_costs(plan)
        if costs is None:
            return None
        running, peak = 0.0, 0.0
        for seg, (stored, transient, flops) in zip(plan.segments, costs, strict=True):
            running += stored
            peak = max(peak, running + transient)
            seg.stored_bytes, seg.transient_bytes = int(stored), int(transient)
            seg.recompute_flops = flops
        plan.predicted_temp_bytes = int(peak)
        plan.recompute_flops = float(sum(c for _, _, c in costs))
        return plan, peak

    def _cheapest_fitting(self, evicted: set[int], model_budget: float) -> Plan | None:
        """The cheaper of `evicted`'s plans on each segmentation within `model_budget`."""
        best = None
        for spans in self.segmentations():
            got = self.plan_from_evictions(evicted, spans)
            if got is not None and got[1] <= model_budget:
                if best is None or got[0].recompute_flops < best.recompute_flops:
                    best = got[0]
        return best

    def plan(self, model_budget: float) -> Plan | None:
        """The cheapest plan (modelled recompute FLOPs) from DTR's evictions whose modelled
        peak is within `model_budget` bytes, or None when none is.

        DTR decides on its own simulated memory (value bytes, without the cotangents and
        working set the segment model adds), so the simulated budget starts at
        `model_budget` and is bisected (at most `SIMULATIONS` runs) towards the largest one
        whose plan fits in the model. Evicting more never raises a plan's modelled peak on
        one segmentation (a value saved moves its bytes from the segment's transient to its
        stores), so when evicting every residual does not fit, nothing does: None, without
        simulating; that plan is also the answer when no simulated budget fits. Simulated
        budgets under `1 / 2**MIN_SIM_HALVINGS` of the roomy one are not run (DTR's
        evictions saturate there, and each simulation slows as it evicts more). Raises as
        `SegmentModel.checked_budget`.
        """
        model_budget = self.model.checked_budget(model_budget)
        if model_budget <= 0:
            return None
        graph = self.model.graph
        if self.model.no_remat_peak() <= model_budget:  # every segment kept
            return self.plan_from_evictions(set(), self.segmentations()[-1])[0]
        every = {v for node in graph.nodes for v in node.residuals}
        floor = self._cheapest_fitting(every, model_budget)
        if floor is None:
            return None
        floor.notes.append("dtr: every residual recomputed (no simulated budget fitted)")
        roomy = self.simulate(float("inf"))[2]  # the simulated peak evicting nothing
        lo, hi = 0.0, roomy
        sim_budget = min(model_budget, roomy)
        best: Plan | None = None
        for run in range(1, SIMULATIONS + 1):
            if sim_budget < roomy / 2**MIN_SIM_HALVINGS:
                break
            evicted, sim_flops, sim_peak = self.simulate(sim_budget)
            plan = self._cheapest_fitting(evicted, model_budget)
            if plan is not None and (best is None or plan.recompute_flops < best.recompute_flops):
                plan.notes.append(
                    f"dtr: simulated budget {sim_budget:,.0f} bytes (run {run}): "
                    f"{len(evicted)} values evicted, simulated peak {sim_peak:,.0f}, "
                    f"simulated recompute {sim_flops:,.0f} FLOPs"
                )
                best = plan
            lo, hi = (sim_budget, hi) if plan is not None else (lo, sim_budget)
            sim_budget = (lo + hi) / 2
        if best is None or floor.recompute_flops < best.recompute_flops:
            return floor
        return best

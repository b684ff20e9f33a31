"""Simulated Dynamic Tensor Rematerialization (DTR) turned into a static plan.

Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021: evict the resident tensor with
the smallest h(t) = cost(t) / (bytes(t) x staleness(t)), run at trace time over the forward
and backward schedule; the evictions become the plan. Details: docs/design.md#planners.
"""

from __future__ import annotations

from jremat._src.plan.offload import OffloadCost
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan
from jremat._src.plan.planners.model import OnSegmentModel, SegmentModel
from jremat._src.plan.planners.segments import SAVE_OPTIONS
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import layer_segments


class DTRPlanner(OnSegmentModel):
    """DTR simulation (docs/design.md#planners); segments are the model's layers. DTR evicts
    or keeps; it never offloads to host memory, so an `offload` cost is ignored (its model,
    and so its min-memory plan, offloads nothing either).

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
        options=tuple(SAVE_OPTIONS),
        offload: OffloadCost | None = None,
    ):
        del offload  # DTR's decisions are evict/keep; its reference plans offload nothing too
        self.model = SegmentModel(graph, max_cuts, options)
        self.offload = None

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

    def plan(self, model_budget: float) -> Plan | None:
        """The layers' save sets from DTR's evictions under `model_budget` bytes, or None when
        the simulated peak exceeds it."""
        graph = self.model.graph
        evicted, flops, peak = self.simulate(model_budget)
        if peak > model_budget * 1.001:
            return None
        spans = layer_segments(graph)
        policies, saved = [], []
        for s, e in spans:
            res = {
                v
                for node in graph.nodes[s:e]
                for v in node.residuals
                if s <= graph.values[v].producer < e
            }
            # a layer with an evicted residual saves the rest; one without keeps everything
            policies.append(SAVE_NAMES if res & evicted else KEEP)
            saved.append(sorted(res - evicted) if res & evicted else [])
        plan = Plan.from_spans(graph, spans, policies, self.name, saved)
        plan.predicted_temp_bytes, plan.recompute_flops = int(peak), flops
        plan.notes.append(f"dtr: {len(evicted)} residuals evicted, simulated peak {peak:,.0f}")
        return plan

"""Sub-layer segments for the segment at a plan's peak, tried when the budget is below every
reference plan (`floor_candidates`).

Each contraction of the peak segment becomes its own checkpointed segment; only the peak
segment, then the next one, are split, in the lowest compiled plans. Rockmate's idea (Zhao et
al., ICML 2023) applied where it pays; measurements and why the result is budget-independent:
docs/design.md#refinement.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from jremat._src.plan.plan import KEEP, Plan, Segment, plan_key
from jremat._src.plan.recipes import recipe_plan
from jremat._src.trace.layers import flop_chunks

#: Primitives that start a sub-layer segment.
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def contraction_groups(graph: Any, start: int, end: int) -> list[tuple[int, int, bool]]:
    """Nodes `[start, end)` as consecutive `(a, b, checkpointed)` pieces: each contraction with
    the residual-free equations after it is checkpointed; the rest is kept. Empty when the span
    holds fewer than two contractions (nothing to split)."""
    nodes = graph.nodes[start:end]
    if sum(n.primitive in CONTRACTIONS for n in nodes) < 2:
        return []
    pieces: list[tuple[int, int, bool]] = []
    i = start
    while i < end:
        node = graph.nodes[i]
        if node.primitive in CONTRACTIONS:
            j = i + 1
            while (
                j < end
                and graph.nodes[j].primitive not in CONTRACTIONS
                and not graph.nodes[j].residuals
            ):
                j += 1
            pieces.append((i, j, True))
        else:
            j = i + 1
            while j < end and graph.nodes[j].primitive not in CONTRACTIONS:
                j += 1
            pieces.append((i, j, False))
        i = j
    return pieces


def split_segment(graph: Any, plan: Plan, index: int) -> Plan | None:
    """`plan` with checkpointed segment `index` cut into `contraction_groups` (each piece under
    the segment's policy, or kept); None when the segment is kept, saves named values, or has
    nothing to split."""
    seg = plan.segments[index]
    if not seg.checkpointed or seg.saved or seg.offloaded:
        return None
    groups = contraction_groups(graph, seg.start, seg.end)
    if not groups:
        return None
    out = copy.deepcopy(plan)
    pieces = [Segment(a, b, seg.policy if ckpt else KEEP) for a, b, ckpt in groups]
    out.segments[index : index + 1] = pieces
    out.solver = f"{plan.solver}+split"
    out.measured_temp_bytes = out.measured_flops = out.measured_footprint_bytes = None
    return out


def peak_order(planner: Any, plan: Plan) -> list[int]:
    """Indices of `plan`'s checkpointed segments from the one the (calibrated) cost model puts
    at the peak down; by segment length when the model cannot describe the plan."""
    segs = planner.model.segments_of(plan)
    ckpt = [i for i, s in enumerate(plan.segments) if s.checkpointed]
    if segs is None or len(segs) != len(plan.segments):
        return sorted(ckpt, key=lambda i: plan.segments[i].start - plan.segments[i].end)
    here = planner.model.segment_peaks(segs)
    return sorted(ckpt, key=lambda i: -here[i] if np.isfinite(here[i]) else np.inf)


def candidates(graph: Any, planner: Any, plan: Plan, depth: int = 2) -> list[Plan]:
    """Plans with the peak segment of `plan` split, then the two highest, ... up to `depth`."""
    order = peak_order(planner, plan)
    out: list[Plan] = []
    for d in range(1, min(depth, len(order)) + 1):
        current = plan
        for i in sorted(order[:d], reverse=True):  # from the back: earlier indices stay valid
            current = split_segment(graph, current, i) or current
        if current is not plan and all(current.segments != p.segments for p in out):
            out.append(current)
    return out


#: How many of the lowest compiled plans `floor_candidates` refines.
FLOOR_STARTS = 1


def floor_candidates(
    graph: Any, planner: Any, compiled: Sequence[tuple[Plan, Any]], starts: int = FLOOR_STARTS
) -> list[Plan]:
    """Plans below the lowest of `compiled` (`(plan, figures)` pairs with `temp_bytes`, such as
    the reference plans and the model's floor plans): `candidates` of each of the `starts`
    lowest distinct plans without loop rematerializations, the lowest first, then
    `nothing_saveable` on equal-FLOP chunks; none twice and none already in `compiled`.
    They depend only on `compiled` and the (fitted) cost model, never on a budget, so the
    floor a call states is found again by a call at that budget.
    """
    known = {plan_key(p) for p, _ in compiled}
    ranked = sorted(((c.temp_bytes, i) for i, (p, c) in enumerate(compiled) if not p.scans))
    out: list[Plan] = []
    origins: set[str] = set()
    for _, i in ranked:
        if len(origins) >= starts:
            break
        plan = compiled[i][0]
        if plan_key(plan) in origins:
            continue
        origins.add(plan_key(plan))
        for candidate in candidates(graph, planner, plan):
            if plan_key(candidate) not in known:
                known.add(plan_key(candidate))
                out.append(candidate)
    # equal-FLOP chunks over every equation, a reference plan only where the layers have no
    # names: cut inside the layers, they reach below per-layer remat on a residual MLP chain
    # (docs/design.md#refinement)
    if len(flop_chunks(graph)) > 1:
        chunks = recipe_plan(graph, "nothing_saveable", "chunks")
        if plan_key(chunks) not in known:
            out.append(chunks)
    return out

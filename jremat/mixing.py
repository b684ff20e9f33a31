"""Mixes of compiled recipes: some layers (or scan iterations) under one policy, the rest under
another, so that a budget between two built-in policies gets a plan between them.

JAX's built-in policies applied per layer give a handful of (temp bytes, FLOPs) points. A
budget between two of them is met by the lower one, which recomputes as much as the lower one.
A mix puts the first k of L units (layers of an unrolled model, iterations of a `lax.scan`
over layers) under the low-memory policy B and the other L - k under the high-memory policy A;
its compiled temp and FLOPs lie close to the line between A and B, so for a budget between
them the mix costs about the interpolation of their FLOPs instead of B's. The points are
compiled anchors (truth, not the cost model), and each mix is compiled before it is used: k is
chosen by interpolation, then corrected by secant steps on the compiled temp. For scans the
split is two consecutive scans over slices of the loop (`rewrite.remat_scan(pieces=...)`).
This is the lower convex hull of the built-in recipes, as Checkmate's and Rockmate's
per-layer choices would give on a chain of identical layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .plan import KEEP, Plan, Segment

#: Per-unit choices mixed, from most memory (no remat) to least.
UNIT_POLICIES = (
    KEEP,
    "dots_and_transcendentals_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
)


def layer_mix_plan(graph: Any, policies: list[str]) -> Plan:
    """A plan with layer i (of `planning.layer_segments`) under `policies[i]` (a built-in
    policy name or "keep"); glue between layers is kept."""
    from .planning import layer_segments

    spans = layer_segments(graph)
    if len(policies) != len(spans):
        raise ValueError(f"{len(policies)} policies for {len(spans)} layers")
    segs: list[Segment] = []
    pos = 0
    for (s, e), pol in zip(spans, policies, strict=True):
        if s > pos:
            segs.append(Segment(pos, s, KEEP))
        segs.append(Segment(s, e, pol))
        pos = e
    if pos < graph.num_nodes:
        segs.append(Segment(pos, graph.num_nodes, KEEP))
    merged: list[Segment] = []
    for seg in segs:  # adjacent kept segments are one unchanged stretch
        if merged and seg.policy == KEEP and merged[-1].policy == KEEP:
            merged[-1].end = seg.end
        else:
            merged.append(seg)
    mix = sorted(set(policies), key=UNIT_POLICIES.index)
    return Plan(merged, graph.fingerprint, graph.num_nodes, solver="mix:" + "+".join(mix))


def scan_mix_plan(graph: Any, low: str, high: str, k: int) -> Plan:
    """The unchanged program with every top-level scan split: its first k iterations under
    `low`, the rest under `high` (k clipped to each scan's length)."""
    plan = Plan.identity(graph)
    plan.solver = f"mix:scan:{low}+{high}"
    for node in graph.nodes:
        if node.primitive != "scan":
            continue
        length = int(node.eqn.params["length"])
        kk = min(max(k, 0), length)
        pieces = [
            {"length": n, "policy": p, "nest": 1} for n, p in ((kk, low), (length - kk, high)) if n
        ]
        if len(pieces) == 1 and pieces[0]["policy"] == KEEP:
            continue  # the loop as it was
        plan.scans[str(node.index)] = (
            {"policy": pieces[0]["policy"], "nest": 1} if len(pieces) == 1 else {"pieces": pieces}
        )
    return plan


def _families(prog: Any) -> list[tuple[int, Callable[[str, str, int], Plan]]]:
    """(number of units, plan builder(low policy, high policy, k)) for each way to mix."""
    from .planning import layer_segments

    graph = prog.graph
    out = []
    spans = layer_segments(graph)
    if len(spans) > 1:
        n = len(spans)
        out.append((n, lambda lo, hi, k: layer_mix_plan(graph, [lo] * k + [hi] * (n - k))))
    lengths = [int(nd.eqn.params["length"]) for nd in graph.nodes if nd.primitive == "scan"]
    if lengths and max(lengths) > 1:
        out.append((max(lengths), lambda lo, hi, k: scan_mix_plan(graph, lo, hi, k)))
    return out


def _best_pair(points: list[tuple[int, float, str]], target: float):
    """The two recipes (A above `target`, B at or below it, B recomputing more) whose
    interpolation at `target` has the fewest FLOPs, as ((temp, flops, policy), (...)); None
    when no pair brackets the target."""
    best, best_flops = None, math.inf
    for a in points:
        for b in points:
            if not (a[0] > target >= b[0] and a[1] < b[1]):
                continue
            flops = a[1] + (a[0] - target) / (a[0] - b[0]) * (b[1] - a[1])
            if flops < best_flops:
                best, best_flops = (a, b), flops
    return best


def search(prog: Any, target: float, best_flops: float, max_compiles: int = 3) -> None:
    """Compile mixes that may fit `target` temp bytes with fewer FLOPs than `best_flops`.

    Every compiled mix lands in `prog.tried`, from which `planning.solve` takes the cheapest
    plan that fits. For each family the pure recipes are compiled (once per program), the two
    whose interpolation at `target` is cheapest are mixed with k units on the low-memory
    one, and k is corrected by secant steps on the compiled temp, `max_compiles` at most.
    """
    for units, build in _families(prog):
        points = []
        for pol in UNIT_POLICIES:
            c = prog.compile(build(pol, pol, units))
            points.append((c.temp_bytes, c.flops, pol))
        pair = _best_pair(points, target)
        if pair is None:
            continue
        (ta, fa, pa), (tb, fb, pb) = pair
        per_unit = (ta - tb) / units
        if fa + math.ceil((ta - target) / per_unit) / units * (fb - fa) >= best_flops:
            continue  # even the interpolation would not beat what fits already
        k = min(units - 1, max(1, math.ceil((ta - target) / per_unit)))
        lo_fit = units  # smallest k known to fit (all units on B fits: tb <= target)
        for _ in range(max_compiles):
            mix = build(pb, pa, k)
            # the interpolation between the two compiled recipes is the mix's prediction
            mix.predicted_temp_bytes = int(ta - k * per_unit)
            mix.recompute_flops = max(fa + k / units * (fb - fa) - prog.baseline.flops, 0.0)
            mix.notes.append(f"mix: {k} of {units} units under {pb}, the rest under {pa}")
            c = prog.compile(mix)
            if c.temp_bytes <= target:
                lo_fit = min(lo_fit, k)
                if target - c.temp_bytes < per_unit or k <= 1:
                    break
                k -= max(1, int((target - c.temp_bytes) // per_unit))
            else:
                k += max(1, math.ceil((c.temp_bytes - target) / per_unit))
            if k >= lo_fit:
                break

"""Mixes of compiled recipes: some layers (or scan iterations) under one policy, the rest under
another, so that a budget between two built-in policies gets a plan between them.

The lower convex hull of the built-in recipes, as Checkmate's and Rockmate's per-layer choices
would give on a chain of identical layers; how mixes are chosen and corrected on the compiled
temp: docs/design.md#mixes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from jremat import policies as _policies
from jremat._src.base import compat as _compat
from jremat._src.plan.plan import KEEP, Plan, ScanPiece, ScanSetting
from jremat._src.trace import cost_model
from jremat._src.trace.layers import layer_segments

#: Per-unit choices mixed, from most memory (no remat) to least.
UNIT_POLICIES = (
    KEEP,
    "dots_and_transcendentals_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
)


def layer_mix_plan(graph: Any, policies: list[str]) -> Plan:
    """A plan with layer i (of `layers.layer_segments`) under `policies[i]` (a built-in
    policy name or "keep"); glue between layers is kept."""
    spans = layer_segments(graph)
    if len(policies) != len(spans):
        raise ValueError(f"{len(policies)} policies for {len(spans)} layers")
    return Plan.from_spans(graph, spans, policies, _label(policies))


def scan_mix_plan(graph: Any, policies: list[str]) -> Plan:
    """The unchanged program with every top-level scan split into consecutive pieces: its
    iteration i under `policies[i]` (a built-in policy name or "keep"), runs of one policy
    forming one piece. A scan shorter than the list takes its first entries."""
    plan = Plan.identity(graph)
    plan.solver = _label(policies, "scan")
    for node in graph.nodes:
        if node.primitive != "scan":
            continue
        length = int(node.eqn.params["length"])
        runs = [(pol, len(list(group))) for pol, group in itertools.groupby(policies[:length])]
        if len(runs) == 1 and runs[0][0] == KEEP:
            continue  # the loop as it was
        plan.scans[str(node.index)] = (
            ScanSetting(runs[0][0])
            if len(runs) == 1
            else ScanSetting(pieces=tuple(ScanPiece(n, pol) for pol, n in runs))
        )
    return plan


def _label(policies: list[str], kind: str = "layers") -> str:
    used = sorted(set(policies), key=UNIT_POLICIES.index)
    return f"mix:{kind}:" + "+".join(used)


def loop_family(prog: Any) -> tuple[int, Callable[[list[str]], Plan]] | None:
    """(iterations, plan builder from per-iteration policies) of a program whose units are
    the iterations of its top-level scans (the longest one's); None for any other program."""
    graph = prog.graph
    lengths = [int(nd.eqn.params["length"]) for nd in graph.nodes if nd.primitive == "scan"]
    if not lengths or max(lengths) <= 1:
        return None
    return max(lengths), lambda pols: scan_mix_plan(graph, pols)


def loop_saved_bytes(prog: Any) -> dict[str, int]:
    """Bytes the top-level scans keep for the backward pass under each of `UNIT_POLICIES` on
    every iteration, from the trace alone (no compile): the residual table's for `KEEP`,
    what each policy marks saveable in the bodies for the others (times the lengths)."""
    scans = [nd.eqn for nd in prog.graph.nodes if nd.primitive == "scan"]
    out = {KEEP: sum(cost_model.internal_residual_bytes(e) for e in scans)}
    for pol in UNIT_POLICIES[1:]:
        out[pol] = sum(
            _compat.scan_length(e)
            * cost_model.jaxpr_policy_saved_bytes(e.params["jaxpr"], _policies.get(pol))
            for e in scans
        )
    return out


def _families(prog: Any) -> list[tuple[int, Callable[[list[str]], Plan]]]:
    """(number of units, plan builder from per-unit policies) for each way to mix."""
    if (loops := loop_family(prog)) is not None:
        return [loops]  # layers live inside the loop: the units to mix are its iterations
    graph = prog.graph
    units = len(layer_segments(graph))
    return [(units, lambda pols: layer_mix_plan(graph, pols))] if units > 1 else []


def compositions(units: int, n_policies: int, max_distinct: int = 3):
    """Every way to give `units` units to `n_policies` policies (counts per policy, summing to
    `units`) using at most `max_distinct` of them: tuples of length `n_policies`."""
    for chosen in itertools.combinations(range(n_policies), min(max_distinct, n_policies)):
        for cuts in itertools.combinations_with_replacement(range(units + 1), len(chosen) - 1):
            bounds = (0, *cuts, units)
            counts = [0] * n_policies
            for i, p in enumerate(chosen):
                counts[p] = bounds[i + 1] - bounds[i]
            yield tuple(counts)


def _cheapest(points, units: int, target: float, best_flops: float, skip: set):
    """The composition with the fewest interpolated FLOPs whose interpolated temp is at most
    `target`, as (counts, temp, flops); None when none beats `best_flops`."""
    best = None
    for counts in set(compositions(units, len(points))):
        if counts in skip:
            continue
        temp = sum(n * p[0] for n, p in zip(counts, points, strict=True)) / units
        flops = sum(n * p[1] for n, p in zip(counts, points, strict=True)) / units
        if temp <= target and flops < best_flops and (best is None or flops < best[2]):
            best = (counts, temp, flops)
    return best


def pure_plans(prog: Any) -> list[Plan]:
    """The pure recipes `search` interpolates (`UNIT_POLICIES` on every unit of each family),
    so that a caller can compile them ahead, together with other plans."""
    return [build([pol] * units) for units, build in _families(prog) for pol in UNIT_POLICIES]


def most_saving_plan(prog: Any) -> Plan | None:
    """The pure recipe that saves the most (`UNIT_POLICIES[1]`, the first after keep, on every
    unit) of an unrolled program with more than one layer; None for any other program."""
    if loop_family(prog) is not None:
        return None
    units = len(layer_segments(prog.graph))
    return layer_mix_plan(prog.graph, [UNIT_POLICIES[1]] * units) if units > 1 else None


def search(
    prog: Any, target: float, best_flops: float, max_compiles: int = 3, close_enough: float = 0.03
) -> list:
    """Compile mixes that may fit `target` temp bytes with fewer FLOPs than `best_flops`.

    Returns the (mix, compiled figures) compiled here, from which `solve.solve` takes the
    cheapest plan that fits (they land in `prog.tried` too). For each family the pure
    recipes (`UNIT_POLICIES` on every unit) are compiled once per program; a mix is a count
    of units per policy (at most three policies), predicted by interpolating the pure
    recipes' compiled temp and FLOPs. The cheapest mix predicted to fit is compiled; when
    XLA's temp misses the prediction, the target the prediction must meet moves by the miss
    and the next cheapest is tried, `max_compiles` at most per family, and none after one
    that fits within `close_enough` (a fraction) of the target. Units take the lower-memory
    policies first.
    """
    out = []
    for units, build in _families(prog):
        pure = prog.compile_many([build([pol] * units) for pol in UNIT_POLICIES])
        points = [(c.temp_bytes, c.flops) for c in pure]
        aim, seen = target, set()
        for _ in range(max_compiles):
            found = _cheapest(points, units, aim, best_flops, seen)
            if found is None:
                break
            counts, temp, flops = found
            seen.add(counts)
            order = sorted(range(len(points)), key=lambda i: points[i][0])
            policies = [UNIT_POLICIES[i] for i in order for _ in range(counts[i])]
            mix = build(policies)
            mix.predicted_temp_bytes = int(temp)
            mix.recompute_flops = max(flops - prog.baseline.flops, 0.0)
            mix.notes.append(
                "mix: "
                + ", ".join(f"{n} x {UNIT_POLICIES[i]}" for i in order if (n := counts[i]))
                + f" of {units} units"
            )
            c = prog.compile(mix)
            out.append((mix, c))
            if c.temp_bytes <= target:
                best_flops = min(best_flops, c.flops)
                if c.temp_bytes >= (1 - close_enough) * target:
                    break  # a cheaper mix would have to fit the little room left
            # the interpolation missed XLA by (compiled - predicted): aim the next one so that
            # the same miss still fits
            aim = target - (c.temp_bytes - temp)
    return out

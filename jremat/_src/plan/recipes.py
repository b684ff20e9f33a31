"""Fixed recipes: JAX's built-in policies per layer, sqrt(n) segments (Chen et al. 2016) and
loop rematerializations of top-level scans, compiled as reference plans next to every search
(docs/design.md#plans-and-the-rewrite)."""

from __future__ import annotations

import math
import re

import jax

from jremat._src.base import compat as _compat
from jremat._src.plan.plan import KEEP, Plan, ScanSetting, plan_key
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import (
    flop_chunks,
    layer_segments,
    layer_source,
    loops_inside,
    sqrt_divisor,
)

#: Fixed recipes compiled next to every plan search: JAX's built-in policies per layer and
#: sqrt(n) segments. `plan` returns the cheapest compiled plan that fits, so it never recomputes
#: more than any of these when one fits the budget.
ANCHOR_RECIPES = (
    ("nothing_saveable", "layers"),
    ("nothing_saveable", "sqrt_n"),
    ("dots_with_no_batch_dims_saveable", "layers"),
    ("dots_saveable", "layers"),
)

#: Added where the layers are the user's blocks found without names (calls, repeated
#: subgraphs): those leave the glue between blocks (pooling, upsampling, concatenation)
#: outside every segment, and on some programs equal-FLOP chunks covering everything reach
#: lower (docs/design.md#layers-without-names).
UNNAMED_EXTRA_RECIPES = (("nothing_saveable", "chunks"), ("nothing_saveable", "chunks_sqrt_n"))


#: Saves what `dots_saveable` saves where no equation is saved by one and not the other
#: (`dots_policies_differ`).
NO_BATCH_DOTS = "dots_with_no_batch_dims_saveable"


def dots_policies_differ(graph: Graph) -> bool:
    """Whether `dots_with_no_batch_dims_saveable` and `dots_saveable` may save different values
    of `graph`: some equation, nested jaxprs included (scan bodies, calls), that one of JAX's
    two policies saves and the other does not: a `dot_general` with batch dimensions
    (attention), a convolution (only `dots_saveable` saves those). Asks the policies
    themselves, so whatever primitive a JAX version treats apart counts."""
    ours = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    theirs = jax.checkpoint_policies.dots_saveable

    def differ(eqns) -> bool:
        for eqn in eqns:
            avals = [v.aval for v in eqn.invars]
            if ours(eqn.primitive, *avals, **eqn.params) != theirs(
                eqn.primitive, *avals, **eqn.params
            ):
                return True
            if any(differ(sub.eqns) for sub in _compat.subjaxprs(eqn)):
                return True
        return False

    return differ([n.eqn for n in graph.nodes])


#: A checkpointed segment that names no value to save or offload (`save_only_these_names()`
#: of nothing) in a `plan_key`: it saves what `nothing_saveable` saves, nothing.
_NAMES_SAVING_NOTHING = re.compile(r"(\d+:\d+:)names:(?=[;|])")


def same_program_key(plan: Plan | None, policies_differ: bool) -> str:
    """`plan_key(plan)`, equal for plans that compile to the same program: a `"names"`
    segment that saves and offloads nothing counts as under `nothing_saveable` (a planner's
    min-memory plan cut at the layers is per-layer `nothing_saveable`); where the two dots
    policies save the same values (`dots_policies_differ` False), segments and scans under
    `NO_BATCH_DOTS` count as under `dots_saveable`."""
    key = _NAMES_SAVING_NOTHING.sub(r"\1nothing_saveable:", plan_key(plan))
    return key if policies_differ else key.replace(NO_BATCH_DOTS, "dots_saveable")


def anchor_plans(graph: Graph) -> list[Plan]:
    """The fixed recipes compiled next to every plan search: `ANCHOR_RECIPES`, and where the
    layers were found without names `UNNAMED_EXTRA_RECIPES`; none when the program has a
    single layer."""
    if len(layer_segments(graph)) <= 1:
        return []
    recipes = list(ANCHOR_RECIPES)
    if layer_source(graph) in ("calls", "repeats"):
        recipes += UNNAMED_EXTRA_RECIPES
    return [recipe_plan(graph, policy, seg) for policy, seg in recipes]


# -- fixed recipes: built-in policies per layer, sqrt(n), scans over layers --------------------
def scan_configs(graph: Graph) -> list[dict[str, ScanSetting]]:
    """Loop rematerializations to try for the graph's top-level scans (one decision for every
    iteration): the body under nothing / dots-without-batch / dots saveable, and sqrt(L)
    nesting (outer scan over checkpointed inner scans) keeping or recomputing the inner body.
    Flax's `nn.remat_scan` never checkpoints its innermost body; these configurations do."""
    scans = [n for n in graph.nodes if n.primitive == "scan"]
    if not scans:
        return []
    configs = []
    options = [
        ("nothing_saveable", 1),
        ("dots_with_no_batch_dims_saveable", 1),
        ("dots_saveable", 1),
        ("everything_saveable", 0),
        ("nothing_saveable", 0),
    ]
    for policy, nest in options:
        cfg: dict[str, ScanSetting] = {}
        for node in scans:
            length = int(node.eqn.params["length"])
            k = nest or sqrt_divisor(length)
            if nest == 0 and k <= 1:
                continue
            cfg[str(node.index)] = ScanSetting(policy, k)
        if cfg:
            configs.append(cfg)
    # loops nested in a loop's body (a bounded while written as scans): their own bodies
    # checkpointed, the outer body kept or checkpointed too, as a user's jax.checkpoint on the
    # nested loop's step places them
    nesting = [n for n in scans if loops_inside(n.eqn.params["jaxpr"])]
    for policy in (KEEP, "nothing_saveable"):
        cfg = {str(n.index): ScanSetting(policy, 1, inner="nothing_saveable") for n in nesting}
        if cfg:
            configs.append(cfg)
    return configs


def recipe_plan(graph: Graph, policy: str, segmentation: str = "layers") -> Plan:
    """A fixed plan: `policy` (a `jremat.policies` name) applied per layer ("layers"), to
    about sqrt(L) groups of layers ("sqrt_n", Chen et al. 2016), or the same on equal-FLOP
    chunks covering every node ("chunks", "chunks_sqrt_n"; `trace.layers.flop_chunks`);
    glue between layers is kept.

    Raises:
      ValueError: `segmentation` is none of these.
    """
    if segmentation not in ("layers", "sqrt_n", "chunks", "chunks_sqrt_n"):
        raise ValueError(
            "segmentation must be 'layers', 'sqrt_n', 'chunks' or 'chunks_sqrt_n', got "
            f"{segmentation!r}"
        )
    spans = flop_chunks(graph) if segmentation.startswith("chunks") else layer_segments(graph)
    if segmentation.endswith("sqrt_n"):
        k = max(1, round(math.sqrt(len(spans))))
        size = math.ceil(len(spans) / k)
        groups = [spans[i : i + size] for i in range(0, len(spans), size)]
        spans = [(g[0][0], g[-1][1]) for g in groups]
    name = f"{policy}/{segmentation}"
    return Plan.from_spans(graph, spans, [policy] * len(spans), name).annotate(graph)

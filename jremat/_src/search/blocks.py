"""Planning a Flax block: `solve` on its kept bytes (`BlockProgram`), the plan mapped back
onto the block's graph. What a block budget bounds: docs/design.md#flax-blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jremat._src.base.budget import Budget
from jremat._src.compile.blocks import BlockProgram, block_plan, whole_block_plan
from jremat._src.plan.plan import Plan
from jremat._src.search.solve import solve
from jremat._src.trace.graph import Graph


def plan_block(
    f: Callable[..., Any],
    block: Graph,
    args: Sequence[Any],
    ct_mask: Sequence[bool],
    spec: Budget,
    *,
    verify: bool = True,
    max_rounds: int = 4,
    **solve_kw: Any,
) -> Plan:
    """Plan a block `f(diff, rest)` (from `block_fn`) under a kept-bytes budget.

    Returns a plan for `block` (the graph of `f`). Raises `InfeasibleBudgetError` as
    `jremat.plan` does, its figures being kept bytes.
    """
    if not verify:
        if spec.fraction is not None and spec.fraction >= 1:
            p = Plan.identity(block, budget=spec.raw)
        else:
            p = whole_block_plan(block, block.num_nodes)
            p.budget = spec.raw
        p.notes.append("verify=False: a block below budget 1 keeps only its inputs")
        return p
    prog = BlockProgram(f, block, args, ct_mask)
    p = solve(prog, spec, verify=True, max_rounds=max_rounds, **solve_kw)
    p = block_plan(p, block, prog.graph)
    if p.measured_temp_bytes is not None:  # the calibrated model figure is not kept bytes
        p.predicted_temp_bytes = p.measured_temp_bytes
    p.notes.append(
        "block plan: measured_temp_bytes and baseline_temp_bytes are the block's kept bytes "
        "(temp it adds ahead of an unrematerialized copy of itself), see docs/design.md#flax-blocks"
    )
    return p

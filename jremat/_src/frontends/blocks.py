"""Flax blocks at run time: `plan_block` plans a traced block under a kept-bytes budget,
`run_block` evaluates it under the plan for its signature, `disabled` switches planning off.

How a block is planned: docs/design.md#flax-blocks."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from jremat._src.base import compat as _compat
from jremat._src.base.budget import Budget
from jremat._src.compile.blocks import (
    BlockProgram,
    block_fn,
    block_plan,
    eval_jaxpr,
    has_cotangent,
    whole_block_plan,
)
from jremat._src.plan.plan import Plan
from jremat._src.plan.rewrite import run_graph
from jremat._src.search.solve import solve
from jremat._src.trace.graph import Graph, build_graph

if TYPE_CHECKING:  # the cache calls plan_block; run_block only takes one
    from jremat._src.frontends.cache import PlanCache


_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jremat_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this context, `jremat.auto`-decorated Flax modules run without rematerialization
    and without planning (their code is traced and evaluated as is). `jremat.explain` uses it
    to analyse a model as written; use it to measure a model with and without the decorator."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    """Whether a `disabled()` context is active."""
    return _DISABLED.get()


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


# -- evaluation ------------------------------------------------------------------------------
def run_block(
    closed_jaxpr: Any,
    flat_args: Sequence[Any],
    out_avals: Sequence[Any],
    ct_mask: Sequence[bool],
    cache: PlanCache,
    *,
    prevent_cse: bool = True,
    plan_it: bool = True,
) -> list[Any]:
    """Evaluate a traced block on `flat_args` under the plan for its signature.

    Evaluates it unchanged (no planning) when `plan_it` is False (Flax's `init`), inside
    `disabled()`, or when the block has no float argument or no float output to differentiate.
    """
    jaxpr, consts = _compat.closed(closed_jaxpr)
    f, (diff, rest) = block_fn(closed_jaxpr, flat_args)
    if not plan_it or is_disabled() or not diff or not has_cotangent(out_avals, ct_mask):
        return eval_jaxpr(jaxpr, consts, flat_args)
    graph = build_graph(f, (diff, rest))
    p = cache.get(graph, f, (diff, rest), ct_mask=ct_mask)
    return run_graph(graph, p, [*diff, *rest], prevent_cse=prevent_cse)

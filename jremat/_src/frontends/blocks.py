"""Flax blocks at run time: `plan_block` plans a traced block under a kept-bytes budget,
`run_block` evaluates it under the plan for its signature, `disabled` switches planning off.

How a block is planned: docs/design.md#flax-blocks."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

from jremat._src.base import compat as _compat
from jremat._src.compile.blocks import (
    block_fn,
    eval_jaxpr,
    has_cotangent,
)
from jremat._src.frontends.cache import PlanCache
from jremat._src.plan.rewrite import run_graph
from jremat._src.trace.graph import build_graph

_DISABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("jremat_disabled", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this context, `jremat.auto`-decorated functions and Flax modules run without
    rematerialization and without planning (their code is traced and evaluated as is).
    `jremat.explain` uses it to analyse a model as written; use it to measure a model with and
    without the decorator.

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> loss = jremat.auto(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), budget=0.5)
      >>> with jremat.disabled():
      ...     g = jax.grad(loss)(jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> g.shape, len(loss.plans)  # the gradient, and no plan made
      ((8, 8), 0)
    """
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def is_disabled() -> bool:
    """Whether a `disabled()` context is active."""
    return _DISABLED.get()


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

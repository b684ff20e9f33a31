"""Per-value save sets priced by a minimum cut: which values to save at a given exchange rate.

A checkpointed program saves some values and recomputes the equations that produce the
others its backward pass needs. At an exchange rate of `price` FLOPs per stored byte, the
save set that minimises `recompute FLOPs + price * saved bytes` is a minimum-weight closure,
the program PyTorch's min-cut partitioner solves (`torch._functorch.partitioners`; Checkmate's
per-value program, Jain et al. 2020, at one rate). Variables, all 0/1:

  r[p]  equation p is recomputed             weight flops[p] - price * bytes(outputs of p)
  a[o]  value o is available to the backward weight price * bytes(o)

with the implications (each "x -> y" a closure constraint y >= x):

  r[p] -> a[o]  for every output o of p     (recomputing p makes its outputs available)
  r[c] -> a[o]  for every input o of c      (a recompute needs its inputs)
  a[o] = 1      for every residual o of a VJP rule (`Node.vjp_residuals`)
  a[o] -> r[p]  where o cannot be saved by name (`Value.saveable`: complex, integer)
  r[p] = 1      where p keeps internal residuals (custom_jvp, scan: no name reaches inside)

A value is saved when it is available and its equation is not recomputed, which costs its
bytes; a recomputed equation costs its FLOPs. The constraint matrix is a network matrix, so
the linear program's vertex solutions (HiGHS's dual simplex) are the integral optimum.

Unlike a threshold on FLOPs per byte (`segments.FPB_LADDER`), the cut sees dependencies: it
saves the cheap value whose recompute would need an expensive unsaved one, and drops a value
whose recompute reads only saved ones. `segments.SAVE_OPTIONS` "cut@t" saves the program-wide
set at rate t; each segment keeps the part its backward needs. docs/design.md#per-value-save-sets.
"""

from __future__ import annotations

import numbers

import numpy as np
import scipy.optimize
import scipy.sparse

from jremat._src.base.args import as_real
from jremat._src.trace.graph import Graph
from jremat._src.trace.layers import first_residual_use

_MEMO = "value_cut_sets"

#: The largest price taken, FLOPs per byte: far above any equation's (a matmul's is its
#: contraction size over 2 for float32), below where HiGHS loses the objective's scale.
MAX_PRICE = 1e6


def cut_save_set(graph: Graph, price: float) -> frozenset[int]:
    """The value ids the whole program saves at `price` FLOPs per stored byte (module
    docstring): the minimum of recompute FLOPs plus `price` times saved bytes, over the
    programs JAX's partial evaluation can run (saved values by name, the rest recomputed
    from them and the arguments). Memoized on the graph.

    Args:
      graph: a traced program (`jremat.trace`).
      price: FLOPs one stored byte is worth, in (0, `MAX_PRICE`] (a Python or NumPy real).

    Raises:
      ValueError: when `price` is not a real number in (0, `MAX_PRICE`].
      RuntimeError: when HiGHS reports no optimum (it cannot happen for a well-formed
        graph: the all-recompute point is feasible and the objective is bounded).
    """
    number = as_real(price) if isinstance(price, numbers.Real) else None
    if number is None or not 0 < number <= MAX_PRICE:
        raise ValueError(f"price: a number of FLOPs per byte in (0, {MAX_PRICE:g}]; got {price!r}")
    price = number
    memo = graph.memo.setdefault(_MEMO, {})
    if price in memo:
        return memo[price]
    n = graph.num_nodes
    produced = [v.id for v in graph.values if v.producer >= 0]
    if not produced:  # no equations: nothing to save or recompute
        memo[price] = frozenset()
        return memo[price]
    col = {v: n + k for k, v in enumerate(produced)}  # a[o]'s column
    nbytes = np.array([float(graph.values[v].nbytes) for v in produced])
    cost = np.zeros(n + len(produced))
    cost[n:] = price * nbytes
    lower = np.zeros_like(cost)
    rows: list[tuple[int, int]] = []  # (x, y): x - y <= 0, i.e. x -> y
    _, vjp_first = first_residual_use(graph)
    for p, node in enumerate(graph.nodes):
        cost[p] = node.flops - price * sum(graph.values[o].nbytes for o in node.outputs)
        if node.internal_bytes:
            lower[p] = 1.0
        for o in node.outputs:
            rows.append((p, col[o]))
            if not graph.values[o].saveable:
                rows.append((col[o], p))
        for o in node.inputs:
            if isinstance(o, int) and o in col:
                rows.append((p, col[o]))
    for o in vjp_first:
        if o in col:
            lower[col[o]] = 1.0
    k = np.arange(len(rows))
    x, y = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    a_ub = scipy.sparse.csr_matrix(
        (np.r_[np.ones(len(k)), -np.ones(len(k))], (np.r_[k, k], np.r_[x, y])),
        shape=(len(rows), len(cost)),
    )
    res = scipy.optimize.linprog(
        cost / max(float(np.abs(cost).max()), 1.0),  # the same argmin, in HiGHS's scale
        A_ub=a_ub,
        b_ub=np.zeros(len(rows)),
        bounds=np.c_[lower, np.ones_like(lower)],
        method="highs-ds",
    )
    if res.status != 0:
        raise RuntimeError(f"the min-cut save set at price {price} has no optimum: {res.message}")
    sol = np.round(res.x).astype(bool)
    saved = frozenset(v for v in produced if sol[col[v]] and not sol[graph.values[v].producer])
    memo[price] = saved
    return saved

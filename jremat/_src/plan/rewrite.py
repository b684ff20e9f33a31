"""Re-evaluate a traced program with each segment of a `Plan` under `jax.checkpoint`.

Named saves, loop rematerialization and the jax < 0.11 tied recompute:
docs/design.md#plans-and-the-rewrite and docs/design.md#jax-versions.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jremat import policies
from jremat._src.base import compat as _compat
from jremat._src.base.args import check_flag, check_loss_output
from jremat._src.base.errors import PlanMismatchError
from jremat._src.plan.offload import offload_policy
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, ScanPiece, ScanSetting, Segment
from jremat._src.trace.graph import Graph, build_graph, is_literal, signature
from jremat._src.trace.layers import PASS_THROUGH, loops_inside


def residual_name(vid: int) -> str:
    """The `checkpoint_name` jremat gives to saved value `vid`."""
    return f"jremat_v{vid}"


def segment_io(graph: Graph, seg: Segment) -> tuple[list[int], list[int]]:
    """(live-in ids, live-out ids) of a segment: what crosses its two cuts."""
    inside = range(seg.start, seg.end)
    live_in: dict[int, None] = {}
    for node in graph.nodes[seg.start : seg.end]:
        for x in node.inputs:
            if not is_literal(x) and graph.values[x].producer not in inside:
                live_in[x] = None
    outs_after = {x for x in graph.outvars if not is_literal(x)}
    live_out = []
    for node in graph.nodes[seg.start : seg.end]:
        for o in node.outputs:
            cons = graph.consumers[o]
            if o in outs_after or (cons and cons[-1] >= seg.end):
                live_out.append(o)
    return list(live_in), live_out


def _eval_nodes(
    nodes: Sequence[Any],
    env: dict[int, Any],
    tag: dict[int, str],
    scans: dict[str, ScanSetting] | None = None,
) -> None:
    for node in nodes:
        invals = [x.val if is_literal(x) else env[x] for x in node.inputs]
        scan = (scans or {}).get(str(node.index))  # a ScanSetting, or None
        outs = (
            _compat.bind(node.eqn, invals)
            if scan is None
            else remat_scan(node.eqn, invals, scan.policy, scan.nest, scan.pieces, scan.inner)
        )
        for o, val in zip(node.outputs, outs, strict=True):
            env[o] = checkpoint_name(val, tag[o]) if o in tag else val


def remat_scan(
    eqn: Any,
    invals: list[Any],
    policy: str = "nothing_saveable",
    nest: int = 1,
    pieces: Sequence[ScanPiece] | None = None,
    inner: str | None = None,
):
    """Evaluate a `scan` equation with its body under `jax.checkpoint(policy)`.

    One decision applies to every iteration: each keeps its carry and what `policy` saves.
    With `nest` = k > 1 dividing the length, the loop runs as an outer scan of length/k whose
    checkpointed body is an inner scan of k steps (sqrt(L) nesting), so only every k-th carry
    is stored. `prevent_cse` is off: inside a
    loop it changes nothing (docs/design.md#facts-about-jax-remat, fact 4).

    With `pieces` (`ScanPiece`s whose lengths sum to the scan's length), the loop is split
    into consecutive scans over slices of its `xs`, each with its own body policy: the first
    n1 iterations under p1, the next n2 under p2, and so on (in iteration order, so from the
    end of `xs` for a reverse scan); a piece's policy "keep" runs its iterations without a
    checkpoint. Memory and recompute then lie between the pure policies, in proportion to
    the lengths.

    With `inner`, the scans among the body's equations run their own bodies under
    `jax.checkpoint(inner)` (`ScanSetting.inner`); with `policy` "keep" the body itself is not
    checkpointed then.

    Raises:
      ValueError: when `nest` > 1 does not divide the length (it fell back to an unnested
        loop silently before); `inner` on a loop whose body runs no loop.
    """
    if pieces:
        return _remat_scan_pieces(eqn, invals, pieces)
    if policy == KEEP and inner is None:  # a piece of a split loop left as it was
        return _compat.bind(eqn, invals)
    from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

    body = eqn.params["jaxpr"]
    if not hasattr(body, "consts"):
        body = ClosedJaxpr(body, [])
    if inner is not None and not loops_inside(body):
        raise ValueError(
            f"ScanSetting.inner={inner!r} on a scan whose body runs no loop (no scan among its "
            "equations, its cond branches or nested jits): it would change nothing; leave "
            "inner None there"
        )
    body_fn = jaxpr_as_fun(body) if inner is None else _with_inner_loops(body, inner)
    if policy != KEEP:
        pol = real_residuals_only(
            policies.get(policy) if policy in policies.names() else policies.preset(policy).policy
        )
        body_fn = jax.checkpoint(body_fn, policy=pol, prevent_cse=False)
    n_consts, n_carry = _compat.scan_partition(eqn)
    consts, carry, xs = (
        invals[:n_consts],
        list(invals[n_consts : n_consts + n_carry]),
        list(invals[n_consts + n_carry :]),
    )
    length = int(eqn.params["length"])
    reverse = bool(eqn.params.get("reverse"))

    # jax.lax.scan traces the checkpointed body itself, in the current trace: operand types
    # (weak types, a shard_map body's varying manual axes) stay what the loop had
    def step(c, x):
        outs = body_fn(*consts, *c, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    if nest > 1 and length % nest:
        # a remainder scan was tried: slicing xs into the chunks and the rest copies them (a
        # 64-step scan nested by 7 compiled to 1.42x the temp of nest 1; nest 8: 0.56x)
        divisors = [k for k in range(2, length) if length % k == 0]
        raise ValueError(
            f"scan nest {nest} does not divide the loop's length {length}; a nest must divide "
            f"it (divisors > 1: {divisors or 'none, the length is prime'}; 1: no nesting)"
        )
    if nest <= 1:
        unroll = eqn.params.get("unroll", 1)
        carry_out, ys = jax.lax.scan(step, carry, xs, length=length, reverse=reverse, unroll=unroll)
        return [*carry_out, *ys]
    n_outer = length // nest

    @functools.partial(
        jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
    )
    def outer_body(c, x_chunk):
        return jax.lax.scan(step, c, x_chunk, length=nest, reverse=reverse)

    chunks = [x.reshape((n_outer, nest) + x.shape[1:]) for x in xs]
    carry_out, ys = jax.lax.scan(outer_body, carry, chunks, length=n_outer, reverse=reverse)
    return [*carry_out, *[y.reshape((length,) + y.shape[2:]) for y in ys]]


def _with_inner_loops(body: Any, inner: str) -> Callable[..., list[Any]]:
    """A closed scan body as a function whose own scan equations run their bodies under
    `jax.checkpoint(inner)` (`remat_scan`), also inside its `cond` branches and nested jits
    (`layers.PASS_THROUGH`); every other equation as it was."""
    jaxpr, consts = _compat.closed(body)

    def bind_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        if name == "scan":
            return remat_scan(eqn, invals, inner)
        if name in PASS_THROUGH and any(loops_inside(j) for j in _compat.subjaxprs(eqn)):
            if name == "cond":  # each branch rewritten; the index picks one, as lax.cond did
                branches = [_with_inner_loops(b, inner) for b in eqn.params["branches"]]
                return list(jax.lax.switch(invals[0], branches, *invals[1:]))
            (sub,) = _compat.subjaxprs(eqn)  # a nested jit: inlined, its loops rewritten
            closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            return list(_with_inner_loops(closed if closed is not None else sub, inner)(*invals))
        return _compat.bind(eqn, invals)

    return lambda *args: _compat.eval_jaxpr(jaxpr, consts, args, bind_eqn)


def _remat_scan_pieces(eqn: Any, invals: list[Any], pieces: Sequence[ScanPiece]) -> list[Any]:
    length = int(eqn.params["length"])
    lengths = [p.length for p in pieces]
    if sum(lengths) != length or min(lengths) < 1:
        raise ValueError(f"scan pieces {lengths} must be positive and sum to its length {length}")
    n_consts, n_carry = _compat.scan_partition(eqn)
    consts, carry = invals[:n_consts], list(invals[n_consts : n_consts + n_carry])
    xs = invals[n_consts + n_carry :]
    reverse = bool(eqn.params.get("reverse"))
    # piece i covers iterations [off, off + n); a reverse scan's iteration t reads xs[L-1-t]
    ys_parts, off = [], 0
    for piece, n in zip(pieces, lengths, strict=True):
        lo, hi = (length - off - n, length - off) if reverse else (off, off + n)
        piece_eqn = _compat.with_params(eqn, dict(eqn.params, length=n))
        piece_in = [*consts, *carry, *[x[lo:hi] for x in xs]]
        outs = remat_scan(piece_eqn, piece_in, policy=piece.policy, nest=piece.nest)
        carry, ys = list(outs[:n_carry]), outs[n_carry:]
        ys_parts.append(ys)
        off += n
    if reverse:
        ys_parts = ys_parts[::-1]
    ys = [jax.numpy.concatenate(parts) for parts in zip(*ys_parts, strict=True)]
    return [*carry, *ys]


def tied_checkpoint(
    fn: Callable[..., Any], policy: Callable[..., Any], prevent_cse: bool = True
) -> Callable[..., Any]:
    """`jax.checkpoint(fn, policy=policy)` whose recompute waits for the incoming cotangent.

    The forward pass runs `jax.vjp` of the checkpointed `fn` and keeps its residuals (the
    inputs and what `policy` saves). The backward pass adds `0 * ct[0]` (a scalar from the
    cotangent) to every floating residual before running the VJP: a true data dependency that
    XLA can neither CSE with the forward pass nor schedule before the cotangent exists. Used
    where `jax.checkpoint`'s barrier does not hold (`_compat.TIED_RECOMPUTE`). A cotangent
    holding inf/NaN turns the residuals to NaN, as it would the gradient anyway. Supports
    reverse mode (grad, vjp) and vmap; not forward mode (jvp). Residuals `policy` offloads
    to host memory are not tied (a device scalar cannot be added to them); their copy back to
    the device happens inside the VJP.
    """
    checkpointed = jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)

    @jax.custom_vjp
    def f(*ins):
        return checkpointed(*ins)

    def fwd(*ins):
        return jax.vjp(checkpointed, *ins)

    def bwd(vjp_fn, ct):
        floats = [c for c in jax.tree_util.tree_leaves(ct) if _compat.is_float_dtype(c.dtype)]
        # the real part: casting a complex cotangent to float32 is deprecated (then an error)
        tie = sum(jnp.real(_one_element(c)).astype("float32") for c in floats if c.size) * 0.0

        return jax.tree_util.tree_map(lambda r: _tied(r, tie), vjp_fn)(ct)

    f.defvjp(fwd, bwd)
    return f


def _tied(r: Any, tie: Any) -> Any:
    """Residual `r` made to depend on `tie` (a float32 zero read from the cotangent) without
    changing its value: floats and integers plus `tie`, booleans and-ed with `tie == 0`, a
    PRNG key array through its key data. Every dtype, not only floats: an untied integer or
    key residual lets XLA compute what depends on it alone (a dropout mask drawn from a key)
    before the cotangent, merged with the forward pass; jax 0.10, a key computed in the
    caller's jit: 1.04x the unrematerialized temp at budget 0.7. An offloaded residual
    returns to the device inside the VJP and is left as it is; float0 holds no data."""
    if _compat.in_host_memory(r) or not hasattr(r, "dtype"):
        return r
    dtype = r.dtype
    if _compat.is_extended_dtype(dtype):
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return r
        data = _tied(jax.random.key_data(r), tie)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(r))
    if dtype == jax.dtypes.float0:
        return r
    if dtype == jnp.bool_:
        return jnp.logical_and(r, tie == 0)
    return r + tie.astype(dtype)


def _one_element(c: Any) -> Any:
    """A scalar read from `c`: its first element, or under explicit sharding (where slicing a
    sharded dimension to size 1 is not implemented) its minimum."""
    spec = getattr(getattr(jax.typeof(c), "sharding", None), "spec", None)
    if spec is not None and any(e is not None for e in spec):
        return c.min()
    return c.reshape(-1)[0]


def segment_policy(seg: Segment) -> Callable[..., Any]:
    """The `jax.checkpoint` policy a checkpointed segment runs under: for policy `"names"`,
    `save_only_these_names` of its saved values, or, when it offloads values,
    `save_and_offload_only_these_names` (offloaded ones to pinned host memory); never saving
    a complex value (`real_residuals_only`)."""
    if seg.policy == SAVE_NAMES and seg.offloaded:
        return real_residuals_only(
            offload_policy(
                [residual_name(v) for v in seg.saved], [residual_name(v) for v in seg.offloaded]
            )
        )
    if seg.policy == SAVE_NAMES:
        policy = jax.checkpoint_policies.save_only_these_names(*map(residual_name, seg.saved))
    elif seg.policy in policies.names():
        policy = policies.get(seg.policy)
    else:
        policy = policies.preset(seg.policy).policy
    return real_residuals_only(policy)


def real_residuals_only(policy: Callable[..., Any]) -> Callable[..., Any]:
    """`policy`, except that an equation with a complex input or output is not saved: JAX's
    remat cannot save a complex residual by policy (jax 0.10-0.12 raise `reduce_precision does
    not accept dtype complex64` for `dots_saveable` on a complex matmul, and for a complex
    value saved by name), so it is recomputed (`Value.saveable`: the planners price it so)."""

    def real_only(prim: Any, *avals: Any, **params: Any) -> Any:
        decision = policy(prim, *avals, **params)
        if decision and (_any_complex(avals) or _any_complex(_out_avals(prim, avals, params))):
            return False
        return decision

    return real_only


def _any_complex(avals: Any) -> bool:
    for a in avals:
        dtype = getattr(a, "dtype", None)
        try:
            if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
                return True
        except TypeError:  # an extended dtype (PRNG keys): not complex
            continue
    return False


def _out_avals(prim: Any, avals: Sequence[Any], params: dict) -> list[Any]:
    """The output avals of `prim` at `avals` (none where its abstract evaluation fails)."""
    try:
        out = prim.abstract_eval(*avals, **params)
    except Exception:  # noqa: BLE001 - a primitive without abstract evaluation: inputs decide
        return []
    out = out[0] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], set) else out
    return list(out) if isinstance(out, (list, tuple)) else [out]


def run_graph(graph: Graph, plan: Plan, flat_args: Sequence[Any], *, prevent_cse: bool = True):
    """Evaluate `graph` on flat arguments following `plan`; returns the flat outputs.

    Raises:
      ValueError: a segment's `saved` or `offloaded` names a value id the graph lacks (a plan
        edited by hand, or made for another program); the message names the segment and ids.
    """
    check_value_ids(graph, plan)
    if not prevent_cse and _compat.loop_context(flat_args) == "top":
        prevent_cse = True  # the program that runs is the one that was verified
        warnings.warn(
            "jremat: prevent_cse=False outside a lax.scan/while_loop body would let XLA merge "
            "the recomputation into the forward pass and keep every activation (the plan was "
            "verified with prevent_cse=True); running with prevent_cse=True. Pass "
            "prevent_cse=False only for a function called inside a scan or loop body.",
            RuntimeWarning,
            stacklevel=2,
        )
    env: dict[int, Any] = dict(zip(graph.invars, flat_args, strict=True))
    env.update(graph.consts)
    for seg in plan.segments:
        if not seg.checkpointed:
            _eval_nodes(graph.nodes[seg.start : seg.end], env, {}, plan.scans)
            continue
        live_in, live_out, run = _segment_runner(graph, seg, plan.scans, prevent_cse)
        outs = materialized(run(*[env[i] for i in live_in]))
        env.update(zip(live_out, outs, strict=True))
    return [x.val if is_literal(x) else env[x] for x in graph.outvars]


def materialized(outs: Sequence[Any]) -> list[Any]:
    """A checkpointed segment's outputs, the floating ones behind one
    `lax.optimization_barrier`: each is computed once, into its own buffer, and read from
    there by the segments after it (and their cotangents leave through the barrier's
    transpose).

    Without it XLA fuses a cheap elementwise output into every consumer: a residual stream
    `x + f(x)` across per-layer segments became one fusion computing the last layer's input
    from the first and every layer's branch output, all of them kept live to the end of the
    forward pass though each layer's input was already saved. Residual MLP of 16 layers,
    2048 x 128 rows, jax 0.12: per-layer segments saving nothing compiled to 39 MiB of temp,
    16 MiB of it those branch outputs; behind the barrier 32 MiB and 0.2 points fewer FLOPs
    (docs/design.md#plans-and-the-rewrite)."""
    outs = list(outs)
    # one barrier per set of varying manual axes: in a checked `shard_map` body jax 0.10 gives
    # every operand of one barrier the union of theirs, and an invariant output that became
    # varying fails the `pvary` that follows it (outside a body: one barrier)
    groups: dict[frozenset[str], list[int]] = {}
    for i, o in enumerate(outs):
        if hasattr(o, "dtype") and _compat.is_float_dtype(o.dtype):
            groups.setdefault(_compat.varying_axes(o), []).append(i)
    for idx in groups.values():
        held = jax.lax.optimization_barrier([outs[i] for i in idx])
        for i, o in zip(idx, held, strict=True):
            outs[i] = o
    return outs


def _segment_runner(
    graph: Graph, seg: Segment, scans: dict[str, ScanSetting], prevent_cse: bool
) -> tuple[list[int], list[int], Callable[..., Any]]:
    """(live-in ids, live-out ids, the checkpointed function) of a checkpointed segment,
    built once per graph and segment: the same function object for the same segment in
    every plan, so that JAX's caches (the checkpoint's traced jaxpr, its JVP and partial
    evaluation, keyed on the function and its policy) serve every candidate that shares it
    instead of tracing it again."""
    inside = {k: v for k, v in scans.items() if seg.start <= int(k) < seg.end}
    key = (
        seg.start,
        seg.end,
        seg.policy,
        tuple(seg.saved),
        tuple(seg.offloaded),
        tuple(sorted(inside.items())),
        prevent_cse,
        _compat.TIED_RECOMPUTE,
    )
    runners = graph.memo.setdefault("segment_runners", {})
    if key not in runners:
        live_in, live_out, seg_fn = _segment_fn(graph, seg, inside)
        if _compat.TIED_RECOMPUTE:
            run = tied_checkpoint(seg_fn, segment_policy(seg), prevent_cse)
        else:
            run = jax.checkpoint(seg_fn, policy=segment_policy(seg), prevent_cse=prevent_cse)
        runners[key] = (live_in, live_out, run)
    return runners[key]


def _segment_fn(
    graph: Graph, seg: Segment, scans: dict[str, ScanSetting]
) -> tuple[list[int], list[int], Callable[..., Any]]:
    """(live-in ids, live-out ids, the segment as a function of its live-in values), its
    saved and offloaded values named (`residual_name`) where its policy is `"names"`."""
    nodes = graph.nodes[seg.start : seg.end]
    live_in, live_out = segment_io(graph, seg)
    named = [*seg.saved, *seg.offloaded] if seg.policy == SAVE_NAMES else []
    tag = {v: residual_name(v) for v in named}

    def seg_fn(*ins):
        local = dict(zip(live_in, ins, strict=True))
        _eval_nodes(nodes, local, tag, scans)
        return [local[o] for o in live_out]

    return live_in, live_out, seg_fn


def drop_unkept_names(graph: Graph, plan: Plan) -> Plan:
    """Remove from each segment's `saved` and `offloaded` the values `jax.checkpoint` does not
    keep; returns `plan`, edited in place.

    A planner names every value its save option selects (`saved_values`), but the
    checkpoint keeps as residuals only those its backward pass reads (a VJP rule's operands,
    the inputs of what it recomputes); a name on any other value changes nothing in the
    program, and a report listing it would count bytes the compiled program never holds
    (their bytes leave the segment's predicted `stored_bytes` too)
    (docs/design.md#what-a-plan-saves). Each named segment is traced on its own (abstractly:
    `jax.vjp` of the checkpointed segment, differentiated where the program is) and its
    names read off the residuals JAX keeps. A segment that cannot be traced alone (collectives
    over a `shard_map`'s axes) keeps its names.
    """
    tangent = _tangent_values(graph)
    for seg in plan.segments:
        if seg.policy != SAVE_NAMES or not (seg.saved or seg.offloaded):
            continue
        live_in, _, seg_fn = _segment_fn(graph, seg, plan.scans)
        avals = [graph.values[v].struct for v in live_in]
        diff = [v in tangent and graph.values[v].is_float for v in live_in]
        # every name saved (offloaded ones too): which of them the backward pass reads
        names = [residual_name(v) for v in [*seg.saved, *seg.offloaded]]
        policy = jax.checkpoint_policies.save_only_these_names(*names)
        try:
            kept = _compat.residual_names(jax.checkpoint(seg_fn, policy=policy), avals, diff)
        except Exception:  # noqa: BLE001 - e.g. a collective over an unbound axis: names kept
            continue
        if kept is None:
            continue
        dropped = [v for v in seg.saved if residual_name(v) not in kept]
        seg.saved = [v for v in seg.saved if residual_name(v) in kept]
        seg.offloaded = [v for v in seg.offloaded if residual_name(v) in kept]
        # the model counted the saved values it thought the backward reads
        seg.stored_bytes = max(0, seg.stored_bytes - sum(graph.values[v].nbytes for v in dropped))
    return plan


def _tangent_values(graph: Graph) -> set[int]:
    """Value ids that depend on a differentiated argument (their tangents are not zero)."""
    out = {v for v, d in zip(graph.invars, graph.diff_invars, strict=True) if d}
    for node in graph.nodes:
        if any(not is_literal(x) and x in out for x in node.inputs):
            out.update(node.outputs)
    return out


def _nested_custom_jvp(eqns: Sequence[Any], depth: int = 0) -> bool:
    """Whether a `custom_jvp_call` sits inside a control-flow body (scan, cond, while...)."""
    for eqn in eqns:
        if depth and "custom_jvp" in eqn.primitive.name:
            return True
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _nested_custom_jvp(inner.eqns, depth + 1):
                    return True
    return False


def _smallest_divisor(n: int) -> int:
    """The smallest k > 1 dividing n (n itself when prime; 1 when n <= 1)."""
    return next((k for k in range(2, n + 1) if n % k == 0), 1)


def check_replayable(graph: Graph, name: str) -> None:
    """Check the traced program can be differentiated once traced, as jremat runs it.

    A `jax.custom_jvp` whose `nondiff_argnums` receive a traced array inside a loop body
    closes its JVP rule over a tracer of the first trace; JAX then cannot lower the gradient of the
    traced program (`jax.grad(jax.jit(fn))` fails the same way) and the error names nothing
    the user wrote. Probed (abstractly) only when a nested `custom_jvp` exists.

    Raises:
      TypeError: naming `fn`, the `custom_jvp` and the fix.
    """
    if not _nested_custom_jvp([n.eqn for n in graph.nodes]):
        return
    avals = [graph.values[i].struct for i in graph.invars]

    probe = Plan.identity(graph)  # every scan's body replayed from its jaxpr, nested as plans do
    probe.scans = {
        str(n.index): ScanSetting(nest=_smallest_divisor(int(n.eqn.params["length"])))
        for n in graph.nodes
        if n.primitive == "scan"
    }

    def replay(*flat: Any) -> Any:
        return run_graph(graph, probe, list(flat))

    diff = list(graph.diff_invars)

    def step(*flat: Any) -> Any:
        def of_diff(*d: Any) -> Any:
            it = iter(d)
            return replay(*[next(it) if k else x for x, k in zip(flat, diff, strict=True)])

        outs, pullback = jax.vjp(of_diff, *[x for x, k in zip(flat, diff, strict=True) if k])
        return pullback(outs)

    try:
        jax.jit(step).lower(*avals)  # the stale tracer fails only when lowered
    except Exception as e:  # noqa: BLE001 - a probe: other failures surface where they occur
        if "Tracer" not in f"{type(e).__name__} {e}":
            return
        raise TypeError(
            f"{name} uses a jax.custom_jvp inside a lax.scan (or another loop/cond body) that "
            "receives a traced array through nondiff_argnums; JAX cannot differentiate such a "
            "function once traced (jax.grad(jax.jit(fn)) fails the same way), so jremat cannot "
            "rematerialize it. Pass that array as a regular argument of the custom_jvp (its "
            f"tangent ignored in the rule) instead of through nondiff_argnums. ({e})"
        ) from None


def check_value_ids(graph: Graph, plan: Plan) -> None:
    """Check every value id in the segments' `saved` and `offloaded` lists is one of `graph`'s
    (a `Plan` holds ids only, so this is checked where it meets its program).

    Raises:
      ValueError: naming the segment, the field and the ids the graph lacks.
    """
    n = len(graph.values)
    for i, seg in enumerate(plan.segments):
        for field in ("saved", "offloaded"):
            bad = [v for v in getattr(seg, field) if not 0 <= v < n]
            if bad:
                raise ValueError(
                    f"Plan.segments[{i}].{field} names value id(s) {bad} that the program does "
                    f"not have (its value ids are 0 .. {n - 1}): the plan was edited or made "
                    "for another program. Make a new plan (jremat.plan)."
                )


def rematerialize(
    fn: Callable[..., Any], plan: Plan, *, prevent_cse: bool = True, has_aux: bool = False
) -> Callable[..., Any]:
    """Return `fn` with its backward pass following `plan`.

    The returned function has the same signature and pytrees as `fn`. When called it traces
    `fn` (cached per argument shapes/dtypes), checks the program is the one the plan was made
    for, and re-evaluates its equations: every checkpointed segment runs under
    `jax.checkpoint(policy=save_only_these_names(...), prevent_cse=prevent_cse)` with its saved
    values tagged by `jax.ad_checkpoint.checkpoint_name` (`save_and_offload_only_these_names`
    where a segment offloads values to host memory; see
    [design.md#host-offload](../design.md#host-offload)). Composes with `jit`, `grad`,
    `value_and_grad` and `vmap`. A plan that checkpoints nothing returns `fn` itself.

    Args:
      fn: the function the plan was made for (positional array/pytree arguments).
      plan: a `jremat.Plan` (from `jremat.plan`, or `Plan.from_json`).
      prevent_cse: passed to `jax.checkpoint`; keep True outside `lax.scan`, or XLA merges the
        recompute back into the forward pass. False is honoured inside a loop body (or where
        that cannot be told); called at the top level (eagerly or under `jit`/`grad`) it runs
        with True, as the plan was verified, and warns (`RuntimeWarning`).
      has_aux: `fn` returns `(loss, aux)` and the plan was made with `jremat.plan(...,
        has_aux=True)`; the returned function returns the same pair, for
        `jax.value_and_grad(..., has_aux=True)`. Each new signature's output is checked to be
        such a pair. Default False: the outputs are returned as `fn` returns them.

    Raises:
      TypeError: `plan` is not a `jremat.Plan`; `has_aux` not a bool; at call time, with
        `has_aux`, `fn` does not return a pair whose first element is a scalar float loss.
      ValueError: the plan's segments do not tile its equations or have fields of the wrong
        type, or its `scans` entries are malformed (`Plan.validate`).
      PlanMismatchError (a ValueError), at call time: the call's program differs from the one
        the plan was made for: its `Graph.fingerprint` (shapes, dtypes, equations and which
        value feeds which) is not the plan's.
      ValueError, at call time: a segment saves or offloads a value id the program lacks
        (`check_value_ids`).

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> p = jremat.plan(loss, ws, x, budget=0.9)
      >>> grads = jax.jit(jax.grad(jremat.rematerialize(loss, p)))(ws, x)
      >>> all(jnp.allclose(g, r) for g, r in zip(grads, jax.grad(loss)(ws, x)))
      True
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a jremat.Plan, got {type(plan).__name__}")
    plan.validate()
    has_aux = check_flag("has_aux", has_aux)
    if plan.is_identity:
        return fn
    graphs: dict[Any, Graph] = {}

    @functools.wraps(fn)
    def rematerialized(*args: Any) -> Any:
        key = signature(args)
        graph = graphs.get(key)
        if graph is None:
            graph = build_graph(fn, args)
            check_plan_program(graph, plan)
            if has_aux:
                check_loss_output(graph.out_shape, has_aux=True)
            if not holds_tracers(graph):
                graphs[key] = graph
        return _call_graph(graph, plan, args, prevent_cse)

    rematerialized.plan = plan  # type: ignore[attr-defined]
    return rematerialized


def check_plan_program(graph: Graph, plan: Plan, what: str = "the call") -> None:
    """Check `plan` was made for the program `graph` (its `Graph.fingerprint`) and names only
    value ids it has (`check_value_ids`).

    Raises:
      PlanMismatchError: the fingerprints differ; the message names `what` traced to which.
      ValueError: a segment saves or offloads an id the graph lacks.
    """
    if graph.fingerprint != plan.fingerprint:
        raise PlanMismatchError(
            f"this plan was made for program {plan.fingerprint} ({plan.num_nodes} "
            f"equations) but {what} traces to {graph.fingerprint} ({graph.num_nodes} "
            "equations): shapes, dtypes or code (its equations or their wiring) changed, "
            "or the plan was saved by jremat 0.1, whose fingerprints left out the wiring. "
            "Make a new plan for these "
            "arguments (jremat.plan), or use jremat.auto, which re-plans per signature."
        )
    check_value_ids(graph, plan)


def graph_function(graph: Graph, plan: Plan, *, prevent_cse: bool = True) -> Callable[..., Any]:
    """The function `rematerialize(fn, plan)` returns, for calls at the one signature `graph`
    (`build_graph(fn, ...)`) was traced at, without tracing `fn` again: it evaluates `graph`'s
    equations under `plan` (a candidate compile then traces the user's code once, not twice;
    `jremat.auto` runs its plans so). `prevent_cse` as in `rematerialize`.

    Raises:
      ValueError: `graph` holds tracers of another trace (its constants were captured inside
        a transformation): call `rematerialize(fn, plan)` instead, which traces per call.
    """
    if holds_tracers(graph):
        raise ValueError("graph_function: the graph holds tracers; use rematerialize(fn, plan)")

    def rematerialized(*args: Any) -> Any:
        return _call_graph(graph, plan, args, prevent_cse)

    return rematerialized


def _call_graph(graph: Graph, plan: Plan, args: Sequence[Any], prevent_cse: bool) -> Any:
    """`graph` evaluated under `plan` on the pytree arguments `args`, as the traced function's
    output pytree."""
    outs = run_graph(graph, plan, jax.tree_util.tree_leaves(args), prevent_cse=prevent_cse)
    return jax.tree_util.tree_unflatten(graph.out_tree, outs)


def holds_tracers(graph: Graph) -> bool:
    """Whether `graph`'s constants include tracers (it was traced inside a transformation)."""
    return any(_compat.is_tracer(c) for c in graph.consts.values())

"""`jremat.measure`: XLA's memory and FLOP figures for one `jit(value_and_grad(fn))` step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import models as M
import numpy as np
import pytest

import jremat
from jremat._src.compile.xla import compile_step, xla_flops


def _nbytes(tree) -> int:
    return sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
    )


def test_footprint_is_argument_plus_output_minus_alias_plus_temp(cache):
    m = cache.model("mlp_chain")
    r = cache.baseline("mlp_chain")
    assert r.footprint_bytes == r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes
    # the terms are the compiled program's: params + x in; loss + param grads out; no donation
    params, x = m.args
    assert r.argument_bytes == _nbytes(params) + _nbytes(x)
    # outputs: the loss and the gradients, plus XLA's output tuple table (a pointer per leaf)
    n_out = 1 + len(jax.tree_util.tree_leaves(params))
    assert 4 + _nbytes(params) <= r.output_bytes <= 4 + _nbytes(params) + 8 * n_out
    assert r.alias_bytes == 0
    mem = jax.jit(jax.value_and_grad(m.loss)).lower(*m.args).compile().memory_analysis()
    assert r.temp_bytes == mem.temp_size_in_bytes > 0
    # activations dominate the temp bytes of this model (so budgets below 1.0 are reachable)
    assert r.temp_bytes > 4 * _nbytes(params)
    assert r.flops > 0 and r.compile_seconds > 0 and r.step_seconds is None


def test_footprint_with_tuple_argnums_and_abstract_args(cache):
    m = cache.model("mlp_chain")
    params, x = m.args
    r = jremat.measure(m.loss, *m.args, argnums=(0, 1))
    n_out = 2 + len(jax.tree_util.tree_leaves(params))
    out = 4 + _nbytes(params) + _nbytes(x)  # the grad of x is returned too
    assert out <= r.output_bytes <= out + 8 * n_out
    assert r.footprint_bytes == r.argument_bytes + r.output_bytes - r.alias_bytes + r.temp_bytes
    # shapes and dtypes suffice (no arrays) when nothing is run
    avals = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), m.args)
    ra = jremat.measure(m.loss, *avals)
    rb = cache.baseline("mlp_chain")
    assert (ra.temp_bytes, ra.footprint_bytes, ra.flops) == (
        rb.temp_bytes,
        rb.footprint_bytes,
        rb.flops,
    )


@pytest.mark.parametrize(
    "depth, argnums, tol",
    [
        (8, 0, 0.05),
        # differentiating the input too, scan and unrolled run the same arithmetic (when x is
        # not differentiated, the unrolled program skips the first layer's input gradient)
        (4, (0, 1), 0.01),
    ],
)
def test_scan_flops_match_the_unrolled_model(depth, argnums, tol):
    scan, unrolled = M.scan_layers(depth=depth), M.scan_layers(depth=depth, unroll=True)
    rs = jremat.measure(scan.loss, *scan.args, argnums=argnums)
    ru = jremat.measure(unrolled.loss, *unrolled.args, argnums=argnums)
    assert rs.flops == pytest.approx(ru.flops, rel=tol)
    # XLA alone counts the scan body once: measure multiplies it by the trip count
    raw = xla_flops(compile_step(scan.loss, scan.args, (0,) if argnums == 0 else argnums))
    assert rs.flops > 0.8 * depth * (raw / 2)
    assert rs.flops > 2 * raw


def test_nested_scan_flops_match_the_unrolled_model():
    scan, unrolled = M.scan_layers(depth=4), M.scan_layers(depth=4, unroll=True)
    params, x = scan.args

    def layer(x, p):
        return x + jnp.tanh(M._rmsnorm(x) @ p["w1"]) @ p["w2"]

    def nested(params, x):  # an outer scan of 2 over inner scans of 2 layers
        pp = jax.tree_util.tree_map(lambda a: a.reshape(2, 2, *a.shape[1:]), params)

        def outer(c, p_outer):
            return jax.lax.scan(lambda c, p: (layer(c, p), None), c, p_outer)[0], None

        return jnp.mean(jax.lax.scan(outer, x, pp)[0] ** 2)

    np.testing.assert_allclose(nested(params, x), unrolled.loss(params, x), rtol=1e-5)
    rn = jremat.measure(nested, params, x, argnums=(0, 1))
    ru = jremat.measure(unrolled.loss, params, x, argnums=(0, 1))
    assert rn.flops == pytest.approx(ru.flops, rel=0.01)


def test_flops_count_the_matmuls(cache):
    """value_and_grad of the MLP: each matmul runs once forward and twice backward (x's
    gradient is skipped in the first layer only); XLA's count is at least that."""
    m = cache.model("mlp_chain")
    params, x = m.args
    b = x.shape[0]
    fwd = sum(2 * b * p["w1"].shape[0] * p["w1"].shape[1] * 2 for p in params)
    r = cache.baseline("mlp_chain")
    assert 2.8 * fwd <= r.flops <= 4.0 * fwd


def test_runs_gives_step_seconds(cache):
    m = cache.model("mlp_chain")
    r = jremat.measure(m.loss, *m.args, runs=2)
    assert r.step_seconds is not None and r.step_seconds > 0
    assert r.temp_bytes == cache.baseline("mlp_chain").temp_bytes


@pytest.mark.parametrize("runs", [-1, 1.5, "2"])
def test_bad_runs_is_a_value_error(cache, runs):
    m = cache.model("mlp_chain")
    with pytest.raises(ValueError, match="runs"):
        jremat.measure(m.loss, *m.args, runs=runs)


def test_measure_of_a_rematerialized_function(cache):
    """measure works on rematerialized functions: less temp, more FLOPs."""
    from jremat._src.plan.recipes import recipe_plan

    m = cache.model("mlp_chain")
    p = recipe_plan(jremat.trace(m.loss, *m.args), "nothing_saveable", "layers")
    r = jremat.measure(jremat.rematerialize(m.loss, p), *m.args)
    base = cache.baseline("mlp_chain")
    assert r.temp_bytes < base.temp_bytes
    assert r.flops > base.flops
    assert (r.argument_bytes, r.output_bytes) == (base.argument_bytes, base.output_bytes)


# -- elementwise and transcendental work ------------------------------------------------------
def _transcendental_scan(checkpoint_body: bool = False):
    """A scan whose body is only transcendental work (XLA counts none of it as "flops")."""

    def body(c, _):
        return jnp.sin(jnp.tanh(c)), None

    def loss(x):
        f = jax.checkpoint(body) if checkpoint_body else body
        return jnp.mean(jax.lax.scan(f, x, None, length=4)[0])

    return loss


X_TRANSCENDENTAL = jnp.linspace(-1.0, 1.0, 64 * 64).reshape(64, 64)


def test_flops_count_transcendentals_as_the_cost_model_does():
    from jremat._src.trace import cost_model

    x = jnp.ones((64, 32))
    fn = lambda x: jnp.tanh(jnp.exp(x))  # noqa: E731
    (eqn_exp, eqn_tanh) = jax.make_jaxpr(fn)(x).jaxpr.eqns
    want = cost_model.eqn_flops(eqn_exp) + cost_model.eqn_flops(eqn_tanh)
    assert xla_flops(jax.jit(fn).lower(x).compile()) == want == 2 * 64 * 32


def test_recomputing_a_transcendental_scan_body_is_not_free():
    """Recomputing the whole body costs its FLOPs (jremat.plan ranks compiled candidates by
    these figures: a whole-scan recompute counted as free won at budget 0.9, +0.0% FLOPs)."""
    loss, x = _transcendental_scan(), X_TRANSCENDENTAL
    base = jremat.measure(loss, x)
    whole = jremat.measure(_transcendental_scan(checkpoint_body=True), x)
    assert whole.flops >= base.flops + 4 * x.size  # tanh again (its backward needs it), every trip


def test_a_backend_that_counts_no_flops_gets_the_cost_models(monkeypatch):
    """Where XLA reports no FLOPs (for a step or a scan body), jremat's FLOP table counts them."""
    from jremat._src.compile import xla
    from jremat._src.trace import cost_model

    loss, x = _transcendental_scan(), X_TRANSCENDENTAL
    monkeypatch.setattr(xla, "xla_flops", lambda compiled: 0.0)
    monkeypatch.setattr(xla, "_BODY_FLOPS", {})  # bodies counted by earlier tests' real XLA
    step = jax.make_jaxpr(jax.value_and_grad(loss))(x).jaxpr
    assert jremat.measure(loss, x).flops == cost_model.jaxpr_flops(step) > 16 * x.size
    body = next(e for e in step.eqns if e.primitive.name == "scan").params["jaxpr"]
    assert xla._body_flops(body, {}) == cost_model.jaxpr_flops(body) > 0


# -- loop bodies once per trip, read from the optimized HLO -----------------------------------
def test_loop_flops_are_read_from_the_compiled_program_without_compiling_bodies(compiles):
    """A scan's missing trips are costed on the program's own optimized HLO (XLA's cost
    analysis of each loop body as it runs): one compile per measure, where each scan body
    used to compile on its own, and the same figure as that body-by-body count to 1%."""
    from jremat._src.compile import loop_flops, xla

    scan = M.scan_layers(depth=4)
    measured = jremat.measure(scan.loss, *scan.args).flops  # before any body is compiled
    assert (compiles.jremat, compiles.aot) == (1, 1)
    exe = compile_step(scan.loss, scan.args, (0,))
    reported = xla_flops(exe)
    from_hlo = loop_flops.loop_flops_correction(exe, reported)
    by_bodies = xla.scan_flops_correction(scan.loss, scan.args, (0,))
    assert from_hlo is not None and from_hlo > reported  # 3 more trips of fwd and bwd bodies
    assert from_hlo == pytest.approx(by_bodies, rel=0.01)
    assert measured == reported + from_hlo


def test_loop_flops_of_a_transcendental_body_count_every_trip():
    """sin(tanh(c)) over 4 trips: XLA counts one trip of the loop's 2 transcendentals per
    element (and the add of its trip counter); the HLO path adds the other 3 trips."""
    from jremat._src.compile import loop_flops

    x = X_TRANSCENDENTAL
    exe = jax.jit(_transcendental_scan()).lower(x).compile()  # forward only: one loop
    reported = xla_flops(exe)
    extra = loop_flops.loop_flops_correction(exe, reported)
    assert extra == 3 * (2 * x.size + 1)


def test_a_loop_without_a_known_trip_count_falls_back_to_the_scan_bodies():
    """A `while_loop` whose trip count depends on data has no `known_trip_count`: the HLO
    path gives None and `measure` counts its scans body by body, as before."""
    from jremat._src.compile import loop_flops

    def loss(x):
        n = jnp.int32(jnp.abs(x[0, 0]) * 0 + 3)
        y = jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, jnp.tanh(s[1])), (0, x))
        return jnp.mean(jax.lax.stop_gradient(y[1]) * x)

    x = X_TRANSCENDENTAL
    exe = jax.jit(loss).lower(x).compile()
    assert loop_flops.loop_flops_correction(exe, xla_flops(exe)) is None
    assert jremat.measure(loss, x).flops > 0


def test_a_figure_that_xla_does_not_reproduce_is_not_used():
    """The re-read module must cost what XLA reported for the executable, else None."""
    from jremat._src.compile import loop_flops

    scan = M.scan_layers(depth=4)
    exe = compile_step(scan.loss, scan.args, (0,))
    assert loop_flops.loop_flops_correction(exe, xla_flops(exe) + 1.0) is None


def test_loops_in_conditional_branches_count_the_costliest_branch_only():
    """XLA costs a conditional as its costliest branch: with a 6-trip scan in one branch and
    4 unrolled layers in the other, the figure is the scan branch's, not both added (the
    breaker's case: 9 layers counted where at most 6 run)."""
    from jremat._src.compile import loop_flops

    w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((8, 64))

    def layer(h):
        return jnp.tanh(h @ w)

    def scan(h, n):
        return jax.lax.scan(lambda h, _: (layer(h), None), h, None, length=n)[0]

    def unrolled(h, n):
        for _ in range(n):
            h = layer(h)
        return h

    def total(f):
        exe = jax.jit(f).lower(x, 1.0).compile()
        reported = xla_flops(exe)
        return reported + loop_flops.loop_flops_correction(exe, reported)

    six = total(lambda x, p: jnp.sum(unrolled(x, 6)))
    mixed = total(
        lambda x, p: jnp.sum(jax.lax.cond(p > 0, lambda h: scan(h, 6), lambda h: unrolled(h, 4), x))
    )
    both_scans = total(
        lambda x, p: jnp.sum(jax.lax.cond(p > 0, lambda h: scan(h, 6), lambda h: scan(h, 3), x))
    )
    assert mixed == pytest.approx(six, rel=0.01)
    assert both_scans == pytest.approx(six, rel=0.01)


def test_a_plans_flops_count_every_trip_of_a_loop_outside_any_scan():
    """A `while_loop` whose bounds XLA reads (as in `jax.random`'s rolled threefry on CPU) in
    a program without a scan: the figures a plan is ranked and reported by count its 8 trips,
    as `measure` does (they counted one trip: the breaker's plan said +10.0% FLOPs where
    `measure` said +0.7%)."""
    from jremat._src.compile.program import Program

    ws = [jnp.full((64, 64), 0.01) for _ in range(3)]

    def loss(ws, x):
        def body(s):
            return s[0] + 1, jnp.tanh(s[1] @ ws[0])

        trips = (0, jax.lax.stop_gradient(x))
        _, scale = jax.lax.while_loop(lambda s: s[0] < 8, body, trips)
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h * jax.lax.stop_gradient(scale))

    x = jnp.ones((32, 64))
    prog = Program(loss, (ws, x), 0)
    assert not prog.has_scan
    one_trip = 2 * 32 * 64 * 64 + 32 * 64  # the loop body's matmul and tanh
    measured = jremat.measure(loss, ws, x).flops
    assert measured >= xla_flops(compile_step(loss, (ws, x), (0,))) + 7 * one_trip
    assert prog.baseline.flops == measured

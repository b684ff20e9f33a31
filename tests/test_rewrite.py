"""`jremat.rematerialize`: gradients under a plan equal the unrematerialized gradients.

Each model is tested with a plan from the planner (`jremat.plan` at budget 0.5, or the first
of 0.3, 0.7, 0.9 it plans something for; see `models.reachable_plan`) and with a hand-made plan
(built directly from the traced graph), so the rewrite is checked independently of the planner.
Where jax has `jax_remat3`, every gradient test runs with it off and on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import models as M
import numpy as np
import pytest
from conftest import HAS_REMAT3
from models import (
    BF16_RTOL,
    F32_RTOL,
    assert_trees_close,
    layer_spans,
    names_plan,
    reachable_plan,
    single_node_plan,
    tile_plan,
)

import jremat
from jremat._src.plan.plan import SAVE_NAMES, Plan
from jremat._src.plan.recipes import recipe_plan

#: model -> how to build its hand-made plan from the traced graph. Together these cover every
#: kind of segment the rewrite supports: "nothing_saveable", "names" with and without saved
#: values, built-in policy names, a preset name, per layer and sqrt(n) groups.
HAND_PLANS = {
    "mlp_chain": lambda g: recipe_plan(g, "nothing_saveable", "layers"),
    "decoder": names_plan,
    "unet": lambda g: recipe_plan(g, "dots_saveable", "layers"),
    "scan": lambda g: single_node_plan(g, "scan", "nothing_saveable"),
    "cond": lambda g: recipe_plan(g, "nothing_saveable", "sqrt_n"),
    "custom_vjp": lambda g: recipe_plan(g, "save_expensive", "layers"),  # a preset name
    "dropout": lambda g: tile_plan(g, [(s, e, SAVE_NAMES, []) for s, e in layer_spans(g)]),
    "bf16": lambda g: recipe_plan(g, "dots_with_no_batch_dims_saveable", "layers"),
}
GRAD_MODELS = list(HAND_PLANS)


def hand_plan(cache, name: str) -> Plan:
    m = cache.model(name)
    return HAND_PLANS[name](jremat.trace(m.loss, *m.args))


# -- gradients equal the unrematerialized ones -------------------------------------------------
@pytest.mark.parametrize("kind", ["planned", "hand"])
@pytest.mark.parametrize("name", GRAD_MODELS)
def test_gradients_match(cache, name, kind, remat3):
    m = cache.model(name)
    plan = reachable_plan(cache, name) if kind == "planned" else hand_plan(cache, name)
    if not (kind == "planned" and name == "scan"):
        # (the planner cannot cut inside a scan: that model is one scan node, planned as is)
        assert not plan.is_identity
    f = jremat.rematerialize(m.loss, plan)
    got = jax.jit(jax.grad(f))(*m.args)
    want = cache.ref_grads(name)  # the same computation (f32, or bf16 for "bf16"), no remat
    assert_trees_close(got, want, BF16_RTOL if name == "bf16" else F32_RTOL)


def test_plans_checkpoint_what_they_say(cache):
    """The rewrite really inserts checkpoints: the rematerialized program's jaxpr holds one
    checkpoint (remat) region or tied custom_vjp per checkpointed segment of the plan."""
    m = cache.model("mlp_chain")
    plan = hand_plan(cache, "mlp_chain")
    n_ckpt = sum(s.checkpointed for s in plan.segments)
    assert n_ckpt == 10  # one per layer
    jaxpr = jax.make_jaxpr(jremat.rematerialize(m.loss, plan))(*m.args)
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    regions = sum(
        p in ("checkpoint", "remat", "remat2", "custom_vjp_call", "custom_vjp_call_jaxpr")
        for p in prims
    )
    assert regions == n_ckpt, prims


def test_bf16_gradients_are_bf16_and_close_to_f32(cache):
    """The bf16 comparison is meaningful: remat grads stay bf16 and near the f32 result."""
    m = cache.model("bf16")
    got = jax.jit(jax.grad(jremat.rematerialize(m.loss, hand_plan(cache, "bf16"))))(*m.args)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree_util.tree_leaves(got))
    f32_args = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), m.args)
    f32 = jax.jit(jax.grad(m.loss))(*f32_args)
    # bf16 rounding of 4 residual layers: a few percent of each leaf's scale
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(f32), strict=True):
        w = np.asarray(w)
        assert np.max(np.abs(np.asarray(g, np.float32) - w)) <= 0.1 * np.max(np.abs(w))


@pytest.mark.parametrize("key_kind", ["raw_uint32", "typed"])
def test_dropout_masks_are_recomputed_identically(cache, key_kind, remat3):
    """Recomputed dropout reproduces the forward mask: grads match for several keys, and they
    differ between keys (so the mask does matter)."""
    m = cache.model("dropout")
    params, x, _ = m.args
    mk = jax.random.PRNGKey if key_kind == "raw_uint32" else jax.random.key
    k1, k2 = mk(1), mk(2)
    plan = HAND_PLANS["dropout"](jremat.trace(m.loss, params, x, k1))  # keys change the jaxpr
    f = jax.jit(jax.grad(jremat.rematerialize(m.loss, plan)))
    ref = jax.jit(jax.grad(m.loss))
    g1, g2 = f(params, x, k1), f(params, x, k2)
    assert_trees_close(g1, ref(params, x, k1), F32_RTOL)
    assert_trees_close(g2, ref(params, x, k2), F32_RTOL)
    assert not np.allclose(g1[0]["w1"], g2[0]["w1"])


# -- composition with jit, grad, value_and_grad, vmap ----------------------------------------
def test_value_and_grad_and_jit(cache, remat3):
    m = cache.model("mlp_chain")
    f = jremat.rematerialize(m.loss, reachable_plan(cache, "mlp_chain"))
    v, g = jax.jit(jax.value_and_grad(f))(*m.args)
    v0, g0 = jax.value_and_grad(m.loss)(*m.args)
    np.testing.assert_allclose(v, v0, rtol=F32_RTOL)
    assert_trees_close(g, g0, F32_RTOL)
    # forward alone, jitted and eager; grad of the jitted function
    np.testing.assert_allclose(jax.jit(f)(*m.args), v0, rtol=F32_RTOL)
    np.testing.assert_allclose(f(*m.args), v0, rtol=F32_RTOL)
    assert_trees_close(jax.grad(jax.jit(f))(*m.args), g0, F32_RTOL)


def test_vmap_over_per_example_loss(remat3):
    loss, params, xs = M.per_example_mlp()
    graph = jremat.trace(loss, params, xs[0])
    plan = recipe_plan(graph, "nothing_saveable", "layers")
    assert sum(s.checkpointed for s in plan.segments) == 3
    f = jremat.rematerialize(loss, plan)
    per_ex = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(params, xs)
    want = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, xs)
    assert jax.tree_util.tree_leaves(per_ex)[0].shape[0] == xs.shape[0]
    assert_trees_close(per_ex, want, F32_RTOL)
    # and the grad of a vmapped mean (vmap inside grad), with its value
    mean_f = lambda p, x: jax.vmap(f, in_axes=(None, 0))(p, x).mean()
    mean_l = lambda p, x: jax.vmap(loss, in_axes=(None, 0))(p, x).mean()
    (v, g), (v0, g0) = (jax.jit(jax.value_and_grad(h))(params, xs) for h in (mean_f, mean_l))
    np.testing.assert_allclose(v, v0, rtol=F32_RTOL)
    assert_trees_close(g, g0, F32_RTOL)


def test_pytree_outputs_and_has_aux(cache):
    """Same signature and pytrees: a (loss, aux-dict) function works with has_aux."""
    m = cache.model("mlp_chain")

    def loss_aux(params, x):
        loss = m.loss(params, x)
        return loss, {"loss2": 2.0 * loss, "n": jnp.asarray(x.shape[0])}

    plan = recipe_plan(jremat.trace(loss_aux, *m.args), "nothing_saveable", "layers")
    f = jremat.rematerialize(loss_aux, plan)
    (v, aux), g = jax.jit(jax.value_and_grad(f, has_aux=True))(*m.args)
    (v0, aux0), g0 = jax.value_and_grad(loss_aux, has_aux=True)(*m.args)
    assert set(aux) == {"loss2", "n"} and int(aux["n"]) == m.args[1].shape[0]
    np.testing.assert_allclose(aux["loss2"], aux0["loss2"], rtol=F32_RTOL)
    assert_trees_close(g, g0, F32_RTOL)
    assert f.__name__ == loss_aux.__name__  # functools.wraps


def test_captured_constants_and_argnums_1(remat3):
    """A function closing over an array (a jaxpr constant) and differentiated in argument 1."""
    w_fixed = jax.random.normal(jax.random.key(9), (16, 16)) / 4.0

    def loss(x, params):
        for i, w in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = x + jnp.tanh(x @ w) @ w_fixed
        return jnp.mean(x**2)

    params = [jax.random.normal(jax.random.key(i), (16, 16)) / 4.0 for i in range(3)]
    x = jax.random.normal(jax.random.key(5), (64, 16))
    plan = recipe_plan(jremat.trace(loss, x, params, argnums=1), "nothing_saveable", "layers")
    assert sum(s.checkpointed for s in plan.segments) == 3
    f = jremat.rematerialize(loss, plan)
    assert_trees_close(
        jax.jit(jax.grad(f, argnums=1))(x, params), jax.grad(loss, argnums=1)(x, params), F32_RTOL
    )
    # and with respect to both arguments
    assert_trees_close(
        jax.jit(jax.grad(f, argnums=(0, 1)))(x, params),
        jax.grad(loss, argnums=(0, 1))(x, params),
        F32_RTOL,
    )


def test_prevent_cse_false_is_still_exact(cache):
    m = cache.model("decoder")
    f = jremat.rematerialize(m.loss, hand_plan(cache, "decoder"), prevent_cse=False)
    assert_trees_close(jax.jit(jax.grad(f))(*m.args), cache.ref_grads("decoder"), F32_RTOL)


def test_rematerialize_rejects_non_plans(cache):
    m = cache.model("mlp_chain")
    with pytest.raises(TypeError, match="jremat.Plan"):
        jremat.rematerialize(m.loss, {"segments": []})
    with pytest.raises(TypeError, match="jremat.Plan"):
        jremat.rematerialize(m.loss, reachable_plan(cache, "mlp_chain").to_json())


@pytest.mark.skipif(not HAS_REMAT3, reason="this jax has no jax_remat3 flag")
def test_remat3_fixture_sets_the_flag(remat3):
    assert jax.config.values["jax_remat3"] is remat3


# -- remat_scan's sqrt(L) nesting ---------------------------------------------------------------


def _scan_plan(graph, nest: int, policy: str = "nothing_saveable") -> Plan:
    """The identity plan with every scan of `graph` under `policy`, nested by `nest`."""
    from jremat._src.plan.plan import ScanSetting

    scans = {str(n.index): ScanSetting(policy, nest) for n in graph.nodes if n.primitive == "scan"}
    assert scans, "the model has no scan"
    return Plan.identity(graph, scans=scans)


def _scan_tree(jaxpr) -> list[tuple[int, list]]:
    """The scans of `jaxpr` as `(length, scans inside its body)`, looking through every
    sub-jaxpr (checkpoint, pjit, custom_vjp bodies) that is not a scan's."""
    out = []
    for eqn in jaxpr.eqns:
        subs = []
        for p in eqn.params.values():
            for x in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(x, "jaxpr", x)
                if hasattr(inner, "eqns"):
                    subs.append(inner)
        inside = [t for s in subs for t in _scan_tree(s)]
        if eqn.primitive.name == "scan":
            out.append((int(eqn.params["length"]), inside))
        else:
            out.extend(inside)
    return out


@pytest.mark.parametrize(("length", "nest"), [(16, 4), (16, 2), (9, 3)])
def test_nested_scan_structure_and_gradients(length, nest):
    """The differentiated program runs an outer scan of length / nest whose body holds an
    inner scan of nest steps, and no scan of the full length is left; gradients equal the
    unrematerialized ones."""
    m = M.scan_layers(depth=length, width=8, batch=4)
    graph = jremat.trace(m.loss, *m.args)
    fn = jremat.rematerialize(m.loss, _scan_plan(graph, nest))
    tree = _scan_tree(jax.make_jaxpr(jax.grad(fn))(*m.args).jaxpr)
    assert length not in {n for n, _ in tree}, tree
    nested = [n for n, inner in tree if n == length // nest and nest in {k for k, _ in inner}]
    assert len(nested) >= 2, tree  # the forward loop and the backward loop
    assert_trees_close(jax.grad(fn)(*m.args), jax.grad(m.loss)(*m.args), F32_RTOL)


@pytest.mark.parametrize(
    ("length", "nest", "divisors"), [(18, 4, r"\[2, 3, 6, 9\]"), (7, 2, "prime")]
)
def test_a_nest_that_does_not_divide_the_length_raises(length, nest, divisors):
    """It fell back to an unnested loop silently (every test passed with a wrong nest)."""
    m = M.scan_layers(depth=length, width=8, batch=4)
    fn = jremat.rematerialize(m.loss, _scan_plan(jremat.trace(m.loss, *m.args), nest))
    with pytest.raises(ValueError, match=rf"nest {nest} does not divide .* {length};.*{divisors}"):
        jax.grad(fn)(*m.args)


def test_nested_scan_compiles_to_less_temp_than_unnested():
    """On a 64-step scan, nest 8 (sqrt L) stores 8 carries and one chunk's in the backward
    pass instead of 64: less compiled temp than nest 1 under the same body policy (measured
    0.56x on jax 0.10), the same gradients."""
    from jremat._src.compile.program import Program

    m = M.scan_layers(depth=64, width=32, batch=128)
    prog = Program(m.loss, m.args, 0)
    temps = {k: prog.compile(_scan_plan(prog.graph, k)).temp_bytes for k in (1, 8)}
    assert temps[8] < 0.7 * temps[1], temps
    got = jax.grad(jremat.rematerialize(m.loss, _scan_plan(prog.graph, 8)))(*m.args)
    assert_trees_close(got, jax.grad(m.loss)(*m.args), F32_RTOL)


def test_a_scan_setting_for_the_loops_inside_runs_exact_and_round_trips():
    """`ScanSetting.inner`: the loops nested in a loop's body run their bodies checkpointed
    (the outer body kept or checkpointed too); gradients are the unrematerialized ones, the
    setting survives JSON, and the forms it does not apply to are refused by name."""
    import chex

    from jremat._src.plan.plan import ScanPiece, ScanSetting

    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
    x = jax.random.normal(jax.random.key(1), (256, 64))

    def run(w, c):  # the inner loop: a step while its index is below 2
        def inner(c, i):
            return jax.lax.cond(i < 2, lambda c: jnp.tanh(c @ w), lambda c: c, c), None

        return jax.lax.scan(inner, c, jnp.arange(3))[0]

    def nested(w, x):  # the inner loop in the outer body
        return jnp.mean(jax.lax.scan(lambda c, _: (run(w, c), None), x, None, length=4)[0] ** 2)

    def in_branch(w, x):  # the inner loop in a cond branch of the outer body
        def outer(c, _):
            return jax.lax.cond(c.sum() > -1e9, lambda c: run(w, c), lambda c: 0.5 * c, c), None

        return jnp.mean(jax.lax.scan(outer, x, None, length=4)[0] ** 2)

    for loss in (nested, in_branch):
        graph = jremat.trace(loss, w, x)
        (node,) = [n for n in graph.nodes if n.primitive == "scan"]
        want = jax.grad(loss)(w, x)
        plain = jax.jit(jax.grad(loss)).lower(w, x).compile().memory_analysis().temp_size_in_bytes
        for policy in ("keep", "nothing_saveable"):
            plan = jremat.Plan.identity(graph)
            plan.scans = {str(node.index): ScanSetting(policy, 1, inner="nothing_saveable")}
            again = jremat.Plan.from_json(plan.to_json())
            assert again.scans == plan.scans and "loops inside" in plan.summary()
            step = jax.jit(jax.grad(jremat.rematerialize(loss, again)))
            chex.assert_trees_all_close(step(w, x), want, rtol=1e-5, atol=1e-7)
            # the nested loops' residuals are gone: not a setting that changes nothing
            assert step.lower(w, x).compile().memory_analysis().temp_size_in_bytes < plain
    flat = jremat.trace(lambda w, x: jnp.mean(run(w, x) ** 2), w, x)
    (node,) = [n for n in flat.nodes if n.primitive == "scan"]
    plan = jremat.Plan.identity(flat)
    plan.scans = {str(node.index): ScanSetting("keep", 1, inner="nothing_saveable")}
    with pytest.raises(ValueError, match="runs no loop"):  # a no-op is refused, not run
        jax.grad(jremat.rematerialize(lambda w, x: jnp.mean(run(w, x) ** 2), plan))(w, x)
    with pytest.raises(ValueError, match=r"inner: unknown policy 'keep'"):
        ScanSetting("nothing_saveable", 1, inner="keep")
    with pytest.raises(ValueError, match="inner does not apply"):
        ScanSetting(pieces=(ScanPiece(2, "nothing_saveable"),), inner="nothing_saveable")

"""Extended dtypes through tracing, planning, the rewrite and the plan cache: typed PRNG keys
(`jax.random.key`, dtype `key<fry>`) and legacy uint32 keys (`jax.random.PRNGKey`), Flax RNG
streams (linen `rngs=`, `nnx.Rngs`), integer leaves with float0 cotangents; and programs
traced inside `checkify.checkify`.

Gradients are compared with the unrematerialized program's (rtol 1e-5, f32). The suite's 8 host
devices stand in for a GPU node: unsharded arguments under `jax.jit` need no `in_shardings`.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental import checkify
from test_flax_nnx import Model as NnxModel  # two blocks and a head

import jremat
from jremat._src.base import compat as _compat
from jremat._src.plan.plan import SAVE_NAMES, Plan, Segment
from jremat._src.plan.rewrite import drop_unkept_names, segment_io
from jremat._src.training.accumulation import state_bytes

KEY_MAKERS = {"typed": jax.random.key, "legacy": jax.random.PRNGKey}
LAYERS, WIDTH = 8, 64
WS = [jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) * 0.1 for i in range(LAYERS)]
X = jax.random.normal(jax.random.key(9), (128, WIDTH))


def dropout_loss(ws, x, key):
    """Per-layer dropout masks drawn from `key` (typed or legacy): tanh MLP, scalar loss."""
    for i, w in enumerate(ws):
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, x.shape)
        x = jnp.tanh(x @ w) * keep / 0.8
    return jnp.mean(x**2)


def scan_loss(ws, x, key):
    """The layers in a `lax.scan` whose body draws its mask and applies `jax.nn.relu` (a
    `custom_jvp`: `check_replayable` probes the program, with the key among its avals)."""

    def body(c, wi):
        w, i = wi
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, c.shape)
        return jax.nn.relu(c @ w) * keep, None

    y, _ = jax.lax.scan(body, x, (ws, jnp.arange(ws.shape[0])))
    return jnp.mean(y**2)


def assert_close(got, want):
    """`chex.assert_trees_all_close` at rtol 1e-5 and atol 1e-5 of the largest entry of
    `want` (f32 noise on entries near 0 has no relative scale of its own)."""
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5 * scale)


def _only_plan(wrapped) -> Plan:
    (p,) = wrapped.plans.values()
    return p


# -- units: bytes, avals, the plan's names ------------------------------------------------------
def test_key_dtypes_have_their_key_data_bytes_and_build_avals():
    typed, rbg = jax.random.key(0).dtype, jax.random.key(0, impl="rbg").dtype
    assert _compat.is_extended_dtype(typed) and not _compat.is_extended_dtype(jnp.uint32)
    assert _compat.dtype_itemsize(typed) == jax.random.key_data(jax.random.key(0)).nbytes == 8
    assert _compat.dtype_itemsize(rbg) == 16
    assert _compat.dtype_itemsize(jax.dtypes.float0) == 0
    assert _compat.dtype_itemsize(jnp.bfloat16) == 2
    assert _compat.aval_nbytes(jax.ShapeDtypeStruct((3, 4), typed)) == 96
    keys = jax.random.split(jax.random.key(1), 5)
    assert state_bytes({"keys": keys, "w": jnp.zeros(3)}) == 5 * 8 + 12

    g = jremat.trace(dropout_loss, WS, X, jax.random.key(3))
    (key_id,) = [v for v in g.invars if g.values[v].dtype == "key<fry>"]
    value = g.values[key_id]
    assert value.nbytes == 8 and not value.is_float
    assert value.struct == jax.ShapeDtypeStruct((), typed)


def test_drop_unkept_names_traces_a_segment_with_a_key_live_in():
    """A names segment whose live-in values include the key is traced on its own from the
    graph's avals (it failed with "data type 'key<fry>' not understood")."""
    g = jremat.trace(dropout_loss, WS, X, jax.random.key(3))
    (key_id,) = [v for v in g.invars if g.values[v].dtype == "key<fry>"]
    first_dot = next(n.index for n in g.nodes if n.primitive == "dot_general")
    end = next(n.index for n in g.nodes[first_dot + 1 :] if n.primitive == "dot_general")
    inside = [v for n in g.nodes[:end] for v in n.outputs if g.values[v].is_float]
    seg = Segment(0, end, SAVE_NAMES, saved=list(inside))
    p = Plan([seg, Segment(end, g.num_nodes, "keep")], g.fingerprint, g.num_nodes)
    assert key_id in segment_io(g, seg)[0]
    drop_unkept_names(g, p)
    assert 0 < len(p.segments[0].saved) < len(inside)  # the ones the backward pass reads


# -- a plain loss taking a key -------------------------------------------------------------------
#: One plan cache for both variants of the dropout test: the first to run solves each key kind's
#: plan, the other loads it (the suite's slowest planning; the solve's own path is tested by
#: whichever variant runs first, and by the tests below with a fresh cache).
_KEY_PLAN_DIR = tempfile.mkdtemp(prefix="jremat-test-keys-")
atexit.register(shutil.rmtree, _KEY_PLAN_DIR, True)


class KeyLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_dropout_loss_gradients_equal_and_temp_within_budget(self):
        for make in KEY_MAKERS.values():  # typed, then legacy uint32 keys: planned apart
            key = make(3)
            wrapped = jremat.auto(dropout_loss, budget=0.8, plan_dir=_KEY_PLAN_DIR)
            grads = self.variant(jax.grad(wrapped))(WS, X, key)
            assert_close(grads, jax.grad(dropout_loss)(WS, X, key))
            p = _only_plan(wrapped)
            assert not p.is_identity
            assert p.measured_temp_bytes <= p.budget_temp_bytes

    @chex.variants(with_jit=True, without_jit=True)
    def test_scan_with_custom_jvp_and_a_key(self):
        ws = jnp.stack(WS[:6])
        key = jax.random.key(4)
        wrapped = jremat.auto(scan_loss, budget=0.8)
        grads = self.variant(jax.grad(wrapped))(ws, X, key)
        assert_close(grads, jax.grad(scan_loss)(ws, X, key))
        p = _only_plan(wrapped)
        assert p.measured_temp_bytes <= p.budget_temp_bytes


def _residual_mlp_with_dropout(p, x, key):
    for i, (w1, w2) in enumerate(p):
        h = jnp.tanh(x @ w1)
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.9, h.shape)
        x = x + jnp.where(keep, h / 0.9, 0) @ w2
    return jnp.mean(x**2)


# each caller and each key kind, once (not their product: each case is a full search of 60-80
# s here, most of it the MILP's presolve; the other key tests cover both kinds too)
@pytest.mark.parametrize(
    ("caller", "kind"), [("fold_in", "typed"), ("split per example", "legacy")]
)
def test_a_key_computed_in_the_callers_jit_keeps_the_budget(caller, kind):
    """The dropout key computed inside the caller's jit (`fold_in` of a step key; `split` into
    per-example keys for `vmap(grad)`), as a training step does: on jax 0.10 the tied
    recompute left integer and key residuals untied, so XLA drew the masks before the
    cotangent, merged with the forward pass (1.04x and 1.06x the unrematerialized step's temp
    at budget 0.7). The step that runs meets the budget; gradients exact."""
    k = jax.random.split(jax.random.key(0), 9)
    p = [(jax.random.normal(k[i], (32, 128)) / 6, jax.random.normal(k[i + 4], (128, 32)) / 11)
         for i in range(4)]  # fmt: skip
    x = jax.random.normal(k[8], (4, 256, 32))
    key = KEY_MAKERS[kind](1)
    budget = 0.7

    def step(loss):
        def run(p, x, key):
            if caller == "fold_in":
                return jax.grad(loss)(p, x.reshape(-1, 32), jax.random.fold_in(key, 3))
            keys = jax.random.split(key, x.shape[0])
            return jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, keys)

        return jax.jit(run)

    f = jremat.auto(_residual_mlp_with_dropout, budget=budget, plan_dir=False)
    got = step(f)(p, x, key)
    want = step(_residual_mlp_with_dropout)(p, x, key)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)

    def temp(loss):
        return step(loss).lower(p, x, key).compile().memory_analysis().temp_size_in_bytes

    assert temp(f) <= budget * temp(_residual_mlp_with_dropout)


@pytest.mark.parametrize("kind", list(KEY_MAKERS))
def test_plan_cache_round_trip_with_a_key_argument(tmp_path, kind):
    key = KEY_MAKERS[kind](3)
    first = jremat.auto(dropout_loss, budget=0.8, plan_dir=tmp_path)
    want = jax.grad(first)(WS, X, key)
    assert first.plan_cache.solves == 1 and len(list(tmp_path.glob("jremat-*.json"))) == 1
    (sig,) = first.plan_cache.signatures.values()
    assert ("key<fry>[]" if kind == "typed" else "uint32[2]") in sig
    second = jremat.auto(dropout_loss, budget=0.8, plan_dir=tmp_path)  # a "new run"
    got = jax.grad(second)(WS, X, key)
    assert second.plan_cache.loads == 1 and second.plan_cache.solves == 0
    assert _only_plan(second).segments == _only_plan(first).segments
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert_close(got, jax.grad(dropout_loss)(WS, X, key))


# -- integer leaves: float0 cotangents -----------------------------------------------------------
def int_leaf_loss(p, x):
    for w in p["ws"]:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2) * p["scale"].astype(jnp.float32)


PARAMS = {"ws": WS, "scale": jnp.int32(3)}


class IntLeafTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grad_allow_int_gives_float0_and_equal_gradients(self):
        wrapped = jremat.auto(int_leaf_loss, budget=0.8)
        got = self.variant(jax.grad(wrapped, allow_int=True))(PARAMS, X)
        want = jax.grad(int_leaf_loss, allow_int=True)(PARAMS, X)
        assert got["scale"].dtype == jax.dtypes.float0
        assert_close(got["ws"], want["ws"])
        p = _only_plan(wrapped)
        assert not p.is_identity and p.measured_temp_bytes <= p.budget_temp_bytes

    def test_vjp_with_an_int_leaf(self):
        wrapped = jremat.auto(int_leaf_loss, budget=0.8)
        out, pullback = jax.vjp(wrapped, PARAMS, X)
        out0, pullback0 = jax.vjp(int_leaf_loss, PARAMS, X)
        (gp, gx), (gp0, gx0) = pullback(jnp.float32(1.0)), pullback0(jnp.float32(1.0))
        assert gp["scale"].dtype == jax.dtypes.float0
        assert_close(out, out0)
        assert_close(gp["ws"], gp0["ws"])
        assert_close(gx, gx0)


# -- checkify ------------------------------------------------------------------------------------
def checked_loss(ws, x):
    checkify.check(jnp.all(jnp.isfinite(x)), "x has a non-finite entry")
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


class CheckifyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_checkify_around_an_auto_loss(self):
        wrapped = jremat.auto(checked_loss, budget=0.8)
        step = self.variant(checkify.checkify(jax.grad(wrapped)))
        err, grads = step(WS, X)
        assert err.get() is None
        assert_close(grads, jax.grad(checked_loss)(WS, X))
        p = _only_plan(wrapped)
        assert not p.is_identity and p.measured_temp_bytes <= p.budget_temp_bytes
        err, _ = step(WS, X.at[0, 0].set(jnp.nan))
        assert "x has a non-finite entry" in err.get()
        assert len(wrapped.plans) == 1


# -- nothing to rematerialize --------------------------------------------------------------------
def forward_only_loop(x):
    """A `while_loop` with a dynamic trip count: JAX builds no reverse derivative."""
    n = jnp.sum(x > 0).astype(jnp.int32) % 4
    y, _ = jax.lax.while_loop(lambda c: c[1] < n, lambda c: (jnp.sin(c[0]), c[1] + 1), (x, 0))
    return jnp.sum(y)


@pytest.mark.parametrize(
    "fn, arg",
    [(lambda s: s, jnp.float32(2.0)), (forward_only_loop, X)],
    ids=["no-equations", "forward-only-while"],
)
def test_nothing_to_rematerialize_raises_infeasible_budget_error(fn, arg):
    with pytest.raises(jremat.InfeasibleBudgetError, match="budget=1.0") as info:
        jremat.plan(fn, arg, budget=0.5)
    assert info.value.budget == 0.5 and info.value.smallest_reachable == 1.0


def test_forward_only_while_runs_unchanged_at_budget_one():
    p = jremat.plan(forward_only_loop, X, budget=1.0)
    assert p.is_identity and "no reverse derivative" in " ".join(p.notes)
    wrapped = jremat.auto(forward_only_loop, budget=0.5)
    with pytest.raises(jremat.InfeasibleBudgetError):
        jax.jvp(wrapped, (X,), (jnp.ones_like(X),))
    # a byte budget cannot be checked without a backward step to compile: said so
    with pytest.raises(ValueError, match=r"byte budget cannot be checked.*budget=1\.0") as e:
        jremat.plan(forward_only_loop, X, budget="64MiB")
    assert not isinstance(e.value, jremat.InfeasibleBudgetError)


# -- Flax ----------------------------------------------------------------------------------------
class LinenBlock(nn.Module):
    """x + BN(Dense(dropout(gelu(Dense(LN(x)))))); (B, D) -> (B, D); `train` static."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(32)(nn.LayerNorm()(x))
        h = nn.Dropout(0.2, deterministic=not train)(nn.gelu(h))
        h = nn.Dense(x.shape[-1])(h)
        return x + nn.BatchNorm(use_running_average=not train, momentum=0.8)(h)


LINEN_AUTO = jremat.auto(LinenBlock, budget=0.4, static_argnums=(2,), max_rounds=1)


class LinenModel(nn.Module):
    block: type = LinenBlock

    @nn.compact
    def __call__(self, x, train: bool = True):
        for i in range(2):
            x = self.block(name=f"block{i}")(x, train)
        return nn.Dense(4)(x)


@pytest.mark.parametrize("kind", list(KEY_MAKERS))
def test_linen_dropout_batchnorm_under_jit_with_keys(kind):
    make = KEY_MAKERS[kind]
    x = X[:, :16]
    variables = LinenModel().init({"params": make(0), "dropout": make(1)}, x)

    def run(model):
        def loss(params, stats):
            y, upd = model.apply(
                {"params": params, "batch_stats": stats},
                x,
                True,
                rngs={"dropout": make(3)},
                mutable=["batch_stats"],
            )
            return jnp.mean(y**2), upd["batch_stats"]

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        return step(variables["params"], variables["batch_stats"])

    (loss, stats), grads = run(LinenModel(LINEN_AUTO))
    (loss0, stats0), grads0 = run(LinenModel())
    assert_close(loss, loss0)
    assert_close(stats, stats0)
    assert_close(grads, grads0)
    planned = [p for p in LINEN_AUTO.plan_cache.plans.values() if not p.is_identity]
    assert planned and all(p.measured_temp_bytes <= p.budget_temp_bytes for p in planned)


class NnxBlock(nnx.Module):
    """x + BN(Linear(dropout(gelu(Linear(x))))); (B, D) -> (B, D)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up = nnx.Linear(d, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.down = nnx.Linear(64, d, rngs=rngs)
        self.bn = nnx.BatchNorm(d, momentum=0.8, rngs=rngs)

    def __call__(self, x):
        return x + self.bn(self.down(self.drop(nnx.gelu(self.up(x)))))


NNX_AUTO = jremat.auto(NnxBlock, budget=0.4, max_rounds=1)


@pytest.mark.parametrize("kind", list(KEY_MAKERS))
def test_nnx_dropout_under_jit_with_key_streams(kind):
    make = KEY_MAKERS[kind]
    x = X[:, :16]

    def run(block):
        model = NnxModel(block, nnx.Rngs(params=make(0), dropout=make(5)))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            opt.update(model, grads)
            return loss, grads

        out = [step(model, opt) for _ in range(2)]
        return out, nnx.state(model)

    got, state = run(NNX_AUTO)
    want, state0 = run(NnxBlock)
    for (loss, grads), (loss0, grads0) in zip(got, want, strict=True):
        assert_close(loss, loss0)
        assert_close(grads, grads0)
    # the same parameters, batch statistics and RNG streams (counts and keys) after two steps
    leaves, leaves0 = jax.tree.leaves(state), jax.tree.leaves(state0)
    assert jax.tree.structure(state) == jax.tree.structure(state0)
    for a, b in zip(leaves, leaves0, strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # the streams' keys
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)
    planned = [p for p in NNX_AUTO.plan_cache.plans.values() if not p.is_identity]
    assert planned and all(p.measured_temp_bytes <= p.budget_temp_bytes for p in planned)


def complex_loss(w, x):
    """Three spectral-style layers: a complex matmul between real ones (FNO, complex SSMs)."""
    for _ in range(3):
        z = jnp.exp(1j * (x @ w)) @ w.astype(jnp.complex64)
        x = x + jnp.tanh(jnp.real(z))
    return jnp.mean(x**2)


def complex_scan_loss(ws, x):
    """`complex_loss`'s layers as the body of a `lax.scan` (loop settings of JAX's policies)."""

    def body(c, w):
        z = jnp.exp(1j * (c @ w)) @ w.astype(jnp.complex64)
        return c + jnp.tanh(jnp.real(z)), None

    y, _ = jax.lax.scan(body, x, ws)
    return jnp.mean(y**2)


@pytest.mark.parametrize(
    "loss, w, solver",
    [
        (complex_loss, WS[0], "auto"),
        (complex_loss, WS[0], "greedy"),
        (complex_scan_loss, jnp.stack(WS[:6]), "auto"),
    ],
    ids=["unrolled-auto", "unrolled-greedy", "scan-auto"],
)
def test_complex_values_are_recomputed_and_plans_meet_the_budget(loss, w, solver):
    """JAX's remat cannot save a complex residual by policy (`dots_saveable` on a complex
    matmul, or a complex value saved by name, raise in `reduce_precision`): every candidate
    and the plan recompute complex values, the plan meets its budget, gradients are exact."""
    plan = jremat.plan(loss, w, X, budget=0.8, solver=solver)
    assert plan.measured_temp_bytes <= plan.budget_temp_bytes
    assert plan.measured_temp_bytes < plan.baseline_temp_bytes
    graph = jremat.trace(loss, w, X)
    assert all(graph.values[v].saveable for seg in plan.segments for v in seg.saved)
    want = jax.grad(loss, argnums=(0, 1))(w, X)
    got = jax.jit(jax.grad(jremat.rematerialize(loss, plan), argnums=(0, 1)))(w, X)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_and_transcendentals_saveable"])
def test_builtin_policies_per_layer_run_on_complex_matmuls(policy):
    """A recipe of JAX's policies per layer saves no complex matmul (JAX would raise)."""
    from jremat._src.plan.recipes import recipe_plan

    w, x = WS[0], X
    plan = recipe_plan(jremat.trace(complex_loss, w, x), policy)
    assert any(seg.checkpointed for seg in plan.segments)
    want = jax.grad(complex_loss)(w, x)
    got = jax.jit(jax.grad(jremat.rematerialize(complex_loss, plan)))(w, x)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

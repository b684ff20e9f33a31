"""Tiny plain-JAX models shared by the jremat core tests.

Every model is a `Model(name, loss, params, x, argnums)`: `loss(params, x, ...) -> scalar f32`
(or bf16 for the bf16 model) with `params` differentiated (argnums=0). Sizes are chosen so that
each `jit(value_and_grad(loss))` compiles in well under a second on a shared CPU, while
activations (batch large relative to width) still dominate XLA's temp bytes so budgets below
1.0 are reachable. Layers are written under `jax.named_scope("layer_<i>")` (or `down_<i>` /
`up_<i>`) so `recipe_plan(graph, ..., "layers")` finds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jremat
from jremat._src.compile.xla import MemoryFigures
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment
from jremat._src.plan.recipes import recipe_plan

#: The planner the core issue specifies (`jremat.plan(..., solver="chain")`). The tests pin it
#: so that their runtime and figures do not depend on what a default solver picks.
SOLVER = "chain"


@dataclasses.dataclass
class Model:
    name: str
    loss: Callable[..., Any]
    args: tuple  # (params, x, ...) positional arguments of `loss`

    @property
    def params(self):
        return self.args[0]


def _normal(key, shape, scale, dtype=jnp.float32):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _rmsnorm(x):
    # RMSNorm rather than LayerNorm: same role, noticeably cheaper for XLA:CPU to compile.
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-5)).astype(x.dtype)


# -- residual MLP chain -----------------------------------------------------------------------
def mlp_chain(
    depth: int = 10, width: int = 8, batch: int = 512, mult: int = 8, dtype=jnp.float32
) -> Model:
    """x <- x + W2 tanh(W1 rmsnorm(x)) per layer (hidden width `mult * width`); loss mean(x^2)."""
    keys = jax.random.split(jax.random.key(0), 2 * depth + 1)
    params = [
        {
            "w1": _normal(keys[2 * i], (width, mult * width), width**-0.5, dtype),
            "w2": _normal(keys[2 * i + 1], (mult * width, width), (mult * width) ** -0.5, dtype),
        }
        for i in range(depth)
    ]
    x = _normal(keys[-1], (batch, width), 1.0, dtype)

    def loss(params, x):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = x + jnp.tanh(_rmsnorm(x) @ p["w1"]) @ p["w2"]
        return jnp.mean(x.astype(jnp.float32) ** 2)

    return Model("mlp_chain", loss, (params, x))


# -- transformer decoder with causal attention ------------------------------------------------
def decoder(
    depth: int = 5,
    d: int = 16,
    heads: int = 4,
    seq: int = 64,
    batch: int = 8,
    vocab: int = 32,
    mult: int = 2,
) -> Model:
    """Pre-norm decoder: causal multi-head self-attention + GELU MLP per layer; next-token
    cross-entropy. Tokens are embedded (and targets scored) through one-hot matmuls."""
    k = iter(jax.random.split(jax.random.key(1), 4 * depth + 4))
    params = {
        "embed": _normal(next(k), (vocab, d), 0.5),
        "pos": _normal(next(k), (seq, d), 0.5),
        "layers": [
            {
                "wqkv": _normal(next(k), (d, 3 * d), d**-0.5),
                "wo": _normal(next(k), (d, d), d**-0.5),
                "w1": _normal(next(k), (d, mult * d), d**-0.5),
                "w2": _normal(next(k), (mult * d, d), (mult * d) ** -0.5),
            }
            for _ in range(depth)
        ],
        "head": _normal(next(k), (d, vocab), d**-0.5),
    }
    tokens = jax.random.randint(next(k), (batch, seq + 1), 0, vocab)

    def loss(params, tokens):
        onehot = jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)
        h = onehot[:, :-1] @ params["embed"] + params["pos"]
        b, t, _ = h.shape
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i, p in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                q, kk, v = jnp.split(_rmsnorm(h) @ p["wqkv"], 3, axis=-1)
                q, kk, v = (z.reshape(b, t, heads, d // heads) for z in (q, kk, v))
                s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(d // heads)
                s = jnp.where(causal, s, -1e9)
                a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
                h = h + a @ p["wo"]
                h = h + jax.nn.gelu(_rmsnorm(h) @ p["w1"]) @ p["w2"]
        logp = jax.nn.log_softmax(_rmsnorm(h) @ params["head"], -1)
        return -jnp.mean(jnp.sum(logp * onehot[:, 1:], -1))

    return Model("decoder", loss, (params, tokens))


# -- U-Net-like conv net with long skip connections -------------------------------------------
def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def unet(depth: int = 2, channels: int = 2, size: int = 32, batch: int = 4) -> Model:
    """`depth` conv+pool down blocks, then upsample+concat(skip)+conv blocks, 1x1 head."""
    key = jax.random.key(2)
    down, up, c = [], [], 3
    for i in range(depth):
        down.append(_normal(jax.random.fold_in(key, i), (3, 3, c, channels * 2**i), 0.2))
        c = channels * 2**i
    for i in reversed(range(depth)):
        cin = c + channels * 2**i
        up.append(_normal(jax.random.fold_in(key, 100 + i), (3, 3, cin, channels * 2**i), 0.2))
        c = channels * 2**i
    params = {
        "down": down,
        "up": up,
        "head": _normal(jax.random.fold_in(key, 999), (1, 1, c, 3), 0.2),
    }
    x = _normal(jax.random.fold_in(key, 7), (batch, size, size, 3), 1.0)

    def loss(params, x):
        skips, h = [], x
        for i, w in enumerate(params["down"]):
            with jax.named_scope(f"down_{i}"):
                h = jax.nn.relu(_conv(h, w))
                skips.append(h)
                h = jax.lax.reduce_window(
                    h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
                )
        for i, w in enumerate(params["up"]):
            with jax.named_scope(f"up_{i}"):
                skip = skips.pop()
                h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
                h = jax.nn.relu(_conv(jnp.concatenate([h, skip], -1), w))
        out = _conv(h, params["head"])
        return jnp.mean((out - x) ** 2)

    return Model("unet", loss, (params, x))


# -- lax.scan over layers ---------------------------------------------------------------------
def scan_layers(depth: int = 4, width: int = 32, batch: int = 128, unroll: bool = False) -> Model:
    """The MLP chain with stacked weights and `lax.scan` over the layers (or a Python loop
    over the same stacked weights when `unroll=True`: the same arithmetic, unrolled)."""
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {
        "w1": _normal(k1, (depth, width, 2 * width), width**-0.5),
        "w2": _normal(k2, (depth, 2 * width, width), (2 * width) ** -0.5),
    }
    x = _normal(k3, (batch, width), 1.0)

    def layer(x, p):
        return x + jnp.tanh(_rmsnorm(x) @ p["w1"]) @ p["w2"]

    def loss(params, x):
        if unroll:
            for i in range(depth):
                x = layer(x, jax.tree_util.tree_map(lambda a, i=i: a[i], params))
        else:
            x, _ = jax.lax.scan(lambda c, p: (layer(c, p), None), x, params)
        return jnp.mean(x**2)

    return Model("scan_unrolled" if unroll else "scan", loss, (params, x))


# -- lax.cond ---------------------------------------------------------------------------------
def cond_model(depth: int = 3, width: int = 32, batch: int = 128) -> Model:
    """Per layer, `lax.cond` on a data-dependent predicate chooses between two branches."""
    keys = jax.random.split(jax.random.key(4), 2 * depth + 1)
    params = [
        {
            "a": _normal(keys[2 * i], (width, width), width**-0.5),
            "b": _normal(keys[2 * i + 1], (width, width), width**-0.5),
        }
        for i in range(depth)
    ]
    x = _normal(keys[-1], (batch, width), 1.0)

    def loss(params, x):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                h = jax.lax.cond(
                    (x.mean() > 0) ^ (i % 2 == 1),  # both branches are taken across layers
                    lambda x, p: jnp.tanh(x @ p["a"]) @ p["b"],
                    lambda x, p: jnp.sin(x @ p["b"]) * (x @ p["a"]),
                    x,
                    p,
                )
                x = x + h
        return jnp.mean(x**2)

    return Model("cond", loss, (params, x))


# -- jax.custom_vjp ---------------------------------------------------------------------------
@jax.custom_vjp
def scaled_softplus(x, w):
    """softplus(x * w) with a hand-written (correct) VJP."""
    return jax.nn.softplus(x * w)


def _ssp_fwd(x, w):
    return jax.nn.softplus(x * w), (x, w)


def _ssp_bwd(res, g):
    x, w = res
    s = jax.nn.sigmoid(x * w) * g
    return s * w, (s * x).sum(0)


scaled_softplus.defvjp(_ssp_fwd, _ssp_bwd)


def custom_vjp_model(depth: int = 3, width: int = 32, batch: int = 128) -> Model:
    keys = jax.random.split(jax.random.key(5), 2 * depth + 1)
    params = [
        {
            "w": _normal(keys[2 * i], (width, width), width**-0.5),
            "s": 1.0 + _normal(keys[2 * i + 1], (width,), 0.1),
        }
        for i in range(depth)
    ]
    x = _normal(keys[-1], (batch, width), 1.0)

    def loss(params, x):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                x = x + scaled_softplus(_rmsnorm(x) @ p["w"], p["s"])
        return jnp.mean(x**2)

    return Model("custom_vjp", loss, (params, x))


# -- dropout from a key argument --------------------------------------------------------------
def dropout_model(depth: int = 3, width: int = 32, batch: int = 128, rate: float = 0.3) -> Model:
    """The MLP chain with dropout after each hidden activation; `loss(params, x, key)`."""
    m = mlp_chain(depth, width, batch)
    params, x = m.args

    def loss(params, x, key):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                h = jnp.tanh(_rmsnorm(x) @ p["w1"])
                keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, h.shape)
                h = jnp.where(keep, h / (1.0 - rate), 0.0)
                x = x + h @ p["w2"]
        return jnp.mean(x**2)

    return Model("dropout", loss, (params, x, jax.random.key(42)))


# -- bf16 activations -------------------------------------------------------------------------
def bf16_chain(depth: int = 4, width: int = 32, batch: int = 256) -> Model:
    """The MLP chain with bf16 parameters and activations (f32 loss reduction)."""
    m = mlp_chain(depth, width, batch, dtype=jnp.bfloat16)
    return Model("bf16", m.loss, m.args)


# -- a per-example loss for vmap -------------------------------------------------------------
def per_example_mlp(depth: int = 3, width: int = 16) -> tuple[Callable, Any, Any]:
    """(loss(params, x_row) -> scalar, params, xs[batch, width]) for vmap over examples."""
    m = mlp_chain(depth, width, batch=32)
    params, xs = m.args

    def loss(params, x_row):
        return m.loss(params, x_row[None])

    return loss, params, xs


ALL_GRAD_MODELS: dict[str, Callable[[], Model]] = {
    "mlp_chain": mlp_chain,
    "decoder": decoder,
    "unet": unet,
    "scan": scan_layers,
    "cond": cond_model,
    "custom_vjp": custom_vjp_model,
    "dropout": dropout_model,
}


#: Every model by name (constructors with the default, test-sized arguments).
MODELS: dict[str, Callable[[], Model]] = {
    **ALL_GRAD_MODELS,
    "bf16": bf16_chain,
    "scan_unrolled": lambda: scan_layers(unroll=True),
}


# -- test helpers: comparisons and hand-made plans ----------------------------------------------
F32_RTOL = 1e-5
BF16_RTOL = 2e-2  # a few bf16 ulps (bf16 has an 8-bit mantissa: 1 ulp ~ 4e-3 relative)


def assert_trees_close(got, want, rtol):
    """Per leaf: |got - want| <= rtol * |want| + rtol * max|want| (relative to the leaf)."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.isfinite(g32))
        scale = float(np.max(np.abs(w32)))
        assert scale > 0, "degenerate test: a zero gradient leaf"
        np.testing.assert_allclose(g32, w32, rtol=rtol, atol=rtol * scale)


def compiled_step(step, *args) -> tuple[Any, int]:
    """(`step`, a jitted function, compiled at `args`; its compiled temp bytes): the
    executable measured is the one a test runs (a new `jax.jit` of the same step, as a test
    that builds its step again calls, compiles again)."""
    exe = step.lower(*args).compile()
    return exe, MemoryFigures.of(exe).temp_bytes


# -- hand-made plans ----------------------------------------------------------------------------
def reachable_plan(cache, name: str) -> Plan:
    """A planner plan for model `name`, for the rewrite tests.

    The first `jremat.plan(budget=b, verify=False)` plan that checkpoints something, for b in
    0.5, 0.3, 0.7, 0.9 (the rewrite's correctness does not depend on how a plan was chosen, and
    unverified plans cost no compiles but the baseline); an identity plan when that is all the
    planner makes (a model that is one scan node). Else the verified plan at 0.5, or at the
    smallest budget the planner states as reachable. (Verified plans' gradients are checked
    by the `jremat.auto` and JSON round-trip tests.)
    """
    identity = None
    for b in (0.5, 0.3, 0.7, 0.9):
        p = cache.plan(name, b, verify=False)
        if isinstance(p, Plan) and not p.is_identity:
            return p
        identity = p if isinstance(p, Plan) else identity
    if identity is not None:
        return identity
    p = cache.plan(name, 0.5)
    if isinstance(p, jremat.InfeasibleBudgetError):
        assert 0.5 < p.smallest_reachable <= 1.0
        p = cache.plan(name, p.smallest_reachable)
        assert not isinstance(p, Exception), f"stated smallest budget is infeasible: {p}"
    return p


def layer_spans(graph):
    """`[start, end)` of each layer, as `recipe_plan` finds them from the name stacks."""
    segs = recipe_plan(graph, "nothing_saveable", "layers").segments
    return [(s.start, s.end) for s in segs if s.checkpointed]


def tile_plan(graph, spans_policies):
    """Segments for `[(start, end, policy, saved)]`, with kept glue between them."""
    segs, pos = [], 0
    for s, e, policy, saved in spans_policies:
        if s > pos:
            segs.append(Segment(pos, s, KEEP))
        segs.append(Segment(s, e, policy, list(saved)))
        pos = e
    if pos < graph.num_nodes:
        segs.append(Segment(pos, graph.num_nodes, KEEP))
    p = Plan(segs, graph.fingerprint, graph.num_nodes, solver="hand")
    p.validate()
    return p


def names_plan(graph, prims=("dot_general",)):
    """Per layer: checkpoint saving (by checkpoint_name) the outputs of `prims` in the layer."""
    spans = []
    for s, e in layer_spans(graph):
        saved = [o for n in graph.nodes[s:e] if n.primitive in prims for o in n.outputs]
        assert saved
        spans.append((s, e, SAVE_NAMES, saved))
    return tile_plan(graph, spans)


def single_node_plan(graph, primitive: str, policy: str):
    """Checkpoint only the (first) node running `primitive` (a scan, say)."""
    i = next(n.index for n in graph.nodes if n.primitive == primitive)
    return tile_plan(graph, [(i, i + 1, policy, [])])

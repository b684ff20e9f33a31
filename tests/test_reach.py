"""Reach on programs without names (docs/design.md#layers-without-names): the user's blocks are
found from the call structure and from repeated equations, so per-block built-in policies are
reference plans and the smallest budget jremat states is at or below what they reach."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jremat
from jremat import models
from jremat._src.compile.program import Program
from jremat._src.trace.graph import build_graph
from jremat._src.trace.layers import call_keys, layer_source, layer_spans, repeat_keys


def _conv(h, w):
    return jax.lax.conv_general_dilated(
        h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _block(w, h):
    return jax.nn.silu(_conv(h, w))


def _chain(block):
    """Three calls of `block` with a max pooling between the first two."""

    def loss(ws, x):
        h = block(ws[0], x)
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = block(ws[2], block(ws[1], h))
        return jnp.mean(h**2)

    ws = [jnp.ones((3, 3, 3, 4)), jnp.ones((3, 3, 4, 4)), jnp.ones((3, 3, 4, 4))]
    return loss, (ws, jnp.ones((1, 8, 8, 3)))


def _block_spans(graph):
    """(first primitive, last primitive) of each layer span."""
    return [(graph.nodes[s].primitive, graph.nodes[e - 1].primitive) for s, e in layer_spans(graph)]


def test_jit_called_blocks_are_layers_by_their_calls():
    loss, args = _chain(jax.jit(_block))
    g = build_graph(loss, args)
    keys = call_keys(g)
    # each jitted call is one layer (silu's own nested jit is not: it holds no contraction)
    assert len({k for k in keys if k}) == 3 and all(k.startswith("_block@") for k in keys if k)
    assert layer_source(g) == "calls"
    assert _block_spans(g) == [("conv_general_dilated", "mul")] * 3
    pool = next(i for i, n in enumerate(g.nodes) if n.primitive == "reduce_window_max")
    assert keys[pool] is None  # the pooling between blocks is glue


def test_plain_python_blocks_are_layers_by_repetition():
    loss, args = _chain(_block)
    g = build_graph(loss, args)
    assert not any(call_keys(g))  # jax.nn.silu's jit holds no contraction: not a block
    assert layer_source(g) == "repeats"
    # grown past silu's cheap tail: conv, logistic, mul per block
    assert _block_spans(g) == [("conv_general_dilated", "mul")] * 3
    assert [e - s for s, e in layer_spans(g)] == [3, 3, 3]


def test_repeats_need_a_contraction_and_names_come_first():
    def elementwise(x):
        for _ in range(4):
            x = jnp.sin(x) * 2.0
        return jnp.sum(x)

    g = build_graph(elementwise, (jnp.ones(8),))
    assert not any(repeat_keys(g)) and layer_source(g) is None

    def named_block(w, h):  # the same block called under named scopes: names win
        with jax.named_scope(f"layer_{w.shape[2]}"):
            return _block(w, h)

    loss, args = _chain(jax.jit(named_block))
    named = build_graph(loss, args)
    assert layer_source(named) == "names"
    assert len(layer_spans(named)) == 2  # layer_3, then layer_4 (two calls, one name)


def _temp(loss, args):
    exe = jax.jit(jax.value_and_grad(loss)).lower(*args).compile()
    return exe.memory_analysis().temp_size_in_bytes


def test_floor_at_or_below_per_block_builtins_and_reached():
    """The max-pool U-Net without names (one level: block, pool, block, upsample, concat,
    block): the reference plans jremat compiles, whose lowest is at or above the smallest budget
    it states, reach at or below per-block `jax.checkpoint` under each built-in; a fresh
    `jremat.plan` at that budget reaches it in the compiled program."""
    w = models.get("unet_maxpool", "tiny", depth=1)
    args = (w.params, w.batch)
    prog = Program(w.loss, args, 0)
    base = prog.baseline.temp_bytes
    per_block = min(
        _temp(models.get("unet_maxpool", "tiny", depth=1, block_policy=p).loss, args)
        for p in ("nothing_saveable", "dots_saveable")
    )
    assert per_block < base  # the reference saves memory: the test can fail
    anchors = prog.anchors(prog.planner("chain", 160))
    assert any(p.solver == "nothing_saveable/layers" for p, _ in anchors)
    lowest = min(c.temp_bytes for _, c in anchors)
    assert lowest <= per_block
    plan = jremat.plan(w.loss, *args, budget=lowest / base, solver="chain", max_rounds=1)
    assert plan.measured_temp_bytes <= lowest

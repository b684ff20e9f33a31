"""`jremat.explain`: rows per layer and segment, largest activations first, with sources."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jremat
from jremat._src.plan.plan import KEEP


def mlp_loss(params, x):
    for i, (w1, w2) in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            x = x + jnp.tanh(x @ w1) @ w2
    return jnp.mean(x**2)


KEY = jax.random.key(0)
PARAMS = [
    (
        jax.random.normal(jax.random.fold_in(KEY, i), (16, 64)) / 4,
        jax.random.normal(jax.random.fold_in(KEY, 10 + i), (64, 16)) / 8,
    )
    for i in range(4)
]
X = jax.random.normal(KEY, (128, 16))


def _check_rows(e: jremat.Explanation) -> None:
    rows = e.rows
    assert [r.activation_bytes for r in rows] == sorted(
        (r.activation_bytes for r in rows), reverse=True
    )
    spans = sorted((r.start, r.end) for r in rows)  # every equation in exactly one row
    assert spans[0][0] == 0 and spans[-1][1] == e.graph.num_nodes
    assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))
    for r in rows:
        assert r.recomputed_bytes <= r.activation_bytes
        if r.policy == KEEP:
            assert r.recomputed_bytes == 0 and r.recompute_flops == 0
            assert r.saved_bytes >= r.activation_bytes
        seg = e.plan.segments[r.segment]
        assert seg.start <= r.start and r.end <= seg.end


def test_explain_function_per_layer_with_compiled_figures():
    e = jremat.explain(mlp_loss, PARAMS, X, budget=0.6, max_rounds=1)
    _check_rows(e)
    assert {f"layer_{i}" for i in range(4)} <= {r.layer for r in e.rows}
    assert e.planned_temp_bytes <= 0.6 * e.baseline_temp_bytes
    recomputed = [r for r in e.rows if r.recomputed_bytes]
    assert recomputed and e.total_recompute_flops > 0
    # what the backward pass reruns (equations JAX's DCE keeps), as the compiled FLOPs say
    extra = e.plan.measured_flops - e.plan.baseline_flops
    assert e.total_recompute_flops == pytest.approx(extra, rel=0.15)
    assert all(r.recomputed for r in recomputed)  # shapes listed, e.g. "float32[128, 64]"
    assert any("float32[128, 64]" in s for r in e.rows for s in r.saved + r.recomputed)
    assert any("test_explain.py" in r.source for r in e.rows)  # the user's lines
    text = str(e)
    p = e.plan
    mib = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
    # the report's head: the budget asked, no remat's and the plan's compiled figures
    assert "budget=0.6" in text and f"budget 0.6 = at most {mib(p.budget_temp_bytes)}" in text
    assert f"without remat:   temp {mib(e.baseline_temp_bytes)}" in text
    assert f"under this plan: temp {mib(e.planned_temp_bytes)}" in text
    assert f"footprint {mib(p.measured_footprint_bytes)}" in text
    assert f"({100 * (p.measured_flops / p.baseline_flops - 1):+.1f}% FLOPs)" in text
    assert "activ = bytes" in text and "layer_0" in text  # the columns are explained
    # short sources in the user's file, the start column before the end column
    for r in e.rows:
        assert r.source.startswith("tests/test_explain.py:") or not r.source, r.source
        for a, b in re.findall(r":\d+:(\d+)-(\d+) ", r.source):
            assert int(a) < int(b)
    assert "<pre>" in e._repr_html_()
    assert e.to_dicts()[0]["activation_bytes"] == e.rows[0].activation_bytes


def test_explain_linen_model_as_written():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(16)(nn.gelu(nn.Dense(64)(x)))

    Dec = jremat.auto(Block, budget=0.4)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = Dec()(x)
            return x

    m = Model()
    v = m.init(KEY, X)
    e = jremat.explain(m, v, X, budget=0.5, verify=False, solver="chain")
    _check_rows(e)
    assert {"Model/Block_0", "Model/Block_1", "Model/Block_2"} <= {r.layer for r in e.rows}
    assert any(r.layer == "(output reduction)" for r in e.rows)  # <out, t> of a vector output
    assert Dec.plan_cache.solves == 0  # the decorators were off while explaining
    # sources are the user's lines (this file), never flax's own modules
    block_rows = [r for r in e.rows if r.layer.startswith("Model/Block_")]
    assert block_rows and all(r.source.startswith("tests/test_explain.py:") for r in block_rows)
    assert sum(e.graph.diff_invars) == len(jax.tree_util.tree_leaves(v["params"]))


def test_explain_linen_model_with_a_positional_bool_input():
    """`explain(model, variables, x, False)`: the bool (`train`) is closed over, as
    `jremat.auto` reads it (helper-4: it was traced, TracerBoolConversionError)."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            for _ in range(3):
                x = x + nn.Dropout(0.5, deterministic=not train)(nn.tanh(nn.Dense(16)(x)))
            return x

    m = Net()
    v = m.init(KEY, X, False)
    e = jremat.explain(m, v, X, False, budget=0.9, verify=False, solver="chain")
    _check_rows(e)
    assert sum(e.graph.diff_invars) == len(jax.tree_util.tree_leaves(v["params"]))


def test_explain_nnx_module():
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(x)))

    model = Mlp(nnx.Rngs(0))
    # one residual block: the cost model (verify=False) finds nothing to save below 1.0, so
    # explain the unrematerialized plan; the rows must still describe every layer
    e = jremat.explain(model, X, budget=1.0, verify=False, solver="chain")
    _check_rows(e)
    assert sum(e.graph.diff_invars) == 4  # the two kernels and biases
    with pytest.raises(TypeError, match="pass an instance"):
        jremat.explain(Mlp, X)


def test_explain_nnx_module_with_batch_norm_in_training_mode():
    """BatchNorm updates its statistics in the call (helper-4: explain's states were closed
    over by jax.grad, and flax refused the update, read as "JAX cannot build the backward
    pass"); `jremat.auto` plans the same module."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lins = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(3)])
            self.bns = nnx.List([nnx.BatchNorm(16, rngs=rngs) for _ in range(3)])

        def __call__(self, x):
            for lin, bn in zip(self.lins, self.bns, strict=True):
                x = x + jnp.tanh(bn(lin(x)))
            return x

    e = jremat.explain(Net(nnx.Rngs(0)), X, budget=0.9)
    _check_rows(e)
    assert e.plan.measured_temp_bytes <= e.plan.budget_temp_bytes


def test_summary_of_a_block_plan_states_its_kept_bytes():
    """A Flax block planned as one segment under a built-in policy: no per-segment model
    figures ("-"), and the segment keeps the block's compiled kept bytes."""
    p = jremat.Plan(
        [jremat.Segment(0, 7, "dots_saveable")],
        "x",
        7,
        solver="whole-block/dots_saveable",
        budget=0.4,
        budget_temp_bytes=3_600_000,
        measured_temp_bytes=3_137_536,
        baseline_temp_bytes=9_000_000,
        notes=["block plan: measured_temp_bytes and baseline_temp_bytes are the block's kept"],
    )
    lines = p.summary().splitlines()
    assert lines[0] == (
        "jremat plan (whole-block/dots_saveable): budget 0.4 = at most 3.43 MiB of compiled "
        "kept bytes"
    )
    assert "under this plan: kept bytes 2.99 MiB (35% of that)" in p.summary()
    row = lines[-1].split()
    assert row[:4] == ["0", "0-6", "dots_saveable", "-"]
    assert row[4] == f"{3_137_536 / 2**20:.2f}" and row[5:7] == ["-", "-"]
    unverified = jremat.Plan([jremat.Segment(0, 7, KEEP)], "x", 7, budget=0.5)
    assert "under this plan: not compiled" in unverified.summary()


@pytest.mark.parametrize("policy", ["dots_and_transcendentals_saveable", "dots_saveable"])
def test_recompute_of_a_built_in_policy_is_what_the_compiled_step_adds(policy):
    """Per-layer recipes of jremat's and JAX's built-ins (`dots_and_transcendentals_saveable`
    is jremat's own: JAX 0.10 lacks it): explain counts the recompute the rewrite applies,
    close to the compiled step's extra FLOPs, and below `nothing_saveable`'s."""
    from jremat._src.compile.program import Program
    from jremat._src.plan.recipes import recipe_plan
    from jremat._src.reports.explain import explain_plan

    k = jax.random.split(KEY, 9)  # matmuls large enough that XLA's own extra FLOPs are noise
    params = [
        (jax.random.normal(k[i], (128, 512)) / 11, jax.random.normal(k[i + 4], (512, 128)) / 23)
        for i in range(4)
    ]
    prog = Program(mlp_loss, (params, jax.random.normal(k[8], (256, 128))), 0)
    base = prog.baseline.flops

    def counted(name: str) -> tuple[float, float]:
        plan = recipe_plan(prog.graph, name)
        rows = explain_plan(prog.graph, plan)
        return sum(r.recompute_flops for r in rows), prog.compile(plan).flops - base

    modelled, compiled = counted(policy)
    assert modelled == pytest.approx(compiled, rel=0.25, abs=0.01 * base)
    assert modelled < counted("nothing_saveable")[0]

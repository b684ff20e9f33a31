"""Reports list only what the compiled program keeps (issue 14): a name on a value the
backward pass never reads is dropped by `jax.checkpoint`, so a plan neither lists nor counts
it (`Segment.saved`, `Plan.summary`, `jremat.explain`)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

import jremat
from jremat._src.plan.rewrite import residual_name, segment_io
from jremat._src.reports.explain import explain_plan


def loss(params, x):
    """Each layer adds `mean(h @ w2)`: a matmul result whose backward needs nothing of it (the
    add and the mean have constant derivatives), which the "dots" save option still selects."""
    for i, p in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            h = x @ p["w1"]
            x = x + jnp.tanh(h) @ p["w2"] + jnp.mean(h @ p["w2"], axis=0)
    return jnp.mean(x**2)


@pytest.fixture(scope="module")
def planned():
    k = jax.random.split(jax.random.key(0), 7)
    params = [
        {
            "w1": jax.random.normal(k[i], (16, 64)) * 0.2,
            "w2": jax.random.normal(k[i + 3], (64, 16)) * 0.1,
        }
        for i in range(3)
    ]
    args = (params, jax.random.normal(k[6], (128, 16)))
    return (
        jremat.plan(loss, *args, budget=0.7, solver="chain", max_rounds=1),
        jremat.trace(loss, *args),
        args,
    )


def named_residuals(f, args, capsys) -> dict[str, int]:
    """{checkpoint name: bytes} of the residuals JAX keeps for `jax.vjp(f)`."""
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(f, *args)
    found = {}
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r"(\w+)\[([\d,]*)\] named '(\w+)'", line)
        if m:
            assert m.group(1) == "f32", line  # the model is float32
            found[m.group(3)] = 4 * math.prod(int(d) for d in m.group(2).split(",") if d)
    return found


def test_a_plan_lists_and_counts_only_the_residuals_jax_keeps(planned, capsys):
    p, graph, args = planned
    saved = [v for s in p.segments for v in s.saved]
    assert saved, "the plan saves named values"
    kept = named_residuals(jremat.rematerialize(loss, p), args, capsys)
    assert {residual_name(v) for v in saved} == set(kept)
    assert sum(graph.values[v].nbytes for v in saved) == sum(kept.values())
    # the dropped class: results the backward never reads are not listed anywhere
    unread = {o for n in graph.nodes if n.primitive == "dot_general" for o in n.outputs}
    unread = {v for v in unread if graph.values[v].shape == (128, 16)}
    assert len(unread) == 6 and not unread & set(saved)
    assert "saves: float32[128, 64]" in p.summary(graph)
    assert "float32[128, 16]" not in "".join(
        line for line in p.summary(graph).splitlines() if "saves:" in line
    )
    # explain lists float32[128,16] values only where the backward reads them: where a
    # checkpointed segment starts from them, or as residuals a kept segment produces
    starts = {v for s in p.segments if s.checkpointed for v in segment_io(graph, s)[0]}
    kept_residuals = {
        v
        for s in p.segments
        if not s.checkpointed
        for n in graph.nodes[s.start : s.end]
        for v in n.residuals
        if s.start <= graph.values[v].producer < s.end
    }
    read = {
        v
        for v in starts | kept_residuals
        if graph.is_temp(v) and graph.values[v].shape == (128, 16)
    }
    listed = [d for r in explain_plan(graph, p) for d in r.saved if d == "float32[128, 16]"]
    assert len(listed) == len(read)


def test_dropping_the_names_leaves_the_compiled_program_as_verified(planned):
    p, _, args = planned
    step = jax.jit(jax.grad(jremat.rematerialize(loss, p)))
    assert step.lower(*args).compile().memory_analysis().temp_size_in_bytes == (
        p.measured_temp_bytes
    )

"""Refinement (docs/design.md#refinement): the segment at a plan's peak cut into one segment
per contraction, with exact gradients and less recompute than per-layer checkpointing."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import models as M  # noqa: E402  (tests/ is on sys.path via conftest)
import pytest

import jremat
from jremat._src.compile.program import Program
from jremat._src.plan.plan import plan_key
from jremat._src.plan.recipes import recipe_plan
from jremat._src.search import refine


@pytest.fixture(scope="module")
def mlp():
    m = M.mlp_chain()
    return m, Program(m.loss, m.args, 0)


def test_contraction_groups_tile_the_span_and_start_at_contractions(mlp):
    _, prog = mlp
    g = prog.graph
    for start, end in M.layer_spans(g):
        pieces = refine.contraction_groups(g, start, end)
        assert pieces, "every MLP layer has two matmuls"
        assert pieces[0][0] == start and pieces[-1][1] == end
        assert all(a < b for a, b, _ in pieces)
        assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:], strict=False))
        for a, _, ckpt in pieces:
            assert ckpt == (g.nodes[a].primitive in refine.CONTRACTIONS)


def test_split_peak_segment_recomputes_less_with_exact_gradients(mlp):
    """The split keeps the peak layer's nonlinearities, so it recomputes fewer FLOPs than the
    per-layer plan. Whether its temp is lower depends on XLA's schedule (on the held-out U-Net
    it is: 0.56 -> 0.51 on jax 0.10 and 0.12; on this small MLP it is lower on jax 0.10, equal
    on 0.12), so `solve` compiles it and takes it only when it fits."""
    m, prog = mlp
    planner = prog.planner("chain", 160)
    layers = recipe_plan(prog.graph, "nothing_saveable")
    order = refine.peak_order(planner, layers)
    assert order and layers.segments[order[0]].checkpointed
    split = refine.candidates(prog.graph, planner, layers)[0]
    assert len(split.segments) > len(layers.segments)
    split.validate()
    assert prog.compile(split).flops < prog.compile(layers).flops
    assert prog.compile(split).temp_bytes <= prog.compile(layers).temp_bytes
    got = jax.grad(jremat.rematerialize(m.loss, split))(*m.args)
    M.assert_trees_close(got, jax.grad(m.loss)(*m.args), rtol=1e-5)


def test_split_leaves_kept_and_named_segments_alone(mlp):
    _, prog = mlp
    identity = jremat.Plan.identity(prog.graph)
    assert refine.split_segment(prog.graph, identity, 0) is None
    assert refine.candidates(prog.graph, prog.planner("chain", 160), identity) == []


def test_floor_candidates_refine_the_lowest_plans_first_none_twice(mlp):
    """`floor_candidates` splits the peaks of the lowest compiled plans (figures given, not
    compiled here), lowest first, then offers equal-FLOP chunks; nothing compiled already and
    nothing twice, and the same plans in a new call."""
    _, prog = mlp
    g, planner = prog.graph, prog.planner("chain", 160)
    layers = recipe_plan(g, "nothing_saveable")
    sqrt_n = recipe_plan(g, "nothing_saveable", "sqrt_n")
    figures = lambda t: SimpleNamespace(temp_bytes=t)  # noqa: E731
    own = refine.candidates(g, planner, layers)
    compiled = [
        (sqrt_n, figures(20)),
        (layers, figures(10)),
        (layers, figures(10)),
        (own[0], figures(9)),
    ]
    got = refine.floor_candidates(g, planner, compiled, starts=2)
    keys = [plan_key(p) for p in got]
    assert len(set(keys)) == len(keys)
    assert not set(keys) & {plan_key(p) for p, _ in compiled}
    *splits, chunks = got
    assert chunks.solver == "nothing_saveable/chunks"
    # own[0] (the lowest) split further first, then `layers` split twice (own[1]; own[0] was
    # compiled); sqrt_n is a third start
    assert splits[0].solver == own[0].solver + "+split" and plan_key(own[1]) in keys
    assert all(len(p.segments) > len(layers.segments) for p in splits)
    assert [plan_key(p) for p in refine.floor_candidates(g, planner, compiled, starts=2)] == keys
    assert len(refine.floor_candidates(g, planner, compiled, starts=3)) > len(got)
    again = refine.floor_candidates(g, planner, [*compiled, (chunks, figures(30))], starts=2)
    assert [plan_key(p) for p in again] == keys[:-1]

"""Mixes of compiled recipes (docs/design.md#mixes) and split scans (`remat_scan(pieces=...)`):
exact gradients, memory between the pure policies, and a search that beats the best fitting
pure recipe on budgets between two of them."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import models as M  # noqa: E402  (tests/ is on sys.path via conftest)
import pytest

import jremat
from jremat._src.compile.program import Program
from jremat._src.plan.plan import ScanSetting
from jremat._src.search import mixing
from jremat._src.trace.layers import layer_segments


def _scan_program(reverse: bool):
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (8, 64, 64)) / 8
    x = jax.random.normal(k2, (256, 64))

    def loss(w, x):
        def body(c, wi):
            return c + jnp.tanh(c @ wi), jnp.sin(c).sum(0)

        c, ys = jax.lax.scan(body, x, w, reverse=reverse)
        return jnp.mean(c**2) + 1e-3 * jnp.sum(ys * jnp.arange(8.0)[:, None])

    return loss, (w, x)


@pytest.mark.parametrize("reverse", [False, True])
def test_split_scan_has_exact_gradients_and_memory_between_its_pieces(reverse):
    loss, args = _scan_program(reverse)
    prog = Program(loss, args, 0)
    want = jax.grad(loss)(*args)
    temps = {}
    for k in (0, 4, 8):  # k iterations under nothing_saveable, the rest kept
        plan = mixing.scan_mix_plan(prog.graph, ["nothing_saveable"] * k + ["keep"] * (8 - k))
        temps[k] = prog.compile(plan).temp_bytes
        got = jax.grad(jremat.rematerialize(loss, plan))(*args)
        M.assert_trees_close(got, want, rtol=1e-6)
    assert temps[0] == prog.baseline.temp_bytes  # all kept: the program as it was
    assert temps[8] < temps[4] < temps[0]


def test_split_scan_survives_json():
    loss, args = _scan_program(False)
    prog = Program(loss, args, 0)
    plan = mixing.scan_mix_plan(prog.graph, ["nothing_saveable"] * 3 + ["dots_saveable"] * 5)
    again = jremat.Plan.from_json(plan.to_json())
    assert again.scans == plan.scans
    assert prog.compile(again).temp_bytes == prog.compile(plan).temp_bytes


def test_layer_mix_has_exact_gradients():
    m = M.MODELS["mlp_chain"]()
    prog = Program(m.loss, m.args, 0)
    n = len(layer_segments(prog.graph))
    plan = mixing.layer_mix_plan(prog.graph, ["nothing_saveable"] * 2 + ["keep"] * (n - 2))
    got = jax.grad(jremat.rematerialize(m.loss, plan))(*m.args)
    M.assert_trees_close(got, jax.grad(m.loss)(*m.args), rtol=1e-5)
    pure = prog.compile(mixing.layer_mix_plan(prog.graph, ["nothing_saveable"] * n))
    assert pure.temp_bytes < prog.compile(plan).temp_bytes < prog.baseline.temp_bytes


def test_search_beats_the_best_fitting_pure_recipe_between_two():
    loss, args = _scan_program(False)
    prog = Program(loss, args, 0)
    lo = prog.compile(mixing.scan_mix_plan(prog.graph, ["nothing_saveable"] * 8))
    target = (lo.temp_bytes + prog.baseline.temp_bytes) / 2
    mixing.search(prog, target, best_flops=lo.flops)
    fits = [c for p, c in prog.tried if c.temp_bytes <= target and p.solver.startswith("mix:")]
    assert fits and min(c.flops for c in fits) < lo.flops


def test_compositions_cover_every_split_with_at_most_three_policies():
    got = set(mixing.compositions(4, 5))
    assert all(sum(c) == 4 and sum(n > 0 for n in c) <= 3 for c in got)
    assert (2, 0, 1, 0, 1) in got and (4, 0, 0, 0, 0) in got
    assert (1, 1, 1, 1, 0) not in got
    # all C(8, 4) = 70 compositions of 4 into 5 parts but the 5 with four non-zero parts
    assert len(got) == 65


def test_search_skips_when_interpolation_cannot_beat_what_fits():
    loss, args = _scan_program(False)
    prog = Program(loss, args, 0)
    mixing.search(prog, 0.9 * prog.baseline.temp_bytes, best_flops=0.0)
    assert not any(p.notes and p.notes[-1].startswith("mix: ") for p, _ in prog.tried)


@pytest.mark.parametrize(
    "scans, named",
    [
        ({"0": {"pieces": []}}, r"Plan.scans\['0'\].pieces must be a non-empty list"),
        (
            {"0": {"pieces": [{"policy": "nothing_saveable"}]}},
            r"Plan.scans\['0'\].pieces\[0\].length is missing",
        ),
        ({"0": {"policy": "nothin_saveable", "nest": 1}}, r"Plan.scans\['0'\].policy: unknown"),
        ({"0": {"policy": "nothing_saveable", "nest": -2}}, r"Plan.scans\['0'\].nest must be"),
        ({"0": {"policy": "nothing_saveable", "foo": 1}}, r"Plan.scans\['0'\]: unknown field"),
        ({"99": {"policy": "nothing_saveable", "nest": 1}}, r"Plan.scans\['99'\]: keys are"),
    ],
)
def test_malformed_scan_configs_are_rejected_by_name(scans, named):
    loss, args = _scan_program(False)
    d = json.loads(jremat.Plan.identity(jremat.trace(loss, *args)).to_json())
    d["scans"] = scans
    with pytest.raises(ValueError, match=named):
        jremat.Plan.from_json(json.dumps(d))


@pytest.mark.parametrize(
    "scans, named",
    [
        ({"99": ScanSetting()}, r"Plan.scans\['99'\]: keys are equation indices"),
        ({"first": ScanSetting()}, r"Plan.scans\['first'\]: keys are equation indices"),
        ({True: ScanSetting()}, r"Plan.scans\[True\]: keys are equation indices"),
        ({"0": 3}, r"Plan.scans\['0'\] must be a ScanSetting or its JSON form"),
    ],
)
def test_a_plan_whose_scans_are_not_settings_by_equation_does_not_run(scans, named):
    loss, args = _scan_program(False)
    plan = jremat.Plan.identity(jremat.trace(loss, *args))
    plan.scans = scans
    with pytest.raises(ValueError, match=named):
        jremat.rematerialize(loss, plan)


@pytest.mark.parametrize(
    "scans",
    [{0: ScanSetting()}, {"0": {"policy": "nothing_saveable", "nest": 1}}],
    ids=["int-key", "json-form"],
)
def test_scans_set_as_before_scan_settings_existed_are_normalized_and_run(scans):
    """An int key and the JSON (dict) form, as plans held before `ScanSetting`, are read as
    the string key and the `ScanSetting`; the plan runs with exact gradients."""
    loss, args = _scan_program(False)
    plan = jremat.Plan.identity(jremat.trace(loss, *args))
    plan.scans = scans
    got = jax.grad(jremat.rematerialize(loss, plan))(*args)
    assert plan.scans == {"0": ScanSetting("nothing_saveable", 1)}
    assert plan.scans["0"]["policy"] == "nothing_saveable"  # read access in the JSON's terms
    M.assert_trees_close(got, jax.grad(loss)(*args), rtol=1e-6)

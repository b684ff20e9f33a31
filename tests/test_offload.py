"""Host offload as a plan option (`jremat.OffloadCost`): offload plans compile and run with exact
gradients, survive JSON, and the planners take them only where the cost model says the
transfer is cheaper than the recompute it spares. On CPU the offload is a no-op (no memory
effect); the test that needs device memory to drop skips there."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import models as M  # noqa: E402  (tests/ is on sys.path via conftest)
import numpy as np
import pytest

import jremat
from jremat import OffloadCost
from jremat._src.base.budget import parse_budget
from jremat._src.compile.program import Program
from jremat._src.plan.offload import host_offload_effective, offload_proxy, parse_offload
from jremat._src.plan.plan import KEEP, SAVE_NAMES, Plan, Segment
from jremat._src.plan.planners import ChainPlanner, DTRPlanner, GreedyPlanner
from jremat._src.plan.planners.chain import within_budget
from jremat._src.search.solve import solve

#: transfers all but free: offloading beats any recompute (2e-3 FLOP-equivalents per byte)
FAST = OffloadCost(host_bandwidth=1e15, device_flops=1e12)
#: transfers ruinous: 2e12 FLOP-equivalents per byte, far above any recompute
SLOW = OffloadCost(host_bandwidth=1e3, device_flops=1e15)
NO_EFFECT = "needs a backend with pinned host memory: on CPU the offload compiles to a no-op"


@pytest.fixture(scope="module")
def prog():
    m = M.mlp_chain()
    return m, Program(m.loss, m.args, 0)


def _offload_plan(graph, fraction: float = 0.4) -> Plan:
    planner = ChainPlanner(graph, offload=FAST)
    plan = planner.plan(planner.no_remat_peak() * fraction)
    assert plan is not None and plan.offloaded_bytes > 0
    return plan


def _saved_instead(plan: Plan) -> Plan:
    """`plan` with its offloaded values saved on the device instead."""
    q = offload_proxy(plan)
    for s, orig in zip(q.segments, plan.segments, strict=True):
        s.saved = sorted({*orig.saved, *orig.offloaded})
    return q


def test_offload_plan_runs_with_exact_gradients(prog):
    m, p = prog
    plan = _offload_plan(p.graph)
    offloading = [s for s in plan.segments if s.offloaded]
    assert offloading and all(s.policy == SAVE_NAMES and not s.saved for s in offloading)
    f = jremat.rematerialize(m.loss, plan)
    # the program really moves values to host and back
    text = str(jax.make_jaxpr(jax.grad(f))(*m.args))
    assert text.count("device_put") >= 2 * len(offloading)
    val, got = jax.jit(jax.value_and_grad(f))(*m.args)
    want_val, want = jax.jit(jax.value_and_grad(m.loss))(*m.args)
    np.testing.assert_allclose(val, want_val, rtol=1e-6)
    M.assert_trees_close(got, want, rtol=1e-5)


def test_offload_plan_json_round_trip_and_old_plans(prog):
    _, p = prog
    plan = _offload_plan(p.graph)
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert [s.offloaded for s in back.segments] == [s.offloaded for s in plan.segments]
    # a plan written before the offload fields existed loads with nothing offloaded
    d = json.loads(plan.to_json())
    d.pop("offloaded_bytes")
    for s in d["segments"]:
        s.pop("offloaded")
    old = Plan.from_json(json.dumps(d))
    assert old.offloaded_bytes == 0 and not any(s.offloaded for s in old.segments)
    bad = Plan([Segment(0, p.graph.num_nodes, KEEP, offloaded=[3])], "fp", p.graph.num_nodes)
    with pytest.raises(ValueError, match="offloaded values need policy 'names'"):
        bad.validate()


def test_offload_option_model_and_cost(prog):
    """Offload: the memory of recomputing everything, the recompute of saving the dots, plus
    2 x bytes / bandwidth x FLOP rate."""
    _, p = prog
    t = ChainPlanner(p.graph, offload=FAST).table
    k_off, k_dots, k_none = (t.option_index(o) for o in ("offload_dots", "dots", "nothing"))
    ok = np.isfinite(t.stored[k_off])
    assert ok.any() and t.offloaded[k_off][ok].max() > 0
    np.testing.assert_array_equal(t.stored[k_off][ok], t.stored[k_none][ok])
    np.testing.assert_array_equal(t.transient[k_off][ok], t.transient[k_none][ok])
    np.testing.assert_array_equal(t.flops[k_off][ok], t.flops[k_dots][ok])
    # the bytes offloaded are the bytes the dots option stores on top of the live-in values
    np.testing.assert_allclose(
        t.offloaded[k_off][ok], t.stored[k_dots][ok] - t.stored[k_none][ok], rtol=1e-12
    )
    np.testing.assert_allclose(
        t.cost[k_off][ok], t.flops[k_off][ok] + t.offloaded[k_off][ok] * 2e-3, rtol=1e-12
    )
    assert FAST.transfer_seconds(1e15) == 2.0 and FAST.transfer_flops(1e15) == 2e12
    plain = ChainPlanner(p.graph).table
    assert "offload_dots" not in plain.options
    np.testing.assert_array_equal(plain.cost, plain.flops)
    assert not plain.offloaded.any()


def _break_even(t) -> np.ndarray:
    """Per segment: recompute FLOPs offloading spares per byte offloaded (the FLOP-equivalents
    per byte at which offloading and recomputing cost the same)."""
    k_off, k_none = t.option_index("offload_dots"), t.option_index("nothing")
    with np.errstate(invalid="ignore", divide="ignore"):
        return (t.flops[k_none] - t.flops[k_off]) / t.offloaded[k_off]


def test_chain_offloads_exactly_where_the_transfer_is_cheaper(prog):
    _, p = prog
    ratio = _break_even(ChainPlanner(p.graph, offload=FAST).table)
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    lo, hi = float(finite.min()), float(finite.max())
    chosen_any = {}
    for label, per_byte in (
        ("cheap", 0.5 * lo),
        ("mid", float(np.median(finite))),
        ("dear", 2 * hi),
    ):
        cost = OffloadCost(host_bandwidth=2.0 * 1e12 / per_byte, device_flops=1e12)
        assert cost.flops_per_byte == pytest.approx(per_byte)
        planner = ChainPlanner(p.graph, offload=cost)
        t = planner.table
        r = _break_even(t)
        none_peak = planner.no_remat_peak()
        min_peak = planner.min_memory_plan().predicted_temp_bytes
        n_off = 0
        for budget in np.linspace(min_peak * 1.05, none_peak, 12):
            found = within_budget(t, budget)
            assert found is not None
            for a, b, option in found[1]:
                if option == "offload_dots":
                    n_off += 1
                    assert r[a, b] >= cost.flops_per_byte  # the transfer costs less
                elif option == "nothing" and t.offloaded[t.option_index("offload_dots"), a, b]:
                    assert r[a, b] <= cost.flops_per_byte  # the recompute costs less
        chosen_any[label] = n_off
    assert chosen_any["cheap"] > 0, chosen_any
    assert chosen_any["dear"] == 0


@pytest.mark.parametrize("solver", ["chain", "greedy"])
def test_plan_offloads_only_when_cheaper(prog, solver):
    m, p = prog
    budget = parse_budget(0.5)
    none = solve(p, budget, solver=solver, max_rounds=2)
    fast = solve(p, budget, solver=solver, max_rounds=2, offload=FAST)
    slow = solve(p, budget, solver=solver, max_rounds=2, offload=SLOW)
    base = p.baseline.temp_bytes
    assert none.offloaded_bytes == 0 and slow.offloaded_bytes == 0
    assert not any(s.offloaded for s in slow.segments)
    assert slow.measured_flops == none.measured_flops
    assert fast.offloaded_bytes > 0
    assert fast.measured_flops < none.measured_flops  # what offloading spares
    for pl in (none, fast, slow):
        assert pl.measured_temp_bytes <= 0.5 * base
    got = jax.grad(jremat.rematerialize(m.loss, fast))(*m.args)
    M.assert_trees_close(got, jax.grad(m.loss)(*m.args), rtol=1e-5)
    if not host_offload_effective():
        assert any("no memory effect" in n for n in fast.notes)
        proxy = p.compile(offload_proxy(fast))
        assert fast.measured_temp_bytes == proxy.temp_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a finding about XLA:CPU")
def test_cpu_offload_is_a_no_op(prog):
    """On CPU the offloaded plan compiles to the temp bytes of saving the same values on the
    device; the verify loop takes device memory from the plan recomputing them instead."""
    _, p = prog
    assert not host_offload_effective()
    plan = _offload_plan(p.graph)
    c = p.compile(plan)
    saved = p.compile(_saved_instead(plan))
    proxy = p.compile(offload_proxy(plan))
    assert c.offload_temp_bytes == saved.temp_bytes
    assert c.temp_bytes == proxy.temp_bytes < c.offload_temp_bytes
    assert c.flops < proxy.flops  # the offloaded values are not recomputed


@pytest.mark.skipif(not host_offload_effective(), reason=NO_EFFECT)
def test_offload_frees_device_memory(prog):
    """GPU/TPU: device temp drops by about the offloaded bytes vs saving them on the device."""
    m, p = prog
    plan = _offload_plan(p.graph)
    c = p.compile(plan)
    assert c.offload_temp_bytes is None  # measured on the offload plan itself
    saved = p.compile(_saved_instead(plan))
    assert saved.temp_bytes - c.temp_bytes >= 0.5 * plan.offloaded_bytes
    got = jax.grad(jremat.rematerialize(m.loss, plan))(*m.args)
    M.assert_trees_close(got, jax.grad(m.loss)(*m.args), rtol=1e-5)


def test_greedy_takes_offload_only_when_fast_and_dtr_never(prog):
    _, p = prog
    fast, slow = GreedyPlanner(p.graph, offload=FAST), GreedyPlanner(p.graph, offload=SLOW)
    tight = fast.min_memory_plan().predicted_temp_bytes * 1.05
    assert fast.plan(tight).offloaded_bytes > 0
    assert slow.plan(tight).offloaded_bytes == 0
    dtr = DTRPlanner(p.graph, offload=FAST)
    assert "offload_dots" not in dtr.table.options
    assert dtr.min_memory_plan().offloaded_bytes == 0


def test_bad_offload_arguments():
    assert parse_offload(None) is None and parse_offload(False) is None
    assert parse_offload(True) == OffloadCost()
    with pytest.raises(TypeError, match="offload must be None/False"):
        parse_offload("yes")
    with pytest.raises(ValueError, match="host_bandwidth must be a finite number > 0"):
        OffloadCost(host_bandwidth=0)
    with pytest.raises(ValueError, match="device_flops"):
        OffloadCost(device_flops=float("inf"))
    m = M.mlp_chain(depth=2)
    with pytest.raises(TypeError, match="offload"):
        jremat.plan(m.loss, *m.args, budget=0.5, offload=1e9)


def test_offload_cost_takes_numpy_and_jax_scalars_as_floats():
    c = OffloadCost(host_bandwidth=np.float32(1e10), device_flops=np.int64(10**12))
    assert c == OffloadCost(host_bandwidth=1e10, device_flops=1e12)
    assert type(c.host_bandwidth) is float and type(c.device_flops) is float
    assert repr(c) == "OffloadCost(host_bandwidth=10000000000.0, device_flops=1000000000000.0)"
    assert OffloadCost(host_bandwidth=jnp.float32(2.0)).host_bandwidth == 2.0
    assert OffloadCost(np.array(3.0)).host_bandwidth == 3.0
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.int8):
        cost = OffloadCost(host_bandwidth=jnp.array(64, dtype), device_flops=np.array(2, dtype))
        assert cost == OffloadCost(64.0, 2.0), dtype
    assert OffloadCost(jnp.array(1e10, jnp.bfloat16)).host_bandwidth == pytest.approx(1e10, 1e-2)
    assert c.flops_per_byte == 200.0
    assert repr(OffloadCost(10, 3)) == "OffloadCost(host_bandwidth=10, device_flops=3)"


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("host_bandwidth", "1e10", "str '1e10'"),
        ("host_bandwidth", np.float32("nan"), "float32 np.float32(nan)"),
        ("host_bandwidth", -1e9, "float -1000000000.0"),
        ("host_bandwidth", np.bool_(True), "bool np.True_"),
        ("device_flops", True, "bool True"),
        ("device_flops", np.inf, "float inf"),
        ("device_flops", 0, "int 0"),
        ("device_flops", 1j, "complex 1j"),
        ("device_flops", np.ones(2), "ndarray array([1., 1.])"),
        ("device_flops", np.array(1 + 0j), "ndarray array(1.+0.j)"),
        ("device_flops", jnp.array(True), "ArrayImpl Array(True, dtype=bool)"),
        ("device_flops", jnp.zeros((), jnp.bfloat16), "ArrayImpl Array(0, dtype=bfloat16)"),
        pytest.param("device_flops", 10**400, "int 1000", id="device_flops-huge-int"),
    ],
)
def test_offload_cost_rejects_bad_figures_naming_the_field(field, value, shown):
    with pytest.raises(ValueError) as info:
        OffloadCost(**{field: value})
    msg = str(info.value)
    assert msg.startswith(f"OffloadCost.{field} must be a finite number > 0"), msg
    assert f"got {shown}" in msg, msg


def test_unverified_offload_plan_says_cpu_cannot_confirm(prog):
    _, p = prog
    plan = solve(p, parse_budget(0.5), solver="chain", verify=False, offload=FAST)
    assert plan.offloaded_bytes > 0 and plan.measured_temp_bytes is None
    on_cpu_note = any("no memory effect" in n for n in plan.notes)
    assert on_cpu_note == (not host_offload_effective())


def test_auto_takes_offload_and_keys_plans_by_it():
    k1, k2 = jax.random.split(jax.random.key(1))
    ws = [jax.random.normal(k, (64, 64)) / 8 for k in jax.random.split(k1, 6)]
    x = jax.random.normal(k2, (256, 64))

    def loss(ws, x):
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer_{i}"):
                x = x + jnp.tanh(x @ w)
        return jnp.mean(x**2)

    fast = jremat.OffloadCost(host_bandwidth=1e15, device_flops=1e9)
    wrapped = jremat.auto(loss, budget=0.7, offload=fast, solver="chain")
    got = jax.grad(wrapped)(ws, x)
    want = jax.grad(loss)(ws, x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert wrapped.plan_cache.offload == fast
    with pytest.raises(TypeError, match="offload"):
        jremat.auto(loss, budget=0.5, offload="yes")

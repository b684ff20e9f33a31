"""Budgets (parsing, infeasibility) and every error jremat's core raises."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import SOLVER

import jremat
from jremat import parse_budget
from jremat._src.plan.recipes import recipe_plan

ACCEPTED_FORMS = ("(0, 1]", "int", "512MiB", "8GB", "auto")


def assert_names_accepted_forms(err: BaseException):
    msg = str(err)
    for form in ACCEPTED_FORMS:
        assert form in msg, f"{form!r} not in message: {msg}"


BAD_BUDGETS = [
    pytest.param(0, id="int-zero"),
    pytest.param(0.0, id="float-zero"),
    pytest.param(-1, id="negative-int"),
    pytest.param(-0.5, id="negative-float"),
    pytest.param(1.5, id="float-above-1"),
    pytest.param(2.0, id="float-2.0"),
    pytest.param(1.0000001, id="float-just-above-1"),
    pytest.param(None, id="None"),
    pytest.param([1], id="list"),
    pytest.param(object(), id="object"),
    pytest.param(True, id="True"),
    pytest.param(False, id="False"),
    pytest.param("lots", id="str-lots"),
    pytest.param("12 parsecs", id="str-parsecs"),
    pytest.param("", id="str-empty"),
    pytest.param("-1GB", id="str-negative"),
    pytest.param("0 GB", id="str-zero"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(np.float32("nan"), id="np-nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param("nan", id="str-nan"),
    pytest.param("1e400MiB", id="str-overflow"),
    pytest.param(1 + 2j, id="complex"),
    pytest.param(np.complex64(0.5 + 1j), id="np-complex64"),
    pytest.param(np.array(0.5 + 0j), id="np-complex-0d"),
    pytest.param(np.array([1, 2]), id="np-int-array"),
    pytest.param(np.array([0.5]), id="np-one-element-array"),
    pytest.param(jnp.array([0.5, 0.25]), id="jax-array"),
]


@pytest.mark.parametrize("budget", BAD_BUDGETS)
def test_bad_budget_is_a_value_error_naming_accepted_forms(budget):
    with pytest.raises(ValueError) as info:
        parse_budget(budget)
    assert not isinstance(info.value, jremat.InfeasibleBudgetError)
    assert_names_accepted_forms(info.value)


@pytest.mark.parametrize("budget", [0, 1.5, None, True, "lots", float("nan")])
def test_bad_budget_is_rejected_by_plan_and_auto_before_tracing(budget):
    def fn(params, x):  # never traced: the budget is checked first
        raise AssertionError("traced")

    with pytest.raises(ValueError) as info:
        jremat.plan(fn, jnp.ones(3), jnp.ones(3), budget=budget)
    assert_names_accepted_forms(info.value)
    with pytest.raises(ValueError) as info:
        jremat.auto(fn, budget=budget)
    assert_names_accepted_forms(info.value)
    with pytest.raises(ValueError) as info:
        jremat.auto(budget=budget)  # decorator-factory form
    assert_names_accepted_forms(info.value)


SOLVER_LIST = "'auto', 'chain', 'greedy', 'dtr', 'milp'"


@pytest.mark.parametrize("solver", [None, "fast", "Chain", ["chain"], 3])
def test_bad_solver_names_solver_and_the_accepted_ones_before_tracing(solver):
    def fn(params, x):  # never traced: the solver is checked first
        raise AssertionError("traced")

    shown = f"got {type(solver).__name__} {solver!r}"
    with pytest.raises(ValueError) as info:
        jremat.plan(fn, jnp.ones(3), jnp.ones(3), budget=0.5, solver=solver)
    assert str(info.value) == f"solver must be one of {SOLVER_LIST} (default 'auto'); {shown}"
    if solver is None:  # auto's default: jremat.plan's
        jremat.auto(fn, budget=0.5, solver=None)
        return
    for call in (
        lambda: jremat.auto(fn, budget=0.5, solver=solver),
        lambda: jremat.auto(budget=0.5, solver=solver),  # decorator-factory form
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == (
            f"solver must be one of {SOLVER_LIST} or None (jremat.plan's default, 'auto'); " + shown
        )


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("max_cuts", "10", TypeError),
        ("max_cuts", None, TypeError),
        ("max_cuts", 2.5, TypeError),
        ("max_cuts", float("nan"), TypeError),
        ("max_cuts", True, TypeError),
        ("max_cuts", 0, ValueError),
        ("max_cuts", -3, ValueError),
        ("max_rounds", True, TypeError),
        ("max_rounds", jnp.float32(2), TypeError),
        ("max_rounds", jnp.int32(0), ValueError),
        ("max_rounds", np.True_, TypeError),
        ("max_rounds", 2.0, TypeError),
        ("max_rounds", 0, ValueError),
        ("verify", "yes", TypeError),
        ("verify", 2, TypeError),
        ("verify", 1, TypeError),
        ("verify", None, TypeError),
    ],
)
def test_bad_count_or_flag_names_the_argument_before_tracing(name, value, error):
    def fn(params, x):  # never traced: the arguments are checked first
        raise AssertionError("traced")

    accepted = "a bool (True or False)" if name == "verify" else "an int >= 1"
    with pytest.raises(error) as info:
        jremat.plan(fn, jnp.ones(3), jnp.ones(3), budget=0.5, **{name: value})
    assert str(info.value).startswith(f"{name} must be {accepted}, got "), str(info.value)
    if name == "max_cuts":  # jremat.auto takes no max_cuts
        return
    for call in (
        lambda: jremat.auto(fn, budget=0.5, **{name: value}),
        lambda: jremat.auto(budget=0.5, **{name: value}),  # decorator-factory form
    ):
        with pytest.raises(error) as info:
            call()
        assert str(info.value).startswith(f"{name} must be {accepted}, got "), str(info.value)


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("512MiB", 512 * 2**20),
        ("8GB", 8 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("1.5GiB", 1610612736),
        (" 8 gb ", 8 * 10**9),
        ("100KB", 100_000),
        ("64KiB", 65536),
        ("2TiB", 2 * 2**40),
        ("4096", 4096),
        ("4096B", 4096),
        ("1e3MB", 10**9),
    ],
)
def test_size_strings_parse_to_footprint_bytes(text, nbytes):
    b = parse_budget(text)
    assert b.fraction is None
    assert b.footprint_bytes == nbytes
    assert b.raw == text


def test_numbers_parse_to_fraction_or_bytes():
    assert parse_budget(0.5).fraction == 0.5 and parse_budget(0.5).footprint_bytes is None
    assert parse_budget(1.0).fraction == 1.0
    assert parse_budget(np.float32(0.25)).fraction == 0.25
    assert parse_budget(1).footprint_bytes == 1 and parse_budget(1).fraction is None
    assert parse_budget(np.int64(2**33)).footprint_bytes == 2**33
    auto = parse_budget("auto")
    assert auto.footprint_bytes is not None and auto.footprint_bytes > 0


# Regression: a NumPy bool is rejected like a Python bool (it has __float__).
def test_numpy_bool_budget_is_rejected_like_bool():
    with pytest.raises(ValueError):
        parse_budget(np.bool_(True))


# Regression: a size below one byte (or a unitless "0.5") is an error, not a 0-byte cap.
@pytest.mark.parametrize("text", ["0.4B", "0.5"])
def test_sub_byte_size_string_is_rejected(text):
    with pytest.raises(ValueError):
        parse_budget(text)


# -- argument errors ---------------------------------------------------------------------------
def test_no_floating_input_at_argnums_is_a_type_error(cache):
    m = cache.model("decoder")  # (params, int tokens)
    for call in (
        lambda: jremat.trace(m.loss, *m.args, argnums=1),
        lambda: jremat.plan(m.loss, *m.args, budget=0.5, argnums=1),
        lambda: jremat.measure(m.loss, *m.args, argnums=1),
        lambda: jremat.measure(m.loss, *m.args, argnums=(0, 1)),
        lambda: jremat.auto(m.loss, budget=0.5, argnums=1)(*m.args),
    ):
        with pytest.raises(TypeError, match="no floating-point leaves"):
            call()
    # an empty pytree has nothing to differentiate either
    with pytest.raises(TypeError, match="no floating-point leaves"):
        jremat.trace(lambda p, x: jnp.sum(x), {}, jnp.ones(3))


def test_non_scalar_output_is_a_type_error(cache):
    m = cache.model("mlp_chain")

    def vector_loss(params, x):
        return m.loss(params, x) * jnp.ones(3)

    def int_loss(params, x):
        return jnp.sum(x).astype(jnp.int32) + 0 * jnp.sum(params[0]["w1"]).astype(jnp.int32)

    def two_losses(params, x):
        return m.loss(params, x), m.loss(params, x)

    for fn in (vector_loss, int_loss, two_losses):
        with pytest.raises(TypeError, match="scalar floating-point loss"):
            jremat.measure(fn, *m.args)
        with pytest.raises(TypeError, match="scalar floating-point loss"):
            jremat.plan(fn, *m.args, budget=0.5)


@pytest.mark.parametrize("argnums", [2, -3, (0, 2), 7])
def test_argnums_out_of_range_is_a_value_error(cache, argnums):
    m = cache.model("mlp_chain")  # two positional arguments
    for call in (
        lambda: jremat.trace(m.loss, *m.args, argnums=argnums),
        lambda: jremat.plan(m.loss, *m.args, budget=0.5, argnums=argnums),
        lambda: jremat.measure(m.loss, *m.args, argnums=argnums),
        lambda: jremat.auto(m.loss, budget=0.5, argnums=argnums)(*m.args),
    ):
        with pytest.raises(ValueError, match="out of range"):
            call()


def test_negative_in_range_argnums_is_accepted(cache):
    m = cache.model("mlp_chain")
    g = jremat.trace(m.loss, *m.args, argnums=-2)  # == 0
    assert g.diff_invars == jremat.trace(m.loss, *m.args, argnums=0).diff_invars


def test_plan_used_with_other_shapes_raises_plan_mismatch(cache):
    m = cache.model("mlp_chain")
    params, x = m.args
    plan = recipe_plan(jremat.trace(m.loss, *m.args), "nothing_saveable", "layers")
    f = jremat.rematerialize(m.loss, plan)
    f(params, x)  # the planned signature works
    for other in (x[:64], x.astype(jnp.bfloat16)):  # other batch size, other dtype
        with pytest.raises(jremat.PlanMismatchError, match="jremat.plan"):
            jax.grad(f)(params, other)
    with pytest.raises(jremat.PlanMismatchError):
        jax.jit(jax.grad(f))(params[:5], x)  # fewer layers: another program
    assert issubclass(jremat.PlanMismatchError, ValueError)


def _sin_cos(a, b):
    return jnp.sum(jnp.sin(a) * jnp.cos(b))


def _cos_sin(a, b):  # the same primitives on the same shapes, wired the other way round
    return jnp.sum(jnp.sin(b) * jnp.cos(a))


def test_plan_for_another_wiring_of_the_same_primitives_raises_plan_mismatch(tmp_path):
    from jremat._src.plan.plan import KEEP, Plan, Segment

    a, b = jnp.linspace(0.0, 1.0, 64).reshape(8, 8), jnp.linspace(1.0, 2.0, 64).reshape(8, 8)
    g, other = jremat.trace(_sin_cos, a, b), jremat.trace(_cos_sin, a, b)
    assert [n.primitive for n in g.nodes] == [n.primitive for n in other.nodes]
    assert [v.shape for v in g.values] == [v.shape for v in other.values]
    assert g.fingerprint != other.fingerprint  # which value feeds which equation counts
    plan = Plan(
        [Segment(0, 3, "nothing_saveable"), Segment(3, g.num_nodes, KEEP)],
        g.fingerprint,
        g.num_nodes,
    )
    plan.save(tmp_path / "plan.json")
    loaded = jremat.Plan.load(tmp_path / "plan.json")
    for p in (plan, loaded):  # a saved and loaded plan still matches its own program
        np.testing.assert_allclose(
            jax.grad(jremat.rematerialize(_sin_cos, p))(a, b), jax.grad(_sin_cos)(a, b), rtol=1e-6
        )
        with pytest.raises(jremat.PlanMismatchError, match="wiring"):
            jax.grad(jremat.rematerialize(_cos_sin, p))(a, b)


def test_plan_of_another_function_raises_plan_mismatch(cache):
    m = cache.model("mlp_chain")
    plan = recipe_plan(jremat.trace(m.loss, *m.args), "nothing_saveable", "layers")

    def other(params, x):  # same argument shapes, different program
        return m.loss(params, jnp.sin(x))

    with pytest.raises(jremat.PlanMismatchError):
        jremat.rematerialize(other, plan)(*m.args)


# -- infeasible budgets ------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0.3, 0.5, 0.7])
def test_unet_budget_holds_or_states_a_smallest_budget_that_holds(cache, budget):
    m = cache.model("unet")
    base = cache.baseline("unet").temp_bytes
    p = cache.plan("unet", budget)
    if isinstance(p, jremat.InfeasibleBudgetError):
        e = p
        assert isinstance(e, ValueError)
        assert e.budget == budget
        assert budget < e.smallest_reachable <= 1.0
        # the stated fraction is the compiled temp of the smallest plan, rounded up
        assert e.smallest_reachable == pytest.approx(e.smallest_reachable_bytes / base, abs=1e-4)
        assert e.smallest_reachable >= e.smallest_reachable_bytes / base
        assert f"{e.smallest_reachable:.4g}" in str(e)
        # re-plan at the stated budget: it holds on the compiled program
        p = cache.plan("unet", e.smallest_reachable)
        assert not isinstance(p, Exception), p
        budget = e.smallest_reachable
    temp = jremat.measure(jremat.rematerialize(m.loss, p), *m.args).temp_bytes
    assert temp <= budget * base
    if not p.is_identity:
        assert temp == p.measured_temp_bytes


def test_unet_smallest_reachable_is_the_same_for_every_infeasible_budget(cache):
    errs = [cache.plan("unet", b) for b in (0.3, 0.5, 0.7)]
    errs = [e for e in errs if isinstance(e, jremat.InfeasibleBudgetError)]
    assert len({(e.smallest_reachable, e.smallest_reachable_bytes) for e in errs}) <= 1


def test_infeasible_byte_budget_states_bytes_that_hold(cache):
    """With an int budget the smallest reachable budget is stated in footprint bytes."""
    m = cache.model("mlp_chain")
    base = cache.baseline("mlp_chain")
    with pytest.raises(jremat.InfeasibleBudgetError) as info:
        jremat.plan(
            m.loss, *m.args, budget=base.footprint_bytes - base.temp_bytes + 1, solver=SOLVER
        )
    e = info.value
    assert isinstance(e.smallest_reachable, int)
    fixed = base.footprint_bytes - base.temp_bytes
    assert e.smallest_reachable == e.smallest_reachable_bytes + fixed
    assert e.smallest_reachable < base.footprint_bytes
    p = jremat.plan(m.loss, *m.args, budget=e.smallest_reachable, solver=SOLVER)
    got = jremat.measure(jremat.rematerialize(m.loss, p), *m.args)
    assert got.footprint_bytes <= e.smallest_reachable


def test_tiny_fraction_is_infeasible_with_a_fraction_stated(cache):
    m = cache.model("mlp_chain")
    with pytest.raises(jremat.InfeasibleBudgetError) as info:
        jremat.plan(m.loss, *m.args, budget=0.01, solver=SOLVER)
    e = info.value
    assert 0.01 < e.smallest_reachable < 1.0
    assert math.isclose(
        e.smallest_reachable,
        math.ceil(e.smallest_reachable_bytes / cache.baseline("mlp_chain").temp_bytes * 1e4) / 1e4,
    )
    # auto raises it at the first call, not at decoration
    wrapped = jremat.auto(m.loss, budget=0.01, solver=SOLVER)
    with pytest.raises(jremat.InfeasibleBudgetError):
        wrapped(*m.args)
    assert wrapped.plans == {}


# Regression: with verify=False the stated smallest budget is still a valid budget (<= 1.0).
def test_unverified_smallest_reachable_is_a_valid_budget(cache):
    m = cache.model("custom_vjp")
    try:
        jremat.plan(m.loss, *m.args, budget=0.5, verify=False, solver=SOLVER)
    except jremat.InfeasibleBudgetError as e:
        assert 0.5 < e.smallest_reachable <= 1.0
        parse_budget(e.smallest_reachable)


# -- plan files: validated where they enter -------------------------------------------------
def _plan_text(**fields):
    import json

    d = {"segments": [{"start": 0, "end": 3, "policy": "keep"}], "fingerprint": "x"}
    d["num_nodes"] = 3
    d.update(fields)
    return json.dumps(d)


@pytest.mark.parametrize(
    "text, shown",
    [
        ("null", "the top level must be an object"),
        ("42", "the top level must be an object"),
        ('"a plan"', "the top level must be an object"),
        ('{"segments": 7, "fingerprint": "x", "num_nodes": 3}', "Plan.segments must be a list"),
        ('{"segments": [3], "fingerprint": "x", "num_nodes": 3}', "Plan.segments[0] must be"),
        (_plan_text(num_nodes="many"), "Plan.num_nodes must be an int >= 0, got str 'many'"),
        (_plan_text(measured_temp_bytes="lots"), "Plan.measured_temp_bytes must be an int or null"),
        (_plan_text(measured_flops=[1]), "Plan.measured_flops must be a number or null"),
        (_plan_text(fingerprint=5), "Plan.fingerprint must be a string"),
        (_plan_text(notes="hi"), "Plan.notes must be a list of strings"),
        (
            _plan_text(segments=[{"start": 0, "end": 3, "stored_bytes": "big"}]),
            "Plan.segments[0].stored_bytes must be a number",
        ),
    ],
)
def test_plan_file_of_the_wrong_shape_names_the_file_and_field(tmp_path, text, shown):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        jremat.Plan.load(path)
    assert str(info.value).startswith(str(path)), info.value
    assert shown in str(info.value), info.value


def test_corrupt_file_in_plan_dir_is_named_and_planned_again(tmp_path):
    def loss(w, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w))

    w, x = jnp.ones((8, 8)) * 0.1, jnp.ones((4, 8))
    f = jremat.auto(loss, budget=1.0, plan_dir=tmp_path)
    want = jax.grad(loss)(w, x)
    jax.grad(f)(w, x)
    (saved,) = tmp_path.glob("jremat-*.json")
    saved.write_text("42")
    g = jremat.auto(loss, budget=1.0, plan_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=str(saved.name)):
        got = jax.grad(g)(w, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert g.plan_cache.solves == 1
    assert jremat.Plan.load(saved).num_nodes > 0  # overwritten with a valid plan

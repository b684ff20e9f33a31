"""jremat under SPMD on 8 host devices: sharded `jit` (data, tensor, data + tensor parallel),
committed shardings read through the caller's `jit`, `shard_map` bodies, explicit sharding.

The suite runs with 8 host devices (conftest.py sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8`); run with fewer, these tests skip.

Every figure is per device: `memory_analysis()` of the SPMD-partitioned step.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import models as M
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jremat
from jremat._src.base.sharding import shard_args

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (conftest.py "
    "sets it unless XLA_FLAGS names a device count)",
)

AUTO = jax.sharding.AxisType.Auto
LAYER_TP = {"wqkv": P(None, "model"), "wo": P("model", None), "w1": P(None, "model"),
            "w2": P("model", None)}  # fmt: skip


def decoder_shardings(params, data: str | None, model: str | None):
    """(params specs, tokens spec): Megatron-style tensor parallelism over `model` (column-
    then row-parallel matmuls), the batch over `data`."""
    layer = {k: (v if model else P()) for k, v in LAYER_TP.items()}
    pspec = {"embed": P(), "pos": P(), "layers": [layer] * len(params["layers"]), "head": P()}
    return (pspec, P(data) if data else P())


def put(args, specs, mesh):
    shardings = jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    return jax.device_put(args, shardings)


def max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def per_device_temp(fn, args) -> int:
    """Temp bytes of `jit(value_and_grad(fn))` compiled on the (sharded) concrete `args`,
    without jremat's measure: the reference figure."""
    exe = jax.jit(jax.value_and_grad(fn)).lower(*args).compile()
    return int(exe.memory_analysis().temp_size_in_bytes)


def mlp_shardings(params, data: str | None, model: str | None):
    """Megatron MLP: w1 columns and w2 rows over `model`; the batch over `data`."""
    layer = {"w1": P(None, model), "w2": P(model, None)} if model else {"w1": P(), "w2": P()}
    return ([layer] * len(params), P(data) if data else P())


#: (model, mesh shape, axis names, data axis, tensor axis). The issue's done-when case is the
#: GPT-style decoder under data + tensor parallelism on 2x4; data-only and tensor-only
#: parallelism run on the MLP chain, whose sharded steps compile several times faster.
CASES = {
    "decoder data+tensor 2x4": ("decoder", (2, 4), ("data", "model"), "data", "model"),
    "mlp data 8": ("mlp", (8,), ("data",), "data", None),
    "mlp tensor 8": ("mlp", (8,), ("model",), None, "model"),
}


@pytest.fixture(scope="module")
def model():
    return M.decoder(depth=3, d=32, heads=4, seq=32, batch=16, vocab=32)


@pytest.fixture(scope="module")
def chain():
    return M.mlp_chain(depth=6, width=16, batch=4096)


@pytest.mark.parametrize("case", list(CASES))
def test_auto_under_sharded_jit_keeps_gradients_and_fits_half(model, chain, case):
    """The done-when of issue 7: under sharded `jit`, `auto(budget=0.5)` keeps gradients exact
    and the per-device compiled temp within half of the unrematerialized per-device temp."""
    kind, shape, names, data, tp = CASES[case]
    m, shardings = (model, decoder_shardings) if kind == "decoder" else (chain, mlp_shardings)
    mesh = jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))
    specs = shardings(m.params, data, tp)
    args = put(m.args, specs, mesh)
    # inside jit (Auto mode) the tracers do not reveal their shardings: in_shardings says them
    f = jremat.auto(m.loss, budget=0.5, solver=M.SOLVER, max_rounds=1,
                    in_shardings=specs, mesh=mesh)  # fmt: skip
    got = jax.jit(jax.grad(f))(*args)
    want = jax.jit(jax.grad(m.loss))(*args)
    assert max_diff(got, want) <= 1e-6
    (plan,) = f.plans.values()
    assert not plan.is_identity
    base = per_device_temp(m.loss, args)
    assert plan.baseline_temp_bytes == base  # jremat's baseline is the per-device figure
    # the single-device program is larger: the figures are per device
    assert base < per_device_temp(m.loss, m.args)
    temp = per_device_temp(jremat.rematerialize(m.loss, plan), args)
    # measured: the larger of the plan's value_and_grad and grad steps (both must fit)
    assert temp <= plan.measured_temp_bytes <= 0.5 * base


def test_trace_bytes_are_per_device(model):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    specs = decoder_shardings(model.params, "data", "model")
    g = jremat.trace(model.loss, *shard_args(model.args, specs, mesh))
    assert g.mesh_axes == {"data": 2, "model": 4}
    by_shape = {}
    for vid in g.invars:
        v = g.values[vid]
        by_shape.setdefault(v.shape, set()).add((v.nbytes, v.global_nbytes))
    assert by_shape[(32, 96)] == {(96 * 32 * 4 // 4, 96 * 32 * 4)}  # wqkv: columns over model
    assert by_shape[(16, 33)] == {(8 * 33 * 4, 16 * 33 * 4)}  # tokens: batch over data
    assert (32 * 32 * 4, 32 * 32 * 4) in by_shape[(32, 32)]  # embed: replicated
    # the layers' wo (32, 32 as embed): rows over model
    wo = [g.values[i] for i in g.invars if g.values[i].spec == (("model",), ())]
    assert wo and all(v.nbytes * 4 == v.global_nbytes for v in wo)
    # the first matmul's output (batch over data, columns over model): 1/8 of its bytes
    qkv = [v for v in g.values if v.shape == (16, 32, 96)]
    assert qkv and qkv[0].spec == (("data",), (), ("model",))
    assert qkv[0].nbytes * 8 == qkv[0].global_nbytes


def test_measure_reports_per_device_bytes(model):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    specs = decoder_shardings(model.params, "data", "model")
    m = jremat.measure(model.loss, *model.args, in_shardings=specs, mesh=mesh)
    single = jremat.measure(model.loss, *model.args)
    assert m.num_devices == 8 and single.num_devices == 1
    g = jremat.trace(model.loss, *shard_args(model.args, specs, mesh))
    shard_bytes = sum(g.values[i].nbytes for i in g.invars)
    assert m.argument_bytes == shard_bytes < single.argument_bytes
    assert m.temp_bytes == per_device_temp(model.loss, put(model.args, specs, mesh))
    # sharded concrete arrays say the same without in_shardings
    assert jremat.measure(model.loss, *put(model.args, specs, mesh)).temp_bytes == m.temp_bytes


@pytest.mark.parametrize("collective", [False, True], ids=["local-loss", "psum-in-fn"])
def test_auto_inside_shard_map(chain, collective):
    """`auto` planned inside a shard_map body: the values are per device already; the plan is
    compiled over a mesh with the body's axes (collectives bound) and fits half of the
    per-device unrematerialized temp."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    params, x = chain.args

    def local(p, xb):
        out = chain.loss(p, xb)
        return jax.lax.psum(out, "model") / 4 if collective else out

    f = jremat.auto(local, budget=0.5, solver=M.SOLVER, max_rounds=1)

    axes = ("data",) if collective else ("data", "model")  # a psum'd loss no longer varies

    def step(loss):
        body = lambda p, xb: jax.lax.pmean(loss(p, xb), axes)  # noqa: E731
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(("data", "model"))), out_specs=P())
        return jax.jit(jax.grad(sm))(params, x)

    assert max_diff(step(f), step(local)) <= 1e-6
    (plan,) = f.plans.values()
    assert plan.measured_temp_bytes <= 0.5 * plan.baseline_temp_bytes
    # the per-device program: the local batch is 4096 / 8; its standalone step is within
    # 1% of jremat's baseline (which adds the psum of the replicated parameters' gradients)
    alone = jremat.measure(chain.loss, params, x[:512]).temp_bytes
    assert abs(plan.baseline_temp_bytes - alone) <= 0.01 * alone


def _dp_mlp_loss(named: bool):
    """A 4-layer residual MLP (width 64) loss, its layers under `layer_<i>` scopes or not."""

    def layer(x, p):
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

    def loss(params, x):
        for i, p in enumerate(params):
            if named:
                with jax.named_scope(f"layer_{i}"):
                    x = layer(x, p)
            else:
                x = layer(x, p)
        return jnp.mean(x**2)

    def checkpointed(params, x):  # per-layer jax.checkpoint, nothing saved: the reference
        for p in params:
            x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x, p)
        return jnp.mean(x**2)

    return loss, checkpointed


@pytest.mark.parametrize("named", [True, False], ids=["named-layers", "unnamed-layers"])
def test_auto_in_a_data_parallel_shard_map_step_holds_in_the_real_step(named):
    """Issue 14, item 2: `auto` inside the body of a data-parallel `shard_map` step, judged on
    the step that runs (`jit(grad(outer))`, outer calling the shard_map): at a budget a little
    above what per-layer `jax.checkpoint` reaches (at most 0.65), a plan is returned, the real
    step's per-device temp is within the budget, jremat's figures are the real step's and the
    gradients are exact. (Without names a stated smallest reachable budget would be reached
    by a new call.)"""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    m = M.mlp_chain(depth=4, width=64, batch=4096, mult=4)
    params, x = m.args
    loss, checkpointed = _dp_mlp_loss(named)

    def step(fn):
        """The caller's step, compiled: `jit(grad(outer))`, outer calling the shard_map."""

        def outer(p, xs):
            body = lambda p, xb: jax.lax.pmean(fn(p, xb), "data")  # noqa: E731
            return jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(p, xs)

        return jax.jit(jax.grad(outer)).lower(params, x).compile()

    def real_temp(exe) -> int:
        return int(exe.memory_analysis().temp_size_in_bytes)

    unremat = step(loss)
    base = real_temp(unremat)
    budget = min(real_temp(step(checkpointed)) / base, 0.6) + 0.05
    f = jremat.auto(loss, budget=budget, solver=M.SOLVER, max_rounds=1)
    try:
        planned = step(f)
    except jremat.InfeasibleBudgetError as e:
        assert not named, e  # named layers: per-layer checkpointing is among the plans tried
        budget = e.smallest_reachable
        f = jremat.auto(loss, budget=budget, solver=M.SOLVER, max_rounds=1)
        planned = step(f)
    (plan,) = f.plans.values()
    temp = real_temp(planned)
    assert not plan.is_identity
    assert temp <= budget * base
    # the program jremat verified is the one that runs: same baseline; the plan's temp is
    # the most of the steps a caller may run around the body (this one, and value_and_grad
    # with the gradients all-reduced inside the body: 1.9% of the baseline more here), so it
    # bounds this step's from above, closely
    assert abs(plan.baseline_temp_bytes - base) <= 0.01 * base
    assert temp <= plan.measured_temp_bytes <= temp + 0.025 * base
    assert max_diff(planned(params, x), unremat(params, x)) <= 1e-6


def test_auto_under_explicit_sharding_reads_the_avals(chain):
    """In explicit sharding mode the tracers carry their shardings: no in_shardings needed."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params, x = chain.args
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        f = jremat.auto(chain.loss, budget=0.5, solver=M.SOLVER, max_rounds=1)
        got = jax.jit(jax.grad(f))(params, xs)
        want = jax.jit(jax.grad(chain.loss))(params, xs)
        base = jremat.measure(chain.loss, params, xs).temp_bytes
    assert max_diff(got, want) <= 1e-6
    (plan,) = f.plans.values()
    assert plan.baseline_temp_bytes == base
    assert base * 4 < jremat.measure(chain.loss, params, x).temp_bytes  # per device
    assert plan.measured_temp_bytes <= 0.5 * base


def test_byte_budget_is_per_device(chain):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    specs = mlp_shardings(chain.params, "data", None)
    m = jremat.measure(chain.loss, *chain.args, in_shardings=specs, mesh=mesh)
    fixed = m.footprint_bytes - m.temp_bytes
    assert fixed == m.argument_bytes + m.output_bytes - m.alias_bytes
    budget = int(fixed + 0.6 * m.temp_bytes)  # bytes of one device's footprint
    p = jremat.plan(chain.loss, *chain.args, budget=budget, solver=M.SOLVER, max_rounds=1,
                    in_shardings=specs, mesh=mesh)  # fmt: skip
    assert p.baseline_temp_bytes == m.temp_bytes
    assert p.measured_temp_bytes + fixed <= budget
    # on one device the same byte budget is far below the unrematerialized step's footprint
    assert budget < 0.5 * jremat.measure(chain.loss, *chain.args).footprint_bytes


def test_auto_refuses_to_plan_where_the_caller_places_values_itself():
    """Where the caller's `jit` constrains a value's sharding before the loss sees it
    (`with_sharding_constraint`), GSPMD decides the loss's partitioning at compile time: auto
    raises at trace time naming what to pass, instead of planning for a guess; with the
    sharding stated (`in_shardings=`) it plans for it."""
    m = M.mlp_chain(depth=2, width=8, batch=64)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    f = jremat.auto(m.loss, budget=0.9, verify=False)

    def step(loss):
        def run(params, x):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
            return jax.grad(loss)(params, x)

        return run

    with pytest.raises(ValueError, match=r"in_shardings=.*PartitionSpec\(\)") as info:
        jax.jit(step(f))(*m.args)
    assert "8 devices and no mesh set" in str(info.value)
    stated = jremat.auto(m.loss, budget=0.9, verify=False, in_shardings=(P(), P("data")),
                         mesh=mesh)  # fmt: skip
    assert max_diff(jax.jit(step(stated))(*m.args), jax.grad(m.loss)(*m.args)) < 1e-6


# -- the caller's jit, no in_shardings: the program that runs is read off the jit trace --------
def running_temp(step, args) -> int:
    """Per-device temp bytes of the caller's own step, `jit(step)` on `args`."""
    return int(jax.jit(step).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def rel_err(got, want) -> float:
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True)
    )  # fmt: skip


def _auto_case(case: str):
    """(jremat.auto keywords, step of a loss, loss, args) for one way users call `auto`."""
    m = M.mlp_chain(depth=4, width=16, batch=2048)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    grad = jax.grad
    loss, args, kw = m.loss, m.args, {}
    if case == "committed data+tensor":
        args = put(m.args, mlp_shardings(m.params, "data", "model"), mesh)
    elif case == "committed batch, uncommitted params":
        args = (m.params, jax.device_put(m.args[1], NamedSharding(mesh, P("data"))))
    elif case == "prevent_cse=False":
        kw = {"prevent_cse": False}
    elif case == "has_aux":
        kw = {"has_aux": True}
        loss = lambda p, x: (m.loss(p, x), {"loss": m.loss(p, x)})  # noqa: E731
        grad = lambda f: jax.grad(f, has_aux=True)  # noqa: E731
    elif case == "static string":
        loss = lambda p, x, mode: m.loss(p, x) * (2.0 if mode == "double" else 1.0)  # noqa: E731
        args = (*m.args, "double")
    return kw, grad, loss, args


AUTO_CASES = ["unsharded", "committed data+tensor", "committed batch, uncommitted params",
              "prevent_cse=False", "has_aux", "static string"]  # fmt: skip


@pytest.mark.parametrize("case", AUTO_CASES)
def test_auto_under_the_callers_jit_meets_its_budget_on_the_step_that_runs(case):
    """Issue 28: on a host with 8 devices, `jax.jit(jax.grad(auto(loss)))` with no
    `in_shardings` plans for the program that runs: unsharded arrays as the one-device
    program they are, committed sharded arrays under the shardings they carry (read off the
    caller's `jit`), and so with `prevent_cse=False`, `has_aux` and a static string argument.
    The caller's own step meets the budget per device, with exact gradients."""
    kw, grad, loss, args = _auto_case(case)
    budget = 0.6
    f = jremat.auto(loss, budget=budget, solver=M.SOLVER, plan_dir=False, **kw)
    static = (2,) if case == "static string" else ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # prevent_cse=False at the top level
        got = jax.jit(grad(f), static_argnums=static)(*args)
        step = jax.jit(grad(f), static_argnums=static)
        temp = int(step.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    plain = jax.jit(grad(loss), static_argnums=static)
    base = int(plain.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    (plan,) = f.plans.values()
    assert not plan.is_identity
    assert temp <= budget * base, (temp / base, plan.measured_temp_bytes / plan.baseline_temp_bytes)
    assert rel_err(got, plain(*args)) <= 1e-5
    sharded = case.startswith("committed")
    # per-device figures where the arguments are sharded; the one-device program's otherwise
    one_device = jax.jit(jax.value_and_grad(m_loss(loss, case))).lower(
        *_unsharded(args, case)).compile().memory_analysis().temp_size_in_bytes  # fmt: skip
    assert (plan.baseline_temp_bytes < one_device) == sharded


def m_loss(loss, case):
    if case == "has_aux":
        return lambda p, x: loss(p, x)[0]
    if case == "static string":
        return lambda p, x: loss(p, x, "double")
    return loss


def _unsharded(args, case):
    args = args[:2] if case == "static string" else args
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)


def test_auto_in_a_scan_under_jit_and_under_jits_own_in_shardings():
    """Two callers whose tracers are not the caller's arrays: gradient accumulation with a
    `lax.scan` over microbatches around `grad(auto(loss))` in `jit`, nothing sharded (the loop
    body's slices are on no mesh: planned as the one-device program, no in_shardings); and a
    `jit` given `in_shardings` of its own over uncommitted arrays (which the avals do not
    show: read from `jit`). Each meets the budget on the step that runs, gradients exact."""
    m = M.mlp_chain(depth=3, width=16, batch=4096)
    params, x = m.args
    f = jremat.auto(m.loss, budget=0.6, solver=M.SOLVER, plan_dir=False)

    def accumulate(loss):
        def step(p, xs):
            def body(acc, xb):
                g = jax.grad(loss)(p, xb)
                return jax.tree_util.tree_map(jnp.add, acc, g), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, p)
            return jax.lax.scan(body, zeros, xs)[0]

        return step

    micro = x.reshape(4, -1, x.shape[-1])
    got = jax.jit(accumulate(f))(params, micro)
    assert rel_err(got, jax.jit(accumulate(m.loss))(params, micro)) <= 1e-5
    assert running_temp(accumulate(f), (params, micro)) <= 0.6 * running_temp(
        accumulate(m.loss), (params, micro))  # fmt: skip

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    given = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    g = jremat.auto(m.loss, budget=0.6, solver=M.SOLVER, plan_dir=False)
    step = jax.jit(jax.grad(g), in_shardings=given)
    assert rel_err(step(params, x), jax.grad(m.loss)(params, x)) <= 1e-5
    (plan,) = g.plans.values()
    plain = jax.jit(jax.grad(m.loss), in_shardings=given).lower(params, x).compile()
    assert plan.baseline_temp_bytes == per_device_temp(m.loss, put(m.args, (P(), P("data")), mesh))
    temp = step.lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 0.6 * plain.memory_analysis().temp_size_in_bytes


def test_auto_under_nested_jits_reads_the_outer_arguments():
    """`jit(step)` calling `jit(grad(auto(loss)))`: the inner jit's arguments are the outer
    trace's inputs, whose committed shardings are read in turn."""
    m = M.mlp_chain(depth=3, width=16, batch=2048)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    args = put(m.args, mlp_shardings(m.params, "data", None), mesh)
    f = jremat.auto(m.loss, budget=0.6, solver=M.SOLVER, plan_dir=False)
    step = jax.jit(lambda p, x: jax.jit(jax.grad(f))(p, x))
    got = step(*args)
    assert rel_err(got, jax.jit(jax.grad(m.loss))(*args)) <= 1e-5
    (plan,) = f.plans.values()
    assert plan.baseline_temp_bytes == per_device_temp(m.loss, args)
    assert running_temp(lambda p, x: jax.jit(jax.grad(f))(p, x), args) <= 0.6 * (
        running_temp(jax.grad(m.loss), args)
    )


def test_auto_under_eager_grad_reads_the_concrete_shardings():
    """`jax.grad(auto(loss))` called on sharded concrete arrays (no jit): the JVP tracers wrap
    the arrays, whose shardings are read; the plan is per device and holds in the step."""
    m = M.mlp_chain(depth=3, width=8, batch=512)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    args = put(m.args, mlp_shardings(m.params, "data", None), mesh)
    f = jremat.auto(m.loss, budget=0.6, solver=M.SOLVER, max_rounds=1)
    assert max_diff(jax.grad(f)(*args), jax.grad(m.loss)(*args)) <= 1e-6
    (plan,) = f.plans.values()
    base = per_device_temp(m.loss, args)
    assert plan.baseline_temp_bytes == base
    assert per_device_temp(jremat.rematerialize(m.loss, plan), args) <= 0.6 * base


@pytest.mark.parametrize("check_vma", [True, False])
def test_auto_in_a_shard_map_body_whose_gradients_are_all_reduced_inside(check_vma):
    """The common data-parallel step: `value_and_grad` inside the `shard_map` body, then
    `pmean` of loss and gradients over the batch axis. The gradient all-reduce can hold more
    temp than the body's backward pass: with `check_vma=False` (no varying axes to read) the
    plan said 0.647 of its stand-in's temp and the running step held 1.41x its budget (a
    breaker's 4-layer MLP whose replicated gradients outweigh its activations). The step that
    runs stays within the budget, or the budget is refused with the smallest reachable one,
    which then holds."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    m = M.mlp_chain(depth=4, width=128, batch=512, mult=2)
    params, x = m.args
    loss, _ = _dp_mlp_loss(named=True)

    def step(fn):
        def body(p, xb):
            return jax.lax.pmean(jax.value_and_grad(fn)(p, xb), "data")

        sm = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma
        )
        return jax.jit(sm).lower(params, x).compile()

    unremat = step(loss)
    budget = 0.75
    f = jremat.auto(loss, budget=budget, solver=M.SOLVER, max_rounds=1)
    try:
        planned = step(f)
    except jremat.InfeasibleBudgetError as e:
        budget = e.smallest_reachable
        f = jremat.auto(loss, budget=budget, solver=M.SOLVER, max_rounds=1)
        planned = step(f)
    (plan,) = f.plans.values()
    temp = int(planned.memory_analysis().temp_size_in_bytes)
    assert temp <= budget * plan.baseline_temp_bytes
    assert max_diff(planned(params, x), unremat(params, x)) <= 1e-6


# -- the private read of jit's placement checks itself (issue 47) -------------------------------
@pytest.fixture
def renamed_jit_frames(monkeypatch):
    """JAX as if it renamed the frames `compat.jit_traces` reads (as it did twice in six
    months): the self-check probed afresh, its warning not yet given; both restored after."""
    from jremat._src.base import compat
    from jremat._src.base import sharding as sh

    monkeypatch.setattr(compat, "_JIT_FRAME", ("pjit.py", "_trace_for_jit_renamed"))
    monkeypatch.setattr(compat, "_TRACE_FRAMES", ("partial_eval.py", ("renamed_trace",)))
    monkeypatch.setattr(sh, "_UNREADABLE_WARNED", [])
    compat.jit_frames_readable.cache_clear()
    yield
    compat.jit_frames_readable.cache_clear()


def test_the_jit_frame_read_passes_its_self_check_on_this_jax():
    from jremat._src.base import compat

    compat.jit_frames_readable.cache_clear()
    assert compat.jit_frames_readable()


def test_a_broken_jit_frame_read_refuses_instead_of_planning_a_guess(renamed_jit_frames):
    """With the read broken, committed sharded arrays and uncommitted arrays under `jit`'s own
    `in_shardings` are refused with an error naming the JAX version and what to pass (without
    the self-check the first blamed the user's program and the second was planned as the
    one-device program, over budget); one RuntimeWarning per process; with `in_shardings=`
    given to `auto` the step plans, meets its budget and has exact gradients."""
    from jremat._src.base import compat

    m = M.mlp_chain(depth=3, width=16, batch=2048)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    committed = put(m.args, mlp_shardings(m.params, "data", None), mesh)
    given = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))
    f = jremat.auto(m.loss, budget=0.5, solver=M.SOLVER, plan_dir=False)
    with pytest.warns(RuntimeWarning, match="cannot read how jax.jit places") as caught:
        with pytest.raises(ValueError, match=rf"jax {jax.__version__}.*in_shardings=") as info:
            jax.jit(jax.grad(f))(*committed)
    assert "Explicit" in str(info.value)
    assert not compat.jit_frames_readable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # warned once: not again
        with pytest.raises(ValueError, match=rf"jax {jax.__version__}"):
            jax.jit(jax.grad(f), in_shardings=given)(*m.args)
    assert len([w for w in caught if "cannot read" in str(w.message)]) == 1
    assert not f.plans
    stated = jremat.auto(m.loss, budget=0.6, solver=M.SOLVER, plan_dir=False,
                         in_shardings=(P(), P("data")), mesh=mesh)  # fmt: skip
    step = jax.jit(jax.grad(stated), in_shardings=given)
    assert rel_err(step(*m.args), jax.grad(m.loss)(*m.args)) <= 1e-5
    plain = jax.jit(jax.grad(m.loss), in_shardings=given).lower(*m.args).compile()
    temp = step.lower(*m.args).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 0.6 * plain.memory_analysis().temp_size_in_bytes

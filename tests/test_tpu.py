"""Plans for a TPU, compiled on this host by libtpu for a topology's compile-only devices.

The memory figure jremat budgets is read per backend (`jremat.MEMORY_FIGURES`): on TPU the
compiler's heap peak less what is live all along, since its `temp_size_in_bytes` is 0. These
tests need libtpu (`pip install "jremat[tpu]"`, in the dev extra on the jax 0.12 line) and are
skipped without it; nothing runs on a TPU, so gradients are checked on CPU under the same plan.
The tests without libtpu (the reading of other platforms, the errors) run everywhere.
"""

from __future__ import annotations

import importlib.util
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jremat
from jremat._src.base import targets
from jremat._src.compile.xla import MemoryFigures

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "jremat[tpu]"): no TPU compiler to plan for',
)

LAYERS, WIDTH, BATCH = 3, 256, 1024


def mlp(params, x):
    for w1, w2 in params:
        x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x**2)


def per_layer(params, x):
    """`mlp` with each layer under `jax.checkpoint(nothing_saveable)`."""
    layer = jax.checkpoint(
        lambda x, w: x + jax.nn.gelu(x @ w[0]) @ w[1],
        policy=jax.checkpoint_policies.nothing_saveable,
    )
    for w in params:
        x = layer(x, w)
    return jnp.mean(x**2)


REPLICATED = P()


def abstract(mesh, weight_specs=(REPLICATED, REPLICATED), batch_spec=REPLICATED):
    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    params = [tuple(sds((WIDTH, WIDTH), s) for s in weight_specs) for _ in range(LAYERS)]
    return params, sds((BATCH, WIDTH), batch_spec)


def grad_figures(fn, *args) -> MemoryFigures:
    """The memory figures of the user's step, `jit(grad(fn))`, compiled for the args' devices."""
    return MemoryFigures.of(jax.jit(jax.grad(fn)).lower(*args).compile())


@needs_libtpu
def test_the_tpu_figure_is_the_compilers_peak_less_the_fixed_bytes():
    mesh = jremat.target_mesh("tpu:v5e:1x1")
    args = abstract(mesh)
    exe = jax.jit(jax.grad(mlp)).lower(*args).compile()
    raw = exe.memory_analysis()
    mem = MemoryFigures.of(exe)
    assert (mem.platform, mem.target) == ("tpu", "tpu:TPU v5 lite")
    assert mem.figure == jremat.MEMORY_FIGURES["tpu"]
    assert raw.temp_size_in_bytes == 0  # why the figure is not read from it on TPU
    assert mem.temp_bytes == raw.peak_memory_in_bytes - mem.fixed_bytes > 0
    assert mem.footprint_bytes == raw.peak_memory_in_bytes
    # per-layer remat moves the figure, as it moves the chip's peak
    assert grad_figures(per_layer, *args).temp_bytes < 0.8 * mem.temp_bytes


@needs_libtpu
def test_auto_inside_the_users_step_meets_its_budget_on_the_tpu_figure():
    mesh = jremat.target_mesh("tpu:v5e:1x1")
    args = abstract(mesh)
    loss = jremat.auto(mlp, budget=0.75, plan_dir=False)
    ran = grad_figures(loss, *args)  # the user's jit(grad) step, compiled for the TPU
    (plan,) = loss.plans.values()
    assert plan.target == "tpu:TPU v5 lite" and plan.memory_figure == jremat.MEMORY_FIGURES["tpu"]
    assert ran.temp_bytes <= plan.budget_temp_bytes
    assert ran.temp_bytes <= 0.75 * grad_figures(mlp, *args).temp_bytes
    assert "compiled for:    tpu:TPU v5 lite" in plan.summary()
    # the same plan on CPU (a compile-only TPU cannot run): gradients equal the plain ones
    k = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
    params = [
        (
            jax.random.normal(k[2 * i], (WIDTH, WIDTH)) / 16,
            jax.random.normal(k[2 * i + 1], (WIDTH, WIDTH)) / 16,
        )
        for i in range(LAYERS)
    ]
    x = jax.random.normal(k[-1], (BATCH, WIDTH))
    chex.assert_trees_all_close(
        jax.jit(jax.grad(jremat.rematerialize(mlp, plan)))(params, x),
        jax.jit(jax.grad(mlp))(params, x),
        atol=1e-6,
        rtol=1e-5,
    )


@needs_libtpu
def test_plan_on_a_2x2_mesh_is_per_device_and_holds_a_floor_there():
    mesh = jremat.target_mesh("tpu:v5e:2x2", ("data", "model"), (2, 2))
    args = abstract(mesh, (P(None, "model"), P("model", None)), P("data", None))
    base = grad_figures(mlp, *args)
    assert base.target == "tpu:TPU v5 lite x4"
    with pytest.raises(jremat.InfeasibleBudgetError) as err:
        jremat.plan(mlp, *args, budget=0.3)
    floor = err.value.smallest_reachable
    plan = jremat.plan(mlp, *args, budget=floor)  # the floor stated holds
    assert plan.measured_temp_bytes <= plan.budget_temp_bytes
    ran = grad_figures(jremat.rematerialize(mlp, plan), *args)
    assert ran.temp_bytes < base.temp_bytes


@needs_libtpu
def test_a_device_budget_is_a_share_of_the_chips_memory():
    mesh = jremat.target_mesh("tpu:v5e:1x1")
    plan = jremat.plan(mlp, *abstract(mesh), budget="0.9 device")
    hbm = jremat.DEVICE_MEMORY_BYTES["TPU v5 lite"]
    assert plan.budget_temp_bytes == int(0.9 * hbm) - plan.measured_footprint_bytes + (
        plan.measured_temp_bytes
    )
    assert plan.is_identity  # a 3-layer MLP fits in 90% of 16 GiB as it is


@needs_libtpu
def test_compare_compiles_for_the_target_and_runs_nothing():
    mesh = jremat.target_mesh("tpu:v5e:1x1")
    c = jremat.compare(mlp, *abstract(mesh), policies=["nothing_saveable"], budgets=())
    base, remat = c.rows
    assert remat.temp_bytes < base.temp_bytes and remat.max_grad_diff is None
    with pytest.raises(ValueError, match="runs > 0"):
        jremat.compare(mlp, *abstract(mesh), budgets=(), runs=1)


# -- without libtpu ---------------------------------------------------------------------------
class FakeDevice:
    def __init__(self, platform: str):
        self.platform, self.device_kind, self.id = platform, "fake", 0


def fake_executable(platform: str, temp: int, peak: int):
    sharding = types.SimpleNamespace(device_set={FakeDevice(platform)})
    mem = types.SimpleNamespace(
        temp_size_in_bytes=temp,
        peak_memory_in_bytes=peak,
        argument_size_in_bytes=100,
        output_size_in_bytes=50,
        alias_size_in_bytes=30,
    )
    return types.SimpleNamespace(
        memory_analysis=lambda: mem, input_shardings=((sharding,), {}), output_shardings=()
    )


@pytest.mark.parametrize(
    "platform, temp, peak, expected",
    [
        ("cpu", 1000, 150, 1000),  # CPU's peak counts arguments and outputs only
        ("cuda", 1000, 150, 1000),  # a CUDA device's platform: read as "gpu"
        ("tpu", 0, 1120, 1000),  # peak less argument + output - alias (120)
        ("tpu", 2000, 1120, 2000),  # never below a temp the compiler reports
    ],
)
def test_each_platform_reads_its_figure(platform, temp, peak, expected):
    mem = MemoryFigures.of(fake_executable(platform, temp, peak))
    assert mem.temp_bytes == expected and mem.fixed_bytes == 120


def test_an_unknown_platform_is_refused_not_planned_on():
    with pytest.raises(jremat.UnsupportedBackendError, match="'metal'.*cpu, gpu, tpu"):
        MemoryFigures.of(fake_executable("METAL", 0, 0))


def test_the_local_figure_is_xla_temp():
    exe = jax.jit(jax.grad(mlp)).lower(*abstract_local()).compile()
    mem = MemoryFigures.of(exe)
    assert mem.temp_bytes == exe.memory_analysis().temp_size_in_bytes > 0
    assert mem.figure == "temp_size_in_bytes"


def abstract_local():
    params = [(jnp.zeros((8, 8)), jnp.zeros((8, 8))) for _ in range(2)]
    return params, jnp.ones((4, 8))


def test_target_names_are_checked():
    with pytest.raises(ValueError, match="accepted: .*tpu:v5e:2x2"):
        jremat.target_mesh("gpu:h100")
    with pytest.raises(ValueError, match="no dimension of size 0"):  # libtpu: SIGFPE
        jremat.target_mesh("tpu:v5e:0x0")
    with pytest.raises(TypeError, match="axis_names must be a tuple of strings"):
        jremat.target_mesh("local", "data")
    with pytest.raises(ValueError, match="distinct"):
        jremat.target_mesh("local", ("a", "a"), (len(jax.devices()), 1))
    with pytest.raises(TypeError, match="axis_shape must be a tuple of positive ints"):
        jremat.target_mesh("local", ("a",), (2.5,))
    with pytest.raises(TypeError, match="target must be a string"):
        jremat.target_mesh(3)
    with pytest.raises(ValueError, match="axis_shape=.*product"):
        jremat.target_mesh("local", ("a", "b"), (3, 5))
    assert jremat.target_mesh("local").devices.size == len(jax.devices())


def test_a_missing_libtpu_names_the_install(monkeypatch):
    from jax.experimental import topologies

    def missing(**kw):
        raise RuntimeError("JAX TPU support not installed; cannot generate TPU topology.")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    targets._topology_devices.cache_clear()  # topologies are read once per process
    with pytest.raises(RuntimeError, match=r'pip install "jax\[tpu\]=='):
        jremat.target_mesh("tpu:v5e:2x2")
    targets._topology_devices.cache_clear()


@pytest.mark.parametrize("text, share", [("device", 1.0), ("0.9 device", 0.9), ("0.5device", 0.5)])
def test_device_budgets_parse(text, share):
    spec = jremat.parse_budget(text)
    assert spec.device_fraction == share and spec.footprint_bytes is None
    device = types.SimpleNamespace(
        memory_stats=lambda: {"bytes_limit": 1000}, device_kind="gpu", platform="gpu"
    )
    assert spec.for_device(device).footprint_bytes == int(share * 1000)


@pytest.mark.parametrize("text", ["1.5 device", "0 device", "x device"])
def test_bad_device_budgets_are_refused(text):
    with pytest.raises(ValueError, match="budget="):
        jremat.parse_budget(text)


def test_a_device_of_unknown_memory_is_refused():
    device = types.SimpleNamespace(memory_stats=lambda: None, device_kind="TPU v99", platform="tpu")
    with pytest.raises(ValueError, match="'TPU v99' is not known"):
        targets.device_memory_bytes(device)
    assert (
        targets.device_memory_bytes(
            types.SimpleNamespace(memory_stats=lambda: None, device_kind="TPU v5 lite")
        )
        == 16 * 2**30
    )
    np.testing.assert_equal(targets.device_memory_bytes(jax.devices()[0]) > 0, True)


def test_a_loss_closing_over_the_callers_tracers_reads_its_figures():
    # JAX passes closed-over tracers as inputs of their own, and the executable's
    # `input_shardings` then fails to unflatten: its devices are read from the outputs
    params, x = abstract_local()

    @jax.jit
    def step(params, x):
        loss = jremat.auto(lambda p: mlp(p, x), budget=0.9, plan_dir=False)
        return jax.grad(loss)(params)

    # float32 rounding of a recomputed forward: atol relative to the largest gradient entry
    want = jax.jit(jax.grad(mlp))(params, x)
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    chex.assert_trees_all_close(step(params, x), want, rtol=1e-5, atol=1e-5 * scale)


@needs_libtpu
def test_one_auto_plans_apart_for_each_tpu_kind():
    loss = jremat.auto(mlp, budget="0.5 device", plan_dir=False)
    for target in ("tpu:v5e:1x1", "tpu:v6e:1x1"):
        jax.jit(jax.grad(loss)).lower(*abstract(jremat.target_mesh(target))).compile()
    kinds = sorted(p.target for p in loss.plans.values())
    assert kinds == ["tpu:TPU v5 lite", "tpu:TPU v6 lite"]
    # two calls for one topology give meshes over the same devices
    assert (
        jremat.target_mesh("tpu:v5e:1x1").devices == jremat.target_mesh(" tpu:v5e:1x1 ").devices
    ).all()

"""The Recipes pages' scripts (examples/recipes/*.py, shown on docs/recipes/*.md) run and do
what their pages say: each script's `main()` returns what it computed, and the test checks
the gradients and the parameters after the step equal those of the same step without remat,
and that the plan's compiled (per-device) temp bytes are within the budget.

The scripts run in this process (8 host devices, conftest.py), each loaded from its file as a
fresh module, so its `jremat.auto` wrappers plan afresh.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import chex
import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "examples" / "recipes"
TOL = {"rtol": 1e-5, "atol": 1e-6}


def run(name: str) -> tuple[object, dict]:
    """Load examples/recipes/<name>.py as a module and call its main(): (module, results)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.main()


def assert_within_budget(plan, budget: float) -> None:
    assert plan.measured_temp_bytes <= budget * plan.baseline_temp_bytes, (
        plan.measured_temp_bytes,
        plan.baseline_temp_bytes,
    )
    assert plan.baseline_temp_bytes > 0


def needs_8_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (conftest.py sets 8 host devices)")


def test_sharded_train_step():
    needs_8_devices()
    m, r = run("sharded_train_step")
    assert_within_budget(r["plan"], m.BUDGET)
    chex.assert_trees_all_close(r["grads"], r["ref_grads"], **TOL)
    chex.assert_trees_all_close(r["params"], r["ref_params"], **TOL)
    chex.assert_trees_all_close(r["losses"], r["ref_losses"], rtol=1e-5)
    assert r["losses"][-1] < r["losses"][0]
    # the parameters stay sharded as the step's out_shardings say
    w1 = r["params"]["layers"][0]["w1"]
    assert w1.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    # the plan is per device: the batch and the hidden layer are split 2 and 4 ways
    assert (
        r["plan"].baseline_temp_bytes
        < 0.5
        * jax.jit(jax.grad(m.loss))
        .lower(m.init(jax.random.key(0)), m.make_batch(jax.random.key(1)))
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
    )


def test_shard_map_step():
    needs_8_devices()
    m, r = run("shard_map_step")
    assert_within_budget(r["plan"], m.BUDGET)
    chex.assert_trees_all_close(r["grads"], r["ref_grads"], **TOL)
    chex.assert_trees_all_close(r["params"], r["ref_params"], **TOL)
    chex.assert_trees_all_close(r["losses"], r["ref_losses"], rtol=1e-5)


def test_flax_linen_scan():
    m, r = run("flax_linen_scan")
    assert_within_budget(r["plan"], m.BUDGET)
    chex.assert_trees_all_close(r["grads"], r["ref_grads"], **TOL)
    chex.assert_trees_all_close(r["new_params"], r["ref_new_params"], **TOL)
    assert r["params"]["layers"]["Dense_0"]["kernel"].shape == (m.LAYERS, m.D, 4 * m.D)
    assert len(m.RematBlock.plan_cache.plans) == 1  # one plan for all the scanned layers


def test_flax_nnx_scan():
    m, r = run("flax_nnx_scan")
    assert_within_budget(r["plan"], m.BUDGET)
    chex.assert_trees_all_close(r["grads"], r["ref_grads"], **TOL)
    chex.assert_trees_all_close(r["new_params"], r["ref_new_params"], **TOL)
    assert r["grads"]["layers"]["up"]["kernel"][...].shape == (m.LAYERS, m.D, 4 * m.D)


def test_sharded_accumulation():
    needs_8_devices()
    m, r = run("sharded_accumulation")
    assert_within_budget(r["plan"], m.BUDGET)
    assert r["updated"]  # the N-th step applied the accumulated update
    chex.assert_trees_all_close(r["params"], r["ref_params"], rtol=1e-4, atol=1e-6)
    assert r["x_sharding"].spec == jax.sharding.PartitionSpec("data")


def test_equinox():
    pytest.importorskip("equinox")
    m, r = run("equinox_mlp")
    assert_within_budget(r["plan"], m.BUDGET)
    chex.assert_trees_all_close(r["grads"], r["ref_grads"], **TOL)
    chex.assert_trees_all_close(r["new_params"], r["ref_new_params"], **TOL)

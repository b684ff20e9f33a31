"""Plans per signature, saved plans (`plan_dir`), stable keys, `budget="auto"`, `disabled()`.

Blocks here are planned with `verify=False` (nothing compiled while planning) or budgets that
resolve to the identity plan, so these tests stay cheap; `jax.eval_shape` is enough to make a
decorated module plan (planning happens when its call is traced).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat._src.base import budget as budget_module
from jremat._src.base.args import abstract_args
from jremat._src.frontends.blocks import disabled
from jremat._src.frontends.cache import PlanCache
from jremat._src.trace.graph import build_graph


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(32)(x)))


X = jnp.ones((16, 8))
V = Block().init(jax.random.key(0), X)


def _trace(cls, x=X):
    """Trace apply and its gradient (planning happens while tracing)."""
    jax.eval_shape(jax.grad(lambda v, x: jnp.sum(cls().apply(v, x))), V, x)


def test_plan_dir_saves_and_reuses_plans_per_signature(tmp_path):
    first = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    _trace(first)
    _trace(first, jnp.ones((32, 8)))
    files = sorted(tmp_path.glob("jremat-*.json"))
    assert len(files) == 2 and first.plan_cache.solves == 2
    assert all(len(f.stem) == len("jremat-") + 24 for f in files)

    second = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)  # a "new run"
    _trace(second)
    _trace(second, jnp.ones((32, 8)))
    assert second.plan_cache.solves == 0 and second.plan_cache.loads == 2
    for key, p in second.plan_cache.plans.items():
        assert p.to_json() == first.plan_cache.plans[key].to_json()
        assert second.plan_cache.path(key).exists()
    assert jremat.Plan.load(files[0]).fingerprint in {
        p.fingerprint for p in first.plan_cache.plans.values()
    }

    other_budget = jremat.auto(Block, budget=0.3, verify=False, plan_dir=tmp_path)
    _trace(other_budget)
    assert other_budget.plan_cache.solves == 1  # the budget is part of the key
    assert len(list(tmp_path.glob("jremat-*.json"))) == 3


def test_a_stale_saved_plan_is_replaced_with_a_warning(tmp_path):
    first = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    _trace(first)
    ((key, p),) = first.plan_cache.plans.items()
    d = json.loads(p.to_json())
    d["fingerprint"] = "0" * 16
    first.plan_cache.path(key).write_text(json.dumps(d))
    second = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="solving again"):
        _trace(second)
    assert second.plan_cache.solves == 1
    assert jremat.Plan.load(first.plan_cache.path(key)).fingerprint == p.fingerprint


def _tiny_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


_KEY_SCRIPT = """
import jax, jax.numpy as jnp
from jremat._src.frontends.cache import PlanCache
from jremat._src.base.args import abstract_args
from jremat._src.trace.graph import build_graph
def _tiny_loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)
args = abstract_args((jnp.ones((8, 8)), jnp.ones((4, 8))))
print(PlanCache(0.5).key(build_graph(_tiny_loss, args), args)[0])
"""


def test_keys_are_stable_across_processes():
    args = abstract_args((jnp.ones((8, 8)), jnp.ones((4, 8))))
    key, sig = PlanCache(0.5).key(build_graph(_tiny_loss, args), args)
    out = subprocess.run(
        [sys.executable, "-c", _KEY_SCRIPT], check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == key
    assert sig == "float32[8,8] float32[4,8]"
    assert PlanCache(0.4).key(build_graph(_tiny_loss, args), args)[0] != key


def test_function_plan_dir_and_budget_auto_read_when_planning(tmp_path, monkeypatch):
    calls = []

    def fake_free_bytes():
        calls.append(1)
        return 1 << 40  # a TiB free: the identity plan

    monkeypatch.setattr(budget_module, "free_device_bytes", fake_free_bytes)
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    loss = jremat.auto(_tiny_loss, budget="auto", plan_dir=tmp_path)
    at_decoration = len(calls)  # validated when decorating
    g = jax.grad(loss)(w, x)
    assert len(calls) == at_decoration + 1  # read again when the signature is planned
    np.testing.assert_allclose(g, jax.grad(_tiny_loss)(w, x), rtol=1e-6)
    (p,) = loss.plans.values()
    assert p.is_identity and p.budget == "auto"
    again = jremat.auto(_tiny_loss, budget="auto", plan_dir=tmp_path)
    again(w, x)
    assert again.plan_cache.loads == 1 and again.plan_cache.solves == 0


def test_disabled_runs_modules_unplanned():
    dec = jremat.auto(Block, budget=0.5, verify=False)
    with disabled():
        _trace(dec)
        y = dec().apply(V, X)
    assert dec.plan_cache.solves == 0
    np.testing.assert_array_equal(y, Block().apply(V, X))
    _trace(dec)
    assert dec.plan_cache.solves == 1


def test_cache_validates_its_arguments():
    with pytest.raises(ValueError, match="budget"):
        PlanCache(0)
    with pytest.raises(ValueError, match="solver"):
        PlanCache(0.5, solver="nope")
    with pytest.raises(ValueError, match="max_rounds"):
        PlanCache(0.5, max_rounds=0)
    with pytest.raises(TypeError, match=r"^max_rounds must be an int >= 1, got bool True"):
        PlanCache(0.5, max_rounds=True)
    for verify in ("yes", 2, None):
        with pytest.raises(TypeError, match=r"^verify must be a bool \(True or False\), got "):
            PlanCache(0.5, verify=verify)
    numpy_args = PlanCache(0.5, verify=np.False_, max_rounds=np.int64(2))
    assert numpy_args.verify is False and type(numpy_args.max_rounds) is int
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "plans=0" in repr(PlanCache(0.5))

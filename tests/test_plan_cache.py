"""Plans per signature, saved plans (`plan_dir`), stable keys, `budget="auto"`, `disabled()`.

Blocks here are planned with `verify=False` (nothing compiled while planning) or budgets that
resolve to the identity plan, so these tests stay cheap; `jax.eval_shape` is enough to make a
decorated module plan (planning happens when its call is traced).
"""

from __future__ import annotations

import json
import os
import stat
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
from jremat._src.trace.graph import build_graph, signature


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
graph = build_graph(_tiny_loss, args)
print(PlanCache(0.5).key(graph, args)[0], graph.fingerprint)
"""


def test_keys_are_stable_across_processes():
    args = abstract_args((jnp.ones((8, 8)), jnp.ones((4, 8))))
    graph = build_graph(_tiny_loss, args)
    key, sig = PlanCache(0.5).key(graph, args)
    out = subprocess.run(
        [sys.executable, "-c", _KEY_SCRIPT], check=True, capture_output=True, text=True
    )
    assert out.stdout.split() == [key, graph.fingerprint]  # the fingerprint too
    assert sig == "float32[8,8] float32[4,8]"
    assert PlanCache(0.4).key(build_graph(_tiny_loss, args), args)[0] != key


def _sin_cos(a, b):
    return jnp.mean(jnp.sin(a) * jnp.cos(b))


def _cos_sin(a, b):  # the same primitives on the same shapes, wired the other way round
    return jnp.mean(jnp.sin(b) * jnp.cos(a))


def test_keys_tell_apart_programs_wired_differently():
    args = abstract_args((jnp.ones((8, 8)), jnp.ones((8, 8))))
    g, other = build_graph(_sin_cos, args), build_graph(_cos_sin, args)
    assert [n.primitive for n in g.nodes] == [n.primitive for n in other.nodes]
    assert g.fingerprint != other.fingerprint
    assert PlanCache(0.5).key(g, args)[0] != PlanCache(0.5).key(other, args)[0]


def test_one_signature_for_keys_and_descriptions():
    w, x = jnp.ones((8, 8)), jnp.ones((4, 8), jnp.int32)
    sig = signature((w, x, 2.0))
    assert sig == signature((w + 1, x, 3.0)) and hash(sig) == hash(signature((w + 1, x, 3.0)))
    assert sig != signature((w, x, jnp.float32(2.0)))  # weak (Python) vs committed scalar
    assert sig != signature(((w, x), 2.0))  # tree structure
    assert sig != signature((w[:4], x, 2.0))
    assert sig.description == "float32[8,8] int32[4,8] float[]{weak}" and sig.sharding == ()
    avals = abstract_args((w, x, 2.0))
    assert signature(avals).description == "float32[8,8] int32[4,8] float32[]{weak}"
    # PlanCache keys describe the planned arguments with it
    assert PlanCache(0.5).key(build_graph(lambda w, x, s: jnp.sum(w) * s, avals), avals)[1] == (
        signature(avals).description
    )


def _mlp_loss(params, x):
    for w1, w2 in params:
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)
        x = x + jnp.tanh(h @ w1) @ w2
    return jnp.mean(x**2)


def test_auto_traces_the_function_once_per_signature(monkeypatch):
    """The user function's Python body runs once per trace. JAX caches traces of the same
    function at the same avals, which would hide repeated traces, so every `make_jaxpr` and
    `eval_shape` here traces afresh (through a new lambda) and is counted.

    On `auto`'s first call (verify=False: the only compile is the unrematerialized step) the
    body runs exactly twice: once for the jaxpr the `Graph` is built from (keyed, planned and
    run from that one graph), and once when `jit(value_and_grad(fn))` is compiled for the
    baseline temp bytes (JAX traces the differentiated body itself; no jaxpr of fn serves it).
    A second call of the same signature runs the planned graph and traces nothing."""
    runs = []
    make_jaxpr, eval_shape = jax.make_jaxpr, jax.eval_shape

    def uncached_make_jaxpr(fn, *a, **k):
        return make_jaxpr(lambda *x, **kw: fn(*x, **kw), *a, **k)

    def uncached_eval_shape(fn, *a, **k):
        return eval_shape(lambda *x, **kw: fn(*x, **kw), *a, **k)

    monkeypatch.setattr(jax, "make_jaxpr", uncached_make_jaxpr)
    monkeypatch.setattr(jax, "eval_shape", uncached_eval_shape)

    def loss(params, x):
        runs.append(1)
        return _mlp_loss(params, x)

    keys = jax.random.split(jax.random.key(0), 7)
    params = [
        (
            jax.random.normal(keys[2 * i], (8, 64)) / 3,
            jax.random.normal(keys[2 * i + 1], (64, 8)) / 8,
        )
        for i in range(3)
    ]
    x = jax.random.normal(keys[6], (512, 8))
    f = jremat.auto(loss, budget=0.5, verify=False)
    g = jax.grad(f)(params, x)
    (p,) = f.plans.values()
    assert not p.is_identity  # run from the graph under a plan, not as fn itself
    assert len(runs) == 2, "traced more than once for the graph and once for the baseline step"
    g2 = jax.grad(f)(params, x)
    assert len(runs) == 2
    runs.clear()
    want = jax.grad(loss)(params, x)
    for got in (g, g2):
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_parses_its_budget_once(monkeypatch):
    parses = []
    pattern = budget_module._PATTERN

    class Counting:
        def match(self, text):
            parses.append(text)
            return pattern.match(text)

    monkeypatch.setattr(budget_module, "_PATTERN", Counting())
    loss = jremat.auto(budget="64GiB")(_tiny_loss)  # the decorator form: auto() twice
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    jax.grad(loss)(w, x)
    loss(w, x)
    assert parses == ["64GiB"]
    (p,) = loss.plans.values()
    assert p.budget == "64GiB" and loss.plan_cache.budget == "64GiB"


def test_function_plan_dir_and_budget_auto_read_when_planning(tmp_path, monkeypatch):
    calls = []

    def fake_free_bytes():
        calls.append(1)
        return 1 << 40  # a TiB free: the identity plan

    monkeypatch.setattr(budget_module, "free_device_bytes", fake_free_bytes)
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    loss = jremat.auto(_tiny_loss, budget="auto", plan_dir=tmp_path)
    at_decoration = len(calls)  # validated when decorating
    assert at_decoration == 1  # once: PlanCache takes the parsed budget
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


def test_default_plan_dir_follows_the_environment(tmp_path, monkeypatch):
    from jremat._src.frontends.cache import default_plan_dir

    monkeypatch.setenv("JREMAT_PLAN_CACHE", str(tmp_path / "plans"))
    assert PlanCache(0.5).plan_dir == tmp_path / "plans"
    assert PlanCache(0.5, plan_dir=False).plan_dir is None  # off with one setting
    for off in ("0", "off", "False", ""):
        monkeypatch.setenv("JREMAT_PLAN_CACHE", off)
        assert PlanCache(0.5).plan_dir is None
    monkeypatch.delenv("JREMAT_PLAN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_plan_dir() == tmp_path / "xdg" / "jremat" / "plans"
    with pytest.raises(TypeError, match="plan_dir must be a folder"):
        jremat.auto(lambda x: x, plan_dir=3)


def test_an_unreadable_saved_plan_is_ignored_with_a_warning_naming_it(tmp_path):
    first = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    _trace(first)
    (path,) = tmp_path.glob("jremat-*.json")
    path.write_text('{"segments": [')  # a truncated file
    second = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=f"saved plan {path} cannot be read"):
        _trace(second)
    assert second.plan_cache.solves == 1 and second.plan_cache.loads == 0
    (saved,) = second.plan_cache.plans.values()
    assert jremat.Plan.load(path).to_json() == saved.to_json()  # planned again and saved


def test_a_saved_plan_naming_values_its_program_lacks_is_ignored_with_a_warning(tmp_path):
    """A file edited or damaged in a value id (the loader cannot judge an id alone): the
    call warns and plans again, as for an unreadable file (helper-4: it raised from inside
    the user's jit)."""
    import json

    first = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    _trace(first)
    (path,) = tmp_path.glob("jremat-*.json")
    d = json.loads(path.read_text())
    seg = next(s for s in d["segments"] if s["policy"] != "keep")
    seg["policy"], seg["saved"] = "names", [999_999]
    path.write_text(json.dumps(d))
    second = jremat.auto(Block, budget=0.5, verify=False, plan_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match=f"saved plan {path} does not fit its program"):
        _trace(second)
    assert second.plan_cache.solves == 1 and second.plan_cache.loads == 0


_WARM_MODEL = """
import jax, jax.numpy as jnp
ws = [(jnp.full((16, 64), 0.02 * (i + 1)), jnp.full((64, 16), 0.03)) for i in range(3)]
x = jnp.ones((64, 16))
def loss(ws, x):
    for i, (w1, w2) in enumerate(ws):
        with jax.named_scope(f"layer_{i}"):
            x = x + jnp.tanh(x @ w1) @ w2
    return jnp.mean(x ** 2)
"""

_WARM_RUN = """
import jax, jremat
from jremat._src.compile import xla
count = {"n": 0}
real = xla.compile_jitted
def counted(jitted, args, **kw):
    count["n"] += 1
    return real(jitted, args, **kw)
xla.compile_jitted = counted
try:
    f = jremat.auto(loss, budget=0.7, solver="chain")
    value = jax.jit(jax.value_and_grad(f))(ws, x)[0]
finally:
    xla.compile_jitted = real
print(count["n"], f.plan_cache.solves, f.plan_cache.loads, float(value))
"""


def test_a_second_process_finds_its_plan_in_the_default_cache(tmp_path, monkeypatch, capsys):
    """A restarted job: the plan is read from the default cache; nothing but the running
    program (JAX's own jit, not jremat's compile path) is compiled."""
    monkeypatch.setenv("JREMAT_PLAN_CACHE", str(tmp_path))
    exec(_WARM_MODEL + _WARM_RUN, {})  # the first run, in this process: plans and saves
    compiled, solves, loads, value = capsys.readouterr().out.split()
    assert int(compiled) > 0 and (solves, loads) == ("1", "0")
    assert len(list(tmp_path.glob("jremat-*.json"))) == 1
    again = subprocess.run(
        [sys.executable, "-c", _WARM_MODEL + _WARM_RUN], capture_output=True, text=True, check=True
    )
    assert again.stdout.split() == ["0", "0", "1", value]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_plans_are_readable_as_the_umask_allows(tmp_path, umask):
    """Saved as JAX's compilation cache files are (mode 0o666 under the umask: 0o644 with the
    usual 0o022), not 0o600 as `tempfile.mkstemp` makes them, so a shared cache folder can be
    read by the other users of a job; no temporary file is left behind."""
    graph = jremat.trace(lambda x: jnp.sum(jnp.tanh(x)), X)
    cache = PlanCache(0.5, plan_dir=tmp_path)
    old = os.umask(umask)
    try:
        cache._save("k", jremat.Plan.identity(graph))
    finally:
        os.umask(old)
    path = cache.path("k")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert jremat.Plan.load(path).fingerprint == graph.fingerprint
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_loaded_plan_names_this_process_sources(tmp_path):
    """A saved plan found by the same program written elsewhere (another file, other lines)
    reports the sources of the program that loaded it, not those it was saved with."""
    first = jremat.auto(_mlp_loss, budget=0.9, verify=False, plan_dir=tmp_path)
    args = ([(jnp.ones((8, 16)), jnp.ones((16, 8)))] * 2, jnp.ones((4, 8)))
    jax.eval_shape(jax.grad(first), *args)
    (path,) = tmp_path.glob("jremat-*.json")
    saved = jremat.Plan.load(path)
    for s in saved.segments:
        s.source = "elsewhere.py:1"
    saved.save(path)
    second = jremat.auto(_mlp_loss, budget=0.9, verify=False, plan_dir=tmp_path)
    jax.eval_shape(jax.grad(second), *args)
    (loaded,) = second.plan_cache.plans.values()
    assert second.plan_cache.loads == 1
    assert loaded.segments and all("elsewhere" not in s.source for s in loaded.segments)
    assert any("test_plan_cache.py" in s.source for s in loaded.segments)

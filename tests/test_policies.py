"""`jremat.policies`: plain `jax.checkpoint` policies and the named preset catalogue."""

from __future__ import annotations

import contextlib
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from models import F32_RTOL, assert_trees_close

from jremat import policies

BUILTINS = [
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
]
NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "query", "key", "value")


def saved(fn, *args) -> list[str]:
    """The residual lines `jax.ad_checkpoint.print_saved_residuals` reports for `fn`."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(fn, *args)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()]


def not_args(lines):
    return [ln for ln in lines if "from the argument" not in ln]


# -- a small per-layer model ------------------------------------------------------------------
def _model(depth=3, width=16, batch=64):
    ks = jax.random.split(jax.random.key(11), 2 * depth + 1)
    params = [
        {
            "w1": jax.random.normal(ks[2 * i], (width, 4 * width)) / 4,
            "w2": jax.random.normal(ks[2 * i + 1], (4 * width, width)) / 8,
        }
        for i in range(depth)
    ]
    return params, jax.random.normal(ks[-1], (batch, width))


def _layer(x, p):
    h = checkpoint_name(x @ p["w1"], "query_proj")  # a name the name-based presets save
    return x + jnp.tanh(h) @ p["w2"]


def _loss(params, x, policy=None, remat=False):
    layer = jax.checkpoint(_layer, policy=policy) if remat else _layer
    for p in params:
        x = layer(x, p)
    return jnp.mean(x**2)


@pytest.fixture(scope="module")
def model():
    params, x = _model()
    return params, x, jax.jit(jax.grad(_loss))(params, x)


def _check_policy(model, policy):
    params, x, want = model
    f = jax.jit(jax.grad(lambda p, x: _loss(p, x, policy, remat=True)))
    assert_trees_close(f(params, x), want, F32_RTOL)


# -- built-ins ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_policy_gives_exact_gradients(model, name, remat3):
    pol = getattr(policies, name)
    assert pol is getattr(jax.checkpoint_policies, name)
    assert policies.get(name) is pol
    _check_policy(model, pol)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: policies.save_only_these_names("query_proj"),
        lambda: policies.save_any_names_but_these("query_proj"),
        lambda: policies.save_from_both_policies(
            policies.dots_saveable, policies.save_only_these_names("x")
        ),
        lambda: policies.get("save_only_these_names", names=["query_proj"]),
        lambda: policies.get("save_any_names_but_these", names=("other",)),
        lambda: policies.save_if_flops_per_byte_above(16.0),
        lambda: policies.save_dots_in_size_range(0, 2**16),
    ],
    ids=[
        "only_names",
        "any_but",
        "both",
        "get_only",
        "get_any_but",
        "flops_per_byte",
        "size_range",
    ],
)
def test_factory_policies_give_exact_gradients(model, factory):
    _check_policy(model, factory())


def test_builtins_save_what_they_say(model):
    params, x, _ = model
    p = params[0]

    def ck(pol):
        return not_args(saved(jax.checkpoint(_layer, policy=pol), x, p))

    assert ck(policies.nothing_saveable) == []
    dots = ck(policies.dots_saveable)
    # x @ w1 feeds tanh (its VJP needs it); the second dot's output is only added (linear)
    assert len(dots) == 1 and dots[0].startswith("f32[64,64] output of dot_general")
    assert len(ck(policies.everything_saveable)) > len(dots)
    named = ck(policies.save_only_these_names("query_proj"))
    assert len(named) == 1 and named[0].startswith("f32[64,64] named 'query_proj'")
    assert ck(policies.save_only_these_names("other")) == []


# -- save_if_flops_per_byte_above --------------------------------------------------------------
def _two_dots(x, w_big, y, w_small):
    """A large-contraction dot (K=256 -> 128 FLOPs/byte), a small one (K=4 -> 2 FLOPs/byte)
    and elementwise work on both."""
    return jnp.sum(jnp.sin(x @ w_big) * jnp.cos(y @ w_small))


TWO_DOTS_ARGS = (
    jnp.ones((8, 256)) / 16,
    jnp.ones((256, 24)) / 16,
    jnp.ones((8, 4)),
    jnp.ones((4, 24)),
)


def test_flops_per_byte_saves_large_contractions_not_elementwise():
    pol = policies.save_if_flops_per_byte_above(16.0)
    lines = not_args(saved(jax.checkpoint(_two_dots, policy=pol), *TWO_DOTS_ARGS))
    assert len(lines) == 1, lines
    assert "f32[8,24]" in lines[0] and "dot_general" in lines[0]
    # that line is the large dot: with the threshold above its 128 FLOPs/byte, nothing is saved
    assert (
        not_args(
            saved(
                jax.checkpoint(_two_dots, policy=policies.save_if_flops_per_byte_above(200.0)),
                *TWO_DOTS_ARGS,
            )
        )
        == []
    )
    # with threshold 0 every dot is saved, but still no elementwise result (sin, cos, mul)
    lines0 = not_args(
        saved(
            jax.checkpoint(_two_dots, policy=policies.save_if_flops_per_byte_above(0.0)),
            *TWO_DOTS_ARGS,
        )
    )
    assert len(lines0) == 2 and all("dot_general" in ln for ln in lines0)
    # asking the policy directly
    prim = jax.lax.dot_general_p
    dn = (((1,), (0,)), ((), ()))
    big = [
        jax.core.ShapedArray((8, 256), jnp.float32),
        jax.core.ShapedArray((256, 24), jnp.float32),
    ]
    small = [jax.core.ShapedArray((8, 4), jnp.float32), jax.core.ShapedArray((4, 24), jnp.float32)]
    assert pol(prim, *big, dimension_numbers=dn, precision=None, preferred_element_type=None)
    assert not pol(prim, *small, dimension_numbers=dn, precision=None, preferred_element_type=None)
    assert not pol(jax.lax.sin_p, big[0], accuracy=None)
    assert not pol(jax.lax.mul_p, big[0], big[0])


def test_flops_per_byte_saves_a_wide_conv():
    def conv_net(x, w):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jnp.sum(jnp.tanh(y))

    x, w = jnp.ones((2, 8, 8, 16)) / 4, jnp.ones((3, 3, 16, 4)) / 16  # 144 MACs per output
    for thr, n in ((16.0, 1), (100.0, 0)):  # 2 * 144 / 4 = 72 FLOPs per byte
        pol = policies.save_if_flops_per_byte_above(thr)
        lines = not_args(saved(jax.checkpoint(conv_net, policy=pol), x, w))
        assert len(lines) == n and all("conv_general_dilated" in ln for ln in lines), lines
        g = jax.grad(jax.checkpoint(conv_net, policy=pol), argnums=(0, 1))(x, w)
        assert_trees_close(g, jax.grad(conv_net, argnums=(0, 1))(x, w), F32_RTOL)


@pytest.mark.parametrize("threshold", [-1.0, math.inf, math.nan, "16"])
def test_flops_per_byte_rejects_bad_thresholds(threshold):
    with pytest.raises(ValueError, match="threshold"):
        policies.save_if_flops_per_byte_above(threshold)


# -- save_dots_in_size_range -------------------------------------------------------------------
def _sized_dots(x, w_small, w_big):
    """Dots with 8x16 (512-byte) and 8x128 (4096-byte) f32 outputs."""
    return jnp.sum(jnp.sin(x @ w_small)) + jnp.sum(jnp.cos(x @ w_big))


SIZED_ARGS = (jnp.ones((8, 32)) / 8, jnp.ones((32, 16)) / 8, jnp.ones((32, 128)) / 8)


@pytest.mark.parametrize(
    "lo, hi, shapes",
    [
        (0, 1024, ["f32[8,16]"]),
        (1024, math.inf, ["f32[8,128]"]),
        (512, 4096, ["f32[8,16]", "f32[8,128]"]),  # both ends inclusive
        (513, 4095, []),
    ],
)
def test_dots_in_size_range_saves_only_that_range(lo, hi, shapes):
    pol = policies.save_dots_in_size_range(lo, hi)
    f = jax.checkpoint(_sized_dots, policy=pol)
    lines = not_args(saved(f, *SIZED_ARGS))
    assert sorted(ln.split()[0] for ln in lines) == sorted(shapes), lines
    assert all("dot_general" in ln for ln in lines)
    g = jax.grad(f, argnums=(1, 2))(*SIZED_ARGS)
    assert_trees_close(g, jax.grad(_sized_dots, argnums=(1, 2))(*SIZED_ARGS), F32_RTOL)


def test_dots_in_size_range_rejects_bad_ranges():
    with pytest.raises(ValueError):
        policies.save_dots_in_size_range(10, 5)
    with pytest.raises(ValueError):
        policies.save_dots_in_size_range(-1, 5)


# -- get ---------------------------------------------------------------------------------------
def test_get_rejects_the_broken_upstream_policy_and_unknown_names():
    with pytest.raises(ValueError, match="save_any_names_but_these") as info:
        policies.get("save_anything_except_these_names")
    assert "everything_saveable" in str(info.value)
    with pytest.raises(ValueError, match="unknown policy") as info:
        policies.get("save_the_world")
    for name in policies.names():  # the message lists the accepted names
        assert name in str(info.value)
    assert "save_anything_except_these_names" not in policies.names()
    assert not hasattr(policies, "save_anything_except_these_names")


def test_names_are_all_gettable():
    for name in policies.names():
        pol = policies.get(name)
        assert callable(pol)


# -- presets -----------------------------------------------------------------------------------
def test_preset_catalogue_is_shipped():
    names = policies.preset_names()
    assert len(names) >= 5
    for expected in ("full_remat", "dots", "no_remat", "sqrt_n", "save_expensive"):
        assert expected in names
    with pytest.raises(ValueError, match="unknown preset") as info:
        policies.preset("not_a_preset")
    assert "full_remat" in str(info.value)


@pytest.mark.parametrize("name", policies.preset_names())
def test_every_preset_loads_and_its_policy_works_with_checkpoint(model, name):
    pre = policies.preset(name)
    assert pre.name == name
    assert pre.description
    assert pre.segmentation in ("layers", "sqrt_n", "none")
    assert pre.policy_name in policies.names()
    pol = pre.policy
    assert callable(pol)
    _check_policy(model, pol)
    # what it saves of one layer (x @ w1 is 64x64 f32, 8 FLOPs/byte; tagged "query_proj")
    params, x, _ = model
    lines = not_args(saved(jax.checkpoint(_layer, policy=pol), x, params[0]))
    assert name in PRESET_SAVES, f"add what preset {name!r} saves of _layer to PRESET_SAVES"
    want = PRESET_SAVES[name]
    if want is None:  # everything: same as everything_saveable
        want_lines = not_args(
            saved(jax.checkpoint(_layer, policy=policies.everything_saveable), x, params[0])
        )
        assert lines == want_lines and lines
    else:
        assert [ln.split(" from ")[0] for ln in lines] == want, lines


#: What each shipped preset saves of `_layer` (None: everything); a preset added to the
#: catalogue must be added here.
PRESET_SAVES = {
    "dots": ["f32[64,64] output of dot_general"],
    "dots_no_batch": ["f32[64,64] output of dot_general"],
    "full_remat": [],
    "no_remat": None,
    "save_attention_projections": ["f32[64,64] named 'query_proj'"],
    "save_expensive": [],  # 8 FLOPs/byte is below its threshold of 16
    "save_qkv_proj": ["f32[64,64] named 'query_proj'"],
    "save_small_dots": ["f32[64,64] output of dot_general"],
    "sqrt_n": [],
}


def test_name_based_presets_save_the_named_values(model):
    params, x, _ = model
    pre = policies.preset("save_attention_projections")
    lines = not_args(saved(jax.checkpoint(_layer, policy=pre.policy), x, params[0]))
    assert len(lines) == 1 and "query_proj" in lines[0]
    full = not_args(
        saved(jax.checkpoint(_layer, policy=policies.preset("full_remat").policy), x, params[0])
    )
    assert full == []


def test_preset_policies_match_their_json(model):
    """A preset's policy is the named policy built with the JSON's params."""
    pre = policies.preset("save_small_dots")
    assert pre.policy_name == "save_dots_in_size_range"
    assert pre.params == {"min_bytes": 0, "max_bytes": 4 * 2**20}
    params, x, _ = model
    a = saved(jax.checkpoint(_layer, policy=pre.policy), x, params[0])
    b = saved(
        jax.checkpoint(_layer, policy=policies.save_dots_in_size_range(0, 4 * 2**20)), x, params[0]
    )
    assert a == b
    assert np.isfinite(pre.params["max_bytes"])

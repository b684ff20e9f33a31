"""Flax's own linen remat tests, run with `jremat.auto` in place of `nn.remat`.

Origin: `tests/linen/linen_transforms_test.py` of the flax 0.12.8 source distribution
(`pip download --no-deps --no-binary :all: flax==0.12.8`), Copyright 2024 The Flax Authors,
Apache License 2.0 (http://www.apache.org/licenses/LICENSE-2.0). Adapted: absltest classes
became pytest functions and `nn.remat` / `nn.checkpoint` became `jremat.auto(...)`; the module
and test names are kept. Only the remat tests that check outputs, parameter trees, static
arguments and Module-state bookkeeping are taken (`test_remat_scan` tests `nn.remat_scan`, which
jremat does not replace). Changes of assertion are marked `# jremat:`.

`verify=False` keeps these fast: nothing is compiled while planning, and each block runs as one
planned checkpoint through jremat's jaxpr rewrite (docs/design.md#flax-blocks).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import errors
from flax import linen as nn
from jax import random

import jremat

remat = partial(jremat.auto, budget=0.5, verify=False)  # the stand-in for nn.remat


def tree_equals(x, y):
    return jax.tree_util.tree_all(jax.tree_util.tree_map(operator.eq, x, y))


id_fn = lambda x: x


class TransformedMLP(nn.Module):
    features: Sequence[int]
    transform: Callable = id_fn

    @nn.compact
    def __call__(self, inputs):
        x = inputs
        for i, feat in enumerate(self.features):
            # JIT the Module (it's __call__ fn by default.)
            x = self.transform(nn.Dense)(feat, name=f"layers_{i}")(x)
            if i != len(self.features) - 1:
                x = nn.relu(x)
        return x


def decorated_MLP(transform: Callable = id_fn):
    class MLP(nn.Module):
        features: Sequence[int]

        @transform
        @nn.compact
        def __call__(self, inputs):
            x = inputs
            for i, feat in enumerate(self.features):
                # JIT the Module (it's __call__ fn by default.)
                x = nn.Dense(feat, name=f"layers_{i}")(x)
                if i != len(self.features) - 1:
                    x = nn.relu(x)
            return x

    return MLP


def test_remat():
    key1, key2 = random.split(random.key(3), 2)
    x = random.uniform(key1, (4, 4))

    normal_model = TransformedMLP(features=[3, 4, 5])
    remat_model = TransformedMLP(features=[3, 4, 5], transform=remat)
    init_variables = normal_model.init(key2, x)
    y1 = normal_model.apply(init_variables, x)
    y2 = remat_model.apply(init_variables, x)

    assert np.all(y1 == y2)
    # jremat: parameter trees of the undecorated and decorated model are the same
    assert jax.tree_util.tree_structure(remat_model.init(key2, x)) == jax.tree_util.tree_structure(
        init_variables
    )


def test_remat_decorated():
    key1, key2 = random.split(random.key(3), 2)
    x = random.uniform(key1, (4, 4))

    normal_model = decorated_MLP()(features=[3, 4, 5])
    remat_model = decorated_MLP(remat)(features=[3, 4, 5])
    init_variables = normal_model.init(key2, x)
    y1 = normal_model.apply(init_variables, x)
    y2 = remat_model.apply(init_variables, x)

    assert np.all(y1 == y2)
    # jremat: and so are the gradients
    g1 = jax.grad(lambda v: jnp.sum(normal_model.apply(v, x) ** 2))(init_variables)
    g2 = jax.grad(lambda v: jnp.sum(remat_model.apply(v, x) ** 2))(init_variables)
    jax.tree_util.tree_map(np.testing.assert_array_equal, g2, g1)


def test_remat_kwargs():
    # upstream: skipped ('test breaks with grad': the concretization error of jax.checkpoint,
    # which traces keyword arguments and ignores static_argnames). jremat: static_argnames
    # makes it work under grad, and so does a Python bool not declared static (jremat keeps
    # bool and str arguments static: docs/design.md, "The program that runs is the program
    # verified").
    class ConditionalReLU(nn.Module):
        @nn.compact
        def __call__(self, input, apply_relu: bool = False):
            return nn.relu(input) if apply_relu else input

    key = random.key(0)
    x = jnp.ones((4, 4)) * -1
    remat_model = remat(ConditionalReLU, static_argnames="apply_relu")()
    p = remat_model.init(key, x)
    y = remat_model.apply(p, x, apply_relu=True)

    assert np.all(y == jnp.zeros_like(x))

    # This next line crashed upstream with a concretization error
    g = jax.grad(lambda x: jnp.sum(remat_model.apply(p, x, apply_relu=True)))(x)
    np.testing.assert_array_equal(g, jnp.zeros_like(x))

    dynamic = remat(ConditionalReLU)()
    g = jax.grad(lambda x: jnp.sum(dynamic.apply(p, x, apply_relu=True)))(x)  # jremat
    np.testing.assert_array_equal(g, jnp.zeros_like(x))


def test_remat_static_argnums():
    class Foo(nn.Module):
        train_is_static: bool

        @nn.compact
        def __call__(self, inputs, train: bool):
            # jremat: a Python bool stays a bool whether declared static or not (upstream: a
            # tracer when not static)
            assert isinstance(train, bool)

            return nn.Dense(3, use_bias=False)(inputs)

    # set train as a static argument
    FooRemat = remat(Foo, static_argnums=(2,))
    foo = FooRemat(train_is_static=True)

    x = jnp.empty((1, 2))
    variables = foo.init(random.key(0), x, True)
    y = foo.apply(variables, x, False)
    assert y.shape == (1, 3)

    # set train as a non-static arguments
    FooRemat = remat(Foo, static_argnums=())
    foo = FooRemat(train_is_static=False)

    variables = foo.init(random.key(0), x, True)
    y = foo.apply(variables, x, False)
    assert y.shape == (1, 3)


def test_remat_decorator_static_argnums():
    class FooTrainStatic(nn.Module):
        @partial(remat, static_argnums=(2,))
        @nn.compact
        def __call__(self, inputs, train: bool):
            assert isinstance(train, bool)

            return nn.Dense(3, use_bias=False)(inputs)

    # set train as a static argument
    foo = FooTrainStatic()

    x = jnp.empty((1, 2))
    variables = foo.init(random.key(0), x, True)
    y = foo.apply(variables, x, False)
    assert y.shape == (1, 3)

    class FooTrainDynamic(nn.Module):
        @partial(remat, static_argnums=())
        @nn.compact
        def __call__(self, inputs, train: bool):
            assert isinstance(train, bool)  # jremat: a Python bool stays a bool (see above)

            return nn.Dense(3, use_bias=False)(inputs)

    # set train as a non-static arguments
    foo = FooTrainDynamic()

    variables = foo.init(random.key(0), x, True)
    y = foo.apply(variables, x, False)
    assert y.shape == (1, 3)


def test_nested_setup_calls_count():
    D = 3
    N = 4
    setup_cntr = 0
    call_cntr = 0

    class Repeat(nn.Module):
        mdl_def: Any

        def setup(self):
            self.lyrs = [self.mdl_def() for _ in range(N)]

        @remat  # we just use remat as a convenient test of transform logic
        def __call__(self, x):
            for lyr in self.lyrs:
                lyr(x)
            return x

    class Counter(nn.Module):
        def setup(self):
            nonlocal setup_cntr
            setup_cntr += 1
            self.dense = nn.Dense(2, use_bias=False)

        @remat
        def __call__(self, x):
            nonlocal call_cntr
            call_cntr += 1
            return self.dense(x)

    def nested_repeat(mdl):
        for _ in range(D):
            mdl = partial(Repeat, mdl)
        return mdl()

    _ = nested_repeat(Counter).init(random.key(0), jnp.ones((2,)))
    # setup_cntr == 128 due to 1 call in Counter.setup by _validate_setup
    # and 1 further "real" call.
    assert setup_cntr == 128
    assert call_cntr == 64


def test_multimethod_setup_calls():
    cntr = 0

    class A(nn.Module):
        def setup(self):
            nonlocal cntr
            cntr += 1
            self.d = nn.Dense(2)

        @remat
        def foo(self, x):
            return self.d(x)

        @remat
        def bar(self, x):
            return self.d(x)

    class B(nn.Module):
        def setup(self):
            self.a = A()

        def __call__(self, x):
            y1 = self.a.foo(x)
            y2 = self.a.bar(x)
            return y1, y2

    key = random.key(0)
    x = jnp.ones((2,))
    (y1, y2), _ = B().init_with_output(key, x)
    np.testing.assert_array_equal(y1, y2)
    # cntr == 4 due to:
    # 1 call by _validate_setup
    # 1 call for the setup() outside transform boundary
    # and two further "real" calls in transform boundaries
    assert cntr == 4


def test_lift_instance_error():
    class Foo(nn.Module):
        @nn.compact
        def __call__(self, x):
            return remat(nn.Dense(2))(x)

    # jremat: the error is a TypeError and also flax's TransformTargetError
    with pytest.raises(errors.TransformTargetError):
        Foo().init(random.key(0), jnp.zeros((2, 3)))
    with pytest.raises(TypeError, match="Module instance"):
        Foo().init(random.key(0), jnp.zeros((2, 3)))


def test_remat_methods_keyword():
    # jremat: `methods=` as nn.remat's (not in the upstream file, which has no remat test of it)
    class AB(nn.Module):
        def setup(self):
            self.d = nn.Dense(2)

        def a(self, x):
            return self.d(x) * 2

        def __call__(self, x):
            return self.d(x)

    x = jnp.ones((3, 2))
    v = AB().init(random.key(0), x)
    R = remat(AB, methods=["a", "__call__"])
    np.testing.assert_array_equal(R().apply(v, x, method="a"), AB().apply(v, x, method="a"))
    np.testing.assert_array_equal(R().apply(v, x), AB().apply(v, x))

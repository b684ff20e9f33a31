# Adapted from optax 0.2.8, file optax/transforms/_accumulation_test.py (as shipped in the
# optax wheel), Copyright 2019 DeepMind Technologies Limited, licensed under the Apache
# License, Version 2.0 (http://www.apache.org/licenses/LICENSE-2.0). Changes: the tests
# run against ``jremat.accumulate`` / ``jremat.has_updated`` instead of
# ``optax.MultiSteps``; private ``optax._src`` imports replaced by public optax names;
# reformatted to this project's style (ruff, 4 spaces); the mixed-precision train step is
# jitted (eager upstream) to fit this suite's CPU time; tests of other optax functions are
# kept as skipped entries or routed through ``accumulate`` as described below.
"""Peer suite: optax's own MultiSteps tests, run against ``jremat.accumulate``.

Outcome with optax 0.2.8 (jax 0.10.2 and 0.12): of the 12 upstream test cases, 10 pass
and 2 do not apply.  test_multi_steps_skip_not_finite runs twice here (both spellings of
the skip option), so pytest reports 11 passed, 2 skipped.

Passing, adapted one-for-one (``MultiSteps(opt, k, ...)`` -> ``accumulate(opt, k, ...)``,
``ms.gradient_transformation()`` -> the returned transformation,
``ms.has_updated(s)`` -> ``has_updated(s)``, ``use_grad_mean=True`` ->
``reduction="mean"``, ``should_skip_update_fn=skip_not_finite`` -> both
``skip_non_finite=True`` and the pass-through ``should_skip_update_fn``):

* test_multi_steps, test_multi_steps_every_k_schedule,
  test_multi_steps_scan_dtype_stability, test_multi_steps_zero_nans,
  test_multi_steps_computes_mean, test_multi_steps_skip_not_finite,
  test_multi_steps_mixed_precision (2 parameterizations: adam, adam with mu_dtype f32).

Passing, routed through ``accumulate``: test_skip_not_finite and test_skip_large_updates
test optax's predicate functions directly; here the same inputs go through
``accumulate(..., skip_non_finite=True)`` / ``accumulate(...,
should_skip_update_fn=partial(optax.skip_large_updates, max_squared_norm=100.0))`` and the
predicate's verdict is read back from ``state.skip_state`` and ``state.mini_step``.

Do not apply (kept as skipped entries): test_ema and test_ema_debias test ``optax.ema``,
an exponential moving average of updates, which jremat neither wraps nor changes.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized

from jremat._src.training.accumulation import accumulate, has_updated

OPTIMIZERS_TO_TEST = [
    {"opt_name": "adam", "opt_kwargs": {"learning_rate": 0.1}},
    {"opt_name": "adam", "opt_kwargs": {"learning_rate": 0.1, "mu_dtype": jnp.float32}},
]


class Loss(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, x, dtype=jnp.float32, param_dtype=jnp.float32):
        return jnp.sum(flax.linen.Dense(10, dtype=dtype, param_dtype=param_dtype)(x) ** 2)


class AccumulationTest(parameterized.TestCase):
    def test_ema(self):
        self.skipTest("not applicable: tests optax.ema, which jremat.accumulate does not use")

    def test_ema_debias(self):
        self.skipTest("not applicable: tests optax.ema, which jremat.accumulate does not use")

    def _one_skip_check(self, opt, update, expect_skip):
        params = [jnp.zeros([]), jnp.zeros([])]
        state = opt.init(params)
        state = jax.jit(opt.update)(update, state, params)[1]
        self.assertEqual(bool(state.skip_state["should_skip"]), expect_skip)
        # a skipped micro-step leaves the mini-step counter where it was
        self.assertEqual(int(state.mini_step), 0 if expect_skip else 1)
        return state.skip_state

    def test_skip_not_finite(self):
        opt = accumulate(optax.sgd(1.0), 2, skip_non_finite=True)

        with self.subTest("test_pos_inf"):
            skip_state = self._one_skip_check(opt, [jnp.array(float("inf")), jnp.zeros([])], True)
            self.assertEqual(int(skip_state["num_not_finite"]), 1)

        with self.subTest("test_neg_inf"):
            skip_state = self._one_skip_check(opt, [jnp.array(-float("inf")), jnp.zeros([])], True)
            self.assertEqual(int(skip_state["num_not_finite"]), 1)

        with self.subTest("test_nan"):
            skip_state = self._one_skip_check(opt, [jnp.array(float("nan")), jnp.zeros([])], True)
            self.assertEqual(int(skip_state["num_not_finite"]), 1)

        with self.subTest("test_finite"):
            skip_state = self._one_skip_check(opt, [jnp.array(11.0), jnp.zeros([])], False)
            self.assertEqual(int(skip_state["num_not_finite"]), 0)

    def test_skip_large_updates(self):
        opt = accumulate(
            optax.sgd(1.0),
            2,
            should_skip_update_fn=functools.partial(
                optax.skip_large_updates, max_squared_norm=100.0
            ),
        )

        with self.subTest("test_inf"):
            skip_state = self._one_skip_check(opt, [jnp.array(float("inf")), jnp.zeros([])], True)
            self.assertEqual(float(skip_state["norm_squared"]), float("inf"))

        with self.subTest("test_nan"):
            skip_state = self._one_skip_check(opt, [jnp.array(float("nan")), jnp.zeros([])], True)
            # Recall that NaN != NaN.
            norm_squared = float(skip_state["norm_squared"])
            self.assertNotEqual(norm_squared, norm_squared)

        with self.subTest("test_large"):
            skip_state = self._one_skip_check(opt, [jnp.array(11.0), jnp.zeros([])], True)
            self.assertEqual(float(skip_state["norm_squared"]), 121.0)

        with self.subTest("test_small"):
            skip_state = self._one_skip_check(opt, [jnp.zeros([]), jnp.zeros([])], False)
            self.assertEqual(float(skip_state["norm_squared"]), 0.0)

    def test_multi_steps(self):
        batch_size = 32
        x_size = 7
        # Parameters should be updated only every `k_steps` optimization steps.
        k_steps = 4
        data = jnp.ones([batch_size, x_size])
        loss = Loss()

        params = loss.init({"params": jax.random.key(0)}, data)["params"]

        def loss_apply(params, data):
            return loss.apply({"params": params}, data)

        ms_opt = accumulate(
            # Use a non-trivial inner optimizer:
            # * it has a state,
            # * it requires the params for the update.
            optax.chain(
                optax.scale_by_adam(),
                optax.add_decayed_weights(1e-2),
                optax.scale(-1e-4),
            ),
            k_steps,
        )

        opt_init, opt_update = ms_opt

        # Put the training in one function, to check that the update is indeed
        # jittable.
        def train_step(data, opt_state, params):
            grad = jax.grad(loss_apply)(params, data)
            updates, opt_state = opt_update(grad, opt_state, params)
            return updates, opt_state

        opt_state = opt_init(params)

        prev_loss = loss_apply(params, data)
        for idx in range(5 * k_steps):
            updates, opt_state = jax.jit(train_step)(data, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            new_loss = loss_apply(new_params, data)
            if idx % k_steps < k_steps - 1:
                # The parameters should not have changed and the loss should be
                # constant.
                jax.tree.map(np.testing.assert_array_equal, new_params, params)
                np.testing.assert_equal(new_loss, prev_loss)
                self.assertFalse(has_updated(opt_state))
            else:
                # This is a step where parameters should actually have been updated, and
                # the loss should accordingly go down.
                np.testing.assert_array_less(new_loss, prev_loss)
                prev_loss = new_loss
                self.assertTrue(has_updated(opt_state))
            params = new_params

    def test_multi_steps_every_k_schedule(self):
        # Test a non-trivial schedule which varies over time.
        ms_opt = accumulate(optax.sgd(1e-4), lambda grad_step: jnp.where(grad_step < 2, 1, 3))
        opt_init, opt_update = ms_opt
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grad = {"a": jnp.zeros([])}
        self.assertFalse(has_updated(opt_state))
        # First two steps have 1 mini-step per update.
        for _ in range(2):
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertTrue(has_updated(opt_state))
        # Subsequently, mini-steps should have 3 mini-steps per update.
        for _ in range(5):
            for _ in range(2):
                _, opt_state = opt_update(grad, opt_state, params)
                self.assertFalse(has_updated(opt_state))
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertTrue(has_updated(opt_state))

    def test_multi_steps_scan_dtype_stability(self):
        # Testing if accumulator dtype stays the same under jax.lax.scan
        # It is important that the dtype is not promoted in the accumulator
        ms_opt = accumulate(optax.sgd(1e-4), 2, accumulator_dtype=jnp.float32)
        opt_init, opt_update = ms_opt
        params = {"a": jnp.zeros([], dtype=jnp.bfloat16)}

        # We use bfloat16 to test if gradients of bfloat16 promote the states
        # to bfloat16 or similar.
        def train_step(state, _):
            grad = {"a": jnp.ones([], dtype=jnp.bfloat16)}
            updates, opt_state = opt_update(grad, state, params)
            return opt_state, updates

        opt_state = opt_init(params)
        # This map should succeed without raising dtype errors in lax.scan
        # if dtype is stable.
        final_state, _ = jax.lax.scan(train_step, opt_state, jnp.arange(4))
        # Also ensure actual dtype of accumulator is float32
        self.assertEqual(final_state.acc_grads["a"].dtype, jnp.float32)

    def test_multi_steps_zero_nans(self):
        # Test that MultiStep is compatible with zero_nans
        # https://github.com/google-deepmind/optax/issues/828
        ms_opt = accumulate(
            optax.chain(optax.zero_nans(), optax.sgd(1e-4)),
            every_k=2,
        )
        opt_init, opt_update = ms_opt
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grad = {"a": jnp.zeros([])}
        opt_update(grad, opt_state, params)

    def test_multi_steps_computes_mean(self):
        k_steps = 4
        ms_opt = accumulate(optax.scale(1.0), k_steps, reduction="mean")
        opt_init, opt_update = ms_opt
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)
        grads = [{"a": jnp.ones([]) * i} for i in [1, 2, 3, 4]]
        self.assertFalse(has_updated(opt_state))

        # First 3 steps don't update.
        for grad in grads[:-1]:
            _, opt_state = opt_update(grad, opt_state, params)
            self.assertFalse(has_updated(opt_state))

        # Actual update.
        new_params, opt_state = opt_update(grads[-1], opt_state, params)
        self.assertTrue(has_updated(opt_state))
        np.testing.assert_array_equal(new_params["a"], 2.5)

    @parameterized.parameters(
        {"skip_kwargs": {"skip_non_finite": True}},
        {"skip_kwargs": {"should_skip_update_fn": optax.skip_not_finite}},
    )
    def test_multi_steps_skip_not_finite(self, skip_kwargs):
        k_steps = 2
        ms_opt = accumulate(optax.sgd(1.0), k_steps, **skip_kwargs)
        opt_init, opt_update = ms_opt
        opt_init = jax.jit(opt_init)
        opt_update = jax.jit(opt_update)
        params = {"a": jnp.zeros([])}
        opt_state = opt_init(params)

        with self.subTest("test_good_updates"):
            updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 1)
            params = optax.apply_updates(params, updates)
            updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))

        with self.subTest("test_inf_updates"):
            updates, opt_state = opt_update({"a": jnp.array(float("inf"))}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 0)  # No increase in mini_step
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))

        with self.subTest("test_nan_updates"):
            updates, opt_state = opt_update({"a": jnp.full([], float("nan"))}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 0)  # No increase in mini_step
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(params["a"], jnp.negative(jnp.ones([])))

        with self.subTest("test_final_good_updates"):
            updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 1)
            params = optax.apply_updates(params, updates)
            updates, opt_state = opt_update({"a": jnp.ones([])}, opt_state, params)
            self.assertEqual(int(opt_state.mini_step), 0)
            params = optax.apply_updates(params, updates)
            np.testing.assert_array_equal(params["a"], jnp.negative(jnp.full([], 2.0)))

    @parameterized.parameters(OPTIMIZERS_TO_TEST)
    def test_multi_steps_mixed_precision(self, opt_name, opt_kwargs):
        batch_size = 32
        x_size = 7
        k_steps = 4
        data = jnp.ones([batch_size, x_size])
        loss = Loss()

        def loss_apply(params, data):
            return loss.apply({"params": params}, data)

        # Compare optimizer dtypes with and without MultiSteps
        def create_optimizer(k_steps):
            base_opt = getattr(optax, opt_name)(**opt_kwargs)
            ms_opt = accumulate(base_opt, k_steps)
            return base_opt, ms_opt

        opt, ms_opt = create_optimizer(k_steps)
        ms_opt_init, ms_opt_update = ms_opt

        # General train step (jitted here, eager upstream: same dtypes, 3x faster on CPU)
        @functools.partial(jax.jit, static_argnums=(3, 4))
        def train_step(data, opt_state, params, opt_update_fn, upd_dtype):
            grad = jax.grad(loss_apply)(params, data)
            grad = jax.tree.map(lambda x: x.astype(upd_dtype), grad)  # mimic varying dtype
            updates, opt_state = opt_update_fn(grad, opt_state, params)
            return updates, opt_state

        # Utility for dtype comparison
        def compare_dtypes(tree1, tree2):
            return jax.tree.all(jax.tree.map(lambda x, y: x.dtype == y.dtype, tree1, tree2))

        # Iterate over parameter and update dtypes
        dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
        for upd_dtype in dtypes:
            for param_dtype in dtypes:
                data = data.astype(param_dtype)
                with self.subTest(
                    f"upd_dtype={upd_dtype.__name__}-param_dtype={param_dtype.__name__}"
                ):
                    # Initialize parameters with current combination of dtypes
                    params = loss.init(
                        {"params": jax.random.key(0)}, data, param_dtype=param_dtype
                    )["params"]
                    opt_state = opt.init(params)
                    ms_opt_state = ms_opt_init(params)

                    for _ in range(k_steps + 1):
                        updates, opt_state = train_step(
                            data, opt_state, params, opt.update, upd_dtype
                        )
                        ms_updates, ms_opt_state = train_step(
                            data, ms_opt_state, params, ms_opt_update, upd_dtype
                        )
                        get_dtypes = lambda tree: jax.tree.map(lambda x: x.dtype, tree)  # noqa: E731
                        self.assertTrue(
                            compare_dtypes(updates, ms_updates),
                            "Underlying optimizer and MultiSteps updates dtype must match."
                            f" Got ({get_dtypes(updates)}) vs ({get_dtypes(ms_updates)}).",
                        )
                        new_params = optax.apply_updates(params, ms_updates)
                        self.assertTrue(
                            compare_dtypes(params, new_params),
                            "Updates parameters dtypes must match."
                            f" Got ({get_dtypes(params)}) vs ({get_dtypes(new_params)}).",
                        )
                        params = new_params


if __name__ == "__main__":
    absltest.main()

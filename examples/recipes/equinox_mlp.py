"""Recipe: an Equinox model under `jremat.auto`, trained with optax.

Equinox is not one of jremat's dependencies (`pip install equinox`). jremat plans functions
whose positional arguments are pytrees of arrays, so the model is split with `eqx.partition`
into its arrays (the argument jremat plans for and `jax.grad` differentiates) and the rest
(closed over), and put back together inside the loss with `eqx.combine`. Each block is called
under `jax.named_scope`, so the plan reports per layer.

    python examples/recipes/equinox_mlp.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jremat

D, HIDDEN, LAYERS, BATCH, BUDGET = 64, 256, 4, 512, 0.5


class Block(eqx.Module):
    """A residual MLP block on one example: x + W2 gelu(W1 x)."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, HIDDEN, key=k1)
        self.down = eqx.nn.Linear(HIDDEN, D, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Model(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 1)
        self.blocks = [Block(k) for k in keys[:-1]]
        self.head = eqx.nn.Linear(D, 1, key=keys[-1])

    def __call__(self, x):
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"layer_{i}"):
                x = block(x)
        return self.head(x)


def make_loss(static):
    """The loss of the arrays `params`; the rest of the model (`static`) is closed over."""

    def loss(params, x, y):
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return loss


def main():
    model = Model(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)  # arrays / everything else
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (BATCH, D)), jax.random.normal(ky, (BATCH, 1))

    loss = make_loss(static)
    planned = jremat.auto(loss, budget=BUDGET)
    optimizer = optax.adamw(1e-3)

    def step_fn(loss_fn):
        @jax.jit
        def step(params, opt_state, x, y):
            value, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, grads

        return step

    new_params, _, value, grads = step_fn(planned)(params, optimizer.init(params), x, y)
    ref_params, _, ref_value, ref_grads = step_fn(loss)(params, optimizer.init(params), x, y)
    model = eqx.combine(new_params, static)  # the trained model, an eqx.Module again

    (plan,) = planned.plans.values()
    print(plan.summary())
    print(f"loss with remat {float(value)}, without {float(ref_value)}")
    return {
        "plan": plan,
        "new_params": new_params,
        "ref_new_params": ref_params,
        "grads": grads,
        "ref_grads": ref_grads,
    }


if __name__ == "__main__":
    main()

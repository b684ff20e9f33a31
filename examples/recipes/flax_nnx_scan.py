"""Recipe: Flax NNX `nnx.scan` over layers whose class `jremat.auto` plans.

The layers are created with `nnx.vmap` (their parameters stacked on a leading axis) and run
with `nnx.scan`; the block class carries `@jremat.auto(budget=...)` as it would carry
`nnx.remat`. jremat plans the block once, on the first traced call, so that it keeps at most
BUDGET of the bytes it would keep from its forward pass to its backward pass.

    python examples/recipes/flax_nnx_scan.py
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jremat

D, LAYERS, BATCH, SEQ, BUDGET = 64, 4, 16, 32, 0.4


class Block(nnx.Module):
    """A pre-norm MLP block: h + W2 gelu(W1 LN(h))."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


RematBlock = jremat.auto(Block, budget=BUDGET)  # or @jremat.auto(budget=0.4) on the class


class Model(nnx.Module):
    def __init__(self, block: type, rngs: nnx.Rngs):
        self.embed = nnx.Linear(8, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return block(rngs)

        self.layers = create(rngs)  # one Block whose parameters have a leading LAYERS axis
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(h, layer):
            return layer(h)

        return self.head(run(self.embed(x), self.layers))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(model, optimizer, x, y):
    value, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return value, grads


def main():
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (BATCH, SEQ, 8)), jax.random.normal(ky, (BATCH, SEQ, 1))
    results = {}
    for name, block in (("remat", RematBlock), ("ref", Block)):
        model = Model(block, nnx.Rngs(0))  # the same initial parameters for both
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        value, grads = nnx.jit(train_step)(model, optimizer, x, y)
        results[name] = (nnx.state(model, nnx.Param), float(value), grads)

    (plan,) = RematBlock.plan_cache.plans.values()
    print(plan.summary())
    print(
        f"each layer keeps {plan.measured_temp_bytes:,} B of {plan.baseline_temp_bytes:,} B "
        f"from its forward to its backward pass (budget={BUDGET})"
    )
    print(f"loss with remat {results['remat'][1]}, without {results['ref'][1]}")
    return {
        "plan": plan,
        "new_params": results["remat"][0],
        "ref_new_params": results["ref"][0],
        "grads": results["remat"][2],
        "ref_grads": results["ref"][2],
    }


if __name__ == "__main__":
    main()

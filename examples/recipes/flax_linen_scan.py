"""Recipe: Flax linen `nn.scan` over a block that `jremat.auto` plans.

`jremat.auto(Block, budget=...)` takes the place of `nn.remat(Block)`: `nn.scan` runs the
decorated block LAYERS times with its parameters stacked on a leading axis, and jremat plans
the block once (its body is the same program at every step) so that it keeps at most
BUDGET of the bytes it would keep from its forward pass to its backward pass. The parameter
tree is the same with and without the decorator, so checkpoints load either way.

    python examples/recipes/flax_linen_scan.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jremat

D, LAYERS, BATCH, SEQ, BUDGET = 64, 4, 16, 32, 0.4


class Block(nn.Module):
    """A pre-norm MLP block with a scan's signature: (carry, x) -> (carry, output)."""

    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(4 * D)(nn.LayerNorm()(h))
        return h + nn.Dense(D)(nn.gelu(y)), None


RematBlock = jremat.auto(Block, budget=BUDGET)  # as nn.remat(Block) would be


class Model(nn.Module):
    block: type  # Block or RematBlock

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            self.block,
            variable_axes={"params": 0},  # one set of parameters per layer, stacked
            split_rngs={"params": True},
            length=LAYERS,
        )
        h, _ = stack(name="layers")(nn.Dense(D)(x), None)
        return nn.Dense(1)(h)


def main():
    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (BATCH, SEQ, 8)), jax.random.normal(ky, (BATCH, SEQ, 1))
    params = Model(Block).init(jax.random.key(0), x)["params"]  # init is never planned

    def loss_fn(model):
        return lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    optimizer = optax.adamw(1e-3)

    def step_fn(model):
        @jax.jit
        def step(params, opt_state, x, y):
            value, grads = jax.value_and_grad(loss_fn(model))(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, grads

        return step

    results = {}
    for name, model in (("remat", Model(RematBlock)), ("ref", Model(Block))):
        new_params, _, value, grads = step_fn(model)(params, optimizer.init(params), x, y)
        results[name] = (new_params, float(value), grads)

    (plan,) = RematBlock.plan_cache.plans.values()  # one block program, one plan
    print(plan.summary())
    print(
        f"each layer keeps {plan.measured_temp_bytes:,} B of {plan.baseline_temp_bytes:,} B "
        f"from its forward to its backward pass (budget={BUDGET})"
    )
    print(f"loss with remat {results['remat'][1]}, without {results['ref'][1]}")
    print(jax.tree.map(jnp.shape, params["layers"]))  # stacked: (LAYERS, ...) per leaf
    return {
        "plan": plan,
        "params": params,
        "new_params": results["remat"][0],
        "ref_new_params": results["ref"][0],
        "grads": results["remat"][2],
        "ref_grads": results["ref"][2],
    }


if __name__ == "__main__":
    main()

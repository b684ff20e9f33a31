"""Recipe: a sharded AdamW train step with `@jremat.auto` on the loss.

A residual MLP, data parallel over the mesh's "data" axis and tensor parallel (Megatron-style:
the first matrix split by columns, the second by rows) over its "model" axis, on a 2 x 4 mesh
of 8 devices. The jitted step states its `in_shardings`/`out_shardings` and donates the
parameters and the optimizer state. jremat reads the shardings off `jit` and plans each
device's program, so the budget is a fraction of one device's temp bytes.

On a CPU the script asks XLA for 8 host devices (when `XLA_FLAGS` is not set):

    python examples/recipes/sharded_train_step.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jremat  # noqa: E402

D, HIDDEN, LAYERS, BATCH, STEPS, BUDGET = 128, 512, 4, 512, 3, 0.5


def init(key):
    keys = jax.random.split(key, 2 * LAYERS + 1)
    layers = [
        {
            "w1": jax.random.normal(keys[2 * i], (D, HIDDEN)) * D**-0.5,
            "w2": jax.random.normal(keys[2 * i + 1], (HIDDEN, D)) * HIDDEN**-0.5 / LAYERS,
        }
        for i in range(LAYERS)
    ]
    return {"layers": layers, "head": jax.random.normal(keys[-1], (D, 1)) * D**-0.5}


def loss(params, batch):
    x = batch["x"]
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):  # a layer jremat can cut at and report on
            x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (BATCH, D)), "y": jax.random.normal(ky, (BATCH, 1))}


# 2 x 4 mesh: the batch split over "data", each layer's matrices over "model"
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
param_specs = {
    "layers": [{"w1": P(None, "model"), "w2": P("model", None)}] * LAYERS,
    "head": P(),
}
batch_specs = {"x": P("data"), "y": P("data")}


def shardings(specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


optimizer = optax.adamw(1e-3, weight_decay=1e-4)


def make_step(loss_fn, param_sh, state_sh, batch_sh):
    """The jitted train step: value_and_grad, AdamW, parameters and state donated."""

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(
        step,
        in_shardings=(param_sh, state_sh, batch_sh),
        out_shardings=(param_sh, state_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),  # the step writes the new parameters and state in place
    )


def train(loss_fn, batches):
    """STEPS AdamW steps from the same initial parameters; the final parameters and losses."""
    param_sh, batch_sh = shardings(param_specs), shardings(batch_specs)
    params = jax.device_put(init(jax.random.key(0)), param_sh)
    # the optimizer state: mu and nu sharded as the parameters, the step count replicated
    state_sh = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        param_sh,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    opt_state = jax.jit(optimizer.init, out_shardings=state_sh)(params)
    step = make_step(loss_fn, param_sh, state_sh, batch_sh)
    losses = []
    for batch in batches:
        params, opt_state, value = step(params, opt_state, jax.device_put(batch, batch_sh))
        losses.append(float(value))
    return params, losses


def main():
    planned = jremat.auto(loss, budget=BUDGET)  # or @jremat.auto(budget=0.5) on `def loss`
    batches = [make_batch(jax.random.key(i + 1)) for i in range(STEPS)]
    params, losses = train(planned, batches)
    ref_params, ref_losses = train(loss, batches)  # the same step without remat

    (plan,) = planned.plans.values()  # one argument signature, one plan
    print(plan.summary())
    print(f"losses with remat {losses}, without {ref_losses}")
    print(
        f"per-device temp of the gradient: {plan.baseline_temp_bytes:,} B without remat, "
        f"{plan.measured_temp_bytes:,} B with budget={BUDGET} "
        f"({plan.measured_temp_bytes / plan.baseline_temp_bytes:.0%})"
    )
    # the same gradients, outside the train step, against jax.grad of the plain loss
    sharded = jax.device_put(
        (init(jax.random.key(0)), batches[0]), shardings((param_specs, batch_specs))
    )
    grads = jax.jit(jax.grad(planned))(*sharded)
    ref_grads = jax.jit(jax.grad(loss))(*sharded)
    return {
        "plan": plan,
        "params": params,
        "ref_params": ref_params,
        "losses": losses,
        "ref_losses": ref_losses,
        "grads": grads,
        "ref_grads": ref_grads,
    }


if __name__ == "__main__":
    main()

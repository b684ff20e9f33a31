"""Recipe: the same loss under `jax.shard_map`, `jremat.auto` on the per-device body.

Data parallel over 8 devices: the parameters are replicated, each device takes its rows of
the batch, computes its loss with `jremat.auto`, and `lax.pmean` averages the losses (so
`jax.grad` averages the gradients). Inside a `shard_map` body every value is already per
device, so jremat plans the body as it is, with no shardings to read; collectives in the
body stay bound while it plans.

On a CPU the script asks XLA for 8 host devices (when `XLA_FLAGS` is not set):

    python examples/recipes/shard_map_step.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jremat  # noqa: E402

D, HIDDEN, LAYERS, BATCH, STEPS, BUDGET = 64, 256, 4, 2048, 3, 0.5


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
        with jax.named_scope(f"layer_{i}"):
            x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (BATCH, D)), "y": jax.random.normal(ky, (BATCH, 1))}


mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
optimizer = optax.adamw(1e-3, weight_decay=1e-4)


def make_step(loss_fn):
    """A jitted AdamW step whose loss is a shard_map over the batch: per device, `loss_fn`
    on its rows (BATCH / 8 of them), then the mean over devices."""

    def per_device(params, batch):
        return jax.lax.pmean(loss_fn(params, batch), "data")

    global_loss = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(global_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    return jax.jit(step, donate_argnums=(0, 1))


def train(loss_fn, batches):
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(init(jax.random.key(0)), replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    step = make_step(loss_fn)
    losses, first_grads = [], None
    for batch in batches:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        params, opt_state, value, grads = step(params, opt_state, batch)
        losses.append(float(value))
        first_grads = grads if first_grads is None else first_grads
    return params, losses, first_grads


def main():
    planned = jremat.auto(loss, budget=BUDGET)  # planned on the body's per-device shapes
    batches = [make_batch(jax.random.key(i + 1)) for i in range(STEPS)]
    params, losses, grads = train(planned, batches)
    ref_params, ref_losses, ref_grads = train(loss, batches)

    (plan,) = planned.plans.values()
    print(plan.summary())
    print(f"losses with remat {losses}, without {ref_losses}")
    print(
        f"per-device temp of the body's gradient: {plan.baseline_temp_bytes:,} B without "
        f"remat, {plan.measured_temp_bytes:,} B with budget={BUDGET}"
    )
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

"""Recipe: gradient accumulation on a batch sharded over 8 devices.

Two ways to take a step on more examples than fit at once, both on a batch split over the
mesh's "data" axis, and both with `jremat.auto` on the loss:

* `jremat.microbatch(loss, K)` splits each batch into K microbatches inside one jitted step
  (a loop over them; each device keeps its own rows, nothing moves between devices);
* `jremat.accumulate(optimizer, every_k=N)` sums the gradients of N steps and updates the
  parameters on every N-th (optax.MultiSteps).

Together, here: N = 2 steps of K = 4 microbatches each take the same AdamW update as one
step on both batches at once, which the script checks. The mesh's axes are Explicit (what
`jax.make_mesh` makes by default): every value's type carries its sharding, so jremat reads
the microbatches' shardings without being told.

On a CPU the script asks XLA for 8 host devices (when `XLA_FLAGS` is not set):

    python examples/recipes/sharded_accumulation.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jremat  # noqa: E402

D, HIDDEN, LAYERS, BATCH, K, N, BUDGET = 64, 256, 4, 8192, 4, 2, 0.5


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
    """The mean over the batch (what `microbatch`'s default reduction expects)."""
    x = batch["x"]
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def make_batch(key):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (BATCH, D)), "y": jax.random.normal(ky, (BATCH, 1))}


mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def main():
    planned = jremat.auto(loss, budget=BUDGET)  # planned on one microbatch's shapes
    optimizer = jremat.accumulate(optax.adamw(1e-3), every_k=N)
    grad_fn = jremat.microbatch(planned, K)  # (loss, grads), the mean over the K microbatches

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    batches = [make_batch(jax.random.key(i + 1)) for i in range(N)]
    with jax.set_mesh(mesh):
        params = jax.device_put(init(jax.random.key(0)), NamedSharding(mesh, P()))
        opt_state = optimizer.init(params)
        for batch in batches:
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            params, opt_state, value = step(params, opt_state, batch)
            print(f"loss {float(value):.6f}, updated: {bool(jremat.has_updated(opt_state))}")

    # the reference: one AdamW step on both batches at once, no remat, no sharding
    both = jax.tree.map(lambda *b: jnp.concatenate(b), *batches)
    ref_params = init(jax.random.key(0))
    adamw = optax.adamw(1e-3)
    ref_grads = jax.grad(loss)(ref_params, both)
    updates, _ = adamw.update(ref_grads, adamw.init(ref_params), ref_params)
    ref_params = optax.apply_updates(ref_params, updates)

    (plan,) = planned.plans.values()
    print(plan.summary())
    print(
        f"per-device temp of one microbatch's gradient: {plan.baseline_temp_bytes:,} B "
        f"without remat, {plan.measured_temp_bytes:,} B with budget={BUDGET}"
    )
    return {
        "plan": plan,
        "params": params,
        "ref_params": ref_params,
        "updated": bool(jremat.has_updated(opt_state)),
        "x_sharding": batch["x"].sharding,
    }


if __name__ == "__main__":
    main()

"""The README's example: `jremat.auto` on a plain JAX loss (runs in seconds on a CPU)."""

import jax
import jax.numpy as jnp

import jremat

k = jax.random.split(jax.random.PRNGKey(0), 17)
params = [
    (jax.random.normal(k[i], (256, 512)) / 16, jax.random.normal(k[i + 8], (512, 256)) / 23)
    for i in range(8)
]
x = jax.random.normal(k[16], (1024, 256))


@jremat.auto(budget=0.4)  # at most 40% of the unrematerialized activation memory
def loss(params, x):
    for i, (w1, w2) in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x**2)


grads = jax.jit(jax.grad(loss))(params, x)  # plans on the first call per shape signature
(plan,) = loss.plans.values()  # the Plan for this signature
print(plan.summary())  # segments, bytes, recompute FLOPs, source lines
print(
    f"compiled temp {plan.measured_temp_bytes / 2**20:.1f} MiB of "
    f"{plan.baseline_temp_bytes / 2**20:.1f} MiB unrematerialized"
)

"""The README's example: `jremat.auto` on a plain JAX loss.

9 s of CPU time on a 2-core machine (28 s wall while the machine was shared).
"""

import jax
import jax.numpy as jnp

import jremat

jremat.log_to_stderr()  # progress on stderr (jremat is quiet by default)
k = jax.random.split(jax.random.key(0), 9)
params = [
    (jax.random.normal(k[i], (128, 256)) / 11, jax.random.normal(k[i + 4], (256, 128)) / 16)
    for i in range(4)
]
x = jax.random.normal(k[8], (256, 128))


@jremat.auto(budget=0.4)  # at most 40% of the unrematerialized step's temp bytes
def loss(params, x):
    for i, (w1, w2) in enumerate(params):
        with jax.named_scope(f"layer_{i}"):
            x = x + jax.nn.gelu(x @ w1) @ w2
    return jnp.mean(x**2)


grads = jax.jit(jax.grad(loss))(params, x)  # plans on the first call per shape signature
(plan,) = loss.plans.values()  # the Plan for this signature
print(plan.summary())  # budget, compiled figures, then per segment
print(
    f"compiled temp {plan.measured_temp_bytes / 2**20:.1f} MiB of "
    f"{plan.baseline_temp_bytes / 2**20:.1f} MiB unrematerialized"
)

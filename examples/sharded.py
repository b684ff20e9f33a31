"""`jremat.auto` under SPMD: a GPT-style decoder, data + tensor parallel on a 2x4 mesh of 8
devices, planned with a per-device budget; then the same model inside a `shard_map` body.

On a CPU, run with 8 forced host devices (the script sets the flag when jax is not yet
imported):

    python examples/sharded.py

Prints the per-device compiled temp bytes before and after, and checks that the gradients
equal the unrematerialized ones.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jremat  # noqa: E402

D, HEADS, SEQ, BATCH, VOCAB, DEPTH = 64, 4, 32, 16, 64, 3


def init(key):
    k = iter(jax.random.split(key, 4 * DEPTH + 3))
    n = lambda shape, s: jax.random.normal(next(k), shape) * s  # noqa: E731
    layer = lambda: {
        "wqkv": n((D, 3 * D), D**-0.5),
        "wo": n((D, D), D**-0.5),  # noqa: E731
        "w1": n((D, 4 * D), D**-0.5),
        "w2": n((4 * D, D), (4 * D) ** -0.5),
    }
    return {
        "embed": n((VOCAB, D), 0.5),
        "pos": n((SEQ, D), 0.5),
        "layers": [layer() for _ in range(DEPTH)],
        "head": n((D, VOCAB), D**-0.5),
    }


def norm(x):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def loss(params, tokens):
    onehot = jax.nn.one_hot(tokens, VOCAB)
    h = onehot[:, :-1] @ params["embed"] + params["pos"]
    b, t, _ = h.shape
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            q, k, v = jnp.split(norm(h) @ p["wqkv"], 3, axis=-1)
            q, k, v = (z.reshape(b, t, HEADS, D // HEADS) for z in (q, k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // HEADS) ** 0.5
            a = jax.nn.softmax(jnp.where(causal, s, -1e9), -1)
            h = h + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, D) @ p["wo"]
            h = h + jax.nn.gelu(norm(h) @ p["w1"]) @ p["w2"]
    logp = jax.nn.log_softmax(norm(h) @ params["head"], -1)
    return -jnp.mean(jnp.sum(logp * onehot[:, 1:], -1))


def max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


params = init(jax.random.key(0))
tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)

# -- sharded jit: batch over "data", Megatron tensor parallelism over "model" ------------------
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
tp = {
    "wqkv": P(None, "model"),
    "wo": P("model", None),
    "w1": P(None, "model"),
    "w2": P("model", None),
}
specs = ({"embed": P(), "pos": P(), "layers": [tp] * DEPTH, "head": P()}, P("data"))
shardings = jax.tree_util.tree_map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
)
args = jax.device_put((params, tokens), shardings)

# inside jit the tracers do not say how they are sharded (Auto mode): in_shardings does
planned = jremat.auto(loss, budget=0.5, in_shardings=specs, mesh=mesh, max_rounds=2)
grads = jax.jit(jax.grad(planned))(*args)
ref = jax.jit(jax.grad(loss))(*args)
(plan,) = planned.plans.values()
before = plan.baseline_temp_bytes  # compiled per device by jremat
after = jremat.measure(jremat.rematerialize(loss, plan), *args)  # sharded arrays: per device
single = jremat.measure(loss, params, tokens)
print(f"one device, unrematerialized:    temp {single.temp_bytes / 2**20:6.2f} MiB")
print(f"2x4 mesh, per device, no remat:  temp {before / 2**20:6.2f} MiB")
print(
    f"2x4 mesh, per device, budget .5: temp {after.temp_bytes / 2**20:6.2f} MiB "
    f"({after.temp_bytes / before:.0%}; {after.num_devices} devices)"
)
print(f"max |grad - unrematerialized grad| = {max_diff(grads, ref):.1e}")
assert after.temp_bytes <= 0.5 * before and max_diff(grads, ref) <= 1e-6

# -- shard_map: auto inside the per-device body (its values are per device already) -----------
dp = jax.make_mesh(
    (2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
)  # 8 sequences per device
local = jremat.auto(loss, budget=0.5, max_rounds=2)


def step(fn):
    body = lambda p, t: jax.lax.pmean(fn(p, t), "data")  # noqa: E731
    return jax.jit(
        jax.grad(jax.shard_map(body, mesh=dp, in_specs=(P(), P("data")), out_specs=P()))
    )(params, tokens)


diff = max_diff(step(local), step(loss))
(plan,) = local.plans.values()
print(
    f"shard_map body, per device: temp {plan.baseline_temp_bytes / 2**20:.2f} -> "
    f"{plan.measured_temp_bytes / 2**20:.2f} MiB, max grad diff {diff:.1e}"
)
assert plan.measured_temp_bytes <= 0.5 * plan.baseline_temp_bytes and diff <= 1e-6

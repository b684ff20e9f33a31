"""Train a small Flax linen transformer whose blocks are `@jremat.auto(budget=0.4)`.

A byte-level causal transformer (4 pre-norm blocks: self-attention and a GELU MLP, both with
dropout; d=64, 4 heads) is trained with AdamW on the public-domain text shipped with jremat
(`jremat.data`, fresh 16 x 64-token windows each step). Each block class carries
`@jremat.auto(budget=0.4, static_argnames="train")`: on the first traced call of a shape
signature jremat plans the block so that it keeps at most 40% of the bytes it would keep from
its forward to its backward pass (see docs/design.md#flax-blocks), verified on compiled programs;
the 4 blocks share that plan. Parameter paths are those of the undecorated model
(`Block_0` ... `Block_3`), so checkpoints load either way.

It prints the compiled temp bytes of the training step (`jremat.measure`) with the decorator
and without it (the same model under `jremat.disabled()`, which switches the
decorators off), the block's plan, and the loss falling. 98 s of CPU time on a 2-core machine
(342 s wall while the machine was shared):

    python examples/flax_linen.py
"""

from __future__ import annotations

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jremat
from jremat import data

VOCAB, D, HEADS, LAYERS, SEQ, BATCH, STEPS, LR, DROPOUT = 256, 64, 4, 4, 64, 16, 200, 3e-3, 0.1


@jremat.auto(budget=0.4, static_argnames="train")
class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); shapes (B, T, D)."""

    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array, train: bool) -> jax.Array:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dropout_rate=self.dropout, deterministic=not train
        )(h, h, mask=mask)
        x = x + nn.Dropout(self.dropout, deterministic=not train)(h)
        h = nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))
        h = nn.Dense(x.shape[-1])(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=not train)(h)


class Transformer(nn.Module):
    """Byte-level causal LM: tokens (B, T) int32 -> logits (B, T, VOCAB) float32."""

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        x = (
            nn.Embed(VOCAB, D)(tokens)
            + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))[: tokens.shape[1]]
        )
        mask = nn.make_causal_mask(tokens)
        for _ in range(LAYERS):
            x = Block(HEADS, DROPOUT)(x, mask, train=train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def main() -> None:
    jremat.log_to_stderr()  # progress on stderr (jremat is quiet by default)
    model = Transformer()
    tokens = jnp.asarray(data.batches(BATCH, SEQ + 1, seed=0))
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss_fn(params, tokens, key):
        logits = model.apply({"params": params}, tokens[:, :-1], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    key = jax.random.key(1)
    with jremat.disabled():
        plain = jremat.measure(loss_fn, params, tokens, key)
    remat = jremat.measure(loss_fn, params, tokens, key)  # plans the blocks (once per shape)
    (plan,) = Block.plan_cache.plans.values()
    print(plan.summary())
    print(
        f"compiled temp of a training step: {plain.temp_bytes / 2**20:.2f} MiB without the "
        f"decorator, {remat.temp_bytes / 2**20:.2f} MiB with @jremat.auto(budget=0.4) "
        f"({remat.temp_bytes / plain.temp_bytes:.2f}x); FLOPs {remat.flops / plain.flops:.2f}x"
    )
    print(
        f"each block keeps {plan.measured_temp_bytes:,} B of {plan.baseline_temp_bytes:,} B "
        "between its forward and backward pass"
    )

    opt = optax.adamw(LR)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    t0 = time.perf_counter()
    for i in range(STEPS):
        tokens = jnp.asarray(data.batches(BATCH, SEQ + 1, seed=i))
        params, opt_state, loss = step(params, opt_state, tokens, jax.random.fold_in(key, i))
        losses.append(float(loss))
        if i % 25 == 0 or i == STEPS - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
    first, last = float(np.mean(losses[:20])), float(np.mean(losses[-20:]))
    print(
        f"mean loss, first 20 steps: {first:.4f}; last 20 steps: {last:.4f} "
        f"(ln 256 = {np.log(256):.4f} is chance)"
    )


if __name__ == "__main__":
    main()

"""Train a small Flax NNX transformer whose blocks are `@jremat.auto(budget=0.4)`.

The NNX twin of `examples/flax_linen.py`: a byte-level causal transformer (4 pre-norm blocks,
self-attention and a GELU MLP with dropout; d=64, 4 heads) trained with AdamW
(`nnx.Optimizer`) on the text shipped with jremat. The block class carries
`@jremat.auto(budget=0.4)`: jremat plans what the block keeps between its forward and backward
pass (at most 40% of the unrematerialized bytes, verified on compiled programs; see
docs/design.md#flax-blocks). Dropout streams advance exactly as without the
decorator.

It prints the compiled temp bytes of the loss's value-and-gradient (`nnx.jit(...).lower()`)
with the decorator and without it (the same model under `jremat.disabled()`), the
block's plan, and the loss falling. 108 s of CPU time on a 2-core machine (309 s wall while
the machine was shared):

    python examples/flax_nnx.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jremat
from jremat import data

VOCAB, D, HEADS, LAYERS, SEQ, BATCH, STEPS, LR, DROPOUT = 256, 64, 4, 4, 64, 16, 200, 3e-3, 0.1


@jremat.auto(budget=0.4)
class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); shapes (B, T, D)."""

    def __init__(self, d: int, heads: int, dropout: float, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=d,
            dropout_rate=dropout,
            deterministic=False,
            decode=False,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, mask=mask))
        return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))


class Transformer(nnx.Module):
    """Byte-level causal LM: tokens (B, T) int32 -> logits (B, T, VOCAB) float32."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, D)) * 0.02)
        self.blocks = nnx.List([Block(D, HEADS, DROPOUT, rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def loss_fn(model: Transformer, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def main() -> None:
    jremat.log_to_stderr()  # progress on stderr (jremat is quiet by default)
    model = Transformer(nnx.Rngs(params=0, dropout=1))
    tokens = jnp.asarray(data.batches(BATCH, SEQ + 1, seed=0))

    def grad_step(model, tokens):  # what one training step computes before the update
        return nnx.value_and_grad(loss_fn)(model, tokens)

    def compiled(model, tokens):
        exe = nnx.jit(grad_step).lower(model, tokens).compile()
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return exe.memory_analysis().temp_size_in_bytes, cost["flops"]

    with jremat.disabled():
        plain_temp, plain_flops = compiled(model, tokens)
    temp, flops = compiled(model, tokens)  # plans the blocks (once per shape signature)
    (plan,) = Block.plan_cache.plans.values()
    print(plan.summary())
    print(
        f"compiled temp of a training step: {plain_temp / 2**20:.2f} MiB without the "
        f"decorator, {temp / 2**20:.2f} MiB with @jremat.auto(budget=0.4) "
        f"({temp / plain_temp:.2f}x); FLOPs {flops / plain_flops:.2f}x"
    )
    print(
        f"each block keeps {plan.measured_temp_bytes:,} B of {plan.baseline_temp_bytes:,} B "
        "between its forward and backward pass"
    )

    optimizer = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    losses = []
    t0 = time.perf_counter()
    for i in range(STEPS):
        tokens = jnp.asarray(data.batches(BATCH, SEQ + 1, seed=i))
        losses.append(float(step(model, optimizer, tokens)))
        if i % 25 == 0 or i == STEPS - 1:
            print(f"step {i:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - t0:.1f} s)")
    first, last = float(np.mean(losses[:20])), float(np.mean(losses[-20:]))
    print(
        f"mean loss, first 20 steps: {first:.4f}; last 20 steps: {last:.4f} "
        f"(ln 256 = {np.log(256):.4f} is chance)"
    )


if __name__ == "__main__":
    main()

"""Plain-JAX workloads (no extra packages): a residual MLP chain, U-Net-like conv nets and a
ResNet.

`mlp` and `unet_plain` are written with `jax.named_scope` per layer, so that jremat finds
their layer boundaries from the jaxpr's name stack, as it does for Flax models.
`unet_maxpool` and `resnet_plain` carry no names at all, as a new user writes them: plain
Python block functions called again and again, whose blocks jremat has to find from the
repeated equations (docs/design.md#layers-without-names). Their `block_policy` keyword
wraps each block call in `jax.checkpoint` under a built-in policy: the per-block reference
a plan is compared with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import Workload, init_key

#: Size presets: keyword arguments of each builder.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "default": dict(depth=12, width=512, batch_size=256),
        "tiny": dict(depth=4, width=32, batch_size=64),
    },
    "unet_plain": {
        "default": dict(depth=3, channels=16, size=32, batch_size=8),
        "tiny": dict(depth=2, channels=4, size=16, batch_size=2),
    },
    "unet_maxpool": {
        "default": dict(depth=2, channels=24, size=48, batch_size=4),
        "tiny": dict(depth=2, channels=4, size=16, batch_size=2),
    },
    "resnet_plain": {
        "default": dict(blocks=(2, 2), channels=16, size=32, batch_size=8),
        "tiny": dict(blocks=(1, 1), channels=4, size=8, batch_size=2),
    },
}


def residual_mlp_arrays(depth: int, width: int, batch_size: int, seed: int = 0):
    """`(params, x)` of a residual MLP chain: `depth` dicts of float32 `w1` [width, 2 width]
    and `w2` [2 width, width], and a float32 batch `x` [batch_size, width]."""
    keys = jax.random.split(init_key(seed), depth + 1)
    params = [
        {
            "w1": jax.random.normal(k, (width, 2 * width)) / jnp.sqrt(width),
            "w2": jax.random.normal(jax.random.fold_in(k, 1), (2 * width, width)) / (2 * width),
        }
        for k in keys[:depth]
    ]
    return params, jax.random.normal(keys[-1], (batch_size, width))


def mlp_workload(depth: int = 12, width: int = 512, batch_size: int = 256) -> Workload:
    """A residual MLP chain: x <- x + W2 gelu(W1 layernorm(x)), `depth` layers, f32."""
    params, x = residual_mlp_arrays(depth, width, batch_size)

    def loss(params, x):
        for i, p in enumerate(params):
            with jax.named_scope(f"layer_{i}"):
                h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
                x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
        return jnp.mean(x**2)

    return Workload("mlp", loss, params, x, f"residual MLP, {depth} layers, width {width}")


def _conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def unet_workload(
    depth: int = 3, channels: int = 16, size: int = 32, batch_size: int = 8
) -> Workload:
    """A U-Net-like conv net: `depth` down blocks, up blocks joined by long skip connections.

    One 3x3 conv per level and nearest-neighbour upsampling: cheaper than the U-Net of
    Ronneberger et al. (2015), which is the `unet` workload (`jremat.models.unet`).
    """
    key = init_key(1)
    params = {"down": [], "up": []}
    c = 3
    for i in range(depth):
        params["down"].append(
            jax.random.normal(jax.random.fold_in(key, i), (3, 3, c, channels * 2**i)) * 0.1
        )
        c = channels * 2**i
    for i in reversed(range(depth)):
        cin = c + channels * 2**i
        params["up"].append(
            jax.random.normal(jax.random.fold_in(key, 100 + i), (3, 3, cin, channels * 2**i)) * 0.1
        )
        c = channels * 2**i
    params["head"] = jax.random.normal(jax.random.fold_in(key, 999), (1, 1, c, 3)) * 0.1
    x = jax.random.normal(jax.random.fold_in(key, 7), (batch_size, size, size, 3))

    def loss(params, x):
        skips = []
        h = x
        for i, w in enumerate(params["down"]):
            with jax.named_scope(f"down_{i}"):
                h = jax.nn.relu(_conv(h, w))
                skips.append(h)
                h = jax.lax.reduce_window(
                    h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
                )
        for i, w in enumerate(params["up"]):
            with jax.named_scope(f"up_{i}"):
                skip = skips.pop()
                h = jax.image.resize(h, skip.shape[:3] + h.shape[3:], "nearest")
                h = jax.nn.relu(_conv(jnp.concatenate([h, skip], -1), w))
        out = _conv(h, params["head"])
        return jnp.mean((out - x) ** 2)

    return Workload(
        "unet_plain",
        loss,
        params,
        x,
        f"U-Net-like conv net, depth {depth}, {channels} channels, {size}x{size}",
    )


def _per_block(block: Any, block_policy: str | None) -> Any:
    """`block`, or `jax.checkpoint(block)` under the named `jax.checkpoint_policies` policy."""
    if block_policy is None:
        return block
    policy = getattr(jax.checkpoint_policies, block_policy, None)
    if policy is None or not callable(policy) or block_policy.startswith("save_"):
        raise ValueError(
            f"block_policy must be None or the name of a jax.checkpoint_policies policy "
            f"(such as 'nothing_saveable', 'dots_saveable'), got {block_policy!r}"
        )
    return jax.checkpoint(block, policy=policy)


def unet_maxpool_workload(
    depth: int = 2,
    channels: int = 24,
    size: int = 48,
    batch_size: int = 4,
    block_policy: str | None = None,
) -> Workload:
    """A U-Net of plain functions without names: `block(w, h) = silu(conv3x3(h, w))` per level
    (`channels * 2**level` channels), 2x2 max pooling (`lax.reduce_window`), a block at the
    bottom, nearest upsampling (`jax.image.resize`) and concatenated skips on the way up, a
    1x1 head; loss: mean squared error against the input. `size` must be divisible by
    `2**depth`. `block_policy`: see the module docstring.
    """
    if size % 2**depth:
        raise ValueError(f"size ({size}) must be divisible by 2**depth ({2**depth})")
    key = init_key(2)
    widths = [channels * 2**i for i in range(depth)]
    params: dict[str, Any] = {"down": [], "up": []}
    c = 3
    for i, w in enumerate(widths):
        params["down"].append(jax.random.normal(jax.random.fold_in(key, i), (3, 3, c, w)) * 0.1)
        c = w
    params["mid"] = jax.random.normal(jax.random.fold_in(key, 50), (3, 3, c, c)) * 0.1
    for i, w in reversed(list(enumerate(widths))):
        params["up"].append(
            jax.random.normal(jax.random.fold_in(key, 100 + i), (3, 3, c + w, w)) * 0.1
        )
        c = w
    params["head"] = jax.random.normal(jax.random.fold_in(key, 999), (1, 1, c, 3)) * 0.1
    x = jax.random.normal(jax.random.fold_in(key, 7), (batch_size, size, size, 3))

    def block(w, h):
        return jax.nn.silu(_conv(h, w))

    run = _per_block(block, block_policy)

    def loss(params, x):
        skips, h = [], x
        for w in params["down"]:
            h = run(w, h)
            skips.append(h)
            h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        h = run(params["mid"], h)
        for w in params["up"]:
            skip = skips.pop()
            h = jax.image.resize(h, skip.shape[:3] + h.shape[3:], "nearest")
            h = run(w, jnp.concatenate([h, skip], -1))
        return jnp.mean((_conv(h, params["head"]) - x) ** 2)

    return Workload(
        "unet_maxpool",
        loss,
        params,
        x,
        f"plain-JAX U-Net without names, max pooling, depth {depth}, {channels} channels, "
        f"{size}x{size}",
    )


def resnet_plain_workload(
    blocks: tuple[int, ...] = (2, 2),
    channels: int = 16,
    size: int = 32,
    batch_size: int = 8,
    block_policy: str | None = None,
) -> Workload:
    """A ResNet of plain functions without module paths: a 3x3 stem, then per stage
    `blocks[i]` residual blocks `h + conv(relu(norm(conv(relu(norm(h))))))` at
    `channels * 2**i` channels (a strided 1x1 projection between stages), global average
    pooling, a dense head, softmax cross-entropy against random labels of 10 classes.
    `norm` normalizes each channel over the batch and space (batch norm without running
    statistics). `block_policy`: see the module docstring.
    """
    key = init_key(3)
    keys = iter(jax.random.split(key, 4 * sum(blocks) + len(blocks) + 4))
    c = channels
    params: dict[str, Any] = {
        "stem": jax.random.normal(next(keys), (3, 3, 3, c)) * 0.2,
        "stages": [],
    }
    for i, n in enumerate(blocks):
        w = channels * 2**i
        stage: dict[str, Any] = {"proj": None, "blocks": []}
        if i:
            stage["proj"] = jax.random.normal(next(keys), (1, 1, c, w)) * c**-0.5
        for _ in range(n):
            stage["blocks"].append(
                {
                    "w1": jax.random.normal(next(keys), (3, 3, w, w)) * (9 * w) ** -0.5,
                    "w2": jax.random.normal(next(keys), (3, 3, w, w)) * (9 * w) ** -0.5,
                }
            )
        params["stages"].append(stage)
        c = w
    params["head"] = jax.random.normal(next(keys), (c, 10)) * c**-0.5
    x = jax.random.normal(next(keys), (batch_size, size, size, 3))
    labels = jax.random.randint(next(keys), (batch_size,), 0, 10)

    def norm(h):
        mean = h.mean((0, 1, 2), keepdims=True)
        return (h - mean) * jax.lax.rsqrt(h.var((0, 1, 2), keepdims=True) + 1e-5)

    def block(p, h):
        y = _conv(jax.nn.relu(norm(h)), p["w1"])
        return h + _conv(jax.nn.relu(norm(y)), p["w2"])

    run = _per_block(block, block_policy)

    def loss(params, batch):
        x, labels = batch
        h = _conv(x, params["stem"])
        for stage in params["stages"]:
            if stage["proj"] is not None:
                h = jax.lax.conv_general_dilated(
                    h, stage["proj"], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            for p in stage["blocks"]:
                h = run(p, h)
        logits = h.mean((1, 2)) @ params["head"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    return Workload(
        "resnet_plain",
        loss,
        params,
        (x, labels),
        f"plain-JAX ResNet without module paths, blocks {tuple(blocks)}, {channels} channels, "
        f"{size}x{size}",
    )

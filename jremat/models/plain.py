"""Plain-JAX workloads (no extra packages): a residual MLP chain and a U-Net-like conv net.

Both are written with `jax.named_scope` per layer so that jremat finds their layer boundaries
from the jaxpr's name stack, as it does for Flax models.
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
}


def mlp_workload(depth: int = 12, width: int = 512, batch_size: int = 256) -> Workload:
    """A residual MLP chain: x <- x + W2 gelu(W1 layernorm(x)), `depth` layers, f32."""
    keys = jax.random.split(init_key(0), depth + 1)
    params = [
        {
            "w1": jax.random.normal(k, (width, 2 * width)) / jnp.sqrt(width),
            "w2": jax.random.normal(jax.random.fold_in(k, 1), (2 * width, width)) / (2 * width),
        }
        for k in keys[:depth]
    ]
    x = jax.random.normal(keys[-1], (batch_size, width))

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

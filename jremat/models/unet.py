"""U-Net (Ronneberger et al. 2015) in Flax linen, trained as a denoiser on synthetic images.

Source: O. Ronneberger, P. Fischer, T. Brox, "U-Net: Convolutional Networks for Biomedical
Image Segmentation", MICCAI 2015 (arXiv:1505.04597), Fig. 1 and section 2: a contracting path
of blocks of two 3x3 convolutions with ReLU, each followed by 2x2 max-pooling with stride 2 that
halves the resolution while the next block doubles the channels; an expansive path of 2x2
up-convolutions (transposed convolutions, stride 2) that halve the channels, concatenation with
the contracting path's feature map at the same resolution (the skip connection), and two 3x3
convolutions with ReLU; a final 1x1 convolution. The paper has 4 poolings and 64 channels in
the first block. One deviation, shared by most implementations: convolutions are padded
("SAME"), so feature maps need no cropping and the output has the input's size.

The `diffusers` U-Net (`FlaxUNet2DConditionModel`, the Stable Diffusion denoiser) also works
on current jax/flax (jax 0.12, flax 0.12.12) but took about 48 s to compile on a CPU, too slow for a
default comparison; this module has no dependency beyond Flax.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import Workload, init_key

#: Size presets: keyword arguments of `workload`.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "unet": {
        "default": dict(depth=3, channels=16, image_size=64, batch_size=8),
        "tiny": dict(depth=1, channels=4, image_size=16, batch_size=2),
    }
}


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by ReLU (one U-Net block)."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(self.features, (3, 3), padding="SAME")(x))
        return nn.relu(nn.Conv(self.features, (3, 3), padding="SAME")(x))


class UpBlock(nn.Module):
    """2x2 up-convolution halving the channels, concatenation with the skip, a DoubleConv."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, skip: jax.Array) -> jax.Array:
        x = nn.ConvTranspose(self.features, (2, 2), strides=(2, 2))(x)
        return DoubleConv(self.features)(jnp.concatenate([skip, x], axis=-1))


class UNet(nn.Module):
    """U-Net with `depth` poolings; block i of the contracting path has channels x 2^i filters.

    Blocks are named `enc_<i>` (the deepest, after the last pooling, is `enc_<depth>`) and
    `dec_<i>`, so each block is one layer for jremat's per-layer policies.
    """

    depth: int = 4
    channels: int = 64
    out_channels: int = 3

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        skips = []
        for i in range(self.depth):
            x = DoubleConv(self.channels * 2**i, name=f"enc_{i}")(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = DoubleConv(self.channels * 2**self.depth, name=f"enc_{self.depth}")(x)
        for j, i in enumerate(reversed(range(self.depth))):
            x = UpBlock(self.channels * 2**i, name=f"dec_{j}")(x, skips[i])
        return nn.Conv(self.out_channels, (1, 1), name="head")(x)


def workload(
    depth: int = 3, channels: int = 16, image_size: int = 64, batch_size: int = 8
) -> Workload:
    """U-Net denoising loss: predict the Gaussian noise added to synthetic RGB images (MSE).

    Args:
      depth: number of 2x2 poolings (the paper: 4); `image_size` must be divisible by 2^depth.
      channels: filters of the first block (the paper: 64), doubled after each pooling.
      image_size, batch_size: square NHWC float32 images.

    Raises:
      ValueError: image_size is not divisible by 2^depth, or a size is not positive.
    """
    if min(depth, channels, image_size, batch_size) <= 0:
        raise ValueError(
            f"depth, channels, image_size and batch_size must be positive, got "
            f"{depth}, {channels}, {image_size}, {batch_size}"
        )
    if image_size % 2**depth:
        raise ValueError(
            f"image_size={image_size} must be divisible by 2**depth={2**depth} (one halving "
            "per pooling)"
        )
    rng = np.random.default_rng(0)
    shape = (batch_size, image_size, image_size, 3)
    clean = rng.standard_normal(shape, dtype=np.float32)
    noise = rng.standard_normal(shape, dtype=np.float32)
    batch = (jnp.asarray(clean + noise), jnp.asarray(noise))
    model = UNet(depth=depth, channels=channels, out_channels=3)
    params = jax.jit(model.init)(init_key(0), batch[0])["params"]

    def loss(params, batch):
        noisy, noise = batch
        return jnp.mean((model.apply({"params": params}, noisy) - noise) ** 2)

    return Workload(
        "unet",
        loss,
        params,
        batch,
        f"Flax U-Net (Ronneberger et al. 2015), {depth} poolings, {channels} channels, "
        f"{image_size}px images, batch {batch_size}",
    )

"""ResNet image classifier from the `jax-resnet` zoo (Flax linen), on synthetic images.

Source: `jax_resnet.ResNet18` / `ResNet34` / `ResNet50` (package `jax-resnet` 0.0.4, Nicholas
Vadivelu, MIT licence), He et al., "Deep Residual Learning for Image Recognition" (2016):
7x7/2 stem with 64 filters, 3x3/2 max-pool, stages of basic (18, 34) or bottleneck (50) blocks,
global average pool, dense head. Checked on jax 0.10.2 / flax 0.12.8 and jax 0.12 /
flax 0.12.12. Batch normalisation runs in training mode (batch statistics; the updated running
averages are discarded), as in a training step. Random weights; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from . import Workload, init_key, require
from .hf import classification_loss, image_batch

#: Size presets: keyword arguments of `workload`.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "resnet": {
        "default": dict(
            depth=18, widths=(32, 64, 128, 256), image_size=64, batch_size=16, classes=10
        ),
        "tiny": dict(
            depth=18, widths=(8, 16), stages=(1, 1), image_size=16, batch_size=2, classes=10
        ),
    }
}


def workload(
    depth: int = 18,
    widths: Sequence[int] = (64, 128, 256, 512),
    stages: Sequence[int] | None = None,
    image_size: int = 64,
    batch_size: int = 16,
    classes: int = 10,
) -> Workload:
    """ResNet cross-entropy loss on a batch of synthetic NHWC images.

    Args:
      depth: 18 or 34 (basic blocks) or 50 (bottleneck blocks), as in He et al. (2016).
      widths: filters of each stage (the paper's are 64, 128, 256, 512); the stem keeps 64.
      stages: blocks per stage; default the paper's for `depth` (18: 2, 2, 2, 2).
      image_size, batch_size, classes: square RGB images and label classes.

    Raises:
      ImportError: jax-resnet is not installed (`pip install "jremat[zoo]"`).
      ValueError: unknown depth, or `stages` and `widths` of different lengths.
    """
    jr = require("jax_resnet", "resnet")
    blocks = {18: jr.ResNetBlock, 34: jr.ResNetBlock, 50: jr.ResNetBottleneckBlock}
    if depth not in blocks:
        raise ValueError(f"depth must be one of {sorted(blocks)}, got {depth!r}")
    paper = tuple(jr.STAGE_SIZES[depth])
    stages = paper if stages is None else tuple(stages)
    if len(stages) != len(widths):
        raise ValueError(
            f"stages {stages} and widths {tuple(widths)} must have the same length (one per stage)"
        )
    model = jr.ResNet(
        blocks[depth],
        stage_sizes=stages,
        hidden_sizes=tuple(widths),
        n_classes=classes,
        stem_cls=jr.ResNetStem,
    )
    images, labels = image_batch(batch_size, image_size, 3, classes, seed=0, layout="NHWC")
    variables = jax.jit(model.init)(init_key(0), images)
    batch_stats = variables["batch_stats"]

    def loss(params, batch):
        x, y = batch
        logits, _ = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
        )
        return classification_loss(logits, y)

    kind = "basic" if depth < 50 else "bottleneck"
    name = f"ResNet-{depth}" if stages == paper else f"ResNet ({kind} blocks)"
    return Workload(
        "resnet",
        loss,
        variables["params"],
        (images, labels),
        f"jax-resnet {name}, stages {stages}, widths {tuple(widths)}, "
        f"{image_size}px images, batch {batch_size}",
    )

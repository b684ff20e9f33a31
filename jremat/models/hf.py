"""Hugging Face Flax models for `jremat compare`: ViT, Llama and BERT (GPT-2 is in `gpt2.py`).

Each is the `transformers` 4.x Flax implementation (the last major version with Flax models;
transformers 5 removed them), built from a config with random weights; nothing is downloaded.
Checked with transformers 4.57.6 on jax 0.10.2 / flax 0.12.8 and jax 0.12 / flax 0.12.12.
Sources: Dosovitskiy et al., "An Image is Worth 16x16 Words" (2021) for ViT; Touvron et al.,
"LLaMA" (2023); Devlin et al., "BERT" (2019). Dropout is off (probabilities 0), so the loss is
deterministic and the rows' gradients compare exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import data
from . import Workload, init_hf

#: Size presets: keyword arguments of each builder.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "vit": {
        "default": dict(
            layers=6, hidden=128, heads=4, image_size=32, patch_size=4, batch_size=32, classes=10
        ),
        "tiny": dict(
            layers=2, hidden=32, heads=2, image_size=16, patch_size=4, batch_size=4, classes=10
        ),
    },
    "llama": {
        "default": dict(layers=6, hidden=128, heads=4, kv_heads=2, batch_size=8, seq_len=128),
        "tiny": dict(layers=2, hidden=32, heads=2, kv_heads=1, batch_size=2, seq_len=32),
    },
    "bert": {
        "default": dict(layers=6, hidden=128, heads=4, batch_size=8, seq_len=128),
        "tiny": dict(layers=2, hidden=32, heads=2, batch_size=2, seq_len=32),
    },
}

VOCAB = 256  # byte tokens


def transformers_module(model: str) -> Any:
    """`transformers` with its Flax models, or ImportError naming the install command."""
    try:
        import transformers

        transformers.FlaxPreTrainedModel  # noqa: B018 - absent in transformers >= 5
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"the {model} workload needs Hugging Face transformers 4.x with its Flax models "
            '(transformers 5 removed them): pip install "jremat[zoo]"'
        ) from e
    transformers.logging.set_verbosity_error()
    return transformers


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (f32) of `logits` (B, T, V) against `tokens` (B, T)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def image_batch(
    batch_size: int, image_size: int, channels: int, classes: int, *, seed: int, layout: str
) -> tuple[jax.Array, jax.Array]:
    """Synthetic images (seeded standard normal pixels) and integer labels in [0, classes).

    `layout` is "NCHW" or "NHWC". Memory and FLOPs depend only on shapes, so random pixels
    measure the same as real photographs would.
    """
    rng = np.random.default_rng(seed)
    shape = (batch_size, channels, image_size, image_size)
    if layout == "NHWC":
        shape = (batch_size, image_size, image_size, channels)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, classes, size=batch_size).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def classification_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy (f32) of `logits` (B, C) against integer `labels` (B,)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def vit_workload(
    layers: int = 6,
    hidden: int = 128,
    heads: int = 4,
    image_size: int = 32,
    patch_size: int = 4,
    batch_size: int = 32,
    classes: int = 10,
) -> Workload:
    """ViT image classifier (`FlaxViTForImageClassification`), cross-entropy on synthetic images.

    Args:
      layers, hidden, heads: encoder depth, width and attention heads (MLP width 4 x hidden).
      image_size, patch_size: square RGB images of image_size pixels cut into patch_size
        patches ((image_size / patch_size)^2 tokens plus [CLS]).
      batch_size, classes: batch of images (NCHW float32, as transformers expects) and the
        number of label classes.

    Raises:
      ImportError: transformers 4.x is not installed (`pip install "jremat[zoo]"`).
    """
    tf = transformers_module("vit")
    config = tf.ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        num_labels=classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.FlaxViTForImageClassification(config, _do_init=False)
    batch = image_batch(batch_size, image_size, 3, classes, seed=0, layout="NCHW")

    def loss(params, batch):
        images, labels = batch
        return classification_loss(model(images, params=params, train=False).logits, labels)

    n_tok = (image_size // patch_size) ** 2 + 1
    return Workload(
        "vit",
        loss,
        init_hf(model),
        batch,
        f"HF Flax ViT, {layers} layers, d={hidden}, {image_size}px images in {patch_size}px "
        f"patches ({n_tok} tokens), batch {batch_size}",
    )


def llama_workload(
    layers: int = 6,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    batch_size: int = 8,
    seq_len: int = 128,
) -> Workload:
    """Llama decoder (`FlaxLlamaForCausalLM`), next-token loss on byte-tokenized text.

    Args:
      layers, hidden, heads, kv_heads: decoder depth, width, query heads and key/value heads
        (grouped-query attention when kv_heads < heads); MLP width 8/3 x hidden (SwiGLU).
      batch_size, seq_len: int32 byte tokens of shape (batch_size, seq_len).

    Raises:
      ImportError: transformers 4.x is not installed (`pip install "jremat[zoo]"`).
    """
    tf = transformers_module("llama")
    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=(8 * hidden) // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
    )
    model = tf.FlaxLlamaForCausalLM(config, _do_init=False)
    tokens = jnp.asarray(data.batches(batch_size, seq_len, seed=0))

    def loss(params, tokens):
        return next_token_loss(model(tokens, params=params, train=False).logits, tokens)

    return Workload(
        "llama",
        loss,
        init_hf(model),
        tokens,
        f"HF Flax Llama, {layers} layers, d={hidden}, batch {batch_size}x{seq_len} bytes of text",
    )


def bert_workload(
    layers: int = 6,
    hidden: int = 128,
    heads: int = 4,
    batch_size: int = 8,
    seq_len: int = 128,
    mask_rate: float = 0.15,
) -> Workload:
    """BERT masked language model (`FlaxBertForMaskedLM`) on byte-tokenized text.

    A seeded `mask_rate` of the positions is replaced by a [MASK] token (id 256); the loss is
    the cross-entropy of the original bytes at those positions.

    Args:
      layers, hidden, heads: encoder depth, width and heads (MLP width 4 x hidden).
      batch_size, seq_len: int32 tokens of shape (batch_size, seq_len).
      mask_rate: fraction of positions masked, in (0, 1).

    Raises:
      ImportError: transformers 4.x is not installed (`pip install "jremat[zoo]"`).
      ValueError: mask_rate outside (0, 1).
    """
    if not 0.0 < mask_rate < 1.0:
        raise ValueError(f"mask_rate must be in (0, 1), got {mask_rate!r}")
    tf = transformers_module("bert")
    config = tf.BertConfig(
        vocab_size=VOCAB + 1,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = tf.FlaxBertForMaskedLM(config, _do_init=False)
    tokens = data.batches(batch_size, seq_len, seed=0)
    mask = np.random.default_rng(1).random(tokens.shape) < mask_rate
    mask[:, 0] = True  # at least one masked position per row
    batch = (jnp.asarray(np.where(mask, VOCAB, tokens)), jnp.asarray(tokens), jnp.asarray(mask))

    def loss(params, batch):
        inputs, targets, mask = batch
        logits = model(inputs, params=params, train=False).logits
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    return Workload(
        "bert",
        loss,
        init_hf(model),
        batch,
        f"HF Flax BERT masked LM, {layers} layers, d={hidden}, batch {batch_size}x{seq_len} "
        "bytes of text",
    )

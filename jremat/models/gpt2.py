"""The default workload: Hugging Face Flax GPT-2 (random weights) on byte-tokenized text.

Source: `transformers.FlaxGPT2LMHeadModel` (transformers 4.x, the last major version with Flax
models), a faithful implementation of Radford et al., "Language Models are Unsupervised Multitask
Learners" (2019). Built from a `GPT2Config`; no weights are downloaded.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .. import data
from . import Workload, init_hf
from .hf import next_token_loss, transformers_module

#: Size presets: keyword arguments of `workload`.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "default": dict(n_layer=6, n_embd=128, n_head=4, batch_size=8, seq_len=128),
        "tiny": dict(n_layer=2, n_embd=32, n_head=2, batch_size=2, seq_len=32),
    }
}


def workload(
    n_layer: int = 6, n_embd: int = 128, n_head: int = 4, batch_size: int = 8, seq_len: int = 128
) -> Workload:
    """GPT-2 language-model loss (mean next-token cross-entropy, f32) on a real text batch.

    Args:
      n_layer, n_embd, n_head: GPT-2 config sizes (vocabulary: 256 bytes + 1).
      batch_size, seq_len: the batch is int32 token ids of shape (batch_size, seq_len).

    Raises:
      ImportError: transformers 4.x is not installed (`pip install "jremat[zoo]"`).
    """
    tf = transformers_module("gpt2")
    config = tf.GPT2Config(
        vocab_size=257,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = tf.FlaxGPT2LMHeadModel(config, _do_init=False)
    batch = jnp.asarray(data.batches(batch_size, seq_len, seed=0))

    def loss(params, tokens):
        return next_token_loss(model(tokens, params=params, train=False).logits, tokens)

    return Workload(
        "gpt2",
        loss,
        init_hf(model),
        batch,
        f"HF Flax GPT-2, {n_layer} layers, d={n_embd}, batch {batch_size}x{seq_len} bytes of text",
    )

"""The default workload: Hugging Face Flax GPT-2 (random weights) on byte-tokenized text.

Source: `transformers.FlaxGPT2LMHeadModel` (transformers 4.x, the last major version with Flax
models), a faithful implementation of Radford et al., "Language Models are Unsupervised Multitask
Learners" (2019). Built from a `GPT2Config`; no weights are downloaded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import data
from . import Workload


def workload(
    n_layer: int = 6, n_embd: int = 128, n_head: int = 4, batch_size: int = 8, seq_len: int = 128
) -> Workload:
    """GPT-2 language-model loss (mean next-token cross-entropy, f32) on a real text batch.

    Args:
      n_layer, n_embd, n_head: GPT-2 config sizes (vocabulary: 256 bytes + 1).
      batch_size, seq_len: the batch is int32 token ids of shape (batch_size, seq_len).

    Raises:
      ImportError: transformers is not installed (`pip install "jremat[models]"`).
    """
    try:
        import transformers
        from transformers import FlaxGPT2LMHeadModel, GPT2Config
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'the gpt2 workload needs Hugging Face transformers<5: pip install "jremat[models]"'
        ) from e
    transformers.logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=257,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = FlaxGPT2LMHeadModel(config, seed=0, _do_init=True)
    batch = jnp.asarray(data.batches(batch_size, seq_len, seed=0))

    def loss(params, tokens):
        logits = model(tokens, params=params, train=False).logits
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    return Workload(
        "gpt2",
        loss,
        model.params,
        batch,
        f"HF Flax GPT-2, {n_layer} layers, d={n_embd}, batch {batch_size}x{seq_len} bytes of text",
    )

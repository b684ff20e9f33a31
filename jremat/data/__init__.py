"""Text shipped with jremat for its default model's batches (see SOURCES.md)."""

from __future__ import annotations

import importlib.resources

import numpy as np


def text() -> str:
    """The public-domain corpus carried with jremat (about 5 KB of English prose)."""
    root = importlib.resources.files(__name__)
    parts = sorted(p for p in root.iterdir() if p.name.endswith(".txt"))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in parts)


def byte_tokens() -> np.ndarray:
    """The corpus tokenized as UTF-8 bytes: int32 ids in [0, 256)."""
    return np.frombuffer(text().encode("utf-8"), dtype=np.uint8).astype(np.int32)


def batches(batch_size: int, seq_len: int, *, seed: int = 0) -> np.ndarray:
    """An endless-use array of token windows, shape (batch_size, seq_len), int32.

    Windows start at random offsets of the byte-tokenized corpus (deterministic per seed).
    Raises ValueError when seq_len exceeds the corpus length or sizes are not positive.

    Examples:
      >>> import jremat.data
      >>> tokens = jremat.data.batches(2, 16, seed=0)
      >>> tokens.shape, str(tokens.dtype)
      ((2, 16), 'int32')
      >>> bool((jremat.data.batches(2, 16, seed=0) == tokens).all())  # the same windows per seed
      True
    """
    tokens = byte_tokens()
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if seq_len >= len(tokens):
        raise ValueError(f"seq_len={seq_len} exceeds the corpus ({len(tokens)} tokens)")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return np.stack([tokens[s : s + seq_len] for s in starts])

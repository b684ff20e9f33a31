"""Workloads for `jremat compare`: a loss, its parameters and a batch.

`gpt2` (the default) is Hugging Face's `FlaxGPT2LMHeadModel` built from a config with random
weights (needs the `models` extra: `transformers<5`), fed byte-tokenized public-domain text that
jremat carries (`jremat.data`). `mlp` and `unet` are plain-JAX models that need nothing extra.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class Workload:
    """`loss(params, batch) -> scalar` with example `params` and `batch` (pytrees of arrays)."""

    name: str
    loss: Callable[[Any, Any], Any]
    params: Any
    batch: Any
    description: str


def get(name: str, **kw: Any) -> Workload:
    """Build workload `name` ("gpt2", "mlp", "unet"); keyword arguments size it.

    Raises ValueError for an unknown name, and ImportError with the install command when the
    model's package is missing.
    """
    from . import gpt2, plain

    builders = {"gpt2": gpt2.workload, "mlp": plain.mlp_workload, "unet": plain.unet_workload}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(builders)}")
    return builders[name](**kw)


NAMES = ("gpt2", "mlp", "unet")

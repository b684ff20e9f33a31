"""Model zoo for `jremat compare`: each workload is a loss, its parameters and a batch.

| name | model | source (`jremat[zoo]` extra unless plain) |
|---|---|---|
| `gpt2` (default) | GPT-2 decoder, byte-level text | `transformers.FlaxGPT2LMHeadModel` |
| `vit` | Vision Transformer, classifier | `transformers.FlaxViTForImageClassification` |
| `resnet` | ResNet-18/34/50, classifier | `jax_resnet.ResNet` (package `jax-resnet`) |
| `unet` | U-Net (Ronneberger et al. 2015), denoiser | `jremat.models.unet` (plain Flax) |
| `mlp` | residual MLP chain | `jremat.models.plain` (plain JAX) |
| `llama` | Llama decoder, byte-level text | `transformers.FlaxLlamaForCausalLM` |
| `bert` | BERT encoder, masked language model | `transformers.FlaxBertForMaskedLM` |
| `unet_plain` | U-Net-like conv net (the earlier `unet`) | `jremat.models.plain` (plain JAX) |
| `unet_maxpool` | U-Net with max pooling, no names | `jremat.models.plain` (plain JAX) |
| `resnet_plain` | ResNet without module paths | `jremat.models.plain` (plain JAX) |

Every model is built from a config with random weights (nothing is downloaded). Text models
read byte-tokenized public-domain text shipped in `jremat.data`; vision models read synthetic
image batches (seeded normal pixels, random labels): memory and FLOPs depend only on shapes.
Each has sizes: "default" (runs on a laptop CPU in minutes) and "tiny" (seconds, for tests).
Most layers run under module names with an index (`h/3`, `layers_4`, `enc_1`), from which
jremat finds the layer boundaries of the per-layer policies; `unet_maxpool` and
`resnet_plain` carry no names (jremat finds their blocks from the repeated equations).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jax


@dataclasses.dataclass
class Workload:
    """`loss(params, batch) -> scalar` with example `params` and `batch` (pytrees of arrays).

    Attributes:
      name: the workload's name, one of `NAMES`.
      loss: `loss(params, batch) -> scalar`, the function `jremat compare` plans.
      params: example parameters (a pytree of arrays).
      batch: an example batch (a pytree of arrays).
      description: one line on the model at its sizes ("residual MLP, 12 layers, width 512").
    """

    name: str
    loss: Callable[[Any, Any], Any]
    params: Any
    batch: Any
    description: str


# name -> (module, builder function, one-line summary)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "gpt2": ("gpt2", "workload", "Hugging Face Flax GPT-2 decoder on byte-level text"),
    "vit": ("hf", "vit_workload", "Hugging Face Flax ViT image classifier, synthetic images"),
    "resnet": ("resnet", "workload", "jax-resnet ResNet-18 image classifier, synthetic images"),
    "unet": ("unet", "workload", "Flax U-Net (Ronneberger et al. 2015) denoiser, synthetic images"),
    "mlp": ("plain", "mlp_workload", "plain-JAX residual MLP chain"),
    "llama": ("hf", "llama_workload", "Hugging Face Flax Llama decoder on byte-level text"),
    "bert": ("hf", "bert_workload", "Hugging Face Flax BERT masked LM on byte-level text"),
    "unet_plain": ("plain", "unet_workload", "plain-JAX U-Net-like conv net"),
    "unet_maxpool": ("plain", "unet_maxpool_workload", "plain-JAX U-Net, max pooling, no names"),
    "resnet_plain": ("plain", "resnet_plain_workload", "plain-JAX ResNet, no module paths"),
}

NAMES = tuple(_REGISTRY)
"""Workload names accepted by `get`, the default first."""
SIZES = ("default", "tiny")
"""Size presets every workload accepts."""


def describe(name: str) -> str:
    """One line saying what workload `name` is. Raises ValueError for an unknown name.

    Examples:
      >>> import jremat.models
      >>> jremat.models.describe("mlp")
      'plain-JAX residual MLP chain'
      >>> jremat.models.describe("gpt2")  # nothing is imported or built
      'Hugging Face Flax GPT-2 decoder on byte-level text'
    """
    _check_name(name)
    return _REGISTRY[name][2]


def sizes(name: str) -> dict[str, dict[str, Any]]:
    """The keyword arguments behind each size preset of workload `name`.

    Examples:
      >>> import jremat.models
      >>> presets = jremat.models.sizes("mlp")
      >>> sorted(presets) == sorted(jremat.models.SIZES)
      True
      >>> presets["tiny"]
      {'depth': 4, 'width': 32, 'batch_size': 64}
    """
    _check_name(name)
    module = importlib.import_module(f"{__name__}.{_REGISTRY[name][0]}")
    return module.SIZES[name]


def get(name: str, size: str = "default", **kw: Any) -> Workload:
    """Build workload `name` at a size preset; keyword arguments override the preset's sizes.

    Args:
      name: one of `NAMES` ("gpt2", "vit", "resnet", "unet", "mlp", "llama", "bert",
        "unet_plain", "unet_maxpool", "resnet_plain").
      size: "default" (a laptop CPU compares policies on it in minutes) or "tiny" (seconds;
        for tests and CI).
      **kw: model sizes, for example `get("gpt2", n_layer=2)`; see each builder's docstring
        (`jremat.models.gpt2.workload`, `jremat.models.hf.vit_workload`, ...).

    Raises:
      ValueError: unknown `name` or `size` (the message lists the accepted ones).
      ImportError: the model's package is missing; the message gives the install command
        (`pip install "jremat[zoo]"`).
      TypeError: a keyword the builder does not take.

    Examples:
      The plain-JAX residual MLP, smaller than its "tiny" preset:

      >>> import jax, jremat.models
      >>> w = jremat.models.get("mlp", "tiny", depth=2, width=8, batch_size=4)
      >>> w.description, w.batch.shape
      ('residual MLP, 2 layers, width 8', (4, 8))
      >>> [jax.tree.map(lambda a: a.shape, layer) for layer in w.params]
      [{'w1': (8, 16), 'w2': (16, 8)}, {'w1': (8, 16), 'w2': (16, 8)}]
      >>> jax.eval_shape(w.loss, w.params, w.batch).shape  # a scalar loss, as jremat plans
      ()
    """
    _check_name(name)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for model {name!r}; accepted: {', '.join(SIZES)}")
    mod_name, fn_name, _ = _REGISTRY[name]
    module = importlib.import_module(f"{__name__}.{mod_name}")
    return getattr(module, fn_name)(**{**module.SIZES[name][size], **kw})


def _check_name(name: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(NAMES)}")


def init_key(seed: int = 0) -> jax.Array:
    """The PRNG key workloads initialise their random weights with.

    A typed key of the "rbg" implementation (XLA's RngBitGenerator): initialising with the
    default threefry keys costs seconds of XLA:CPU compilation per parameter shape on
    jax 0.10 (9 s against 2 s for five conv kernels, measured), which dominated building a
    model. The weights are random either way; memory and FLOPs depend only on shapes.

    Examples:
      >>> import jremat.models
      >>> key = jremat.models.init_key(0)  # pass it to jax.random.normal, split, ...
      >>> str(key.dtype), key.shape
      ('key<rbg>', ())
    """
    import jax  # here, not at the top: `jremat --help` lists the models without jax

    return jax.random.key(seed, impl="rbg")


def init_hf(model: Any) -> Any:
    """Random parameters of a transformers Flax model built with `_do_init=False`, initialised
    in one jitted call from `init_key()` (transformers would initialise eagerly, op by op)."""
    import jax

    return jax.jit(model.init_weights, static_argnums=1)(init_key(0), model.input_shape)


def require(package: str, model: str) -> Any:
    """Import `package` for workload `model`, or raise ImportError naming the extra to install.

    Examples:
      >>> import jremat.models
      >>> jremat.models.require("math", "mlp").__name__
      'math'
      >>> jremat.models.require("no_such_package", "gpt2")
      Traceback (most recent call last):
      ...
      ImportError: the gpt2 workload needs the 'no_such_package' package: pip install "jremat[zoo]"
    """
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(
            f'the {model} workload needs the {package!r} package: pip install "jremat[zoo]"'
        ) from e

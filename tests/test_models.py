"""The model zoo behind `jremat compare --model`: every workload at its tiny size.

Each must build from a config with random weights, return a finite scalar loss, differentiate
with respect to its parameters, and expose its layers through the name stack (so per-layer
policies have layers to apply to). Models needing the `zoo` extra are skipped without it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jremat
from jremat import models
from jremat._src.trace.layers import layer_spans

NEEDS = {
    "gpt2": "transformers",
    "vit": "transformers",
    "llama": "transformers",
    "bert": "transformers",
    "resnet": "jax_resnet",
}


def _skip_without(name: str) -> None:
    pkg = NEEDS.get(name)
    if pkg and importlib.util.find_spec(pkg) is None:
        pytest.skip(f"{name} needs {pkg} (the zoo extra)")


@pytest.mark.parametrize("name", models.NAMES)
def test_tiny_workload(name):
    _skip_without(name)
    w = models.get(name, size="tiny")
    assert w.name == name and w.description
    loss = float(jax.jit(w.loss)(w.params, w.batch))
    assert np.isfinite(loss)
    grads = jax.eval_shape(jax.grad(w.loss), w.params, w.batch)
    shapes = lambda t: jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert shapes(grads) == shapes(w.params)
    graph = jremat.trace(w.loss, w.params, w.batch)
    assert len(layer_spans(graph)) >= 2, "layers not found from the name stack"


def test_sizes_and_overrides():
    assert set(models.NAMES) >= {"gpt2", "vit", "resnet", "unet", "mlp"}
    assert models.NAMES[0] == "gpt2"
    for name in models.NAMES:
        assert set(models.sizes(name)) == set(models.SIZES) and models.describe(name)
    w = models.get("mlp", size="tiny", depth=3)
    assert len(w.params) == 3


def test_unet_is_the_paper_architecture():
    from jremat.models.unet import UNet

    w = models.get("unet", size="tiny", depth=2, channels=4)
    p = w.params
    assert set(p) == {"enc_0", "enc_1", "enc_2", "dec_0", "dec_1", "head"}
    # two 3x3 convs per block, channels doubling down the contracting path
    assert [p[f"enc_{i}"]["Conv_1"]["kernel"].shape[-1] for i in range(3)] == [4, 8, 16]
    # 2x2 stride-2 up-convolution halving the channels, then a block on the concatenation
    assert p["dec_0"]["ConvTranspose_0"]["kernel"].shape == (2, 2, 16, 8)
    assert p["dec_0"]["DoubleConv_0"]["Conv_0"]["kernel"].shape == (3, 3, 16, 8)
    assert p["head"]["kernel"].shape == (1, 1, 4, 3)
    out = UNet(depth=2, channels=4).apply({"params": p}, jnp.zeros((1, 16, 16, 3)))
    assert out.shape == (1, 16, 16, 3)
    with pytest.raises(ValueError, match="divisible by 2\\*\\*depth"):
        models.get("unet", image_size=30)


def test_errors():
    with pytest.raises(ValueError, match="unknown model 'nope'; available: gpt2"):
        models.get("nope")
    with pytest.raises(ValueError, match="unknown size 'huge'.*default, tiny"):
        models.get("mlp", size="huge")
    with pytest.raises(TypeError):
        models.get("mlp", size="tiny", widthh=3)


@pytest.mark.parametrize("name, module", [("resnet", "jax_resnet"), ("gpt2", "transformers")])
def test_missing_package_names_the_extra(monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'pip install "jremat\[zoo\]"'):
        models.get(name, size="tiny")


def test_core_import_needs_no_zoo_package():
    code = (
        "import sys, jremat, jremat.models, jremat._src.reports.comparison, jremat.cli\n"
        "bad = [m for m in ('transformers', 'jax_resnet', 'matplotlib', 'diffusers') "
        "if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard

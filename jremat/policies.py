"""Plain `jax.checkpoint` policies, usable without the planner.

A policy is a predicate `policy(prim, *input_avals, **params) -> bool` that says whether the
result of one primitive is saved for the backward pass; pass any of these to `jax.checkpoint`,
`flax.linen.remat` or `flax.nnx.remat` unchanged. Built-ins that work are re-exported;
`save_anything_except_these_names` is not, because upstream it behaves as `everything_saveable`.

The named presets (a policy plus where to cut: per layer, sqrt(n) segments, none) live as JSON
data in the top-level `policies/` folder, shipped in the wheel; load one with `preset(name)`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

_cp = jax.checkpoint_policies

everything_saveable = _cp.everything_saveable
nothing_saveable = _cp.nothing_saveable
dots_saveable = _cp.dots_saveable
checkpoint_dots = _cp.checkpoint_dots
dots_with_no_batch_dims_saveable = _cp.dots_with_no_batch_dims_saveable
save_only_these_names = _cp.save_only_these_names
save_any_names_but_these = _cp.save_any_names_but_these
save_from_both_policies = _cp.save_from_both_policies

Policy = Callable[..., bool]

_DOTS = ("dot_general", "conv_general_dilated")


def _out_bytes_and_flops(prim: Any, avals: tuple, params: dict) -> tuple[int, float] | None:
    """(output bytes, FLOPs) of a dot_general/conv from its input avals; None for others."""
    name = getattr(prim, "name", str(prim))
    if name == "dot_general":
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lhs, rhs = avals[0].shape, avals[1].shape
        batch = math.prod(lhs[d] for d in lb)
        contract = math.prod(lhs[d] for d in lc)
        lfree = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
        rfree = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
        dtype = params.get("preferred_element_type") or avals[0].dtype
        out = batch * lfree * rfree
        return out * np.dtype(dtype).itemsize, 2.0 * out * contract
    if name == "conv_general_dilated":
        out = jax.eval_shape(lambda a, b: prim.bind(a, b, **params), *avals[:2])
        rhs = avals[1].shape
        window = math.prod(rhs) // max(rhs[0], 1)  # in-features x kernel window
        size = math.prod(out.shape)
        return size * np.dtype(out.dtype).itemsize, 2.0 * size * window
    return None


def save_if_flops_per_byte_above(threshold: float = 16.0) -> Policy:
    """Save matmul/conv results whose FLOPs per byte stored exceed `threshold`.

    A dot contracting over K elements costs 2K FLOPs per output element, so with f32 outputs
    the rule saves dots with K > 2 x threshold. Elementwise results (about 1 FLOP per 4 bytes)
    are always recomputed. Raises ValueError for a negative or non-finite threshold.

    Examples:
      A 4 x 8 @ 8 x 8 matmul: K = 8, so 16 FLOPs per 4-byte output element (4 per byte):

      >>> import jax, jax.numpy as jnp
      >>> from jremat import policies
      >>> jaxpr = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> dot, tanh = jaxpr.eqns  # jax.checkpoint asks the policy about each equation
      >>> def saves(policy, eqn):
      ...     return policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
      >>> saves(policies.save_if_flops_per_byte_above(1.0), dot)
      True
      >>> saves(policies.save_if_flops_per_byte_above(16.0), dot)
      False
      >>> saves(policies.save_if_flops_per_byte_above(1.0), tanh)  # elementwise: recomputed
      False
    """
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a finite number >= 0 (FLOPs/byte), got {threshold!r}")

    def policy(prim, *avals, **params):
        cost = _out_bytes_and_flops(prim, avals, params)
        return cost is not None and cost[1] / max(cost[0], 1) > threshold

    return policy


def save_dots_in_size_range(min_bytes: int = 0, max_bytes: float = math.inf) -> Policy:
    """Save matmul/conv results of `min_bytes <= size <= max_bytes` bytes; recompute the rest.

    Raises ValueError when the range is empty or negative.

    Examples:
      A 4 x 8 @ 8 x 8 matmul's float32 result is 128 bytes:

      >>> import jax, jax.numpy as jnp
      >>> from jremat import policies
      >>> jaxpr = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> dot, tanh = jaxpr.eqns  # jax.checkpoint asks the policy about each equation
      >>> def saves(policy, eqn):
      ...     return policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
      >>> saves(policies.save_dots_in_size_range(max_bytes=1024), dot)
      True
      >>> saves(policies.save_dots_in_size_range(min_bytes=256), dot)
      False
      >>> saves(policies.save_dots_in_size_range(), tanh)  # not a matmul
      False
    """
    if not (0 <= min_bytes <= max_bytes):
        raise ValueError(f"need 0 <= min_bytes <= max_bytes, got {min_bytes!r}, {max_bytes!r}")

    def policy(prim, *avals, **params):
        cost = _out_bytes_and_flops(prim, avals, params)
        return cost is not None and min_bytes <= cost[0] <= max_bytes

    return policy


TRANSCENDENTALS = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "erf",
        "erf_inv",
        "sin",
        "cos",
        "tan",
        "atan2",
        "pow",
        "rsqrt",
        "sqrt",
        "cbrt",
        "erfc",
        "lgamma",
        "digamma",
    }
)
"""Names of the transcendental elementwise primitives: several FLOPs per element to
recompute (and, on accelerators, slow special-function units), so worth saving before cheap
arithmetic (`dots_and_transcendentals_saveable` saves them)."""


def dots_and_transcendentals_saveable(prim: Any, *_: Any, **__: Any) -> bool:
    """Save matmul/conv results and transcendental elementwise results (exp, tanh, erf, log,
    rsqrt ...); recompute only cheap arithmetic (adds, multiplies, selects, reductions).

    Between `dots_saveable` and `everything_saveable`: it keeps softmax's `exp` and GELU's
    `tanh`/`erf` too, so the backward pass recomputes only additions and multiplications.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jremat import policies
      >>> jaxpr = jax.make_jaxpr(lambda x: jnp.tanh(x) * 2.0)(jnp.ones((4, 8)))
      >>> [(e.primitive.name, policies.dots_and_transcendentals_saveable(e.primitive))
      ...  for e in jaxpr.eqns]
      [('tanh', True), ('mul', False)]
    """
    name = getattr(prim, "name", str(prim))
    return name in _DOTS or name in TRANSCENDENTALS


_BUILTIN = {
    "everything_saveable": everything_saveable,
    "nothing_saveable": nothing_saveable,
    "dots_saveable": dots_saveable,
    "checkpoint_dots": checkpoint_dots,
    "dots_with_no_batch_dims_saveable": dots_with_no_batch_dims_saveable,
    "dots_and_transcendentals_saveable": dots_and_transcendentals_saveable,
}
_FACTORIES = {
    "save_only_these_names": lambda names=(): save_only_these_names(*names),
    "save_any_names_but_these": lambda names=(): save_any_names_but_these(*names),
    "save_if_flops_per_byte_above": save_if_flops_per_byte_above,
    "save_dots_in_size_range": save_dots_in_size_range,
}


def names() -> list[str]:
    """Policy names accepted by `get` (and by `Segment.policy`).

    Examples:
      >>> from jremat import policies
      >>> names = policies.names()
      >>> "dots_saveable" in names, "save_dots_in_size_range" in names
      (True, True)
    """
    return sorted(_BUILTIN) + sorted(_FACTORIES)


def get(name: str, **params: Any) -> Policy:
    """The policy called `name`, built with `params` for the parameterised ones.

    Raises:
      ValueError: unknown name (the message lists the accepted names), including
        `save_anything_except_these_names`, which is broken upstream.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jremat import policies
      >>> policies.get("dots_saveable") is jax.checkpoint_policies.dots_saveable
      True
      >>> small = policies.get("save_dots_in_size_range", max_bytes=1 << 20)  # parameterised
      >>> step = jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(x @ w)), policy=small)
      >>> jax.grad(step)(jnp.ones((8, 8)), jnp.ones((4, 8))).shape
      (8, 8)
    """
    if name in _BUILTIN and not params:
        return _BUILTIN[name]
    if name in _FACTORIES:
        return _FACTORIES[name](**params)
    hint = ""
    if name == "save_anything_except_these_names":
        hint = (
            " (jax's save_anything_except_these_names behaves as everything_saveable; use "
            "save_any_names_but_these)"
        )
    raise ValueError(f"unknown policy {name!r}{hint}; accepted: {', '.join(names())}")


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named remat recipe from the catalogue in `policies/`.

    Attributes:
      name, description: as in the JSON file.
      policy_name, params: the policy (`get(policy_name, **params)`).
      segmentation: where checkpoint regions go: "layers" (one per layer, as `nn.remat` on each
        block), "sqrt_n" (about sqrt(L) groups of layers, Chen et al. 2016) or "none".

    Examples:
      `preset` loads one; its `policy` goes to `jax.checkpoint`:

      >>> import jax, jax.numpy as jnp
      >>> from jremat import policies
      >>> p = policies.preset("save_small_dots")
      >>> p.policy_name, p.params, p.segmentation
      ('save_dots_in_size_range', {'min_bytes': 0, 'max_bytes': 4194304}, 'layers')
      >>> step = jax.checkpoint(lambda w, x: jnp.sum(jnp.tanh(x @ w)), policy=p.policy)
      >>> jax.grad(step)(jnp.ones((8, 8)), jnp.ones((4, 8))).shape
      (8, 8)
    """

    name: str
    description: str
    policy_name: str
    segmentation: str
    params: dict

    @property
    def policy(self) -> Policy:
        """The `jax.checkpoint` policy of this preset."""
        return get(self.policy_name, **self.params)


def _catalogue_files() -> dict[str, Any]:
    found: dict[str, Any] = {}
    try:
        root = importlib.resources.files("jremat.presets")
        for entry in root.iterdir():
            if entry.name.endswith(".json"):
                found[entry.name[:-5]] = entry
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    source = Path(__file__).resolve().parent.parent / "policies"
    if not found and source.is_dir():
        found = {p.stem: p for p in source.glob("*.json")}
    return found


def preset_names() -> list[str]:
    """Names of the presets in the shipped catalogue.

    Examples:
      >>> from jremat import policies
      >>> names = policies.preset_names()
      >>> "sqrt_n" in names, names == sorted(names)
      (True, True)
    """
    return sorted(_catalogue_files())


def preset(name: str) -> Preset:
    """Load the preset `name` from the catalogue (the `policies/` folder).

    Raises ValueError for an unknown name, listing the available ones.

    Examples:
      >>> from jremat import policies
      >>> p = policies.preset("sqrt_n")
      >>> p.name, p.policy_name, p.segmentation
      ('sqrt_n', 'nothing_saveable', 'sqrt_n')
    """
    files = _catalogue_files()
    if name not in files:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(files))}")
    d = json.loads(files[name].read_text(encoding="utf-8"))
    return Preset(d["name"], d["description"], d["policy"], d["segmentation"], d.get("params", {}))

"""Host offload: a residual goes to pinned host memory between the forward and backward pass.

`OffloadCost` (a transfer priced in FLOP-equivalents), the offload policy
(`jax.checkpoint_policies.save_and_offload_only_these_names`), `host_offload_effective` (does
this backend free device memory?) and `offload_proxy` (the plan that stands in for an offload
plan's device memory where it does not). Measurements on CPU and how an offload plan is
verified: docs/design.md#host-offload.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Any

import jax

from jremat._src.base.args import as_real
from jremat._src.plan.plan import Plan

#: `offload_dst` of jremat's offload policies.
HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True)
class OffloadCost:
    """What offloading costs, in FLOP-equivalents: a byte offloaded costs
    `2 x device_flops / host_bandwidth` FLOPs (copied to host in the forward pass, back in the
    backward pass; the transfer is charged in full, not overlapped with compute).

    Attributes:
      host_bandwidth: device <-> pinned host copy bandwidth, bytes/second, each way. The
        default, 25e9, is a PCIe 4.0 x16 link in practice. To model transfers that overlap
        with compute, raise it (a transfer hidden by half costs as one at twice the speed).
      device_flops: the device's sustained compute rate, FLOP/second, that converts transfer
        seconds into recompute FLOPs (default 1e14).

    Both take any real number: a Python int or float, a NumPy scalar (`np.float32(1e10)`) or
    a 0-d NumPy/JAX array of any integer or floating dtype (bfloat16 included), stored as a
    Python float (Python ints and floats as given).

    Raises:
      ValueError: a figure that is not a finite real number > 0 (a string, a bool, a complex
        number, an array with more than one element, NaN, infinity, zero or less).

    Examples:
      >>> import jremat
      >>> cost = jremat.OffloadCost(host_bandwidth=20e9, device_flops=1e14)
      >>> cost.flops_per_byte  # 2 x 1e14 / 20e9
      10000.0
      >>> cost.transfer_seconds(1e9), cost.transfer_flops(1e9)  # 1 GB to host and back
      (0.1, 10000000000000.0)
    """

    host_bandwidth: float = 25e9
    device_flops: float = 1e14

    def __post_init__(self) -> None:
        for name in ("host_bandwidth", "device_flops"):
            value = getattr(self, name)
            number = as_real(value)
            if number is None or not math.isfinite(number) or number <= 0:
                raise ValueError(
                    f"OffloadCost.{name} must be a finite number > 0 "
                    f"({'bytes/second' if name == 'host_bandwidth' else 'FLOP/second'}; a "
                    f"Python or NumPy int or float), got {type(value).__name__} {value!r}"
                )
            if type(value) not in (int, float):  # keep repr, JSON and plan-cache keys plain
                object.__setattr__(self, name, number)

    @property
    def flops_per_byte(self) -> float:
        """FLOP-equivalents one offloaded byte costs (both transfers)."""
        return 2.0 * self.device_flops / self.host_bandwidth

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` bytes to host and back."""
        return 2.0 * nbytes / self.host_bandwidth

    def transfer_flops(self, nbytes: float) -> float:
        """`transfer_seconds(nbytes)` as FLOP-equivalents of the device."""
        return nbytes * self.flops_per_byte


def parse_offload(offload: Any) -> OffloadCost | None:
    """The `offload=` keyword of `jremat.plan` as an `OffloadCost`, or None (disabled).

    Accepted: None or False (no offload: the default), True (offload with the default
    `OffloadCost()`), or an `OffloadCost`. Raises TypeError for anything else.
    """
    if offload is None or offload is False:
        return None
    if offload is True:
        return OffloadCost()
    if isinstance(offload, OffloadCost):
        return offload
    raise TypeError(
        f"offload must be None/False (no host offload), True (default OffloadCost()) or a "
        f"jremat.OffloadCost(host_bandwidth=bytes/s, device_flops=FLOP/s); got {offload!r}"
    )


def offload_policy(saved: list[str], offloaded: list[str]):
    """The `jax.checkpoint` policy that saves `saved` names on the device and offloads
    `offloaded` names to pinned host memory; everything else is recomputed."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved),
        names_which_can_be_offloaded=list(offloaded),
        offload_src="device",
        offload_dst=HOST_MEMORY,
    )


@functools.cache
def _effective(backend: str) -> bool:
    from jax.ad_checkpoint import checkpoint_name

    def f(x):
        return jax.numpy.sin(checkpoint_name(jax.numpy.sin(x), "jremat_probe"))

    g = jax.checkpoint(f, policy=offload_policy([], ["jremat_probe"]))
    x = jax.ShapeDtypeStruct((8,), jax.numpy.float32)
    del backend  # the cache key: lowering uses JAX's default backend
    text = jax.jit(jax.grad(lambda x: g(x).sum())).lower(x).as_text()
    return HOST_MEMORY in text or "annotate_device_placement" in text


def host_offload_effective() -> bool:
    """Whether offloading to pinned host memory frees device memory on JAX's default backend:
    True when the lowered program places the offloaded value in host memory (GPU, TPU), False
    where the offload compiles to a no-op (CPU). Cached per backend."""
    return _effective(jax.default_backend())


def offloads(p: Plan | None) -> bool:
    return p is not None and any(s.offloaded for s in p.segments)


def offload_proxy(p: Plan) -> Plan:
    """`p` with every offloaded value recomputed instead (no longer named): on a backend
    with pinned host memory, the device holds offloaded values as it holds recomputed ones,
    so this plan's compiled temp bytes estimate `p`'s device memory where the offload
    itself compiles to a no-op (CPU; see docs/design.md#host-offload)."""
    q = copy.deepcopy(p)
    for s in q.segments:
        s.offloaded = []
    q.offloaded_bytes = 0
    return q

"""Budgets: what the caller asks for, and its translation into XLA temp bytes.

Accepted forms:
  * a float in (0, 1]: a fraction of the unrematerialized program's compiled temp bytes;
  * an int > 0: a cap on the compiled footprint (argument + output - alias + temp) in bytes;
  * a string with a unit, e.g. "512MiB", "8GB", "1.5 GiB" (B, KB/MB/GB/TB powers of 1000,
    KiB/MiB/GiB/TiB powers of 1024): a footprint cap;
  * "auto": the device's free memory (GPU/TPU `memory_stats()`; on CPU, where that is None, the
    host's available memory from psutil) as a footprint cap;
  * "device", or a fraction of it as "0.9 device": that fraction of the memory of the device
    the program is compiled for (`base.targets.device_memory_bytes`: a compile-only TPU's from
    a table) as a footprint cap, resolved when the program's devices are known (`for_device`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, TypeAlias

import numpy as np

from jremat._src.base.errors import InfeasibleBudgetError

ACCEPTED = (
    "a float in (0, 1] (fraction of the unrematerialized temp bytes), an int > 0 (footprint "
    'bytes), a string such as "512MiB" or "8GB", "auto" (free device memory), or "device" / '
    '"0.9 device" (that fraction of the target device\'s memory)'
)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of `fraction` (of temp), `footprint_bytes` or
    `device_fraction` (of the target device's memory, until `for_device` turns it into
    `footprint_bytes`) is set."""

    raw: Any
    fraction: float | None = None
    footprint_bytes: int | None = None
    device_fraction: float | None = None

    def for_device(self, device: Any) -> Budget:
        """This budget for a program compiled for `device`: a "device" budget as footprint
        bytes of that device's memory (`base.targets.device_memory_bytes`); any other budget
        as it is.

        Raises:
          ValueError: a "device" budget on a device whose memory is not known.
        """
        if self.device_fraction is None:
            return self
        from jremat._src.base.targets import device_memory_bytes

        limit = int(self.device_fraction * device_memory_bytes(device))
        return dataclasses.replace(self, footprint_bytes=limit, device_fraction=None)

    @property
    def is_auto(self) -> bool:
        """Whether this is `"auto"`: the free memory at parse time, so parse the raw budget
        again (`parse_budget(b.raw)`) where the memory free *now* matters."""
        return isinstance(self.raw, str) and self.raw.strip().lower() == "auto"

    def temp_bytes(self, baseline_temp: int, fixed_bytes: int) -> float:
        """The budget as XLA temp bytes, given the unrematerialized temp and the fixed bytes
        (argument + output - alias) of the step."""
        if self.fraction is not None:
            return self.fraction * baseline_temp
        if self.footprint_bytes is None:  # a bug of jremat's, not the caller's
            raise RuntimeError(f"budget={self.raw!r} was not resolved for a device (for_device)")
        return float(self.footprint_bytes - fixed_bytes)

    def in_caller_unit(self, temp_bytes: int, baseline_temp: int, fixed_bytes: int) -> Any:
        """Express compiled `temp_bytes` in the unit the caller used (fraction or bytes)."""
        if self.fraction is not None:
            return math.ceil(temp_bytes / baseline_temp * 1e4) / 1e4 if baseline_temp else 1.0
        return int(temp_bytes + fixed_bytes)

    def nothing_to_rematerialize(self, reason: str) -> InfeasibleBudgetError | None:
        """The error for a program with nothing to rematerialize (`reason` says why, e.g. it
        traces to no equations) when this budget asks for less than the unrematerialized
        program (a fraction below 1); None when the program as written meets it. Only a
        fraction can ask that without a compile: a byte budget is checked against the
        compiled footprint as usual."""
        if self.fraction is None or self.fraction >= 1:
            return None
        return InfeasibleBudgetError(
            f"budget={self.raw!r} asks for less than the unrematerialized program, but {reason}"
            ": nothing can be rematerialized, so no budget below it can be met. Pass "
            "budget=1.0 to run the function unchanged.",
            budget=self.raw,
            smallest_reachable=1.0,
            smallest_reachable_bytes=0,
        )

    def describe(self, value: Any) -> str:
        if self.fraction is not None:
            return f"{value:.4g} (a fraction of the unrematerialized temp bytes)"
        return f"{value:,} bytes ({value / 2**20:.2f} MiB) of footprint"


BudgetLike: TypeAlias = float | int | str | Budget
"""What the `budget` argument of `jremat.auto`, `jremat.plan`, `jremat.plan_training`,
`jremat.compare` and `jremat.explain` accepts ([`parse_budget`][jremat.parse_budget] reads it):

* a `float` in (0, 1]: a fraction of the unrematerialized program's compiled temp bytes
  (`0.5`);
* an `int` > 0: a cap on the compiled footprint (argument + output - alias + temp), in bytes;
* a `str` with a unit: a footprint cap, `"512MiB"`, `"8GB"`, `"1.5 GiB"` (KB/MB/GB/TB powers
  of 1000; KiB/MiB/GiB/TiB, and K/M/G/T as in XLA's flags, powers of 1024);
* `"auto"`: the device's free memory (the host's available memory on CPU), as a footprint cap;
* `"device"` or `"0.9 device"`: that fraction of the memory of the device the program
  compiles for, as a footprint cap;
* a `Budget` that `jremat.parse_budget` returned, used as it is.

NumPy and JAX scalars (0-d arrays) of an integer or floating dtype count as `int` and `float`.
Anything else raises a `ValueError` naming the accepted forms.
"""


def _bad(budget: Any, why: str) -> ValueError:
    return ValueError(f"budget={budget!r} is invalid: {why}. Accepted: {ACCEPTED}.")


def parse_budget(budget: BudgetLike) -> Budget:
    """Parse a budget in any accepted form, as every planning call does.

    A `Budget` (already parsed) is returned as it is, so callers parse once and pass the result
    down (`jremat.auto` -> `PlanCache` -> `jremat.plan`).

    Args:
      budget: a float in (0, 1]: a fraction of the unrematerialized program's compiled temp
        bytes; an int > 0: a cap on the compiled footprint (argument + output - alias + temp)
        in bytes; a string with a unit, e.g. "512MiB", "8GB", "1.5 GiB" (KB/MB/GB/TB powers
        of 1000; KiB/MiB/GiB/TiB, and K/M/G/T alone as in XLA's flags, powers of 1024; B or
        no unit: bytes; any case): a footprint cap; "auto": the device's free memory
        (on CPU the host's available memory) as a footprint cap; "device" or "0.9 device":
        that fraction of the memory of the device the program compiles for (its
        `memory_stats()`, a compile-only TPU's from `jremat.DEVICE_MEMORY_BYTES`) as a
        footprint cap, read when the program is planned.

    Returns:
      A `Budget` with exactly one of `fraction` (float), `footprint_bytes` (int) or
      `device_fraction` (float) set, and `raw`, the budget as given.

    Raises:
      ValueError: budget <= 0, a float > 1, NaN/inf, a bool, a complex number, an array that
        is not 0-d, a non-numeric value, or an unparsable string; the message names the
        accepted forms.

    Examples:
      >>> import jremat
      >>> jremat.parse_budget(0.5).fraction
      0.5
      >>> [jremat.parse_budget(b).footprint_bytes for b in ("512MiB", "1.5 GB", 4096)]
      [536870912, 1500000000, 4096]
      >>> jremat.parse_budget("0.9 device").device_fraction
      0.9
    """
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, (bool, np.bool_)) or budget is None:
        raise _bad(budget, "expected a number or a string")
    if getattr(budget, "shape", ()) != ():
        raise _bad(budget, f"expected a single number, got an array of shape {budget.shape}")
    if _is_complex(budget):
        raise _bad(budget, "a complex number is not a size")
    if isinstance(budget, str):
        if budget.strip().lower() == "auto":
            return Budget(budget, footprint_bytes=free_device_bytes())
        if (share := _device_share(budget)) is not None:
            return Budget(budget, device_fraction=share)
        m = _PATTERN.match(budget)
        if not m or m.group(2).lower() not in _UNITS:
            raise _bad(budget, "could not read a size with a unit from the string")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if not math.isfinite(size):
            raise _bad(budget, "the size is too large to be a number of bytes")
        value = int(size)
        if value < 1:
            raise _bad(
                budget, "a size must be at least 1 byte (a fraction is a float, not a string)"
            )
        return Budget(budget, footprint_bytes=value)
    if isinstance(budget, int) or (hasattr(budget, "dtype") and "int" in str(budget.dtype)):
        if int(budget) <= 0:
            raise _bad(budget, "it must be positive")
        return Budget(int(budget), footprint_bytes=int(budget))
    if isinstance(budget, float) or hasattr(budget, "__float__"):
        try:
            f = float(budget)
        except (TypeError, ValueError):
            raise _bad(budget, "expected a number or a string") from None
        if not math.isfinite(f) or f <= 0:
            raise _bad(budget, "a fraction must be finite and > 0")
        if f > 1:
            raise _bad(budget, "a float is a fraction and must be <= 1 (for bytes pass an int)")
        return Budget(f, fraction=f)
    raise _bad(budget, f"expected a number or a string, got {type(budget).__name__}")


def _device_share(budget: str) -> float | None:
    """The fraction of a "device" budget string ("device" 1.0, "0.9 device" 0.9), None for
    a string of another form.

    Raises:
      ValueError: a "device" budget whose fraction is not in (0, 1].
    """
    text = budget.strip().lower()
    if not text.endswith("device"):
        return None
    number = text[: -len("device")].strip().rstrip("*").strip()
    try:
        share = float(number) if number else 1.0
    except ValueError:
        raise _bad(
            budget, 'a device budget is "device" or a fraction before it: "0.9 device"'
        ) from None
    if not (math.isfinite(share) and 0 < share <= 1):
        raise _bad(budget, "the fraction of the device's memory must be in (0, 1]")
    return share


def _is_complex(value: Any) -> bool:
    """Whether `value` is a Python complex or has a complex NumPy/JAX dtype."""
    if isinstance(value, complex):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return False
    try:
        return bool(np.issubdtype(dtype, np.complexfloating))
    except TypeError:  # a `dtype` attribute that is not a dtype
        return False


def free_device_bytes() -> int:
    """Free memory of the default device in bytes.

    On GPU/TPU: `bytes_limit - bytes_in_use` from `jax.devices()[0].memory_stats()`. On CPU,
    where `memory_stats()` is None, the host's available memory (`psutil.virtual_memory()`).
    """
    import jax

    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    import psutil

    return int(psutil.virtual_memory().available)

"""Compile `jit(value_and_grad(fn))` and read XLA's memory and FLOP figures (`jremat.measure`).

Which figures and why: docs/design.md#measuring.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jremat._src.base import sharding
from jremat._src.base.args import (
    check_differentiable,
    check_flag,
    check_scalar_output,
    normalize_argnums,
)
from jremat._src.compile.xla import MemoryFigures, compile_step, mesh_size, step_flops


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What XLA compiled for one training step `jit(value_and_grad(fn, argnums, has_aux))`.

    Attributes:
      temp_bytes: the peak bytes of live temporaries (activations, residuals, gradients in
        flight), read as `jremat.MEMORY_FIGURES` says for the platform compiled for: XLA's
        `temp_size_in_bytes` on CPU and GPU, `peak_memory_in_bytes` less arguments and
        outputs on TPU.
      footprint_bytes: argument + output - alias + temp bytes: the device memory of the step.
      flops: `cost_analysis()["flops"]` plus its `"transcendentals"` (`exp`, `tanh` ... count
        1 per element, as in jremat's FLOP table), with every scan body multiplied by its trip
        count.
      compile_seconds: wall seconds to lower and compile.
      step_seconds: median wall seconds of one executed step over `runs`, or None.
      argument_bytes, output_bytes, alias_bytes: the other terms of the footprint.
      num_devices: devices the step is partitioned over; every byte figure is per device.

    Examples:
      `jremat.measure` returns one (shapes are enough where the step is not run):

      >>> import jax, jax.numpy as jnp, jremat
      >>> w, x = (jax.ShapeDtypeStruct(s, jnp.float32) for s in [(8, 8), (4, 8)])
      >>> m = jremat.measure(lambda w, x: jnp.sum(jnp.tanh(x @ w)), w, x)
      >>> m.argument_bytes  # w and x, float32
      384
      >>> m.step_seconds is None, m.num_devices  # runs=0: compiled, not run
      (True, 1)
    """

    temp_bytes: int
    footprint_bytes: int
    flops: float
    compile_seconds: float
    step_seconds: float | None = None
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    num_devices: int = 1


def measure(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    runs: int = 0,
    in_shardings: Any = None,
    mesh: Any = None,
    has_aux: bool = False,
) -> Measurement:
    """Compile one training step of `fn` and report XLA's memory and FLOPs.

    Arguments sharded over a mesh (sharded `jax.Array`s, `jax.ShapeDtypeStruct`s with a
    `sharding`, or `in_shardings=`) compile the partitioned step, and the byte figures are
    per device (XLA's `memory_analysis()` of the SPMD program).

    Args:
      fn: returns a scalar floating-point loss (with `has_aux`, a pair `(loss, aux)`);
        positional array/pytree arguments.
      *args: arguments (arrays, or `jax.ShapeDtypeStruct` when `runs == 0`).
      argnums: arguments to differentiate (int or tuple of ints), as in `jax.grad`.
      runs: when > 0, execute the compiled step `runs` times (after one warm-up) and report
        the median wall seconds in `step_seconds`.
      in_shardings: the arguments' shardings, as in `jax.jit` and `jremat.plan`; default: what
        the arguments carry.
      mesh: the mesh `PartitionSpec`s in `in_shardings` refer to (default: `jax.set_mesh`'s),
        as in `jremat.plan`: a `jax.sharding.Mesh` (or `AbstractMesh`) or None. It shards
        nothing by itself; given while no `PartitionSpec` refers to it and no argument is
        sharded, the step is measured unsharded and a `RuntimeWarning` says so.
      has_aux: `fn` returns `(loss, aux)`, aux any pytree of arrays: the step measured is
        `jit(value_and_grad(fn, has_aux=True))`, which computes both (as `jremat.plan`).

    Returns:
      A `Measurement`. Figures other than seconds are deterministic for a given program.

    Raises:
      TypeError: `fn` does not return a scalar float (with `has_aux`, a pair whose first
        element is one), or an argument at `argnums` has no floating-point leaves; `mesh`
        or `in_shardings` of a type not accepted; `has_aux` not a bool.
      ValueError: `argnums` out of range or `runs` negative; `in_shardings` not matching the
        arguments, naming an axis its mesh lacks, or naming a mesh larger than the devices
        ([design.md#sharding](../design.md#sharding)).

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> m = jremat.measure(loss, ws, x)
      >>> m.argument_bytes  # float32: 4 weights of 64 x 64 and x of 128 x 64
      98304
      >>> m.footprint_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes + m.temp_bytes
      True
    """
    nums = normalize_argnums(argnums, len(args))
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 0:
        raise ValueError(f"runs must be a non-negative int, got {runs!r}")
    check_flag("has_aux", has_aux)
    check_differentiable(args, nums)
    avals = sharding.shard_args(args, in_shardings, mesh)
    check_scalar_output(fn, avals, has_aux)
    t0 = time.perf_counter()
    compiled = compile_step(fn, avals, nums, has_aux)
    compile_seconds = time.perf_counter() - t0
    mem = MemoryFigures.of(compiled)
    flops = step_flops(compiled, fn, avals, nums, has_aux=has_aux)
    step = None
    if runs:
        if in_shardings is not None:  # place the arrays as the step was compiled for
            args = jax.tree_util.tree_map(
                lambda x, a: (
                    x if getattr(a, "sharding", None) is None else jax.device_put(x, a.sharding)
                ),
                tuple(args),
                avals,
            )
        jax.block_until_ready(compiled(*args))  # warm-up
        step = median_step_seconds(compiled, args, runs)
    return Measurement(
        temp_bytes=mem.temp_bytes,
        footprint_bytes=mem.footprint_bytes,
        flops=flops,
        compile_seconds=compile_seconds,
        step_seconds=step,
        argument_bytes=mem.argument_bytes,
        output_bytes=mem.output_bytes,
        alias_bytes=mem.alias_bytes,
        num_devices=mesh_size(avals),
    )


def median_step_seconds(executable: Any, args: Sequence[Any], runs: int) -> float:
    """Median wall seconds of `runs` executions of a compiled step (results awaited)."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(executable(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)

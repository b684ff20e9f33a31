"""Compile `jit(value_and_grad(fn))` and read XLA's memory and FLOP figures."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _compat, sharding
from .trace import normalize_argnums


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What XLA compiled for one training step `jit(value_and_grad(fn, argnums))`.

    Attributes:
      temp_bytes: XLA's packed peak of live temporaries (activations, residuals, gradients in
        flight), in bytes: `memory_analysis().temp_size_in_bytes`.
      footprint_bytes: argument + output - alias + temp bytes: the device memory of the step.
      flops: `cost_analysis()["flops"]`, with every scan body multiplied by its trip count.
      compile_seconds: wall seconds to lower and compile.
      step_seconds: median wall seconds of one executed step over `runs`, or None.
      argument_bytes, output_bytes, alias_bytes: the other terms of the footprint.
      num_devices: devices the step is partitioned over; every byte figure is per device.
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


def _check_scalar_output(fn: Callable[..., Any], args: Sequence[Any]) -> None:
    out = jax.eval_shape(fn, *args)
    leaves = jax.tree_util.tree_leaves(out)
    ok = len(leaves) == 1 and leaves[0].shape == () and _compat.is_float_dtype(leaves[0].dtype)
    if not ok:
        shapes = [f"{x.dtype}{list(x.shape)}" for x in leaves]
        raise TypeError(
            "jremat needs fn to return a scalar floating-point loss (it compiles "
            f"jax.value_and_grad(fn)); fn returned {shapes or 'no arrays'}. Reduce the output "
            "(for example with .mean()) or wrap fn in a loss."
        )


def compile_step(fn: Callable[..., Any], args: Sequence[Any], argnums: tuple[int, ...]) -> Any:
    """Lower and compile `jit(value_and_grad(fn, argnums))` for `args` (arrays or avals, whose
    shardings it compiles under: `memory_analysis()` is then per device)."""
    nums = argnums[0] if len(argnums) == 1 else argnums
    return jax.jit(jax.value_and_grad(fn, argnums=nums)).lower(*args).compile()


def compile_figures(
    fn: Callable[..., Any],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    *,
    manual_axes: dict[str, int] | None = None,
    scan_flops: bool = True,
) -> tuple[Any, float]:
    """`compile_step` and its FLOPs (scan bodies counted once per trip, when `scan_flops`).

    With `manual_axes` ({name: size}, `jremat.sharding.manual_axes()` inside a `shard_map`
    body) the per-device program is compiled in a helper thread, outside the body's trace,
    under a `shard_map` over a mesh of the same axes (`jremat.sharding.bind_axes`); its
    memory figures are those of one device.
    """

    def run(f: Callable[..., Any], a: Sequence[Any], spmd: bool) -> tuple[Any, float]:
        exe = compile_step(f, a, argnums)
        flops = xla_flops(exe)
        if scan_flops:
            extra = scan_flops_correction(f, a, argnums)
            # under sharded jit the bodies are costed on global shapes: a device's share is
            # 1/devices of them (data and tensor parallelism split a body's work evenly);
            # a shard_map body's scans already have per-device shapes
            flops += extra / _num_devices(exe) if spmd else extra
        return exe, flops

    if not manual_axes:
        return run(fn, args, True)
    g, global_args = sharding.bind_axes(fn, manual_axes, args)
    return sharding.outside_trace(lambda: run(g, global_args, False))


def measure(
    fn: Callable[..., Any],
    *args: Any,
    argnums: int | Sequence[int] = 0,
    runs: int = 0,
    in_shardings: Any = None,
    mesh: Any = None,
) -> Measurement:
    """Compile one training step of `fn` and report XLA's memory and FLOPs.

    Arguments sharded over a mesh (sharded `jax.Array`s, `jax.ShapeDtypeStruct`s with a
    `sharding`, or `in_shardings=`) compile the partitioned step, and the byte figures are
    per device (XLA's `memory_analysis()` of the SPMD program).

    Args:
      fn: returns a scalar floating-point loss; positional array/pytree arguments.
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

    Returns:
      A `Measurement`. Figures other than seconds are deterministic for a given program.

    Raises:
      TypeError: `fn` does not return a scalar float, or an argument at `argnums` has no
        floating-point leaves; `mesh` or `in_shardings` of a type not accepted.
      ValueError: `argnums` out of range or `runs` negative; `in_shardings` not matching the
        arguments, naming an axis its mesh lacks, or naming a mesh larger than the devices
        (see `jremat.sharding.shard_args`).
    """
    from .trace import _check_differentiable

    nums = normalize_argnums(argnums, len(args))
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 0:
        raise ValueError(f"runs must be a non-negative int, got {runs!r}")
    _check_differentiable(args, nums)
    avals = sharding.shard_args(args, in_shardings, mesh)
    _check_scalar_output(fn, avals)
    t0 = time.perf_counter()
    compiled = compile_step(fn, avals, nums)
    compile_seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes)
    arg, out, alias = (
        int(mem.argument_size_in_bytes),
        int(mem.output_size_in_bytes),
        int(mem.alias_size_in_bytes),
    )
    flops = xla_flops(compiled) + scan_flops_correction(fn, avals, nums) / _num_devices(compiled)
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
        temp_bytes=temp,
        footprint_bytes=arg + out - alias + temp,
        flops=flops,
        compile_seconds=compile_seconds,
        step_seconds=step,
        argument_bytes=arg,
        output_bytes=out,
        alias_bytes=alias,
        num_devices=mesh_size(avals),
    )


def mesh_size(avals: Sequence[Any]) -> int:
    """Devices of the mesh the arguments are sharded over (1 when none is)."""
    m = sharding.arg_mesh(jax.tree_util.tree_leaves(avals))
    return 1 if m is None else int(m.size)


def median_step_seconds(executable: Any, args: Sequence[Any], runs: int) -> float:
    """Median wall seconds of `runs` executions of a compiled step (results awaited)."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(executable(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def xla_flops(compiled: Any) -> float:
    """`cost_analysis()["flops"]` of a compiled executable (0 when the backend reports none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def scan_flops_correction(fn: Callable[..., Any], args: Sequence[Any], nums: tuple[int, ...]):
    """FLOPs XLA's count misses because it counts each scan body once, not once per trip.

    Each scan body in the differentiated program is compiled on its own and its FLOPs are
    added (length - 1) more times (nested scans recursively). `while` loops have no static
    trip count and stay counted once.
    """
    nums_arg = nums[0] if len(nums) == 1 else nums
    closed_jaxpr = jax.make_jaxpr(jax.value_and_grad(fn, argnums=nums_arg))(*args)
    cache: dict[int, float] = {}
    return _correction(_compat.closed(closed_jaxpr)[0], cache)


def _correction(jaxpr: Any, cache: dict[int, float]) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        for sub in _compat.subjaxprs(eqn):
            inner = _correction(sub, cache)
            if eqn.primitive.name == "scan":
                length = _compat.scan_length(eqn)
                total += (length - 1) * _body_flops(eqn.params["jaxpr"], cache) + length * inner
            else:
                total += inner
    return total


def _num_devices(executable: Any) -> int:
    """How many devices a compiled SPMD step runs on (1 when it cannot be read)."""
    try:
        leaves = jax.tree_util.tree_leaves(executable.input_shardings)
        return max(len(leaves[0].device_set), 1) if leaves else 1
    except Exception:  # noqa: BLE001 - an executable without shardings: one device
        return 1


def _body_flops(body: Any, cache: dict[int, float]) -> float:
    key = id(body)
    if key not in cache:
        try:
            cache[key] = _compiled_body_flops(body)
        except Exception:  # noqa: BLE001 - e.g. a body with collectives over a shard_map's axes
            # cannot compile on its own: count it with jremat's own FLOP table instead
            from . import cost_model

            cache[key] = cost_model.jaxpr_flops(_compat.closed(body)[0])
    return cache[key]


def _compiled_body_flops(body: Any) -> float:
    """XLA's FLOPs of one scan body compiled on its own."""
    import jax.extend.core as jc
    from jax.extend.core import jaxpr_as_fun

    jaxpr, consts = _compat.closed(body)
    closed_body = body if consts or hasattr(body, "consts") else jc.ClosedJaxpr(jaxpr, [])
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return xla_flops(jax.jit(jaxpr_as_fun(closed_body)).lower(*avals).compile())

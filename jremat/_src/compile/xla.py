"""Where jremat meets XLA: the one compile call (`compile_jitted`), the memory figures of a
compiled program (`MemoryFigures`), and the FLOPs of a compiled training step (loop bodies
counted once per trip: `loop_flops`). What the figures mean: docs/design.md#measuring."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental import checkify

from jremat._src.base import compat as _compat
from jremat._src.base import sharding
from jremat._src.base.batching import Batching
from jremat._src.base.errors import UnsupportedBackendError
from jremat._src.base.targets import args_device
from jremat._src.compile.loop_flops import loop_flops_correction
from jremat._src.trace import cost_model

#: XLA compiler options, by platform, for a program compiled only to read its figures
#: (`compile_jitted(..., figures_only=True)`): options that change no HLO pass, so that
#: `memory_analysis()` and `cost_analysis()` are those of the default compile, only the code
#: generated is slower. CPU: LLVM at -O0 (the HLO passes, buffer assignment and schedule run
#: before code generation): about 0.57 of the compile seconds, the same figures on every zoo model
#: (docs/design.md#figures-only-compiles). None on other platforms (not measured: GPU
#: autotuning, for one, changes a program's workspace bytes).
FIGURES_ONLY_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_backend_optimization_level": 0},
}


def compile_jitted(jitted: Any, args: Sequence[Any], *, figures_only: bool = False) -> Any:
    """`jitted.lower(*args).compile()`: the one call through which jremat reaches XLA's
    compiler (training steps, scan bodies, `jremat.measure`, `jremat.plan_training`). Call it
    as `xla.compile_jitted` (module attribute) so that one patch sees every compile.

    With `figures_only` (the executable is read for its memory and cost figures, never run)
    it compiles under the platform's `FIGURES_ONLY_OPTIONS`: the same figures, sooner."""
    lowered = jitted.lower(*args)
    options = _figures_only_options(args) if figures_only else None
    return lowered.compile(compiler_options=dict(options)) if options else lowered.compile()


def _figures_only_options(args: Sequence[Any]) -> dict[str, Any] | None:
    """`FIGURES_ONLY_OPTIONS` of the platform `args` compile for (None: it has none)."""
    return FIGURES_ONLY_OPTIONS.get(_platform(args))


def figures_only_is_default(args: Sequence[Any]) -> bool:
    """Whether `compile_jitted(..., figures_only=True)` for `args` compiles with the default
    options: `FIGURES_ONLY_OPTIONS` has none for their platform (GPU, TPU), so its executable
    is the one a default compile gives, fit to run (`Program.step` then runs a plan the
    search compiled, instead of compiling it again)."""
    return not _figures_only_options(args)


def _platform(args: Sequence[Any]) -> str:
    """The platform `args` compile for: that of their mesh's devices, else the default
    (`base.targets.args_device`)."""
    try:
        return _platform_name(args_device(args).platform)
    except ValueError:  # arguments over different meshes: compiling them raises that itself
        return jax.default_backend()


#: How each backend's `memory_analysis()` gives the peak bytes of a program's temporaries
#: (what jremat budgets, verifies and reports as "temp"; measured in
#: docs/guides/tpu.md#the-memory-figure):
#:   cpu, gpu: `temp_size_in_bytes`, the packed size of XLA's temporaries (`peak_memory_in_bytes`
#:     counts only arguments and outputs there);
#:   tpu: `peak_memory_in_bytes - (argument + output - alias)`: the TPU compiler's heap peak
#:     holds the program's arguments and outputs (`indefinite_allocations`, live for the whole
#:     run) and its temporaries, whose `temp_size_in_bytes` it reports as 0 (libtpu 0.0.50).
#: Any other platform raises `UnsupportedBackendError`: jremat does not plan on a figure it
#: has not read.
MEMORY_FIGURES: dict[str, str] = {
    "cpu": "temp_size_in_bytes",
    "gpu": "temp_size_in_bytes",
    "tpu": "peak_memory_in_bytes - (argument + output - alias)",
}
"""How each platform's `memory_analysis()` gives the peak bytes of a program's temporaries,
the figure jremat budgets, verifies and reports as "temp": platform name -> the reading.
On CPU and GPU XLA's `temp_size_in_bytes`; on TPU, whose compiler reports 0 there, its heap
peak less the bytes live all along. Programs compiled for any other platform raise
`jremat.UnsupportedBackendError`
([guides/tpu.md#the-memory-figure](../guides/tpu.md#the-memory-figure))."""


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """A compiled program's `memory_analysis()` in bytes (per device for an SPMD program).

    `temp_bytes` is the peak bytes of the program's temporaries, read as its platform's
    `MEMORY_FIGURES` entry says (`figure` names it): the figure every budget, plan and
    report of jremat is in. `fixed_bytes` (argument + output - alias) and `footprint_bytes`
    (fixed + temp: the device memory of one run, on TPU the compiler's peak) are computed here
    and nowhere else in jremat.
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    platform: str = "cpu"
    #: the platform and device kind compiled for, with the device count of an SPMD program:
    #: "cpu", "tpu:TPU v5 lite x4" (`executable_target`)
    target: str = "cpu"

    @property
    def figure(self) -> str:
        """How `temp_bytes` was read from `memory_analysis()` (`MEMORY_FIGURES`)."""
        return MEMORY_FIGURES[self.platform]

    @property
    def fixed_bytes(self) -> int:
        """argument + output - alias bytes: what the program holds besides its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def footprint_bytes(self) -> int:
        """fixed + temp bytes: the device memory of one run of the program."""
        return self.fixed_bytes + self.temp_bytes

    @classmethod
    def of(cls, executable: Any) -> MemoryFigures:
        """The figures of a compiled executable (`compile_jitted`'s result).

        Raises:
          UnsupportedBackendError: the executable's platform is not in `MEMORY_FIGURES`.
        """
        mem = executable.memory_analysis()
        platform = executable_platform(executable)
        if platform not in MEMORY_FIGURES:
            raise UnsupportedBackendError(
                f"jremat cannot read the memory figures of a program compiled for platform "
                f"{platform!r}: it reads {', '.join(sorted(MEMORY_FIGURES))} "
                "(docs/guides/tpu.md#the-memory-figure). Plan on one of those, or run the "
                "function without jremat."
            )
        argument = int(mem.argument_size_in_bytes)
        output = int(mem.output_size_in_bytes)
        alias = int(mem.alias_size_in_bytes)
        temp = int(mem.temp_size_in_bytes)
        if platform == "tpu":
            # the heap peak minus what is live all along; max: a libtpu that reports its
            # temporaries in temp_size_in_bytes too is never read lower than that
            temp = max(temp, int(mem.peak_memory_in_bytes) - (argument + output - alias))
        return cls(temp, argument, output, alias, platform, executable_target(executable))


def executable_platform(executable: Any) -> str:
    """The platform ("cpu", "gpu", "tpu", ...) a compiled executable runs on: that of the
    devices of its input or output shardings (a compile-only TPU's for a program compiled
    for a topology), else JAX's default backend."""
    devices = _executable_devices(executable)
    return _platform_name(devices[0].platform if devices else jax.default_backend())


def executable_target(executable: Any) -> str:
    """What a compiled executable was compiled for, as plans and reports name it: its
    platform, with the device kind where it is not CPU and the device count where it is
    over 1 ("cpu", "cpu x8", "gpu:NVIDIA H100 80GB HBM3", "tpu:TPU v5 lite x4")."""
    devices = _executable_devices(executable)
    if not devices:
        return _platform_name(jax.default_backend())
    name = _platform_name(devices[0].platform)
    if name != "cpu":
        name += f":{devices[0].device_kind}"
    return name + (f" x{len(devices)}" if len(devices) > 1 else "")


def _executable_devices(executable: Any) -> list[Any]:
    """The devices of a compiled executable's input (else output) shardings, by id."""
    for name in ("input_shardings", "output_shardings"):
        try:
            shardings = getattr(executable, name, None)
        # a jit traced inside the caller's jit that closes over its tracers: JAX passes them
        # as inputs of their own, which its `input_shardings` fails to unflatten (jax 0.10
        # and 0.12); its outputs are read instead
        except (ValueError, TypeError):
            continue
        for leaf in jax.tree_util.tree_leaves(shardings):
            devices = getattr(leaf, "device_set", None)
            if devices:
                return sorted(devices, key=lambda d: d.id)
    return []


def _platform_name(platform: str) -> str:
    """JAX's platform name, with CUDA and ROCm as "gpu" (`jax.default_backend()` spells them
    "gpu"; a device's `platform` may say "cuda" or "rocm")."""
    platform = str(platform).lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


def compile_step(
    fn: Callable[..., Any],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    has_aux: bool = False,
    value: bool = True,
    figures_only: bool = False,
    checks: bool = False,
    batching: Batching | None = None,
) -> Any:
    """Lower and compile `jit(value_and_grad(fn, argnums, has_aux))` (`jit(grad(...))` when
    not `value`) for `args` (arrays or avals, whose shardings it compiles under:
    `memory_analysis()` is then per device); `figures_only` as in `compile_jitted`. With
    `batching` (the caller's vmaps), the step under them at the batched arguments
    (`step_grad`); `args` stay the per-example ones.

    `checks`: `fn` holds `checkify.check`s (it runs inside the caller's `checkify.checkify`),
    which XLA cannot lower unfunctionalized: the step compiled is
    `checkify.checkify(step, errors=checkify.user_checks)`, as the caller's checkify runs it
    (its error values among the outputs)."""
    step = step_grad(fn, argnums, has_aux, value, batching)
    if checks:
        step = checkify.checkify(step, errors=checkify.user_checks)
    return compile_jitted(jax.jit(step), step_args(args, batching), figures_only=figures_only)


def step_grad(
    fn: Callable[..., Any],
    argnums: tuple[int, ...],
    has_aux: bool = False,
    value: bool = True,
    batching: Batching | None = None,
) -> Any:
    """`jax.value_and_grad(fn, argnums, has_aux=has_aux, allow_int=True)`: the training step
    jremat compiles (with `has_aux`, `fn` returns `(loss, aux)` and the step computes both);
    `jax.grad` when not `value` (the step of a caller that drops the loss). `allow_int`: an
    integer leaf among the differentiated arguments (a step counter in the
    parameters, as `jax.grad(..., allow_int=True)` and `jax.vjp` accept) gets a float0
    cotangent, as in the caller's backward pass, instead of failing the plan's compile. With
    `batching`, that step under the caller's vmaps (`Batching.step`), a function of
    `step_args(args, batching)`."""
    nums = argnums[0] if len(argnums) == 1 else argnums
    grad = jax.value_and_grad if value else jax.grad
    if batching is not None:
        return batching.step(
            fn, lambda f: grad(f, argnums=nums, has_aux=has_aux, allow_int=True), has_aux
        )
    return grad(fn, argnums=nums, has_aux=has_aux, allow_int=True)


def step_args(args: Sequence[Any], batching: Batching | None) -> tuple:
    """The arguments `step_grad(..., batching)` runs at: `args`, batched under `batching`."""
    return tuple(args) if batching is None else batching.global_args(args)


def step_flops(
    executable: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    *,
    scan_flops: bool = True,
    spmd: bool = True,
    has_aux: bool = False,
    batching: Batching | None = None,
) -> float:
    """FLOPs of `compile_step(fn, args, argnums, batching=batching)`'s `executable`: XLA's
    count plus, when `scan_flops`, every loop body once more per extra trip: read from the
    executable's optimized HLO (`loop_flops.loop_flops_correction`, per device), else, where
    a loop there has no known trip count, each scan body of the step's jaxpr compiled on its
    own (`scan_flops_correction`).

    On that second path, under sharded jit (`spmd`) the bodies are costed on global shapes: a
    device's share is 1/devices of them (data and tensor parallelism split a body's work
    evenly); a `shard_map` body's scans (`spmd=False`) already have per-device shapes.
    """
    flops = xla_flops(executable)
    if not flops:  # a backend that counts nothing: jremat's own table on the step's jaxpr
        jaxpr = jax.make_jaxpr(step_grad(fn, argnums, has_aux, batching=batching))(
            *step_args(args, batching)
        )
        return cost_model.jaxpr_flops(_compat.closed(jaxpr)[0]) / (
            _num_devices(executable) if spmd else 1
        )
    if scan_flops:

        def by_bodies() -> float:
            extra = scan_flops_correction(fn, args, argnums, has_aux, batching)
            return extra / _num_devices(executable) if spmd else extra

        flops = with_loop_trips(executable, flops, by_bodies)
    return flops


def with_loop_trips(executable: Any, flops: float, by_bodies: Callable[[], float]) -> float:
    """`flops` (XLA's count for `executable`, `xla_flops`) with every loop body counted once
    per trip: the missing trips read from the executable's optimized HLO (per device,
    `loop_flops.loop_flops_correction`), else, where they cannot be read there (a loop
    without a known trip count), `by_bodies()`: the scan bodies compiled on their own."""
    extra = loop_flops_correction(executable, flops)
    return flops + (by_bodies() if extra is None else extra)


def compile_figures(
    fn: Callable[..., Any],
    args: Sequence[Any],
    argnums: tuple[int, ...],
    *,
    manual_axes: dict[str, int] | None = None,
    scan_flops: bool = True,
    has_aux: bool = False,
    figures_only: bool = False,
    checks: bool = False,
    batching: Batching | None = None,
) -> tuple[Any, float]:
    """`compile_step` (`figures_only`, `checks` and `batching` as there: under the caller's
    vmaps with `batching`) and its FLOPs (scan bodies counted once per trip, when
    `scan_flops`).

    With `manual_axes` ({name: size}, `base.sharding.manual_axes()` inside a `shard_map`
    body) the per-device program is compiled in a helper thread, outside the body's trace,
    under a `shard_map` over a mesh of the same axes (`base.sharding.bind_axes`); its
    memory figures are those of one device. The caller's step around a body may be
    `grad` or `value_and_grad`, which XLA schedules differently there (jax 0.10: 1,966,080
    vs 1,835,072 temp bytes for one plan, docs/design.md#sharding), or `value_and_grad`
    inside the body with the gradients all-reduced there (`sharding.bind_axes_step`), whose
    all-reduce may hold more; all three are compiled and the one with the most temp bytes is
    returned: the figure holds for any of these steps.
    """

    def run(f: Callable[..., Any], a: Sequence[Any], spmd: bool) -> tuple[Any, float]:
        exe = compile_step(
            f, a, argnums, has_aux, figures_only=figures_only, checks=checks, batching=batching
        )
        flops = step_flops(
            exe,
            f,
            a,
            argnums,
            scan_flops=scan_flops,
            spmd=spmd,
            has_aux=has_aux,
            batching=batching,
        )
        if not spmd:  # a shard_map body: also the step that drops the loss
            alone = compile_step(
                f, a, argnums, has_aux, value=False, figures_only=True, checks=checks
            )
            if MemoryFigures.of(alone).temp_bytes > MemoryFigures.of(exe).temp_bytes:
                # its memory figures (a body's step is never run); the FLOPs stay the step's
                exe = alone
        return exe, flops

    def data_parallel() -> Any:
        # the caller's step inside the body, its gradients all-reduced there
        h, global_args = sharding.bind_axes_step(fn, manual_axes, args, argnums, has_aux)
        return compile_jitted(jax.jit(h), global_args, figures_only=True)

    if not manual_axes:
        return run(fn, args, True)
    if batching is not None:  # jremat.auto plans a vmap inside a shard_map body per example
        raise ValueError("compile_figures: batching inside a shard_map body is not supported")
    g, global_args = sharding.bind_axes(fn, manual_axes, args, has_aux)
    exe, flops = outside_trace(lambda: run(g, global_args, False))
    inner = outside_trace(data_parallel)
    if MemoryFigures.of(inner).temp_bytes > MemoryFigures.of(exe).temp_bytes:
        exe = inner  # its memory figures; the FLOPs stay the step's
    return exe, flops


def mesh_size(avals: Sequence[Any]) -> int:
    """Devices of the mesh the arguments are sharded over (1 when none is)."""
    m = sharding.arg_mesh(jax.tree_util.tree_leaves(avals))
    return 1 if m is None else int(m.size)


def xla_flops(compiled: Any) -> float:
    """FLOPs of a compiled executable: `cost_analysis()["flops"]` plus its
    `"transcendentals"` (0 when the backend reports neither).

    XLA counts transcendental ops (`exp`, `tanh`, `sin`, `log` ...) apart from "flops";
    jremat's FLOP table counts each as 1 per element, and so does this figure: without them
    a recompute of transcendental work looks free (docs/design.md#measuring)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    return float(cost.get("flops", 0.0)) + float(cost.get("transcendentals", 0.0))


def scan_flops_correction(
    fn: Callable[..., Any],
    args: Sequence[Any],
    nums: tuple[int, ...],
    has_aux: bool = False,
    batching: Batching | None = None,
):
    """FLOPs XLA's count misses because it counts each scan body once, not once per trip.

    Each scan body in the differentiated program is compiled on its own and its FLOPs are
    added (length - 1) more times (nested scans recursively). `while` loops have no static
    trip count and stay counted once.
    """
    closed_jaxpr = jax.make_jaxpr(step_grad(fn, nums, has_aux, batching=batching))(
        *step_args(args, batching)
    )
    cache: dict[int, float] = {}
    return jaxpr_scan_correction(_compat.closed(closed_jaxpr)[0], cache)


def jaxpr_scan_correction(jaxpr: Any, cache: dict[int, float]) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        for sub in _compat.subjaxprs(eqn):
            inner = jaxpr_scan_correction(sub, cache)
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


#: FLOPs of scan bodies by (backend, the body's jaxpr text), for the life of the process: the
#: candidate plans of one program share most loop bodies (the forward loop, a layer recomputed
#: under one policy), so each distinct body compiles once, not once per candidate.
_BODY_FLOPS: dict[tuple[str, str], float] = {}
_BODY_FLOPS_LOCK = threading.Lock()
_BODY_FLOPS_MAX = 4096  # entries; cleared when full


def _body_flops(body: Any, cache: dict[int, float]) -> float:
    key = id(body)
    if key not in cache:
        cache[key] = _shared_body_flops(body)
    return cache[key]


def _shared_body_flops(body: Any) -> float:
    key = (jax.default_backend(), str(body))
    with _BODY_FLOPS_LOCK:
        found = _BODY_FLOPS.get(key)
    if found is not None:
        return found
    try:
        flops = _compiled_body_flops(body)
    except Exception:  # noqa: BLE001 - e.g. a body with collectives over a shard_map's axes
        # cannot compile on its own: count it with jremat's own FLOP table instead
        flops = 0.0
    # nothing counted (no compile, or a backend that reports no FLOPs for its ops): the
    # table's count, so that recomputing the body is never free
    flops = flops or cost_model.jaxpr_flops(_compat.closed(body)[0])
    with _BODY_FLOPS_LOCK:
        if len(_BODY_FLOPS) >= _BODY_FLOPS_MAX:
            _BODY_FLOPS.clear()
        _BODY_FLOPS[key] = flops
    return flops


def _compiled_body_flops(body: Any) -> float:
    """XLA's FLOPs of one scan body compiled on its own."""
    import jax.extend.core as jc
    from jax.extend.core import jaxpr_as_fun

    jaxpr, consts = _compat.closed(body)
    closed_body = body if consts or hasattr(body, "consts") else jc.ClosedJaxpr(jaxpr, [])
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return xla_flops(compile_jitted(jax.jit(jaxpr_as_fun(closed_body)), avals, figures_only=True))


def outside_trace(thunk: Callable[[], Any]) -> Any:
    """Run `thunk` in a helper thread, whose JAX trace state is fresh (compiling in the middle
    of a `shard_map` body's trace fails); returns its result or raises its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = thunk()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="jremat-compile")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]

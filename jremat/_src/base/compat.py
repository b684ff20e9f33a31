"""Every difference between the JAX versions jremat supports (0.10.x and 0.12.x) lives here.

What differs and what was measured: docs/design.md#jax-versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

#: jax 0.10's XLA:CPU merges a checkpoint's recompute back into the forward pass (per-layer
#: remat compiles to the temp of no remat), so there segments run under
#: `rewrite.tied_checkpoint`, whose recompute depends on the incoming cotangent. Measured:
#: docs/design.md#jax-versions.
TIED_RECOMPUTE = JAX_VERSION < (0, 11)

#: Primitives whose body jremat inlines into the surrounding graph (a plain call, no semantics).
INLINE_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
#: Names the checkpoint primitive has carried.
CHECKPOINT_PRIMITIVES = frozenset({"checkpoint", "remat", "remat2"})


def bind_params(eqn: Any) -> dict[str, Any]:
    """Parameters with which `eqn.primitive.bind` re-evaluates `eqn`."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older signature: (subfuns, params)
        subfuns, params = params
        if subfuns:
            raise NotImplementedError(f"primitive {eqn.primitive.name} needs subfuns")
    return dict(params)


def bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Re-evaluate one equation on new inputs; always returns a list of outputs."""
    out = eqn.primitive.bind(*invals, **bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


def with_params(eqn: Any, params: dict[str, Any]) -> Any:
    """A stand-in for `eqn` (primitive, operands, params) with edited raw `params`."""
    attrs = {"primitive": eqn.primitive, "params": params, "invars": getattr(eqn, "invars", ())}
    return type("Eqn", (), attrs)()


def bind_params_call(eqn: Any, invals: list[Any], params: dict[str, Any]) -> list[Any]:
    """Bind `eqn`'s primitive on `invals` with `params` (raw equation params, edited)."""
    return bind(with_params(eqn, params), invals)


def subjaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs held in an equation's parameters (scan body, cond branches, ...)."""
    return list(jex_core.jaxprs_in_params(eqn.params))


def closed(jaxpr: Any) -> tuple[Any, list[Any]]:
    """Split a (possibly closed) jaxpr into its open jaxpr and its constants."""
    if hasattr(jaxpr, "consts") and hasattr(jaxpr, "jaxpr"):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def inner_call_jaxpr(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The body of an inlinable call equation (jit/closed_call), as (open jaxpr, consts)."""
    for key in ("jaxpr", "call_jaxpr"):
        if key in eqn.params:
            return closed(eqn.params[key])
    return None


def scan_partition(eqn: Any) -> tuple[int, int]:
    """(number of consts, number of carries) among a scan equation's operands."""
    params = eqn.params
    if "num_consts" in params:  # jax 0.10
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()  # 0.12
    return len(list(consts)), len(list(carry))


def scan_length(eqn: Any) -> int:
    return int(eqn.params.get("length", 1))


def aval_nbytes(aval: Any) -> int:
    """Bytes one value of abstract value `aval` occupies (`dtype_itemsize` per element: PRNG
    key arrays count their key data); 0 for a value without a dtype."""
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    size = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if dtype is None:
        return 0
    return size * dtype_itemsize(dtype)


def is_extended_dtype(dtype: Any) -> bool:
    """Whether `dtype` is one of JAX's extended dtypes (a typed PRNG key's `key<fry>`), which
    numpy does not know: `np.dtype(...)` of it, or of its name, raises TypeError. Such a dtype
    builds avals only as the dtype object itself (`jax.ShapeDtypeStruct(shape, dtype)`)."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:  # a name numpy does not know, or not a dtype at all
        return False


@functools.lru_cache(maxsize=64)
def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype` (a numpy dtype, a name, or an extended dtype object): an
    extended dtype's are those of its physical data, e.g. 8 for a threefry key (`key<fry>`,
    two uint32s: `jax.random.key_data`), 16 for an rbg key; float0 has 0.

    Raises:
      TypeError: `dtype` is neither a numpy dtype (or name) nor an extended dtype object.
    """
    if not is_extended_dtype(dtype):
        return int(np.dtype(dtype).itemsize)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    else:  # another extended dtype: its physical element (jax internals, 0.10 and 0.12)
        data = dtype._rules.physical_element_aval(dtype)
    return int(np.prod(data.shape, dtype=np.int64)) * int(np.dtype(data.dtype).itemsize)


def is_float_dtype(dtype: Any) -> bool:
    try:
        return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))
    except TypeError:
        return False


def remat3_available() -> bool:
    """Whether this jax has the `jax_remat3` upgrade flag (JAX tests its remat both ways)."""
    return "jax_remat3" in jax.config.values


def source_summary(eqn: Any) -> str:
    """'file:line (function)' of the user code that emitted `eqn`, or '' when unknown."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - source info is best effort across versions
        return ""


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    bind_eqn: Callable[[Any, list[Any]], list[Any]] | None = None,
) -> list[Any]:
    """Evaluate an open jaxpr equation by equation, each under its own source info; returns
    the flat outputs. `bind_eqn(eqn, invals) -> outputs` evaluates each equation (default
    `bind`: as traced), so a caller may rewrite some (`rewrite.remat_scan` the nested loops)."""
    run = bind if bind_eqn is None else bind_eqn
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if hasattr(v, "val") else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        with source_context(eqn):
            outs = run(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def source_context(eqn: Any) -> Any:
    """A context manager that emits equations with `eqn`'s traceback and name stack (appended
    to the current one); a no-op context where this jax has no such API."""
    try:
        from jax._src import source_info_util as siu

        info = eqn.source_info
        stack = siu.current_name_stack() + info.name_stack
        return siu.user_context(info.traceback, name_stack=stack)
    except Exception:  # noqa: BLE001 - source info is best effort across versions
        return contextlib.nullcontext()


def user_frames_of(traceback: Any) -> list[Any] | None:
    """The user frames (`file_name`, `start_line`, `function_name`) of an equation's
    `source_info.traceback`, innermost first, or None where this jax cannot say."""
    if traceback is None:
        return None
    try:
        from jax._src import source_info_util as siu

        return list(siu.user_frames(traceback))
    except Exception:  # noqa: BLE001 - source info is best effort across versions
        return None


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


#: `DebugInfo.traced_for` of the traces of loop bodies (`lax.scan`, `while_loop`, `fori_loop`).
_LOOP_BODIES = ("scan", "while", "fori")


def loop_context(flat_args: Sequence[Any]) -> str:
    """Where values are traced: "loop" (a `lax.scan`/`while_loop`/`fori_loop` body), "top"
    (concrete, or a `jit`/`grad` trace of concrete values), or "unknown" (another
    transformation's trace, e.g. `jax.checkpoint`, which may itself sit in a loop body).
    Reads JAX internals (a trace's `frame.debug_info.traced_for`); "unknown" when absent."""
    found = "top"
    for x in flat_args:
        what = _traced_for(x)
        if isinstance(what, str) and what.startswith(_LOOP_BODIES):
            return "loop"
        if what not in (None, "jit", "pjit"):
            found = "unknown"
    return found


def _traced_for(x: Any) -> str | None:
    """The `traced_for` of the jaxpr trace `x` belongs to, looking through JVP/linearize/vmap
    tracers to their primal; None for a concrete value, "?" when it cannot be told."""
    inner, known = _innermost(x)
    if not known:
        return "?"
    if not isinstance(inner, jax.core.Tracer):
        return None
    frame = inner._trace.frame
    return getattr(getattr(frame, "debug_info", None), "traced_for", None) or "?"


def _innermost(x: Any) -> tuple[Any, bool]:
    """`(v, True)`: `v` the tracer of a jaxpr trace (`jit`, a loop body; its trace has a
    `frame`) or the concrete value that `x` is or wraps, looking through JVP/linearize/vmap
    tracers to their primal (`.primal`, `.val`); `(None, False)` when a tracer wraps neither."""
    while isinstance(x, jax.core.Tracer):
        if getattr(getattr(x, "_trace", None), "frame", None) is not None:
            return x, True
        inner = getattr(x, "primal", None)
        if inner is None:
            inner = getattr(x, "val", None)
        if inner is None:
            return None, False
        x = inner
    return x, True


def _autodiff_tracer_types() -> tuple[type, ...]:
    """The tracer types of JAX's autodiff traces: `JVPTracer` (`jax.jvp`, and `jax.grad`/
    `jax.vjp` without direct linearization) and `LinearizeTracer` (`jax.grad`/`jax.vjp`/
    `jax.linearize` under `jax_use_direct_linearize`, the default from jax 0.10)."""
    from jax._src.interpreters import ad

    return tuple(t for t in (getattr(ad, n, None) for n in ("JVPTracer", "LinearizeTracer")) if t)


def is_differentiated(x: Any) -> bool:
    """Whether `x` is a float value an enclosing autodiff transformation (`jax.grad`,
    `jax.vjp`, `jax.value_and_grad`, `jax.jvp`, `jax.linearize`) differentiates: an autodiff
    tracer, or a `vmap` tracer wrapping one. False for concrete values and for tracers of
    jaxpr traces (`jit`, a loop body, `jax.checkpoint`), whose differentiation, if any, comes
    later and cannot be seen here."""
    kinds = _autodiff_tracer_types()
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, kinds):
            return is_float_dtype(getattr(x, "dtype", None))
        x = getattr(x, "val", None)  # vmap's BatchTracer: the value it batches
    return False


def batch_tracers(x: Any) -> list[tuple[Any, Any]] | None:
    """The `vmap` levels a value is batched at: `(trace, batch_dim)` for each `BatchTracer`
    found looking through `x`'s tracers (vmap's `.val`, autodiff tracers' `.primal`), the
    innermost vmap first; `batch_dim` an int, or None where that level does not map `x`. None
    where a level's batch dimension is not an int (a ragged axis): jremat cannot rebuild it.
    Reads JAX internals (`batching.BatchTracer`, jax 0.10 and 0.12 alike)."""
    from jax._src.interpreters import batching

    found: list[tuple[Any, Any]] = []
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, batching.BatchTracer):
            dim = x.batch_dim  # `batching.not_mapped` (None): this level does not map x
            if dim is not None and not isinstance(dim, int):
                return None
            found.append((x._trace, dim))
            x = x.val
            continue
        inner = getattr(x, "primal", None)
        if inner is None:
            break  # a jaxpr tracer (jit, a loop body): what it wraps is not seen
        x = inner
    return found


def batch_axis(trace: Any) -> tuple[int, Any, Any]:
    """(size, axis name or None, spmd axis name or None) of a vmap's `BatchTrace`."""
    from jax._src import core

    data = trace.axis_data
    name = None if data.name is getattr(core, "no_axis_name", None) else data.name
    return int(data.size), name, getattr(data, "spmd_name", None)


def trace_parents(trace: Any) -> list[Any]:
    """The traces `trace` is nested in (its `parent_trace` chain), innermost first; [] where
    this JAX does not say."""
    out = []
    t = getattr(trace, "parent_trace", None)
    while t is not None:
        out.append(t)
        t = getattr(t, "parent_trace", None)
    return out


def autodiff_traces(x: Any) -> list[Any]:
    """The traces of the autodiff tracers (`JVPTracer`, `LinearizeTracer`) around value `x`
    (through vmap tracers), innermost first."""
    kinds = _autodiff_tracer_types()
    found = []
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, kinds):
            found.append(x._trace)
        inner = getattr(x, "primal", None)
        x = getattr(x, "val", None) if inner is None else inner
    return found


def is_jaxpr_traced(x: Any) -> bool:
    """Whether `x` is (or wraps) a tracer of a jaxpr trace (`jit`, `scan`, ...), whose value
    and placement are unknown at trace time; False for concrete values and for JVP/linearize/
    vmap tracers of concrete values."""
    return _traced_for(x) is not None


def concrete_primal(x: Any) -> Any:
    """The concrete array a JVP/linearize/vmap tracer wraps (`x` itself when concrete); None
    when `x` is (or wraps) a jaxpr tracer."""
    inner, _ = _innermost(x)
    return None if isinstance(inner, jax.core.Tracer) else inner


def name_stack(eqn: Any) -> str:
    try:
        return str(eqn.source_info.name_stack)
    except Exception:  # noqa: BLE001
        return ""


def in_host_memory(x: Any) -> bool:
    """Whether traced value `x` lives in host memory (an offloaded residual: its aval's
    `memory_space` is `MemorySpace.Host`, jax 0.10 and 0.12 alike)."""
    space = getattr(getattr(x, "aval", None), "memory_space", None)
    return space is not None and str(space).rsplit(".", 1)[-1].lower() == "host"


def shard_map(fn: Any, mesh: Any, in_specs: Any, out_specs: Any, check: bool = True) -> Any:
    """`jax.shard_map` with (`check`) or without varying-axes checking: the keyword is
    `check_vma` in `jax.shard_map`, `check_rep` in the older `jax.experimental.shard_map`."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover - old jax

    return _sm(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def manual_axis_type(x: Any) -> Any:
    """The manual-axis type of a value traced inside a `shard_map` body (which mesh axes it
    varies over: `.varying`), or None when it varies over none. jax 0.10 and 0.12 keep it as
    `aval.mat`; the ShapeDtypeStruct keyword is `manual_axis_type`."""
    try:
        mat = getattr(jax.typeof(x), "mat", None)
    except TypeError:
        return None
    return mat if mat is not None and getattr(mat, "varying", None) else None


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes a value traced inside a `shard_map` body varies over (its type's
    `vma`: `jax.typeof(x).mat.varying` on jax 0.10 and 0.12); empty outside a body, under
    `check_vma=False` and for concrete values."""
    mat = manual_axis_type(x)
    return frozenset(mat.varying) if mat is not None else frozenset()


def aval_manual(aval: Any) -> tuple[Any, Any] | None:
    """`(manual-axis type, sharding)` of a jaxpr variable's aval traced inside a `shard_map`
    body that varies over some of its axes (`f32[8,32]{V:data}`): what a `ShapeDtypeStruct`
    standing for it needs (`shape_dtype(..., manual=..., sharding=...)`; the manual-axis
    type alone fails an assertion in tracing, jax 0.10 and 0.12). None otherwise."""
    mat = getattr(aval, "mat", None)
    if mat is None or not getattr(mat, "varying", None):
        return None
    return mat, getattr(aval, "sharding", None)


def shape_dtype(x: Any, shape: Any = None, manual: Any = None, **kw: Any) -> Any:
    """`jax.ShapeDtypeStruct` of `x`'s dtype (and shape unless given), carrying `manual` (a
    manual-axis type from `manual_axis_type`) when not None."""
    if manual is not None:
        kw["manual_axis_type"] = manual
    return jax.ShapeDtypeStruct(x.shape if shape is None else shape, x.dtype, **kw)


def residual_names(fn: Any, avals: Sequence[Any], diff: Sequence[bool]) -> set[str] | None:
    """The `checkpoint_name`s of the values `jax.vjp` of `fn` keeps as residuals, `fn`
    differentiated at the arguments `diff` marks (the others held fixed), traced abstractly
    at `avals`; None where this JAX cannot say (JAX's own `saved_residuals` reading, private:
    `jax.ad_checkpoint.print_saved_residuals` prints the same)."""
    try:
        from jax._src.ad_checkpoint import _saved_residuals
    except ImportError:  # pragma: no cover - a JAX without it: the names stay unfiltered
        return None

    def residuals(*flat: Any) -> Any:
        fixed = iter([x for x, d in zip(flat, diff, strict=True) if not d])

        def of_diff(*ds: Any) -> Any:
            it = iter(ds)
            return fn(*[next(it) if d else next(fixed) for d in diff])

        _, pullback = jax.vjp(of_diff, *[x for x, d in zip(flat, diff, strict=True) if d])
        return pullback

    closed_jaxpr, out = jax.make_jaxpr(residuals, return_shape=True)(*avals)
    jaxpr = closed_jaxpr.jaxpr
    n_res = len(jax.tree_util.tree_leaves(out))
    jaxpr = jaxpr.replace(outvars=jaxpr.outvars[len(jaxpr.outvars) - n_res :])
    found = _saved_residuals(jaxpr, [""] * len(jaxpr.invars))
    return {d.split("'")[1] for _, d in found if d.startswith("named '")}


def hlo_text_flops(text: str, executable: Any) -> float | None:
    """XLA's cost analysis ("flops" + "transcendentals") of the HLO module `text` (optimized
    HLO, as `Compiled.as_text()` prints it) on the platform of `executable` (a
    `jax.stages.Compiled`), without compiling it; None where this jaxlib cannot parse or cost
    a module (jaxlib's private `_hlo.hlo_module_from_text` and `hlo_module_cost_analysis`)."""
    try:
        from jax._src.lib import _jax, hlo

        module = hlo.hlo_module_from_text(text)
        cost = _jax.hlo_module_cost_analysis(executable.runtime_executable().client, module)
    except Exception:  # noqa: BLE001 - another jaxlib, backend or HLO dialect: not readable
        return None
    return float(cost.get("flops", 0.0)) + float(cost.get("transcendentals", 0.0))


def jaxpr_tracer(x: Any) -> Any:
    """The tracer of a jaxpr trace (`jit`, a loop body) that `x` is or wraps, looking through
    JVP/linearize/vmap tracers to their primal; None for a concrete value (or when it cannot
    be told)."""
    inner, _ = _innermost(x)
    return inner if isinstance(inner, jax.core.Tracer) else None


#: The functions whose frames hold a jit trace's inputs, by JAX file: `pjit._trace_for_jit`
#: (the caller's arguments, flattened, and `jit`'s own `in_shardings`) and
#: `partial_eval.trace_to_jaxpr` (0.10) / `trace_to_jaxpr_nocache` (0.12), which makes the
#: trace and its input tracers. The same names on both lines (docs/design.md#sharding).
_JIT_FRAME = ("pjit.py", "_trace_for_jit")
_TRACE_FRAMES = ("partial_eval.py", ("trace_to_jaxpr", "trace_to_jaxpr_nocache"))


@dataclasses.dataclass(frozen=True)
class JitTrace:
    """One `jax.jit` trace under way, read off the Python stack.

    Attributes:
      trace: the `DynamicJaxprTrace` its input tracers belong to.
      in_tracers: those tracers, one per flattened (non-static) argument.
      args: the caller's flattened arguments, in the same order: concrete arrays, NumPy
        values, `ShapeDtypeStruct`s (`.lower`/`.trace`), or tracers of an enclosing trace.
      in_shardings: `jit`'s own `in_shardings`, flattened; a leaf `jit` was not given one is
        not a `jax.sharding.Sharding`.
    """

    trace: Any
    in_tracers: tuple[Any, ...]
    args: tuple[Any, ...]
    in_shardings: tuple[Any, ...]


def _frame_is(frame: Any, file: str, names: Any) -> bool:
    code = frame.f_code
    names = (names,) if isinstance(names, str) else names
    return code.co_name in names and code.co_filename.endswith(file)


def jit_traces() -> list[JitTrace]:
    """The `jax.jit` traces the current call runs inside, innermost first ([] outside any, or
    where JAX's frames do not have the expected form: `jit_frames_readable` tells the two
    apart)."""
    import sys

    out: list[JitTrace] = []
    pending = None  # the innermost trace frame not yet matched with its jit frame
    frame = sys._getframe(1)
    while frame is not None:
        if _frame_is(frame, *_TRACE_FRAMES):
            pending = frame
        elif _frame_is(frame, *_JIT_FRAME) and pending is not None:
            loc, tloc = frame.f_locals, pending.f_locals
            try:
                args = loc["args_ft"]
                out.append(
                    JitTrace(
                        trace=tloc["trace"],
                        in_tracers=tuple(getattr(tloc["in_tracers"], "vals", tloc["in_tracers"])),
                        args=tuple(getattr(args, "vals", args)),
                        in_shardings=tuple(loc["in_shardings_flat"]),
                    )
                )
            except (KeyError, TypeError):
                return []
            pending = None
        frame = frame.f_back
    return [t for t in out if len(t.in_tracers) == len(t.args) == len(t.in_shardings)]


@functools.lru_cache(maxsize=1)
def jit_frames_readable() -> bool:
    """Whether `jit_traces` reads this JAX's `jit` frames: a probe traced once per process
    (`jax.jit(probe, in_shardings=...).trace(...)`, no compile, ~2 ms) must find its own trace,
    its input tracers, its arguments and `jit`'s `in_shardings` entry. False where JAX renamed
    or reshaped those frames (docs/design.md#sharding): then no placement read off them holds.

    Runs in a helper thread, whose trace state and mesh context are JAX's defaults (JAX keeps
    both per thread), so the probe is the same wherever the first call comes from: inside a
    caller's `jit`, a `shard_map` body or under `jax.set_mesh`.
    """
    import threading

    found: list[bool] = []

    def check() -> None:
        seen: list[Any] = []

        def probe(x: Any, y: Any) -> Any:
            seen.append((x, y, jit_traces()))
            return x

        given = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        a = jax.ShapeDtypeStruct((2,), np.float32)
        b = jax.ShapeDtypeStruct((3,), np.int32)
        try:
            jax.jit(probe, in_shardings=(given, None)).trace(a, b)
        except Exception:  # noqa: BLE001 - a JAX where the probe itself fails: not readable
            found.append(False)
            return
        ok = len(seen) == 1 and bool(seen[0][2])
        if ok:
            x, y, traces = seen[0]
            t = traces[0]  # the innermost: the probe's own
            ok = (
                t.trace is getattr(x, "_trace", None)
                and len(t.in_tracers) == 2
                and t.in_tracers[0] is x
                and t.in_tracers[1] is y
                and t.args[0] is a
                and t.args[1] is b
                and t.in_shardings[0] == given  # equal: JAX may hand back a cached equal one
                and not isinstance(t.in_shardings[1], jax.sharding.Sharding)
            )
        found.append(bool(ok))

    thread = threading.Thread(target=check, name="jremat-jit-frames-probe")
    thread.start()
    thread.join()
    return bool(found and found[0])

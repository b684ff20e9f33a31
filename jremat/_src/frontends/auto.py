"""`jremat.auto`: plan on first call per argument signature, then run the rematerialized fn.

One decorator for a loss function, a Flax linen Module class or method (`flax_linen.py`) and
an `nnx.Module` class or a function of NNX modules (`flax_nnx.py`), told apart without
importing Flax. Targets, and what a budget means for a block: docs/design.md#flax-blocks.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jremat._src.base import compat as _compat
from jremat._src.base.args import normalize_argnums
from jremat._src.base.batching import Batching, UnsupportedBatching, batching_of
from jremat._src.base.budget import BudgetLike
from jremat._src.base.sharding import check_known, leaf_sharding, manual_axes, shard_args
from jremat._src.frontends.blocks import is_disabled
from jremat._src.frontends.cache import PlanCache
from jremat._src.frontends.options import AutoOptions
from jremat._src.plan.plan import Plan
from jremat._src.plan.rewrite import (
    check_replayable,
    graph_function,
    holds_tracers,
    rematerialize,
)
from jremat._src.trace.graph import Graph, build_graph, signature


def auto(
    fn: Any = None,
    *,
    budget: BudgetLike = 0.5,
    solver: str | None = None,
    argnums: int | Sequence[int] | None = None,
    verify: bool = True,
    prevent_cse: bool = True,
    max_rounds: int = 4,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    methods: Any = None,
    variables: Any = True,
    rngs: Any = True,
    plan_dir: str | os.PathLike | bool | None = None,
    in_shardings: Any = None,
    mesh: Any = None,
    offload: Any = None,
    has_aux: bool = False,
    compile_budget: int | str | None = "auto",
) -> Any:
    """Rematerialize a function or a Flax module automatically under a memory budget.

    Wrap a loss function (or decorate a Flax block) and call it as usual, under `jax.grad`,
    `jax.jit` or an optimizer step: on the first call for each argument shape/dtype signature
    it plans (`jremat.plan`, which compiles and verifies), then runs the rematerialized
    program; later calls with the same signature reuse the plan, and a new batch size or
    sequence length plans again. Works as `jremat.auto(target, budget=...)`,
    `@jremat.auto(budget=...)` and `@jremat.auto`. It may be called inside `jit`/`grad`/
    `nn.scan`/`nnx.scan`: planning uses the arguments' shapes only.

    Targets:
      * a function returning a scalar floating-point loss (positional array arguments);
      * a linen `nn.Module` class (`jremat.auto(Block, budget=0.4)`, or as a class decorator)
        or a linen method (`@jremat.auto(budget=0.4)` above `@nn.compact def __call__`): the
        keywords of `nn.remat` apply. The result keeps the class name, so parameter paths are
        those of the undecorated module (`Block_0`, not `CheckpointBlock_0`);
      * an `nnx.Module` class, or a function taking NNX modules: the keywords of `nnx.remat`
        apply; RNG streams and batch-norm state advance exactly as without remat.
    For a Flax block the budget bounds what the block keeps from its forward to its backward
    pass (see Notes). `init` is never planned.

    Examples:
      >>> import jax, jax.numpy as jnp, jremat
      >>> def loss(ws, x):  # a 4-layer MLP
      ...     for w in ws:
      ...         x = jnp.tanh(x @ w)
      ...     return jnp.mean(x**2)
      >>> ws, x = [jnp.full((64, 64), 0.01)] * 4, jnp.ones((128, 64))
      >>> remat_loss = jremat.auto(loss, budget=0.9)  # 90% of the temp bytes without remat
      >>> grads = jax.jit(jax.grad(remat_loss))(ws, x)  # plans on this first call
      >>> [g.shape for g in grads], len(remat_loss.plans)
      ([(64, 64), (64, 64), (64, 64), (64, 64)], 1)

    Args:
      fn: the target (above); None to get a decorator.
      budget: a `jremat.BudgetLike`: a float in (0, 1] (fraction of the unrematerialized
        compiled temp bytes), an int (footprint bytes), a string such as "512MiB", or "auto":
        the device's free memory (`memory_stats()` on GPU/TPU, the host's available memory
        from psutil on CPU), read when a signature is first planned. Default 0.5. Under
        `jax.vmap` and on sharded arguments, see Notes for what a fraction is of.
      solver: the planner (see `jremat.plan`); None (default) uses `jremat.plan`'s default.
      argnums: the differentiated arguments of a plain loss function, as in `jax.grad`.
        None (default): the arguments the caller differentiates (those `jax.grad`/`jax.vjp`/
        `jax.value_and_grad` around the call trace), planned per such set; 0 where nothing
        around the call differentiates it (an eager call; `jax.grad(jax.jit(step))`, where
        `jit` traces the call before `grad` differentiates it).
        Given, it must match what the caller differentiates (else a ValueError at the call;
        arguments holding values of a jit/loop trace inside the caller's grad may be added).
        Flax blocks differentiate all their float variables and inputs.
      verify: compile and check each plan against the budget (default True). With False,
        nothing is compiled for a Flax block: below budget 1 it gets the one checkpoint that
        keeps only its inputs (as `nn.remat`); a loss function gets the cost model's plan.
      prevent_cse: passed to `jax.checkpoint` (keep True outside scans; False inside
        `nn.scan`/`nnx.scan` bodies, as for `nn.remat`). Plans are verified with True; False
        is honoured only where the call is traced inside a loop body (or where that cannot be
        told): at the top level it would let XLA undo the plan, so True runs there, with a
        `RuntimeWarning`.
      max_rounds: compiles verification may spend per signature.
      static_argnums: Flax targets: positions of static (hashable, specialised-on) arguments,
        counted as `nn.remat`/`nnx.remat` count them: for a module or method, `self` is 0.
        Bool, int and string arguments are static without it. A plain loss function needs
        none: a positional bool, Python int, string or other non-array argument (the caller's
        own `jax.jit(..., static_argnums=...)`) is closed over and planned per value.
      static_argnames: Flax targets: names of static arguments (honoured, unlike in
        `jax.checkpoint`, which ignores them; names and positions complete each other).
      methods: linen/NNX classes: the methods to transform (default `["__call__"]`).
      variables: linen: the variable collections lifted (as `nn.remat`; default all).
      rngs: linen: the PRNG sequences lifted (as `nn.remat`; default all).
      plan_dir: a folder for saved plans, loaded instead of solved when a later run meets the
        same key (see Notes). None (default): `$JREMAT_PLAN_CACHE`, else
        `~/.cache/jremat/plans` (under `$XDG_CACHE_HOME` when set); False, or
        `JREMAT_PLAN_CACHE=0`: no plans on disk.
      in_shardings: plain loss functions: the shardings the arguments run under, as in
        `jax.jit` (a `NamedSharding`/`PartitionSpec` for all, or a tuple of pytree prefixes,
        one per argument). Needed inside `jax.jit` on more than one device in JAX's default
        (Auto) sharding mode (see Notes); `PartitionSpec()` states "not sharded".
      mesh: the mesh `PartitionSpec`s in `in_shardings` refer to: a `jax.sharding.Mesh` (or
        `AbstractMesh`), or None (default: `jax.set_mesh`'s). As in `jremat.plan`, it shards
        nothing by itself (a `RuntimeWarning` at the first call says so when nothing refers
        to it).
      offload: host offload as in `jremat.plan`: None (default) never offloads; True or a
        `jremat.OffloadCost(host_bandwidth=bytes/s, device_flops=FLOP/s)` lets segments move
        residuals to pinned host memory where the transfer is cheaper than recomputing.
      has_aux: loss functions, plain or of NNX modules (Flax's `loss_fn(params, rngs)`):
        `fn` returns a pair `(loss, aux)`, aux any pytree of arrays (metrics, updated batch
        statistics), for `jax.value_and_grad(..., has_aux=True)`; the step planned and
        verified is `jit(value_and_grad(fn, has_aux=True))`, which computes both, and the
        plan is checked on the `jit(grad)` step that drops the aux too. Default False (then a
        returned pair raises a TypeError naming `has_aux`). Flax modules (classes, linen
        methods) return any outputs already and refuse it.
      compile_budget: whole-program compiles one signature's search may spend, verification
        included (`jremat.plan`'s `compile_budget`: "auto", the default, 6 for a plain loss;
        an int >= 3, 5 with `has_aux`; or None for no limit); the cheapest plan verified
        when it runs out is used. "auto" does not cap a Flax block class's searches (a
        block's programs are small), an int does.

    Returns:
      For a function, the wrapped function: `wrapper.plans` maps each key (signature,
      static arguments, differentiated argnums) to its `Plan` (plain loss functions) and
      `wrapper.plan_cache` is its `PlanCache`. For a Module class, a subclass of the same
      name with `plan_cache` as a class attribute.

    Raises:
      TypeError: the target is neither a function nor a Flax Module class (a Module instance,
        another class, a non-callable); for a linen instance the error is also Flax's
        `TransformTargetError`, as with `nn.remat`.
      TypeError: `offload` is not None, a bool or a `jremat.OffloadCost`; `mesh` is not a
        Mesh or None; `in_shardings` is not one of its accepted forms (checked here, before
        any call; whether it matches the arguments is checked at the first call).
      TypeError: `verify` or `has_aux` is not a bool, or `max_rounds` not an int, or
        `compile_budget` not an int, "auto" or None (a bool included); `has_aux=True` for a
        Flax target (at decoration, or at the first call of a function of modules).
      ValueError: an invalid budget or solver; `max_rounds` below 1; static_argnums out of
        range, naming `self`, or naming a parameter that received an unhashable value (the
        message names the argument and how `self` is counted).
      InfeasibleBudgetError: at the first call of a signature whose budget is unreachable.
      ValueError: at the first call inside `jax.jit` on sharded (Auto mode) tracers without
        `in_shardings` (above).
      ValueError: at a call that differentiates other arguments than the `argnums` given.
      TypeError: at a call with a non-array argument that is unhashable, or at `argnums`;
        at the first call of a signature, when `fn` does not return a scalar float loss (with
        `has_aux`, a pair whose first element is one).

    Notes:
      **Under `jax.vmap`** (per-example gradients, `jax.vmap(jax.grad(loss))`, nested vmaps,
      any `in_axes`, unbatched arguments, `vmap(value_and_grad)`, or `grad` of a vmapped
      mean), the plan is made on `fn`'s per-example program but chosen, verified and budgeted
      on the step that runs: the caller's vmaps, with their batch sizes and axes (read from
      the arguments' batch tracers), around `value_and_grad` (a vmap inside the gradient: the
      gradient of the batch's summed loss). A fraction is then of that vmapped step's
      unrematerialized temp bytes, and a new batch size or batch axis is a new plan. Not
      seen, and planned per example: a vmap around a `jit` that `auto` runs inside
      (`jax.vmap(jax.jit(jax.grad(f)))`: `jit` traces `f` at one example's shapes); a vmap
      inside a `shard_map` body, over sharded arguments or along a ragged axis, and Flax
      targets called under `nn.vmap`/`nnx.vmap`/`jax.vmap` (their block budget is one
      example's) get a `RuntimeWarning` naming the batch size and what to do.

      **Flax blocks.** A Flax block is planned as the function (variables, inputs) ->
      outputs, and its budget bounds what the block *keeps from its forward to its backward
      pass* (what accumulates over a stack of blocks), measured on compiled programs: a
      fraction is of the unrematerialized block's kept bytes, bytes cap them (see
      [design.md#flax-blocks](../design.md#flax-blocks)).

      **Sharding.** `in_shardings` is needed when `fn` is called inside `jax.jit` in JAX's
      default (Auto) sharding mode on more than one device, where the tracers do not say how
      they are sharded: without it the first call raises a ValueError rather than plan for a
      guess. Sharded concrete arrays (also under `jax.grad` without jit) and explicit-mode
      tracers (`jax.sharding.AxisType.Explicit`) carry theirs. Budgets are then per device: a
      fraction is of the unrematerialized per-device temp bytes, bytes cap one device's
      footprint. Inside a `shard_map` body nothing is needed: the body's values are per
      device already.

      **The plan cache.** Each plan is written to `plan_dir` as JSON, keyed by a stable hash
      of the signature, shardings, budget, solver, program fingerprint, backend and
      jax/jremat versions, and loaded instead of solved when a later run meets the same key
      (the wrapper's `plan_cache`; [design.md#flax-blocks](../design.md#flax-blocks), "The plan
      cache").
    """
    options = AutoOptions(
        budget=budget,
        solver=solver,
        argnums=argnums,
        verify=verify,
        prevent_cse=prevent_cse,
        max_rounds=max_rounds,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        methods=methods,
        variables=variables,
        rngs=rngs,
        plan_dir=plan_dir,
        in_shardings=in_shardings,
        mesh=mesh,
        offload=offload,
        has_aux=has_aux,
        compile_budget=compile_budget,
    )
    if fn is None:
        return functools.partial(_auto_target, options=options)
    return _auto_target(fn, options)


def _auto_target(fn: Any, options: AutoOptions) -> Any:
    """`jremat.auto` on one target, under options already checked."""
    kind = _target_kind(fn)
    if kind != "function":
        _refuse_aux_for_flax(options, fn)
    cache = options.plan_cache()
    if kind == "linen_class":
        from jremat._src.frontends.flax_linen import auto_linen_class

        return auto_linen_class(fn, options, cache)
    if kind == "nnx_class":
        from jremat._src.frontends.flax_nnx import auto_nnx_class

        return auto_nnx_class(fn, options, cache)
    return _auto_function(fn, options, cache)


def _target_kind(target: Any) -> str:
    """'linen_class', 'nnx_class' or 'function'; TypeError for anything else."""
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if linen is not None:
        from jremat._src.frontends.flax_linen import AutoTargetError, is_module, is_module_class

        if is_module_class(target):
            return "linen_class"
        if is_module(target):
            raise AutoTargetError(target)
    if nnx is not None:
        from jremat._src.frontends.flax_nnx import is_module, is_module_class

        if is_module_class(target):
            return "nnx_class"
        if is_module(target):
            raise TypeError(
                f"jremat.auto decorates an nnx.Module class or a function taking modules; got "
                f"the module instance {type(target).__name__}(...). Decorate the class "
                f"(jremat.auto({type(target).__name__}, budget=...)) or a function "
                "(jremat.auto(lambda model, x: model(x), budget=...)), as with nnx.remat."
            )
    if isinstance(target, type):
        raise TypeError(
            f"jremat.auto decorates a function, a Flax linen Module class or an nnx.Module "
            f"class; got the class {target.__qualname__}, which is neither a linen nor an NNX "
            "Module (is Flax imported, and does it subclass nn.Module / nnx.Module?)."
        )
    if not callable(target):
        raise TypeError(
            "jremat.auto decorates a function, a Flax linen Module class or an nnx.Module "
            f"class; got {type(target).__name__} {target!r}, which is not callable."
        )
    return "function"


def _auto_function(
    fn: Callable[..., Any], options: AutoOptions, cache: PlanCache
) -> Callable[..., Any]:
    plans: dict[Any, Any] = {}
    runners: dict[Any, Callable[..., Any]] = {}
    lock = threading.Lock()
    flax_state: dict[str, Any] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        linen = sys.modules.get("flax.linen")
        if linen is not None and args and isinstance(args[0], linen.Module):
            from jremat._src.frontends.flax_linen import linen_method_call

            _refuse_aux_for_flax(options, fn)
            _warn_flax_vmap(fn, (args, kwargs))
            return linen_method_call(fn, options, cache, flax_state)(*args, **kwargs)
        if sys.modules.get("flax.nnx") is not None:
            from jremat._src.frontends.flax_nnx import has_graph_node, make_caller

            if has_graph_node((args, kwargs)):
                _warn_flax_vmap(fn, (args, kwargs))
                if "nnx" not in flax_state:
                    flax_state["nnx"] = make_caller(fn, options, cache, self_counted=_is_method(fn))
                return flax_state["nnx"](*args, **kwargs)
        if is_disabled():  # jremat.disabled(): the function as written, nothing planned
            return fn(*args, **kwargs)
        if kwargs or options.static_argnums or options.static_argnames:
            raise TypeError(
                f"{getattr(fn, '__name__', 'fn')} is planned as a plain loss function of "
                "positional array arguments (no linen or NNX module among its arguments), which "
                "takes no keyword or static arguments; close over static values with "
                "functools.partial."
            )
        argnums = _planned_argnums(fn, args, options.argnums)
        static = _static_positions(fn, args, argnums)
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        statics = tuple((i, args[i]) for i in static)
        nums = _shift_argnums(argnums, static, len(args))
        # the caller's vmaps (sizes, batch axes): the step that runs is batched under them
        batching = _batching(fn, dyn, nums)
        # another set of differentiated arguments is another backward pass: another plan
        key = (signature(dyn), statics, nums, batching)
        with lock:
            if key not in runners:
                # static arguments (strings, bools, other non-array values: the caller's
                # static_argnums) are closed over, as the caller's own jit does
                f = _bind_static(fn, statics, len(args)) if statics else fn
                in_shardings = _drop_static(options.in_shardings, static)
                avals = shard_args(dyn, in_shardings, options.mesh)
                check_known(dyn, avals, in_shardings)
                batching = _checked_batching(fn, batching, dyn)
                # the one trace of fn at this signature: keyed, planned and run from it
                graph = build_graph(f, avals, nums)
                check_replayable(graph, getattr(fn, "__name__", "fn"))
                p = cache.get(
                    graph, f, avals, argnums=nums, has_aux=options.has_aux, batching=batching
                )
                plans[key] = p
                runners[key] = _runner(f, graph, p, options)
        return runners[key](*dyn)

    wrapper.plans = plans  # type: ignore[attr-defined]
    wrapper.plan_cache = cache  # type: ignore[attr-defined]
    # As linen method, the lifted transform manages Module state itself (as `nn.remat`'s
    # wrapper does): this marker keeps Flax from wrapping it a second time.
    wrapper.method_handler_wrapped = True  # type: ignore[attr-defined]
    return wrapper


def _batching(fn: Any, dyn: Sequence[Any], nums: tuple[int, ...]) -> Batching | None:
    """The vmaps around the call (`base.batching.batching_of`); None when none, or, with a
    `RuntimeWarning`, where a batch dimension cannot be rebuilt (then planned per example)."""
    try:
        return batching_of(dyn, nums)
    except UnsupportedBatching as e:
        warnings.warn(
            f"jremat.auto: {getattr(fn, '__name__', 'fn')} is called under jax.vmap, but {e}; "
            "its plan is chosen and verified for one example, and the vmapped step that runs "
            "may exceed the budget. Call it on the batched arguments instead (a loss over the "
            "batch), or check the vmapped step's temp with jremat.measure.",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )
        return None


def _checked_batching(fn: Any, batching: Batching | None, args: Sequence[Any]) -> Any:
    """`batching`, or None with a `RuntimeWarning` where jremat cannot compile the batched
    step: inside a `shard_map` body, or over sharded arguments (`args`, the call's own: the
    batched step would need the batched arrays' shardings, which it does not carry)."""
    if batching is None:
        return None
    why = None
    if manual_axes():
        why = "inside a shard_map body"
    elif any(
        leaf_sharding(x, per_example=False) is not None for x in jax.tree_util.tree_leaves(args)
    ):
        why = "over sharded arguments"
    if why is None:
        return batching
    warnings.warn(
        f"jremat.auto: {getattr(fn, '__name__', 'fn')} is called under {batching.describe()} "
        f"{why}, where jremat does not compile the batched step: the plan is chosen and "
        f"verified for one example, while the step that runs holds {batching.batch_size} "
        "examples and may exceed the budget. Call it on the batched arguments instead (a "
        "loss over the batch), or check the vmapped step's temp with jremat.measure.",
        RuntimeWarning,
        stacklevel=_user_stacklevel(),
    )
    return None


def _warn_flax_vmap(fn: Any, args: Any) -> None:
    """A `RuntimeWarning` where a Flax target is called under a vmap (`nn.vmap`, `nnx.vmap`,
    `jax.vmap`): its block budget is planned and verified per example."""
    sizes = []
    for x in jax.tree_util.tree_leaves(args):
        found = _compat.batch_tracers(x) if _compat.is_tracer(x) else []
        if found:
            sizes = [_compat.batch_axis(t)[0] for t, _ in reversed(found)]
            break
    if sizes:
        warnings.warn(
            f"jremat.auto: the Flax target {getattr(fn, '__qualname__', fn)} is called under "
            f"a vmap of batch size {' x '.join(map(str, sizes))} (nn.vmap/nnx.vmap/jax.vmap), "
            "which jremat does not plan for a Flax block: its budget is planned and verified "
            "for one example, and the vmapped block keeps about that many times more. Decorate "
            "the vmapped module instead (jremat.auto(nn.vmap(Block, ...))), or give a byte "
            "budget for one example divided by the batch size.",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )


def _user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel of the first frame outside jremat and JAX."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    jax_dir = os.path.dirname(os.path.abspath(jax.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        (here + os.sep, jax_dir + os.sep)
    ):
        frame, level = frame.f_back, level + 1
    return level


def _refuse_aux_for_flax(options: AutoOptions, target: Any) -> None:
    """A Flax module is planned by what it keeps whatever it returns: `has_aux` means nothing
    there, and is refused rather than ignored (a function of NNX modules takes it: a loss)."""
    if options.has_aux:
        raise TypeError(
            f"has_aux=True applies to loss functions; {getattr(target, '__name__', target)}"
            " is a Flax module, whose outputs may be any pytree already. Drop has_aux, and "
            "pass has_aux=True to jax.value_and_grad as usual."
        )


def is_static_arg(a: Any) -> bool:
    """A positional argument traced as a constant: a bool, a Python int, a string, or any value
    with a leaf that is neither an array nor a Python number. A concrete bool or int reaching
    `auto` is what the caller's `jax.jit(..., static_argnums=...)` (or an eager call) gives,
    and the function may use it in Python control flow or as a slice bound; under the
    caller's jit without static_argnums it arrives as a tracer and stays one. Python floats
    and ints inside pytrees trace as arrays, as in jit."""
    if isinstance(a, (bool, np.bool_, int)):
        return True
    leaves = jax.tree_util.tree_leaves(a)
    return any(
        isinstance(x, (bool, np.bool_))
        or not (isinstance(x, (int, float, complex)) or hasattr(x, "shape") and hasattr(x, "dtype"))
        for x in leaves
    )


def _planned_argnums(fn: Any, args: Sequence[Any], argnums: Any) -> Any:
    """The arguments whose backward pass is planned: those the caller differentiates (the
    arguments holding autodiff tracers, `compat.is_differentiated`) when `argnums` was not
    given, else `argnums`; 0 when nothing around the call differentiates (an eager or forward
    call, or one traced inside `jit`/a loop body/`jax.checkpoint`, where differentiation, if
    any, comes later and cannot be seen).

    Raises:
      ValueError: `argnums` was given and the caller differentiates other arguments: the
        backward pass that would run keeps other residuals than the one verified. A given
        argument holding values of a jit/loop trace is not one of those: its
        differentiation, if any, cannot be seen.
    """
    seen = tuple(
        i
        for i, a in enumerate(args)
        if any(_compat.is_differentiated(x) for x in jax.tree_util.tree_leaves(a))
    )
    if argnums is None:
        return seen or 0
    given = set(normalize_argnums(argnums, len(args)))
    # a given argument not seen differentiated may still be: a value of a jit/loop trace
    # opened inside the caller's grad (`grad(lambda w: jit(lambda x: f(w, x))(g(w)))`)
    hidden = {
        i
        for i in given - set(seen)
        if any(
            _compat.is_jaxpr_traced(x) and _compat.is_float_dtype(getattr(x, "dtype", None))
            for x in jax.tree_util.tree_leaves(args[i])
        )
    }
    if seen and set(seen) != given - hidden:
        name = getattr(fn, "__name__", "fn")
        raise ValueError(
            f"{name} was given argnums={argnums!r}, but the caller differentiates it with "
            f"respect to argument(s) {seen} (the jax.grad/jax.vjp/jax.value_and_grad around "
            "it): that backward pass keeps other residuals than the one jremat would plan and "
            f"verify. Pass argnums={seen if len(seen) > 1 else seen[0]!r} to jremat.auto, or "
            "leave argnums out to plan for the arguments the caller differentiates."
        )
    return argnums


def _static_positions(fn: Any, args: Sequence[Any], argnums: Any) -> tuple[int, ...]:
    """Positions of `args` that are static (`is_static_arg`).

    Raises:
      TypeError: a static argument is unhashable, or is a differentiated one (argnums).
    """
    static = tuple(i for i, a in enumerate(args) if is_static_arg(a))
    name = getattr(fn, "__name__", "fn")
    diff = set(argnums if isinstance(argnums, (tuple, list)) else (argnums,))
    for i in static:
        if i in diff or i - len(args) in diff:
            raise TypeError(
                f"argument {i} of {name} ({type(args[i]).__name__} {args[i]!r:.60}) is "
                f"differentiated (argnums={argnums!r}) but is not an array: pass float arrays "
                "there, or set argnums to the parameters' position."
            )
        try:
            hash(args[i])
        except TypeError:
            raise TypeError(
                f"argument {i} of {name} is {type(args[i]).__name__} {args[i]!r:.60}, which is "
                "neither an array nor hashable: jremat traces non-array arguments as constants "
                "(as jax.jit's static_argnums). Pass arrays, a hashable value, or close over it "
                "with functools.partial."
            ) from None
    return static


def _bind_static(fn: Any, statics: tuple, nargs: int) -> Callable[..., Any]:
    """`fn` of its non-static positional arguments, the static ones fixed."""
    fixed = dict(statics)

    @functools.wraps(fn)
    def bound(*dyn: Any) -> Any:
        it = iter(dyn)
        return fn(*[fixed[i] if i in fixed else next(it) for i in range(nargs)])

    return bound


def _drop_static(in_shardings: Any, static: tuple[int, ...]) -> Any:
    if not static or not isinstance(in_shardings, (tuple, list)):
        return in_shardings
    return tuple(s for i, s in enumerate(in_shardings) if i not in static)


def _shift_argnums(argnums: Any, static: tuple[int, ...], nargs: int) -> tuple[int, ...]:
    """`argnums` (checked against all `nargs` arguments) renumbered without `static`."""
    nums = normalize_argnums(argnums, nargs)
    return tuple(a - sum(1 for i in static if i < a) for a in nums)


def _runner(
    fn: Callable[..., Any], graph: Graph, plan: Plan, options: AutoOptions
) -> Callable[..., Any]:
    """`fn` under `plan`, run from `graph` (the program the plan was made for) without tracing
    `fn` again. Through `rematerialize` (which traces each call) when the arguments were given
    shardings (`in_shardings`/`mesh`: the call's own tracers may not carry them) or `graph`
    captured tracers of an enclosing transformation (valid in that trace only)."""
    prevent_cse = options.prevent_cse
    if (
        plan.is_identity
        or options.in_shardings is not None
        or options.mesh is not None
        or holds_tracers(graph)
    ):
        return rematerialize(fn, plan, prevent_cse=prevent_cse)
    plan.validate()
    return graph_function(graph, plan, prevent_cse=prevent_cse)


def _is_method(fn: Callable[..., Any]) -> bool:
    """Whether `fn` looks like a method (first parameter named `self`): positions then count
    `self` as 0, as `nnx.remat` does on an unbound method."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "self"

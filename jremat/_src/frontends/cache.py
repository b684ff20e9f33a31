"""`PlanCache`: the plans of one `jremat.auto` target, keyed by program signature and budget,
in memory and on disk (`plan_dir=`, by default `default_plan_dir()`), so that a restarted job
finds its plans without compiling candidates (docs/design.md#flax-blocks, "The plan cache").

How a Flax block is planned and what its budget bounds: docs/design.md#flax-blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jremat._src.base.args import abstract_args, check_compile_budget, check_count, check_flag
from jremat._src.base.batching import Batching
from jremat._src.base.budget import Budget, BudgetLike, parse_budget
from jremat._src.base.targets import args_device
from jremat._src.plan.offload import parse_offload
from jremat._src.plan.plan import Plan
from jremat._src.plan.rewrite import check_value_ids
from jremat._src.search.blocks import plan_block
from jremat._src.search.solve import check_solver, plan
from jremat._src.trace.graph import Graph, signature

logger = logging.getLogger(__name__)

#: Environment variable naming the default plan cache folder; "0", "off", "false" or "none"
#: (any case), or empty, turn the default cache off.
PLAN_CACHE_ENV = "JREMAT_PLAN_CACHE"
_OFF = ("", "0", "off", "false", "no", "none")


def default_plan_dir() -> Path | None:
    """The plan cache folder `jremat.auto` uses when `plan_dir` is not given: the value of
    `$JREMAT_PLAN_CACHE` when set (None when it is "0"/"off"/"false"/"none"/empty: no disk
    cache), else `$XDG_CACHE_HOME/jremat/plans`, else `~/.cache/jremat/plans`."""
    env = os.environ.get(PLAN_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jremat" / "plans"


def resolve_plan_dir(plan_dir: Any) -> Path | None:
    """A `plan_dir=` argument as a folder: None (default) -> `default_plan_dir()`; False ->
    None (no disk cache); a str or os.PathLike -> that folder.

    Raises:
      TypeError: anything else; the message names `plan_dir` and the accepted forms.
    """
    if plan_dir is None:
        return default_plan_dir()
    if plan_dir is False:
        return None
    if isinstance(plan_dir, (str, os.PathLike)) and not isinstance(plan_dir, bool):
        return Path(plan_dir).expanduser()
    raise TypeError(
        "plan_dir must be a folder (str or os.PathLike), None (the default plan cache, "
        f"${PLAN_CACHE_ENV} or ~/.cache/jremat/plans) or False (no plan cache on disk); got "
        f"{type(plan_dir).__name__} {plan_dir!r}"
    )


class PlanCache:
    """Plans of one decorated function or module, keyed by program signature and budget.

    The in-memory key and the file name of a saved plan are a SHA-256 of: the description of
    the planned program's argument `Signature` (shapes, dtypes, weak types), its shardings, the
    program's `Graph.fingerprint` (its values and wiring), the budget as given (`"auto"` stays
    `"auto"`, so a saved plan is reused whatever memory is free), the solver, `verify` and
    `offload`. A new batch size or sequence length is a new signature, so it is planned anew.

    Args:
      budget: as `jremat.plan`, or a `Budget` parsed from it (parsed here once; `"auto"` is
        read again at each solve).
      solver: the planner name, or None for `jremat.plan`'s default.
      verify: compile and check each plan against the budget.
      max_rounds: verification compiles per signature.
      plan_dir: a folder: each plan is saved there as `jremat-<key>.json` (`Plan.save`,
        written atomically) and a later run with the same key loads it instead of solving.
        None (default): `default_plan_dir()` (`$JREMAT_PLAN_CACHE`, else
        `$XDG_CACHE_HOME/jremat/plans`, else `~/.cache/jremat/plans`); False: plans kept in
        memory only.
        A saved file that cannot be read, or was made for another program, is ignored with a
        `RuntimeWarning` naming it, and the plan is solved again and saved over it.
      offload: host offload, as `jremat.plan`'s `offload` (None: never offload).
      compile_budget: whole-program compiles one plan's search may spend, as
        `jremat.plan`'s `compile_budget` ("auto", the default; None: no limit).

    Attributes:
      plans: key -> `Plan`, in the order first seen.
      signatures: key -> a readable description of the signature (shapes and dtypes).
      solves, loads: how many plans were solved, and loaded from `plan_dir`.

    Raises:
      ValueError: an invalid budget or solver; `max_rounds` below 1.
      TypeError: `offload` is not None, a bool or a `jremat.OffloadCost`; `verify` is not a
        bool; `max_rounds` is not an int or `compile_budget` not an int, "auto" or None (a
        bool included); `plan_dir` not a folder, None or False.
    """

    def __init__(
        self,
        budget: BudgetLike,
        *,
        solver: str | None = None,
        verify: bool = True,
        max_rounds: int = 4,
        plan_dir: str | os.PathLike | bool | None = None,
        offload: Any = None,
        compile_budget: int | str | None = "auto",
    ):
        self._spec = parse_budget(budget)
        self.offload = parse_offload(offload)
        check_solver(solver, none_ok=True)
        self.budget = budget.raw if isinstance(budget, Budget) else budget
        self.solver = solver
        self.verify = check_flag("verify", verify)
        self.max_rounds = check_count("max_rounds", max_rounds)
        self.compile_budget = check_compile_budget(compile_budget)
        self.plan_dir = resolve_plan_dir(plan_dir)
        self.plans: dict[str, Plan] = {}
        self.signatures: dict[str, str] = {}
        self.solves = 0
        self.loads = 0
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (
            f"PlanCache(budget={self.budget!r}, solver={self.solver!r}, plans={len(self.plans)}, "
            f"solves={self.solves}, loads={self.loads}, plan_dir={self.plan_dir})"
        )

    # -- keys -----------------------------------------------------------------------------
    def key(
        self,
        graph: Graph,
        args: Sequence[Any],
        kind: str = "function",
        batching: Batching | None = None,
    ) -> tuple[str, str]:
        """(key, readable signature) of a program; stable across processes, different for
        another backend, jax or jremat version (whose compiled figures may differ), and for
        other vmaps around the call (`batching`: batch sizes and axes)."""
        signed = signature(args)
        sig, shard_key = signed.description, signed.sharding
        if batching is not None:
            sig = f"{sig} under {batching.describe()}"
        payload = json.dumps(
            {
                "kind": kind,
                "signature": sig,
                "fingerprint": graph.fingerprint,
                # which arguments are differentiated (argnums): another backward program
                "differentiated": list(map(bool, graph.diff_invars)),
                "budget": repr(self.budget),
                "solver": self.solver,
                "verify": bool(self.verify),
                "versions": _versions(),
                # the platform and device kind compiled for: a TPU topology's plan is not a
                # CPU plan of the same shapes and mesh axes
                "target": _target(args),
                **({"offload": repr(self.offload)} if self.offload is not None else {}),
                # a smaller compile budget may settle on another plan
                **(
                    {"compile_budget": self.compile_budget}
                    if self.compile_budget is not None
                    else {}
                ),
                **({"sharding": repr(shard_key)} if shard_key else {}),
                **({"vmap": _vmap_key(batching)} if batching is not None else {}),
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:24], sig

    def path(self, key: str) -> Path | None:
        """Where the plan of `key` is saved (None without `plan_dir`)."""
        return None if self.plan_dir is None else self.plan_dir / f"jremat-{key}.json"

    # -- lookup / solve ------------------------------------------------------------------
    def get(
        self,
        graph: Graph,
        fn: Callable[..., Any],
        args: Sequence[Any],
        argnums: int | Sequence[int] = 0,
        ct_mask: Sequence[bool] | None = None,
        has_aux: bool = False,
        batching: Batching | None = None,
    ) -> Plan:
        """The plan for `graph` (the traced `fn(*args)`): cached, loaded or solved.

        Args:
          graph: `build_graph(fn, args)`: the program's one trace, keyed (its fingerprint),
            checked against a saved plan and planned on (passed to `jremat.plan`) as it is.
          fn: the function the plan is for: a scalar loss, or (with `ct_mask`) a block
            `f(diff, rest)` from `block_fn`.
          args: its arguments (arrays, tracers or avals; only shapes and dtypes are used).
          argnums: differentiated arguments of a loss.
          ct_mask: for a block, which flat outputs a training step differentiates (the
            module's outputs, not its updated collections); see docs/design.md#flax-blocks.
          has_aux: a loss `fn` returns `(loss, aux)` (`jremat.plan`'s `has_aux`).
          batching: the caller's vmaps around a loss (`jremat.plan`'s `batching`): part of
            the key, and the step the plan is verified on.

        Raises:
          InfeasibleBudgetError, and the other errors of `jremat.plan`, unchanged.
        """
        avals = abstract_args(args)
        key, sig = self.key(graph, avals, "function" if ct_mask is None else "block", batching)
        with self._lock:
            if key in self.plans:
                return self.plans[key]
            p = self._load(key, graph)
            if p is None:
                # parsed once in __init__; "auto" is read again: free memory now
                spec = parse_budget(self.budget) if self._spec.is_auto else self._spec
                opts: dict[str, Any] = {} if self.solver is None else {"solver": self.solver}
                if self.offload is not None:
                    opts["offload"] = self.offload
                opts["compile_budget"] = self.compile_budget
                if ct_mask is None:
                    p = plan(
                        fn,
                        *avals,
                        budget=spec,
                        graph=graph,  # traced once per signature: not again to plan
                        argnums=argnums,
                        has_aux=has_aux,
                        batching=batching,
                        verify=self.verify,
                        max_rounds=self.max_rounds,
                        **opts,
                    )
                else:
                    p = plan_block(
                        fn,
                        graph,
                        avals,
                        ct_mask,
                        spec,
                        verify=self.verify,
                        max_rounds=self.max_rounds,
                        **opts,
                    )
                p.budget = _jsonable(self.budget)
                p.notes.append(f"signature: {sig}")
                self.solves += 1
                self._save(key, p)
            self.plans[key] = p
            self.signatures[key] = sig
            return p

    def _load(self, key: str, graph: Graph) -> Plan | None:
        path = self.path(key)
        if path is None or not path.exists():
            return None
        try:
            p = Plan.load(path)  # a ValueError names the file and the field
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            warnings.warn(
                f"jremat: saved plan {path} cannot be read ({type(e).__name__}: {e}); "
                "solving again and overwriting it",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        if p.fingerprint != graph.fingerprint or p.num_nodes != graph.num_nodes:
            warnings.warn(
                f"jremat: saved plan {path} was made for program {p.fingerprint} "
                f"({p.num_nodes} equations), not {graph.fingerprint} ({graph.num_nodes}); "
                "solving again and overwriting it",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        try:  # a file edited or damaged in a field the loader cannot judge alone
            check_value_ids(graph, p)
        except ValueError as e:
            warnings.warn(
                f"jremat: saved plan {path} does not fit its program ({e}); "
                "solving again and overwriting it",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        self.loads += 1
        logger.info("loaded the plan from %s (no planning compiles)", path)
        # the same program may sit in another file, or at other lines of the same one: the
        # segments' sources are this process's
        return p.annotate(graph)

    def _save(self, key: str, p: Plan) -> None:
        path = self.path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # a new file of mode 0o666 under the umask (0o644 with the usual 0o022), readable
            # as JAX's compilation cache is (tempfile.mkstemp would make it 0o600); a unique
            # name per writer, so concurrent runs never write the same temporary file
            tmp = path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(p.to_json())
                os.replace(tmp, path)  # atomic: concurrent runs never read a half-written plan
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:  # a read-only or full disk: the plan is still used, not saved
            warnings.warn(
                f"jremat: cannot save the plan to {path} ({e}); it is used but not saved",
                RuntimeWarning,
                stacklevel=3,
            )


def _vmap_key(batching: Batching) -> list:
    """The vmaps of a key, stable across processes (an axis name by its repr)."""
    return [
        [lv.size, list(lv.in_dims), lv.outside_grad, repr(lv.axis_name), repr(lv.spmd_axis_name)]
        for lv in batching.levels
    ]


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


def _target(args: Sequence[Any]) -> str:
    """The platform and device kind `args` compile for (`base.targets.args_device`)."""
    try:
        device = args_device(args)
    except ValueError:  # arguments over different meshes: planning raises that itself
        return "mixed"
    return f"{device.platform}:{getattr(device, 'device_kind', '')}"


def _versions() -> str:
    """Backend, jax and jremat versions: what a saved plan's compiled figures depend on."""
    import jax

    # the package's own attribute (installed metadata may be stale in an editable install);
    # read from sys.modules: the root package is not a layer this module may import
    version = getattr(sys.modules.get("jremat"), "__version__", "unknown")
    return f"{jax.default_backend()} jax {jax.__version__} jremat {version}"

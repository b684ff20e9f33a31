"""`PlanCache`: the plans of one `jremat.auto` target, keyed by program signature and budget,
in memory and optionally on disk (`plan_dir=`).

How a Flax block is planned and what its budget bounds: docs/design.md#flax-blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jremat._src.base.args import abstract_args, check_count, check_flag
from jremat._src.base.budget import Budget, parse_budget
from jremat._src.plan.offload import parse_offload
from jremat._src.plan.plan import Plan
from jremat._src.search.blocks import plan_block
from jremat._src.search.solve import check_solver, plan
from jremat._src.trace.graph import Graph, signature


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
      plan_dir: a folder; when set, each plan is saved there as `jremat-<key>.json`
        (`Plan.save`) and a later run with the same key loads it instead of solving.
      offload: host offload, as `jremat.plan`'s `offload` (None: never offload).

    Attributes:
      plans: key -> `Plan`, in the order first seen.
      signatures: key -> a readable description of the signature (shapes and dtypes).
      solves, loads: how many plans were solved, and loaded from `plan_dir`.

    Raises:
      ValueError: an invalid budget or solver; `max_rounds` below 1.
      TypeError: `offload` is not None, a bool or a `jremat.OffloadCost`; `verify` is not a
        bool; `max_rounds` is not an int (a bool included).
    """

    def __init__(
        self,
        budget: Any,
        *,
        solver: str | None = None,
        verify: bool = True,
        max_rounds: int = 4,
        plan_dir: str | os.PathLike | None = None,
        offload: Any = None,
    ):
        self._spec = parse_budget(budget)
        self.offload = parse_offload(offload)
        check_solver(solver, none_ok=True)
        self.budget = budget.raw if isinstance(budget, Budget) else budget
        self.solver = solver
        self.verify = check_flag("verify", verify)
        self.max_rounds = check_count("max_rounds", max_rounds)
        self.plan_dir = Path(plan_dir) if plan_dir is not None else None
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
    def key(self, graph: Graph, args: Sequence[Any], kind: str = "function") -> tuple[str, str]:
        """(key, readable signature) of a program; stable across processes."""
        signed = signature(args)
        sig, shard_key = signed.description, signed.sharding
        payload = json.dumps(
            {
                "kind": kind,
                "signature": sig,
                "fingerprint": graph.fingerprint,
                "budget": repr(self.budget),
                "solver": self.solver,
                "verify": bool(self.verify),
                **({"offload": repr(self.offload)} if self.offload is not None else {}),
                **({"sharding": repr(shard_key)} if shard_key else {}),
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

        Raises:
          InfeasibleBudgetError, and the other errors of `jremat.plan`, unchanged.
        """
        avals = abstract_args(args)
        key, sig = self.key(graph, avals, "function" if ct_mask is None else "block")
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
                if ct_mask is None:
                    p = plan(
                        fn,
                        *avals,
                        budget=spec,
                        graph=graph,  # traced once per signature: not again to plan
                        argnums=argnums,
                        has_aux=has_aux,
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
        except (OSError, ValueError, UnicodeDecodeError) as e:
            warnings.warn(
                f"jremat: saved plan {path} cannot be read ({e}); solving again and overwriting it",
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
        self.loads += 1
        return p

    def _save(self, key: str, p: Plan) -> None:
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".jremat-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(p.to_json())
        os.replace(tmp, path)  # atomic: concurrent runs never read a half-written plan


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)

"""`AutoOptions`: the keywords of `jremat.auto`, checked once and passed by value.

Its own module so that the Flax frontends (`flax_linen`, `flax_nnx`) read the record without
importing `jremat.auto`'s module (which imports them lazily).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from jremat._src.base.args import check_compile_budget, check_count, check_flag
from jremat._src.base.budget import parse_budget
from jremat._src.base.sharding import check_in_shardings, check_mesh
from jremat._src.frontends.cache import PlanCache
from jremat._src.plan.offload import parse_offload
from jremat._src.search.solve import check_solver


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """The keywords of `jremat.auto`, with its defaults; see `jremat.auto` for each one.

    Values are kept as the caller gave them (`static_argnums` an int or a sequence), so
    messages that quote a keyword quote what was passed; the budget is parsed once into a
    `Budget` (which keeps the caller's value as `raw`). Building one
    checks the keywords that need no target (`__post_init__`), in the order `jremat.auto`
    always checked them; the target-dependent ones (`static_argnums` against a signature,
    `methods` against a class, `variables`/`rngs` for NNX) are checked where the target is
    known.

    Raises:
      ValueError: an invalid budget or solver; `max_rounds` or `compile_budget` below 1
        (a `compile_budget` below what verification needs on the traced program is
        raised at the first call, where the program is known).
      TypeError: `verify` or `has_aux` not a bool; `max_rounds` not an int, `compile_budget`
        not an int, "auto" or None (a bool included);
        `mesh` not a Mesh or None; `in_shardings` not one of its accepted forms; `offload`
        not None, a bool or a `jremat.OffloadCost`.
    """

    budget: Any = 0.5
    solver: str | None = None
    argnums: int | Sequence[int] | None = None
    verify: bool = True
    prevent_cse: bool = True
    max_rounds: int = 4
    static_argnums: int | Sequence[int] = ()
    static_argnames: str | Sequence[str] = ()
    methods: Any = None
    variables: Any = True
    rngs: Any = True
    plan_dir: str | os.PathLike | bool | None = None
    in_shardings: Any = None
    mesh: Any = None
    offload: Any = None
    has_aux: bool = False
    compile_budget: int | str | None = "auto"

    def __post_init__(self) -> None:
        # parsed once: the decorator form, PlanCache and jremat.plan take the Budget as it is
        object.__setattr__(self, "budget", parse_budget(self.budget))
        check_solver(self.solver, none_ok=True)
        check_flag("verify", self.verify)
        check_flag("has_aux", self.has_aux)
        check_count("max_rounds", self.max_rounds)
        check_compile_budget(self.compile_budget)
        check_mesh(self.mesh)
        check_in_shardings(self.in_shardings)
        parse_offload(self.offload)

    def plan_cache(self) -> PlanCache:
        """A new, empty `PlanCache` for one decorated target, under these options."""
        return PlanCache(
            self.budget,
            solver=self.solver,
            verify=self.verify,
            max_rounds=self.max_rounds,
            plan_dir=self.plan_dir,
            offload=self.offload,
            compile_budget=self.compile_budget,
        )

"""Exceptions raised by jremat."""

from __future__ import annotations


class InfeasibleBudgetError(ValueError):
    """The budget is below the smallest memory jremat's plans reach on this program (the
    plans it compiles whatever the budget; XLA's temp is not monotone in what a plan saves,
    so another plan may compile a little lower: [troubleshooting.md](../troubleshooting.md)).

    Attributes:
      budget: the budget the caller asked for, in the caller's unit.
      smallest_reachable: the smallest budget that holds, in the caller's unit (a fraction of the
        unrematerialized temp bytes when the budget was a fraction, else footprint bytes).
      smallest_reachable_bytes: the compiled temp bytes of the smallest-memory plan (not a
        footprint: pass `smallest_reachable` back as the budget); 0 where nothing can be
        rematerialized, and the cost model's estimate under `verify=False`.
    """

    def __init__(self, message: str, *, budget, smallest_reachable, smallest_reachable_bytes: int):
        super().__init__(message)
        self.budget = budget
        self.smallest_reachable = smallest_reachable
        self.smallest_reachable_bytes = smallest_reachable_bytes


class PlanMismatchError(ValueError):
    """A plan was made for another program (other shapes, dtypes or equations)."""


class UnsupportedBackendError(RuntimeError):
    """A program was compiled for a platform whose memory figures jremat cannot read (not in
    `jremat.MEMORY_FIGURES`): no plan is made on a figure that may not move with the plan.
    Plan for CPU, GPU or TPU ([guides/tpu.md](../guides/tpu.md)), or run the function without
    jremat."""
